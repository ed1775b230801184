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
#include "tools-api/generation.h"

namespace flashd::api {
namespace {

using namespace gen;

constexpr int kDefaultMaxTokens = 16;  // OpenAI's default for this route.

struct CompletionRequest {
  engine::GenerationRequest gen;
  bool stream = false;
  bool include_usage = false;
  bool echo = false;
  std::string echo_text;
};

// Fills `out` from the body; returns the first problem found.
std::optional<FieldError> ParseCompletion(const json& body, const std::string& model_id,
                                          const engine::Engine& eng, CompletionRequest* out) {
  const engine::Tokenizer* tok = eng.tokenizer();
  if (auto e = CheckModel(body, model_id)) return e;

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
    out->gen.prompt = TextPromptTokens(eng, s);
  }

  engine::SamplingParams& p = out->gen.sampling;
  if (auto e = ParseSampling(body, eng, kDefaultMaxTokens, &p)) return e;
  int64_t i64 = 0;
  if (auto e = GetInt(body, "logprobs", 0, 20, &i64)) return e;
  if (Present(body, "logprobs")) p.logprobs = static_cast<int>(i64);
  if (auto e = GetBool(body, "echo", &out->echo)) return e;
  if (auto e = ParseStreamFlags(body, &out->stream, &out->include_usage)) return e;
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

}  // namespace

void Api::Completions(const httplib::Request& req, httplib::Response& res) const {
  const auto arrived = std::chrono::steady_clock::now();
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
  std::shared_ptr<Generation> g =
      StartGeneration(eng, std::move(cr.gen), TenantOf(req), id, arrived, res);
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
