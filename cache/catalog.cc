#include "cache/catalog.h"

#include <sqlite3.h>

#include <chrono>

namespace flashd::cache {
namespace {

// Migration i takes the schema from version i to i + 1. Append only; never edit a shipped one.
const char* const kMigrations[] = {
    R"sql(
CREATE TABLE tenants (
  name TEXT PRIMARY KEY,
  created INTEGER NOT NULL
);
CREATE TABLE pins (
  tenant TEXT NOT NULL,
  name TEXT NOT NULL,
  chain BLOB NOT NULL,      -- 16-byte block keys, root first
  snapshot BLOB NOT NULL,   -- 16-byte key of the state at the end
  tokens INTEGER NOT NULL,
  created INTEGER NOT NULL,
  PRIMARY KEY (tenant, name)
);
CREATE TABLE sessions (
  id TEXT PRIMARY KEY,
  tenant TEXT NOT NULL,
  title TEXT NOT NULL DEFAULT '',
  created INTEGER NOT NULL,
  last_used INTEGER NOT NULL,
  tokens INTEGER NOT NULL DEFAULT 0,
  head_key BLOB,
  snapshot_key BLOB,
  body TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX sessions_by_tenant ON sessions (tenant, last_used);
CREATE TABLE usage (
  tenant TEXT PRIMARY KEY,
  requests INTEGER NOT NULL DEFAULT 0,
  prompt_tokens INTEGER NOT NULL DEFAULT 0,
  cached_tokens INTEGER NOT NULL DEFAULT 0,
  completion_tokens INTEGER NOT NULL DEFAULT 0
);
)sql",
    // 1 -> 2: the tool-call ledger (call id -> the DSML text the model wrote), so that exact
    // replay of sampled calls survives restarts.
    R"sql(
CREATE TABLE tool_calls (
  id TEXT PRIMARY KEY,
  invoke TEXT NOT NULL,
  created INTEGER NOT NULL
);
CREATE INDEX tool_calls_by_age ON tool_calls (created);
)sql",
};
static_assert(sizeof(kMigrations) / sizeof(kMigrations[0]) == Catalog::kSchemaVersion);

int64_t NowSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

BlockKey KeyFrom(const void* p) {
  const auto* b = static_cast<const unsigned char*>(p);
  BlockKey k;
  for (int i = 0; i < 8; ++i) {
    k.hi = (k.hi << 8) | b[i];
    k.lo = (k.lo << 8) | b[8 + i];
  }
  return k;
}

// A prepared statement that finalizes itself.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) { ok_ = sqlite3_prepare_v2(db, sql, -1, &s_, nullptr) == 0; }
  ~Stmt() { sqlite3_finalize(s_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;
  bool ok() const { return ok_; }
  sqlite3_stmt* get() { return s_; }
  void Text(int i, const std::string& v) {
    sqlite3_bind_text(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  }
  void Blob(int i, const std::string& v) {
    sqlite3_bind_blob(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  }
  void Int(int i, int64_t v) { sqlite3_bind_int64(s_, i, v); }
  int Step() { return sqlite3_step(s_); }
  std::string ColumnText(int i) {
    const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(s_, i));
    return p == nullptr ? std::string() : std::string(p, sqlite3_column_bytes(s_, i));
  }
  int64_t ColumnInt(int i) { return sqlite3_column_int64(s_, i); }

 private:
  sqlite3_stmt* s_ = nullptr;
  bool ok_ = false;
};

}  // namespace

StatusOr<std::unique_ptr<Catalog>> Catalog::Open(const std::string& path) {
  std::unique_ptr<Catalog> c(new Catalog());
  c->path_ = path;
  if (sqlite3_open_v2(path.c_str(), &c->db_,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    return IoError("catalog " + path + ": " + (c->db_ ? sqlite3_errmsg(c->db_) : "cannot open"));
  }
  sqlite3_busy_timeout(c->db_, 5000);
  // WAL with synchronous=NORMAL: a kill -9 loses nothing committed; power loss at most the last
  // transactions, never consistency.
  FLASHD_RETURN_IF_ERROR(c->Exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"));
  FLASHD_RETURN_IF_ERROR(c->Migrate());
  return c;
}

Catalog::~Catalog() {
  if (db_) sqlite3_close(db_);
}

Status Catalog::Exec(const std::string& sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
    std::string m = err ? err : "unknown error";
    sqlite3_free(err);
    return IoError("catalog " + path_ + ": " + m);
  }
  return Status::Ok();
}

int Catalog::schema_version() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt s(db_, "PRAGMA user_version");
  return s.ok() && s.Step() == SQLITE_ROW ? sqlite3_column_int(s.get(), 0) : -1;
}

Status Catalog::Migrate() {
  const int version = schema_version();
  if (version < 0) return IoError("catalog " + path_ + ": cannot read its schema version");
  if (version > kSchemaVersion) {
    return FailedPrecondition("catalog " + path_ + " has schema version " +
                              std::to_string(version) + "; this flashd knows up to " +
                              std::to_string(kSchemaVersion) + " (written by a newer flashd?)");
  }
  for (int v = version; v < kSchemaVersion; ++v) {
    // Each step and its version bump commit together.
    FLASHD_RETURN_IF_ERROR(Exec(std::string("BEGIN IMMEDIATE;") + kMigrations[v] +
                                "PRAGMA user_version=" + std::to_string(v + 1) + ";COMMIT;"));
  }
  return Status::Ok();
}

Status Catalog::PutPin(const Pin& pin) {
  std::string chain;
  for (const BlockKey& k : pin.chain) chain += k.ToBytes();
  std::lock_guard<std::mutex> lock(mu_);
  Stmt s(db_,
         "INSERT OR REPLACE INTO pins (tenant, name, chain, snapshot, tokens, created) "
         "VALUES (?, ?, ?, ?, ?, ?)");
  if (!s.ok()) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  s.Text(1, pin.tenant);
  s.Text(2, pin.name);
  s.Blob(3, chain);
  s.Blob(4, pin.snapshot.ToBytes());
  s.Int(5, pin.tokens);
  s.Int(6, pin.created ? pin.created : NowSeconds());
  if (s.Step() != SQLITE_DONE) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  return Status::Ok();
}

std::vector<Catalog::Pin> Catalog::Pins() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Pin> out;
  Stmt s(db_,
         "SELECT tenant, name, chain, snapshot, tokens, created FROM pins ORDER BY tenant, name");
  while (s.ok() && s.Step() == SQLITE_ROW) {
    Pin p;
    p.tenant = reinterpret_cast<const char*>(sqlite3_column_text(s.get(), 0));
    p.name = reinterpret_cast<const char*>(sqlite3_column_text(s.get(), 1));
    const auto* chain = static_cast<const unsigned char*>(sqlite3_column_blob(s.get(), 2));
    const int n = sqlite3_column_bytes(s.get(), 2);
    for (int i = 0; i + 16 <= n; i += 16) p.chain.push_back(KeyFrom(chain + i));
    if (sqlite3_column_bytes(s.get(), 3) == 16)
      p.snapshot = KeyFrom(sqlite3_column_blob(s.get(), 3));
    p.tokens = sqlite3_column_int64(s.get(), 4);
    p.created = sqlite3_column_int64(s.get(), 5);
    out.push_back(std::move(p));
  }
  return out;
}

std::optional<Catalog::Pin> Catalog::FindPin(const std::string& tenant,
                                             const std::string& name) const {
  for (Pin& p : Pins()) {
    if (p.tenant == tenant && p.name == name) return std::move(p);
  }
  return std::nullopt;
}

Status Catalog::DeletePin(const std::string& tenant, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt s(db_, "DELETE FROM pins WHERE tenant = ? AND name = ?");
  s.Text(1, tenant);
  s.Text(2, name);
  if (s.Step() != SQLITE_DONE) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  if (sqlite3_changes(db_) == 0) return NotFound("pin '" + name + "' does not exist");
  return Status::Ok();
}

Status Catalog::PutSession(const Session& x) {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt s(db_,
         "INSERT OR REPLACE INTO sessions (id, tenant, title, created, last_used, tokens, body, "
         "head_key, snapshot_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)");
  if (!s.ok()) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  s.Text(1, x.id);
  s.Text(2, x.tenant);
  s.Text(3, x.title);
  s.Int(4, x.created ? x.created : NowSeconds());
  s.Int(5, x.last_used ? x.last_used : NowSeconds());
  s.Int(6, x.tokens);
  s.Text(7, x.body);
  s.Blob(8, x.head_key.ToBytes());
  s.Blob(9, x.snapshot_key.ToBytes());
  if (s.Step() != SQLITE_DONE) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  return Status::Ok();
}

namespace {

Catalog::Session SessionFrom(sqlite3_stmt* st) {
  auto text = [st](int i) {
    const unsigned char* t = sqlite3_column_text(st, i);
    return t ? std::string(reinterpret_cast<const char*>(t)) : std::string();
  };
  Catalog::Session x;
  x.id = text(0);
  x.tenant = text(1);
  x.title = text(2);
  x.created = sqlite3_column_int64(st, 3);
  x.last_used = sqlite3_column_int64(st, 4);
  x.tokens = sqlite3_column_int64(st, 5);
  x.body = text(6);
  if (sqlite3_column_bytes(st, 7) == 16) x.head_key = KeyFrom(sqlite3_column_blob(st, 7));
  if (sqlite3_column_bytes(st, 8) == 16) x.snapshot_key = KeyFrom(sqlite3_column_blob(st, 8));
  return x;
}

}  // namespace

std::optional<Catalog::Session> Catalog::FindSession(const std::string& tenant,
                                                     const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt s(db_,
         "SELECT id, tenant, title, created, last_used, tokens, body, head_key, snapshot_key "
         "FROM sessions "
         "WHERE tenant = ? AND id = ?");
  s.Text(1, tenant);
  s.Text(2, id);
  if (s.ok() && s.Step() == SQLITE_ROW) return SessionFrom(s.get());
  return std::nullopt;
}

std::vector<Catalog::Session> Catalog::Sessions(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Session> out;
  Stmt s(db_,
         "SELECT id, tenant, title, created, last_used, tokens, body, head_key, snapshot_key "
         "FROM sessions "
         "WHERE tenant = ? ORDER BY last_used DESC, id");
  s.Text(1, tenant);
  while (s.ok() && s.Step() == SQLITE_ROW) out.push_back(SessionFrom(s.get()));
  return out;
}

std::vector<Catalog::SessionKeys> Catalog::AllSessionKeys() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SessionKeys> out;
  Stmt s(db_, "SELECT tenant, id, head_key, snapshot_key FROM sessions ORDER BY tenant, id");
  while (s.ok() && s.Step() == SQLITE_ROW) {
    SessionKeys k;
    k.tenant = reinterpret_cast<const char*>(sqlite3_column_text(s.get(), 0));
    k.id = reinterpret_cast<const char*>(sqlite3_column_text(s.get(), 1));
    if (sqlite3_column_bytes(s.get(), 2) == 16)
      k.head_key = KeyFrom(sqlite3_column_blob(s.get(), 2));
    if (sqlite3_column_bytes(s.get(), 3) == 16) {
      k.snapshot_key = KeyFrom(sqlite3_column_blob(s.get(), 3));
    }
    out.push_back(std::move(k));
  }
  return out;
}

