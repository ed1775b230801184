// The GPU backend: every op of the forward pass run by the kernels of kernels/gpu. Compiled once
// per GPU runtime; FLASHD_GPU_BACKEND (cuda, hip or hipcpu) names the kernels' namespace and
// this backend's.
//
// Memory. The weights an op reads are uploaded the first time and stay on the device, as stored:
// FP8 and FP4 codes with their scales, and BF16 matrices (which the forward pass keeps as fp32
// values) as BF16 codes again, never widened. The KV pool's blocks stay on the device too (the
// KV arena, KvArena below): a block is copied there when an op first reads it and again only
// after its bytes changed on the host (the pool's block versions say when: a restore from the
// prefix cache, a snapshot read, a copy on write, a CPU backend's write in a layer split; and
// the pool's count of such writes says whether any block changed since a table's blocks were
// last found current, so an op compares the versions of only the blocks its tables added); what
// a kernel writes into a block goes back to the host block when the backend settles (before
// another backend's op and at the end of every step, Backend::Settle). So the pool's host
// bytes stay the one authority the prefix cache, snapshots and forks read, and the indexer and
// the attention read their keys and KV in place. The forward pass's activations stay on the
// device between ops too (Backend::Keep, KeptBuffers below): ops read and write the device
// copies of the buffers the step keeps, and the host copy catches up only where the forward
// pass reads it (the logits, and at the step's end the rows it commits; the indexer's picks
// stay for the attention, which maps the blocks under each query's bound);
// buffers that start as zeros are cleared there rather than copied. An op whose outputs all
// stay on the device is not waited for. What the host takes back at one wait (a settle's KV
// rows and kept buffers, an op's outputs) comes in one copy, gathered on the device by a kernel
// (DeviceMemory::Bring), however many sequences wrote it. The
// sequences' window rings stay on the device from step to step (RingCache below): a decode step
// copies the ring slots the step before wrote, named by their versions, all the slots of one op
// (its sequences' rings) in one copy that a kernel spreads. So do the sequences' compressor
// partial groups: the commit names them by a new version (SequenceState::Compressor::version),
// and the next step keeping that version takes the device copy as it is (KeptBuffers). Everything
// else an op touches (buffers nobody kept, a ring without versions) is copied to device workspace
// for the op and its outputs copied back. Copies to the device of up to 1 MiB (most of a step's)
// are staged in pinned memory and queued behind the kernels (Traffic below), the host not waiting.
//
// Two ops stay on the host: the Engram gather (its tables live in host memory by design; the
// rows a step needs are known from its tokens) and, for the reference's own top-k order (the
// CPU library's, which only the golden test asks for), TopK, CandidateFilter and MoeRoute.
//
// Thread-safety: ops are serialised by a mutex (one stream, one workspace).
#include "engine/gpu_backend.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/upload_staging.h"
#include "kernels/codecs.h"
#include "kernels/cpu/ops.h"
#include "kernels/gpu/device.h"
#include "kernels/gpu/ops.h"

namespace flashd::engine::FLASHD_GPU_BACKEND {
namespace {

namespace k = flashd::kernels;
namespace g = flashd::kernels::FLASHD_GPU_BACKEND;
using k::OpStatus;

constexpr size_t kAlign = 256;
constexpr size_t kMinChunk = size_t{64} << 20;

size_t Count(int64_t n) { return n > 0 ? static_cast<size_t>(n) : 0; }

// The runtime's calls UploadStaging makes.
struct StagingDevice {
  std::string HostAlloc(void** ptr, size_t bytes) { return g::HostAlloc(ptr, bytes); }
  void HostFree(void* ptr) { (void)g::HostFree(ptr); }
  std::string Queue(void* dst, const void* pinned, size_t bytes) {
    return g::CopyToDeviceQueued(dst, pinned, bytes);
  }
  std::string Copy(void* dst, const void* src, size_t bytes) {
    return g::CopyToDevice(dst, src, bytes);
  }
  std::string Wait() { return g::Synchronize(); }
};

// Uploads of up to 1 MiB (a step's small operands) are queued from 16 MiB of pinned staging.
constexpr size_t kStagingBytes = size_t{16} << 20, kStagedLargest = size_t{1} << 20;

// What crossed between host and device, and how often the host waited for the device (a
// synchronisation, a read of kept activations, which waits for the ops before it, or a full
// staging). Small uploads are queued behind the kernels (UploadStaging); a wait or a copy to
// the host, which the device does after everything queued before it, frees their staging.
struct Traffic {
  uint64_t to_device = 0, to_host = 0, waits = 0, zeroed = 0, downloads = 0;
  UploadStaging<StagingDevice> staging{StagingDevice{}, kStagingBytes, kStagedLargest};
  std::string Zero(void* dst, size_t bytes) {
    zeroed += bytes;
    return g::ZeroOnDevice(dst, bytes);
  }
  std::string Up(void* dst, const void* src, size_t bytes) {
    to_device += bytes;
    return staging.Up(dst, src, bytes);
  }
  std::string Down(void* dst, const void* src, size_t bytes) {
    to_host += bytes;
    ++downloads;
    std::string e = g::CopyToHost(dst, src, bytes);
    if (e.empty()) staging.Drained();
    return e;
  }
};

// A copy to the host of bytes a kernel wrote: `bytes` at `device` to `host`.
struct Download {
  void* host;
  const void* device;
  size_t bytes;
};

// Device copies of the KV pool's blocks, kept from op to op. A block is copied to the device when
// an op needs it and its version (kernels::PagedRows::versions) is not the one copied last; a
// block's slot, once given, stays its own for the backend's life (the pool reuses its ids and
// its capacity bounds them). REQUIRES: one pool per backend (a CpuForward's).
class KvArena {
 public:
  KvArena() = default;
  KvArena(const KvArena&) = delete;
  KvArena& operator=(const KvArena&) = delete;
  ~KvArena() {
    for (void* c : chunks_) g::DeviceFree(c);
    if (table_ != nullptr) g::DeviceFree(table_);
  }

  // The device table (block id -> its copy) after making every block of `ids` (in any order,
  // repeats allowed) current from the host blocks of `pool`. Null with *error set when a copy
  // failed, or with *error empty when device memory ran out (the caller then copies the blocks
  // for its op alone).
  uint8_t** Prepare(const std::vector<int64_t>& ids, const k::PagedRows& pool, std::string* error) {
    if (ids.empty()) return table_;
    if (block_bytes_ != 0 && block_bytes_ != pool.block_bytes) {
      *error = "KV arena: blocks of " + std::to_string(pool.block_bytes) + " bytes after " +
               std::to_string(block_bytes_);
      return nullptr;
    }
    block_bytes_ = pool.block_bytes;
    slot_bytes_ = (block_bytes_ + kAlign - 1) / kAlign * kAlign;
    const size_t top = static_cast<size_t>(*std::max_element(ids.begin(), ids.end())) + 1;
    if (top > slots_.size()) {
      slots_.resize(top, nullptr);
      held_.resize(top, 0);
    }
    if (top > table_size_ && !GrowTable(top, error)) return nullptr;
    // The table entries of slots given out by this call go to the device even when a later
    // block finds no memory, since the slots stay given.
    size_t lo = SIZE_MAX, hi = 0;
    auto publish = [&] {
      if (lo >= hi) return true;
      const std::string e =
          traffic->Up(table_ + lo, slots_.data() + lo, (hi - lo) * sizeof(uint8_t*));
      if (!e.empty()) *error = e;
      return e.empty();
    };
    compared_ += ids.size();
    for (int64_t id : ids) {
      const size_t i = static_cast<size_t>(id);
      if (slots_[i] == nullptr) {
        if ((slots_[i] = NewSlot()) == nullptr) {
          publish();
          return nullptr;
        }
        lo = std::min(lo, i);
        hi = std::max(hi, i + 1);
      }
      if (held_[i] != pool.versions[i]) {
        if (const std::string e = traffic->Up(slots_[i], pool.blocks[i], block_bytes_);
            !e.empty()) {
          publish();
          *error = e;
          return nullptr;
        }
        held_[i] = pool.versions[i];
        ++copied_;
      }
    }
    return publish() ? table_ : nullptr;
  }

  // After a kernel wrote rows of block `id`, all within [lo, hi) of the block: the block's
  // version moves on with the device copy current, and those bytes go back to the host block at
  // the next Written (the backend's Settle, which the forward pass calls before anything else
  // reads the host blocks: another backend's op, the end of the step).
  void Wrote(int64_t id, size_t lo, size_t hi, const k::PagedRows& pool) {
    const size_t i = static_cast<size_t>(id);
    pool.versions[i] += 1;
    held_[i] = pool.versions[i];
    pending_.push_back({pool.blocks[i] + lo, slots_[i] + lo, hi - lo});
  }

  // The copies that bring the written bytes to their host blocks, added to *out; the caller
  // makes them (DeviceMemory::Bring).
  void Written(std::vector<Download>* out) {
    out->insert(out->end(), pending_.begin(), pending_.end());
    pending_.clear();
  }

  uint64_t bytes() const { return bytes_; }
  uint64_t copied() const { return copied_; }
  uint64_t compared() const { return compared_; }

  Traffic* traffic = nullptr;

 private:
  bool GrowTable(size_t need, std::string* error) {
    const size_t size = std::max(need, 2 * table_size_);
    void* table = nullptr;
    if (!g::DeviceAlloc(&table, size * sizeof(uint8_t*)).empty()) return false;  // Out of memory.
    std::vector<uint8_t*> host(size, nullptr);
    std::copy(slots_.begin(), slots_.end(), host.begin());
    if (const std::string e = traffic->Up(table, host.data(), size * sizeof(uint8_t*));
        !e.empty()) {
      g::DeviceFree(table);
      *error = e;
      return false;
    }
    if (table_ != nullptr) g::DeviceFree(table_);
    bytes_ += (size - table_size_) * sizeof(uint8_t*);
    table_ = static_cast<uint8_t**>(table);
    table_size_ = size;
    return true;
  }

  // A block's slot from the current chunk; a new chunk (as many slots as are given already,
  // from 64 up to 64 MiB) when it is full. Null when the device has no memory for one.
  uint8_t* NewSlot() {
    if (chunk_left_ == 0) {
      const size_t most = std::max<size_t>(kMinChunk / slot_bytes_, 64);
      const size_t slots = std::clamp<size_t>(given_, 64, most);
      void* chunk = nullptr;
      if (!g::DeviceAlloc(&chunk, slots * slot_bytes_).empty()) return nullptr;
      chunks_.push_back(chunk);
      chunk_next_ = static_cast<uint8_t*>(chunk);
      chunk_left_ = slots;
      bytes_ += slots * slot_bytes_;
    }
    uint8_t* slot = chunk_next_;
    chunk_next_ += slot_bytes_;
    --chunk_left_;
    ++given_;
    return slot;
  }

  size_t block_bytes_ = 0, slot_bytes_ = 0;
  std::vector<uint8_t*> slots_;  // Block id -> its device copy, or null.
  std::vector<uint64_t> held_;   // Block id -> the version its copy holds (0: none).
  uint8_t** table_ = nullptr;    // slots_ on the device, table_size_ entries.
  size_t table_size_ = 0;
  std::vector<void*> chunks_;
  uint8_t* chunk_next_ = nullptr;
  size_t chunk_left_ = 0, given_ = 0;
  uint64_t bytes_ = 0, copied_ = 0, compared_ = 0;
  std::vector<Download> pending_;  // Written on the device, not yet on the host.
};

// A step's activations kept on the device from op to op (Backend::Keep). Each kept buffer has a
// device copy and knows which side holds its bytes: the host only, the device only, both, or
// neither yet (fresh: nothing has written it, so an op writing it first uploads nothing), or
// zeros on the host that the device copy gets by a clear on the device. The device memory of
// released buffers is reused by later ones of a similar size, except that a buffer released
// with a content that its device copy holds keeps that copy for the next step that keeps the
// same content (a sequence's compressor partial groups, which a decode step would otherwise
// copy up again, a few copies a sequence).
class KeptBuffers {
 public:
  enum class Where { kFresh, kHost, kZeros, kDevice, kBoth };
  struct Buffer {
    uint8_t* host;
    size_t bytes;
    uint8_t* device;
    Where where;
    // The device copy held the host's bytes at the last Settle (read back, or both current),
    // and the host has announced no write since.
    bool settled_same = false;
  };

  KeptBuffers() = default;
  KeptBuffers(const KeptBuffers&) = delete;
  KeptBuffers& operator=(const KeptBuffers&) = delete;
  ~KeptBuffers() {
    for (auto& [host, b] : kept_) g::DeviceFree(b.device);
    for (auto& [size, device] : free_) g::DeviceFree(device);
    for (auto& [content, r] : retained_) g::DeviceFree(r.device);
  }

