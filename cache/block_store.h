// BlockStore: the persistent tier of the prefix cache, RocksDB on disk plus a RAM LRU in front.
//
// Two kinds of entry, each addressed by a BlockKey:
//   - blocks: one full cache block of a prefix (its token ids and the engine's bytes for them);
//     the parent is the block before it, so the keys of a prompt form a chain from the root.
//   - snapshots: the bounded state of a sequence at a position inside or at the end of a block
//     (the tail tokens after the parent block and the engine's state bytes for them).
// Column families: "blocks", "snapshots" and "meta" (parent, size, depth and last use of every
// entry, read at start-up to rebuild the index without reading the payloads). A block's value is
// stored under (its chain's first block, its depth, its key), so that the blocks of a chain are
// neighbours on disk and a restore reads them sequentially. An entry and its
// meta row are written in one atomic batch, so a crash never leaves one without the other.
//
// Every value carries a header (magic, format version, token count, parent key, payload size,
// CRC32C over all of it); a read checks the CRC and that the stored tokens are the expected ones.
// A bad value is a miss: it is deleted, counted, and never returned.
//
// Writes are asynchronous: Put*() queue the entry for one writer thread and return at once, so
// the engine never waits for the disk. A queued entry is already there for every lookup, read and
// pin (from memory, until the writer has stored it), so a request right behind the one that
// stored a prefix finds it however far behind the disk is. Entries already stored or queued are
// not written again, which is what stores a shared prefix once. After each write the disk quota is
// enforced: least recently used first, a parent only after all its descendants (no orphaned tails),
// pinned entries never. Entries idle longer than the TTL (when set) go the same way. A failed write
// (disk full) stops all further writes: the store is then "degraded", reads keep working.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <rocksdb/db.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cache/block_key.h"
#include "config/status.h"

namespace flashd::cache {

struct BlockKeyHash {
  size_t operator()(const BlockKey& k) const { return static_cast<size_t>(k.lo ^ (k.hi * 31)); }
};

// CRC32C (Castagnoli) of `bytes` (cache/crc32c.h).
uint32_t Crc32c(std::string_view bytes);

struct StoreOptions {
  std::string dir;  // The RocksDB directory; created when missing.
  uint64_t ram_bytes = 256ull << 20;
  uint64_t disk_quota_bytes = 16ull << 30;
  int64_t ttl_seconds = 0;  // 0: entries never expire by age.
  // What the payloads' bytes mean (the KV block layout and snapshot versions). A store whose
  // entries were written under another format, or before formats were recorded, is emptied at
  // open (dropped_at_open() says what went), so no payload is ever read under the wrong layout.
  // Empty: not checked.
  std::string payload_format;
  // What the quota evicts first (only entries nothing hangs from, never a pinned one):
  //   kLru   the least recently used.
  //   kCost  the least value per byte kept: (hits + 1) * the cost of recomputing the entry /
  //          its bytes, plus the value of the last entry evicted at the time of its last use
  //          (greedy-dual: recency without a clock). A block costs one block of prefill; a
  //          snapshot costs snapshot_cost_blocks (the replay a miss on it causes). Widely shared
  //          prefixes collect hits and stay; one-off tails go first.
  enum class Eviction { kLru, kCost } eviction = Eviction::kLru;
  double snapshot_cost_blocks = 1;
};

class BlockStore {
 public:
  enum class Kind : uint8_t { kBlock = 1, kSnapshot = 2 };
  static constexpr uint32_t kFormatVersion = 1;

  static StatusOr<std::unique_ptr<BlockStore>> Open(const StoreOptions& options);
  ~BlockStore();  // Writes what is queued, then closes.

  // Queues an entry for writing (nothing happens if the key is stored already). `depth` is the
  // number of blocks before it plus one (a snapshot: its parent block's depth).
  void Put(Kind kind, const BlockKey& key, const BlockKey& parent, uint32_t depth,
           std::span<const int32_t> tokens, std::string payload);
  // Waits until every queued write has been applied (or dropped because the store is degraded).
  void Flush();

  // How many leading keys of `chain` are stored.
  size_t PresentPrefix(std::span<const BlockKey> chain) const;
  bool Contains(const BlockKey& key) const;

