#include "tools-api/api.h"

#include <spdlog/spdlog.h>
#include <strings.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "tools-api/browser_guard.h"
#include "tools-api/chat_common.h"
#include "tools-api/generation.h"

namespace flashd::api {
namespace {

const char* PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kStarting:
      return "starting";
    case Phase::kLoading:
      return "loading";
    case Phase::kReady:
      return "ok";
    case Phase::kFailed:
      return "error";
    case Phase::kStopping:
      return "stopping";
  }
  return "unknown";
}

// Per-thread request bookkeeping. httplib runs pre-routing, the handler, the response write and
// the logger of one request on the same worker thread, so a thread-local carries the start time.
struct RequestClock {
  bool active = false;
  std::chrono::steady_clock::time_point start;
};
thread_local RequestClock request_clock;

// Where the model runs, for /health and /v1/models.
nlohmann::json BackendJson(const engine::BackendReport& r) {
  return {{"name", r.backend},
          {"device", r.device},
          {"memory_in_use_bytes", r.memory_in_use},
          {"memory_total_bytes", r.memory_total},
          {"gemms", r.gemms},
          {"early_launch", r.early_launch},
          {"kv_device_bytes", r.kv_device_bytes},
          {"kv_blocks_copied", r.kv_blocks_copied},
          {"ring_device_bytes", r.ring_device_bytes},
          {"ring_slots_copied", r.ring_slots_copied},
          {"ring_uploads", r.ring_uploads},
          {"table_entries_copied", r.table_entries_copied},
          {"kv_versions_compared", r.kv_versions_compared},
          {"bytes_to_device", r.bytes_to_device},
          {"bytes_to_host", r.bytes_to_host},
          {"copies_to_host", r.downloads},
          {"bytes_zeroed_on_device", r.bytes_zeroed},
          {"host_waits", r.waits},
          {"device_ops", r.device_ops},
          {"kernel_launches", r.kernel_launches}};
}

}  // namespace