  // False when the device has no memory for it (the buffer then stays the host's alone, and
  // ops copy it as they would any other). A content (Backend::Keep) whose bytes a Release left
  // here is taken as it is.
  bool Keep(uint8_t* host, size_t bytes, KeepAs as, uint64_t content) {
    if (host == nullptr || bytes == 0) return false;
    Release(host, 0);
    if (auto it = retained_.find(content);
        content != 0 && as == KeepAs::kHostBytes && it != retained_.end()) {
      const Retained r = it->second;
      Unretain(it);
      if (r.bytes == bytes) {
        kept_[reinterpret_cast<uintptr_t>(host)] = {host, bytes, r.device, Where::kBoth};
        ++reused_;
        return true;
      }
      free_.emplace(sizes_[r.device], r.device);
    }
    uint8_t* device = nullptr;
    auto it = free_.lower_bound(bytes);
    if (it != free_.end() && it->first <= 2 * bytes) {
      device = static_cast<uint8_t*>(it->second);
      sizes_[device] = it->first;
      free_.erase(it);
    } else {
      const size_t size = (bytes + kAlign - 1) / kAlign * kAlign;
      void* fresh_memory = nullptr;
      if (!g::DeviceAlloc(&fresh_memory, size).empty()) {
        Trim();
        if (!g::DeviceAlloc(&fresh_memory, size).empty()) return false;
      }
      device = static_cast<uint8_t*>(fresh_memory);
      sizes_[device] = size;
      bytes_ += size;
    }
    const Where where = as == KeepAs::kUnwritten ? Where::kFresh
                        : as == KeepAs::kZeros   ? Where::kZeros
                                                 : Where::kHost;
    kept_[reinterpret_cast<uintptr_t>(host)] = {host, bytes, device, where};
    return true;
  }

  // With a content (Backend::Release), a device copy that holds the host's bytes stays for a
  // later Keep of that content, the least recently released going past kRetainedBytes.
  void Release(const void* host, uint64_t content) {
    auto it = kept_.find(reinterpret_cast<uintptr_t>(host));
    if (it == kept_.end()) return;
    const Buffer& b = it->second;
    const size_t size = sizes_[b.device];
    const bool same = b.where == Where::kBoth || (b.where == Where::kHost && b.settled_same);
    if (content != 0 && same && !retained_.contains(content)) {
      while (!order_.empty() && retained_bytes_ + size > kRetainedBytes) {
        auto oldest = retained_.find(order_.back());
        free_.emplace(sizes_[oldest->second.device], oldest->second.device);
        Unretain(oldest);
      }
      order_.push_front(content);
      retained_[content] = {b.device, b.bytes, order_.begin()};
      retained_bytes_ += size;
    } else {
      free_.emplace(size, b.device);
    }
    kept_.erase(it);
  }

  uint64_t reused() const { return reused_; }

  // The kept buffer holding all of [p, p + bytes), or null; *straddles when the range starts in
  // a kept buffer but runs past its end (or starts before one and runs into it).
  Buffer* Find(const void* p, size_t bytes, bool* straddles) {
    *straddles = false;
    if (kept_.empty()) return nullptr;
    const uintptr_t lo = reinterpret_cast<uintptr_t>(p), hi = lo + bytes;
    auto it = kept_.upper_bound(lo);
    if (it != kept_.end() && it->first < hi) *straddles = true;  // Runs into the next one.
    if (it == kept_.begin()) return nullptr;
    Buffer& b = std::prev(it)->second;
    const uintptr_t start = reinterpret_cast<uintptr_t>(b.host);
    if (lo >= start + b.bytes) return nullptr;
    if (hi > start + b.bytes || *straddles) {
      *straddles = true;
      return nullptr;
    }
    return &b;
  }

  // Makes the device copy current before an op uses it: the host's bytes (all of them) when
  // those are the newer ones, copied, or cleared when they are zeros; nothing otherwise (a
  // fresh buffer's bytes are not: no op reads what ops have not written).
  std::string MakeCurrent(Buffer* b) {
    if (b->where != Where::kHost && b->where != Where::kZeros) return "";
    std::string e = b->where == Where::kZeros ? traffic->Zero(b->device, b->bytes)
                                              : traffic->Up(b->device, b->host, b->bytes);
    if (e.empty()) b->where = Where::kBoth;
    return e;
  }

  // The device's bytes of [p, p + bytes) to the host, when the device holds the newer ones.
  std::string ToHost(const void* p, size_t bytes) {
    bool straddles = false;
    Buffer* b = Find(p, bytes, &straddles);
    if (straddles) return "a host read runs past a kept buffer";
    if (b == nullptr || b->where != Where::kDevice) return "";
    ++traffic->waits;
    std::string e = traffic->Down(b->host, b->device, b->bytes);
    if (e.empty()) b->where = Where::kBoth;
    return e;
  }

  // The host wrote [p, p + bytes): a device copy that holds the rest gets these bytes too.
  std::string HostWrote(const void* p, size_t bytes) {
    bool straddles = false;
    Buffer* b = Find(p, bytes, &straddles);
    if (straddles) return "a host write runs past a kept buffer";
    if (b == nullptr) return "";
    if (b->where == Where::kFresh || b->where == Where::kHost || b->where == Where::kZeros) {
      b->where = Where::kHost;
      b->settled_same = false;
      return "";
    }
    const size_t at = static_cast<const uint8_t*>(p) - b->host;
    return traffic->Up(b->device + at, p, bytes);
  }

  // The copies that bring every buffer's newer device bytes to the host, added to *out (the
  // caller makes them: DeviceMemory::Bring); from then on the host's are the only copy.
  void Settle(std::vector<Download>* out) {
    for (auto& [host, b] : kept_) {
      if (b.where == Where::kDevice) out->push_back({b.host, b.device, b.bytes});
      // (A second Settle with nothing written between keeps what the first found.)
      b.settled_same = b.where == Where::kDevice || b.where == Where::kBoth ||
                       (b.where == Where::kHost && b.settled_same);
      b.where = Where::kHost;  // Zeros too: another backend may write the host's bytes next.
    }
  }

  uint64_t bytes() const { return bytes_; }

  Traffic* traffic = nullptr;

 private:
  struct Retained {
    uint8_t* device;
    size_t bytes;
    std::list<uint64_t>::iterator order;
  };
  // Device copies of released contents, at most this many bytes (a sequence's partial groups
  // take a few hundred kilobytes at the released dimensions).
  static constexpr size_t kRetainedBytes = size_t{256} << 20;

  void Unretain(std::map<uint64_t, Retained>::iterator it) {
    retained_bytes_ -= sizes_[it->second.device];
    order_.erase(it->second.order);
    retained_.erase(it);
  }

  // Frees the device memory no kept buffer uses, released contents' copies too.
  void Trim() {
    while (!retained_.empty()) {
      free_.emplace(sizes_[retained_.begin()->second.device], retained_.begin()->second.device);
      Unretain(retained_.begin());
    }
    for (auto& [size, device] : free_) {
      sizes_.erase(device);
      g::DeviceFree(device);
      bytes_ -= size;
    }
    free_.clear();
  }

  std::map<uintptr_t, Buffer> kept_;       // By host address.
  std::multimap<size_t, void*> free_;      // Released device memory by size.
  std::map<const void*, size_t> sizes_;    // Device allocation -> its size.
  std::map<uint64_t, Retained> retained_;  // By content.
  std::list<uint64_t> order_;              // Retained contents, the latest released first.
  uint64_t bytes_ = 0, retained_bytes_ = 0, reused_ = 0;
};

// Device buffers kept for host objects named by their address, from op to op and from step to
// step: the mechanism the block tables' and window rings' copies share. Each use marks its
// buffer as the current op's; the least recently used buffers go when the buffers pass their
// budget, but never one the op being prepared reads (NewOp marks where an op starts), so an op
// finding only its own buffers in the way copies what it needs for itself instead. What makes
// a buffer current is the user's: `State` is what it knows of the buffer's contents, empty in a
// new one.
template <class State>
class DeviceCopies {
 public:
  struct Copy {
    uint8_t* device;
    size_t bytes;
    State state;
  };

  DeviceCopies() = default;
  DeviceCopies(const DeviceCopies&) = delete;
  DeviceCopies& operator=(const DeviceCopies&) = delete;
  ~DeviceCopies() {
    for (auto& [host, e] : entries_) g::DeviceFree(e.copy.device);
  }

  void NewOp() { ++op_; }

  // The buffer kept for `host`, of at least `need` bytes: a new one of `size` bytes (>= need)
  // where there was none or a smaller one. Null when device memory ran out or only this op's
  // buffers stand between the budget and it.
  Copy* Use(const void* host, size_t need, size_t size) {
    auto it = entries_.find(host);
    if (it != entries_.end() && it->second.copy.bytes < need) {
      Drop(it);
      it = entries_.end();
    }
    if (it == entries_.end()) {
      // This op's buffers are the most recently used: when the last is one, all are.
      while (!lru_.empty() && bytes_ + size > budget_) {
        auto last = entries_.find(lru_.back());
        if (last->second.op == op_) return nullptr;
        Drop(last);
      }
      void* device = nullptr;
      if (!g::DeviceAlloc(&device, size).empty()) return nullptr;
      lru_.push_front(host);
      it =
          entries_
              .emplace(host, Entry{{static_cast<uint8_t*>(device), size, State{}}, lru_.begin(), 0})
              .first;
      bytes_ += size;
    } else {
      lru_.splice(lru_.begin(), lru_, it->second.used);
    }
    it->second.op = op_;
    return &it->second.copy;
  }

  // The buffer kept for `host`, or null; its use unchanged.
  Copy* Find(const void* host) {
    auto it = entries_.find(host);
    return it == entries_.end() ? nullptr : &it->second.copy;
  }

  // Forgets host's buffer (its contents are not what its state says).
  void Drop(const void* host) {
    if (auto it = entries_.find(host); it != entries_.end()) Drop(it);
  }

  uint64_t bytes() const { return bytes_; }
  void set_budget(uint64_t bytes) { budget_ = bytes; }

 private:
  struct Entry {
    Copy copy;
    std::list<const void*>::iterator used;
    uint64_t op;  // The last op that used it.
  };

  void Drop(typename std::map<const void*, Entry>::iterator it) {
    g::DeviceFree(it->second.copy.device);
    bytes_ -= it->second.copy.bytes;
    lru_.erase(it->second.used);
    entries_.erase(it);
  }

  std::map<const void*, Entry> entries_;  // By host address.
  std::list<const void*> lru_;            // Most recently used first.
  uint64_t bytes_ = 0, op_ = 0, budget_ = 0;
};

// Device copies of the sequences' block tables, by host address: each use compares the host's
// entries with those the copy holds and uploads only from the first that differs (a decode step
// appends a block every 64 tokens, a copy on write replaces one), so a long context's table
// (64 KB at a million tokens) is not uploaded again by every attention and indexer op. The
// contents are compared, not trusted by address, so a table at an address another one had gets
// its own entries. A copy also remembers how many of its first entries name blocks that were
// made current in the KV arena while the pool's host writes stood at a count (Verified), so an
// op whose blocks did not change compares no versions.
class TableCache {
 public:
  TableCache() { copies_.set_budget(size_t{64} << 20); }

  void NewOp() { copies_.NewOp(); }

  // The device copy of host[0..n), current; null when device memory ran out (the caller copies
  // the table for its op alone) or with *error set when a copy failed.
  const int32_t* Prepare(const int32_t* host, int64_t n, std::string* error) {
    const size_t count = Count(n);
    if (host == nullptr || count == 0) return nullptr;
    auto* c = copies_.Use(host, count * 4, std::max<size_t>(count * 2, 64) * 4);
    if (c == nullptr) return nullptr;
    auto* device = reinterpret_cast<int32_t*>(c->device);
    std::vector<int32_t>& held = c->state.held;
    size_t same = 0;
    const size_t common = std::min(count, held.size());
    while (same < common && held[same] == host[same]) ++same;
    c->state.verified = std::min(c->state.verified, same);
    if (same < count) {
      if (std::string e = traffic->Up(device + same, host + same, (count - same) * 4); !e.empty()) {
        *error = e;
        copies_.Drop(host);
        return nullptr;
      }
      held.resize(std::max(held.size(), count));
      std::copy(host + same, host + count, held.begin() + same);
      entries_copied_ += count - same;
    }
    return device;
  }

