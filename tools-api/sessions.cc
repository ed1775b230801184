// flashd sessions: the stateful path. The daemon keeps the conversation (system prompt, tools,
// settings and every message) in the catalog, so a client sends only what is new:
//
//   POST   /v1/sessions                 {system?, tools?, title?, settings?, pin?} -> the session
//   POST   /v1/sessions/{id}/turns      {messages, stream?, ...} -> a chat completion (whole or
//                                       streamed exactly like /v1/chat/completions)
//   POST   /v1/sessions/{id}/fork       {turn?} -> a new session holding the first `turn` turns
//   GET    /v1/sessions                 this tenant's sessions, most recently used first
//   GET    /v1/sessions/{id}            messages, turns, token count, cached tokens and bytes
//   DELETE /v1/sessions/{id}
//
// A turn renders the whole conversation, so the prefix cache restores everything up to the
// previous turn (its end state is a stored snapshot) and computes only the new messages; a fork
// shares every block with its origin. The reply is appended when the generation ends normally; a
// turn that fails or is cancelled leaves the session as it was. Turns sent at once on one session
// run one after another in arrival order, each seeing the replies before it (none is dropped).
// Sessions survive restarts.
#include <spdlog/spdlog.h>

#include <chrono>
#include <ctime>
#include <nlohmann/json.hpp>

#include "tools-api/api.h"
#include "tools-api/chat_common.h"
#include "tools-api/generation.h"

