// The prefix cache over HTTP: GET /v1/cache (what it holds and how it is doing), POST
// /v1/cache/pins (warm a prefix and keep it from eviction) and DELETE /v1/cache/pins/{name}.
//
// A pin is tokenized exactly as the requests that should start from it: "text" as a
// /v1/completions prompt (the beginning-of-sentence token, then the text); "messages" (and
// "tools") as /v1/chat/completions renders them; "files" (a repository digest: each file as
// "<file path=\"PATH\">\n" CONTENT "\n</file>\n", in the order given) as the start of the first
// user message of a chat without a system prompt, whichever API sends it. The
// prefix is prefilled like any prompt (so its blocks and end state are stored), then its blocks
// and snapshot are pinned and the pin is recorded in the catalog, which survives restarts.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "tools-api/api.h"
#include "tools-api/chat_common.h"
#include "tools-api/generation.h"

namespace flashd::api {
namespace {

using namespace gen;

bool ValidPinName(const std::string& n) {
  if (n.empty() || n.size() > 128) return false;
  for (char c : n) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return false;
    }
  }
  return true;
}

}  // namespace

void Api::CacheStats(const httplib::Request& req, httplib::Response& res) const {
  engine::Engine* eng = engine();
  if (eng == nullptr) {
    return WriteError(res, 503, "unavailable_error", "the model is not loaded yet; see /health");
  }
  const cache::BlockStore* store = eng->cache();
  if (store == nullptr) {
    return WriteError(res, 503, "unavailable_error",
                      "the prefix cache is off (it could not be opened; see the log)");
  }
  const cache::BlockStore::Stats c = store->stats();
  const engine::Engine::Stats e = eng->stats();
  const std::string tenant = TenantOf(req);
  json pins = json::array();
  const std::vector<std::string> groups = GroupsOf(tenant);
  if (catalog_ != nullptr) {
    for (const cache::Catalog::Pin& p : catalog_->Pins()) {
      json group = nullptr;  // Null: the tenant's own; else the group it is published to.
      if (p.tenant != tenant) {
        const std::string g = p.tenant.rfind("group:", 0) == 0 ? p.tenant.substr(6) : "";
        if (g.empty() || std::find(groups.begin(), groups.end(), g) == groups.end()) continue;
        group = g;
      }
      pins.push_back({{"name", p.name},
                      {"group", group},
                      {"tokens", p.tokens},
                      {"blocks", p.chain.size()},
                      {"created", p.created}});
    }
  }
  json body = {
      {"object", "cache"},      {"tenant", tenant},
      {"groups", groups},       {"block_tokens", config_.cache.block_tokens},
      {"degraded", c.degraded}, {"pins", pins},
  };
  // Daemon-wide counters describe every tenant's traffic: only an administrator sees them.
  const bool admin = IsAdmin(req);
  body["scope"] = admin ? "daemon" : "tenant";
  if (admin) {
    body.update({{"blocks", c.blocks},
                 {"snapshots", c.snapshots},
                 {"disk_bytes", c.disk_bytes},
                 {"disk_quota_bytes", config_.cache.disk_quota_bytes},
                 {"ram_bytes", c.ram_bytes},
                 {"pinned_entries", c.pinned},
                 {"lookups", e.cache_lookups},
                 {"hit_tokens", e.cache_hit_tokens},
                 {"miss_tokens", e.cache_miss_tokens},
                 {"evictions", c.evictions},
                 {"expirations", c.expirations},
                 {"corruptions", c.corruptions}});
  }
  if (c.degraded) body["degraded_reason"] = c.degraded_reason;
  if (catalog_ != nullptr) {
    // This tenant's counters since the catalog was created (they survive restarts).
    const cache::Catalog::Usage u = catalog_->UsageOf(tenant);
    body["usage"] = {{"requests", u.requests},
                     {"prompt_tokens", u.prompt_tokens},
                     {"cached_tokens", u.cached_tokens},
                     {"completion_tokens", u.completion_tokens}};
  }
  res.set_content(body.dump(), "application/json");
}

