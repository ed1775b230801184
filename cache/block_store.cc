#include "cache/block_store.h"

#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "cache/crc32c.h"

namespace flashd::cache {
namespace {

// RocksDB's info log, written through spdlog: warnings and errors as such, the rest at debug.
class SpdlogLogger : public rocksdb::Logger {
 public:
  SpdlogLogger() : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL) {}
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    Logv(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap);
  }
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    if (level < GetInfoLogLevel()) return;
    char text[1024];
    std::vsnprintf(text, sizeof text, format, ap);
    if (level >= rocksdb::InfoLogLevel::ERROR_LEVEL) {
      spdlog::error("rocksdb: {}", text);
    } else if (level == rocksdb::InfoLogLevel::WARN_LEVEL) {
      spdlog::warn("rocksdb: {}", text);
    } else {
      spdlog::debug("rocksdb: {}", text);
    }
  }
};

constexpr char kMagic[4] = {'F', 'L', 'K', 'B'};
// magic, format version, token count, CRC32C, parent key, payload size.
constexpr size_t kHeaderBytes = 4 + 4 + 4 + 4 + 16 + 8;
constexpr size_t kCrcOffset = 12;
static_assert(kCrcOffset == BlockStore::kChecksumOffset);
// kind, parent key, depth, bytes, last use, root key; then a snapshot's tail tokens.
constexpr size_t kMetaBytes = 1 + 16 + 4 + 8 + 8 + 16;
constexpr size_t kReadThreads = 8;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

template <typename T>
void PutRaw(std::string* out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // Little-endian hosts only (x86-64, arm64); see formats.md.
  out->append(b, sizeof(T));
}

template <typename T>
T Get(std::string_view in, size_t offset) {
  T v;
  std::memcpy(&v, in.data() + offset, sizeof(T));
  return v;
}

BlockKey KeyFromBytes(std::string_view b) {
  BlockKey k;
  for (int i = 0; i < 8; ++i) {
    k.hi = (k.hi << 8) | static_cast<uint8_t>(b[i]);
    k.lo = (k.lo << 8) | static_cast<uint8_t>(b[8 + i]);
  }
  return k;
}

// Where a block's value lives: its chain's first block, its depth (big-endian), then its own key.
// A chain's blocks are neighbours in the table, so a restore reads them in long sequential runs
// instead of one scattered read per block (keys alone are hashes, in no useful order).
std::string BlockDataKey(const BlockKey& root, uint32_t depth, const BlockKey& key) {
  std::string k = root.ToBytes();
  for (int i = 3; i >= 0; --i) k.push_back(static_cast<char>((depth >> (8 * i)) & 0xff));
  k += key.ToBytes();
  return k;
}

int64_t OrderDepth(BlockStore::Kind kind, uint32_t depth) {
  // A snapshot goes before the block it hangs from, deeper blocks before shallower ones.
  return 2 * static_cast<int64_t>(depth) + (kind == BlockStore::Kind::kSnapshot ? 1 : 0);
}

}  // namespace

namespace {

// CRC32C over several pieces, as if concatenated (cache/crc32c.h: the SSE4.2 instruction where
// the CPU has it; the values RocksDB's own CRC32C gives, which stored values were made with).
uint32_t Crc32cOf(std::initializer_list<std::string_view> pieces) {
  uint32_t crc = 0;
  for (std::string_view p : pieces) crc = Crc32cExtend(crc, p.data(), p.size());
  return crc;
}

// The checksum of a stored value's first `end` bytes (end >= kCrcOffset + 4): its key, then
// those bytes with the CRC field read as zeros.
uint32_t ValuePrefixCrc(std::string_view key_bytes, std::string_view value, size_t end) {
  static const char kZero[4] = {0, 0, 0, 0};
  return Crc32cOf({key_bytes, value.substr(0, kCrcOffset), std::string_view(kZero, 4),
                   value.substr(kCrcOffset + 4, end - kCrcOffset - 4)});
}

// A stored value's checksum: the above over all of it.
uint32_t ValueCrc(std::string_view key_bytes, std::string_view value) {
  return ValuePrefixCrc(key_bytes, value, value.size());
}

}  // namespace

uint32_t Crc32c(std::string_view bytes) { return Crc32cOf({bytes}); }

BlockStore::Order BlockStore::OrderOf(const Entry& e, const BlockKey& key) {
  return {e.rank, e.last_used_ms, OrderDepth(e.kind, e.depth), key};
}

bool BlockStore::OrderLess::operator()(const Order& a, const Order& b) const {
  if (std::get<0>(a) != std::get<0>(b)) return std::get<0>(a) < std::get<0>(b);
  if (std::get<1>(a) != std::get<1>(b)) return std::get<1>(a) < std::get<1>(b);
  if (std::get<2>(a) != std::get<2>(b)) return std::get<2>(a) > std::get<2>(b);
  const BlockKey &x = std::get<3>(a), &y = std::get<3>(b);
  return x.hi != y.hi ? x.hi < y.hi : x.lo < y.lo;
}

