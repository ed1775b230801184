// The CPU forward pass of DeepSeek-V4.1-Flash: prefill (many tokens) and decode (one token) for
// sequences at any position, with all per-sequence state in SequenceState.
//
// Numerics follow the reference implementation: activations are rounded to BF16 between ops,
// norms, gates, mHC mixes and softmaxes run in FP32, every FP8/FP4 linear quantizes its input to
// FP8 per 32, the window KV is kept as FP8 with a UE8M0 scale per 32, compressed KV as FP4 with
// an E4M3 scale per 16, and index keys as FP4 with a UE8M0 scale per 32. Every per-token result
// depends only on that token and the state before it, so one prefill, any chunking, and token by
// token decoding give bit-identical results; so do a batch and each sequence alone.
//
// Thread-safety: a CpuForward's weights and configuration never change after Create(); its KV
// pool does (allocation and reference counts), so forward calls, NewSequence, Restore and ResumeAt
// belong to one thread (the engine's). One SequenceState must not be used by two calls at once.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "config/status.h"
#include "engine/backend.h"
#include "engine/engram.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "engine/sequence_state.h"
#include "kernels/ops.h"

namespace flashd::engine {

class EngramStore;

// What a forward call can report besides logits, for tests against the reference.
struct ForwardTrace {
  // For each index-source layer and token: the compressed positions selected (ascending).
  struct Selection {
    int layer;
    int64_t position;
    std::vector<int64_t> entries;
  };
  std::vector<Selection> selections;
  std::vector<std::vector<int64_t>> engram_rows;  // Per token: rows of every Engram layer.
  // When record_streams is set: the residual streams after every layer, [tokens, hc, dim].
  bool record_streams = false;
  std::vector<std::vector<float>> streams;
  // With record_streams: each layer's attention input and output, FFN input and output,
  // [tokens, dim] each, in that order.
  std::vector<std::vector<float>> sublayers;
};

struct ForwardOptions {
  bool all_logits = false;  // Logits for every token, or only the last.
  int threads = 0;          // 0: all cores.
  ForwardTrace* trace = nullptr;
  // Layer-by-layer replay of another implementation's run: when set, the residual stream
  // entering layer l (l >= 1), and the final one, are taken from forced_streams
  // [tokens, layers, hc, dim] (the stream each layer produced there) instead of from this
  // model's previous layer. Each layer is then compared on identical inputs, which keeps one
  // rounding difference from compounding through the rest of the stack.
  const float* forced_streams = nullptr;
  // The decoder bounded replay (off with 0): layers after the last KV source run only on the
  // last max(replay_tokens, sliding_window) tokens of each sequence in the call. Earlier prompt
  // tokens reach those layers only through their window rings, which then start at the replay.
  // An approximation, measured in docs/benchmarks.md; needs all_logits off.
  int64_t replay_tokens = 0;
  // How the indexer, the candidate filter and the router order equal scores. The total order
  // (value, then index) is what every backend reproduces; the golden test selects the
  // reference's own order, which its data was made with.
  kernels::TopKOrder topk_order = kernels::TopKOrder::kTotal;
};

// Where each part of the model runs, for several backends in one forward pass: a layer split
// across devices, or the routed experts on another backend than their layer (the CPU beside one
// GPU). Activations cross between backends through the forward pass's host state.
struct Placement {
  std::vector<std::unique_ptr<Backend>> backends;  // At least one.
  std::vector<int> layer_backend;                  // Per layer, an index into backends; empty:
                                                   // every layer on backends[0].
  int routed_experts = -1;                         // The routed experts' backend; -1: the layer's.
};

// One sequence's part of a batched call.
struct BatchItem {
  SequenceState* state;
  std::span<const int32_t> tokens;
  std::vector<float>* logits;
  // When set, a sequence whose KV blocks do not fit in the pool is left out of the step with its
  // reason here (its state unchanged) while the others run; when null, it fails the whole call.
  Status* status = nullptr;
  bool all_logits = false;  // Logits for every token of this item (as ForwardOptions').
  // Speculative verification: called with the item's logits (every token's) once the step has
  // run, before anything is committed; returns how many of the tokens the sequence keeps (0 to
  // all). The sequence then ends exactly as if it had run only those. At most sliding_window
  // tokens.
  std::function<int64_t(std::span<const float> logits)> accept = nullptr;
};

// One sequence's part of a DSpark draft call (CpuForward::Draft).
struct DraftItem {
  const SequenceState* state = nullptr;  // At position >= 1, with the drafter's rings.
  int32_t token = -1;                    // The token at state->position: sampled, not run.
  // Picks drafted token i + 1 from the draft logits of block position i (vocab-sized, the
  // Markov head's bias included); the logits of block position i + 1 depend on that choice.
  std::function<int32_t(int64_t i, std::span<const float> logits)> pick = nullptr;
  std::vector<int32_t>* drafted = nullptr;   // The picks, up to a block.
  std::vector<float>* confidence = nullptr;  // The confidence head's logit that each drafted
                                             // token is accepted.
  // Drafting stops after `limit` tokens (0: a whole block), and before a position whose
  // confidence is below min_confidence (the first position is always drafted). The stages run
  // over the whole block either way; the head runs only for the positions drafted.
  int64_t limit = 0;
  float min_confidence = -std::numeric_limits<float>::infinity();
};

class CpuForward {
 public:
  // Prepares the model's weights for the CPU (decodes BF16 matrices, keeps FP8/FP4 mapped).
  // `tokenizer_json` is needed for Engram; "" means the model directory's own tokenizer.json.
  // `block_tokens` is the KV pool's block, which is also the prefix cache's block. Every op runs
  // on `backend` (null: the CPU's).
  static StatusOr<std::unique_ptr<CpuForward>> Create(const Model& model,
                                                      const std::string& tokenizer_json = "",
                                                      int64_t block_tokens = 64,
                                                      std::unique_ptr<Backend> backend = nullptr);
  // The same with the model spread over several backends. The embedding runs on backends[0],
  // the final norm and the head on the last layer's backend.
  static StatusOr<std::unique_ptr<CpuForward>> Create(const Model& model,
                                                      const std::string& tokenizer_json,
                                                      int64_t block_tokens, Placement placement);
  int64_t block_tokens() const;
  ~CpuForward();