  // How many of the first n entries of host's table (prepared by this op) name blocks current in
  // the KV arena: those Verify recorded at the pool's host writes `writes`, unchanged since.
  size_t Verified(const int32_t* host, int64_t n, uint64_t writes) {
    const Copy* c = copies_.Find(host);
    if (c == nullptr || c->state.writes != writes) return 0;
    return std::min(c->state.verified, Count(n));
  }
  // The blocks of host's first n entries are current in the KV arena, the pool's host writes
  // standing at `writes`.
  void Verify(const int32_t* host, int64_t n, uint64_t writes) {
    if (Copy* c = copies_.Find(host); c != nullptr && c->state.held.size() >= Count(n)) {
      c->state.verified = Count(n);
      c->state.writes = writes;
    }
  }

  uint64_t bytes() const { return copies_.bytes(); }
  uint64_t entries_copied() const { return entries_copied_; }

  Traffic* traffic = nullptr;

 private:
  struct State {
    std::vector<int32_t> held;  // The entries the device copy holds.
    size_t verified = 0;        // Of them, those naming blocks current in the KV arena,
    uint64_t writes = 0;        // at this count of the pool's host writes.
  };
  using Copy = DeviceCopies<State>::Copy;
  DeviceCopies<State> copies_;
  uint64_t entries_copied_ = 0;
};

// Device copies of the sequences' window rings, by the address of their host codes. A ring's
// slots' versions (SequenceState::Ring::versions) say which slots changed since the copy was
// last made current, and only those are copied, in runs of neighbouring slots: a decode step
// copies the one slot it wrote, not the window. A version names one slot content, so an address
// another ring used before holds versions the new ring does not have, and those slots are
// copied. On the device a slot's scales follow its codes (SlotBytes a slot), so a run of slots
// is one copy, gathered on the host.
class RingCache {
 public:
  // A device slot's bytes: its head_dim codes, its head_dim / 32 scales, to 16 bytes.
  static size_t SlotBytes(int64_t head_dim) {
    return (Count(head_dim) + Count(head_dim / 32) + 15) / 16 * 16;
  }

  // The rings prepared from now on are one op's, kept until the next NewOp.
  void NewOp() { copies_.NewOp(); }

  // Slots on their way to the device copies: the runs' bytes one after another, and each run's
  // place (`from` an offset into bytes). Sent by the op that prepared them, before it launches:
  // one run as a copy of its own, more as one copy spread by a kernel (g::ScatterOnDevice).
  struct Pending {
    std::vector<uint8_t> bytes;
    std::vector<g::ByteRun> runs;
    std::vector<const void*> rings;  // The rings the runs are of, by host codes address.
  };

  // The device copy of a ring of `window` slots (host codes [window, head_dim] and scales
  // [window, head_dim / 32]; on the device SlotBytes a slot, its codes then its scales), made
  // current from the host by the runs of changed slots added to *pending. Null when device
  // memory ran out or the budget holds only this op's rings (the caller then copies the ring
  // for its op alone).
  uint8_t* Prepare(const uint8_t* codes, const uint8_t* scales, const uint64_t* versions,
                   int64_t window, int64_t head_dim, Pending* pending) {
    const size_t slot_codes = Count(head_dim), slot_scales = Count(head_dim / 32);
    const size_t slot = SlotBytes(head_dim), slots = Count(window), bytes = slots * slot;
    auto* c = copies_.Use(codes, bytes, bytes);
    if (c == nullptr) return nullptr;
    // The versions of the slots the device copy holds; 0: none.
    std::vector<uint64_t>& held = c->state;
    if (held.size() != slots || c->bytes != bytes) held.assign(slots, 0);
    bool any = false;
    for (size_t a = 0; a < slots;) {
      if (held[a] == versions[a]) {
        ++a;
        continue;
      }
      size_t b = a + 1;
      while (b < slots && held[b] != versions[b]) ++b;
      // The run's slots as the device holds them (the last without its padding).
      const size_t run = (b - a - 1) * slot + slot_codes + slot_scales;
      const size_t from = pending->bytes.size();
      pending->bytes.resize(from + run, 0);
      for (size_t i = a; i < b; ++i) {
        uint8_t* at = &pending->bytes[from + (i - a) * slot];
        std::memcpy(at, codes + i * slot_codes, slot_codes);
        std::memcpy(at + slot_codes, scales + i * slot_scales, slot_scales);
      }
      pending->runs.push_back({c->device + a * slot, from, run});
      std::copy(versions + a, versions + b, held.begin() + a);
      slots_copied_ += b - a;
      any = true;
      a = b;
    }
    if (any) pending->rings.push_back(codes);
    return c->device;
  }

  // The pending runs went up in `copies` copies, or with an error (their rings dropped: the
  // versions they took are not on the device).
  void Sent(const Pending& pending, uint64_t copies, bool ok) {
    uploads_ += copies;
    if (ok) return;
    for (const void* codes : pending.rings) copies_.Drop(codes);
  }

  uint64_t bytes() const { return copies_.bytes(); }
  uint64_t slots_copied() const { return slots_copied_; }
  uint64_t uploads() const { return uploads_; }
  void set_budget(uint64_t bytes) { copies_.set_budget(bytes); }

 private:
  DeviceCopies<std::vector<uint64_t>> copies_;
  uint64_t slots_copied_ = 0, uploads_ = 0;
};

// The device memory a backend holds: resident weights, the KV arena, and workspace reused by
// every op.
class DeviceMemory {
 public:
  DeviceMemory() {
    kv.traffic = &traffic;
    kept.traffic = &traffic;
    tables.traffic = &traffic;
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    for (auto& [host, w] : weights_) g::DeviceFree(w.device);
    for (Chunk& c : chunks_) g::DeviceFree(c.device);
    if (counters_ != nullptr) g::DeviceFree(counters_);
  }

  // The device copy of a weight, made on first use. Weights never change after the model is
  // prepared, so their host address names them.
  void* Weight(const void* host, size_t bytes, std::string* error) {
    return Upload(host, bytes, host, bytes, false, error);
  }

  // An fp32 matrix whose values are all BF16 numbers (as the forward pass decodes BF16 tensors)
  // is kept as BF16 codes, half the bytes and never widened; `*bf16` says which it got.
  void* DenseWeight(const float* host, size_t count, bool* bf16, std::string* error) {
    auto it = weights_.find(host);
    if (it != weights_.end() && it->second.count >= count) {
      *bf16 = it->second.bf16;
      return it->second.device;
    }
    std::vector<uint16_t> codes(count);
    *bf16 = true;
    for (size_t i = 0; i < count && *bf16; ++i) {
      codes[i] = k::codecs::FloatToBf16(host[i]);
      *bf16 = k::codecs::Bf16ToFloat(codes[i]) == host[i] || host[i] != host[i];
    }
    if (*bf16) return Upload(host, count, codes.data(), count * 2, true, error);
    return Upload(host, count, host, count * 4, false, error);
  }

  // A device table of `count` weights' device copies, named by the host table of their host
  // addresses (which, like a weight, never changes): `copies()` makes the copies and gives
  // their addresses when the table is not on the device yet.
  template <class MakeCopies>
  const void* Table(const void* host, size_t count, MakeCopies copies, std::string* error) {
    auto it = weights_.find(host);
    if (it != weights_.end() && it->second.count >= count) return it->second.device;
    const std::vector<const void*> device = copies();
    if (!error->empty()) return nullptr;
    return Upload(host, count, device.data(), count * sizeof(void*), false, error, true);
  }

 private:
  // Keys the copy of `bytes` at `data` by `host` (and its element count).
  // `table`: a table of weights' addresses (memory in use, not weight bytes).
  void* Upload(const void* host, size_t count, const void* data, size_t bytes, bool bf16,
               std::string* error, bool table = false) {
    auto it = weights_.find(host);
    if (it != weights_.end() && it->second.count >= count && it->second.bf16 == bf16) {
      return it->second.device;
    }
    void* device = nullptr;
    std::string e = g::DeviceAlloc(&device, std::max<size_t>(bytes, 1));
    if (e.empty()) e = traffic.Up(device, data, bytes);
    if (!e.empty()) {
      if (device != nullptr) g::DeviceFree(device);
      *error = e;
      return nullptr;
    }
    if (it != weights_.end()) {
      (it->second.table ? tables_ : resident_) -= it->second.bytes;
      g::DeviceFree(it->second.device);
    }
    weights_[host] = {device, bytes, count, bf16, table};
    (table ? tables_ : resident_) += bytes;
    return device;
  }

 public:
  // The host side of an op's pack of small inputs (Call::Upload), its allocation reused.
  std::vector<uint8_t> pack;

  // Workspace for one op, valid until Reset().
  void* Scratch(size_t bytes, std::string* error) {
    bytes = (std::max<size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
    for (; current_ < chunks_.size(); ++current_) {
      Chunk& c = chunks_[current_];
      if (c.size - c.used >= bytes) {
        void* p = static_cast<uint8_t*>(c.device) + c.used;
        c.used += bytes;
        return p;
      }
    }
    const size_t size = std::max({bytes, kMinChunk, 2 * workspace_});
    void* device = nullptr;
    const std::string e = g::DeviceAlloc(&device, size);
    if (!e.empty()) {
      *error = e;
      return nullptr;
    }
    chunks_.push_back({device, size, bytes});
    workspace_ += size;
    return device;
  }

  void Reset() {
    for (Chunk& c : chunks_) c.used = 0;
    current_ = 0;
  }

  // `count` counters, zeros, that the kernels using them leave zeros (g::HcMixFused's arrivals):
  // one allocation kept for every op, grown when an op needs more.
  unsigned* Counters(size_t count, std::string* error) {
    if (count > counters_count_) {
      const size_t size = std::max<size_t>(count, 1024);
      void* device = nullptr;
      std::string e = g::DeviceAlloc(&device, size * sizeof(unsigned));
      if (e.empty()) e = traffic.Zero(device, size * sizeof(unsigned));
      if (!e.empty()) {
        if (device != nullptr) g::DeviceFree(device);
        *error = e;
        return nullptr;
      }
      if (counters_ != nullptr) g::DeviceFree(counters_);
      workspace_ += (size - counters_count_) * sizeof(unsigned);
      counters_ = static_cast<unsigned*>(device);
      counters_count_ = size;
    }
    return counters_;
  }

  // The downloads' device bytes to their host places, after the kernels launched before them:
  // one wait, one copy for all the pieces of up to kGatheredLargest bytes (gathered on the
  // device by one kernel into workspace, which stays taken until Reset; a piece alone is copied
  // as it is), and a copy of its own for each larger piece. Each copy to the host of a step's
  // small pieces waited for the device on its own, and a step has a few for each sequence.
  std::string Bring(const std::vector<Download>& downloads) {
    if (downloads.empty()) return "";
    ++traffic.waits;
    std::vector<g::ByteGather> runs;
    uint64_t gathered = 0;
    for (const Download& d : downloads) {
      if (d.bytes == 0 || d.bytes > kGatheredLargest) continue;
      runs.push_back({static_cast<const uint8_t*>(d.device), gathered, d.bytes});
      gathered += (d.bytes + 15) / 16 * 16;
    }
    const bool gather = runs.size() > 1;
    uint8_t* device = nullptr;
    if (gather) {
      std::string e;
      device = static_cast<uint8_t*>(Scratch(gathered, &e));
      void* table = e.empty() ? Scratch(runs.size() * sizeof(g::ByteGather), &e) : nullptr;
      if (e.empty()) e = traffic.Up(table, runs.data(), runs.size() * sizeof(g::ByteGather));
      if (e.empty()) {
        e = g::GatherOnDevice(device, static_cast<const g::ByteGather*>(table),
                              static_cast<int64_t>(runs.size()));
      }
      if (!e.empty()) return e;
    }
    for (const Download& d : downloads) {
      if (d.bytes == 0 || (gather && d.bytes <= kGatheredLargest)) continue;
      if (std::string e = traffic.Down(d.host, d.device, d.bytes); !e.empty()) return e;
    }
    if (!gather) return "";
    down_.resize(gathered);
    if (std::string e = traffic.Down(down_.data(), device, gathered); !e.empty()) return e;
    size_t i = 0;
    for (const Download& d : downloads) {
      if (d.bytes == 0 || d.bytes > kGatheredLargest) continue;
      std::memcpy(d.host, &down_[runs[i++].to], d.bytes);
    }
    return "";
  }

  uint64_t bytes() const {
    return resident_ + tables_ + workspace_ + kv.bytes() + kept.bytes() + rings.bytes() +
           tables.bytes();
  }
  uint64_t weight_bytes() const { return resident_; }

  Traffic traffic;
  KvArena kv;
  KeptBuffers kept;
  RingCache rings;
  TableCache tables;

 private:
  struct Resident {
    void* device;
    size_t bytes, count;  // count: bytes, or elements of a dense weight.
    bool bf16;
    bool table;  // Weights' device addresses (DeviceMemory::Table).
  };
  struct Chunk {
    void* device;
    size_t size, used;
  };
  static constexpr size_t kGatheredLargest = size_t{64} << 10;
  std::map<const void*, Resident> weights_;
  std::vector<uint8_t> down_;  // Bring's gathered bytes, its allocation reused.
  std::vector<Chunk> chunks_;
  size_t current_ = 0;
  uint64_t resident_ = 0, tables_ = 0, workspace_ = 0;
  unsigned* counters_ = nullptr;
  size_t counters_count_ = 0;
};

// The ids of a block table's first `blocks` entries, added to *ids.
void TableBlocks(const int32_t* table, int64_t blocks, std::vector<int64_t>* ids) {
  ids->insert(ids->end(), table, table + std::max<int64_t>(blocks, 0));
}

// One op's transfers: host buffers mapped to device workspace (the same host buffer twice maps to
// one device buffer, so aliasing outputs stay aliased), outputs copied back when the kernels
// succeeded. Inputs of up to 4 KiB (positions, tables, key lists) are packed into one region of
// the workspace and uploaded as one copy just before the launch (Flush): a decode step's op has
// several, each of which was a copy of its own.
class Call {
 public:
  explicit Call(DeviceMemory* memory) : memory_(memory) {
    memory_->pack.clear();
    memory_->rings.NewOp();
    memory_->tables.NewOp();
  }
  ~Call() {
    // Ring slots prepared but never sent: their rings drop the versions they took.
    if (!rings_.runs.empty()) memory_->rings.Sent(rings_, 0, false);
    memory_->Reset();
  }

