// SequenceState snapshots: the format is documented in docs/formats.md; bump kVersion on change.
#include <cstring>

#include "engine/forward.h"

namespace flashd::engine {
namespace {

constexpr char kMagic[4] = {'F', 'L', 'S', 'Q'};
constexpr uint32_t kVersion = 1;

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
    if (!I64(&n) || n < 0 || static_cast<uint64_t>(n) > (in_.size() - pos_) / sizeof(T))
      return false;
    v->resize(static_cast<size_t>(n));
    return Raw(v->data(), v->size() * sizeof(T));
  }
  bool Raw(void* p, size_t n) {
    if (n > in_.size() - pos_) return false;
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

std::string SequenceState::Serialize() const {
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
  for (const Source& s : sources) {
    w.Vec(s.kv_partial);
    w.Vec(s.score_partial);
    w.Vec(s.kv_packed);
    w.Vec(s.kv_scales);
    w.Vec(s.key_packed);
    w.Vec(s.key_scales);
    w.I64(s.entries);
  }
  w.Vec(engram_classes);
  return w.out;
}

StatusOr<SequenceState> SequenceState::Deserialize(std::string_view bytes) {
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
  SequenceState s;
  int64_t n = 0;
  bool ok = r.I64(&s.position) && r.I64(&n) && n >= 0 && n < (1 << 20);
  if (ok) s.rings.resize(static_cast<size_t>(n));
  for (size_t i = 0; ok && i < s.rings.size(); ++i) {
    ok = r.Vec(&s.rings[i].codes) && r.Vec(&s.rings[i].scales);
  }
  ok = ok && r.I64(&n) && n >= 0 && n < (1 << 20);
  if (ok) s.sources.resize(static_cast<size_t>(n));
  for (size_t i = 0; ok && i < s.sources.size(); ++i) {
    Source& src = s.sources[i];
    ok = r.Vec(&src.kv_partial) && r.Vec(&src.score_partial) && r.Vec(&src.kv_packed) &&
         r.Vec(&src.kv_scales) && r.Vec(&src.key_packed) && r.Vec(&src.key_scales) &&
         r.I64(&src.entries);
  }
  ok = ok && r.Vec(&s.engram_classes) && r.done();
  if (!ok) return DataLoss("sequence snapshot: truncated or corrupt");
  return s;
}

}  // namespace flashd::engine