Api::Api(const Config& config, ServedModel model)
    : config_(config), model_(std::move(model)), auth_(std::make_shared<AuthConfig>(config.auth)) {
  router_.Add("GET", "/health",
              [this](const auto& req, auto& res, const PathParams&) { Health(req, res); });
  router_.Add("GET", "/v1/models",
              [this](const auto& req, auto& res, const PathParams&) { Models(req, res); });
  router_.Add("GET", "/v1/models/{id}", [this](const auto& req, auto& res, const PathParams& p) {
    Model(req, res, p.at("id"));
  });
  router_.Add("GET", "/metrics", [this](const auto& req, auto& res, const PathParams&) {
    if (!IsAdmin(req)) return TenantMetrics(req, res);
    std::string text = metrics_.Render();
    if (const engine::Engine* eng = engine()) {
      const engine::Engine::Stats e = eng->stats();
      auto gauge = [&](const char* name, const char* help, const char* type, auto v) {
        text += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type +
                "\n" + name + " " + std::to_string(v) + "\n";
      };
      gauge("flashd_engine_running", "Sequences generating now.", "gauge", e.running);
      gauge("flashd_engine_waiting", "Requests waiting for memory or a slot.", "gauge", e.waiting);
      gauge("flashd_engine_memory_reserved_bytes", "KV and state reserved by admitted sequences.",
            "gauge", e.memory_reserved_bytes);
      gauge("flashd_engine_memory_budget_bytes", "engine.memory_budget_bytes.", "gauge",
            e.memory_budget_bytes);
      gauge("flashd_engine_kv_pool_used_bytes", "KV pool blocks in use, shared ones once.", "gauge",
            e.pool_used_bytes);
      gauge("flashd_engine_kv_pool_capacity_bytes", "KV pool capacity.", "gauge",
            e.pool_capacity_bytes);
      gauge("flashd_engine_steps_total", "Forward steps run.", "counter", e.steps);
      gauge("flashd_engine_generated_tokens_total", "Tokens generated.", "counter",
            e.tokens_generated);
      gauge("flashd_engine_prompt_tokens_total", "Prompt tokens prefilled.", "counter",
            e.prompt_tokens_processed);
      gauge("flashd_speculative_enabled", "1 when DSpark drafts (engine.speculative).", "gauge",
            eng->speculative() ? 1 : 0);
      gauge("flashd_speculative_steps_total", "Decode steps that verified drafted tokens.",
            "counter", e.spec_steps);
      gauge("flashd_speculative_drafted_tokens_total", "Drafted tokens verified.", "counter",
            e.spec_drafted);
      gauge("flashd_speculative_accepted_tokens_total", "Drafted tokens accepted.", "counter",
            e.spec_accepted);
      gauge("flashd_speculative_mean_accepted_length",
            "Accepted drafts per verifying step, plus the token every step makes.", "gauge",
            e.spec_steps > 0 ? 1.0 + double(e.spec_accepted) / double(e.spec_steps) : 0.0);
      gauge("flashd_speculative_draft_seconds_total", "Time drafting.", "counter",
            e.spec_draft_seconds);
      gauge("flashd_speculative_verify_seconds_total",
            "Time in forward steps that verified drafts.", "counter", e.spec_verify_seconds);
      if (const engine::EngramStore* engram = eng->engram_store()) {
        const engine::EngramStore::Stats g = engram->stats();
        gauge("flashd_engram_rows_total", "Engram rows gathered from the SSD tier.", "counter",
              g.rows);
        gauge("flashd_engram_row_hits_total", "Of them, served by the cache of hot rows.",
              "counter", g.hits);
        gauge("flashd_engram_reads_total", "Disk reads (4 KiB blocks) for missed rows.", "counter",
              g.reads);
        gauge("flashd_engram_read_seconds_total",
              "Time those reads took (gathered ahead, beside the layers before).", "counter",
              g.read_seconds);
        gauge("flashd_engram_wait_seconds_total",
              "Time forward steps waited for an Engram layer's rows.", "counter", g.wait_seconds);
      }
      if (const cache::BlockStore* store = eng->cache()) {
        const cache::BlockStore::Stats c = store->stats();
        gauge("flashd_prefix_cache_lookups_total", "Prompts looked up in the prefix cache.",
              "counter", e.cache_lookups);
        gauge("flashd_prefix_cache_hit_tokens_total", "Prompt tokens restored, not computed.",
              "counter", e.cache_hit_tokens);
        gauge("flashd_prefix_cache_miss_tokens_total", "Prompt tokens computed (replays included).",
              "counter", e.cache_miss_tokens);
        gauge("flashd_prefix_cache_snapshot_hits_total", "Restores from a state snapshot.",
              "counter", e.cache_snapshot_hits);
        gauge("flashd_prefix_cache_replay_hits_total", "Restores from blocks plus a replay.",
              "counter", e.cache_replay_hits);
        gauge("flashd_prefix_cache_replayed_tokens_total", "Tokens run again by replays.",
              "counter", e.cache_replayed_tokens);
        gauge("flashd_prefix_cache_restore_seconds_total",
              "Time finding, reading and checking restored entries.", "counter",
              e.cache_restore_seconds);
        gauge("flashd_prefix_cache_blocks", "Blocks stored on disk.", "gauge", c.blocks);
        gauge("flashd_prefix_cache_snapshots", "State snapshots stored on disk.", "gauge",
              c.snapshots);
        gauge("flashd_prefix_cache_disk_bytes", "Bytes of stored entries.", "gauge", c.disk_bytes);
        gauge("flashd_prefix_cache_ram_bytes", "Bytes in the RAM tier.", "gauge", c.ram_bytes);
        gauge("flashd_prefix_cache_pinned_entries", "Entries kept by pins.", "gauge", c.pinned);
        gauge("flashd_prefix_cache_queued_entries",
              "Entries waiting to be written (lookups find them already).", "gauge", c.queued);
        gauge("flashd_prefix_cache_written_bytes_total", "Bytes written.", "counter",
              c.bytes_written);
        gauge("flashd_prefix_cache_read_disk_bytes_total", "Bytes read from disk.", "counter",
              c.bytes_read_disk);
        gauge("flashd_prefix_cache_read_ram_bytes_total", "Bytes read from the RAM tier.",
              "counter", c.bytes_read_ram);
        gauge("flashd_prefix_cache_evictions_total", "Entries evicted for the disk quota.",
              "counter", c.evictions);
        gauge("flashd_prefix_cache_expirations_total", "Entries expired by cache.ttl_seconds.",
              "counter", c.expirations);
        gauge("flashd_prefix_cache_corruptions_total",
              "Entries that failed their check (deleted, never used).", "counter", c.corruptions);
        gauge("flashd_prefix_cache_write_failures_total", "Writes that failed.", "counter",
              c.write_failures);
        gauge("flashd_prefix_cache_degraded", "1 when writes have stopped (disk full or failing).",
              "gauge", c.degraded ? 1 : 0);
      }
    }
    res.set_content(text, "text/plain; version=0.0.4");
  });
  router_.Add("POST", "/tokenize",
              [this](const auto& req, auto& res, const PathParams&) { Tokenize(req, res); });
  router_.Add("POST", "/detokenize",
              [this](const auto& req, auto& res, const PathParams&) { Detokenize(req, res); });
  router_.Add("POST", "/v1/completions",
              [this](const auto& req, auto& res, const PathParams&) { Completions(req, res); });
  router_.Add("POST", "/v1/chat/completions",
              [this](const auto& req, auto& res, const PathParams&) { ChatCompletions(req, res); });
  router_.Add("POST", "/v1/messages",
              [this](const auto& req, auto& res, const PathParams&) { Messages(req, res); });
  router_.Add("POST", "/v1/messages/count_tokens",
              [this](const auto& req, auto& res, const PathParams&) { CountTokens(req, res); });
  router_.Add("POST", "/v1/responses",
              [this](const auto& req, auto& res, const PathParams&) { Responses(req, res); });
  router_.Add("POST", "/v1/sessions",
              [this](const auto& req, auto& res, const PathParams&) { CreateSession(req, res); });
  router_.Add("GET", "/v1/sessions",
              [this](const auto& req, auto& res, const PathParams&) { ListSessions(req, res); });
  router_.Add("GET", "/v1/sessions/{id}", [this](const auto& req, auto& res, const PathParams& p) {
    GetSession(req, res, p.at("id"));
  });
  router_.Add("DELETE", "/v1/sessions/{id}",
              [this](const auto& req, auto& res, const PathParams& p) {
                DeleteSession(req, res, p.at("id"));
              });
  router_.Add("POST", "/v1/sessions/{id}/turns",
              [this](const auto& req, auto& res, const PathParams& p) {
                SessionTurn(req, res, p.at("id"));
              });
  router_.Add("POST", "/v1/sessions/{id}/fork",
              [this](const auto& req, auto& res, const PathParams& p) {
                ForkSession(req, res, p.at("id"));
              });
  router_.Add("GET", "/v1/cache",
              [this](const auto& req, auto& res, const PathParams&) { CacheStats(req, res); });
  router_.Add("POST", "/v1/cache/pins",
              [this](const auto& req, auto& res, const PathParams&) { CreatePin(req, res); });
  router_.Add("POST", "/v1/cache/evict",
              [this](const auto& req, auto& res, const PathParams&) { EvictCache(req, res); });
  router_.Add("DELETE", "/v1/cache/pins/{name}",
              [this](const auto& req, auto& res, const PathParams& p) {
                DeletePin(req, res, p.at("name"));
              });
}