  template <class T>
  const T* Weight(const T* host, int64_t count) {
    if (host == nullptr || !error_.empty()) return nullptr;
    return static_cast<const T*>(memory_->Weight(host, Count(count) * sizeof(T), &error_));
  }
  const void* DenseWeight(const float* host, int64_t count, bool* bf16) {
    if (host == nullptr || !error_.empty()) return nullptr;
    return memory_->DenseWeight(host, Count(count), bf16, &error_);
  }
  // The device table of the device copies of host[0..count), each `bytes` long.
  const uint8_t* const* WeightTable(const uint8_t* const* host, int64_t count, int64_t bytes) {
    if (host == nullptr || !error_.empty()) return nullptr;
    const void* table = memory_->Table(
        host, Count(count),
        [&] {
          std::vector<const void*> device;
          for (int64_t i = 0; i < count && error_.empty(); ++i) {
            device.push_back(Weight(host[i], bytes));
          }
          return device;
        },
        &error_);
    return static_cast<const uint8_t* const*>(table);
  }
  template <class T>
  const T* In(const T* host, int64_t count) {
    return Map(const_cast<T*>(host), count, true, false);
  }
  // Uploaded and copied back: in-place operands, and outputs a kernel need not write whole.
  template <class T>
  T* InOut(T* host, int64_t count) {
    return Map(host, count, true, true);
  }
  // Copied back only: outputs the kernel writes whole (no upload; a buffer already mapped as an
  // input of the same op keeps its uploaded copy).
  template <class T>
  T* Out(T* host, int64_t count) {
    return Map(host, count, false, true);
  }
  // A row's FP8 codes and their scales (one a 32 values) for `values` values, mapped in place
  // (null stays null): read by the op, or written whole by it.
  template <class T>
  void CodesIn(T*& codes, T*& scales, int64_t values) {
    codes = const_cast<T*>(In(codes, values));  // Only read.
    scales = const_cast<T*>(In(scales, values / 32));
  }
  void CodesOut(uint8_t*& codes, uint8_t*& scales, int64_t values) {
    codes = Out(codes, values);
    scales = Out(scales, values / 32);
  }
  // An op's x codes: where `given` (x_quantized) the codes the op that made x wrote, read as
  // CodesIn; else workspace the op quantizes x into.
  void XCodes(uint8_t*& codes, uint8_t*& scales, int64_t values, bool given) {
    if (given) return CodesIn(codes, scales, values);
    codes = Work<uint8_t>(values);
    scales = Work<uint8_t>(values / 32);
  }
  unsigned* Counters(int64_t count) {
    if (!error_.empty()) return nullptr;
    return memory_->Counters(static_cast<size_t>(count), &error_);
  }
  template <class T>
  T* Work(int64_t count) {
    if (!error_.empty()) return nullptr;
    return static_cast<T*>(memory_->Scratch(Count(count) * sizeof(T), &error_));
  }

  // The pool blocks holding `rows` (pool row ids, or with `block_ids` the blocks' ids; -1
  // skipped), for every region given: of each block only the span its regions cover, all
  // gathered into one staging buffer and copied to the device at once; a device table of block
  // pointers is made and the regions pointed at it (their offsets now from the span's start).
  // With `write` the spans come back after the op. Blocks read in place in the KV arena are not
  // sorted first: an op reading a long context's table (tens of thousands of blocks, every
  // attention and indexer op of a step) took most of its host time sorting them. With
  // `partial` (block ids of one pool's blocks, read) the op reads other blocks too, all current
  // in the KV arena already: the regions go to the arena, or nothing is done and it returns
  // false (the caller then passes every block). True otherwise.
  bool Blocks(const std::vector<int64_t>& rows, std::initializer_list<k::PagedRows*> regions,
              bool write, bool block_ids = false, bool partial = false) {
    std::map<uint8_t* const*, std::vector<k::PagedRows*>> by_table;
    for (k::PagedRows* r : regions) {
      if (r->blocks != nullptr && r->rows_per_block > 0) by_table[r->blocks].push_back(r);
    }
    if (partial && (by_table.size() != 1 || write || !block_ids)) return false;
    for (auto& [host_table, group] : by_table) {
      size_t lo = SIZE_MAX, hi = 0;
      for (const k::PagedRows* r : group) {
        lo = std::min(lo, r->offset);
        hi = std::max(hi, r->offset + Count(r->rows_per_block) * r->stride);
      }
      const size_t span = (hi - lo + 15) / 16 * 16;
      const int64_t per_block = group.front()->rows_per_block;
      std::vector<int64_t> ids;
      ids.reserve(rows.size());
      for (int64_t row : rows) {
        if (row >= 0) ids.push_back(block_ids ? row : row / per_block);
      }
      auto distinct = [&] {
        std::sort(ids.begin(), ids.end());
        ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
      };
      if (write) distinct();  // Each written block's bytes come back once.
      if (InArena(ids, group, lo, hi, write, partial) || !error_.empty()) continue;
      if (partial) return false;
      if (!write) distinct();
      std::vector<uint8_t*> table(ids.empty() ? 1 : Count(ids.back() + 1), nullptr);
      Gathered gathered{{}, std::vector<uint8_t>(ids.size() * span), nullptr, hi - lo, span};
      for (size_t i = 0; i < ids.size(); ++i) {
        gathered.host.push_back(host_table[ids[i]] + lo);
        std::memcpy(&gathered.staging[i * span], gathered.host.back(), hi - lo);
      }
      uint8_t* device =
          static_cast<uint8_t*>(Upload(gathered.staging.data(), gathered.staging.size()));
      if (device == nullptr) return false;
      for (size_t i = 0; i < ids.size(); ++i) table[Count(ids[i])] = device + i * span;
      gathered.device = device;
      if (write && !ids.empty()) scatter_.push_back(std::move(gathered));
      auto** device_table =
          static_cast<uint8_t**>(Upload(table.data(), table.size() * sizeof(uint8_t*)));
      if (device_table == nullptr) return false;
      for (k::PagedRows* r : group) {
        if (r->rows_per_block != per_block) {
          error_ = "regions of one pool with different block sizes";
          return false;
        }
        r->blocks = device_table;
        r->offset -= lo;
      }
    }
    return true;
  }

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

  // Uploads the packed inputs not uploaded yet; before the launch, and before a pack's region
  // is left for a new one. False on an error.
  bool Flush() {
    const std::vector<uint8_t>& pack = memory_->pack;
    if (error_.empty() && pack.size() > flushed_) {
      if (!Check(memory_->traffic.Up(pack_device_ + flushed_, pack.data() + flushed_,
                                     pack.size() - flushed_))) {
        return false;
      }
      flushed_ = pack.size();
    }
    return error_.empty();
  }

  // The blocks `ids` of a pool whose regions carry its block versions, read and written in place
  // in the backend's KV arena, the regions pointed at its table. False when there is nothing to
  // read, the pool has no versions, or the arena is out of device memory: the caller then
  // copies the blocks for this op alone (or when a copy failed, with the error set).
  bool InArena(const std::vector<int64_t>& ids, const std::vector<k::PagedRows*>& group, size_t lo,
               size_t hi, bool write, bool partial) {
    const k::PagedRows pool = *group.front();
    if ((ids.empty() && !partial) || pool.versions == nullptr || pool.block_bytes < hi) {
      return false;
    }
    for (const k::PagedRows* r : group) {
      if (r->versions != pool.versions || r->rows_per_block != pool.rows_per_block) return false;
    }
    std::string e;
    uint8_t** table = memory_->kv.Prepare(ids, pool, &e);
    if (table == nullptr) return !Check(e);
    for (k::PagedRows* r : group) r->blocks = table;
    if (write) written_.push_back({ids, lo, hi, pool});
    return true;
  }

  // The blocks of the sequences' block tables (each table's host entries, prepared by Table
  // first, and how many the op reads) for reading, as Blocks maps them. Where the regions' pool
  // counts its host writes, the blocks a table's copy found current in the KV arena at the same
  // count are not compared again (TableCache::Verified), only the rest, and the tables are
  // recorded current after: a decode step's ops compare a long context's versions once, not
  // once an op.
  void TableReads(const std::vector<std::pair<const int32_t*, int64_t>>& tables,
                  std::initializer_list<k::PagedRows*> regions) {
    std::vector<int64_t> ids;
    const k::PagedRows& pool = **regions.begin();
    if (pool.writes != nullptr && pool.versions != nullptr) {
      const uint64_t writes = *pool.writes;
      for (const auto& [host, n] : tables) {
        const size_t from = memory_->tables.Verified(host, n, writes);
        TableBlocks(host + from, n - static_cast<int64_t>(from), &ids);
      }
      if (Blocks(ids, regions, false, true, true)) {
        for (const auto& [host, n] : tables) memory_->tables.Verify(host, n, writes);
        return;
      }
      if (!error_.empty()) return;
      ids.clear();
    }
    for (const auto& [host, n] : tables) TableBlocks(host, n, &ids);
    Blocks(ids, regions, false, true);
  }

  // The device copy of a block table's first n entries, from the backend's table cache (else
  // copied for this op alone). A table of no entries still gets an address, as In gives one:
  // a query that sees no entry yet keeps its sequence's table, which the kernels ask for.
  const int32_t* Table(const int32_t* host, int64_t n) {
    if (host == nullptr || !error_.empty()) return nullptr;
    if (n <= 0) return In(host, n);
    std::string e;
    if (const int32_t* device = memory_->tables.Prepare(host, n, &e)) return device;
    if (!Check(e)) return nullptr;
    return In(host, n);
  }

  // The device copy of sequence s's window ring from the backend's ring cache (when the ring
  // carries its slots' versions), its changed slots to be sent by SendRings: false when it has no
  // versions or the cache has no room (the caller copies the ring for this op alone).
  bool Ring(const k::SparseAttentionParams& p, const k::AttentionSequence& s, const uint8_t** codes,
            const uint8_t** scales, int64_t* slot_bytes) {
    if (s.ring_versions == nullptr || s.ring_codes == nullptr || p.window <= 0 ||
        s.ring_slot_bytes != 0) {
      return false;
    }
    uint8_t* device = memory_->rings.Prepare(s.ring_codes, s.ring_scales, s.ring_versions, p.window,
                                             p.head_dim, &rings_);
    if (device == nullptr) return false;
    *codes = device;
    *scales = device + p.head_dim;
    *slot_bytes = static_cast<int64_t>(RingCache::SlotBytes(p.head_dim));
    return true;
  }

  // The ring slots the op's Ring calls found changed, to their device copies: one run as a copy,
  // more as one copy (packed where small) that a kernel spreads. Before the launch; false on an
  // error.
  bool SendRings() {
    RingCache::Pending& pending = rings_;
    if (pending.runs.empty()) return error_.empty();
    // After an error nothing is sent, and the rings drop the versions they took (Sent).
    bool ok = error_.empty();
    if (ok && pending.runs.size() == 1) {
      ok = Check(
          memory_->traffic.Up(pending.runs[0].to, pending.bytes.data(), pending.bytes.size()));
    } else if (ok) {
      const void* src = Upload(pending.bytes.data(), pending.bytes.size());
      const void* runs =
          src == nullptr ? nullptr
                         : Upload(pending.runs.data(), pending.runs.size() * sizeof(g::ByteRun));
      ok = runs != nullptr && Flush() &&
           Check(g::ScatterOnDevice(src, static_cast<const g::ByteRun*>(runs),
                                    static_cast<int64_t>(pending.runs.size())));
    }
    memory_->rings.Sent(pending, ok ? 1 : 0, ok);
    pending = {};
    return ok;
  }

