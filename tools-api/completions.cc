// POST /v1/completions: OpenAI's text completions on the engine, whole or streamed as
// server-sent events.
//
// The handler submits the request and waits for the engine's first event before answering. The
// engine refuses at once what it will never run (a field out of range, a prompt longer than the
// context, a request larger than the whole memory budget), so those get a 4xx with a JSON body.
// After that the response is 200, and a failure midway arrives as an error in the body. Both kinds
// of response write something at least once a second (a token, an SSE comment, or a space before a
// whole JSON body), so a client that goes away is noticed within about two seconds, even while its
// request waits for memory, and its generation is cancelled.
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "tools-api/api.h"

namespace flashd::api {
namespace {

using engine::GenerationEvent;
using nlohmann::json;
using namespace std::chrono_literals;

constexpr int kDefaultMaxTokens = 16;  // OpenAI's default for this route.
constexpr size_t kMaxStops = 16;

struct CompletionRequest {
  engine::GenerationRequest gen;
  bool stream = false;
  bool include_usage = false;
  bool echo = false;
  std::string echo_text;
};

// A request field's problem; `status` is the HTTP status to answer with.
struct FieldError {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string message;
};

bool Present(const json& body, const char* key) {
  return body.contains(key) && !body[key].is_null();
}

std::optional<FieldError> GetNumber(const json& body, const char* key, double lo, double hi,
                                    double* out) {
  if (!Present(body, key)) return std::nullopt;
  const json& v = body[key];
  if (!v.is_number() || v.get<double>() < lo || v.get<double>() > hi) {
    char range[96];
    std::snprintf(range, sizeof range, "expected a number in [%g, %g]", lo, hi);
    return FieldError{400, "invalid_request_error", std::string(key) + ": " + range};
  }
  *out = v.get<double>();
  return std::nullopt;
}

std::optional<FieldError> GetInt(const json& body, const char* key, int64_t lo, int64_t hi,
                                 int64_t* out) {
  if (!Present(body, key)) return std::nullopt;
  const json& v = body[key];
  if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
    return FieldError{400, "invalid_request_error",
                      std::string(key) + ": expected an integer in [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + "]"};
  }
  *out = v.get<int64_t>();
  return std::nullopt;
}

std::optional<FieldError> GetBool(const json& body, const char* key, bool* out) {
  if (!Present(body, key)) return std::nullopt;
  if (!body[key].is_boolean()) {
    return FieldError{400, "invalid_request_error", std::string(key) + ": expected true or false"};
  }
  *out = body[key].get<bool>();
  return std::nullopt;
}

// Fills `out` from the body; returns the first problem found.
std::optional<FieldError> ParseCompletion(const json& body, const std::string& model_id,
                                          const engine::Engine& eng, CompletionRequest* out) {
  const engine::Tokenizer* tok = eng.tokenizer();
  if (Present(body, "model")) {
    if (!body["model"].is_string()) {
      return FieldError{400, "invalid_request_error", "model: expected a string"};
    }
    if (body["model"].get<std::string>() != model_id) {
      return FieldError{404, "not_found_error",
                        "model: \"" + body["model"].get<std::string>() +
                            "\" is not served here; this daemon serves \"" + model_id + "\""};
    }
  }

  if (!Present(body, "prompt")) {
    return FieldError{400, "invalid_request_error", "prompt: required"};
  }
  const json& prompt = body["prompt"];
  const json* text = nullptr;
  if (prompt.is_string()) {
    text = &prompt;
  } else if (prompt.is_array() && prompt.size() == 1 && prompt[0].is_string()) {
    text = &prompt[0];
  } else if (prompt.is_array() && !prompt.empty() && prompt[0].is_number_integer()) {
    for (size_t i = 0; i < prompt.size(); ++i) {
      if (!prompt[i].is_number_integer() || prompt[i].get<int64_t>() < 0 ||
          prompt[i].get<int64_t>() >= eng.config().vocab_size) {
        return FieldError{400, "invalid_request_error",
                          "prompt[" + std::to_string(i) + "]: expected a token id in [0, " +
                              std::to_string(eng.config().vocab_size) + ")"};
      }
      out->gen.prompt.push_back(prompt[i].get<int32_t>());
    }
    if (tok != nullptr) out->echo_text = engine::SanitizeUtf8(tok->Decode(out->gen.prompt));
  } else if (prompt.is_array() && !prompt.empty()) {
    return FieldError{400, "invalid_request_error",
                      "prompt: batches of prompts are not supported; send one request per prompt"};
  } else {
    return FieldError{400, "invalid_request_error",
                      "prompt: expected a non-empty string or an array of token ids"};
  }
  if (text != nullptr) {
    if (tok == nullptr) {
      return FieldError{503, "unavailable_error",
                        "prompt: text prompts need the model's tokenizer.json; send token ids"};
    }
    const std::string& s = text->get_ref<const std::string&>();
    if (s.empty()) return FieldError{400, "invalid_request_error", "prompt: empty"};
    out->echo_text = s;
    out->gen.prompt = tok->Encode(s);
    // Like the model's own chat format, a prompt starts with the beginning-of-sentence token.
    const auto bos = static_cast<int32_t>(eng.config().bos_token_id);
    if (out->gen.prompt.empty() || out->gen.prompt.front() != bos) {
      out->gen.prompt.insert(out->gen.prompt.begin(), bos);
    }
  }

  engine::SamplingParams& p = out->gen.sampling;
  p.max_tokens = kDefaultMaxTokens;
  int64_t i64 = 0;
  double d = 0;
  const int64_t context = eng.config().max_position_embeddings;
  if (auto e = GetInt(body, "max_tokens", 1, context > 0 ? context : INT32_MAX, &i64)) return e;
  if (Present(body, "max_tokens")) p.max_tokens = static_cast<int>(i64);
  if (auto e = GetNumber(body, "temperature", 0, 2, &d)) return e;
  if (Present(body, "temperature")) p.temperature = static_cast<float>(d);
  if (auto e = GetNumber(body, "top_p", 0, 1, &d)) return e;
  if (Present(body, "top_p")) {
    if (d <= 0) return FieldError{400, "invalid_request_error", "top_p: expected (0, 1]"};
    p.top_p = static_cast<float>(d);
  }
  if (auto e = GetInt(body, "top_k", 0, INT32_MAX, &i64)) return e;
  if (Present(body, "top_k")) p.top_k = static_cast<int>(i64);
  if (auto e = GetNumber(body, "min_p", 0, 1, &d)) return e;
  if (Present(body, "min_p")) p.min_p = static_cast<float>(d);
  if (auto e = GetNumber(body, "presence_penalty", -2, 2, &d)) return e;
  if (Present(body, "presence_penalty")) p.presence_penalty = static_cast<float>(d);
  if (auto e = GetNumber(body, "frequency_penalty", -2, 2, &d)) return e;
  if (Present(body, "frequency_penalty")) p.frequency_penalty = static_cast<float>(d);
  if (auto e = GetNumber(body, "repetition_penalty", 0.01, 10, &d)) return e;
  if (Present(body, "repetition_penalty")) p.repetition_penalty = static_cast<float>(d);
  if (Present(body, "seed")) {
    if (!body["seed"].is_number_integer()) {
      return FieldError{400, "invalid_request_error", "seed: expected an integer"};
    }
    p.seed = body["seed"].is_number_unsigned() ? body["seed"].get<uint64_t>()
                                               : static_cast<uint64_t>(body["seed"].get<int64_t>());
  }
  if (auto e = GetInt(body, "logprobs", 0, 20, &i64)) return e;
  if (Present(body, "logprobs")) p.logprobs = static_cast<int>(i64);

  if (Present(body, "stop")) {
    const json& stop = body["stop"];
    if (stop.is_string()) {
      p.stop.push_back(stop.get<std::string>());
    } else if (stop.is_array() && stop.size() <= kMaxStops) {
      for (const json& s : stop) {
        if (!s.is_string()) {
          return FieldError{400, "invalid_request_error", "stop: expected strings"};
        }
        p.stop.push_back(s.get<std::string>());
      }
    } else {
      return FieldError{400, "invalid_request_error",
                        "stop: expected a string or an array of at most " +
                            std::to_string(kMaxStops) + " strings"};
    }
    for (const std::string& s : p.stop) {
      if (s.empty()) return FieldError{400, "invalid_request_error", "stop: empty stop string"};
    }
  }
  if (Present(body, "stop_token_ids")) {
    const json& ids = body["stop_token_ids"];
    if (!ids.is_array()) {
      return FieldError{400, "invalid_request_error", "stop_token_ids: expected an array"};
    }
    for (const json& t : ids) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 ||
          t.get<int64_t>() >= eng.config().vocab_size) {
        return FieldError{400, "invalid_request_error",
                          "stop_token_ids: expected token ids in [0, " +
                              std::to_string(eng.config().vocab_size) + ")"};
      }
      p.stop_tokens.push_back(t.get<int32_t>());
    }
  }

  if (auto e = GetBool(body, "ignore_eos", &p.ignore_eos)) return e;
  if (auto e = GetBool(body, "echo", &out->echo)) return e;
  if (auto e = GetBool(body, "stream", &out->stream)) return e;
  if (Present(body, "stream_options")) {
    if (!body["stream_options"].is_object()) {
      return FieldError{400, "invalid_request_error", "stream_options: expected an object"};
    }
    if (auto e = GetBool(body["stream_options"], "include_usage", &out->include_usage)) {
      e->message = "stream_options." + e->message;
      return e;
    }
  }
  if (auto e = GetInt(body, "n", 1, 1, &i64)) {
    e->message = "n: only 1 completion per request is supported";
    return e;
  }
  if (auto e = GetInt(body, "best_of", 1, 1, &i64)) {
    e->message = "best_of: only 1 is supported";
    return e;
  }
  if (Present(body, "suffix") && !(body["suffix"].is_string() && body["suffix"].empty())) {
    return FieldError{400, "invalid_request_error", "suffix: not supported by this model"};
  }
  if (Present(body, "logit_bias") &&
      !(body["logit_bias"].is_object() && body["logit_bias"].empty())) {
    return FieldError{400, "invalid_request_error", "logit_bias: not supported"};
  }
  if (out->echo && p.logprobs > 0) {
    return FieldError{400, "invalid_request_error",
                      "echo: prompt log-probabilities are not computed; use echo or logprobs"};
  }
  return std::nullopt;
}