void Api::SetPhase(Phase phase, std::string reason) {
  std::lock_guard<std::mutex> lock(mu_);
  phase_ = phase;
  reason_ = std::move(reason);
  progress_ = nullptr;
}

void Api::SetProgress(const std::string& what, const std::string& unit, uint64_t done,
                      uint64_t total, double seconds) {
  const double rate = seconds > 0 ? done / seconds : 0;
  nlohmann::json p = {{"what", what},
                      {"unit", unit},
                      {"done", done},
                      {"total", total},
                      {"per_second", static_cast<uint64_t>(rate)}};
  if (rate > 0 && total >= done) p["eta_seconds"] = (total - done) / rate;
  std::lock_guard<std::mutex> lock(mu_);
  progress_ = std::move(p);
}

Phase Api::phase() const {
  std::lock_guard<std::mutex> lock(mu_);
  return phase_;
}

void Api::Health(const httplib::Request&, httplib::Response& res) const {
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json body = {{"status", PhaseName(phase_)}};
  if (phase_ != Phase::kReady) {
    body["reason"] = reason_;
    if (!progress_.is_null()) body["progress"] = progress_;
    res.status = 503;
  } else if (engine_ != nullptr) {
    // The prefix cache failing degrades the service but does not stop it: still 200.
    const cache::BlockStore* store = engine_->cache();
    if (store == nullptr) {
      body["status"] = "degraded";
      body["reason"] = "the prefix cache could not be opened (see the log): prompts are prefilled";
      body["cache"] = {{"status", "off"}};
    } else if (const auto c = store->stats(); c.degraded) {
      body["status"] = "degraded";
      body["reason"] = "prefix cache writes stopped: " + c.degraded_reason;
      body["cache"] = {{"status", "degraded"}};
    } else if (catalog_ == nullptr) {
      body["status"] = "degraded";
      body["reason"] =
          "the catalog could not be opened (see the log): sessions and pins are unavailable";
      body["cache"] = {{"status", "ok"}, {"blocks", c.blocks}, {"disk_bytes", c.disk_bytes}};
    } else {
      body["cache"] = {{"status", "ok"}, {"blocks", c.blocks}, {"disk_bytes", c.disk_bytes}};
    }
    body["backend"] = BackendJson(engine_->backend());
    body["backend"]["placement"] = engine_->placement();
    // engine.speculative as in effect: dspark needs the checkpoint's heads.
    body["speculative"] = engine_->speculative() ? "dspark" : "off";
  }
  res.set_content(body.dump(), "application/json");
}