  // After the launch: waits for the kernels and copies the outputs back.
  OpStatus Finish(OpStatus launched) {
    if (!error_.empty()) return OpStatus::kDeviceError;
    if (launched != OpStatus::kOk) return launched;
    for (KeptBuffers::Buffer* k : kept_written_) k->where = KeptBuffers::Where::kDevice;
    // An op whose outputs all stay on the device is not waited for: the next op on the stream
    // runs after it, and a host read of its outputs (ToHost) waits for it.
    for (const Written& w : written_) {
      for (int64_t id : w.ids) memory_->kv.Wrote(id, w.lo, w.hi, w.pool);
    }
    std::vector<Download> downloads;
    for (const Copy& c : back_) downloads.push_back({c.host, c.device, c.bytes});
    for (const Gathered& s : scatter_) {
      for (size_t i = 0; i < s.host.size(); ++i) {
        downloads.push_back({s.host[i], s.device + i * s.span, s.bytes});
      }
    }
    return Check(memory_->Bring(downloads)) ? OpStatus::kOk : OpStatus::kDeviceError;
  }

 private:
  struct Copy {
    void* host;
    const void* device;
    size_t bytes;
  };
  // Block spans gathered into one staging buffer: host[i]'s `bytes` at staging[i * span].
  struct Gathered {
    std::vector<uint8_t*> host;
    std::vector<uint8_t> staging;
    const uint8_t* device;
    size_t bytes, span;
  };

  template <class T>
  T* Map(T* host, int64_t count, bool upload, bool write) {
    if (host == nullptr || !error_.empty()) return nullptr;
    const size_t bytes = Count(count) * sizeof(T);
    bool straddles = false;
    if (KeptBuffers::Buffer* k = memory_->kept.Find(host, bytes, &straddles)) {
      // A kept buffer is read and written in place, its device copy made current first.
      if (!Check(memory_->kept.MakeCurrent(k))) return nullptr;
      if (write) kept_written_.push_back(k);
      const size_t at = reinterpret_cast<const uint8_t*>(host) - k->host;
      return reinterpret_cast<T*>(k->device + at);
    }
    if (straddles) {
      error_ = "an op's operand runs past the end of a kept buffer";
      return nullptr;
    }
    for (Copy& c : mapped_) {
      if (c.host == host && bytes <= c.bytes) {
        if (write) back_.push_back({host, c.device, bytes});
        return static_cast<T*>(const_cast<void*>(c.device));
      }
    }
    void* device = upload && bytes > 0 ? Upload(host, bytes) : memory_->Scratch(bytes, &error_);
    if (device == nullptr) return nullptr;
    mapped_.push_back({host, device, bytes});
    if (write) back_.push_back({host, device, bytes});
    return static_cast<T*>(device);
  }

  bool Check(const std::string& e) {
    if (!e.empty() && error_.empty()) error_ = e;
    return e.empty();
  }

  static constexpr size_t kPackLargest = size_t{4} << 10, kPackRegion = size_t{64} << 10;

  // A device copy of `bytes` at `host` for this op: packed when small (uploaded at the next
  // Flush), else workspace of its own uploaded now. Null on an error.
  void* Upload(const void* host, size_t bytes) {
    if (bytes == 0 || bytes > kPackLargest) {
      void* device = memory_->Scratch(bytes, &error_);
      if (device == nullptr || !Check(memory_->traffic.Up(device, host, bytes))) return nullptr;
      return device;
    }
    std::vector<uint8_t>& pack = memory_->pack;
    size_t at = (pack.size() + 15) / 16 * 16;
    if (pack_device_ == nullptr || at + bytes > kPackRegion) {
      if (!Flush()) return nullptr;
      pack_device_ = static_cast<uint8_t*>(memory_->Scratch(kPackRegion, &error_));
      if (pack_device_ == nullptr) return nullptr;
      pack.clear();
      flushed_ = at = 0;
    }
    pack.resize(at + bytes);
    std::memcpy(&pack[at], host, bytes);
    return pack_device_ + at;
  }

  // Blocks of the KV arena an op writes: the bytes [lo, hi) of each go back to the host pool.
  struct Written {
    std::vector<int64_t> ids;
    size_t lo, hi;
    k::PagedRows pool;
  };

  DeviceMemory* memory_;
  RingCache::Pending rings_;        // Ring slots to send before the launch (SendRings).
  uint8_t* pack_device_ = nullptr;  // The pack's region (memory_->pack its host bytes).
  size_t flushed_ = 0;              // The pack's bytes uploaded so far.
  std::vector<Copy> mapped_, back_;
  std::vector<Gathered> scatter_;
  std::vector<Written> written_;
  std::vector<KeptBuffers::Buffer*> kept_written_;
  std::string error_;
};

// A matrix instruction's name in the numerics string and the report (mma.sync or its stand-in:
// none, which those strings predate).
std::string_view InstructionName(g::MatrixInstruction instruction) {
  switch (instruction) {
    case g::MatrixInstruction::kWgmma:
      return "wgmma";
    case g::MatrixInstruction::kMfma:
      return "mfma";
    case g::MatrixInstruction::kMma:
      break;
  }
  return "";
}

// The backend's numerics string: `<backend>/4`, `<backend>-matrix/5` or
// `<backend>-matrix-<instruction>/5` (5 since wo_a runs on matrix cores in that mode;
// `hip-matrix-mfma/6` since it runs on AMD's instruction there, where it took mma.sync's
// stand-in).
std::string Numerics(bool matrix, g::MatrixInstruction instruction) {
  std::string numerics(g::kBackendName);
  if (!matrix) return numerics + "/4";
  numerics += "-matrix";
  const std::string_view name = InstructionName(instruction);
  if (!name.empty()) numerics += "-" + std::string(name);
  return numerics + (instruction == g::MatrixInstruction::kMfma ? "/6" : "/5");
}

class GpuBackend final : public Backend {
 public:
  // `instruction`: of the matrix-core GEMMs (MakeGpuBackend's choice for the device's code).
  GpuBackend(int device, const GpuOptions& options, g::MatrixInstruction instruction)
      : device_(device),
        matrix_(options.matrix_gemms),
        instruction_(instruction),
        numerics_(Numerics(options.matrix_gemms, instruction)) {
    if (!options.queued_uploads) memory_.traffic.staging.set_largest(0);
    memory_.rings.set_budget(options.ring_cache_bytes);
  }
  std::string_view name() const override { return g::kBackendName; }
  // The kernels give the CPU's bits (kernels/gpu/ops.h), but for the matrix-core GEMMs, and on
  // an H200 the whole forward pass did (backend_equivalence_test); the cache still keys each
  // backend apart: sharing the CPU's string wants HIP shown on a device too.
  std::string_view numerics() const override { return numerics_; }

  BackendReport Report() const override {
    BackendReport r{std::string(name()), "", 0, 0};
    std::lock_guard<std::mutex> lock(mu_);
    if (!g::SetDevice(device_).empty() || !g::DeviceName(&r.device).empty()) r.device = "unknown";
    if (matrix_) {
      // Asked of the device once (a kernel and a copy back), the first time: at start-up.
      // (The warpgroup and AMD's instructions were asked for at start-up, by MakeGpuBackend.)
      if (const std::string_view instruction = InstructionName(instruction_);
          !instruction.empty()) {
        r.gemms = "matrix " + std::string(instruction);
      } else {
        if (native_ < 0) native_ = g::MatrixCoresNative() ? 1 : 0;
        r.gemms = native_ == 1 ? "matrix" : "matrix stand-in";
      }
    }
    if (device_ > 0) r.device += " #" + std::to_string(device_);
    size_t free_bytes = 0, total = 0;
    if (g::MemoryInfo(&free_bytes, &total).empty()) r.memory_total = total;
    r.memory_in_use = memory_.bytes();
    r.kv_device_bytes = memory_.kv.bytes();
    r.kv_blocks_copied = memory_.kv.copied();
    r.ring_device_bytes = memory_.rings.bytes();
    r.ring_slots_copied = memory_.rings.slots_copied();
    r.ring_uploads = memory_.rings.uploads();
    r.table_entries_copied = memory_.tables.entries_copied();
    r.kv_versions_compared = memory_.kv.compared();
    r.device_ops = ops_;
    r.kernel_launches = g::KernelLaunches();
    r.early_launch = g::EarlyLaunch();
    r.weight_bytes = memory_.weight_bytes();
    r.bytes_to_device = memory_.traffic.to_device;
    r.bytes_zeroed = memory_.traffic.zeroed;
    r.bytes_to_host = memory_.traffic.to_host;
    r.waits = memory_.traffic.waits + memory_.traffic.staging.waits();
    r.uploads_queued = memory_.traffic.staging.queued();
    r.uploads_waited = memory_.traffic.staging.copied();
    r.downloads = memory_.traffic.downloads;
    r.kept_reused = memory_.kept.reused();
    return r;
  }

  OpStatus Linear(const k::LinearParams& p) const override {
    if (const OpStatus s = k::LinearAlsoFits(p); s != OpStatus::kOk) return s;
    if (const OpStatus s = k::LinearRopeFits(p); s != OpStatus::kOk) return s;
    if (p.also_count > 0 && p.format == k::WeightFormat::kDense) {
      if (p.rope_dim == 0) return DenseLinears(p);
      k::LinearParams q = p;  // The op, then its rotation.
      q.rope_dim = 0;
      const OpStatus s = DenseLinears(q);
      return s != OpStatus::kOk ? s : Rope(k::LinearRope(p));
    }
    return Run([&](Call& c) {
      k::LinearParams d = p;
      d.stream = nullptr;
      const int64_t groups = p.groups > 0 ? p.groups : 1;  // The op refuses the rest.
      d.x = c.In(p.x, p.rows * groups * p.in);
      d.w = d.w_scales = nullptr;
      d.dense = nullptr;
      if (p.format == k::WeightFormat::kFp8 || p.format == k::WeightFormat::kFp4) {
        const k::StoredBytes stored = k::QuantizedWeightBytes(p.format, p.out, p.in);
        d.w = c.Weight(p.w, stored.codes);
        d.w_scales = c.Weight(p.w_scales, stored.scales);
        if (p.up != nullptr) {  // The gated pair (workspace: the caller's, kept or not).
          d.up = c.Weight(p.up, stored.codes);
          d.up_scales = c.Weight(p.up_scales, stored.scales);
          d.row_weights = c.In(p.row_weights, p.rows);
          d.gate = c.Out(p.gate, p.rows * p.out);
          d.up_out = c.Out(p.up_out, p.rows * p.out);
        }
      } else if (p.format == k::WeightFormat::kDense) {
        DenseWeights(c, p, d);
      } else if (p.format == k::WeightFormat::kFp8Dense) {
        // The codes of these rows; the scales of the tiles they reach (of a larger matrix when
        // the rows are a slice of it, uploaded whole beforehand).
        d.w = c.Weight(p.w, groups * p.out * p.in);
        d.w_scales = c.Weight(
            p.w_scales, k::QuantizedWeightBytes(p.format, p.w_row0 + groups * p.out, p.in).scales);
      } else {
        d.w = c.Weight(p.w, p.out * p.in * 2);
      }
      // The projections of `also` (FP8, FP4 or BF16 codes): their weights and outputs (the list
      // stays on the host).
      std::vector<k::LinearProjection> also(static_cast<size_t>(p.also_count));
      for (int64_t j = 0; j < p.also_count; ++j) {
        const k::LinearProjection& a = p.also[j];
        if (p.format == k::WeightFormat::kBf16) {
          also[j].w = c.Weight(a.w, a.out * p.in * 2);
        } else {
          const k::StoredBytes stored = k::QuantizedWeightBytes(p.format, a.out, p.in);
          also[j].w = c.Weight(a.w, stored.codes);
          also[j].w_scales = c.Weight(a.w_scales, stored.scales);
        }
        also[j].out = a.out;
        also[j].y = c.Out(a.y, p.rows * a.out);
      }
      d.also = also.data();
      const bool codes = p.format == k::WeightFormat::kFp8 || p.format == k::WeightFormat::kFp4;
      c.XCodes(d.x_codes, d.x_scales, p.rows * p.in, p.x_quantized && codes);
      // On matrix cores for every row count, so that a row's results do not depend on how the
      // rows were batched (there an op a projection).
      const bool matrix = matrix_ && g::LinearMatrixTakes(k::LinearAlone(d, -1));
      d.y = c.Out(p.y, p.rows * groups * p.out);
      c.CodesOut(d.y_codes, d.y_code_scales, p.rows * groups * p.out);  // For the next Linear.
      if (p.rope_dim > 0) {  // The rows' positions and the layer's frequencies.
        d.rope_positions = c.In(p.rope_positions, p.rows);
        d.rope_freqs = c.Weight(p.rope_freqs, p.rope_dim / 2);
      }
      // A row's codes written by its GEMV as it writes y: counters for its 32-column blocks.
      unsigned* arrivals =
          p.y_codes != nullptr && p.rows == 1 ? c.Counters(groups * p.out / 32) : nullptr;
      return Launch(c, [&] {
        if (!matrix) return g::Linear(d, arrivals);
        OpStatus s = OpStatus::kOk;
        for (int64_t j = -1; j < d.also_count && s == OpStatus::kOk; ++j) {
          s = g::LinearMatrix(k::LinearAlone(d, j), instruction_);
        }
        return s;
      });
    });
  }