BlockStore::BlockStore(StoreOptions options) : options_(std::move(options)) {}

StatusOr<std::unique_ptr<BlockStore>> BlockStore::Open(const StoreOptions& options) {
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) return IoError("cache: cannot create " + options.dir + ": " + ec.message());
  std::unique_ptr<BlockStore> store(new BlockStore(options));
  rocksdb::Options o;
  o.create_if_missing = true;
  // RocksDB's messages go to the daemon's log, not to a LOG file beside the data: on a full disk
  // that file's writer fails, and RocksDB's next message to it would abort the process.
  o.info_log = std::make_shared<SpdlogLogger>();
  o.create_missing_column_families = true;
  o.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  o.keep_log_file_num = 2;
  o.max_background_jobs = 2;
  // A restore reads a chain's neighbouring blocks in order: the kernel's readahead serves it
  // (RocksDB's default advises random access, which turns readahead off; measured in
  // bench/cache_bench, restore of a 1M-token chain at 62-64% of the disk's direct read with it,
  // 70-88% without).
  o.advise_random_on_open = false;
  rocksdb::ColumnFamilyOptions blocks;
  // Payloads are FP4/FP8 codes: compression gains little and costs restore speed. Large data
  // blocks keep a chain's consecutive entries in few, long reads.
  blocks.compression = rocksdb::kNoCompression;
  blocks.write_buffer_size = 64 << 20;
  rocksdb::BlockBasedTableOptions table;
  table.block_size = 256 << 10;
  blocks.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, rocksdb::ColumnFamilyOptions()},
      {"blocks", blocks},
      {"snapshots", blocks},
      {"meta", rocksdb::ColumnFamilyOptions()},
  };
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(o, options.dir, cfs, &store->families_, &db);
  if (s.IsCorruption()) {
    // Damaged files (a bad sector, a bit flip): salvage every readable entry instead of losing
    // the whole cache. RepairDB keeps what passes RocksDB's own checks and moves the rest to
    // lost/; each entry still passes our CRC before use.
    spdlog::error("cache: {} is damaged ({}); repairing it, unreadable entries are dropped",
                  options.dir, s.ToString());
    store->families_.clear();
    const rocksdb::Status repaired = rocksdb::RepairDB(options.dir, o, cfs);
    if (!repaired.ok()) spdlog::error("cache: repair failed: {}", repaired.ToString());
    s = rocksdb::DB::Open(o, options.dir, cfs, &store->families_, &db);
  }
  if (!s.ok()) return IoError("cache: cannot open RocksDB at " + options.dir + ": " + s.ToString());
  store->db_.reset(db);
  FLASHD_RETURN_IF_ERROR(store->CheckPayloadFormat());
  FLASHD_RETURN_IF_ERROR(store->Load());
  store->writer_ = std::thread([raw = store.get()] { raw->WriterLoop(); });
  return store;
}

BlockStore::~BlockStore() {
  if (writer_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    writer_.join();
  }
  if (db_) {
    for (auto* h : families_) db_->DestroyColumnFamilyHandle(h);
    db_->Close();
  }
}

std::string BlockStore::MetaValue(const Entry& e) {
  std::string v;
  v.push_back(static_cast<char>(e.kind));
  v += e.parent.ToBytes();
  PutRaw<uint32_t>(&v, e.depth);
  PutRaw<uint64_t>(&v, e.bytes);
  PutRaw<int64_t>(&v, e.last_used_ms);
  v += e.root.ToBytes();
  // A snapshot's tail, so that finding the snapshots that fit a prompt reads no values.
  v.append(reinterpret_cast<const char*>(e.tail.data()), e.tail.size() * 4);
  return v;
}

rocksdb::ColumnFamilyHandle* BlockStore::Family(Kind kind) const {
  return kind == Kind::kBlock ? families_[1] : families_[2];
}

Status BlockStore::CheckPayloadFormat() {
  if (options_.payload_format.empty()) return Status::Ok();
  static const std::string kTag = "payload_format";
  std::string stored;
  const bool recorded = db_->Get(rocksdb::ReadOptions(), families_[0], kTag, &stored).ok();
  if (recorded && stored == options_.payload_format) return Status::Ok();
  // Entries written in another layout: count them from the index, then remove every one.
  Dropped d;
  d.format = recorded ? stored : "";
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), families_[3]));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      d.entries += 1;
      if (it->value().size() >= kMetaBytes) {
        d.bytes += Get<uint64_t>(std::string_view(it->value().data(), it->value().size()), 21);
      }
    }
  }
  if (d.entries > 0) {
    const std::string first, last(17, '\xff');  // Keys are 16 bytes.
    for (size_t f = 1; f <= 3; ++f) {
      rocksdb::Status s = db_->DeleteRange(rocksdb::WriteOptions(), families_[f], first, last);
      if (!s.ok()) return IoError("cache: dropping entries of another format: " + s.ToString());
      rocksdb::Slice b(first), e(last);
      (void)db_->CompactRange(rocksdb::CompactRangeOptions(), families_[f], &b, &e);
    }
    dropped_ = d;
  }
  rocksdb::WriteOptions sync;
  sync.sync = true;
  rocksdb::Status s = db_->Put(sync, families_[0], kTag, options_.payload_format);
  if (!s.ok()) return IoError("cache: recording the payload format: " + s.ToString());
  return Status::Ok();
}