nlohmann::json Api::ModelEntry() const {
  nlohmann::json entry = {{"id", model_.id},
                          {"object", "model"},
                          {"created", model_.created},
                          {"owned_by", "flashd"},
                          {"description", model_.description},
                          {"embedded_default", model_.embedded_default}};
  if (const engine::Engine* eng = engine()) entry["backend"] = BackendJson(eng->backend());
  return entry;
}

void Api::Models(const httplib::Request&, httplib::Response& res) const {
  nlohmann::json body = {{"object", "list"}, {"data", nlohmann::json::array({ModelEntry()})}};
  res.set_content(body.dump(), "application/json");
}

void Api::Model(const httplib::Request&, httplib::Response& res, const std::string& id) const {
  if (id != model_.id) {
    return WriteError(res, 404, "not_found_error",
                      "model '" + id + "' does not exist (this daemon serves '" + model_.id + "')");
  }
  res.set_content(ModelEntry().dump(), "application/json");
}

std::optional<std::string> Api::PresentedKey(const httplib::Request& req) {
  // The scheme name is case-insensitive (RFC 9110); some clients send "bearer".
  const std::string auth = req.get_header_value("Authorization");
  if (auth.size() > 7 && strncasecmp(auth.c_str(), "Bearer ", 7) == 0) {
    return auth.substr(auth.find_first_not_of(' ', 7));
  }
  if (req.has_header("x-api-key")) return req.get_header_value("x-api-key");
  return std::nullopt;
}

std::optional<std::string> Api::TenantForKey(const std::string& presented) const {
  // Every configured key is compared, each in time that depends only on the lengths, so the
  // time taken says nothing about how much of a key was right or which tenant's it was.
  const std::string* found = nullptr;
  const std::shared_ptr<const AuthConfig> auth = Auth();
  for (const auto& [tenant, key] : auth->keys) {
    unsigned diff = presented.size() == key.size() ? 0u : 1u;
    const size_t n = std::max(presented.size(), key.size());
    for (size_t i = 0; i < n; ++i) {
      const unsigned char a = i < presented.size() ? presented[i] : 0;
      const unsigned char b = i < key.size() ? key[i] : 0;
      diff |= static_cast<unsigned>(a ^ b);
    }
    if (diff == 0) found = &tenant;
  }
  if (found == nullptr) return std::nullopt;
  return *found;
}

std::shared_ptr<gen::Generation> Api::StartGeneration(engine::Engine* eng,
                                                      engine::GenerationRequest request,
                                                      const std::string& tenant,
                                                      const std::string& id,
                                                      std::chrono::steady_clock::time_point arrived,
                                                      httplib::Response& res) const {
  request.tenant = tenant;
  request.shared_namespaces = SharedNamespacesOf(tenant);
  return gen::Start(eng, std::move(request), id, &metrics_, arrived, res, UsageRecorder(tenant));
}