  // A dense Linear and its `also` (host fp32 weights): one op where the device keeps every
  // weight alike (BF16 codes, or fp32 where one is not all BF16 values), else an op each.
  OpStatus DenseLinears(const k::LinearParams& p) const {
    bool alike = true;
    const OpStatus s = Run([&](Call& c) {
      k::LinearParams d = p;
      d.stream = nullptr;
      const bool bf16 = DenseWeights(c, p, d);
      std::vector<k::LinearProjection> also(static_cast<size_t>(p.also_count));
      for (int64_t j = 0; j < p.also_count && alike; ++j) {
        bool same = false;
        const void* wj = c.DenseWeight(p.also[j].dense, p.also[j].out * p.in, &same);
        alike = same == bf16;
        also[j].w = bf16 ? static_cast<const uint8_t*>(wj) : nullptr;
        also[j].dense = bf16 ? nullptr : static_cast<const float*>(wj);
      }
      if (!alike) return OpStatus::kOk;  // Nothing mapped or launched; an op each below.
      d.x = c.In(p.x, p.rows * p.in);
      for (int64_t j = 0; j < p.also_count; ++j) {
        also[j].out = p.also[j].out;
        also[j].y = c.Out(p.also[j].y, p.rows * p.also[j].out);
      }
      d.also = also.data();
      d.y = c.Out(p.y, p.rows * p.out);
      return Launch(c, [&] { return g::Linear(d); });
    });
    if (s != OpStatus::kOk || alike) return s;
    for (int64_t j = -1; j < p.also_count; ++j) {
      if (const OpStatus e = Linear(k::LinearAlone(p, j)); e != OpStatus::kOk) return e;
    }
    return OpStatus::kOk;
  }

  OpStatus RoundBf16(const k::RoundBf16Params& p) const override {
    return Run([&](Call& c) {
      k::RoundBf16Params d = p;
      d.stream = nullptr;
      d.x = c.InOut(p.x, p.n);
      return Launch(c, [&] { return g::RoundBf16(d); });
    });
  }

  OpStatus RmsNorm(const k::RmsNormParams& p) const override {
    if (const OpStatus s = k::RmsNormFits(p); s != OpStatus::kOk) return s;
    return Run([&](Call& c) {
      // Each norm's arrays (this op's, and its next's) on the device.
      const auto on_device = [&](const k::RmsNormParams& q) {
        k::RmsNormParams d = q;
        d.stream = nullptr;
        d.x = c.InOut(q.x, q.rows > 0 ? (q.rows - 1) * q.stride + q.dim : 0);
        d.weight = c.Weight(q.weight, q.dim);
        if (q.rope_dim > 0) {  // The rotation after the norm.
          d.positions = c.In(q.positions, q.rows);
          d.freqs = c.Weight(q.freqs, q.rope_dim / 2);
        }
        c.CodesOut(d.codes, d.code_scales, q.rows * q.dim);  // For the Linear reading the rows.
        // The copy's rows: up to the last one written (the others between keep their bytes).
        int64_t copies = 0;
        for (int64_t r = 0; q.copy_to != nullptr && r < q.rows; ++r) {
          copies = std::max(copies, q.copy_rows[r] + 1);
        }
        d.copy_rows = copies > 0 ? c.In(q.copy_rows, q.rows) : nullptr;
        d.copy_to = copies > 0 ? c.InOut(q.copy_to, copies * q.dim) : nullptr;
        return d;
      };
      k::RmsNormParams d = on_device(p), next;
      if (p.next != nullptr) {
        next = on_device(*p.next);
        d.next = &next;
      }
      return Launch(c, [&] { return g::RmsNorm(d); });
    });
  }

  OpStatus Rope(const k::RopeParams& p) const override {
    return Run([&](Call& c) {
      k::RopeParams d = p;
      d.stream = nullptr;
      d.x = c.InOut(p.x, p.rows > 0 ? (p.rows - 1) * p.row_stride + p.heads * p.head_dim : 0);
      d.positions = c.In(p.positions, p.rows);
      d.freqs = c.Weight(p.freqs, p.rope_dim / 2);
      return Launch(c, [&] { return g::Rope(d); });
    });
  }

  OpStatus FakeQuant(const k::FakeQuantParams& p) const override {
    return Run([&](Call& c) {
      k::FakeQuantParams d = p;
      d.stream = nullptr;
      d.x = c.InOut(p.x, p.n);
      return Launch(c, [&] { return g::FakeQuant(d); });
    });
  }

  OpStatus Embed(const k::EmbedParams& p) const override {
    for (int64_t t = 0; t < p.count; ++t) {
      if (p.tokens[t] < 0 || p.tokens[t] >= p.vocab) return OpStatus::kBadArgument;
    }
    return Run([&](Call& c) {
      k::EmbedParams d = p;
      d.stream = nullptr;
      d.tokens = c.In(p.tokens, p.count);
      if (p.embed != nullptr) {
        bool bf16 = false;
        const void* table = c.DenseWeight(p.embed, p.vocab * p.dim, &bf16);
        d.embed = bf16 ? nullptr : static_cast<const float*>(table);
        d.embed_bf16 = bf16 ? static_cast<const uint16_t*>(table) : nullptr;
      } else {
        d.embed_bf16 = c.Weight(p.embed_bf16, p.vocab * p.dim);
      }
      d.X = c.Out(p.X, p.count * p.hc * p.dim);
      return Launch(c, [&] { return g::Embed(d); });
    });
  }

  OpStatus HcMix(const k::HcMixParams& p) const override {
    return Run([&](Call& c) {
      const int64_t mix = (2 + p.hc) * p.hc, streams = p.rows * p.hc * p.dim;
      k::HcMixParams d = p;
      d.stream = nullptr;
      d.X = c.In(p.X, streams);
      d.fn = c.Weight(p.fn, mix * p.hc * p.dim);
      d.scale = c.Weight(p.scale, 3);
      d.base = c.Weight(p.base, mix);
      // The steps' inputs mapped before the outputs, which may alias them.
      if (p.sub != nullptr) {
        d.sub = c.In(p.sub, p.rows * p.dim);
        d.expand_post = c.In(p.expand_post, p.rows * p.hc);
        d.expand_comb = c.In(p.expand_comb, p.rows * p.hc * p.hc);
      }
      if (p.x != nullptr) {
        d.collapse_weights = c.In(p.collapse_weights, p.rows * p.hc);
        if (p.collapse_norm != nullptr) d.collapse_norm = c.Weight(p.collapse_norm, p.dim);
      }
      d.mixes = c.Out(p.mixes, p.rows * mix);
      d.pre = c.Out(p.pre, p.rows * p.hc);
      d.post = c.Out(p.post, p.rows * p.hc);
      d.comb = c.Out(p.comb, p.rows * p.hc * p.hc);
      if (p.sub != nullptr) d.expanded = c.Out(p.expanded, streams);
      if (p.x != nullptr) d.x = c.Out(p.x, p.rows * p.dim);
      c.CodesOut(d.x_codes, d.x_code_scales, p.rows * p.dim);  // For the Linears reading x.
      // A decode step's rows in one kernel (g::HcMixFused).
      g::HcMixFused fused;
      if (p.rows > 0 && p.rows <= g::kHcFusedRows) {
        fused.sums = c.Work<double>(p.rows);
        fused.arrivals = c.Counters(p.rows);
      }
      return Launch(c, [&] { return g::HcMix(d, &fused); });
    });
  }

  OpStatus HcCollapse(const k::HcCollapseParams& p) const override {
    return Run([&](Call& c) {
      k::HcCollapseParams d = p;
      d.stream = nullptr;
      d.X = c.In(p.X, p.rows * p.hc * p.dim);
      d.weights = c.In(p.weights, p.rows * p.hc);
      d.norm_weight = c.Weight(p.norm_weight, p.dim);
      d.x = c.Out(p.x, p.rows * p.dim);
      c.CodesOut(d.codes, d.code_scales, p.rows * p.dim);
      return Launch(c, [&] { return g::HcCollapse(d); });
    });
  }

  OpStatus HcExpand(const k::HcExpandParams& p) const override {
    return Run([&](Call& c) {
      k::HcExpandParams d = p;
      d.stream = nullptr;
      d.X = c.In(p.X, p.rows * p.hc * p.dim);
      d.sub = c.In(p.sub, p.rows * p.dim);
      d.post = c.In(p.post, p.rows * p.hc);
      d.comb = c.In(p.comb, p.rows * p.hc * p.hc);
      d.out = c.Out(p.out, p.rows * p.hc * p.dim);
      return Launch(c, [&] { return g::HcExpand(d); });
    });
  }

  OpStatus CompressPool(const k::CompressPoolParams& p) const override {
    int64_t completing = 0;
    for (int64_t r = 0; r < p.rows && p.ratio > 0; ++r) {
      if ((p.positions[r] + 1) % p.ratio == 0) ++completing;
    }
    const bool several = p.sequence_rows != nullptr;
    if (several &&
        (p.sequence_count <= 0 || p.kv_partials == nullptr || p.score_partials == nullptr ||
         p.sequence_rows[0] != 0 || p.sequence_rows[p.sequence_count] != p.rows)) {
      return OpStatus::kBadShape;
    }
    return Run([&](Call& c) {
      k::CompressPoolParams d = p;
      d.stream = nullptr;
      d.kv = c.In(p.kv, p.rows * p.dim);
      d.score = c.In(p.score, p.rows * p.dim);
      d.positions = c.In(p.positions, p.rows);
      // Each sequence's partial groups (kept on the device through a step), and a table of them.
      std::vector<float*> kv_partials, score_partials;
      for (int64_t s = 0; several && s < p.sequence_count; ++s) {
        kv_partials.push_back(c.InOut(p.kv_partials[s], p.ratio * p.dim));
        score_partials.push_back(c.InOut(p.score_partials[s], p.ratio * p.dim));
      }
      if (several) {
        d.sequence_rows = c.In(p.sequence_rows, p.sequence_count + 1);
        d.kv_partials = c.In(kv_partials.data(), p.sequence_count);
        d.score_partials = c.In(score_partials.data(), p.sequence_count);
      } else {
        d.kv_partial = c.InOut(p.kv_partial, p.ratio * p.dim);
        d.score_partial = c.InOut(p.score_partial, p.ratio * p.dim);
      }
      d.pooled = c.Out(p.pooled, completing * p.dim);
      return Launch(c, [&] { return g::CompressPool(d); });
    });
  }

  OpStatus CompressWrite(const k::CompressWriteParams& p) const override {
    return Run([&](Call& c) {
      k::CompressWriteParams d = p;
      d.stream = nullptr;
      d.latent = c.InOut(p.latent, p.groups * p.head_dim);
      d.key = c.InOut(p.key, p.groups * p.index_dim);
      d.positions = c.In(p.positions, p.groups);
      d.freqs = c.Weight(p.freqs, p.rope_dim / 2);
      d.rows = c.In(p.rows, p.groups);
      const std::vector<int64_t> rows(p.rows, p.rows + Count(p.groups));
      if (p.key != nullptr) {
        c.Blocks(rows, {&d.kv_codes, &d.kv_scales, &d.key_codes, &d.key_scales}, true);
      } else {
        c.Blocks(rows, {&d.kv_codes, &d.kv_scales}, true);
      }
      return Launch(c, [&] { return g::CompressWrite(d); });
    });
  }