  // The payloads of `keys` (blocks; RAM first, the rest with one RocksDB MultiGet), each checked
  // against the tokens it must hold. A missing or bad entry gives nullopt. Hits become the most
  // recently used.
  std::vector<std::optional<std::string>> ReadBlocks(
      std::span<const BlockKey> keys, std::span<const std::span<const int32_t>> tokens);
  // The same read, each payload put where `dest(i, bytes)` says (null: not wanted, a miss) by
  // the reading thread that read it (several at once for a long chain), checked while it is
  // copied (one pass over the bytes), with no lock held: the caller puts the bytes straight
  // where they belong (the KV pool's blocks). Returns, per key, whether its payload was put and
  // passed every check; where not, what was written to its destination means nothing.
  using BlockDest = std::function<uint8_t*(size_t i, size_t bytes)>;
  std::vector<bool> ReadBlocksInto(std::span<const BlockKey> keys,
                                   std::span<const std::span<const int32_t>> tokens,
                                   const BlockDest& dest);

  // The snapshots whose parent block is `parent`, with their tail tokens (from the index: no
  // value is read).
  struct SnapshotRef {
    BlockKey key;
    std::vector<int32_t> tail;
  };
  std::vector<SnapshotRef> SnapshotsUnder(const BlockKey& parent) const;
  std::optional<std::string> ReadSnapshot(const BlockKey& key, std::span<const int32_t> tail);

  // Pins keep entries (and, for a chain, all of it) from eviction; counted, so pins nest.
  void Pin(std::span<const BlockKey> keys);
  void Unpin(std::span<const BlockKey> keys);

  // Removes entries that no longer belong (tests, and start-up reconciliation of the catalog).
  void Erase(const BlockKey& key);

  // Evicts every entry no pin keeps (an operator's "drop the cache"), tails before heads as the
  // quota would. Returns the entries and bytes freed.
  std::pair<uint64_t, uint64_t> EvictUnpinned();

  // StoreOptions::snapshot_cost_blocks, once the model (and so its replay length) is known.
  void SetSnapshotCost(double blocks);
  // New limits (a configuration reload); a smaller quota or TTL evicts at once.
  void SetLimits(uint64_t ram_bytes, uint64_t disk_quota_bytes, int64_t ttl_seconds);

  struct Stats {
    uint64_t entries = 0;
    uint64_t blocks = 0;
    uint64_t snapshots = 0;
    uint64_t disk_bytes = 0;      // Payloads, tokens and headers of every stored entry.
    uint64_t snapshot_bytes = 0;  // The snapshots' share of disk_bytes.
    uint64_t ram_bytes = 0;
    uint64_t pinned = 0;
    uint64_t bytes_written = 0;
    uint64_t bytes_read_disk = 0;
    uint64_t bytes_read_ram = 0;
    uint64_t evictions = 0;
    uint64_t expirations = 0;
    uint64_t corruptions = 0;
    uint64_t write_failures = 0;
    uint64_t writes_dropped = 0;
    uint64_t queued = 0;  // Entries waiting for the writer (found by lookups already).
    bool degraded = false;
    std::string degraded_reason;
  };
  Stats stats() const;
  const std::string& dir() const { return options_.dir; }

  // What Open dropped because it was written in another payload format.
  struct Dropped {
    uint64_t entries = 0, bytes = 0;
    std::string format;  // The old format, or "" when the store predates recorded formats.
  };
  const std::optional<Dropped>& dropped_at_open() const { return dropped_; }

  // The checks every read makes on a stored value (magic, format, sizes, the CRC32C over key and
  // value, the token ids); the payload when all pass. Never reads outside `value`.
  static std::optional<std::string> CheckValue(std::string_view value, const BlockKey& key,
                                               std::span<const int32_t> tokens);
  // The same checks, the payload copied to `dest(payload bytes)` (null: not wanted) as its CRC
  // is computed; whether it was wanted and every check passed.
  static bool CheckedCopy(std::string_view value, const BlockKey& key,
                          std::span<const int32_t> tokens,
                          const std::function<uint8_t*(size_t bytes)>& dest);
  // The CRC32C a value stores for `key_bytes` (computed with the CRC field as zeros), and where.
  static uint32_t ValueChecksum(std::string_view key_bytes, std::string_view value);
  static constexpr size_t kChecksumOffset = 12;

  // Test hooks: the raw value as stored, and overwriting it (to simulate corruption); holding the
  // writer (queued entries stay queued until it is let go).
  std::optional<std::string> RawValue(Kind kind, const BlockKey& key) const;
  Status OverwriteRawValue(Kind kind, const BlockKey& key, std::string_view value);
  void HoldWrites(bool hold);