int HttpStatusFor(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kResourceExhausted:
      return 400;
    case StatusCode::kNotFound:
      return 404;
    case StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

const char* ErrorTypeFor(int status) {
  switch (status) {
    case 400:
      return "invalid_request_error";
    case 404:
      return "not_found_error";
    case 503:
      return "unavailable_error";
    default:
      return "internal_error";
  }
}

std::string NewId(const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}() * 0x9E3779B97F4A7C15ull;
  char buf[40];
  std::snprintf(buf, sizeof buf, "%s%016llx%08llx", prefix, static_cast<unsigned long long>(salt),
                static_cast<unsigned long long>(counter.fetch_add(1) & 0xffffffffu));
  return buf;
}

std::string SseEvent(const json& j) { return "data: " + j.dump() + "\n\n"; }

json Usage(const GenerationEvent& done) {
  return {{"prompt_tokens", done.prompt_tokens},
          {"completion_tokens", done.completion_tokens},
          {"total_tokens", done.prompt_tokens + done.completion_tokens}};
}

// OpenAI's legacy logprobs object, grown one token at a time.
class Logprobs {
 public:
  explicit Logprobs(const engine::Tokenizer* tok) : tok_(tok) {}

  void Add(const GenerationEvent& e, size_t text_offset) {
    tokens_.push_back(Piece(e.token.token));
    token_logprobs_.push_back(e.token.logprob);
    json top = json::object();
    for (const auto& [id, lp] : e.token.top) top[Piece(id)] = lp;
    top_logprobs_.push_back(std::move(top));
    text_offset_.push_back(text_offset);
  }
  json ToJson() const {
    return {{"tokens", tokens_},
            {"token_logprobs", token_logprobs_},
            {"top_logprobs", top_logprobs_},
            {"text_offset", text_offset_}};
  }