  OpStatus IndexerScores(const k::IndexerScoreParams& p) const override {
    const bool several = p.token_sequence != nullptr;
    const int64_t count = several ? p.sequence_count : 1;
    if (several && (p.block_tables == nullptr || count <= 0)) return OpStatus::kBadShape;
    // Per sequence: the most entries its queries see.
    std::vector<int64_t> visible(static_cast<size_t>(count), 0);
    for (int64_t t = 0; t < p.tokens; ++t) {
      const int64_t s = several ? p.token_sequence[t] : 0;
      if (s < 0 || s >= count) return OpStatus::kBadShape;
      visible[s] = std::max(visible[s], p.visible[t]);
    }
    return Run([&](Call& c) {
      k::IndexerScoreParams d = p;
      d.stream = nullptr;
      d.q = c.In(p.q, p.tokens * p.heads * p.dim);
      d.weights = c.In(p.weights, p.tokens * p.heads);
      d.visible = c.In(p.visible, p.tokens);
      const int64_t per_block = std::max<int64_t>(p.key_codes.rows_per_block, 1);
      // Each sequence's table on the device, the blocks of all of them mapped at once.
      std::vector<const int32_t*> tables(visible.size());
      std::vector<std::pair<const int32_t*, int64_t>> reads;
      for (size_t s = 0; s < visible.size(); ++s) {
        const int32_t* table = several ? p.block_tables[s] : p.block_table;
        const int64_t blocks = (visible[s] + per_block - 1) / per_block;
        tables[s] = c.Table(table, blocks);
        reads.emplace_back(table, blocks);
      }
      if (several) {
        d.token_sequence = c.In(p.token_sequence, p.tokens);
        d.block_tables = c.In(tables.data(), count);
      } else {
        d.block_table = tables[0];
      }
      c.TableReads(reads, {&d.key_codes, &d.key_scales});
      d.mask = c.In(p.mask, p.tokens * p.stride);
      d.scores = c.Out(p.scores, p.tokens * p.stride);
      return Launch(c, [&] { return g::IndexerScores(d); });
    });
  }

  OpStatus TopK(const k::TopKParams& p) const override {
    if (p.order == k::TopKOrder::kReference) {
      return OnHost({{p.values, p.rows * p.stride}, {p.n, p.rows}}, {{p.out, p.rows * p.k}},
                    [&] { return k::cpu::TopK(p); });
    }
    return Run([&](Call& c) {
      k::TopKParams d = p;
      d.stream = nullptr;
      d.values = c.In(p.values, p.rows * p.stride);
      d.n = c.In(p.n, p.rows);
      d.out = c.Out(p.out, p.rows * p.k);
      return Launch(c, [&] { return g::TopK(d); });
    });
  }

  OpStatus CandidateFilter(const k::CandidateFilterParams& p) const override {
    if (p.order == k::TopKOrder::kReference) {
      const int64_t blocks = p.block > 0 ? (p.stride + p.block - 1) / p.block : 0;
      return OnHost({{p.scores, p.tokens * p.stride}, {p.block_scores, p.tokens * blocks}},
                    {{p.block_scores, p.tokens * blocks}, {p.mask, p.tokens * p.stride}},
                    [&] { return k::cpu::CandidateFilter(p); });
    }
    return Run([&](Call& c) {
      k::CandidateFilterParams d = p;
      d.stream = nullptr;
      d.scores = c.In(p.scores, p.tokens * p.stride);
      d.visible = c.In(p.visible, p.tokens);
      const int64_t blocks = p.block > 0 ? (p.stride + p.block - 1) / p.block : 0;
      // The block maxima and picks are the op's workspace; the mask it writes whole.
      d.block_scores = c.Work<float>(p.tokens * blocks);
      d.block_top = c.Work<int64_t>(p.tokens * p.top_blocks);
      d.mask = c.Out(p.mask, p.tokens * p.stride);
      return Launch(c, [&] { return g::CandidateFilter(d); });
    });
  }

  OpStatus SparseAttention(const k::SparseAttentionParams& p) const override {
    const int64_t per_block = std::max<int64_t>(p.kv_codes.rows_per_block, 1);
    const bool several = p.token_sequence != nullptr;
    const int64_t count = several ? p.sequence_count : 1;
    if (several && (p.sequences == nullptr || count <= 0)) return OpStatus::kBadShape;
    // Per sequence: its last window position and the blocks its selected entries reach.
    std::vector<k::AttentionSequence> host(static_cast<size_t>(count));
    std::vector<int64_t> last(static_cast<size_t>(count)), table_blocks(host.size(), 0);
    for (int64_t s = 0; s < count; ++s) {
      host[s] = several ? p.sequences[s] : p.SequenceOf(0);
      last[s] = host[s].fresh_first - 1;
    }
    for (int64_t t = 0; t < p.tokens; ++t) {
      const int64_t s = several ? p.token_sequence[t] : 0;
      if (s < 0 || s >= count) return OpStatus::kBadShape;
      last[s] = std::max(last[s], p.window_last != nullptr ? p.window_last[t] : p.positions[t]);
      if (p.selected_stride > 0 && p.selected_bound != nullptr) {
        table_blocks[s] =
            std::max(table_blocks[s], (p.selected_bound[t] + per_block - 1) / per_block);
        continue;
      }
      for (int64_t j = 0; j < p.selected_stride; ++j) {
        const int64_t e = p.selected[t * p.selected_stride + j];
        if (e >= 0) table_blocks[s] = std::max(table_blocks[s], e / per_block + 1);
      }
    }
    return Run([&](Call& c) {
      k::SparseAttentionParams d = p;
      d.stream = nullptr;
      d.q = c.In(p.q, p.tokens * p.heads * p.head_dim);
      d.positions = c.In(p.positions, p.tokens);
      // Each sequence's ring (from the ring cache, else copied for this op), fresh rows and block
      // table on the device; the blocks of all the tables mapped at once.
      std::vector<k::AttentionSequence> device(host.size());
      std::vector<std::pair<const int32_t*, int64_t>> reads;
      for (size_t s = 0; s < host.size(); ++s) {
        const k::AttentionSequence& h = host[s];
        k::AttentionSequence& v = device[s];
        v.ring_slot_bytes = h.ring_slot_bytes;
        if (!c.Ring(p, h, &v.ring_codes, &v.ring_scales, &v.ring_slot_bytes)) {
          const int64_t slots = std::max<int64_t>(p.window, 1) - 1, stride = h.ring_slot_bytes;
          v.ring_codes =
              c.In(h.ring_codes, stride > 0 ? slots * stride + p.head_dim : p.window * p.head_dim);
          v.ring_scales = c.In(h.ring_scales, stride > 0 ? slots * stride + p.head_dim / 32
                                                         : p.window * p.head_dim / 32);
        }
        v.fresh_first = h.fresh_first;
        v.fresh = c.In(h.fresh, (last[s] - h.fresh_first + 1) * p.head_dim);
        v.block_table = c.Table(h.block_table, table_blocks[s]);
        reads.emplace_back(h.block_table, table_blocks[s]);
      }
      if (several) {
        d.token_sequence = c.In(p.token_sequence, p.tokens);
        d.sequences = c.In(device.data(), count);
      } else {
        d.ring_codes = device[0].ring_codes;
        d.ring_scales = device[0].ring_scales;
        d.ring_slot_bytes = device[0].ring_slot_bytes;
        d.fresh = device[0].fresh;
        d.block_table = device[0].block_table;
      }
      d.ring_versions = nullptr;
      d.window_first = c.In(p.window_first, p.tokens);
      if (p.window_last != nullptr) d.window_last = c.In(p.window_last, p.tokens);
      d.selected = c.In(p.selected, p.tokens * p.selected_stride);
      c.TableReads(reads, {&d.kv_codes, &d.kv_scales});
      d.sink = c.Weight(p.sink, p.heads);
      d.freqs = c.Weight(p.freqs, p.rope_dim / 2);
      d.out = c.Out(p.out, p.tokens * p.heads * p.head_dim);
      // Each query's keys decoded once for all the heads (the same bits as without); a draft
      // block's window keys counted here, where its bounds are on the host.
      if (p.window_last != nullptr) {
        d.draft_keys = 0;
        for (int64_t t = 0; t < p.tokens; ++t) {
          d.draft_keys = std::max(d.draft_keys, p.window_last[t] - p.window_first[t] + 1);
        }
        d.draft_keys = std::max<int64_t>(d.draft_keys, 1);
      }
      d.workspace_floats = g::SparseAttentionWorkspaceFloats(d);
      d.workspace = d.workspace_floats > 0 ? c.Work<float>(d.workspace_floats) : nullptr;
      if (!c.SendRings()) return c.Finish(OpStatus::kDeviceError);
      return Launch(c, [&] { return g::SparseAttention(d); });
    });
  }

  OpStatus MoeRoute(const k::MoeRouteParams& p) const override {
    // The router's logits in the routing's kernel where the device takes them there, else the
    // Linear op, then the rest.
    if (p.router != nullptr && !g::RouterInKernel(p)) {
      if (!k::MoeRouteFits(p)) return OpStatus::kBadShape;  // Before the Linear writes anything.
      if (const OpStatus s = Linear(*p.router); s != OpStatus::kOk) return s;
      k::MoeRouteParams rest = p;
      rest.router = nullptr;
      return MoeRoute(rest);
    }
    // The grouping in the same kernel where the device routes and groups them, else the two
    // ops in turn.
    if (p.group != nullptr) {
      if (!k::MoeGroupFits(k::MoeRouteGroup(p))) return OpStatus::kBadShape;
      if (p.order == k::TopKOrder::kReference || p.experts > k::kMoeGroupMaxExperts) {
        k::MoeRouteParams alone = p;
        alone.group = nullptr;
        const OpStatus s = MoeRoute(alone);
        return s == OpStatus::kOk ? MoeGroup(k::MoeRouteGroup(p)) : s;
      }
    }
    if (p.order == k::TopKOrder::kReference) {
      const int64_t n = p.tokens * p.experts;
      return OnHost(
          {{p.logits, n}},
          {{p.scores, n}, {p.biased, n}, {p.chosen, p.tokens * p.k}, {p.weights, p.tokens * p.k}},
          [&] { return k::cpu::MoeRoute(p); });
    }
    return Run([&](Call& c) {
      k::MoeRouteParams d = p;
      d.stream = nullptr;
      k::LinearParams router;
      if (p.router != nullptr) {  // The logits made in the kernel (RouterInKernel).
        router = *p.router;
        router.stream = nullptr;
        router.x = c.In(p.router->x, p.router->in);
        DenseWeights(c, *p.router, router);
        router.y = c.Out(p.router->y, p.experts);
        d.logits = router.y;
        d.router = &router;
      } else {
        d.logits = c.In(p.logits, p.tokens * p.experts);
      }
      d.bias = c.Weight(p.bias, p.experts);
      d.scores = c.Out(p.scores, p.tokens * p.experts);
      d.biased = c.Out(p.biased, p.tokens * p.experts);
      d.chosen = c.Out(p.chosen, p.tokens * p.k);
      d.weights = c.Out(p.weights, p.tokens * p.k);
      k::MoeGroupParams g;
      unsigned* arrivals = nullptr;
      if (p.group != nullptr) {  // Its outputs; one kernel with the backend's counter.
        g.slots = p.group->slots;
        GroupOutputs(c, *p.group, p.tokens * p.k, g);
        d.group = &g;
        arrivals = c.Counters(1);
      }
      return Launch(c, [&] { return g::MoeRoute(d, arrivals); });
    });
  }

  OpStatus Swiglu(const k::SwigluParams& p) const override {
    return Run([&](Call& c) {
      k::SwigluParams d = p;
      d.stream = nullptr;
      d.gate = c.In(p.gate, p.rows * p.inter);
      d.up = c.In(p.up, p.rows * p.inter);
      d.row_weights = c.In(p.row_weights, p.rows);
      d.h = c.Out(p.h, p.rows * p.inter);
      return Launch(c, [&] { return g::Swiglu(d); });
    });
  }

  OpStatus MoeCombine(const k::MoeCombineParams& p) const override {
    if (p.add != nullptr && (p.y_rows <= 0 || p.out == nullptr)) return OpStatus::kBadShape;
    int64_t rows = p.y_rows;
    for (int64_t i = 0; i < p.count && p.y_rows == 0; ++i) {
      if (p.rows[i] < 0) return OpStatus::kBadArgument;
      rows = std::max(rows, p.rows[i] + 1);
    }
    return Run([&](Call& c) {
      k::MoeCombineParams d = p;
      d.stream = nullptr;
      d.expert_out = c.In(p.expert_out, p.count * p.dim);
      d.rows = c.In(p.rows, p.count);
      d.y = c.InOut(p.y, rows * p.dim);
      if (p.add != nullptr) {  // Then the rounded sum with `add`.
        d.add = c.In(p.add, rows * p.dim);
        d.out = c.Out(p.out, rows * p.dim);
      }
      // Each row's entries binned, then the rows added at once (the same order of adds).
      d.y_rows = rows;
      d.workspace_ints = g::MoeCombineWorkspaceInts(d);
      d.workspace = d.workspace_ints > 0 ? c.Work<int32_t>(d.workspace_ints) : nullptr;
      return Launch(c, [&] { return g::MoeCombine(d); });
    });
  }