std::function<void(const engine::GenerationEvent&)> Api::UsageRecorder(
    const std::string& tenant) const {
  cache::Catalog* catalog = catalog_;
  if (catalog == nullptr) return nullptr;
  return [catalog, tenant](const engine::GenerationEvent& done) {
    if (done.finish_reason == "error") return;
    Status s = catalog->AddUsage(
        tenant, {1, done.prompt_tokens, done.cached_tokens, done.completion_tokens});
    if (!s.ok()) spdlog::warn("usage of tenant {} not recorded: {}", tenant, s.message());
  };
}

std::vector<std::string> Api::GroupsOf(const std::string& tenant) const {
  std::vector<std::string> out;
  const std::shared_ptr<const AuthConfig> auth = Auth();
  for (const auto& [group, members] : auth->groups) {
    if (std::find(members.begin(), members.end(), tenant) != members.end()) out.push_back(group);
  }
  return out;
}

std::vector<std::string> Api::SharedNamespacesOf(const std::string& tenant) const {
  std::vector<std::string> out;
  for (const std::string& g : GroupsOf(tenant)) out.push_back("group:" + g);
  return out;
}

Peer& CurrentPeer() {
  thread_local Peer peer;
  return peer;
}

bool Api::IsAdmin(const httplib::Request& req) const {
  const std::shared_ptr<const AuthConfig> auth = Auth();
  if (std::optional<std::string> key = PresentedKey(req); key && !auth->keys.empty()) {
    const std::optional<std::string> tenant = TenantForKey(*key);
    return tenant &&
           std::find(auth->admins.begin(), auth->admins.end(), *tenant) != auth->admins.end();
  }
  // On the socket: the daemon's own user.
  if (const Peer& peer = CurrentPeer(); peer.known) return peer.uid == ::geteuid();
  // Over TCP without keys every client is the one tenant "default", which may see it all.
  return auth->keys.empty();
}

void Api::TenantMetrics(const httplib::Request& req, httplib::Response& res) const {
  // A tenant sees its own usage; daemon-wide counters would show the others' traffic.
  const std::string tenant = TenantOf(req);
  std::string text;
  if (catalog_ != nullptr) {
    const cache::Catalog::Usage u = catalog_->UsageOf(tenant);
    const auto counter = [&](const char* name, const char* help, int64_t v) {
      text += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " counter\n" +
              name + "{tenant=\"" + tenant + "\"} " + std::to_string(v) + "\n";
    };
    counter("flashd_tenant_requests_total", "Generations of this tenant.", u.requests);
    counter("flashd_tenant_prompt_tokens_total", "Prompt tokens of this tenant.", u.prompt_tokens);
    counter("flashd_tenant_cached_tokens_total", "Prompt tokens restored from the cache.",
            u.cached_tokens);
    counter("flashd_tenant_completion_tokens_total", "Tokens generated for this tenant.",
            u.completion_tokens);
  }
  res.set_content(text, "text/plain; version=0.0.4");
}

std::string Api::TenantOf(const httplib::Request& req) const {
  const std::shared_ptr<const AuthConfig> auth = Auth();
  if (!auth->keys.empty()) {
    if (std::optional<std::string> key = PresentedKey(req)) {
      if (std::optional<std::string> tenant = TenantForKey(*key)) return *tenant;
    }
  }
  // On the socket, without a key: the connecting user.
  if (const Peer& peer = CurrentPeer(); peer.known) return "uid-" + std::to_string(peer.uid);
  return auth->keys.empty() ? "default" : "local";
}

std::shared_ptr<const AuthConfig> Api::Auth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return auth_;
}

void Api::ReloadAuth(const AuthConfig& auth) {
  auto fresh = std::make_shared<const AuthConfig>(auth);
  std::lock_guard<std::mutex> lock(mu_);
  auth_ = std::move(fresh);
}

void Api::SetEngine(engine::Engine* engine) {
  std::lock_guard<std::mutex> lock(mu_);
  engine_ = engine;
}

void Api::SetCatalog(cache::Catalog* catalog) {
  catalog_ = catalog;
  if (catalog == nullptr) return;
  ledger_.Attach(
      [catalog](const std::string& id, const std::string& text) {
        if (Status s = catalog->PutToolCall(id, text); !s.ok()) {
          spdlog::warn("tool call {} not recorded for exact replay: {}", id, s.message());
        }
      },
      [catalog](const std::string& id) { return catalog->FindToolCall(id); });
}

