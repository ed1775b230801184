#include "engine/scheduler.h"

#include <algorithm>
#include <deque>
#include <map>
#include <string>

namespace flashd::engine {

size_t Scheduler::Admit(std::span<const uint64_t> needs, uint64_t reserved, size_t running) const {
  size_t admitted = 0;
  for (uint64_t need : needs) {
    if (reserved + need > options_.memory_budget_bytes ||
        static_cast<int64_t>(running + admitted) >= options_.max_running) {
      break;
    }
    reserved += need;
    ++admitted;
  }
  return admitted;
}

std::vector<Scheduler::Pick> Scheduler::Batch(std::span<const Candidate> running) {
  std::vector<Pick> picks;
  int64_t budget = options_.step_token_budget;
  for (size_t i = 0; i < running.size() && budget > 0; ++i) {
    if (running[i].prompt_left > 0) continue;
    picks.push_back({i, 1});
    --budget;
  }
  // Round-robin over tenants: each tenant's oldest prefilling sequence in turn.
  std::map<std::string_view, std::deque<size_t>> by_tenant;
  for (size_t i = 0; i < running.size(); ++i) {
    if (running[i].prompt_left > 0) by_tenant[running[i].tenant].push_back(i);
  }
  std::vector<std::string_view> tenants;
  for (auto& [t, q] : by_tenant) tenants.push_back(t);
  size_t turn = tenants.empty() ? 0 : tenant_turn_ % tenants.size();
  tenant_turn_ += 1;
  while (budget > 0 && !by_tenant.empty()) {
    const std::string_view tenant = tenants[turn % tenants.size()];
    ++turn;
    auto found = by_tenant.find(tenant);
    if (found == by_tenant.end()) continue;
    const size_t i = found->second.front();
    found->second.pop_front();
    if (found->second.empty()) by_tenant.erase(found);
    const size_t n =
        std::min<size_t>({running[i].prompt_left, static_cast<size_t>(options_.prefill_chunk),
                          static_cast<size_t>(budget)});
    picks.push_back({i, n});
    budget -= static_cast<int64_t>(n);
  }
  return picks;
}

}  // namespace flashd::engine
