// BlockManager and the forward pass's allocation: every block a step writes is reserved before
// the step, a full pool fails only the sequence that needs the block, and a failed call leaves
// every sequence exactly as it was.
#include "engine/block_manager.h"

#include <boost/test/unit_test.hpp>
#include <cstring>
#include <random>

#include "engine/forward.h"
#include "engine/forward_plan.h"
#include "tests/support/golden_forward.h"

namespace flashd::engine {
namespace {

BOOST_AUTO_TEST_SUITE(block_manager)

BOOST_AUTO_TEST_CASE(reserve_appends_copies_shared_blocks_and_commits) {
  auto pool = std::make_shared<KvPool>(32, 10);
  BlockManager bm(pool);
  std::vector<int32_t> a = {pool->Allocate(), pool->Allocate()};
  std::memset(pool->mutable_data(a[1]), 7, 32);
  std::vector<int32_t> b = {a[0], a[1]};  // A fork: both blocks shared.
  pool->Ref(a[0]);
  pool->Ref(a[1]);
  auto r = bm.Reserve(&b, 1, 4);
  BOOST_REQUIRE(r.ok());
  BOOST_TEST(b.size() == 4u);
  BOOST_TEST(b[0] == a[0]);  // Outside the range: still shared.
  BOOST_TEST(b[1] != a[1]);  // Written by the step: a private copy with the same bytes.
  BOOST_TEST(std::memcmp(pool->data(b[1]), pool->data(a[1]), 32) == 0);
  BOOST_TEST(pool->refs(a[1]) == 2);  // Given up only at commit.
  r->Commit();
  BOOST_TEST(pool->refs(a[1]) == 1);
  BOOST_TEST(pool->refs(b[1]) == 1);
  BOOST_TEST(pool->used_blocks() == 5u);
}

// A restore's blocks become the pool's without a copy: adopted memory is the block's memory,
// into a freed id or a new one, counted like an allocation, refused (and freed) at capacity.
BOOST_AUTO_TEST_CASE(adopted_memory_becomes_a_block) {
  KvPool pool(40, 3);
  const int32_t a = pool.Allocate();
  pool.Allocate();
  pool.Unref(a);  // a's id is free again.
  KvPool::BlockMemory m = KvPool::NewBlockMemory(40);
  BOOST_REQUIRE(m);
  BOOST_TEST(reinterpret_cast<uintptr_t>(m.get()) % 64 == 0u);
  BOOST_TEST(m.get()[40] == 0);  // The padding to 64 bytes is zeroed.
  std::memset(m.get(), 9, 40);
  uint8_t* bytes = m.get();
  const int32_t reused = pool.Adopt(std::move(m));
  BOOST_TEST(reused == a);
  BOOST_TEST(pool.data(reused) == bytes);
  BOOST_TEST(pool.block_table()[reused] == bytes);
  BOOST_TEST(pool.refs(reused) == 1);
  KvPool::BlockMemory n = KvPool::NewBlockMemory(40);
  uint8_t* more = n.get();
  const int32_t fresh = pool.Adopt(std::move(n));
  BOOST_TEST(fresh == 2);
  BOOST_TEST(pool.data(fresh) == more);
  BOOST_TEST(pool.used_blocks() == 3u);
  BOOST_TEST(pool.Adopt(KvPool::NewBlockMemory(40)) == -1);  // At capacity.
  BOOST_TEST(pool.Allocate() == -1);
  pool.Unref(fresh);
  const int32_t again = pool.Allocate();  // Allocate zeroes adopted memory it hands out again.
  BOOST_TEST(again == fresh);
  BOOST_TEST(pool.data(again)[0] == 0);
}

BOOST_AUTO_TEST_CASE(rollback_and_a_full_pool_change_nothing) {
  auto pool = std::make_shared<KvPool>(16, 4);
  BlockManager bm(pool);
  std::vector<int32_t> a = {pool->Allocate()};
  std::vector<int32_t> b = a;
  pool->Ref(a[0]);
  {
    auto r = bm.Reserve(&b, 0, 3);  // One copy and two new blocks: 3 of the 3 free.
    BOOST_REQUIRE(r.ok());
    BOOST_TEST(pool->used_blocks() == 4u);
  }  // Dropped without a commit: rolled back.
  BOOST_TEST((b == a));
  BOOST_TEST(pool->used_blocks() == 1u);
  BOOST_TEST(pool->refs(a[0]) == 2);
  auto r = bm.Reserve(&b, 0, 5);  // Needs 5, only 3 free.
  BOOST_TEST(!r.ok());
  BOOST_TEST(r.status().code() == StatusCode::kResourceExhausted);
  BOOST_TEST((b == a));
  BOOST_TEST(pool->used_blocks() == 1u);
}

const CpuForward& Golden() { return testing::GoldenForward(); }

std::vector<int32_t> Tokens(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(3,
                                           static_cast<int32_t>(Golden().config().vocab_size) - 1);
  std::vector<int32_t> t(n);
  for (int32_t& v : t) v = d(rng);
  return t;
}

// The plan lists each KV source's completed groups with their rotation positions, leaves
// restored (frozen) entries alone, and names the blocks the step writes.
BOOST_AUTO_TEST_CASE(plan_groups_rows_and_frozen_entries) {
  const CpuForward& f = Golden();
  const ModelConfig& c = f.config();
  std::vector<int32_t> prefix = Tokens(130, 3);
  SequenceState s = f.NewSequence();
  std::vector<float> logits;
  BOOST_REQUIRE(f.Forward(&s, prefix, &logits).ok());
  // A resume at 128 from the same blocks: entries of groups ending at or before 192 are frozen.
  std::vector<int32_t> blocks = s.blocks;
  for (int32_t b : blocks) f.pool()->Ref(b);
  auto resumed = f.ResumeAt(128, prefix, blocks);
  BOOST_REQUIRE(resumed.ok());
  std::vector<int32_t> more = Tokens(70, 4);
  const PlanRequest req{&*resumed, more};
  KvBlockLayout layout = *KvBlockLayout::For(c);
  ForwardPlan plan = PlanForward(c, layout, nullptr, {&req, 1});
  BOOST_TEST(plan.rows() == 70u);
  BOOST_TEST(plan.positions.front() == 128);
  BOOST_TEST(plan.window_first.back() == 197 - c.sliding_window + 1);
  for (size_t s_i = 0; s_i < layout.sources.size(); ++s_i) {
    const KvBlockLayout::Source& src = layout.sources[s_i];
    const ForwardPlan::Groups& g = plan.groups[0][s_i];
    BOOST_TEST(g.first_entry == 128 / src.ratio);
    BOOST_TEST(static_cast<int64_t>(g.positions.size()) == 70 / src.ratio);
    for (size_t k = 0; k < g.positions.size(); ++k) {
      BOOST_TEST(g.positions[k] == 128 + static_cast<int64_t>(k) * src.ratio);
      BOOST_TEST((g.rows[k] == -1) == (g.positions[k] + src.ratio <= 192));
    }
  }
  BOOST_TEST(plan.write_blocks[0].first == 3u);  // Positions 192.. are the fourth block.
  BOOST_TEST(plan.write_blocks[0].second == 4u);
}

BOOST_AUTO_TEST_CASE(a_full_pool_fails_only_the_sequence_that_needs_the_block) {
  const CpuForward& f = Golden();
  f.pool()->set_capacity_blocks(std::numeric_limits<size_t>::max());
  SequenceState a = f.NewSequence(), b = f.NewSequence(), alone = f.NewSequence();
  std::vector<float> la, lb, lalone;
  std::vector<int32_t> ta = Tokens(10, 5), tb = Tokens(200, 6);
  BOOST_REQUIRE(f.Forward(&alone, ta, &lalone).ok());
  const std::string b_before = b.Serialize();
  // Room for a's one block but not b's four.
  f.pool()->set_capacity_blocks(f.pool()->used_blocks() + 2);
  {
    Status sa, sb;
    std::vector<BatchItem> items = {{&a, ta, &la, &sa}, {&b, tb, &lb, &sb}};
    BOOST_REQUIRE(f.ForwardBatch(items).ok());
    BOOST_TEST(sa.ok());
    BOOST_TEST(sb.code() == StatusCode::kResourceExhausted);
    BOOST_TEST(b.Serialize() == b_before);  // b exactly as it was.
    BOOST_TEST(std::memcmp(la.data(), lalone.data(), la.size() * 4) == 0);
    BOOST_TEST(a.position == 10);
  }
  // Without per-sequence statuses the whole call fails, and changes nothing.
  const std::string a_before = a.Serialize();
  const size_t used = f.pool()->used_blocks();
  std::vector<int32_t> ta2 = Tokens(60, 7);
  std::vector<BatchItem> items = {{&a, ta2, &la}, {&b, tb, &lb}};
  Status s = f.ForwardBatch(items);
  BOOST_TEST(s.code() == StatusCode::kResourceExhausted);
  BOOST_TEST(a.Serialize() == a_before);
  BOOST_TEST(b.Serialize() == b_before);
  BOOST_TEST(f.pool()->used_blocks() == used);
  f.pool()->set_capacity_blocks(std::numeric_limits<size_t>::max());
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