Status Catalog::ClearSessionKeys(const std::string& tenant, const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt s(db_, "UPDATE sessions SET head_key = ?, snapshot_key = ? WHERE tenant = ? AND id = ?");
  const std::string root = BlockKey{}.ToBytes();
  s.Blob(1, root);
  s.Blob(2, root);
  s.Text(3, tenant);
  s.Text(4, id);
  if (s.Step() != SQLITE_DONE) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  return Status::Ok();
}

Status Catalog::DeleteSession(const std::string& tenant, const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt s(db_, "DELETE FROM sessions WHERE tenant = ? AND id = ?");
  s.Text(1, tenant);
  s.Text(2, id);
  if (s.Step() != SQLITE_DONE) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  if (sqlite3_changes(db_) == 0) return NotFound("session '" + id + "' does not exist");
  return Status::Ok();
}

Status Catalog::AddUsage(const std::string& tenant, const Usage& d) {
  std::lock_guard<std::mutex> lock(mu_);
  {
    Stmt t(db_, "INSERT OR IGNORE INTO tenants (name, created) VALUES (?, ?)");
    t.Text(1, tenant);
    t.Int(2, NowSeconds());
    if (t.Step() != SQLITE_DONE) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  }
  Stmt s(db_,
         "INSERT INTO usage (tenant, requests, prompt_tokens, cached_tokens, completion_tokens) "
         "VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT(tenant) DO UPDATE SET "
         "requests = requests + ?2, prompt_tokens = prompt_tokens + ?3, "
         "cached_tokens = cached_tokens + ?4, completion_tokens = completion_tokens + ?5");
  if (!s.ok()) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  s.Text(1, tenant);
  s.Int(2, d.requests);
  s.Int(3, d.prompt_tokens);
  s.Int(4, d.cached_tokens);
  s.Int(5, d.completion_tokens);
  if (s.Step() != SQLITE_DONE) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  return Status::Ok();
}