engine::Engine* Api::engine() const {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_;
}

const engine::Tokenizer* Api::tokenizer() const {
  const engine::Engine* eng = engine();
  return eng != nullptr ? eng->tokenizer() : nullptr;
}

void Api::Tokenize(const httplib::Request& req, httplib::Response& res) const {
  auto tok = tokenizer();
  if (!tok) return WriteError(res, 503, "unavailable_error", "no tokenizer is loaded yet");
  nlohmann::json body;
  if (!ParseJsonBody(req, res, &body)) return;
  if (body.contains("request")) return TokenizeRequest(req, res, body);
  if (!body.contains("text") || !body["text"].is_string()) {
    return WriteError(res, 400, "invalid_request_error",
                      "text: expected a string (or \"request\" with \"api\")");
  }
  bool special = true;
  if (body.contains("special")) {
    if (!body["special"].is_boolean()) {
      return WriteError(res, 400, "invalid_request_error", "special: expected true or false");
    }
    special = body["special"].get<bool>();
  }
  // Tokenizing costs CPU in proportion to the text: /tokenize takes at most what the model could
  // ever read (its longest context is about 4 MB of text), with room to spare.
  constexpr size_t kMaxTokenizeBytes = 16u << 20;
  if (body["text"].get_ref<const std::string&>().size() > kMaxTokenizeBytes) {
    return WriteError(res, 413, "request_too_large_error",
                      "text: " + std::to_string(body["text"].get_ref<const std::string&>().size()) +
                          " bytes; /tokenize takes at most " + std::to_string(kMaxTokenizeBytes));
  }
  std::vector<int32_t> ids = tok->Encode(body["text"].get<std::string>(), special);
  nlohmann::json out = {{"tokens", ids}, {"count", ids.size()}, {"model", model_.id}};
  res.set_content(out.dump(), "application/json");
}

// The prompt a request body of another route renders to, token for token: the same translation,
// volatile-line handling and tool-call ledger as the route itself. What a client (or a benchmark's
// oracle) needs to see which prefix of its prompts can be shared.
void Api::TokenizeRequest(const httplib::Request& req, httplib::Response& res,
                          const nlohmann::json& body) const {
  if (!body["request"].is_object()) {
    return WriteError(res, 400, "invalid_request_error",
                      "request: expected the JSON body of a generation request");
  }
  const std::string api = body.contains("api") && body["api"].is_string() ? body["api"] : "";
  chat::Translate translate;
  if (api == "chat.completions") {
    translate = [](const ojson& in, ojson* out) {
      *out = in;
      return std::optional<gen::FieldError>();
    };
  } else if (api == "messages") {
    translate = [](const ojson& in, ojson* out) { return chat::AnthropicToChat(in, false, out); };
  } else if (api == "responses") {
    translate = chat::ResponsesToChat;
  } else {
    return WriteError(res, 400, "invalid_request_error",
                      "api: expected \"chat.completions\", \"messages\" or \"responses\"");
  }
  httplib::Request inner = req;
  inner.body = body["request"].dump();
  nlohmann::json inner_body;
  chat::ChatRequest cr;
  if (!chat::ParseTranslated(inner, res, engine(), translate, model_.id, &ledger_,
                             static_cast<size_t>(config_.server.max_messages), &inner_body, &cr)) {
    return;
  }
  nlohmann::json out = {
      {"tokens", cr.gen.prompt}, {"count", cr.gen.prompt.size()}, {"model", model_.id}};
  res.set_content(out.dump(), "application/json");
}

void Api::Detokenize(const httplib::Request& req, httplib::Response& res) const {
  auto tok = tokenizer();
  if (!tok) return WriteError(res, 503, "unavailable_error", "no tokenizer is loaded yet");
  nlohmann::json body;
  if (!ParseJsonBody(req, res, &body)) return;
  if (!body.contains("tokens") || !body["tokens"].is_array()) {
    return WriteError(res, 400, "invalid_request_error", "tokens: expected an array of token ids");
  }
  std::vector<int32_t> ids;
  for (size_t i = 0; i < body["tokens"].size(); ++i) {
    const nlohmann::json& v = body["tokens"][i];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
        v.get<int64_t>() >= static_cast<int64_t>(tok->size())) {
      return WriteError(res, 400, "invalid_request_error",
                        "tokens[" + std::to_string(i) + "]: expected a token id in [0, " +
                            std::to_string(tok->size()) + ")");
    }
    ids.push_back(v.get<int32_t>());
  }
  // Text that ends inside a UTF-8 character gets U+FFFD there, so the JSON stays valid.
  nlohmann::json out = {{"text", engine::SanitizeUtf8(tok->Decode(ids))}};
  res.set_content(out.dump(), "application/json");
}

