// The parts every generation route shares: request-field checks that name the field, the
// sampling fields, error statuses, and serving a generation as a stream of server-sent events or
// as one JSON body, with disconnects cancelling the generation. Internal to tools-api.
#pragma once

#include <httplib.h>

#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "engine/engine.h"
#include "tools-api/metrics.h"

namespace flashd::api::gen {

using engine::GenerationEvent;
using nlohmann::json;

// A request field's problem; `status` is the HTTP status to answer with.
struct FieldError {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string message;
};

bool Present(const json& body, const char* key);

std::optional<FieldError> GetNumber(const json& body, const char* key, double lo, double hi,
                                    double* out);

std::optional<FieldError> GetInt(const json& body, const char* key, int64_t lo, int64_t hi,
                                 int64_t* out);

std::optional<FieldError> GetBool(const json& body, const char* key, bool* out);

// The sampling fields every generation route shares; `max_tokens` also answers to
// "max_completion_tokens".
std::optional<FieldError> ParseSampling(const json& body, const engine::Engine& eng,
                                        int default_max_tokens, engine::SamplingParams* out);

// "stream" and "stream_options.include_usage".
std::optional<FieldError> ParseStreamFlags(const json& body, bool* stream, bool* include_usage);

// "model", when given, must name the served model (404 otherwise).
std::optional<FieldError> CheckModel(const json& body, const std::string& model_id);

int HttpStatusFor(const Status& s);

// Answers 507 for a catalog write that failed (a full or failing disk), naming why.
void WriteCatalogError(httplib::Response& res, const Status& s);

const char* ErrorTypeFor(int status);

std::string NewId(const char* prefix);

// One server-sent event carrying `j`.
std::string SseEvent(const json& j);
// The same with an event name ("event: NAME"), as the Messages and Responses streams send.
std::string SseEvent(const std::string& name, const json& j);
// `j` as compact JSON text; invalid UTF-8 in strings becomes U+FFFD instead of throwing.
std::string Dump(const json& j);

json Usage(const GenerationEvent& done);

// A text completion prompt's tokens: the text with added tokens recognised, led by the
// beginning-of-sentence token as the model's own chat format is. Text pins use it too, so that
// completions starting with a pinned text start with its tokens.
// REQUIRES: eng.tokenizer() is not null.
std::vector<int32_t> TextPromptTokens(const engine::Engine& eng, const std::string& text);

// A submitted generation as its response's content provider sees it.
struct Generation {
  engine::Engine* engine = nullptr;
  engine::Engine::Handle handle = 0;
  std::shared_ptr<engine::EventQueue> queue;
  std::optional<GenerationEvent> pending;  // The first event, popped by the handler.
  std::string id;
  bool finished = false;  // The response is complete.
  std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();
  Metrics* metrics = nullptr;
  std::chrono::steady_clock::time_point arrived;  // When the request reached the handler.
  std::optional<std::chrono::steady_clock::time_point> last_token;
  // Sees the final event of a generation that ended (not one whose client went away).
  std::function<void(const GenerationEvent&)> on_end;

  // Records a token's latency in the metrics.
  void Saw(const GenerationEvent& token);

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
  void Release();
};

using StreamAppend = std::function<void(const GenerationEvent&, std::string*)>;

// How a route's event stream spells what every stream has.
struct StreamStyle {
  std::string keep_alive = ": keep-alive\n\n";  // Each second of silence.
  bool queue_comments = true;                   // ": queued at position N" while waiting.
  // The event ending a stream in error.
  std::function<std::string(int status, const std::string& message)> error;
  std::string trailer = "data: [DONE]\n\n";  // After the last event.
};
// OpenAI's: comment lines, {"error": {...}} and a closing "data: [DONE]".
StreamStyle OpenAiStreamStyle();

// Streams `g` as server-sent events. `append` writes the events of a token and of a normal end;
// silence and queue places become keep-alives, an error the style's error event.
void ServeStream(httplib::Response& res, std::shared_ptr<Generation> g, StreamAppend append,
                 StreamStyle style = OpenAiStreamStyle());

// Sends `g` as one JSON body: `on_token` sees every token, `body` makes the response from the
// final event. It is sent chunked, led by a space every second while the generation runs: JSON
// allows leading whitespace, and a write to a client that went away fails, which cancels the
// generation (httplib shows a handler no other sign of a closed connection).
void ServeWhole(httplib::Response& res, std::shared_ptr<Generation> g,
                std::function<void(const GenerationEvent&)> on_token,
                std::function<json(const GenerationEvent&)> body);

// Submits `request` and waits for the engine's first word on it (a token, a place in the queue,
// or the end), so that refusals, which the engine makes at once, still answer 4xx. Returns null
// after writing that 4xx.
std::shared_ptr<Generation> Start(engine::Engine* eng, engine::GenerationRequest request,
                                  const std::string& id, Metrics* metrics,
                                  std::chrono::steady_clock::time_point arrived,
                                  httplib::Response& res,
                                  std::function<void(const GenerationEvent&)> on_end = nullptr);

}  // namespace flashd::api::gen
