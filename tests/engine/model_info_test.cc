#include "engine/model_info.h"

#include <boost/test/unit_test.hpp>
#include <cmath>

namespace flashd::engine {
namespace {

const char* kReleasedConfig = FLASHD_TEST_DATA_DIR "/deepseek-v4.1-flash/config.json";

BOOST_AUTO_TEST_SUITE(model_info)

BOOST_AUTO_TEST_CASE(released_config_kv_is_890_bytes_per_token) {
  StatusOr<ModelConfig> c = LoadModelConfig(kReleasedConfig);
  BOOST_REQUIRE(c.ok());
  ModelStats s = ComputeModelStats(*c);
  // 3 ratio-2 sources and 1 ratio-1 source, each (288 + 68) bytes per entry.
  BOOST_TEST(s.kv_bytes_per_token == 890.0);
  BOOST_REQUIRE(s.kv_sources.size() == 4u);
  BOOST_TEST(s.kv_sources[0].entry_bytes == 288u);     // 512/2 FP4 + 512/16 E4M3 scales
  BOOST_TEST(s.kv_sources[0].index_key_bytes == 68u);  // 128/2 FP4 + 128/32 E8M0 scales
  BOOST_TEST(s.kv_sources[3].layer == 20);
  BOOST_TEST(s.kv_sources[3].bytes_per_token == 356.0);
}

BOOST_AUTO_TEST_CASE(released_parameter_totals_explain_the_public_figures) {
  StatusOr<ModelConfig> c = LoadModelConfig(kReleasedConfig);
  BOOST_REQUIRE(c.ok());
  ModelStats s = ComputeModelStats(*c);
  // Engram exactly: both tables (rows x 256), both wkv projections (25600 x 6144), and the
  // q/k weights (2 x 4 x 5120 per layer).
  const uint64_t tables = (384006168ull + 384016682ull) * 256;
  const uint64_t engram = tables + 2 * (25600ull * 6144) + 2 * (2 * 4 * 5120ull);
  BOOST_TEST(s.params_engram == engram);
  // Public figures: 552B backbone (+196B Engram), ~16B active at decode, ~8B at prefill.
  BOOST_TEST(std::fabs(s.params_backbone / 1e9 - 552.0) < 1.0, s.params_backbone);
  BOOST_TEST(std::fabs(s.params_engram / 1e9 - 196.9) < 0.1, s.params_engram);
  BOOST_TEST(std::fabs(s.params_active_decode / 1e9 - 16.0) < 0.5, s.params_active_decode);
  BOOST_TEST(std::fabs(s.params_active_prefill / 1e9 - 8.0) < 0.5, s.params_active_prefill);
  BOOST_TEST(s.last_kv_source_layer == 20);
  BOOST_TEST(s.params_active_prefill < s.params_active_prefill_full);
  BOOST_TEST(s.params_active_prefill_full < s.params_active_decode);
}

BOOST_AUTO_TEST_CASE(released_layout_accounts_for_every_checkpoint_byte) {
  StatusOr<ModelConfig> c = LoadModelConfig(kReleasedConfig);
  BOOST_REQUIRE(c.ok());
  ModelStats s = ComputeModelStats(*c);
  // The release's tensors hold 510,286,023,000 bytes (sum over its 48 shard headers). The
  // layout here, plus the vision tower in BF16 from its estimate, must account for them.
  const double published = 510286023000.0;
  const double ours = double(s.checkpoint_bytes) + 2.0 * double(s.params_vision);
  BOOST_TEST(std::fabs(ours - published) / published < 1e-6, ours);
  BOOST_TEST(s.checkpoint_bytes_by_dtype.count("I8") == 1u);  // FP4 experts as packed I8.
  // Per-sequence state: 40 rings of 128 FP8 rows of 512 (+16 scale bytes), 3 ratio-2
  // compressors (2 slots x 512 fp32, kv and score), fp32 logits over 129,280 ids.
  BOOST_TEST(s.window_ring_bytes == 40u * 128 * (512 + 16));
  BOOST_TEST(s.compressor_state_bytes == 3u * 2 * 2 * 512 * 4);
  BOOST_TEST(s.logits_bytes == 129280u * 4);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