 private:
  std::string Piece(int32_t id) const {
    if (tok_ == nullptr) return fmt::format("<{}>", id);
    const int32_t one[1] = {id};
    return engine::SanitizeUtf8(tok_->Decode(one));
  }
  const engine::Tokenizer* tok_;
  json tokens_ = json::array();
  json token_logprobs_ = json::array();
  json top_logprobs_ = json::array();
  json text_offset_ = json::array();
};

// A submitted generation as its response's content provider sees it.
struct Generation {
  engine::Engine* engine = nullptr;
  engine::Engine::Handle handle = 0;
  std::shared_ptr<engine::EventQueue> queue;
  std::optional<GenerationEvent> pending;  // The first event, popped by the handler.
  std::string id;
  bool finished = false;  // The response is complete.
  std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();

  void Bind(engine::Engine* e, engine::Engine::Handle h, std::shared_ptr<engine::EventQueue> q,
            GenerationEvent first, std::string response_id) {
    engine = e;
    handle = h;
    queue = std::move(q);
    pending = std::move(first);
    id = std::move(response_id);
  }

  std::optional<GenerationEvent> Next(std::chrono::milliseconds timeout) {
    if (pending) {
      std::optional<GenerationEvent> e = std::move(pending);
      pending.reset();
      return e;
    }
    return queue->Pop(timeout);
  }
  // The response's resource releaser: a response that did not complete lost its client.
  void Release() {
    if (finished) return;
    spdlog::info("completion {}: client gone, generation cancelled", id);
    engine->Cancel(handle);
  }
};