  OpStatus MoeGroup(const k::MoeGroupParams& p) const override {
    const int64_t n = p.tokens * p.k;
    if (p.experts > k::kMoeGroupMaxExperts) {  // More than the kernel's one thread block holds.
      return OnHost({{p.chosen, n}, {p.weights, n}},
                    {{p.slot_expert, p.slots},
                     {p.slot_offset, p.slots + 1},
                     {p.slot_tiles, p.slots + 1},
                     {p.rows, n},
                     {p.row_weights, n}},
                    [&] { return k::cpu::MoeGroup(p); });
    }
    return Run([&](Call& c) {
      k::MoeGroupParams d = p;
      d.stream = nullptr;
      d.chosen = c.In(p.chosen, n);
      d.weights = c.In(p.weights, n);
      GroupOutputs(c, p, n, d);
      return Launch(c, [&] { return g::MoeGroup(d); });
    });
  }

  // Dense Linear p's weights as the device keeps them (DenseWeight), in `d`: BF16 codes where
  // every value is a BF16 one (format kBf16, w), else fp32 values (kDense, dense); true for BF16.
  static bool DenseWeights(Call& c, const k::LinearParams& p, k::LinearParams& d) {
    bool bf16 = false;
    const void* w = c.DenseWeight(p.dense, p.out * p.in, &bf16);
    d.format = bf16 ? k::WeightFormat::kBf16 : k::WeightFormat::kDense;
    d.w = bf16 ? static_cast<const uint8_t*>(w) : nullptr;
    d.dense = bf16 ? nullptr : static_cast<const float*>(w);
    return bf16;
  }

  // The grouping's five outputs (of `n` choices) on the device, in `d`.
  static void GroupOutputs(Call& c, const k::MoeGroupParams& p, int64_t n, k::MoeGroupParams& d) {
    d.slot_expert = c.Out(p.slot_expert, p.slots);
    d.slot_offset = c.Out(p.slot_offset, p.slots + 1);
    d.slot_tiles = c.Out(p.slot_tiles, p.slots + 1);
    d.rows = c.Out(p.rows, n);
    d.row_weights = c.Out(p.row_weights, n);
  }

  OpStatus ExpertLinear(const k::ExpertLinearParams& p) const override {
    const k::StoredBytes stored = k::QuantizedWeightBytes(p.format, p.out, p.in);
    return Run([&](Call& c) {
      k::ExpertLinearParams d = p;
      d.stream = nullptr;
      d.x = c.In(p.x, (p.x_rows != nullptr ? p.x_count : p.rows) * p.in);
      d.x_rows = c.In(p.x_rows, p.x_rows != nullptr ? p.rows : 0);
      if (p.x_rows != nullptr) c.CodesIn(d.x_row_codes, d.x_row_scales, p.x_count * p.in);
      d.slot_expert = c.In(p.slot_expert, p.slots);
      d.slot_offset = c.In(p.slot_offset, p.slots + 1);
      d.slot_tiles = c.In(p.slot_tiles, p.slots + 1);
      d.w = c.WeightTable(p.w, p.experts, stored.codes);
      d.w_scales = c.WeightTable(p.w_scales, p.experts, stored.scales);
      c.XCodes(d.x_codes, d.x_scales, p.rows * p.in, p.x_quantized);
      d.y = c.Out(p.y, p.rows * p.out);
      c.CodesOut(d.y_codes, d.y_code_scales, p.rows * p.out);  // For the next ExpertLinear.
      // Rows few enough a slot for the GEMV write their codes as they write y: counters for
      // their 32-column blocks.
      unsigned* arrivals =
          p.y_codes != nullptr && p.slot_rows >= 1 && p.slot_rows <= g::kExpertGemvRows && !matrix_
              ? c.Counters(p.rows * p.out / 32)
              : nullptr;
      if (p.up != nullptr) {  // The gated pair (its two products, where made apart, in the
                              // caller's workspace: kept buffers stay on the device).
        d.up = c.WeightTable(p.up, p.experts, stored.codes);
        d.up_scales = c.WeightTable(p.up_scales, p.experts, stored.scales);
        d.row_weights = c.In(p.row_weights, p.rows);
        d.gate = c.Out(p.gate, p.rows * p.out);
        d.up_out = c.Out(p.up_out, p.rows * p.out);
      }
      return Launch(c, [&] {
        return matrix_ ? g::ExpertLinearMatrix(d, instruction_) : g::ExpertLinear(d, arrivals);
      });
    });
  }

  OpStatus AddRound(const k::AddRoundParams& p) const override {
    return Run([&](Call& c) {
      k::AddRoundParams d = p;
      d.stream = nullptr;
      d.a = c.In(p.a, p.n);
      d.b = c.In(p.b, p.n);
      d.out = c.Out(p.out, p.n);
      return Launch(c, [&] { return g::AddRound(d); });
    });
  }

  OpStatus CopyRows(const k::CopyRowsParams& p) const override {
    int64_t src_rows = p.rows;
    if (p.src_rows > 0) {
      src_rows = p.src_rows;
    } else if (p.index != nullptr) {
      src_rows = 0;
      for (int64_t i = 0; i < p.rows; ++i) {
        if (p.index[i] < 0) return OpStatus::kBadArgument;
        src_rows = std::max(src_rows, p.index[i] + 1);
      }
    }
    auto span = [](int64_t rows, int64_t stride, int64_t cols) {
      return rows > 0 ? (rows - 1) * stride + cols : 0;
    };
    return Run([&](Call& c) {
      k::CopyRowsParams d = p;
      d.stream = nullptr;
      d.src = c.In(p.src, span(src_rows, p.src_stride, p.cols));
      if (p.index != nullptr) d.index = c.In(p.index, p.rows);
      // Between rows the destination keeps its bytes, so it goes up and comes back whole.
      d.dst = c.InOut(p.dst, span(p.rows, p.dst_stride, p.cols));
      return Launch(c, [&] { return g::CopyRows(d); });
    });
  }

  OpStatus EngramGather(const k::EngramGatherParams& p) const override {
    const int64_t out = p.tokens * p.columns * p.head_dim;
    return OnHost({}, {{p.out, out}}, [&] { return k::cpu::EngramGather(p); });
  }

  OpStatus EngramGate(const k::EngramGateParams& p) const override {
    return Run([&](Call& c) {
      k::EngramGateParams d = p;
      d.stream = nullptr;
      d.X = c.InOut(p.X, p.tokens * p.hc * p.dim);
      d.kv = c.In(p.kv, p.tokens * (p.hc + 1) * p.dim);
      d.qk = c.Weight(p.qk, p.hc * p.dim);
      return Launch(c, [&] { return g::EngramGate(d); });
    });
  }

  bool copies_weights() const override { return true; }
  OpStatus Upload(const void* host, size_t bytes) const override {
    return OnDevice([&] {
      std::string e;
      memory_.Weight(host, bytes, &e);
      return e;
    });
  }
  OpStatus UploadDense(const float* host, size_t count) const override {
    return OnDevice([&] {
      std::string e;
      bool bf16 = false;
      memory_.DenseWeight(host, count, &bf16, &e);
      return e;
    });
  }

  void Keep(float* host, size_t count, KeepAs as, uint64_t content) const override {
    std::lock_guard<std::mutex> lock(mu_);
    if (g::SetDevice(device_).empty()) memory_.kept.Keep(Bytes(host), count * 4, as, content);
  }
  void Release(const float* host, uint64_t content) const override {
    std::lock_guard<std::mutex> lock(mu_);
    memory_.kept.Release(host, content);
  }
  OpStatus ToHost(const float* host, size_t count) const override {
    return OnDevice([&] { return memory_.kept.ToHost(host, count * 4); });
  }
  OpStatus HostWrote(const float* host, size_t count) const override {
    return OnDevice([&] { return memory_.kept.HostWrote(host, count * 4); });
  }
  // The KV rows and kept buffers the device wrote, to the host in one wait (Bring).
  OpStatus Settle() const override {
    return OnDevice([&] {
      std::vector<Download> downloads;
      memory_.kv.Written(&downloads);
      memory_.kept.Settle(&downloads);
      const std::string e = memory_.Bring(downloads);
      memory_.Reset();
      return e;
    });
  }

  // The last device error, for the log.
  std::string last_error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return last_error_;
  }

 private:
  template <class F>
  OpStatus Run(F body) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (const std::string e = g::SetDevice(device_); !e.empty()) {
      last_error_ = e;
      return OpStatus::kDeviceError;
    }
    Call c(&memory_);
    ++ops_;
    const OpStatus s = body(c);
    if (s == OpStatus::kDeviceError) last_error_ = c.error();
    return s;
  }

  static uint8_t* Bytes(float* p) { return reinterpret_cast<uint8_t*>(p); }

  // Runs `f` (device calls giving "" or the first error) on this backend's device, under the
  // lock that serialises its ops.
  template <class F>
  OpStatus OnDevice(F f) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (const std::string e = g::SetDevice(device_); !e.empty()) return Checked(e);
    return Checked(f());
  }

  // A device call's error as an op's status, kept for the log. REQUIRES: mu_ held.
  OpStatus Checked(const std::string& e) const {
    if (e.empty()) return OpStatus::kOk;
    last_error_ = e;
    return OpStatus::kDeviceError;
  }

  // An operand of an op the CPU runs for this backend: `n` values at `p`.
  struct HostRange {
    template <class T>
    HostRange(const T* p, int64_t n) : host(p), bytes(Count(n) * sizeof(T)) {}
    const void* host;
    size_t bytes;
  };
  // An op that runs on the host (the Engram gather; the reference's top-k order): kept buffers
  // among its inputs are brought to the host first, and those among its outputs get the bytes
  // it wrote.
  template <class F>
  OpStatus OnHost(std::initializer_list<HostRange> in, std::initializer_list<HostRange> out,
                  F op) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (const OpStatus s = Checked(g::SetDevice(device_)); s != OpStatus::kOk) return s;
    for (const HostRange& r : in) {
      if (r.host == nullptr || r.bytes == 0) continue;
      if (const OpStatus s = Checked(memory_.kept.ToHost(r.host, r.bytes)); s != OpStatus::kOk) {
        return s;
      }
    }
    const OpStatus s = op();
    if (s != OpStatus::kOk) return s;
    for (const HostRange& r : out) {
      if (r.host == nullptr || r.bytes == 0) continue;
      if (const OpStatus w = Checked(memory_.kept.HostWrote(r.host, r.bytes)); w != OpStatus::kOk) {
        return w;
      }
    }
    return OpStatus::kOk;
  }

  template <class L>
  static OpStatus Launch(Call& c, L launch) {
    if (!c.Flush()) return c.Finish(OpStatus::kDeviceError);
    return c.Finish(launch());
  }

  const int device_;
  const bool matrix_;                       // GpuOptions::matrix_gemms.
  const g::MatrixInstruction instruction_;  // Of the matrix-core GEMMs.
  mutable int native_ = -1;                 // MatrixCoresNative(), once asked (under mu_).
  const std::string numerics_;
  mutable std::mutex mu_;
  mutable DeviceMemory memory_;
  mutable std::string last_error_;
  mutable uint64_t ops_ = 0;  // Ops run on the device (Run), under mu_.
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> MakeGpuBackend(int device, const GpuOptions& options) {
  std::string reason;
  const int count = g::DeviceCount(&reason);
  const std::string kind(g::kBackendName);
  if (count == 0) return Unavailable(kind + ": " + reason);
  if (device < 0 || device >= count) {
    return Unavailable(kind + ": no device " + std::to_string(device) + " (" +
                       std::to_string(count) + " found)");
  }
  // Hopper's warpgroup instruction where the device's code has it (sm_90a), AMD's where its code
  // has that (gfx908, gfx90a, gfx940-gfx942), else mma.sync or its stand-in, for every matrix
  // GEMM: one instruction for all rows, so that a row's sums do not depend on its batch.
  auto instruction = g::MatrixInstruction::kMma;
  if (const std::string e = g::SetDevice(device); !e.empty()) return Unavailable(kind + ": " + e);
  g::SetEarlyLaunch(options.early_launch);  // Asked of the device's code, as the instructions are.
  if (options.matrix_gemms) {
    if (g::MatrixWgmmaNative()) {
      instruction = g::MatrixInstruction::kWgmma;
    } else if (g::MatrixMfmaNative()) {
      instruction = g::MatrixInstruction::kMfma;
    }
  }
  return std::unique_ptr<Backend>(std::make_unique<GpuBackend>(device, options, instruction));
}

}  // namespace flashd::engine::FLASHD_GPU_BACKEND
