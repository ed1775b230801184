// SequenceState: block references, copy-on-write rows, forks and snapshots. The snapshot format
// is documented in docs/formats.md; bump kVersion on change.
#include "engine/sequence_state.h"

#include <cstring>

namespace flashd::engine {
namespace {

constexpr char kMagic[4] = {'F', 'L', 'S', 'Q'};
// 4: KV blocks are planar (engine/kv_pool.h).
constexpr uint32_t kVersion = 5;

class Writer {
 public:
  void U32(uint32_t v) { Raw(&v, 4); }
  void I64(int64_t v) { Raw(&v, 8); }
  template <typename T>
  void Vec(const std::vector<T>& v) {
    I64(static_cast<int64_t>(v.size()));
    Raw(v.data(), v.size() * sizeof(T));
  }
  void Raw(const void* p, size_t n) { out.append(static_cast<const char*>(p), n); }
  std::string out;
};

class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  bool U32(uint32_t* v) { return Raw(v, 4); }
  bool I64(int64_t* v) { return Raw(v, 8); }
  template <typename T>
  bool Vec(std::vector<T>* v) {
    int64_t n;
    if (!I64(&n) || n < 0 || static_cast<uint64_t>(n) > (in_.size() - pos_) / sizeof(T)) {
      return false;
    }
    v->resize(static_cast<size_t>(n));
    return Raw(v->data(), v->size() * sizeof(T));
  }
  bool Raw(void* p, size_t n) {
    if (n > in_.size() - pos_) return false;
    if (n == 0) return true;  // An empty vector's data() may be null, which memcpy must not get.
    std::memcpy(p, in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  std::string_view in_;
  size_t pos_ = 0;
};

}  // namespace

SequenceState::SequenceState(SequenceState&& o) noexcept { *this = std::move(o); }

SequenceState& SequenceState::operator=(SequenceState&& o) noexcept {
  if (this == &o) return *this;
  if (pool) {
    for (int32_t b : blocks) pool->Unref(b);
  }
  position = o.position;
  rings = std::move(o.rings);
  sources = std::move(o.sources);
  engram_classes = std::move(o.engram_classes);
  pool = std::move(o.pool);
  layout = std::move(o.layout);
  blocks = std::move(o.blocks);
  frozen_tokens = o.frozen_tokens;
  o.blocks.clear();
  o.pool.reset();
  return *this;
}

SequenceState::~SequenceState() {
  if (pool) {
    for (int32_t b : blocks) pool->Unref(b);
  }
}

SequenceState SequenceState::Fork() const {
  SequenceState s;
  s.position = position;
  s.rings = rings;
  s.sources = sources;
  s.engram_classes = engram_classes;
  s.pool = pool;
  s.layout = layout;
  s.blocks = blocks;
  s.frozen_tokens = frozen_tokens;
  for (int32_t b : s.blocks) pool->Ref(b);
  return s;
}

std::string SequenceState::Serialize(size_t first_block) const {
  first_block = std::min(first_block, blocks.size());
  Writer w;
  w.Raw(kMagic, 4);
  w.U32(kVersion);
  w.I64(position);
  w.I64(static_cast<int64_t>(rings.size()));
  for (const Ring& r : rings) {
    w.Vec(r.codes);
    w.Vec(r.scales);
  }
  w.I64(static_cast<int64_t>(sources.size()));
  for (const Compressor& s : sources) {
    w.Vec(s.kv_partial);
    w.Vec(s.score_partial);
    w.I64(s.entries);
  }
  w.Vec(engram_classes);
  w.I64(frozen_tokens);
  w.I64(static_cast<int64_t>(layout ? layout->block_bytes : 0));
  w.I64(static_cast<int64_t>(first_block));
  w.I64(static_cast<int64_t>(blocks.size() - first_block));
  for (size_t b = first_block; b < blocks.size(); ++b) {
    w.Raw(pool->data(blocks[b]), pool->block_bytes());
  }
  return w.out;
}

// Reads a snapshot into blocks of `pool`; used by CpuForward::Restore.
StatusOr<SequenceState> RestoreSequence(std::string_view bytes, std::shared_ptr<KvPool> pool,
                                        std::shared_ptr<const KvBlockLayout> layout,
                                        std::vector<int32_t> leading_blocks) {
  // The state owns the leading blocks from here on, so every failure below gives them back.
  SequenceState s;
  s.pool = pool;
  s.layout = layout;
  s.blocks = std::move(leading_blocks);
  Reader r(bytes);
  char magic[4];
  uint32_t version = 0;
  if (!r.Raw(magic, 4) || std::memcmp(magic, kMagic, 4) != 0) {
    return DataLoss("sequence snapshot: bad magic (not a flashd sequence snapshot)");
  }
  if (!r.U32(&version) || version != kVersion) {
    return DataLoss("sequence snapshot: format version " + std::to_string(version) +
                    ", this build reads version " + std::to_string(kVersion));
  }
  int64_t n = 0;
  bool ok = r.I64(&s.position) && r.I64(&n) && n >= 0 && n < (1 << 20);
  if (ok) s.rings.resize(static_cast<size_t>(n));
  for (size_t i = 0; ok && i < s.rings.size(); ++i) {
    ok = r.Vec(&s.rings[i].codes) && r.Vec(&s.rings[i].scales);
  }
  ok = ok && r.I64(&n) && n >= 0 && n < (1 << 20);
  if (ok) s.sources.resize(static_cast<size_t>(n));
  for (size_t i = 0; ok && i < s.sources.size(); ++i) {
    SequenceState::Compressor& src = s.sources[i];
    ok = r.Vec(&src.kv_partial) && r.Vec(&src.score_partial) && r.I64(&src.entries);
  }
  int64_t block_bytes = 0, first = 0, count = 0;
  ok = ok && r.Vec(&s.engram_classes) && r.I64(&s.frozen_tokens) && r.I64(&block_bytes) &&
       r.I64(&first) && r.I64(&count) && count >= 0;
  if (!ok) return DataLoss("sequence snapshot: truncated or corrupt");
  if (static_cast<size_t>(block_bytes) != layout->block_bytes) {
    return DataLoss("sequence snapshot: blocks of " + std::to_string(block_bytes) +
                    " bytes, this model's are " + std::to_string(layout->block_bytes));
  }
  if (static_cast<size_t>(first) != s.blocks.size()) {
    return DataLoss("sequence snapshot: starts at block " + std::to_string(first) + ", given " +
                    std::to_string(s.blocks.size()) + " leading blocks");
  }
  for (int64_t b = 0; b < count; ++b) {
    const int32_t id = pool->Allocate();
    if (id < 0) return ResourceExhausted("KV pool full while restoring a snapshot");
    s.blocks.push_back(id);
    if (!r.Raw(pool->mutable_data(id), pool->block_bytes())) {
      return DataLoss("sequence snapshot: truncated or corrupt");
    }
  }
  if (!r.done()) return DataLoss("sequence snapshot: trailing bytes");
  return s;
}

}  // namespace flashd::engine