void Api::CreatePin(const httplib::Request& req, httplib::Response& res) const {
  engine::Engine* eng = engine();
  if (eng == nullptr || eng->tokenizer() == nullptr) {
    return WriteError(res, 503, "unavailable_error", "the model is not loaded yet; see /health");
  }
  if (eng->cache() == nullptr || catalog_ == nullptr) {
    return WriteError(res, 503, "unavailable_error", "the prefix cache is off; see the log");
  }
  json body;
  if (!ParseJsonBody(req, res, &body)) return;
  if (!body.contains("name") || !body["name"].is_string() ||
      !ValidPinName(body["name"].get<std::string>())) {
    return WriteError(res, 400, "invalid_request_error",
                      "name: required, 1-128 letters, digits, '-', '_' or '.'");
  }
  const std::string name = body["name"];
  const int given = (body.contains("text") ? 1 : 0) + (body.contains("messages") ? 1 : 0) +
                    (body.contains("files") ? 1 : 0);
  if (given != 1) {
    return WriteError(res, 400, "invalid_request_error",
                      "text, messages, files: give exactly one of them");
  }
  std::vector<int32_t> tokens;
  if (body.contains("text")) {
    if (!body["text"].is_string() || body["text"].get<std::string>().empty()) {
      return WriteError(res, 400, "invalid_request_error", "text: expected a non-empty string");
    }
    tokens = TextPromptTokens(*eng, body["text"].get<std::string>());
  } else if (body.contains("files")) {
    if (!body["files"].is_array() || body["files"].empty()) {
      return WriteError(res, 400, "invalid_request_error", "files: expected a non-empty array");
    }
    std::string text;
    for (size_t i = 0; i < body["files"].size(); ++i) {
      const json& f = body["files"][i];
      if (!f.is_object() || !f.contains("path") || !f["path"].is_string() ||
          !f.contains("content") || !f["content"].is_string()) {
        return WriteError(res, 400, "invalid_request_error",
                          "files[" + std::to_string(i) + "]: expected {\"path\", \"content\"}");
      }
      text += "<file path=\"" + f["path"].get<std::string>() + "\">\n" +
              f["content"].get<std::string>() + "\n</file>\n";
    }
    // The start of a first user message, in the chat template: what a chat, message, response
    // or session turn whose first message opens with these files renders to.
    StatusOr<RenderedPrompt> r =
        RenderChat(ojson::array({{{"role", "user"}, {"content", text}}}), ChatOptions{}, nullptr);
    if (!r.ok() || r->untrusted.empty()) {
      return WriteError(res, 400, "invalid_request_error", "files: " + r.status().message());
    }
    const size_t end = r->untrusted.front().second;
    tokens = eng->tokenizer()->EncodeWithPlainRanges(std::string_view(r->text).substr(0, end),
                                                     {r->untrusted.front()});
  } else {
    // Rendered as the chat route renders it, so later chat requests start with these tokens.
    json chat_body = {{"messages", body["messages"]}};
    if (body.contains("tools")) chat_body["tools"] = body["tools"];
    chat::ChatRequest cr;
    cr.max_messages = static_cast<size_t>(config_.server.max_messages);
    const ojson ordered = ojson::parse(chat_body.dump());
    if (auto e = chat::ParseChat(chat_body, ordered, model_.id, *eng, &ledger_, &cr)) {
      return WriteError(res, e->status, e->type, e->message);
    }
    tokens = cr.gen.prompt;
  }
  if (tokens.empty()) return WriteError(res, 400, "invalid_request_error", "the prefix is empty");

  std::string tenant = TenantOf(req);
  json group = nullptr;
  if (body.contains("group")) {
    // Published to a group: stored in the group's namespace, read by every member.
    const std::vector<std::string> groups = GroupsOf(tenant);
    if (!body["group"].is_string() ||
        std::find(groups.begin(), groups.end(), body["group"].get<std::string>()) == groups.end()) {
      return WriteError(res, 403, "permission_error",
                        "group: tenant '" + tenant + "' is not a member of that group");
    }
    group = body["group"];
    tenant = "group:" + body["group"].get<std::string>();
  }
  size_t blocks = 0;
  if (Status st = PinTokens(tokens, tenant, name, &blocks); !st.ok()) {
    const int status = st.code() == StatusCode::kResourceExhausted ? 507 : HttpStatusFor(st);
    return WriteError(res, status, status == 507 ? "storage_error" : ErrorTypeFor(status),
                      st.message());
  }
  res.status = 201;
  res.set_content(json{{"object", "cache.pin"},
                       {"name", name},
                       {"tokens", tokens.size()},
                       {"blocks", blocks},
                       {"group", group}}
                      .dump(),
                  "application/json");
}