Status BlockStore::Load() {
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), families_[3]));
  std::lock_guard<std::mutex> lock(mu_);
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::string_view k(it->key().data(), it->key().size());
    const std::string_view v(it->value().data(), it->value().size());
    if (k.size() != 16 || v.size() < kMetaBytes || (v.size() - kMetaBytes) % 4 != 0 ||
        (v[0] != 1 && v[0] != 2)) {
      spdlog::warn("cache: ignoring a malformed meta row");
      continue;
    }
    Entry e;
    e.kind = static_cast<Kind>(v[0]);
    e.parent = KeyFromBytes(v.substr(1, 16));
    e.depth = Get<uint32_t>(v, 17);
    e.bytes = Get<uint64_t>(v, 21);
    e.last_used_ms = Get<int64_t>(v, 29);
    e.root = KeyFromBytes(v.substr(37, 16));
    e.tail.resize((v.size() - kMetaBytes) / 4);
    if (!e.tail.empty()) std::memcpy(e.tail.data(), v.data() + kMetaBytes, e.tail.size() * 4);
    index_[KeyFromBytes(k)] = std::move(e);
  }
  if (!it->status().ok()) return IoError("cache: reading the index: " + it->status().ToString());
  // Entries whose parent is gone can never be reached again: collect them, and their children.
  std::unordered_map<BlockKey, std::vector<BlockKey>, BlockKeyHash> children;
  for (auto& [key, e] : index_) {
    if (!e.parent.IsRoot()) children[e.parent].push_back(key);
  }
  std::vector<BlockKey> orphans;
  for (auto& [key, e] : index_) {
    if (!e.parent.IsRoot() && !index_.count(e.parent)) orphans.push_back(key);
  }
  rocksdb::WriteBatch batch;
  size_t collected = 0;
  while (!orphans.empty()) {
    const BlockKey k = orphans.back();
    orphans.pop_back();
    auto found = index_.find(k);
    if (found == index_.end()) continue;
    batch.Delete(Family(found->second.kind), DataKey(k, found->second));
    batch.Delete(families_[3], k.ToBytes());
    index_.erase(found);
    ++collected;
    for (const BlockKey& c : children[k]) orphans.push_back(c);
  }
  if (collected > 0) {
    spdlog::warn("cache: collected {} entries whose prefix was gone", collected);
    Commit(&batch);
  }
  for (auto& [key, e] : index_) {
    if (auto p = index_.find(e.parent); p != index_.end()) p->second.children += 1;
    if (e.kind == Kind::kSnapshot) snapshots_[e.parent].push_back(key);
    e.rank = RankOf(e);
    order_.insert(OrderOf(e, key));
    stats_.disk_bytes += e.bytes;
    if (e.kind == Kind::kSnapshot) stats_.snapshot_bytes += e.bytes;
    (e.kind == Kind::kBlock ? stats_.blocks : stats_.snapshots) += 1;
  }
  return Status::Ok();
}

void BlockStore::Put(Kind kind, const BlockKey& key, const BlockKey& parent, uint32_t depth,
                     std::span<const int32_t> tokens, std::string payload) {
  auto op = std::make_shared<Op>(Op{kind, key, parent, depth,
                                    std::vector<int32_t>(tokens.begin(), tokens.end()),
                                    std::make_shared<const std::string>(std::move(payload))});
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (index_.count(key) || pending_.count(key)) return;
    pending_.emplace(key, op);
  }
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    queue_.push_back(std::move(op));
  }
  queue_cv_.notify_one();
}

const BlockStore::Op* BlockStore::PendingLocked(const BlockKey& key) const {
  auto found = pending_.find(key);
  return found == pending_.end() ? nullptr : found->second.get();
}

void BlockStore::UnqueueLocked(const BlockKey& key) {
  auto found = pending_.find(key);
  if (found == pending_.end()) return;
  if (found->second->pins > 0) stats_.pinned -= 1;
  pending_.erase(found);
}

void BlockStore::HoldWrites(bool hold) {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    held_ = hold;
  }
  queue_cv_.notify_all();
}

