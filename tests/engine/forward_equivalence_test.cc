// Equivalences the forward pass must keep bit for bit: chunking, snapshots, batching.
#include <boost/test/unit_test.hpp>
#include <cstring>
#include <random>

#include "engine/forward.h"
#include "tests/support/golden_forward.h"

namespace flashd::engine {
namespace {

const std::string kDir = testing::GoldenDir();

const CpuForward& Forward() { return testing::GoldenForward(); }

std::vector<int32_t> Tokens(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(
      0, static_cast<int32_t>(Forward().config().vocab_size) - 1);
  std::vector<int32_t> t(n);
  for (int32_t& v : t) v = dist(rng);
  return t;
}

// Logits of every token, feeding `tokens` in chunks of the given sizes (cycled).
std::vector<float> RunChunked(const std::vector<int32_t>& tokens, const std::vector<size_t>& sizes,
                              SequenceState* state) {
  std::vector<float> all, part;
  ForwardOptions options;
  options.all_logits = true;
  size_t pos = 0, i = 0;
  while (pos < tokens.size()) {
    size_t n = std::min(sizes[i++ % sizes.size()], tokens.size() - pos);
    BOOST_REQUIRE(
        Forward().Forward(state, std::span<const int32_t>(&tokens[pos], n), &part, options).ok());
    all.insert(all.end(), part.begin(), part.end());
    pos += n;
  }
  return all;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

BOOST_AUTO_TEST_SUITE(forward_equivalence)

// The GEMMs asked for (FLASHD_TEST_GPU_GEMMS) are the ones running, and the cache keys them apart.
BOOST_AUTO_TEST_CASE(the_gemms_are_the_ones_asked_for) {
  const BackendReport r = Forward().backend().Report();
  const bool gpu = Forward().backend().name() != "cpu";
  const bool matrix = gpu && testing::TestMatrixGemms();
  BOOST_TEST(r.gemms.starts_with("matrix") == matrix, r.gemms);
  BOOST_TEST((Forward().numerics().find("-matrix") != std::string_view::npos) == matrix,
             Forward().numerics());
}

BOOST_AUTO_TEST_CASE(one_prefill_equals_any_chunking_equals_token_by_token) {
  const std::vector<int32_t> tokens = Tokens(77, 1);  // Past several windows and index top-ks.
  SequenceState whole = Forward().NewSequence();
  const std::vector<float> want = RunChunked(tokens, {tokens.size()}, &whole);
  const std::vector<std::vector<size_t>> chunkings = {{1}, {3}, {8}, {17}, {5, 1, 30, 2}};
  for (const auto& sizes : chunkings) {
    SequenceState st = Forward().NewSequence();
    std::vector<float> got = RunChunked(tokens, sizes, &st);
    BOOST_TEST(BitEqual(got, want), "chunk sizes starting " << sizes[0]);
    BOOST_TEST((st.Serialize() == whole.Serialize()), "state after chunks starting " << sizes[0]);
  }
}

BOOST_AUTO_TEST_CASE(snapshot_restore_continue_equals_uninterrupted) {
  const std::vector<int32_t> prompt = Tokens(41, 2), more = Tokens(23, 3);
  SequenceState a = Forward().NewSequence();
  std::vector<float> logits;
  BOOST_REQUIRE(Forward().Forward(&a, prompt, &logits).ok());
  std::string snapshot = a.Serialize();
  std::vector<float> uninterrupted = RunChunked(more, {1}, &a);

  auto restored = Forward().Restore(snapshot);
  BOOST_REQUIRE_MESSAGE(restored.ok(), restored.status().ToString());
  BOOST_TEST(restored->position == 41);
  std::vector<float> resumed = RunChunked(more, {1}, &*restored);
  BOOST_TEST(BitEqual(resumed, uninterrupted));
}

// Pool blocks holding copies of the first `count` blocks of `from` (what the prefix cache does
// with the bytes it read back).
std::vector<int32_t> CopyBlocks(const SequenceState& from, size_t count) {
  KvPool& pool = *Forward().pool();
  std::vector<int32_t> ids;
  for (size_t b = 0; b < count; ++b) {
    const int32_t id = pool.Allocate();
    BOOST_REQUIRE(id >= 0);
    std::memcpy(pool.mutable_data(id), pool.data(from.blocks[b]), pool.block_bytes());
    ids.push_back(id);
  }
  return ids;
}

BOOST_AUTO_TEST_CASE(snapshot_without_its_leading_blocks_restores_with_them) {
  const std::vector<int32_t> prompt = Tokens(150, 31), more = Tokens(20, 32);
  SequenceState a = Forward().NewSequence();
  std::vector<float> logits;
  BOOST_REQUIRE(Forward().Forward(&a, prompt, &logits).ok());
  const std::string snapshot = a.Serialize(/*first_block=*/2);  // Blocks 0 and 1 left out.
  BOOST_TEST(snapshot.size() + 2 * Forward().pool()->block_bytes() < a.Serialize().size() + 64);
  std::vector<float> uninterrupted = RunChunked(more, {1}, &a);

  BOOST_TEST(!Forward().Restore(snapshot).ok());  // Without them it is refused.
  auto restored = Forward().Restore(snapshot, CopyBlocks(a, 2));
  BOOST_REQUIRE_MESSAGE(restored.ok(), restored.status().ToString());
  BOOST_TEST(BitEqual(RunChunked(more, {1}, &*restored), uninterrupted));
}

// The cache's hit between snapshots: the blocks up to P are restored, the bounded state is
// rebuilt by running ExactReplayTokens() tokens before P again.
BOOST_AUTO_TEST_CASE(replaying_before_restored_blocks_is_exact) {
  const int64_t R = Forward().ExactReplayTokens();
  // 10 layers, window 8: every layer reaches 7 tokens back, 71 in all, rounded to 2 blocks.
  BOOST_TEST(R == 128);
  const int64_t P = 256;
  const std::vector<int32_t> tokens = Tokens(300, 41);
  SequenceState whole = Forward().NewSequence();
  std::vector<float> all = RunChunked(tokens, {300}, &whole);
  const size_t vocab = all.size() / tokens.size();
  const std::vector<float> after_p(all.begin() + P * vocab, all.end());

  auto replay_from = [&](int64_t start, std::vector<float>* logits) {
    auto s = Forward().ResumeAt(start, std::span(tokens).first(start),
                                CopyBlocks(whole, static_cast<size_t>(P / 64)));
    BOOST_REQUIRE_MESSAGE(s.ok(), s.status().ToString());
    std::vector<int32_t> rest(tokens.begin() + start, tokens.end());
    std::vector<float> got = RunChunked(rest, {37}, &*s);
    logits->assign(got.begin() + (P - start) * vocab, got.end());
    return std::move(*s);
  };
  std::vector<float> replayed;
  SequenceState resumed = replay_from(P - R, &replayed);
  BOOST_TEST(BitEqual(replayed, after_p));
  resumed.frozen_tokens = 0;
  BOOST_TEST((resumed.Serialize() == whole.Serialize()), "state after the replay");
  // The replay length matters: one block (64 < 71 tokens) or none at all is not exact.
  std::vector<float> short_replay, unreplayed;
  replay_from(P - 64, &short_replay);
  replay_from(P, &unreplayed);
  BOOST_TEST(!BitEqual(short_replay, after_p));
  BOOST_TEST(!BitEqual(unreplayed, after_p));
}

BOOST_AUTO_TEST_CASE(forks_share_blocks_until_they_diverge) {
  const KvPool& pool = *Forward().pool();
  const size_t baseline = pool.used_blocks();
  const std::vector<int32_t> prefix = Tokens(200, 21), a_more = Tokens(30, 22),
                             b_more = Tokens(30, 23);
  std::vector<float> logits;
  SequenceState a = Forward().NewSequence();
  BOOST_REQUIRE(Forward().Forward(&a, prefix, &logits).ok());
  const size_t prefix_blocks = a.blocks.size();
  BOOST_TEST(prefix_blocks == 4u);  // 200 tokens: three full 64-token blocks and a partial one.
  BOOST_TEST(pool.used_blocks() == baseline + prefix_blocks);
  {
    SequenceState b = a.Fork();
    // The fork holds the same blocks: nothing new is allocated.
    BOOST_TEST(pool.used_blocks() == baseline + prefix_blocks);
    BOOST_TEST(b.blocks == a.blocks);
    std::vector<float> la, lb;
    BOOST_REQUIRE(Forward().Forward(&a, a_more, &la).ok());
    BOOST_REQUIRE(Forward().Forward(&b, b_more, &lb).ok());
    // Both wrote into the partial block, so one of them copied it; the full blocks stay shared.
    BOOST_TEST(pool.used_blocks() == baseline + prefix_blocks + 1);
    for (size_t i = 0; i < 3; ++i) BOOST_TEST(a.blocks[i] == b.blocks[i]);
    BOOST_TEST(a.blocks[3] != b.blocks[3]);
    // And each continues exactly as a sequence that never shared anything.
    SequenceState fresh = Forward().NewSequence();
    std::vector<int32_t> all = prefix;
    all.insert(all.end(), b_more.begin(), b_more.end());
    std::vector<float> lf;
    BOOST_REQUIRE(Forward().Forward(&fresh, all, &lf).ok());
    BOOST_TEST(BitEqual(lb, lf));
  }
  // The fork's own blocks are back in the pool once it is gone.
  BOOST_TEST(pool.used_blocks() == baseline + prefix_blocks);
}

BOOST_AUTO_TEST_CASE(corrupt_snapshots_are_refused) {
  SequenceState a = Forward().NewSequence();
  std::vector<float> logits;
  BOOST_REQUIRE(Forward().Forward(&a, Tokens(9, 4), &logits).ok());
  std::string bytes = a.Serialize();
  BOOST_TEST(!Forward().Restore(bytes.substr(0, bytes.size() - 3)).ok());
  std::string bad_magic = bytes;
  bad_magic[0] = 'X';
  BOOST_TEST(!Forward().Restore(bad_magic).ok());
  std::string bad_version = bytes;
  bad_version[4] = 99;
  auto v = Forward().Restore(bad_version);
  BOOST_TEST(v.status().message().find("version 99") != std::string::npos, v.status().message());
}

// Three sequences at different positions with different chunk lengths, in one call, against
// each alone: all rows' logits, or (one pass over the head for the three) the last row's.
void BatchEqualsEachSequenceAlone(bool all_logits) {
  std::vector<std::vector<int32_t>> prefixes = {Tokens(5, 10), Tokens(30, 11), {}};
  std::vector<std::vector<int32_t>> chunks = {Tokens(12, 12), Tokens(1, 13), Tokens(20, 14)};
  std::vector<SequenceState> batched, alone;
  std::vector<std::vector<float>> want(3), got(3);
  std::vector<float> scratch;
  for (size_t i = 0; i < 3; ++i) {
    batched.push_back(Forward().NewSequence());
    alone.push_back(Forward().NewSequence());
    if (!prefixes[i].empty()) {
      BOOST_REQUIRE(Forward().Forward(&batched[i], prefixes[i], &scratch).ok());
      BOOST_REQUIRE(Forward().Forward(&alone[i], prefixes[i], &scratch).ok());
    }
  }
  ForwardOptions options;
  options.all_logits = all_logits;
  for (size_t i = 0; i < 3; ++i) {
    BOOST_REQUIRE(Forward().Forward(&alone[i], chunks[i], &want[i], options).ok());
    BOOST_REQUIRE_EQUAL(want[i].size(), (all_logits ? chunks[i].size() : 1) *
                                            static_cast<size_t>(Forward().config().vocab_size));
  }
  std::vector<BatchItem> items;
  for (size_t i = 0; i < 3; ++i) items.push_back({&batched[i], chunks[i], &got[i]});
  BOOST_REQUIRE(Forward().ForwardBatch(items, options).ok());
  for (size_t i = 0; i < 3; ++i) {
    BOOST_TEST(BitEqual(got[i], want[i]), "sequence " << i);
    BOOST_TEST((batched[i].Serialize() == alone[i].Serialize()), "state of sequence " << i);
  }
}

BOOST_AUTO_TEST_CASE(batch_equals_each_sequence_alone) { BatchEqualsEachSequenceAlone(true); }

BOOST_AUTO_TEST_CASE(batch_last_rows_equal_each_sequence_alone) {
  BatchEqualsEachSequenceAlone(false);
}

BOOST_AUTO_TEST_CASE(bounded_replay_is_exact_when_the_prompt_fits_and_off_by_default) {
  const std::vector<int32_t> tokens = Tokens(60, 5);
  SequenceState a = Forward().NewSequence(), b = Forward().NewSequence();
  std::vector<float> full, replay;
  BOOST_REQUIRE(Forward().Forward(&a, tokens, &full).ok());
  ForwardOptions options;
  options.replay_tokens = 60;  // The whole prompt: nothing is skipped.
  BOOST_REQUIRE(Forward().Forward(&b, tokens, &replay, options).ok());
  BOOST_TEST(BitEqual(full, replay));
  BOOST_TEST(ForwardOptions().replay_tokens == 0);
  options.all_logits = true;
  BOOST_TEST(!Forward().Forward(&b, tokens, &replay, options).ok());
}

BOOST_AUTO_TEST_CASE(bad_input_is_refused) {
  SequenceState st = Forward().NewSequence();
  std::vector<float> logits;
  std::vector<int32_t> out_of_vocab = {1, static_cast<int32_t>(Forward().config().vocab_size)};
  Status s = Forward().Forward(&st, out_of_vocab, &logits);
  BOOST_TEST(s.message().find("outside the vocabulary") != std::string::npos, s.message());
  BOOST_TEST(st.position == 0);
  BOOST_TEST(!Forward().Forward(&st, {}, &logits).ok());
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
