// Catalog: the prefix cache's named things, in SQLite (`catalog.db` in the state directory).
//
// Tables: tenants, pins (named prefixes never evicted while pinned: tool sets, system prompts,
// repository digests), sessions (a conversation's head: token count and the keys its state is
// stored under), usage counters per tenant, and the tool-call ledger (call id -> DSML text). The
// schema is versioned with PRAGMA user_version and migrated forward on open; a catalog written by a
// newer flashd is refused, not guessed at. Rows only ever point at entries the block store has
// already written.
//
// Thread-safety: every method may be called from any thread (one connection, serialised).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cache/block_key.h"
#include "config/status.h"

struct sqlite3;

namespace flashd::cache {

class Catalog {
 public:
  static constexpr int kSchemaVersion = 2;

  static StatusOr<std::unique_ptr<Catalog>> Open(const std::string& path);
  ~Catalog();

  int schema_version() const;

  struct Pin {
    std::string tenant;
    std::string name;
    std::vector<BlockKey> chain;  // Every block of the pinned prefix, root first.
    BlockKey snapshot;            // The state at its end (root when none).
    int64_t tokens = 0;
    int64_t created = 0;  // Unix seconds.
  };
  Status PutPin(const Pin& pin);  // Replaces a pin of the same tenant and name.
  std::vector<Pin> Pins() const;
  std::optional<Pin> FindPin(const std::string& tenant, const std::string& name) const;
  Status DeletePin(const std::string& tenant, const std::string& name);

  // A conversation kept by the daemon; `body` is the route layer's JSON (messages, tools,
  // settings, turn boundaries), stored as given.
  struct Session {
    std::string id;
    std::string tenant;
    std::string title;
    int64_t created = 0;  // Unix seconds.
    int64_t last_used = 0;
    int64_t tokens = 0;  // Of its last turn: prompt plus output.
    std::string body;
    // Where the prefix cache holds its last turn's prompt: the last full block and the state at
    // the prompt's end (root keys: nothing stored). Written only after the entries are.
    BlockKey head_key;
    BlockKey snapshot_key;
  };
  Status PutSession(const Session& s);  // Insert or replace.
  std::optional<Session> FindSession(const std::string& tenant, const std::string& id) const;
  std::vector<Session> Sessions(const std::string& tenant) const;  // Most recently used first.
  // Every session's cache keys (no conversations), for start-up reconciliation.
  struct SessionKeys {
    std::string tenant, id;
    BlockKey head_key, snapshot_key;
  };
  std::vector<SessionKeys> AllSessionKeys() const;
  Status ClearSessionKeys(const std::string& tenant, const std::string& id);
  Status DeleteSession(const std::string& tenant, const std::string& id);

  struct Usage {
    int64_t requests = 0;
    int64_t prompt_tokens = 0;
    int64_t cached_tokens = 0;
    int64_t completion_tokens = 0;
  };
  // Adds to the tenant's counters (and records the tenant when it is new).
  Status AddUsage(const std::string& tenant, const Usage& delta);
  std::vector<std::string> Tenants() const;
  Usage UsageOf(const std::string& tenant) const;

  // The tool-call ledger: the DSML text the model wrote for a call id. The newest `limit` calls
  // are kept (the oldest beyond it go, checked every kToolCallTrimEvery writes).
  static constexpr int64_t kToolCallTrimEvery = 1024;
  Status PutToolCall(const std::string& id, const std::string& invoke);
  std::optional<std::string> FindToolCall(const std::string& id) const;
  int64_t ToolCalls() const;
  void set_tool_call_limit(int64_t limit) { tool_call_limit_ = limit; }

 private:
  Catalog() = default;
  Status Exec(const std::string& sql);
  Status Migrate();

  mutable std::mutex mu_;
  int64_t tool_call_puts_ = 0;  // Guarded by mu_.
  int64_t tool_call_limit_ = 1000000;
  sqlite3* db_ = nullptr;
  std::string path_;
};

}  // namespace flashd::cache