void BlockStore::Flush() {
  std::unique_lock<std::mutex> lock(queue_mu_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

void BlockStore::WriterLoop() {
  for (;;) {
    std::vector<OpPtr> ops;
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait_for(lock, std::chrono::seconds(1),
                         [&] { return stopping_ || (!queue_.empty() && !held_); });
      while (!queue_.empty() && (!held_ || stopping_) && ops.size() < 256) {
        ops.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      if (ops.empty() && stopping_) break;
      busy_ = true;
    }
    Apply(ops);
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      busy_ = false;
    }
    idle_cv_.notify_all();
  }
}

void BlockStore::Apply(std::vector<OpPtr>& ops) {
  const int64_t now = NowMs();
  for (OpPtr& queued : ops) {
    Op& op = *queued;
    BlockKey root = op.key;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Erased while it waited (or, never, stored meanwhile): nothing to write.
      if (PendingLocked(op.key) != &op || index_.count(op.key)) continue;
      if (stats_.degraded) {
        stats_.writes_dropped += 1;
        UnqueueLocked(op.key);
        continue;
      }
      if (auto p = index_.find(op.parent); p != index_.end()) {
        root = p->second.kind == Kind::kBlock ? p->second.root : op.key;
      }
    }
    std::string value;
    const std::string& payload = *op.payload;
    value.reserve(kHeaderBytes + op.tokens.size() * 4 + payload.size());
    value.append(kMagic, 4);
    PutRaw<uint32_t>(&value, kFormatVersion);
    PutRaw<uint32_t>(&value, static_cast<uint32_t>(op.tokens.size()));
    PutRaw<uint32_t>(&value, 0);  // CRC, filled in below.
    value += op.parent.ToBytes();
    PutRaw<uint64_t>(&value, payload.size());
    value.append(reinterpret_cast<const char*>(op.tokens.data()), op.tokens.size() * 4);
    value += payload;
    const std::string key_bytes = op.key.ToBytes();
    // The key is covered too: a value under the wrong key fails the check.
    const uint32_t crc = ValueCrc(key_bytes, value);
    std::memcpy(&value[kCrcOffset], &crc, 4);

    Entry e;
    e.kind = op.kind;
    e.parent = op.parent;
    e.bytes = value.size();
    e.depth = op.depth;
    e.last_used_ms = now;
    e.root = root;
    if (op.kind == Kind::kSnapshot) e.tail = op.tokens;
    rocksdb::WriteBatch batch;
    batch.Put(Family(op.kind), DataKey(op.key, e), value);
    batch.Put(families_[3], key_bytes, MetaValue(e));
    rocksdb::Status s = Commit(&batch);
    std::lock_guard<std::mutex> lock(mu_);
    if (!s.ok()) {
      stats_.degraded = true;
      stats_.degraded_reason = s.ToString();
      UnqueueLocked(op.key);
      continue;
    }
    if (PendingLocked(op.key) != &op) {  // Erased while it was being written.
      rocksdb::WriteBatch undo;
      undo.Delete(Family(op.kind), DataKey(op.key, e));
      undo.Delete(families_[3], key_bytes);
      Commit(&undo);
      continue;
    }
    e.pins = op.pins;  // Already counted in stats_.pinned.
    pending_.erase(op.key);
    e.rank = RankOf(e);
    index_[op.key] = e;
    order_.insert(OrderOf(e, op.key));
    if (!op.parent.IsRoot()) {
      auto p = index_.find(op.parent);
      if (p != index_.end()) p->second.children += 1;
    }
    if (op.kind == Kind::kSnapshot) snapshots_[op.parent].push_back(op.key);
    stats_.disk_bytes += e.bytes;
    if (e.kind == Kind::kSnapshot) stats_.snapshot_bytes += e.bytes;
    stats_.bytes_written += e.bytes;
    (op.kind == Kind::kBlock ? stats_.blocks : stats_.snapshots) += 1;
    RamInsertLocked(op.key, op.payload);
  }
  // Quota, TTL and last-use rows.
  rocksdb::WriteBatch batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t expire = options_.ttl_seconds > 0 ? now - options_.ttl_seconds * 1000 : 0;
    EvictLocked(options_.disk_quota_bytes, expire);
    for (const BlockKey& k : touched_) {
      auto found = index_.find(k);
      if (found == index_.end()) continue;
      batch.Put(families_[3], k.ToBytes(), MetaValue(found->second));
    }
    touched_.clear();
  }
  if (batch.Count() > 0) Commit(&batch);
}

