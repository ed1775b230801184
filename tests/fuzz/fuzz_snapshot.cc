// Snapshot values (a sequence's bounded state, docs/formats.md) restored into the golden
// model's KV pool: every length, count and index is checked before it is used.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "engine/forward.h"
#include "engine/model.h"

using namespace flashd::engine;

namespace {
const CpuForward& Forward() {
  static std::unique_ptr<Model> model = [] {
    auto m = Model::Load(FLASHD_GOLDEN_DIR);
    if (!m.ok()) __builtin_trap();
    return std::move(*m);
  }();
  static std::unique_ptr<CpuForward> fwd = [] {
    auto f = CpuForward::Create(*model);
    if (!f.ok()) __builtin_trap();
    return std::move(*f);
  }();
  return *fwd;
}

// A real snapshot to start mutating from: a few tokens' state.
const std::string& Seed() {
  static const std::string seed = [] {
    SequenceState s = Forward().NewSequence();
    std::vector<float> logits;
    const std::vector<int32_t> tokens = {0, 5, 9, 77, 120, 3, 44, 8, 19, 201, 33, 7};
    if (!Forward().Forward(&s, tokens, &logits).ok()) __builtin_trap();
    return s.Serialize();
  }();
  return seed;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  std::string mixed;
  if (size > 0 && data[0] == 0xA5) {
    // The seed snapshot with the input's bytes written over part of it.
    mixed = Seed();
    const size_t at = size > 3 ? (data[1] << 8 | data[2]) % mixed.size() : 0;
    for (size_t i = 3; i < size && at + i - 3 < mixed.size(); ++i) mixed[at + i - 3] = data[i];
    in = mixed;
  }
  (void)Forward().Restore(in);
  return 0;
}