Status Catalog::PutToolCall(const std::string& id, const std::string& invoke) {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt s(db_, "INSERT OR REPLACE INTO tool_calls (id, invoke, created) VALUES (?, ?, ?)");
  if (!s.ok()) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  s.Text(1, id);
  s.Text(2, invoke);
  s.Int(3, NowSeconds());
  if (s.Step() != SQLITE_DONE) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  // Now and then, the oldest calls beyond the bound go.
  if (++tool_call_puts_ % kToolCallTrimEvery == 0) {
    Stmt t(db_,
           "DELETE FROM tool_calls WHERE rowid IN (SELECT rowid FROM tool_calls ORDER BY created "
           "DESC, rowid DESC LIMIT -1 OFFSET ?)");
    t.Int(1, static_cast<int64_t>(tool_call_limit_));
    if (t.Step() != SQLITE_DONE) return IoError(std::string("catalog: ") + sqlite3_errmsg(db_));
  }
  return Status::Ok();
}

std::optional<std::string> Catalog::FindToolCall(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt s(db_, "SELECT invoke FROM tool_calls WHERE id = ?");
  s.Text(1, id);
  if (s.Step() != SQLITE_ROW) return std::nullopt;
  return s.ColumnText(0);
}

int64_t Catalog::ToolCalls() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt s(db_, "SELECT COUNT(*) FROM tool_calls");
  return s.Step() == SQLITE_ROW ? s.ColumnInt(0) : 0;
}

std::vector<std::string> Catalog::Tenants() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  Stmt s(db_, "SELECT name FROM tenants ORDER BY name");
  while (s.ok() && s.Step() == SQLITE_ROW) {
    out.push_back(reinterpret_cast<const char*>(sqlite3_column_text(s.get(), 0)));
  }
  return out;
}

Catalog::Usage Catalog::UsageOf(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  Usage u;
  Stmt s(db_,
         "SELECT requests, prompt_tokens, cached_tokens, completion_tokens FROM usage "
         "WHERE tenant = ?");
  s.Text(1, tenant);
  if (s.ok() && s.Step() == SQLITE_ROW) {
    u.requests = sqlite3_column_int64(s.get(), 0);
    u.prompt_tokens = sqlite3_column_int64(s.get(), 1);
    u.cached_tokens = sqlite3_column_int64(s.get(), 2);
    u.completion_tokens = sqlite3_column_int64(s.get(), 3);
  }
  return u;
}

}  // namespace flashd::cache