void BlockStore::EvictLocked(uint64_t target_bytes, int64_t expire_before_ms) {
  rocksdb::WriteBatch batch;
  if (options_.eviction == StoreOptions::Eviction::kCost && expire_before_ms > 0) {
    // Not ordered by age: a scan of the index, at most once a second.
    const int64_t now = NowMs();
    if (now - last_expiry_scan_ms_ >= 1000) {
      last_expiry_scan_ms_ = now;
      ExpireLocked(expire_before_ms, &batch);
    }
    expire_before_ms = 0;
  }
  // Walk from the lowest rank; only leaves go, so a prefix never loses its middle. Parents
  // freed by an eviction that rank below where the walk is are taken first.
  std::set<Order, OrderLess> freed;
  auto it = order_.begin();
  while (true) {
    while (it != order_.end()) {
      const Entry& e = index_.at(std::get<3>(*it));
      if (e.children == 0 && e.pins == 0) break;
      ++it;
    }
    const bool from_freed =
        !freed.empty() && (it == order_.end() || OrderLess()(*freed.begin(), *it));
    if (!from_freed && it == order_.end()) break;
    const Order* next = from_freed ? &*freed.begin() : &*it;
    const Entry& victim = index_.at(std::get<3>(*next));
    const bool over_quota = stats_.disk_bytes > target_bytes;
    const bool expired = expire_before_ms > 0 && victim.last_used_ms < expire_before_ms;
    if (!over_quota && !expired) break;
    const BlockKey key = std::get<3>(*next);
    const int64_t rank = std::get<0>(*next);
    const BlockKey parent = victim.parent;
    if (from_freed) {
      freed.erase(freed.begin());
    } else {
      ++it;
    }
    if (over_quota) clock_ = std::max(clock_, rank);
    RemoveLocked(key, &batch);
    (over_quota ? stats_.evictions : stats_.expirations) += 1;
    auto p = index_.find(parent);
    if (p != index_.end() && p->second.children == 0 && p->second.pins == 0) {
      const Order po = OrderOf(p->second, parent);
      if (it == order_.end() || OrderLess()(po, *it)) freed.insert(po);
    }
  }
  if (batch.Count() > 0) Commit(&batch);
}

void BlockStore::RemoveLocked(const BlockKey& key, rocksdb::WriteBatch* batch) {
  auto found = index_.find(key);
  if (found == index_.end()) return;
  const Entry e = found->second;
  batch->Delete(Family(e.kind), DataKey(key, e));
  batch->Delete(families_[3], key.ToBytes());
  order_.erase(OrderOf(e, key));
  index_.erase(found);
  if (!e.parent.IsRoot()) {
    auto p = index_.find(e.parent);
    if (p != index_.end()) p->second.children -= 1;
  }
  if (e.kind == Kind::kSnapshot) {
    auto& v = snapshots_[e.parent];
    v.erase(std::remove(v.begin(), v.end(), key), v.end());
    if (v.empty()) snapshots_.erase(e.parent);
  }
  RamEraseLocked(key);
  stats_.disk_bytes -= e.bytes;
  if (e.kind == Kind::kSnapshot) stats_.snapshot_bytes -= e.bytes;
  (e.kind == Kind::kBlock ? stats_.blocks : stats_.snapshots) -= 1;
}

void BlockStore::RamInsertLocked(const BlockKey& key, RamPayload payload) {
  const size_t bytes = payload->size();
  if (bytes > options_.ram_bytes) return;
  RamEraseLocked(key);
  ram_.emplace_front(key, std::move(payload));
  ram_index_[key] = ram_.begin();
  stats_.ram_bytes += bytes;
  while (stats_.ram_bytes > options_.ram_bytes && !ram_.empty()) {
    stats_.ram_bytes -= ram_.back().second->size();
    ram_index_.erase(ram_.back().first);
    ram_.pop_back();
  }
}

void BlockStore::RamEraseLocked(const BlockKey& key) {
  auto found = ram_index_.find(key);
  if (found == ram_index_.end()) return;
  stats_.ram_bytes -= found->second->second->size();
  ram_.erase(found->second);
  ram_index_.erase(found);
}

void BlockStore::Touch(const BlockKey& key, int64_t now_ms, bool reused_here) {
  auto found = index_.find(key);
  if (found == index_.end()) return;
  Entry& e = found->second;
  if (reused_here) e.hits += 1;
  if (e.last_used_ms == now_ms && options_.eviction == StoreOptions::Eviction::kLru) return;
  order_.erase(OrderOf(e, key));
  if (e.last_used_ms != now_ms) touched_.push_back(key);
  e.last_used_ms = now_ms;
  e.rank = RankOf(e);
  order_.insert(OrderOf(e, key));
}

int64_t BlockStore::RankOf(const Entry& e) const {
  if (options_.eviction == StoreOptions::Eviction::kLru) return e.last_used_ms;
  // Value per byte in units of 2^-40 blocks: a 64-token block of the released model (57 KB)
  // read once is about 2e7 units, so neither rounding nor int64 range is ever a concern.
  const double cost = e.kind == Kind::kSnapshot ? options_.snapshot_cost_blocks : 1.0;
  const double value = (e.hits + 1.0) * cost / static_cast<double>(std::max<uint64_t>(1, e.bytes));
  return clock_ + static_cast<int64_t>(std::min(value * 1099511627776.0, 1e15));
}