void Api::Install(httplib::Server* server, const std::string& listener) {
  router_.Install(server);
  server->set_payload_max_length(config_.server.max_request_bytes);

  auto guard = std::make_shared<BrowserGuard>(config_.server, listener == "tcp");
  server->set_pre_routing_handler(
      [this, listener, guard](const httplib::Request& req, httplib::Response& res) {
        request_clock.active = true;
        request_clock.start = std::chrono::steady_clock::now();
        metrics_.RequestStarted();
        if (guard->AnswerPreflight(req, res)) return httplib::Server::HandlerResponse::Handled;
        if (std::optional<Refusal> r = guard->Check(req, res)) {
          WriteError(res, r->status, r->type, r->message);
          return httplib::Server::HandlerResponse::Handled;
        }
        // API keys, when configured: a wrong key is refused everywhere; no key is refused on TCP
        // (the socket's file permissions admit its users, each its own tenant "uid-N").
        if (!Auth()->keys.empty() && req.path != "/health") {
          const std::optional<std::string> key = PresentedKey(req);
          const bool ok = key ? TenantForKey(*key).has_value() : listener != "tcp";
          if (!ok) {
            const std::string what =
                key ? "the API key is not valid"
                    : "an API key is required (Authorization: Bearer KEY or x-api-key: KEY)";
            if (req.path.rfind("/v1/messages", 0) == 0) {
              res.status = 401;
              res.set_content(
                  nlohmann::json{{"type", "error"},
                                 {"error", {{"type", "authentication_error"}, {"message", what}}}}
                      .dump(),
                  "application/json");
            } else {
              WriteError(res, 401, "authentication_error", what);
            }
            return httplib::Server::HandlerResponse::Handled;
          }
        }
        return httplib::Server::HandlerResponse::Unhandled;
      });

  // Errors httplib detects before routing (bad request line, body too large) still get our JSON.
  server->set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string type = "invalid_request_error";
    std::string what = "request rejected with HTTP " + std::to_string(res.status);
    if (res.status == 413) {
      type = "request_too_large_error";
      what = "request body exceeds server.max_request_bytes";
    } else if (res.status == 414) {
      what = "request URI too long";
    } else if (res.status >= 500) {
      type = "internal_error";
    }
    WriteError(res, res.status, type, what + " (" + req.method + " " + req.path + ")");
  });

  server->set_exception_handler(
      [](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        bool client_json = false;
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const nlohmann::json::type_error& e) {
          what = e.what();
          client_json = true;
        } catch (const nlohmann::json::out_of_range& e) {
          what = e.what();
          client_json = true;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        if (client_json) {
          // A field of the client's JSON had a shape no route check caught: the client's error,
          // answered as one (routes name the field wherever they check it).
          spdlog::warn("{} {}: unexpected JSON shape: {}", req.method, req.path, what);
          WriteError(res, 400, "invalid_request_error",
                     "a request field has an unexpected type or value: " + what);
          return;
        }
        spdlog::error("{} {}: handler failed: {}", req.method, req.path, what);
        WriteError(res, 500, "internal_error", "internal error while handling " + req.path);
      });

  server->set_logger([this, listener](const httplib::Request& req, const httplib::Response& res) {
    double seconds = 0;
    if (request_clock.active) {
      seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - request_clock.start)
              .count();
      request_clock.active = false;
      metrics_.RequestFinished();
    }
    Router::Match m = router_.Find(req.method, req.path);
    const std::string route = m.kind == Router::Match::Kind::kNotFound ? "unmatched" : m.pattern;
    metrics_.RecordRequest(route, res.status, seconds);
    spdlog::info("{} {} {} {} {:.2f} ms", listener, req.method, req.path, res.status,
                 seconds * 1e3);
  });
}

}  // namespace flashd::api
