// TurnQueue: turns on one session run one at a time, in the order they arrived.
//
// A turn renders the session's conversation and appends its reply when the generation ends, so
// two turns running at once would both render the same history and the second to finish would
// overwrite the first's reply. Each turn takes a ticket for its session; it proceeds when every
// earlier ticket's lease is gone, and then reads the conversation the earlier turns left.
// Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace flashd::api {

class TurnQueue {
 public:
  // Blocks until the turns on `key` that entered earlier have released their leases. The next
  // turn may enter once the returned lease is destroyed.
  std::shared_ptr<void> Enter(const std::string& key);

  // Turns entered on `key` and not yet released (running or waiting), for tests and logs.
  uint64_t Pending(const std::string& key) const;

 private:
  struct Line {
    uint64_t next_ticket = 0;
    uint64_t serving = 0;
  };
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Line> lines_;  // Guarded by mu_; a key is erased when its line is empty.
};

}  // namespace flashd::api