void Api::EvictCache(const httplib::Request& req, httplib::Response& res) const {
  engine::Engine* eng = engine();
  cache::BlockStore* store = eng == nullptr ? nullptr : eng->cache();
  if (store == nullptr) {
    return WriteError(res, 503, "unavailable_error", "the prefix cache is off; see the log");
  }
  // Entries are shared between tenants' chains only through groups, but evicting touches every
  // tenant's cache: it is an administrator's act.
  if (!IsAdmin(req)) {
    return WriteError(res, 403, "permission_error",
                      "evicting the cache needs an administrator (auth.admins, or the daemon's "
                      "own user on the socket)");
  }
  store->Flush();
  const auto [entries, bytes] = store->EvictUnpinned();
  spdlog::info("cache: evicted {} unpinned entries ({} bytes) on request", entries, bytes);
  res.set_content(
      json{{"object", "cache.eviction"}, {"evicted", entries}, {"freed_bytes", bytes}}.dump(),
      "application/json");
}

Status Api::PinTokens(const std::vector<int32_t>& tokens, const std::string& tenant,
                      const std::string& name, size_t* blocks) const {
  engine::Engine* eng = engine();
  cache::BlockStore* store = eng == nullptr ? nullptr : eng->cache();
  if (store == nullptr || catalog_ == nullptr) return Unavailable("the prefix cache is off");
  // Prefill it like a prompt; the engine stores its blocks and its end state.
  engine::GenerationRequest g;
  g.prompt = tokens;
  g.tenant = tenant;
  g.sampling.max_tokens = 1;
  g.sampling.temperature = 0;
  auto [handle, queue] = eng->Submit(std::move(g));
  for (;;) {
    std::optional<engine::GenerationEvent> e = queue->Pop(std::chrono::hours(24));
    if (!e || e->kind != engine::GenerationEvent::Kind::kDone) continue;
    if (e->finish_reason == "error") return e->error;
    break;
  }
  store->Flush();
  const engine::Engine::PrefixKeys keys = eng->KeysFor(tokens, tenant);
  if (store->PresentPrefix(keys.blocks) != keys.blocks.size()) {
    return ResourceExhausted("the prefix could not be stored (cache degraded or over its quota)");
  }
  // A pin of the same name is replaced: unpin the old one's entries.
  if (auto old = catalog_->FindPin(tenant, name)) {
    store->Unpin(old->chain);
    store->Unpin(std::span(&old->snapshot, 1));
  }
  store->Pin(keys.blocks);
  store->Pin(std::span(&keys.snapshot, 1));
  cache::Catalog::Pin pin{
      tenant, name, keys.blocks, keys.snapshot, static_cast<int64_t>(tokens.size()), 0};
  if (Status s = catalog_->PutPin(pin); !s.ok()) {
    store->Unpin(keys.blocks);
    store->Unpin(std::span(&keys.snapshot, 1));
    return s;
  }
  spdlog::info("cache pin '{}' of tenant '{}': {} tokens, {} blocks", name, tenant, tokens.size(),
               keys.blocks.size());
  *blocks = keys.blocks.size();
  return Status::Ok();
}

void Api::DeletePin(const httplib::Request& req, httplib::Response& res,
                    const std::string& name) const {
  engine::Engine* eng = engine();
  cache::BlockStore* store = eng == nullptr ? nullptr : eng->cache();
  if (store == nullptr || catalog_ == nullptr) {
    return WriteError(res, 503, "unavailable_error", "the prefix cache is off; see the log");
  }
  std::string tenant = TenantOf(req);
  if (req.has_param("group")) {
    const std::string g = req.get_param_value("group");
    const std::vector<std::string> groups = GroupsOf(tenant);
    if (std::find(groups.begin(), groups.end(), g) == groups.end()) {
      return WriteError(res, 403, "permission_error",
                        "group: tenant '" + tenant + "' is not a member of that group");
    }
    tenant = "group:" + g;
  }
  std::optional<cache::Catalog::Pin> pin = catalog_->FindPin(tenant, name);
  if (!pin) return WriteError(res, 404, "not_found_error", "pin '" + name + "' does not exist");
  if (Status s = catalog_->DeletePin(tenant, name); !s.ok()) {
    return WriteCatalogError(res, s);
  }
  store->Unpin(pin->chain);
  store->Unpin(std::span(&pin->snapshot, 1));
  res.set_content(json{{"object", "cache.pin"}, {"name", name}, {"deleted", true}}.dump(),
                  "application/json");
}

}  // namespace flashd::api
