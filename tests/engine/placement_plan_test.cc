// The placement plan on the released config: which mode each machine gets, that every layer is
// placed once and in order, that the bytes add up to the tensors the config implies, and that a
// machine too small is refused with the numbers.
#include "engine/placement_plan.h"

#include <boost/test/unit_test.hpp>

#include "engine/model_info.h"
#include "tests/support/temp_dir.h"

namespace flashd::engine {
namespace {

const ModelConfig& Released() {
  static const ModelConfig c = [] {
    auto config = LoadModelConfig(FLASHD_TEST_DATA_DIR "/deepseek-v4.1-flash/config.json");
    BOOST_REQUIRE_MESSAGE(config.ok(), config.status().ToString());
    return *config;
  }();
  return c;
}

PlanOptions Machine(const std::string& gpus, uint64_t host_gib) {
  PlanOptions o;
  auto parsed = ParseGpus(gpus);
  BOOST_REQUIRE_MESSAGE(parsed.ok(), parsed.status().ToString());
  o.gpus = *parsed;
  o.host_ram_bytes = host_gib << 30;
  return o;
}

// Layers go to GPUs in order, each GPU a contiguous run; the weights add up.
void CheckLayout(const PlacementPlan& p, const PlanOptions& o) {
  BOOST_REQUIRE(p.layer_gpu.size() == static_cast<size_t>(Released().num_hidden_layers));
  for (size_t l = 1; l < p.layer_gpu.size(); ++l) {
    BOOST_TEST(p.layer_gpu[l] >= p.layer_gpu[l - 1]);
    BOOST_TEST(p.layer_gpu[l] <= p.layer_gpu[l - 1] + 1);
  }
  uint64_t weights = p.host_weights;
  for (size_t g = 0; g < p.gpus.size(); ++g) {
    weights += p.gpus[g].weights;
    BOOST_TEST(p.gpus[g].weights + p.gpus[g].kv + p.gpus[g].reserve <= o.gpus[g].memory_bytes);
  }
  // Everything but the Engram tables, as held (BF16 as fp32): more than the layers alone.
  BOOST_TEST(weights > p.dense_bytes + p.expert_bytes);
  BOOST_TEST(weights < p.dense_bytes + p.expert_bytes + (uint64_t{8} << 30));
}

BOOST_AUTO_TEST_SUITE(placement_plan)

BOOST_AUTO_TEST_CASE(gpu_specs_parse_and_bad_ones_are_named) {
  auto eight = ParseGpus("8xH200");
  BOOST_REQUIRE(eight.ok());
  BOOST_TEST(eight->size() == 8u);
  BOOST_TEST((*eight)[0].memory_bytes == 141000000000ull);
  auto sized = ParseGpus("2x96GiB");
  BOOST_REQUIRE(sized.ok());
  BOOST_TEST((*sized)[1].memory_bytes == (uint64_t{96} << 30));
  BOOST_TEST(ParseGpus("none")->empty());
  auto bad = ParseGpus("3xTPU");
  BOOST_TEST(!bad.ok());
  BOOST_TEST(testing::Contains(bad.status().message(), "TPU"));
  BOOST_TEST(!ParseGpus("0xH200").ok());
}

BOOST_AUTO_TEST_CASE(released_model_on_the_machines_users_have) {
  const ModelStats stats = ComputeModelStats(Released());
  // Eight or four H200: every layer on the GPUs, split evenly, Engram in host memory.
  for (const char* gpus : {"8xH200", "4xH200", "8xMI300X"}) {
    const PlanOptions o = Machine(gpus, 512);
    const PlacementPlan p = MakePlan(Released(), o);
    BOOST_TEST_CONTEXT(gpus) {
      BOOST_TEST(p.fits, p.why_not);
      BOOST_TEST((p.mode == PlacementPlan::Mode::kGpu));
      BOOST_TEST(p.layer_gpu.front() == 0);
      BOOST_TEST(p.layer_gpu.back() == static_cast<int>(o.gpus.size()) - 1);
      BOOST_TEST(p.host_weights == 0u);
      BOOST_TEST(p.kv_bytes_per_token == stats.kv_bytes_per_token);
      BOOST_TEST(p.sequences >= 1);
      CheckLayout(p, o);
    }
  }
  // One H200 beside 512 GiB: the hybrid mode, experts in host memory.
  const PlanOptions one = Machine("1xH200", 512);
  const PlacementPlan hybrid = MakePlan(Released(), one);
  BOOST_TEST(hybrid.fits, hybrid.why_not);
  BOOST_TEST((hybrid.mode == PlacementPlan::Mode::kHybrid));
  BOOST_TEST(hybrid.host_weights == hybrid.expert_bytes);
  CheckLayout(hybrid, one);
  // More KV room with more GPUs.
  BOOST_TEST(MakePlan(Released(), Machine("8xH200", 512)).kv_tokens >
             MakePlan(Released(), Machine("4xH200", 512)).kv_tokens);
  // A CPU server with 1 TiB: everything in host memory, the rest for KV.
  const PlacementPlan cpu = MakePlan(Released(), Machine("none", 1024));
  BOOST_TEST(cpu.fits, cpu.why_not);
  BOOST_TEST((cpu.mode == PlacementPlan::Mode::kCpu));
  BOOST_TEST(cpu.host_kv > 0u);
  BOOST_TEST(std::count(cpu.layer_gpu.begin(), cpu.layer_gpu.end(), -1) ==
             Released().num_hidden_layers);
}

BOOST_AUTO_TEST_CASE(a_machine_too_small_is_refused_with_the_numbers) {
  const PlacementPlan p = MakePlan(Released(), Machine("1xH200", 128));
  BOOST_TEST(!p.fits);
  BOOST_TEST(testing::Contains(p.why_not, "host memory"), p.why_not);
  BOOST_TEST(testing::Contains(p.why_not, "GiB is usable"), p.why_not);
  const PlacementPlan cpu = MakePlan(Released(), Machine("none", 256));
  BOOST_TEST(!cpu.fits);
  const std::string text = DescribePlan(cpu, Machine("none", 256));
  BOOST_TEST(testing::Contains(text, "does not fit"), text);
  BOOST_TEST(testing::Contains(PlanJson(cpu), "\"fits\":false"));
}

// With the Engram tables on SSD only their cache counts in host memory: a machine too small for
// the tables fits, and the refusal says where they could go.
BOOST_AUTO_TEST_CASE(engram_tables_on_ssd_leave_only_their_cache_in_memory) {
  PlanOptions o = Machine("1xH200", 384);
  const PlacementPlan in_memory = MakePlan(Released(), o);
  BOOST_TEST(!in_memory.fits);
  BOOST_TEST(testing::Contains(in_memory.why_not, "--engram-ssd"), in_memory.why_not);
  o.engram_ssd_cache_bytes = int64_t{4} << 30;
  const PlacementPlan on_ssd = MakePlan(Released(), o);
  BOOST_TEST(on_ssd.fits, on_ssd.why_not);
  BOOST_TEST(on_ssd.engram_on_ssd);
  BOOST_TEST(on_ssd.engram_host_bytes == uint64_t{4} << 30);
  BOOST_TEST(on_ssd.engram_bytes == in_memory.engram_bytes);
  BOOST_TEST(in_memory.engram_host_bytes == in_memory.engram_bytes);
  const std::string text = DescribePlan(on_ssd, o);
  BOOST_TEST(testing::Contains(text, "(tables on SSD)"), text);
  // The model line still gives the tables' size, not the cache's.
  auto model_line = [](const std::string& t) {
    const size_t at = t.find("model:");
    return t.substr(at, t.find('\n', at) - at);
  };
  BOOST_TEST(model_line(text) == model_line(DescribePlan(in_memory, o)));
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
