#include "tools-api/turn_queue.h"

namespace flashd::api {

std::shared_ptr<void> TurnQueue::Enter(const std::string& key) {
  std::unique_lock<std::mutex> lock(mu_);
  Line& line = lines_[key];  // Map nodes stay put while other keys come and go.
  const uint64_t ticket = line.next_ticket++;
  cv_.wait(lock, [&] { return line.serving == ticket; });
  return std::shared_ptr<void>(nullptr, [this, key](void*) {
    std::lock_guard<std::mutex> guard(mu_);
    auto it = lines_.find(key);
    if (++it->second.serving == it->second.next_ticket) lines_.erase(it);
    cv_.notify_all();
  });
}

uint64_t TurnQueue::Pending(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = lines_.find(key);
  return it == lines_.end() ? 0 : it->second.next_ticket - it->second.serving;
}

}  // namespace flashd::api
