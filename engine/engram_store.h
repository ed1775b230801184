// EngramStore: the Engram tables' rows read from the checkpoint's files on SSD, for boxes whose
// memory does not hold the tables (the released ones are 197 GB), behind an in-memory cache of
// hot rows.
//
// A step's row ids are known from its tokens before the step, so a layer's rows are gathered in
// one call: cache hits are copied at once, and every missed row (and its scales) is read with
// O_DIRECT through one io_uring queue, all reads of the call in flight together, each 4 KiB
// block read once however many rows of the call it holds. The rows land in a small table of the
// call's own (EngramGatherParams can read it like the whole one, with its ids renumbered). The
// forward pass asks for every Engram layer's rows when a step starts, from a thread of its own,
// so that they are read while the layers before each compute (CpuForward::SetEngramStore).
//
// Thread-safety: Gather may be called from one thread at a time (a mutex enforces it).
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "config/status.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"

namespace flashd::engine {

struct EngramTableFile {
  std::string path;            // The shard holding the table and its scales.
  uint64_t rows_offset = 0;    // Where the [rows, row_bytes] FP8 rows start in it.
  uint64_t scales_offset = 0;  // Where the [rows, scale_bytes] UE8M0 scales start in it.
  std::string scales_path;     // The scales' shard (may differ from the rows').
  int64_t rows = 0;
  int row_bytes = 0, scale_bytes = 0;
};

// The Engram tables of `checkpoint`, one per Engram layer of `config` in order, where the
// checkpoint holds their rows and scales.
StatusOr<std::vector<EngramTableFile>> EngramTableFiles(const Checkpoint& checkpoint,
                                                        const ModelConfig& config);

class EngramStore {
 public:
  // `cache_bytes`: the hot-row cache (rows with their scales; 0: none). `queue_depth`: reads in
  // flight at most.
  static StatusOr<std::unique_ptr<EngramStore>> Open(std::vector<EngramTableFile> tables,
                                                     uint64_t cache_bytes,
                                                     unsigned queue_depth = 128);
  ~EngramStore();

  // The rows `ids[0..n)` of table `t` (repeats allowed) into rows_out[n, row_bytes] and
  // scales_out[n, scale_bytes]. An id outside the table is InvalidArgument (nothing read).
  Status Gather(int t, const int64_t* ids, size_t n, uint8_t* rows_out, uint8_t* scales_out);

  const EngramTableFile& table(int t) const { return tables_[static_cast<size_t>(t)]; }
  int tables() const { return static_cast<int>(tables_.size()); }

  struct Stats {
    uint64_t gathers = 0;  // Gather calls.
    uint64_t rows = 0;     // Rows asked for.
    uint64_t hits = 0;     // Of them, found in the cache (or earlier in the same call).
    uint64_t reads = 0;    // Reads issued (4 KiB blocks, or 8 KiB where a row straddles).
    uint64_t read_bytes = 0;
    double read_seconds = 0;  // The reads' time (off the forward pass when gathered ahead).
    double wait_seconds = 0;  // The forward pass's time waiting for a layer's rows (AddWait).
  };
  Stats stats() const;
  // Counts time a forward pass spent waiting for rows it had asked for ahead.
  void AddWait(double seconds);

 private:
  struct Ring;
  EngramStore() = default;
  // Reads [offset, offset + bytes) of `fd` for every request, one read per distinct aligned
  // span, all in flight together; `out[i]` gets request i's bytes.
  struct Request {
    int fd;
    uint64_t offset;
    uint32_t bytes;
    uint8_t* out;
  };
  Status ReadAll(std::vector<Request>& requests);

  std::vector<EngramTableFile> tables_;
  std::vector<int> row_fds_, scale_fds_;
  std::unique_ptr<Ring> ring_;
  unsigned depth_ = 0;
  // Cache: (table, id) -> slot in slab_ (row bytes then scale bytes), LRU order.
  size_t slot_bytes_ = 0, capacity_ = 0;
  std::vector<uint8_t> slab_;
  std::list<uint64_t> lru_;  // Keys, most recent first.
  struct Slot {
    uint32_t slot;
    std::list<uint64_t>::iterator at;
  };
  std::unordered_map<uint64_t, Slot> cache_;
  std::vector<uint32_t> free_slots_;
  mutable std::mutex mu_;
  Stats stats_;
};

}  // namespace flashd::engine