using StreamAppend = std::function<void(const GenerationEvent&, std::string*)>;

// Streams `g` as server-sent events. `append` writes the "data:" events of a token and of a normal
// end; queue places and silence become comment lines, an error an error event, and the stream
// closes with "data: [DONE]".
void ServeStream(httplib::Response& res, std::shared_ptr<Generation> g, StreamAppend append) {
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [g, append](size_t, httplib::DataSink& sink) {
        std::optional<GenerationEvent> e = g->Next(250ms);
        if (!e) {
          // A comment line each second of silence (a long prefill, a wait for memory): clients
          // ignore it, and writing it is how a client that went away is noticed.
          const auto now = std::chrono::steady_clock::now();
          if (now - g->last_write < 1s) return true;
          g->last_write = now;
          return sink.write(": keep-alive\n\n", 14);
        }
        std::string out;
        bool done = false;
        // This event and what else is ready, in one write.
        for (; e && !done; e = done ? std::nullopt : g->queue->Pop(0ms)) {
          if (e->kind == GenerationEvent::Kind::kQueued) {
            out += ": queued at position " + std::to_string(e->queue_position) + "\n\n";
            continue;
          }
          done = e->kind == GenerationEvent::Kind::kDone;
          if (done && e->finish_reason == "error") {
            const int status = HttpStatusFor(e->error);
            out += SseEvent(
                {{"error", {{"type", ErrorTypeFor(status)}, {"message", e->error.message()}}}});
          } else {
            append(*e, &out);
          }
          if (done) out += "data: [DONE]\n\n";
        }
        g->last_write = std::chrono::steady_clock::now();
        if (!sink.write(out.data(), out.size())) return false;  // The releaser cancels.
        if (done) {
          g->finished = true;
          sink.done();
        }
        return true;
      },
      [g](bool) { g->Release(); });
}

// Sends `g` as one JSON body: `on_token` sees every token, `body` makes the response from the
// final event. It is sent chunked, led by a space every second while the generation runs: JSON
// allows leading whitespace, and a write to a client that went away fails, which cancels the
// generation (httplib shows a handler no other sign of a closed connection).
void ServeWhole(httplib::Response& res, std::shared_ptr<Generation> g,
                std::function<void(const GenerationEvent&)> on_token,
                std::function<json(const GenerationEvent&)> body) {
  res.set_chunked_content_provider(
      "application/json",
      [g, on_token, body](size_t, httplib::DataSink& sink) {
        std::optional<GenerationEvent> e = g->Next(250ms);
        while (e && e->kind != GenerationEvent::Kind::kDone) {
          if (e->kind == GenerationEvent::Kind::kToken) on_token(*e);
          e = g->queue->Pop(0ms);
        }
        if (!e) {
          const auto now = std::chrono::steady_clock::now();
          if (now - g->last_write < 1s) return true;
          g->last_write = now;
          return sink.write(" ", 1);  // false: the releaser cancels.
        }
        json out;
        if (e->finish_reason == "error") {
          const int status = HttpStatusFor(e->error);
          out = {{"error", {{"type", ErrorTypeFor(status)}, {"message", e->error.message()}}}};
        } else {
          out = body(*e);
        }
        g->finished = true;
        const std::string text = out.dump();
        if (!sink.write(text.data(), text.size())) return false;
        sink.done();
        return true;
      },
      [g](bool) { g->Release(); });
}

