// Api: the HTTP routes flashd serves, installed identically on every listener (TCP, Unix socket).
//
// Owns the router and the metrics. The daemon owns one Api and reports its readiness through
// SetPhase(); listener threads call the routes concurrently.
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "cache/catalog.h"
#include "config/config.h"
#include "engine/engine.h"
#include "engine/tokenizer.h"
#include "tools-api/chat_format.h"
#include "tools-api/metrics.h"
#include "tools-api/router.h"
#include "tools-api/turn_queue.h"

namespace flashd::api {

namespace gen {
struct Generation;
}

// Who is on the other end of the connection being served, when the listener knows (the Unix
// socket reads SO_PEERCRED); per handling thread.
struct Peer {
  bool known = false;
  uint32_t uid = 0;
  int32_t pid = 0;
};
Peer& CurrentPeer();

// What /v1/models reports about the served model.
struct ServedModel {
  std::string id;
  std::string description;
  bool embedded_default = false;  // True for the built-in tiny model with random weights.
  int64_t created = 0;            // Unix seconds.
};

enum class Phase { kStarting, kLoading, kReady, kFailed, kStopping };

class Api {
 public:
  Api(const Config& config, ServedModel model);
  Api(const Api&) = delete;
  Api& operator=(const Api&) = delete;

  // Thread-safe. `reason` is shown by /health for every phase but kReady.
  void SetPhase(Phase phase, std::string reason);
  // Thread-safe. Progress of the loading step under way, shown by /health while not ready:
  // `done` of `total` `unit`s ("bytes", "parameters") after `seconds`, the rate and the time
  // left. Cleared by SetPhase.
  void SetProgress(const std::string& what, const std::string& unit, uint64_t done, uint64_t total,
                   double seconds);
  Phase phase() const;

  // Installs the routes, the JSON error bodies for errors httplib raises itself (413, 400, 500),
  // and per-request logging and metrics. `listener` names it in the log ("tcp", "unix").
  // REQUIRES: `server` is not listening yet; this Api outlives it.
  void Install(httplib::Server* server, const std::string& listener);

  Metrics& metrics() { return metrics_; }

  // Thread-safe: replaces the keys, groups and administrators (SIGHUP). Requests already past
  // authentication finish as they began.
  void ReloadAuth(const AuthConfig& auth);

  // Thread-safe. Until an engine is set, generation routes answer 503 and /metrics has no engine
  // gauges. REQUIRES: the engine outlives every listener this Api is installed on.
  void SetEngine(engine::Engine* engine);
  engine::Engine* engine() const;
  // The prefix cache's catalog (pins); null when the cache is off. Set before serving.
  // The catalog (null: none). Also where the tool-call ledger persists.
  void SetCatalog(cache::Catalog* catalog);
  // The engine's tokenizer, or null (no engine yet, or a model without tokenizer.json): then
  // /tokenize and /detokenize answer 503.
  const engine::Tokenizer* tokenizer() const;

