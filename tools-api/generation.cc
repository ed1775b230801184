#include "tools-api/generation.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdio>
#include <random>

#include "tools-api/router.h"

namespace flashd::api::gen {
namespace {
constexpr size_t kMaxStops = 16;
}  // namespace

using namespace std::chrono_literals;

void Generation::Saw(const GenerationEvent& token) {
  if (token.token.token < 0 || metrics == nullptr) return;
  if (!last_token) {
    metrics->ObserveTimeToFirstToken(std::chrono::duration<double>(token.time - arrived).count());
  } else {
    metrics->ObserveInterToken(std::chrono::duration<double>(token.time - *last_token).count());
  }
  last_token = token.time;
}

void Generation::Release() {
  if (finished) return;
  spdlog::info("generation {}: client gone, cancelled", id);
  engine->Cancel(handle);
}

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

// The sampling fields every generation route shares; `max_tokens` also answers to
// "max_completion_tokens".
std::optional<FieldError> ParseSampling(const json& body, const engine::Engine& eng,
                                        int default_max_tokens, engine::SamplingParams* out) {
  engine::SamplingParams& p = *out;
  p.max_tokens = default_max_tokens;
  int64_t i64 = 0;
  double d = 0;
  const int64_t context = eng.config().max_position_embeddings;
  for (const char* key : {"max_completion_tokens", "max_tokens"}) {
    if (auto e = GetInt(body, key, 1, context > 0 ? context : INT32_MAX, &i64)) return e;
    if (Present(body, key)) p.max_tokens = static_cast<int>(i64);
  }
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
  return std::nullopt;
}

std::optional<FieldError> ParseStreamFlags(const json& body, bool* stream, bool* include_usage) {
  if (auto e = GetBool(body, "stream", stream)) return e;
  if (Present(body, "stream_options")) {
    if (!body["stream_options"].is_object()) {
      return FieldError{400, "invalid_request_error", "stream_options: expected an object"};
    }
    if (auto e = GetBool(body["stream_options"], "include_usage", include_usage)) {
      e->message = "stream_options." + e->message;
      return e;
    }
  }
  return std::nullopt;
}

std::optional<FieldError> CheckModel(const json& body, const std::string& model_id) {
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

std::string SseEvent(const json& j) { return "data: " + Dump(j) + "\n\n"; }

std::string SseEvent(const std::string& name, const json& j) {
  return "event: " + name + "\n" + SseEvent(j);
}

void WriteCatalogError(httplib::Response& res, const Status& s) {
  WriteError(res, 507, "storage_error", "the catalog could not be written: " + s.message());
}

std::vector<int32_t> TextPromptTokens(const engine::Engine& eng, const std::string& text) {
  std::vector<int32_t> ids = eng.tokenizer()->Encode(text);
  const auto bos = static_cast<int32_t>(eng.config().bos_token_id);
  if (ids.empty() || ids.front() != bos) ids.insert(ids.begin(), bos);
  return ids;
}

std::string Dump(const json& j) {
  // Generated text is whole characters, but a log line must never take a response down: any
  // invalid UTF-8 that slips through becomes U+FFFD.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

json Usage(const GenerationEvent& done) {
  return {{"prompt_tokens", done.prompt_tokens},
          {"completion_tokens", done.completion_tokens},
          {"total_tokens", done.prompt_tokens + done.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", done.cached_tokens}}}};
}

using StreamAppend = std::function<void(const GenerationEvent&, std::string*)>;

// Streams `g` as server-sent events. `append` writes the "data:" events of a token and of a normal
// end; queue places and silence become comment lines, an error an error event, and the stream
// closes with "data: [DONE]".
StreamStyle OpenAiStreamStyle() {
  StreamStyle s;
  s.error = [](int status, const std::string& message) {
    return SseEvent({{"error", {{"type", ErrorTypeFor(status)}, {"message", message}}}});
  };
  return s;
}

void ServeStream(httplib::Response& res, std::shared_ptr<Generation> g, StreamAppend append,
                 StreamStyle style) {
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [g, append, style](size_t, httplib::DataSink& sink) {
        std::optional<GenerationEvent> e = g->Next(250ms);
        if (!e) {
          // A comment line each second of silence (a long prefill, a wait for memory): clients
          // ignore it, and writing it is how a client that went away is noticed.
          const auto now = std::chrono::steady_clock::now();
          if (now - g->last_write < 1s) return true;
          g->last_write = now;
          return sink.write(style.keep_alive.data(), style.keep_alive.size());
        }
        std::string out;
        bool done = false;
        // This event and what else is ready, in one write.
        for (; e && !done; e = done ? std::nullopt : g->queue->Pop(0ms)) {
          if (e->kind == GenerationEvent::Kind::kQueued) {
            out += style.queue_comments
                       ? ": queued at position " + std::to_string(e->queue_position) + "\n\n"
                       : style.keep_alive;
            continue;
          }
          done = e->kind == GenerationEvent::Kind::kDone;
          if (done && g->on_end) g->on_end(*e);
          if (e->kind == GenerationEvent::Kind::kToken) g->Saw(*e);
          if (done && e->finish_reason == "error") {
            out += style.error(HttpStatusFor(e->error), e->error.message());
          } else {
            try {
              append(*e, &out);
            } catch (const std::exception& ex) {
              // A formatting bug must not leave the client waiting: end the stream with an error.
              spdlog::error("generation {}: {}", g->id, ex.what());
              out += style.error(500, ex.what());
              done = true;
              g->engine->Cancel(g->handle);
            }
          }
          if (done) out += style.trailer;
        }
        if (out.empty()) return true;  // (An empty write would end the chunked body.)
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
          if (e->kind == GenerationEvent::Kind::kToken) {
            g->Saw(*e);
            on_token(*e);
          }
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
        if (g->on_end) g->on_end(*e);
        g->finished = true;
        const std::string text = Dump(out);
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
                                  const std::string& id, Metrics* metrics,
                                  std::chrono::steady_clock::time_point arrived,
                                  httplib::Response& res,
                                  std::function<void(const GenerationEvent&)> on_end) {
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
  g->metrics = metrics;
  g->arrived = arrived;
  g->on_end = std::move(on_end);
  return g;
}

}  // namespace flashd::api::gen