 private:
  struct Entry {
    Kind kind = Kind::kBlock;
    BlockKey parent;
    uint64_t bytes = 0;
    uint32_t depth = 0;
    int64_t last_used_ms = 0;
    int64_t rank = 0;   // Its place in the eviction order (options_.eviction).
    uint32_t hits = 0;  // Restores that ended at it since it was written or the store opened.
    int children = 0;
    int pins = 0;
    BlockKey root;              // A block's chain's first block (the data key's prefix).
    std::vector<int32_t> tail;  // A snapshot's tokens after its parent block.
  };
  // The RAM tier's payloads are shared: a reader copies one out after releasing mu_.
  using RamPayload = std::shared_ptr<const std::string>;
  // An entry queued for the writer; until it is stored, lookups find it in pending_.
  struct Op {
    Kind kind;
    BlockKey key, parent;
    uint32_t depth;
    std::vector<int32_t> tokens;
    RamPayload payload;
    int pins = 0;  // Guarded by mu_: pins taken while it waited, handed to its entry.
  };
  using OpPtr = std::shared_ptr<Op>;
  // Eviction order: lowest rank first, at equal rank the least recently used, then the deepest.
  using Order = std::tuple<int64_t, int64_t, int64_t, BlockKey>;
  static Order OrderOf(const Entry& e, const BlockKey& key);
  struct OrderLess {
    bool operator()(const Order& a, const Order& b) const;
  };

  explicit BlockStore(StoreOptions options);
  Status Load();
  void WriterLoop();
  void Apply(std::vector<OpPtr>& ops);
  // The queued entry under `key`, or null. Requires mu_.
  const Op* PendingLocked(const BlockKey& key) const;
  // Forgets a queued entry (written, dropped or erased). Requires mu_.
  void UnqueueLocked(const BlockKey& key);
  // A read of `key` at now_ms; `reused_here`: a restore ends at it (the last block of a chain
  // read, a snapshot), which counts as a hit. Blocks a restore passes through count none: every
  // request of a long session would otherwise pile hits on its early blocks. Requires mu_.
  void Touch(const BlockKey& key, int64_t now_ms, bool reused_here);
  int64_t RankOf(const Entry& e) const;  // Requires mu_.
  // Removes entries idle since before `expire_before_ms` that nothing hangs from (with kCost,
  // whose order is not by age). Requires mu_.
  void ExpireLocked(int64_t expire_before_ms, rocksdb::WriteBatch* batch);
  void EvictLocked(uint64_t target_bytes, int64_t expire_before_ms);
  void RemoveLocked(const BlockKey& key, rocksdb::WriteBatch* batch);
  void RamInsertLocked(const BlockKey& key, RamPayload payload);
  void RamEraseLocked(const BlockKey& key);
  rocksdb::ColumnFamilyHandle* Family(Kind kind) const;
  std::string DataKey(const BlockKey& key, const Entry& e) const;
  static std::string MetaValue(const Entry& e);
  void DropCorrupt(Kind kind, const BlockKey& key);
  // Every write to the database goes through here. After the first failure none is attempted
  // again: RocksDB's file writer must not be called after an error it reported (a debug build
  // aborts on it), and a failing disk gets no further load.
  rocksdb::Status Commit(rocksdb::WriteBatch* batch);

  StoreOptions options_;
  std::unique_ptr<rocksdb::DB> db_;
  std::vector<rocksdb::ColumnFamilyHandle*> families_;  // default, blocks, snapshots, meta

  mutable std::mutex mu_;
  std::unordered_map<BlockKey, Entry, BlockKeyHash> index_;                      // Guarded.
  std::set<Order, OrderLess> order_;                                             // Guarded.
  std::unordered_map<BlockKey, std::vector<BlockKey>, BlockKeyHash> snapshots_;  // parent ->
  std::list<std::pair<BlockKey, RamPayload>> ram_;                               // MRU first.
  std::unordered_map<BlockKey, std::list<std::pair<BlockKey, RamPayload>>::iterator, BlockKeyHash>
      ram_index_;
  std::unordered_map<BlockKey, OpPtr, BlockKeyHash> pending_;  // Guarded: queued, not stored.
  std::vector<BlockKey> touched_;  // Last-use changes not yet written to meta.
  Stats stats_;                    // Guarded.
  int64_t clock_ = 0;              // Guarded: kCost's rank of the last entry evicted.
  int64_t last_expiry_scan_ms_ = 0;

  std::atomic<bool> writes_stopped_{false};
  std::atomic<uint64_t> commit_failures_{0};  // Failed or refused Commit()s.
  mutable std::mutex failure_mu_;
  std::string failure_;  // Guarded by failure_mu_: the first failure.

  std::mutex queue_mu_;
  std::condition_variable queue_cv_, idle_cv_;
  std::deque<OpPtr> queue_;  // Guarded by queue_mu_.
  bool busy_ = false;        // Guarded by queue_mu_: the writer holds ops not yet applied.
  bool stopping_ = false;
  bool held_ = false;  // Guarded by queue_mu_: HoldWrites.
  std::thread writer_;
  std::optional<Dropped> dropped_;
  Status CheckPayloadFormat();
};

}  // namespace flashd::cache