  const ModelConfig& config() const;
  SequenceState NewSequence() const;
  // Reads a snapshot written by SequenceState::Serialize into this model's pool. A snapshot
  // written without its first blocks needs them in `leading_blocks`: pool blocks holding their
  // bytes, whose one reference each the state takes over (also on failure).
  StatusOr<SequenceState> Restore(std::string_view snapshot,
                                  std::vector<int32_t> leading_blocks = {}) const;
  // A sequence at `position` (a multiple of 64) whose compressed KV for every earlier position is
  // already in `blocks` (taken over as above) but whose bounded state is unknown: its window
  // rings start empty and `tokens_before` (the whole prefix, or at least its last few tokens)
  // give the Engram history. Running the ExactReplayTokens() tokens before the blocks' end
  // again from such a state rebuilds the bounded state bit for bit (frozen_tokens keeps the
  // replay from touching the restored entries); what it yields before that point is not exact.
  StatusOr<SequenceState> ResumeAt(int64_t position, std::span<const int32_t> tokens_before,
                                   std::vector<int32_t> blocks) const;
  // Tokens a replay needs: each layer's window reaches sliding_window - 1 tokens back, so after
  // layers x (window - 1) tokens every layer's state is exact; rounded up to whole blocks.
  int64_t ExactReplayTokens() const;
  // The pool new sequences take their KV blocks from (unbounded until a capacity is set).
  const std::shared_ptr<KvPool>& pool() const;
  // Engram rows from `store` (one table per Engram layer, in order) instead of the mapped
  // tables; null goes back to the tables. Between forward calls only. With `read_ahead` a step
  // asks for every Engram layer's rows when it starts (one thread reads them in layer order
  // while the layers before each compute); without, each layer reads its rows when reached.
  Status SetEngramStore(std::shared_ptr<EngramStore> store, bool read_ahead = true);
  const EngramStore* engram_store() const;

  // Appends `tokens` to the sequence and writes vocab-sized fp32 logits for the last token, or
  // for every token with options.all_logits. A call that fails leaves the sequence as it was.
  Status Forward(SequenceState* state, std::span<const int32_t> tokens, std::vector<float>* logits,
                 const ForwardOptions& options = {}) const;

  // Several sequences in one call: row-wise work (projections, experts, head) runs over all
  // their tokens together; each sequence's results equal those of running it alone.
  // REQUIRES: distinct states.
  Status ForwardBatch(std::span<BatchItem> items, const ForwardOptions& options = {}) const;

  // DSpark speculative decoding. EnableDSpark loads the drafter (the checkpoint's mtp.* stages);
  // from then on new sequences carry its window rings and every forward call fills them, so
  // Draft can run after any call. Fails when the checkpoint has no complete drafter.
  Status EnableDSpark();
  bool dspark() const;
  int dspark_block() const;  // Tokens per draft block.
  // Drafts a block after each item's pending token: the DSpark stages over the block [token,
  // noise, ...], the model's head, then position by position the Markov head's bias and the
  // pick. Changes no state; each item's result depends on that item alone.
  Status Draft(std::span<DraftItem> items, const ForwardOptions& options = {}) const;

  // Places every weight the ops will be given on the backend that runs them (Backend::Upload),
  // before the first step needs it: on a GPU the uploads a first request would otherwise wait
  // for. The pages of the next weights are asked for (madvise) while one uploads, so reading
  // the checkpoint overlaps the copies. `progress` hears of the weight bytes done and in all.
  // Call after EnableDSpark when the drafter is wanted; backends that read weights in place
  // (the CPU) are skipped.
  Status UploadWeights(
      const std::function<void(uint64_t done, uint64_t total)>& progress = nullptr) const;

  // The compressed Engram vocabulary's class count (99,092 for the released tokenizer).
  int64_t engram_classes() const;

  // The backend and the version of its numerics, part of every prefix-cache key: KV written by
  // one backend is resumed bit for bit only by a backend with the same numerics. Bump when any
  // op's results change in their last bits.
  std::string_view numerics() const;
  // The backend the embedding runs on (the only one without a Placement).
  const Backend& backend() const;

  struct Impl;  // Opaque: the prepared weights and the pool.

 private:
  explicit CpuForward(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashd::engine