void BlockStore::ExpireLocked(int64_t expire_before_ms, rocksdb::WriteBatch* batch) {
  for (bool more = true; more;) {
    more = false;
    std::vector<BlockKey> idle;
    for (const auto& [key, e] : index_) {
      if (e.children == 0 && e.pins == 0 && e.last_used_ms < expire_before_ms) idle.push_back(key);
    }
    for (const BlockKey& key : idle) {
      RemoveLocked(key, batch);
      stats_.expirations += 1;
      more = true;  // Their parents may now be leaves, and idle too.
    }
  }
}

size_t BlockStore::PresentPrefix(std::span<const BlockKey> chain) const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  while (n < chain.size() && (index_.count(chain[n]) || pending_.count(chain[n]))) ++n;
  return n;
}

bool BlockStore::Contains(const BlockKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return index_.count(key) > 0 || pending_.count(key) > 0;
}

uint32_t BlockStore::ValueChecksum(std::string_view key_bytes, std::string_view value) {
  return ValueCrc(key_bytes, value);
}

bool BlockStore::CheckedCopy(std::string_view value, const BlockKey& key,
                             std::span<const int32_t> tokens,
                             const std::function<uint8_t*(size_t bytes)>& dest) {
  if (value.size() < kHeaderBytes || std::memcmp(value.data(), kMagic, 4) != 0 ||
      Get<uint32_t>(value, 4) != kFormatVersion || Get<uint32_t>(value, 8) != tokens.size()) {
    return false;
  }
  // Compared without overflow: a huge stored payload size must not wrap around to a match.
  const uint64_t payload = Get<uint64_t>(value, 32);
  const size_t fixed = kHeaderBytes + tokens.size() * 4;
  if (value.size() < fixed || payload != value.size() - fixed) return false;
  if (!tokens.empty() &&
      std::memcmp(value.data() + kHeaderBytes, tokens.data(), tokens.size() * 4) != 0) {
    return false;
  }
  uint8_t* out = dest(payload);
  if (out == nullptr) return false;
  // ValueCrc, the payload copied as it is summed.
  uint32_t crc = ValuePrefixCrc(key.ToBytes(), value, fixed);
  crc = Crc32cExtendCopy(crc, out, value.data() + fixed, payload);
  return crc == Get<uint32_t>(value, kCrcOffset);
}

std::optional<std::string> BlockStore::CheckValue(std::string_view value, const BlockKey& key,
                                                  std::span<const int32_t> tokens) {
  std::string out;
  const bool ok = CheckedCopy(value, key, tokens, [&](size_t bytes) {
    out.resize(bytes);
    return reinterpret_cast<uint8_t*>(out.data());
  });
  if (!ok) return std::nullopt;
  return out;
}

void BlockStore::DropCorrupt(Kind kind, const BlockKey& key) {
  spdlog::error("cache: entry {} failed its check; deleted, not used", key.ToHex());
  std::lock_guard<std::mutex> lock(mu_);
  stats_.corruptions += 1;
  rocksdb::WriteBatch batch;
  if (index_.count(key)) {
    RemoveLocked(key, &batch);
  } else if (kind == Kind::kSnapshot) {
    batch.Delete(Family(kind), key.ToBytes());
  }
  Commit(&batch);
}

std::vector<std::optional<std::string>> BlockStore::ReadBlocks(
    std::span<const BlockKey> keys, std::span<const std::span<const int32_t>> tokens) {
  std::vector<std::optional<std::string>> out(keys.size());
  const std::vector<bool> got = ReadBlocksInto(keys, tokens, [&](size_t i, size_t bytes) {
    out[i].emplace(bytes, '\0');
    return reinterpret_cast<uint8_t*>(out[i]->data());
  });
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!got[i]) out[i].reset();
  }
  return out;
}