// Submits `request` and waits for the engine's first word on it (a token, a place in the queue,
// or the end), so that refusals, which the engine makes at once, still answer 4xx. Returns null
// after writing that 4xx.
std::shared_ptr<Generation> Start(engine::Engine* eng, engine::GenerationRequest request,
                                  const std::string& id, httplib::Response& res) {
  auto [handle, queue] = eng->Submit(std::move(request));
  std::optional<GenerationEvent> first;
  while (!first) first = queue->Pop(250ms);
  if (first->kind == GenerationEvent::Kind::kDone && first->finish_reason == "error") {
    const int status = HttpStatusFor(first->error);
    WriteError(res, status, ErrorTypeFor(status), first->error.message());
    return nullptr;
  }
  auto g = std::make_shared<Generation>();
  g->Bind(eng, handle, queue, std::move(*first), id);
  return g;
}

}  // namespace

void Api::Completions(const httplib::Request& req, httplib::Response& res) const {
  engine::Engine* eng = engine();
  if (eng == nullptr) {
    return WriteError(res, 503, "unavailable_error", "the model is not loaded yet; see /health");
  }
  json body;
  if (!ParseJsonBody(req, res, &body)) return;
  CompletionRequest cr;
  if (auto e = ParseCompletion(body, model_.id, *eng, &cr)) {
    return WriteError(res, e->status, e->type, e->message);
  }
  const bool want_logprobs = cr.gen.sampling.logprobs > 0;
  const std::string id = NewId("cmpl-");
  std::shared_ptr<Generation> g = Start(eng, std::move(cr.gen), id, res);
  if (!g) return;
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  const engine::Tokenizer* tok = eng->tokenizer();
  auto chunk = [id, created, model = model_.id, usage = cr.include_usage](
                   const std::string& text, const json& logprobs, const json& finish) {
    json c = {
        {"id", id},
        {"object", "text_completion"},
        {"created", created},
        {"model", model},
        {"choices",
         json::array(
             {{{"text", text}, {"index", 0}, {"logprobs", logprobs}, {"finish_reason", finish}}})}};
    if (usage) c["usage"] = nullptr;
    return c;
  };

  if (cr.stream) {
    struct State {
      std::string echo;
      size_t text_offset = 0;
    };
    auto st = std::make_shared<State>();
    st->echo = cr.echo ? cr.echo_text : "";
    ServeStream(res, g,
                [st, chunk, tok, want_logprobs, usage = cr.include_usage](const GenerationEvent& e,
                                                                          std::string* out) {
                  if (!st->echo.empty()) {
                    *out += SseEvent(chunk(st->echo, nullptr, nullptr));
                    st->text_offset += st->echo.size();
                    st->echo.clear();
                  }
                  if (e.kind == GenerationEvent::Kind::kToken) {
                    json lp = nullptr;
                    if (want_logprobs) {
                      Logprobs one(tok);
                      one.Add(e, st->text_offset);
                      lp = one.ToJson();
                    }
                    st->text_offset += e.text.size();
                    *out += SseEvent(chunk(e.text, lp, nullptr));
                    return;
                  }
                  *out += SseEvent(chunk("", nullptr, e.finish_reason));
                  if (usage) {
                    json u = chunk("", nullptr, nullptr);
                    u["choices"] = json::array();
                    u["usage"] = Usage(e);
                    *out += SseEvent(u);
                  }
                });
    return;
  }

  struct State {
    std::string text;
    std::optional<Logprobs> logprobs;
  };
  auto st = std::make_shared<State>();
  st->text = cr.echo ? cr.echo_text : "";
  if (want_logprobs) st->logprobs.emplace(tok);
  ServeWhole(
      res, g,
      [st](const GenerationEvent& e) {
        if (st->logprobs) st->logprobs->Add(e, st->text.size());
        st->text += e.text;
      },
      [st, chunk](const GenerationEvent& done) {
        json out =
            chunk(st->text, st->logprobs ? st->logprobs->ToJson() : json(), done.finish_reason);
        out.erase("usage");
        out["usage"] = Usage(done);
        return out;
      });
}

}  // namespace flashd::api