namespace flashd::api {
namespace {

using namespace gen;

// Settings a session keeps for its turns (a turn may override each).
constexpr const char* kSettings[] = {"temperature",
                                     "top_p",
                                     "top_k",
                                     "min_p",
                                     "max_tokens",
                                     "max_completion_tokens",
                                     "reasoning_effort",
                                     "thinking",
                                     "presence_penalty",
                                     "frequency_penalty",
                                     "repetition_penalty",
                                     "stop",
                                     "seed",
                                     "response_format",
                                     "parallel_tool_calls"};

// The session's conversation as a chat body.
ojson ChatBody(const ojson& s, const ojson& new_messages, const ojson& overrides) {
  ojson body = ojson::object();
  for (const char* k : kSettings) {
    if (s["settings"].contains(k)) body[k] = s["settings"][k];
    if (overrides.contains(k)) body[k] = overrides[k];
  }
  ojson messages = ojson::array();
  if (s.contains("system") && s["system"].is_string()) {
    messages.push_back({{"role", "system"}, {"content", s["system"]}});
  }
  for (const ojson& m : s["messages"]) messages.push_back(m);
  for (const ojson& m : new_messages) messages.push_back(m);
  body["messages"] = messages;
  if (s.contains("tools") && s["tools"].is_array() && !s["tools"].empty())
    body["tools"] = s["tools"];
  return body;
}

json Summary(const cache::Catalog::Session& x, const ojson& body) {
  return {{"id", x.id},
          {"object", "session"},
          {"title", x.title},
          {"created", x.created},
          {"last_used", x.last_used},
          {"turns", body["turns"].size()},
          {"messages", body["messages"].size()},
          {"tokens", x.tokens}};
}

int64_t NowSeconds() { return static_cast<int64_t>(std::time(nullptr)); }

}  // namespace

std::optional<cache::Catalog::Session> Api::FindSessionOrAnswer(const std::string& tenant,
                                                                const std::string& id,
                                                                httplib::Response& res) const {
  if (catalog_ == nullptr) {
    WriteError(res, 503, "unavailable_error", "sessions need the catalog; see the log");
    return std::nullopt;
  }
  std::optional<cache::Catalog::Session> x = catalog_->FindSession(tenant, id);
  if (!x) WriteError(res, 404, "not_found_error", "session '" + id + "' does not exist");
  return x;
}

void Api::CreateSession(const httplib::Request& req, httplib::Response& res) const {
  if (catalog_ == nullptr) {
    return WriteError(res, 503, "unavailable_error", "sessions need the catalog; see the log");
  }
  json parsed;
  if (!ParseJsonBody(req, res, &parsed)) return;
  const ojson in = ojson::parse(req.body);
  ojson body = {
      {"settings", ojson::object()}, {"messages", ojson::array()}, {"turns", ojson::array()}};
  if (in.contains("system")) {
    if (!in["system"].is_string()) {
      return WriteError(res, 400, "invalid_request_error", "system: expected a string");
    }
    body["system"] = in["system"];
  }
  if (in.contains("tools")) {
    if (!in["tools"].is_array()) {
      return WriteError(res, 400, "invalid_request_error", "tools: expected an array");
    }
    body["tools"] = in["tools"];
  }
  if (in.contains("settings")) {
    if (!in["settings"].is_object()) {
      return WriteError(res, 400, "invalid_request_error", "settings: expected an object");
    }
    for (auto it = in["settings"].begin(); it != in["settings"].end(); ++it) {
      bool known = false;
      for (const char* k : kSettings) known = known || it.key() == k;
      if (!known) {
        return WriteError(res, 400, "invalid_request_error",
                          "settings." + it.key() + ": not a session setting");
      }
      body["settings"][it.key()] = it.value();
    }
  }
  std::string title;
  if (in.contains("title")) {
    if (!in["title"].is_string()) {
      return WriteError(res, 400, "invalid_request_error", "title: expected a string");
    }
    title = in["title"];
  }
  engine::Engine* eng = engine();
  const std::string tenant = TenantOf(req);
  // Everything is checked by rendering it once, as a turn would (with a placeholder message).
  if (eng != nullptr && eng->tokenizer() != nullptr) {
    const ojson probe = ChatBody(body, ojson::array({{{"role", "user"}, {"content", "x"}}}), {});
    chat::ChatRequest cr;
    cr.max_messages = static_cast<size_t>(config_.server.max_messages);
    if (auto e = chat::ParseChatBody(probe, model_.id, *eng, &ledger_, &cr)) {
      return WriteError(res, e->status, e->type, e->message);
    }
  }
  size_t pinned_blocks = 0;
  if (in.contains("pin")) {
    // The session's fixed prefix (system prompt and tools), warmed and pinned under this name.
    if (!in["pin"].is_string() || in["pin"].get<std::string>().empty()) {
      return WriteError(res, 400, "invalid_request_error", "pin: expected a name");
    }
    if (eng == nullptr || eng->tokenizer() == nullptr) {
      return WriteError(res, 503, "unavailable_error", "the model is not loaded yet");
    }
    ojson fixed = ChatBody(body, ojson::array(), {});
    if (fixed["messages"].empty()) {
      return WriteError(res, 400, "invalid_request_error", "pin: the session has no system prompt");
    }
    chat::ChatRequest cr;
    cr.max_messages = static_cast<size_t>(config_.server.max_messages);
    if (auto e = chat::ParseChatBody(fixed, model_.id, *eng, &ledger_, &cr)) {
      return WriteError(res, e->status, e->type, e->message);
    }
    if (Status s = PinTokens(cr.gen.prompt, tenant, in["pin"], &pinned_blocks); !s.ok()) {
      const int status = HttpStatusFor(s);
      return WriteError(res, status, ErrorTypeFor(status), "pin: " + s.message());
    }
  }
  cache::Catalog::Session x;
  x.id = NewId("sess_");
  x.tenant = tenant;
  x.title = title;
  x.created = x.last_used = NowSeconds();
  x.body = body.dump();
  if (Status s = catalog_->PutSession(x); !s.ok()) {
    return WriteCatalogError(res, s);
  }
  json out = Summary(x, body);
  if (in.contains("pin")) out["pinned_blocks"] = pinned_blocks;
  res.status = 201;
  res.set_content(out.dump(), "application/json");
}

void Api::SessionTurn(const httplib::Request& req, httplib::Response& res,
                      const std::string& id) const {
  const auto arrived = std::chrono::steady_clock::now();
  const std::string tenant = TenantOf(req);
  json parsed;
  if (!ParseJsonBody(req, res, &parsed)) return;
  // Turns on one session run one after another, each on the conversation the previous left; the
  // lease goes with the reply's callback, so it is held until the turn is saved or abandoned.
  std::shared_ptr<void> lease = turns_.Enter(tenant + "\n" + id);
  std::optional<cache::Catalog::Session> x = FindSessionOrAnswer(tenant, id, res);
  if (!x) return;
  const ojson in = ojson::parse(req.body);
  if (!in.contains("messages") || !in["messages"].is_array() || in["messages"].empty()) {
    return WriteError(res, 400, "invalid_request_error",
                      "messages: expected a non-empty array of the new messages");
  }
  const ojson session = ojson::parse(x->body);
  ojson body = ChatBody(session, in["messages"], in);
  for (const char* k : {"stream", "stream_options", "logprobs", "top_logprobs", "tool_choice"}) {
    if (in.contains(k)) body[k] = in[k];
  }
  engine::Engine* eng = engine();
  // The reply joins the session when the generation ends normally.
  cache::Catalog* catalog = catalog_;
  cache::BlockStore* store = eng == nullptr ? nullptr : eng->cache();
  const ojson new_messages = in["messages"];
  cache::Catalog::Session row = *x;
  ServeChat(json::parse(body.dump()), body, tenant, arrived, res,
            [catalog, store, row, session, new_messages, lease](
                const json& message, const engine::GenerationEvent& done,
                const engine::Engine::PrefixKeys& keys) mutable {
              ojson s = session;
              for (const ojson& m : new_messages) s["messages"].push_back(m);
              s["messages"].push_back(ojson::parse(message.dump()));
              s["turns"].push_back(s["messages"].size());
              row.body = s.dump();
              row.last_used = NowSeconds();
              row.tokens = done.prompt_tokens + done.completion_tokens;
              row.head_key = row.snapshot_key = cache::BlockKey{};
              if (store != nullptr) {
                // Where the cache holds this turn's prompt; the row points only at entries
                // already written.
                store->Flush();
                if (!keys.blocks.empty() && store->Contains(keys.blocks.back())) {
                  row.head_key = keys.blocks.back();
                }
                if (store->Contains(keys.snapshot)) row.snapshot_key = keys.snapshot;
              }
              Status st = catalog->PutSession(row);
              if (!st.ok()) {
                spdlog::error("session {}: the turn could not be saved: {}", row.id, st.message());
              }
              return st;
            });
}

void Api::ForkSession(const httplib::Request& req, httplib::Response& res,
                      const std::string& id) const {
  const std::string tenant = TenantOf(req);
  std::optional<cache::Catalog::Session> x = FindSessionOrAnswer(tenant, id, res);
  if (!x) return;
  json in = json::object();
  if (!req.body.empty() && !ParseJsonBody(req, res, &in)) return;
  ojson s = ojson::parse(x->body);
  const int64_t turns = static_cast<int64_t>(s["turns"].size());
  int64_t at = turns;
  if (auto e = GetInt(in, "turn", 0, turns, &at))
    return WriteError(res, e->status, e->type, e->message);
  const size_t keep = at == 0 ? 0 : s["turns"][static_cast<size_t>(at - 1)].get<size_t>();
  ojson messages = ojson::array();
  for (size_t i = 0; i < keep; ++i) messages.push_back(s["messages"][i]);
  ojson turn_list = ojson::array();
  for (int64_t i = 0; i < at; ++i) turn_list.push_back(s["turns"][static_cast<size_t>(i)]);
  s["messages"] = messages;
  s["turns"] = turn_list;
  cache::Catalog::Session fork = *x;
  fork.id = NewId("sess_");
  fork.title = x->title.empty() ? "" : x->title + " (fork)";
  fork.created = fork.last_used = NowSeconds();
  fork.body = s.dump();
  if (Status st = catalog_->PutSession(fork); !st.ok()) {
    return WriteCatalogError(res, st);
  }
  json out = Summary(fork, s);
  out["forked_from"] = id;
  out["forked_at_turn"] = at;
  res.status = 201;
  res.set_content(out.dump(), "application/json");
}

void Api::ListSessions(const httplib::Request& req, httplib::Response& res) const {
  if (catalog_ == nullptr) {
    return WriteError(res, 503, "unavailable_error", "sessions need the catalog; see the log");
  }
  json data = json::array();
  for (const cache::Catalog::Session& x : catalog_->Sessions(TenantOf(req))) {
    data.push_back(Summary(x, ojson::parse(x.body)));
  }
  res.set_content(json{{"object", "list"}, {"data", data}}.dump(), "application/json");
}

void Api::GetSession(const httplib::Request& req, httplib::Response& res,
                     const std::string& id) const {
  const std::string tenant = TenantOf(req);
  std::optional<cache::Catalog::Session> x = FindSessionOrAnswer(tenant, id, res);
  if (!x) return;
  const ojson s = ojson::parse(x->body);
  json out = Summary(*x, s);
  out["head_key"] = x->head_key.IsRoot() ? json() : json(x->head_key.ToHex());
  out["snapshot_key"] = x->snapshot_key.IsRoot() ? json() : json(x->snapshot_key.ToHex());
  out["system"] = s.contains("system") ? json::parse(s["system"].dump()) : json();
  out["settings"] = json::parse(s["settings"].dump());
  out["turn_ends"] = json::parse(s["turns"].dump());
  out["conversation"] = json::parse(s["messages"].dump());
  // How much of the conversation the prefix cache holds now.
  engine::Engine* eng = engine();
  if (eng != nullptr && eng->tokenizer() != nullptr && eng->cache() != nullptr &&
      !s["messages"].empty()) {
    const ojson body = ChatBody(s, ojson::array(), {});
    chat::ChatRequest cr;
    cr.max_messages = static_cast<size_t>(config_.server.max_messages);
    if (!chat::ParseChatBody(body, model_.id, *eng, &ledger_, &cr)) {
      const engine::Engine::PrefixKeys keys = eng->KeysFor(cr.gen.prompt, tenant);
      const size_t present = eng->cache()->PresentPrefix(keys.blocks);
      out["conversation_tokens"] = cr.gen.prompt.size();
      out["cached_tokens"] = static_cast<int64_t>(present) * eng->block_tokens();
      out["cached_bytes"] = present * eng->block_bytes();
    }
  }
  res.set_content(out.dump(), "application/json");
}

void Api::DeleteSession(const httplib::Request& req, httplib::Response& res,
                        const std::string& id) const {
  if (catalog_ == nullptr) {
    return WriteError(res, 503, "unavailable_error", "sessions need the catalog; see the log");
  }
  Status s = catalog_->DeleteSession(TenantOf(req), id);
  if (s.code() == StatusCode::kNotFound)
    return WriteError(res, 404, "not_found_error", s.message());
  if (!s.ok()) return WriteCatalogError(res, s);
  res.set_content(json{{"id", id}, {"object", "session"}, {"deleted", true}}.dump(),
                  "application/json");
}

}  // namespace flashd::api