std::vector<bool> BlockStore::ReadBlocksInto(std::span<const BlockKey> keys,
                                             std::span<const std::span<const int32_t>> tokens,
                                             const BlockDest& dest) {
  // vector<bool> packs bits: reading threads write their own bytes, then it is filled in.
  std::vector<uint8_t> delivered(keys.size(), 0);
  std::vector<std::pair<size_t, RamPayload>> from_ram;
  std::vector<size_t> misses;
  std::vector<std::string> data_keys;  // Of the misses.
  uint64_t miss_bytes = 0;
  bool fill_ram = false;
  const int64_t now = NowMs();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto r = ram_index_.find(keys[i]);
      if (r == ram_index_.end()) {
        auto e = index_.find(keys[i]);
        if (e == index_.end()) {
          // Queued for the writer: its payload as the engine gave it. Otherwise not stored, a
          // miss without a read.
          const Op* op = PendingLocked(keys[i]);
          if (op != nullptr && op->kind == Kind::kBlock &&
              std::ranges::equal(op->tokens, tokens[i])) {
            from_ram.emplace_back(i, op->payload);
            stats_.bytes_read_ram += op->payload->size();
          }
          continue;
        }
        misses.push_back(i);
        data_keys.push_back(DataKey(keys[i], e->second));
        miss_bytes += e->second.bytes;
        continue;
      }
      ram_.splice(ram_.begin(), ram_, r->second);
      from_ram.emplace_back(i, r->second->second);
      stats_.bytes_read_ram += r->second->second->size();
      Touch(keys[i], now, i + 1 == keys.size());
    }
    // What comes from disk joins the RAM tier unless it is a large share of it: one long chain
    // (a million-token context) would otherwise push out every other prompt's hot blocks, and
    // itself in turn.
    fill_ram = miss_bytes <= options_.ram_bytes / 4;
  }
  // RAM hits (checked when they were read or written) are copied out with no lock held: the
  // tier shares them.
  for (auto& [i, payload] : from_ram) {
    uint8_t* out = dest(i, payload->size());
    if (out == nullptr) continue;
    std::memcpy(out, payload->data(), payload->size());
    delivered[i] = 1;
  }
  // One MultiGet per slice of the misses, slices on several threads: a long chain restores at
  // several times one thread's speed (bench/cache_bench). Each thread checks what it read as it
  // copies it to its destination; the RAM tier's copy is made from there before the lock is
  // taken, so the lock only links it in.
  auto read_slice = [&](size_t from, size_t to) {
    const size_t n = to - from;
    std::vector<rocksdb::Slice> slices(n);
    for (size_t j = 0; j < n; ++j) slices[j] = data_keys[from + j];
    std::vector<rocksdb::PinnableSlice> values(n);
    std::vector<rocksdb::Status> statuses(n);
    // Every value carries its own CRC32C, checked below: RocksDB's block checksums would be a
    // second pass over the same bytes. A restore reads each block once: no block-cache churn.
    rocksdb::ReadOptions ro;
    ro.verify_checksums = false;
    ro.fill_cache = false;
    db_->MultiGet(ro, families_[1], n, slices.data(), values.data(), statuses.data());
    for (size_t j = 0; j < n; ++j) {
      const size_t i = misses[from + j];
      if (!statuses[j].ok()) continue;
      const std::string_view v(values[j].data(), values[j].size());
      uint8_t* out = nullptr;
      size_t bytes = 0;
      bool refused = false;
      const bool ok = CheckedCopy(v, keys[i], tokens[i], [&](size_t b) {
        bytes = b;
        out = dest(i, b);
        refused = out == nullptr;
        return out;
      });
      if (!ok) {
        if (!refused) DropCorrupt(Kind::kBlock, keys[i]);
        continue;
      }
      delivered[i] = 1;
      RamPayload copy =
          fill_ram ? std::make_shared<const std::string>(reinterpret_cast<const char*>(out), bytes)
                   : nullptr;
      std::lock_guard<std::mutex> lock(mu_);
      stats_.bytes_read_disk += v.size();
      Touch(keys[i], now, i + 1 == keys.size());
      if (copy) RamInsertLocked(keys[i], std::move(copy));
    }
  };
  constexpr size_t kSlice = 256;
  const size_t workers = std::min<size_t>({kReadThreads, (misses.size() + kSlice - 1) / kSlice});
  if (workers <= 1) {
    if (!misses.empty()) read_slice(0, misses.size());
  } else {
    std::atomic<size_t> next{0};
    std::vector<std::thread> pool;
    for (size_t w = 0; w < workers; ++w) {
      pool.emplace_back([&] {
        for (size_t at; (at = next.fetch_add(kSlice)) < misses.size();) {
          read_slice(at, std::min(misses.size(), at + kSlice));
        }
      });
    }
    for (auto& t : pool) t.join();
  }
  return std::vector<bool>(delivered.begin(), delivered.end());
}

std::vector<BlockStore::SnapshotRef> BlockStore::SnapshotsUnder(const BlockKey& parent) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SnapshotRef> out;
  if (auto found = snapshots_.find(parent); found != snapshots_.end()) {
    for (const BlockKey& k : found->second) {
      auto e = index_.find(k);
      if (e != index_.end()) out.push_back({k, e->second.tail});
    }
  }
  for (const auto& [k, op] : pending_) {  // Few: what the writer has not reached yet.
    if (op->kind == Kind::kSnapshot && op->parent == parent) out.push_back({k, op->tokens});
  }
  return out;
}

std::optional<std::string> BlockStore::ReadSnapshot(const BlockKey& key,
                                                    std::span<const int32_t> tail) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Op* op = PendingLocked(key);
    if (op != nullptr) {
      if (op->kind != Kind::kSnapshot || !std::ranges::equal(op->tokens, tail)) return std::nullopt;
      stats_.bytes_read_ram += op->payload->size();
      return *op->payload;
    }
  }
  std::string v;
  if (!db_->Get(rocksdb::ReadOptions(), families_[2], key.ToBytes(), &v).ok()) return std::nullopt;
  std::optional<std::string> payload = CheckValue(v, key, tail);
  if (!payload) {
    DropCorrupt(Kind::kSnapshot, key);
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_read_disk += v.size();
  Touch(key, NowMs(), true);
  return payload;
}

