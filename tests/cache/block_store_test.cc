// BlockStore and Catalog against a real RocksDB and SQLite in a temporary directory.
#include "cache/block_store.h"

#include <rocksdb/file_checksum.h>
#include <sqlite3.h>

#include <boost/test/unit_test.hpp>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include "cache/catalog.h"
#include "cache/crc32c.h"
#include "tests/support/temp_dir.h"

namespace flashd::cache {
namespace {

using flashd::testing::TempDir;
using Kind = BlockStore::Kind;

const KeyContext kContext{HashBytes("model"), 1, "tenant", "cpu/1"};

// A chain of `n` blocks of 4 tokens each, starting at token `first`.
struct Chain {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<BlockKey> keys;
  Chain(int n, int32_t first, BlockKey parent = {}) {
    for (int i = 0; i < n; ++i) {
      std::vector<int32_t> t(4);
      std::iota(t.begin(), t.end(), first + 4 * i);
      parent = ChainBlockKey(parent, t, kContext);
      tokens.push_back(t);
      keys.push_back(parent);
    }
  }
  std::vector<std::span<const int32_t>> spans() const {
    return std::vector<std::span<const int32_t>>(tokens.begin(), tokens.end());
  }
};

std::string PayloadFor(const BlockKey& k, size_t bytes) {
  std::string p(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<char>((k.lo >> (i % 8)) + i);
  return p;
}

void PutChain(BlockStore& store, const Chain& c, size_t bytes, uint32_t depth0 = 0,
              BlockKey parent = {}) {
  for (size_t i = 0; i < c.keys.size(); ++i) {
    store.Put(Kind::kBlock, c.keys[i], i == 0 ? parent : c.keys[i - 1],
              depth0 + static_cast<uint32_t>(i) + 1, c.tokens[i], PayloadFor(c.keys[i], bytes));
  }
  store.Flush();
}

std::unique_ptr<BlockStore> OpenStore(
    const std::filesystem::path& dir, uint64_t quota = 1 << 30, int64_t ttl = 0,
    uint64_t ram = 1 << 20, StoreOptions::Eviction eviction = StoreOptions::Eviction::kLru) {
  StoreOptions o;
  o.eviction = eviction;
  o.dir = (dir / "cache").string();
  o.disk_quota_bytes = quota;
  o.ttl_seconds = ttl;
  o.ram_bytes = ram;
  auto store = BlockStore::Open(o);
  BOOST_REQUIRE_MESSAGE(store.ok(), store.status().ToString());
  return std::move(store).value();
}

// Writes `c` through a store of its own (closed again before returning), so a test can size its
// quota: the bytes one stored entry of that payload size takes.
uint64_t PutChainAlone(const std::filesystem::path& dir, const Chain& c, size_t bytes) {
  auto store = OpenStore(dir);
  PutChain(*store, c, bytes);
  return store->stats().disk_bytes / c.keys.size();
}

BOOST_AUTO_TEST_SUITE(block_store)

// The instruction and the table give the same values at every length and alignment, pieces
// extend as one, and both equal RocksDB's CRC32C, which stored values were checked with before.
BOOST_AUTO_TEST_CASE(crc32c_hardware_table_and_rocksdb_agree) {
  std::mt19937 rng(5);
  std::vector<uint8_t> buf(1 << 20);
  for (uint8_t& b : buf) b = static_cast<uint8_t>(rng());
  auto rocks = [](const uint8_t* p, size_t n) {
    auto gen = rocksdb::GetFileChecksumGenCrc32cFactory()->CreateFileChecksumGenerator(
        rocksdb::FileChecksumGenContext());
    gen->Update(reinterpret_cast<const char*>(p), n);
    gen->Finalize();
    uint32_t v = 0;
    for (char ch : gen->GetChecksum()) v = (v << 8) | static_cast<uint8_t>(ch);
    return v;
  };
  for (size_t offset = 0; offset < 8; ++offset) {
    // Around one and several three-lane rounds too (internal::kCrcLane).
    constexpr size_t R = 3 * internal::kCrcLane;
    for (size_t n :
         {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{63}, size_t{64}, size_t{65},
          size_t{1000}, size_t{4097}, R - 1, R, R + 1, 2 * R + 13, size_t{10240}, buf.size() - 8}) {
      const uint32_t want = rocks(&buf[offset], n);
      BOOST_TEST(internal::Crc32cTable(0, &buf[offset], n) == want, offset << " " << n);
      if (Crc32cInHardware()) {
        BOOST_TEST(internal::Crc32cSse42(0, &buf[offset], n) == want, offset << " " << n);
      }
      std::vector<uint8_t> copy(n + 1, 0xA5);
      BOOST_TEST(Crc32cExtendCopy(0, copy.data(), &buf[offset], n) == want);
      BOOST_TEST(std::memcmp(copy.data(), &buf[offset], n) == 0);
      BOOST_TEST(copy[n] == 0xA5);  // Not a byte past the end.
      BOOST_TEST(Crc32cExtend(Crc32cExtend(0, &buf[offset], n / 3), &buf[offset + n / 3],
                              n - n / 3) == want);
    }
  }
  BOOST_TEST_MESSAGE("CRC32C in hardware: " << Crc32cInHardware());
}

BOOST_AUTO_TEST_CASE(crc32c_is_castagnoli) {
  // The check value of CRC-32C (iSCSI), and the RFC 3720 all-zero vector.
  BOOST_TEST(Crc32c("123456789") == 0xE3069283u);
  BOOST_TEST(Crc32c(std::string(32, '\0')) == 0x8A9136AAu);
  BOOST_TEST(Crc32c("123456789") != Crc32c("123456788"));
}

// The read into destinations, as a restore uses it: a long chain read on several threads (over
// the 256-key slice), each payload put once, from disk and then from RAM; what the caller
// refuses, or what is not stored, is reported as not delivered.
BOOST_AUTO_TEST_CASE(read_blocks_into_puts_each_payload_once_from_any_thread) {
  TempDir dir;
  Chain c(700, 1);
  {
    auto store = OpenStore(dir.path(), 1 << 30, 0, 64 << 20);
    PutChain(*store, c, 300);
  }
  auto store = OpenStore(dir.path(), 1 << 30, 0, 64 << 20);
  Chain missing(1, 90000, c.keys.back());
  std::vector<BlockKey> keys = c.keys;
  keys.push_back(missing.keys[0]);
  auto spans = c.spans();
  spans.push_back(missing.tokens[0]);
  for (const char* from : {"disk", "ram"}) {
    std::vector<std::string> got(keys.size());
    std::vector<std::atomic<int>> calls(keys.size());
    std::mutex mu;
    std::set<std::thread::id> threads;
    auto delivered = store->ReadBlocksInto(keys, spans, [&](size_t i, size_t bytes) -> uint8_t* {
      calls[i] += 1;
      {
        std::lock_guard<std::mutex> lock(mu);
        threads.insert(std::this_thread::get_id());
      }
      if (i == 5) return nullptr;  // Refused: a miss.
      got[i].assign(bytes, '?');
      return reinterpret_cast<uint8_t*>(got[i].data());
    });
    BOOST_REQUIRE(delivered.size() == keys.size());
    for (size_t i = 0; i < c.keys.size(); ++i) {
      BOOST_TEST(calls[i] == 1, from << " " << i);
      BOOST_TEST(delivered[i] == (i != 5), from << " " << i);
      if (i != 5) BOOST_TEST(got[i] == PayloadFor(c.keys[i], 300), from << " " << i);
    }
    BOOST_TEST(calls.back() == 0);
    BOOST_TEST(!delivered.back());
    // 700 keys: three slices, on up to three reading threads (one may take them all).
    BOOST_TEST(threads.size() >= 1u);
    if (std::string(from) == "disk") BOOST_TEST(store->stats().bytes_read_disk > 699u * 300u);
  }
  // The second pass came from the RAM tier; refusing a block is not a corruption.
  BOOST_TEST(store->stats().bytes_read_ram >= 699u * 300u);
  BOOST_TEST(store->stats().corruptions == 0u);
}

// A read that would take more than a quarter of the RAM tier goes around it: one long restore
// must not push out every other prompt's hot blocks. A short one still fills it.
BOOST_AUTO_TEST_CASE(a_long_read_leaves_the_ram_tier_alone) {
  TempDir dir;
  Chain long_chain(100, 1), short_chain(3, 5000);
  {
    auto store = OpenStore(dir.path());
    PutChain(*store, long_chain, 1000);
    PutChain(*store, short_chain, 1000);
  }
  auto store = OpenStore(dir.path(), 1 << 30, 0, 40000);  // 100 KB chain > 10 KB (a quarter).
  auto read = [&](const Chain& c) {
    for (const auto& p : store->ReadBlocks(c.keys, c.spans())) BOOST_TEST(p.has_value());
  };
  read(short_chain);
  read(long_chain);
  BOOST_TEST(store->stats().ram_bytes == 3000u);  // Only the short chain is in RAM.
  const uint64_t disk = store->stats().bytes_read_disk;
  read(short_chain);
  BOOST_TEST(store->stats().bytes_read_disk == disk);  // Still served from RAM.
  read(long_chain);
  BOOST_TEST(store->stats().bytes_read_disk > disk + 100000);
}

BOOST_AUTO_TEST_CASE(round_trip_survives_a_restart) {
  TempDir dir;
  Chain c(5, 100);
  {
    auto store = OpenStore(dir.path());
    PutChain(*store, c, 1000);
    BOOST_TEST(store->PresentPrefix(c.keys) == 5u);
    BOOST_TEST(store->stats().blocks == 5u);
  }
  auto store = OpenStore(dir.path());  // RAM tier empty: everything comes from disk.
  BOOST_TEST(store->PresentPrefix(c.keys) == 5u);
  auto got = store->ReadBlocks(c.keys, c.spans());
  for (size_t i = 0; i < 5; ++i) {
    BOOST_REQUIRE(got[i].has_value());
    BOOST_TEST(*got[i] == PayloadFor(c.keys[i], 1000));
  }
  BOOST_TEST(store->stats().bytes_read_disk > 5000u);
  // Read again: now from RAM.
  const uint64_t disk = store->stats().bytes_read_disk;
  got = store->ReadBlocks(c.keys, c.spans());
  BOOST_TEST(store->stats().bytes_read_disk == disk);
  BOOST_TEST(store->stats().bytes_read_ram == 5000u);
}

// A store written under another payload format (or before formats were recorded) is emptied at
// open, and says so; under the same format it is kept.
BOOST_AUTO_TEST_CASE(another_payload_format_is_dropped_at_open) {
  TempDir dir;
  Chain c(3, 500);
  auto open = [&](const std::string& format) {
    StoreOptions o;
    o.dir = (dir.path() / "cache").string();
    o.payload_format = format;
    auto store = BlockStore::Open(o);
    BOOST_REQUIRE_MESSAGE(store.ok(), store.status().ToString());
    return std::move(store).value();
  };
  {
    auto store = open("");  // An older build: records no format.
    PutChain(*store, c, 700);
  }
  {
    auto store = open("layout 2");
    BOOST_REQUIRE(store->dropped_at_open().has_value());
    BOOST_TEST(store->dropped_at_open()->entries == 3u);
    BOOST_TEST(store->dropped_at_open()->bytes >= 3 * 700u);
    BOOST_TEST(store->dropped_at_open()->format == "");
    BOOST_TEST(store->PresentPrefix(c.keys) == 0u);
    BOOST_TEST(store->stats().entries == 0u);
    PutChain(*store, c, 700);
  }
  {
    auto store = open("layout 2");  // Same format: kept.
    BOOST_TEST(!store->dropped_at_open().has_value());
    BOOST_TEST(store->PresentPrefix(c.keys) == 3u);
  }
  auto store = open("layout 3");
  BOOST_REQUIRE(store->dropped_at_open().has_value());
  BOOST_TEST(store->dropped_at_open()->format == "layout 2");
  BOOST_TEST(store->PresentPrefix(c.keys) == 0u);
  // Nothing of the old entries is readable, from RocksDB either.
  BOOST_TEST(!store->RawValue(Kind::kBlock, c.keys[0]).has_value());
}

BOOST_AUTO_TEST_CASE(a_shared_prefix_is_stored_once) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  Chain common(10, 0);
  Chain a(2, 1000, common.keys.back()), b(3, 2000, common.keys.back());
  PutChain(*store, common, 500);
  PutChain(*store, a, 500, 10, common.keys.back());
  const uint64_t written = store->stats().bytes_written;
  PutChain(*store, common, 500);  // The second conversation writes its whole prefix again...
  PutChain(*store, b, 500, 10, common.keys.back());
  // ...and only its own three blocks are added.
  BOOST_TEST(store->stats().blocks == 15u);
  BOOST_TEST(store->stats().bytes_written - written == 3 * (written / 12));
}

BOOST_AUTO_TEST_CASE(a_corrupt_block_is_a_counted_miss_and_deleted) {
  TempDir dir;
  Chain c(3, 7);
  {
    auto store = OpenStore(dir.path());
    PutChain(*store, c, 256);
    std::string v = *store->RawValue(Kind::kBlock, c.keys[1]);
    v[v.size() - 10] ^= 0x20;  // One bit in the payload.
    BOOST_REQUIRE(store->OverwriteRawValue(Kind::kBlock, c.keys[1], v).ok());
  }
  auto store = OpenStore(dir.path());
  auto got = store->ReadBlocks(c.keys, c.spans());
  BOOST_TEST(got[0].has_value());
  BOOST_TEST(!got[1].has_value());
  BOOST_TEST(store->stats().corruptions == 1u);
  BOOST_TEST(!store->Contains(c.keys[1]));
  BOOST_TEST(!store->RawValue(Kind::kBlock, c.keys[1]).has_value());
  BOOST_TEST(store->PresentPrefix(c.keys) == 1u);
}

BOOST_AUTO_TEST_CASE(wrong_tokens_or_a_moved_value_are_misses) {
  TempDir dir;
  auto store = OpenStore(dir.path(), 1 << 30, 0, /*ram=*/0);
  Chain c(2, 40);
  PutChain(*store, c, 128);
  const std::string first_value = *store->RawValue(Kind::kBlock, c.keys[0]);
  // A valid value copied under another key fails the CRC (the key is covered).
  BOOST_REQUIRE(store->OverwriteRawValue(Kind::kBlock, c.keys[1], first_value).ok());
  std::vector<std::span<const int32_t>> first = {c.tokens[0]};
  BOOST_TEST(!store->ReadBlocks(std::span(c.keys).subspan(1, 1), first)[0].has_value());
  // The block under key 0 holds other tokens than the caller expects.
  std::vector<int32_t> other = {1, 2, 3, 4};
  std::vector<std::span<const int32_t>> spans = {other};
  BOOST_TEST(!store->ReadBlocks(std::span(c.keys).first(1), spans)[0].has_value());
  BOOST_TEST(store->stats().corruptions == 2u);
  BOOST_TEST(store->stats().entries == 0u);
}

BOOST_AUTO_TEST_CASE(quota_evicts_least_recent_leaves_first_and_respects_pins) {
  TempDir dir;
  Chain pinned(6, 0), old_chain(6, 1000), new_chain(6, 2000);
  const uint64_t entry_bytes = PutChainAlone(dir.path(), pinned, 1000);
  // Room for 14 entries: the pinned 6, then two more chains of 6.
  auto store = OpenStore(dir.path(), 14 * entry_bytes);
  store->Pin(pinned.keys);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  PutChain(*store, old_chain, 1000);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  PutChain(*store, new_chain, 1000);
  const auto s = store->stats();
  BOOST_TEST(s.disk_bytes <= 14 * entry_bytes);
  BOOST_TEST(s.evictions == 4u);
  // The pinned chain is whole, the newest chain whole, the old one lost its tail only.
  BOOST_TEST(store->PresentPrefix(pinned.keys) == 6u);
  BOOST_TEST(store->PresentPrefix(new_chain.keys) == 6u);
  BOOST_TEST(store->PresentPrefix(old_chain.keys) == 2u);
  for (size_t i = 2; i < 6; ++i) BOOST_TEST(!store->Contains(old_chain.keys[i]));
  // Unpinned, the pinned chain is the oldest and goes first when room is needed.
  store->Unpin(pinned.keys);
  Chain more(2, 3000);
  PutChain(*store, more, 1000);
  BOOST_TEST(store->PresentPrefix(pinned.keys) == 4u);
  BOOST_TEST(store->PresentPrefix(new_chain.keys) == 6u);
}

BOOST_AUTO_TEST_CASE(reading_a_chain_makes_it_recent) {
  TempDir dir;
  Chain a(4, 0), b(4, 100), c(4, 200);
  const uint64_t entry_bytes = PutChainAlone(dir.path(), a, 500);
  auto store = OpenStore(dir.path(), 8 * entry_bytes);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  PutChain(*store, b, 500);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  store->ReadBlocks(a.keys, a.spans());  // a is now more recent than b.
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  PutChain(*store, c, 500);
  BOOST_TEST(store->PresentPrefix(a.keys) == 4u);
  BOOST_TEST(store->PresentPrefix(b.keys) == 0u);
  BOOST_TEST(store->PresentPrefix(c.keys) == 4u);
}

// A prefix every session reads (a client's system prompt and tools) against newer one-off
// prompts: least-recently-used evicts the shared one as soon as newer prompts fill the quota;
// the cost policy keeps it (its hits make it worth more per byte) and drops an unread one.
BOOST_AUTO_TEST_CASE(cost_eviction_keeps_a_widely_read_prefix_lru_does_not) {
  for (auto policy : {StoreOptions::Eviction::kCost, StoreOptions::Eviction::kLru}) {
    TempDir dir;
    Chain shared(4, 0), once1(4, 100), once2(4, 200);
    const uint64_t entry_bytes = PutChainAlone(dir.path(), shared, 500);
    auto store = OpenStore(dir.path(), 8 * entry_bytes, 0, 1 << 20, policy);
    for (int i = 0; i < 5; ++i) store->ReadBlocks(shared.keys, shared.spans());
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    PutChain(*store, once1, 500);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    PutChain(*store, once2, 500);
    BOOST_TEST(store->stats().evictions == 4u);
    BOOST_TEST(store->PresentPrefix(once2.keys) == 4u);
    if (policy == StoreOptions::Eviction::kCost) {
      BOOST_TEST(store->PresentPrefix(shared.keys) == 4u);
      BOOST_TEST(store->PresentPrefix(once1.keys) == 0u);
    } else {
      BOOST_TEST(store->PresentPrefix(shared.keys) == 0u);
      BOOST_TEST(store->PresentPrefix(once1.keys) == 4u);
    }
  }
}

// Snapshots weigh the replay a miss on them causes: with that cost, one outlives an unread
// block of the same size written after it.
BOOST_AUTO_TEST_CASE(cost_eviction_weighs_a_snapshot_by_its_replay) {
  TempDir dir;
  Chain base(1, 0), later(2, 100);
  const uint64_t entry_bytes = PutChainAlone(dir.path(), base, 500);
  auto store = OpenStore(dir.path(), 3 * entry_bytes + entry_bytes / 2, 0, 1 << 20,
                         StoreOptions::Eviction::kCost);
  store->SetSnapshotCost(86);  // The released model: 43 layers' windows, in 64-token blocks.
  const std::vector<int32_t> tail = {7, 8};
  const BlockKey snap = ChainBlockKey(base.keys[0], tail, kContext);
  // The same stored size as a block: 2 tail tokens instead of 4, 8 bytes more payload.
  store->Put(Kind::kSnapshot, snap, base.keys[0], 1, tail, std::string(508, 's'));
  store->Flush();
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  PutChain(*store, later, 500);  // Four entries for room for three and a half: one goes.
  BOOST_TEST(store->stats().evictions == 1u);
  BOOST_TEST(store->Contains(snap));
  BOOST_TEST(store->PresentPrefix(later.keys) == 1u);  // The newer, unread block went.
}

BOOST_AUTO_TEST_CASE(ttl_expires_idle_entries) {
  // Under either policy (cost's order is not by age: its expiry is a scan).
  for (auto policy : {StoreOptions::Eviction::kLru, StoreOptions::Eviction::kCost}) {
    TempDir dir;
    auto store = OpenStore(dir.path(), 1 << 30, /*ttl=*/1, 1 << 20, policy);
    Chain c(3, 0);
    PutChain(*store, c, 100);
    BOOST_TEST(store->stats().entries == 3u);
    // The writer sweeps once a second; after the TTL everything idle is gone.
    for (int i = 0; i < 50 && store->stats().entries > 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    BOOST_TEST(store->stats().entries == 0u);
    BOOST_TEST(store->stats().expirations == 3u);
  }
}

BOOST_AUTO_TEST_CASE(unreachable_entries_are_collected_at_start) {
  TempDir dir;
  Chain c(5, 0);
  {
    auto store = OpenStore(dir.path());
    PutChain(*store, c, 100);
    store->Erase(c.keys[2]);  // The middle goes; 3 and 4 can never be reached again.
    BOOST_TEST(store->stats().entries == 4u);
  }
  auto store = OpenStore(dir.path());
  BOOST_TEST(store->stats().entries == 2u);
  BOOST_TEST(!store->RawValue(Kind::kBlock, c.keys[4]).has_value());
}

BOOST_AUTO_TEST_CASE(snapshots_hang_from_their_block) {
  TempDir dir;
  Chain c(2, 0);
  auto store = OpenStore(dir.path());
  PutChain(*store, c, 100);
  std::vector<int32_t> tail = {8, 9};
  const BlockKey snap = ChainBlockKey(c.keys[1], tail, kContext);
  store->Put(Kind::kSnapshot, snap, c.keys[1], 2, tail, "state bytes");
  store->Flush();
  auto refs = store->SnapshotsUnder(c.keys[1]);
  BOOST_REQUIRE(refs.size() == 1u);
  BOOST_TEST(refs[0].key.ToHex() == snap.ToHex());
  BOOST_TEST(refs[0].tail == tail);
  BOOST_TEST(*store->ReadSnapshot(snap, tail) == "state bytes");
  std::vector<int32_t> wrong = {8, 10};
  BOOST_TEST(!store->ReadSnapshot(snap, wrong).has_value());
  BOOST_TEST(store->SnapshotsUnder(c.keys[0]).empty());
}

// An entry the writer has not stored yet is found by every lookup, read and pin from memory, so
// a request right behind the one that stored a prefix restores it; once written it is the same
// entry on disk, an erased one is never written, and the pins taken meanwhile hold.
BOOST_AUTO_TEST_CASE(queued_entries_are_found_before_the_writer_stores_them) {
  TempDir dir;
  Chain c(3, 0);
  std::vector<int32_t> tail = {12, 13};
  const BlockKey snap = ChainBlockKey(c.keys[2], tail, kContext);
  Chain gone(1, 500);
  {
    auto store = OpenStore(dir.path(), 1 << 30, 0, /*ram=*/0);
    store->HoldWrites(true);
    for (size_t i = 0; i < c.keys.size(); ++i) {
      store->Put(Kind::kBlock, c.keys[i], i == 0 ? BlockKey{} : c.keys[i - 1],
                 static_cast<uint32_t>(i) + 1, c.tokens[i], PayloadFor(c.keys[i], 300));
    }
    store->Put(Kind::kSnapshot, snap, c.keys[2], 3, tail, "state bytes");
    store->Put(Kind::kBlock, gone.keys[0], {}, 1, gone.tokens[0], "never written");
    BOOST_TEST(store->stats().blocks == 0u);
    BOOST_TEST(store->stats().queued == 5u);
    BOOST_TEST(store->PresentPrefix(c.keys) == 3u);
    BOOST_TEST(store->Contains(snap));
    auto got = store->ReadBlocks(c.keys, c.spans());
    for (size_t i = 0; i < c.keys.size(); ++i) {
      BOOST_TEST((got[i] && *got[i] == PayloadFor(c.keys[i], 300)));
    }
    // The tokens are checked as for a stored entry.
    std::vector<std::span<const int32_t>> wrong = c.spans();
    std::vector<int32_t> other = {9, 9, 9, 9};
    wrong[1] = other;
    BOOST_TEST(!store->ReadBlocks(c.keys, wrong)[1].has_value());
    auto refs = store->SnapshotsUnder(c.keys[2]);
    BOOST_REQUIRE(refs.size() == 1u);
    BOOST_TEST(refs[0].key.ToHex() == snap.ToHex());
    BOOST_TEST(refs[0].tail == tail);
    BOOST_TEST(*store->ReadSnapshot(snap, tail) == "state bytes");
    std::vector<int32_t> wrong_tail = {12, 14};
    BOOST_TEST(!store->ReadSnapshot(snap, wrong_tail).has_value());
    // Queued twice: stored once.
    store->Put(Kind::kBlock, c.keys[0], {}, 1, c.tokens[0], PayloadFor(c.keys[0], 300));
    BOOST_TEST(store->stats().queued == 5u);
    const BlockKey pin[] = {snap};
    store->Pin(pin);
    BOOST_TEST(store->stats().pinned == 1u);
    store->Erase(gone.keys[0]);
    BOOST_TEST(!store->Contains(gone.keys[0]));
    store->HoldWrites(false);
    store->Flush();
    const BlockStore::Stats s = store->stats();
    BOOST_TEST(s.queued == 0u);
    BOOST_TEST(s.blocks == 3u);
    BOOST_TEST(s.snapshots == 1u);
    BOOST_TEST(s.pinned == 1u);
    BOOST_TEST(!store->RawValue(Kind::kBlock, gone.keys[0]).has_value());
    // The pin taken while queued keeps the snapshot, and so its chain, from being dropped.
    store->EvictUnpinned();
    BOOST_TEST(store->PresentPrefix(c.keys) == 3u);
    BOOST_TEST(store->Contains(snap));
  }
  // On disk: read back after reopening (no RAM tier, so from RocksDB).
  auto store = OpenStore(dir.path(), 1 << 30, 0, /*ram=*/0);
  BOOST_TEST(store->stats().queued == 0u);
  auto got = store->ReadBlocks(c.keys, c.spans());
  for (size_t i = 0; i < c.keys.size(); ++i) {
    BOOST_TEST((got[i] && *got[i] == PayloadFor(c.keys[i], 300)));
  }
  BOOST_TEST(*store->ReadSnapshot(snap, tail) == "state bytes");
  BOOST_TEST(!store->Contains(gone.keys[0]));
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(catalog)

// The tool-call ledger's table: calls persist across reopening, the newest are kept.
BOOST_AUTO_TEST_CASE(tool_calls_persist_and_the_oldest_go_beyond_the_limit) {
  TempDir dir;
  const std::string path = (dir.path() / "catalog.db").string();
  {
    auto cat = Catalog::Open(path);
    BOOST_REQUIRE(cat.ok());
    BOOST_TEST((*cat)->PutToolCall("call_a", "<invoke a>").ok());
    BOOST_TEST((*cat)->PutToolCall("call_b", "<invoke b>").ok());
  }
  auto cat = Catalog::Open(path);
  BOOST_REQUIRE(cat.ok());
  BOOST_TEST((*cat)->FindToolCall("call_a").value_or("") == "<invoke a>");
  BOOST_TEST(!(*cat)->FindToolCall("call_c").has_value());
  (*cat)->set_tool_call_limit(100);
  for (int i = 0; i < Catalog::kToolCallTrimEvery; ++i) {
    BOOST_REQUIRE((*cat)->PutToolCall("call_" + std::to_string(i), "x").ok());
  }
  BOOST_TEST((*cat)->ToolCalls() == 100);
  BOOST_TEST(
      (*cat)->FindToolCall("call_" + std::to_string(Catalog::kToolCallTrimEvery - 1)).has_value());
  cat->reset();
  // A catalog of schema 1 (before the ledger) gains the table on open and keeps its rows.
  sqlite3* db = nullptr;
  BOOST_REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  BOOST_REQUIRE(sqlite3_exec(db,
                             "DROP TABLE tool_calls; INSERT INTO tenants VALUES ('bob', 1); "
                             "PRAGMA user_version=1",
                             nullptr, nullptr, nullptr) == SQLITE_OK);
  sqlite3_close(db);
  auto migrated = Catalog::Open(path);
  BOOST_REQUIRE_MESSAGE(migrated.ok(), migrated.status().ToString());
  BOOST_TEST((*migrated)->schema_version() == 2);
  BOOST_TEST((*migrated)->Tenants().size() == 1u);
  BOOST_TEST((*migrated)->PutToolCall("call_z", "z").ok());
  BOOST_TEST((*migrated)->FindToolCall("call_z").value_or("") == "z");
}

BOOST_AUTO_TEST_CASE(migrates_and_keeps_pins_and_usage) {
  TempDir dir;
  const std::string path = (dir.path() / "catalog.db").string();
  Chain c(3, 0);
  {
    auto cat = Catalog::Open(path);
    BOOST_REQUIRE_MESSAGE(cat.ok(), cat.status().ToString());
    BOOST_TEST((*cat)->schema_version() == Catalog::kSchemaVersion);
    Catalog::Pin p{"alice", "tools", c.keys, c.keys[2], 12, 0};
    BOOST_TEST((*cat)->PutPin(p).ok());
    BOOST_TEST((*cat)->AddUsage("alice", {1, 100, 64, 5}).ok());
    BOOST_TEST((*cat)->AddUsage("alice", {1, 50, 0, 7}).ok());
  }
  auto cat = Catalog::Open(path);
  BOOST_REQUIRE(cat.ok());
  auto pin = (*cat)->FindPin("alice", "tools");
  BOOST_REQUIRE(pin.has_value());
  BOOST_TEST((pin->chain == c.keys));
  BOOST_TEST(pin->snapshot.ToHex() == c.keys[2].ToHex());
  BOOST_TEST(pin->tokens == 12);
  BOOST_TEST(!(*cat)->FindPin("bob", "tools").has_value());
  const auto u = (*cat)->UsageOf("alice");
  BOOST_TEST(u.requests == 2);
  BOOST_TEST(u.prompt_tokens == 150);
  BOOST_TEST(u.cached_tokens == 64);
  BOOST_TEST(u.completion_tokens == 12);
  BOOST_TEST((*cat)->Tenants() == std::vector<std::string>{"alice"});
  cache::Catalog::Session x{"sess_1", "alice", "t", 0, 0, 42, "{}", c.keys[2], c.keys[1]};
  BOOST_TEST((*cat)->PutSession(x).ok());
  auto back = (*cat)->FindSession("alice", "sess_1");
  BOOST_REQUIRE(back.has_value());
  BOOST_TEST(back->head_key.ToHex() == c.keys[2].ToHex());
  BOOST_TEST(back->snapshot_key.ToHex() == c.keys[1].ToHex());
  BOOST_TEST(!(*cat)->FindSession("bob", "sess_1").has_value());
  const auto keys = (*cat)->AllSessionKeys();
  BOOST_REQUIRE(keys.size() == 1u);
  BOOST_TEST(keys[0].head_key.ToHex() == c.keys[2].ToHex());
  BOOST_TEST((*cat)->ClearSessionKeys("alice", "sess_1").ok());
  back = (*cat)->FindSession("alice", "sess_1");
  BOOST_TEST(back->head_key.IsRoot());
  BOOST_TEST(back->snapshot_key.IsRoot());
  BOOST_TEST(back->tokens == 42);  // The rest of the row is untouched.
  BOOST_TEST((*cat)->DeletePin("alice", "tools").ok());
  BOOST_TEST((*cat)->DeletePin("alice", "tools").code() == StatusCode::kNotFound);
}

BOOST_AUTO_TEST_CASE(a_newer_schema_is_refused) {
  TempDir dir;
  const std::string path = (dir.path() / "catalog.db").string();
  sqlite3* db = nullptr;
  BOOST_REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  BOOST_REQUIRE(sqlite3_exec(db, "PRAGMA user_version=99", nullptr, nullptr, nullptr) == 0);
  sqlite3_close(db);
  auto cat = Catalog::Open(path);
  BOOST_REQUIRE(!cat.ok());
  BOOST_TEST(cat.status().message().find("schema version 99") != std::string::npos);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::cache
