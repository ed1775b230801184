// The scheduler's policies: admission in arrival order within memory and slots, decodes before
// prefill, prompt chunks within the budget, tenants in turn.
#include "engine/scheduler.h"

#include <boost/test/unit_test.hpp>
#include <map>
#include <string>

namespace flashd::engine {
namespace {

using Candidate = Scheduler::Candidate;

BOOST_AUTO_TEST_SUITE(scheduler)

BOOST_AUTO_TEST_CASE(admission_is_first_come_first_served_without_overtaking) {
  Scheduler s({.step_token_budget = 100,
               .prefill_chunk = 10,
               .max_running = 4,
               .memory_budget_bytes = 1000});
  const uint64_t needs[] = {300, 500, 100, 50};
  BOOST_TEST(s.Admit(needs, 0, 0) == 4u);    // 950 of 1000 bytes, 4 of 4 slots.
  BOOST_TEST(s.Admit(needs, 300, 0) == 1u);  // 300 + 300 fits, then 500 does not: 100 waits too.
  BOOST_TEST(s.Admit(needs, 0, 3) == 1u);    // One free slot.
  BOOST_TEST(s.Admit(needs, 0, 4) == 0u);
  const uint64_t big[] = {2000, 1};
  BOOST_TEST(s.Admit(big, 0, 0) == 0u);  // Larger than the budget: never admitted here.
}

BOOST_AUTO_TEST_CASE(decodes_first_then_chunks_within_the_budget) {
  Scheduler s(
      {.step_token_budget = 25, .prefill_chunk = 10, .max_running = 64, .memory_budget_bytes = 1});
  const std::vector<Candidate> running = {{"a", 30}, {"a", 0}, {"b", 4}, {"a", 0}, {"b", 100}};
  const std::vector<Scheduler::Pick> picks = s.Batch(running);
  BOOST_REQUIRE(picks.size() >= 2u);
  BOOST_TEST(picks[0].index == 1u);  // Decodes first, in order, one token each.
  BOOST_TEST(picks[0].tokens == 1u);
  BOOST_TEST(picks[1].index == 3u);
  size_t total = 0;
  for (const auto& p : picks) {
    total += p.tokens;
    BOOST_TEST(p.tokens <= 10u);
    BOOST_TEST(p.tokens <= (running[p.index].prompt_left == 0 ? 1 : running[p.index].prompt_left));
  }
  BOOST_TEST(total <= 25u);
  BOOST_TEST(total == 25u);  // 2 decodes + 10 + 4 + 9: the budget is used up.
}

BOOST_AUTO_TEST_CASE(tenants_take_turns_and_the_first_turn_rotates) {
  Scheduler s(
      {.step_token_budget = 20, .prefill_chunk = 10, .max_running = 64, .memory_budget_bytes = 1});
  // Tenant a has three long prompts, b one: b is not starved behind a's queue.
  const std::vector<Candidate> running = {{"a", 50}, {"a", 50}, {"a", 50}, {"b", 50}};
  std::map<std::string, int> first;
  for (int step = 0; step < 4; ++step) {
    const auto picks = s.Batch(running);
    BOOST_REQUIRE(picks.size() == 2u);  // Two chunks of 10 fill the budget.
    BOOST_TEST(running[picks[0].index].tenant != running[picks[1].index].tenant);
    first[std::string(running[picks[0].index].tenant)] += 1;
  }
  BOOST_TEST(first["a"] == 2);  // The turn alternates from step to step.
  BOOST_TEST(first["b"] == 2);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