void BlockStore::Pin(std::span<const BlockKey> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const BlockKey& k : keys) {
    int* pins = nullptr;
    if (auto found = index_.find(k); found != index_.end()) {
      pins = &found->second.pins;
    } else if (auto queued = pending_.find(k); queued != pending_.end()) {
      pins = &queued->second->pins;  // Its entry takes them when it is stored.
    }
    if (pins != nullptr && (*pins)++ == 0) stats_.pinned += 1;
  }
}

void BlockStore::Unpin(std::span<const BlockKey> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const BlockKey& k : keys) {
    int* pins = nullptr;
    if (auto found = index_.find(k); found != index_.end()) {
      pins = &found->second.pins;
    } else if (auto queued = pending_.find(k); queued != pending_.end()) {
      pins = &queued->second->pins;
    }
    if (pins != nullptr && *pins > 0 && --*pins == 0) stats_.pinned -= 1;
  }
}

void BlockStore::Erase(const BlockKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_.count(key)) {  // Not written yet: the writer skips it.
    UnqueueLocked(key);
    return;
  }
  rocksdb::WriteBatch batch;
  RemoveLocked(key, &batch);
  Commit(&batch);
}

rocksdb::Status BlockStore::Commit(rocksdb::WriteBatch* batch) {
  if (writes_stopped_) {
    commit_failures_ += 1;
    return rocksdb::Status::Aborted("cache writes stopped after an earlier failure");
  }
  rocksdb::Status s = db_->Write(rocksdb::WriteOptions(), batch);
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (!writes_stopped_.exchange(true)) {
      failure_ = s.ToString();
      spdlog::error("cache: write failed, no more entries are written: {}", failure_);
    }
    commit_failures_ += 1;
  }
  return s;
}

std::pair<uint64_t, uint64_t> BlockStore::EvictUnpinned() {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t entries = index_.size(), bytes = stats_.disk_bytes;
  EvictLocked(0, 0);
  return {entries - index_.size(), bytes - stats_.disk_bytes};
}

void BlockStore::SetSnapshotCost(double blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  options_.snapshot_cost_blocks = std::max(blocks, 0.0);
  if (options_.eviction == StoreOptions::Eviction::kLru) return;
  // Ranks follow the new cost.
  order_.clear();
  for (auto& [key, e] : index_) {
    e.rank = RankOf(e);
    order_.insert(OrderOf(e, key));
  }
}

void BlockStore::SetLimits(uint64_t ram_bytes, uint64_t disk_quota_bytes, int64_t ttl_seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  options_.ram_bytes = ram_bytes;
  options_.disk_quota_bytes = disk_quota_bytes;
  options_.ttl_seconds = ttl_seconds;
  const int64_t expire = ttl_seconds > 0 ? NowMs() - ttl_seconds * 1000 : 0;
  EvictLocked(disk_quota_bytes, expire);
  while (stats_.ram_bytes > options_.ram_bytes && !ram_.empty()) RamEraseLocked(ram_.back().first);
}

BlockStore::Stats BlockStore::stats() const {
  Stats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = stats_;
    s.entries = index_.size();
    s.queued = pending_.size();
  }
  if (writes_stopped_) {
    std::lock_guard<std::mutex> lock(failure_mu_);
    s.degraded = true;
    if (s.degraded_reason.empty()) s.degraded_reason = failure_;
  }
  s.write_failures = commit_failures_;
  return s;
}

std::string BlockStore::DataKey(const BlockKey& key, const Entry& e) const {
  return e.kind == Kind::kBlock ? BlockDataKey(e.root, e.depth, key) : key.ToBytes();
}

std::optional<std::string> BlockStore::RawValue(Kind kind, const BlockKey& key) const {
  std::string data_key;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto e = index_.find(key);
    if (e == index_.end() || e->second.kind != kind) return std::nullopt;
    data_key = DataKey(key, e->second);
  }
  std::string v;
  if (!db_->Get(rocksdb::ReadOptions(), Family(kind), data_key, &v).ok()) return std::nullopt;
  return v;
}

Status BlockStore::OverwriteRawValue(Kind kind, const BlockKey& key, std::string_view value) {
  std::string data_key;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RamEraseLocked(key);
    auto e = index_.find(key);
    if (e == index_.end() || e->second.kind != kind) return NotFound("no such entry");
    data_key = DataKey(key, e->second);
  }
  rocksdb::WriteBatch batch;
  batch.Put(Family(kind), data_key, rocksdb::Slice(value.data(), value.size()));
  rocksdb::Status s = Commit(&batch);
  return s.ok() ? Status::Ok() : IoError(s.ToString());
}

}  // namespace flashd::cache