 private:
  void Health(const httplib::Request& req, httplib::Response& res) const;
  void Models(const httplib::Request& req, httplib::Response& res) const;
  void Model(const httplib::Request& req, httplib::Response& res, const std::string& id) const;
  nlohmann::json ModelEntry() const;
  void Tokenize(const httplib::Request& req, httplib::Response& res) const;
  void TokenizeRequest(const httplib::Request& req, httplib::Response& res,
                       const nlohmann::json& body) const;
  void Detokenize(const httplib::Request& req, httplib::Response& res) const;
  // POST /v1/completions (OpenAI): tools-api/completions.cc.
  void Completions(const httplib::Request& req, httplib::Response& res) const;
  // POST /v1/chat/completions (OpenAI): tools-api/chat_completions.cc.
  void ChatCompletions(const httplib::Request& req, httplib::Response& res) const;
  // Serves an OpenAI chat body for `tenant`; `on_done`, when set, gets the assistant message as
  // a client would send it back, the final event, and the prefix-cache keys of the prompt, when
  // the generation ends normally. When it fails (a session turn that cannot be saved), the
  // response ends with an error instead of the completion: its status went out with the first
  // byte, so the error is in the body (whole) or an error event (streamed).
  using ChatDone =
      std::function<Status(const nlohmann::json& message, const engine::GenerationEvent& done,
                           const engine::Engine::PrefixKeys& prompt_keys)>;
  void ServeChat(const nlohmann::json& body, const ojson& ordered, const std::string& tenant,
                 std::chrono::steady_clock::time_point arrived, httplib::Response& res,
                 ChatDone on_done) const;
  // messages.cc: Anthropic's Messages API.
  void Messages(const httplib::Request& req, httplib::Response& res) const;
  void MessagesImpl(const httplib::Request& req, httplib::Response& res,
                    std::chrono::steady_clock::time_point arrived) const;
  void CountTokens(const httplib::Request& req, httplib::Response& res) const;
  // sessions.cc: flashd sessions.
  void CreateSession(const httplib::Request& req, httplib::Response& res) const;
  // The tenant's session `id`, or nullopt after answering 503 (no catalog) or 404.
  std::optional<cache::Catalog::Session> FindSessionOrAnswer(const std::string& tenant,
                                                             const std::string& id,
                                                             httplib::Response& res) const;
  void SessionTurn(const httplib::Request& req, httplib::Response& res,
                   const std::string& id) const;
  void ForkSession(const httplib::Request& req, httplib::Response& res,
                   const std::string& id) const;
  void ListSessions(const httplib::Request& req, httplib::Response& res) const;
  void GetSession(const httplib::Request& req, httplib::Response& res, const std::string& id) const;
  void DeleteSession(const httplib::Request& req, httplib::Response& res,
                     const std::string& id) const;
  // responses.cc: OpenAI's Responses API.
  void Responses(const httplib::Request& req, httplib::Response& res) const;
  // cache_routes.cc: GET /v1/cache, POST /v1/cache/pins, DELETE /v1/cache/pins/{name}.
  void CacheStats(const httplib::Request& req, httplib::Response& res) const;
  void CreatePin(const httplib::Request& req, httplib::Response& res) const;
  // POST /v1/cache/evict: an administrator drops every unpinned entry.
  void EvictCache(const httplib::Request& req, httplib::Response& res) const;
  void DeletePin(const httplib::Request& req, httplib::Response& res,
                 const std::string& name) const;
  // Prefills `tokens` for `tenant` and pins its blocks and end state under `name`.
  Status PinTokens(const std::vector<int32_t>& tokens, const std::string& tenant,
                   const std::string& name, size_t* blocks) const;
  // Submits `request` for `tenant` (its cache namespace, the groups it may read, its usage
  // counters) and waits for the engine's first word; null after answering a refusal.
  std::shared_ptr<gen::Generation> StartGeneration(engine::Engine* eng,
                                                   engine::GenerationRequest request,
                                                   const std::string& tenant, const std::string& id,
                                                   std::chrono::steady_clock::time_point arrived,
                                                   httplib::Response& res) const;
  // Adds a finished generation to its tenant's usage counters in the catalog.
  std::function<void(const engine::GenerationEvent&)> UsageRecorder(
      const std::string& tenant) const;
  // The keys, groups and administrators in force (reloadable).
  std::shared_ptr<const AuthConfig> Auth() const;
  // The tenant a request acts for: its prefix-cache namespace and the owner of its pins.
  std::string TenantOf(const httplib::Request& req) const;
  // May see daemon-wide counters: an auth.admins tenant's key, the daemon's own user on the
  // socket, or anyone on TCP when there are no keys (then TCP is one tenant).
  bool IsAdmin(const httplib::Request& req) const;
  // GET /metrics for a tenant that is not an administrator: its own usage counters.
  void TenantMetrics(const httplib::Request& req, httplib::Response& res) const;
  static std::optional<std::string> PresentedKey(const httplib::Request& req);
  // auth.groups the tenant belongs to, and their cache namespaces ("group:NAME").
  std::vector<std::string> GroupsOf(const std::string& tenant) const;
  std::vector<std::string> SharedNamespacesOf(const std::string& tenant) const;
  // The tenant whose key this is; compared in constant time, never logged.
  std::optional<std::string> TenantForKey(const std::string& presented) const;

  const Config config_;
  const ServedModel model_;
  Router router_;
  mutable Metrics metrics_;  // Thread-safe itself.
  cache::Catalog* catalog_ = nullptr;
  mutable std::mutex mu_;
  Phase phase_ = Phase::kStarting;          // Guarded by mu_.
  std::string reason_ = "starting";         // Guarded by mu_.
  nlohmann::json progress_;                 // Guarded by mu_; null when nothing to show.
  engine::Engine* engine_ = nullptr;        // Guarded by mu_.
  std::shared_ptr<const AuthConfig> auth_;  // Guarded by mu_; replaced whole on reload.
  mutable ToolCallLedger ledger_;           // Thread-safe itself.
  mutable TurnQueue turns_;                 // Thread-safe itself; one line per tenant's session.
};

}  // namespace flashd::api
