#pragma once
/// TensorParallel: a tensor-parallel inference engine (parallelformers' parallelize() and
/// ParallelProcess). One worker process per rank holds its shard of the model; the ranks
/// meet in a CollectiveGroup; the caller's process only sends requests and receives results.
///
///   torchpar::TensorParallel tp("runs/gpt/model.pt", {.world_size = 2});
///   at::Tensor logits = tp.forward(ids);                        // [B, T, V]
///   at::Tensor out = tp.generate(ids, {.max_new_tokens = 64});  // [B, T + 64]
///   tp.shutdown();                                              // or let the destructor do it
///
/// Not included by torchpar/torchpar.h (it pulls in torch::nn through gpt.h).
/// docs/inference.md: the model file contract, the error semantics, what differs from
/// parallelformers.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torchpar/core/timeout.h"
#include "torchpar/dist/collective_group.h"
#include "torchpar/parallel/gpt.h"
#include "torchpar/parallel/tensor_parallel_layers.h"
#include "torchpar/parallel/tensor_parallel_policy.h"
#include "torchpar/process/start_method.h"

namespace torchpar {

// ---- custom models ------------------------------------------------------------------------------

/// One rank's shard of a model that a TensorParallel worker runs (what a factory returns).
/// TensorParallel builds a Gpt from a state dict file itself; implement this for any other
/// model, built from TensorParallelComm-aware layers (ColumnParallelLinear,
/// RowParallelLinear) so that every rank computes the same logits.
///
/// Safety: called from the worker's one thread; every rank gets the same calls in the same
///         order, with the same inputs (they meet in the collectives).
class TensorParallelModel {
 public:
  virtual ~TensorParallelModel() = default;
  /// Logits of the next token at every position: input_ids [batch, tokens] int64 ->
  /// [batch, tokens, vocab], the same on every rank (any floating dtype). With `cache`
  /// (generate), the tokens continue the positions already in it and the model appends
  /// theirs, as Gpt::forward does; nullptr for a plain forward. Runs under NoGradGuard.
  /// Errors: anything it throws reaches the caller as WorkerError naming the rank.
  virtual at::Tensor forward(const at::Tensor& input_ids, GptKvCache* cache) = 0;
  /// false: the model ignores `cache`, and generate feeds it the whole sequence at every
  /// step (quadratic, but right) instead of the newest token.
  virtual bool uses_cache() const { return true; }
};

/// A Gpt as a TensorParallelModel: what a factory returns for a Gpt it built (load_gpt with
/// ctx.comm), instead of a hand-written wrapper. Puts the model in eval mode.
/// Safety: as TensorParallelModel (the worker's one thread).
class GptTensorParallelModel final : public TensorParallelModel {
 public:
  explicit GptTensorParallelModel(Gpt gpt);
  /// Gpt::forward (shapes, errors: GptImpl::forward).
  at::Tensor forward(const at::Tensor& input_ids, GptKvCache* cache) override;
  const Gpt& gpt() const { return gpt_; }

 private:
  Gpt gpt_;
};

/// What a factory gets in a worker.
struct TensorParallelContext {
  /// This worker's rank and the group's communication (from_group of its CollectiveGroup;
  /// world_size 1: no collectives).
  TensorParallelComm comm{};
  /// TensorParallelOptions::dtype: build the parameters in it.
  at::ScalarType dtype = at::kFloat;
  /// The argument given with a registered name (TensorParallelModelName::argument): a path,
  /// a JSON string, ...; empty for an unregistered factory.
  std::string argument{};
};

/// Builds one rank's shard. Runs in the worker, once, before the worker reports ready.
using TensorParallelFactory =
    std::function<std::shared_ptr<TensorParallelModel>(const TensorParallelContext& context)>;

/// Registers `factory` under `name` in this process, replacing an earlier registration, and
/// returns true, so that it can initialise a static at namespace scope. Workers look the name
/// up in their own process: register at namespace scope (a static runs in every process of the
/// binary: forked, spawned and forkserver workers) or in main() before torchpar::init.
///
///   static const bool kRegistered = torchpar::register_tensor_parallel_model(
///       "my_model", [](const torchpar::TensorParallelContext& ctx) {
///         return std::make_shared<MyModel>(ctx.comm, ctx.dtype, ctx.argument);
///       });
///
/// Errors: ValueError for an empty name or an empty factory. Safety: thread-safe.
/// Source: machin's registered functions; functions travel by name, never by address.
bool register_tensor_parallel_model(const std::string& name, TensorParallelFactory factory);

/// A model registered with register_tensor_parallel_model, and the argument its factory gets.
struct TensorParallelModelName {
  std::string name;
  std::string argument{};
};

/// A factory that gives each rank its shard of `model`, a single-rank Gpt held in this
/// process (trained or loaded here): the workers, forked, read the parameters in place
/// (copy-on-write, no file), each copies its shard in TensorParallelOptions::dtype, and `model`
/// is not changed. `vocab_parallel` as TensorParallelOptions::vocab_parallel. The parameters
/// are taken when the factory is made: later training of `model` is not seen by it.
/// Errors: ValueError for a Gpt with world_size > 1 (a shard is not a whole model); the
///         workers' errors as load_gpt (a world size that does not divide n_head ...).
/// Source: parallelformers.parallelize(model, num_gpus) on a model object in memory.
TensorParallelFactory gpt_tensor_parallel_factory(GptImpl& model, bool vocab_parallel = true);

// ---- the engine ---------------------------------------------------------------------------------

/// Options of a TensorParallel engine.
struct TensorParallelOptions {
  /// Worker processes, one per rank (parallelformers' num_gpus). The model's heads, width and
  /// MLP width must divide by it.
  int world_size = 1;
  /// The Gpt's policy (how the checkpoint is laid out; see GptOptions::policy). nullopt: the
  /// sidecar's weight_layout (TensorParallel(path)), or gpt2_policy(config). Ignored for
  /// factories.
  std::optional<TensorParallelPolicy> policy{};
  /// Dtype of the weights and the computation in the workers: float32, bfloat16 (half the
  /// memory per rank; logits come back in bfloat16), float64; float16 only where LibTorch's CPU
  /// kernels have it (LibTorch 1.13's do not: ValueError at construction).
  at::ScalarType dtype = at::kFloat;
  /// How workers start; nullopt: get_start_method() ("spawn" unless set), or "fork" for a
  /// TensorParallelFactory (which cannot cross exec). spawn and forkserver need
  /// torchpar::init(argc, argv) first thing in main.
  std::optional<StartMethod> start_method{};
  /// Seconds. The limit of starting (rendezvous and loading the shards), the default limit of
  /// each call, and the workers' collective timeout (a rank that stops answering). Finite,
  /// > 0 and at most 1e7 s (about 115 days; a later deadline would overflow steady_clock):
  /// ValueError otherwise, also for a call's own timeout.
  std::chrono::duration<double> timeout = std::chrono::seconds(300);
  /// The group's backend: kAuto (shm, as every worker is on this host), kShm, kGloo (TCP on
  /// loopback; it reduces no bfloat16).
  Backend backend = Backend::kAuto;
  /// LibTorch intra-op threads per worker; 0: cores / world_size (at least 1) with spawn and
  /// forkserver, 1 with fork (thread pools do not survive a fork).
  int threads_per_worker = 0;
  /// Gpt only (ignored for custom models): split the token embedding and the tied head by
  /// vocabulary rows across the ranks, as Megatron-LM does (GptOptions::vocab_parallel); false
  /// replicates them on every rank, as parallelformers does (more memory per rank, and every
  /// rank computes the whole head).
  bool vocab_parallel = true;
  /// Seed of sampling. nullopt: rank 0 draws one (std::random_device). Either way rank 0
  /// broadcasts it at start and every rank seeds LibTorch's global generator with it, so a
  /// custom model's own randomness agrees across ranks too. seed() returns it.
  std::optional<uint64_t> seed{};
};

/// Options of TensorParallel::forward.
struct ForwardOptions {
  /// This call's limit (seconds); nullopt: TensorParallelOptions::timeout.
  Timeout timeout = std::nullopt;
};

/// Options of TensorParallel::generate (Hugging Face's generate arguments, by their names).
struct GenerateOptions {
  /// Tokens appended to every row.
  int64_t max_new_tokens = 32;
  /// Divides the logits before the softmax: finite and >= 0; 0 means greedy. Any positive
  /// value is safe: the largest logit is subtracted first, so a tiny temperature (1e-300)
  /// samples the likeliest token (greedy in effect) instead of overflowing to inf / NaN.
  double temperature = 1.0;
  /// Sample among the top_k likeliest tokens only; 0: among all.
  int64_t top_k = 0;
  /// true: the likeliest token every step (temperature and top_k unused).
  bool greedy = false;
  /// Reseeds the sampling generator for this call (reproducible output); nullopt: the
  /// engine's generator goes on from where the last call left it.
  std::optional<uint64_t> seed{};
  /// This call's limit (seconds); nullopt: TensorParallelOptions::timeout.
  Timeout timeout = std::nullopt;
};

/// A sequence that joins the running batch of TensorParallel::step (continuous batching).
struct StepJoin {
  /// The caller's name for it: unique among the running sequences; leave names it.
  int64_t id = 0;
  /// Its prompt: [tokens] or [1, tokens] int64, tokens >= 1, ids in the vocabulary.
  at::Tensor prompt_ids;
  /// How its tokens are picked (GenerateOptions' fields: 0 means greedy; top_k 0: all).
  double temperature = 1.0;
  int64_t top_k = 0;
  bool greedy = false;
  /// Its own sampling generator, seeded: the tokens are those generate({prompt}, {.seed})
  /// gives on a fresh engine, whatever else runs in the batch. nullopt: the engine's
  /// generator (the draws then depend on the other sequences).
  std::optional<uint64_t> seed{};
};

/// What one TensorParallel::step produced: the next token of every running sequence, in the
/// order the workers hold them (those running before the step, then the joined ones).
struct StepResult {
  std::vector<int64_t> ids;
  std::vector<int64_t> tokens;
};

/// Options of TensorParallel::step.
struct StepOptions {
  /// This call's limit (seconds); nullopt: TensorParallelOptions::timeout.
  Timeout timeout = std::nullopt;
};

/// A model split across `world_size` worker processes (tensor parallelism, Megatron-style:
/// attention heads and MLP units divided among ranks, one all_reduce after each block's two
/// row-parallel projections), driven from the calling process.
///
/// Start (the constructor): starts one worker per rank (torchpar Process, daemon, dying with
/// this process), each with its own input and output Queue. Workers join a World on a
/// private rendezvous (rank 0's store on 127.0.0.1, a fresh random key per engine, never in
/// the environment) and a CollectiveGroup (options.backend), set their intra-op threads,
/// agree on the seed (rank 0 broadcasts it), build their shard, and report ready. The
/// constructor returns when every rank is ready.
///
/// Calls: each call sends one request to every rank; every rank runs the same forward calls
/// (they meet in all_reduces); rank 0 sends the result, the others an acknowledgement.
/// generate keeps a KV cache in each worker; rank 0 samples each next token and broadcasts it,
/// so the ranks never disagree on a token (even if their logits differed in the last bit).
/// The caller waits with the call's deadline while watching every worker: a worker's
/// exception or death fails the call at once (within ~20 ms of the death), never a hang.
///
/// Errors (all calls):
///   ValueError   bad arguments (shape, dtype, ids outside the vocabulary, more positions than
///                the model has, a bad option); nothing was sent, the engine goes on.
///   WorkerError  a worker raised (rank, type, message), or died (rank, exit code / signal).
///                A worker that fails because a peer died (RankLostError) is not blamed: the
///                dead peer is named.
///   TimeoutError the call's timeout passed without every rank's answer.
///   ClosedError  after shutdown().
/// After a WorkerError or TimeoutError the engine is broken: its workers were killed and
/// reaped before the error was thrown, and every later call raises the same error at once.
/// Create a new engine to go on.
/// Safety:  thread-safe: calls from several threads run one at a time (a mutex).
/// Lifetime: shutdown() or the destructor stops the workers: a stop request, up to the
///          timeout to exit, then SIGTERM, then SIGKILL; no worker outlives either. Workers
///          also die with this process (PR_SET_PDEATHSIG) and exit when it is gone.
/// Source:  parallelformers.parallelize / ParallelProcess (its issues #16, #19 and #24: a dead
///          worker hangs the caller there), Megatron-LM tensor parallelism.
class TensorParallel {
 public:
  /// A GPT checkpoint: `model_path` (model.pt, a state dict file) and its sidecar model.json
  /// (load_gpt_checkpoint_info: the GptConfig and the weight layout). Each rank maps the file
  /// and copies only its shard (load_state_dict_file, load_gpt).
  /// Errors: as load_gpt_checkpoint_info (in this process, before any worker starts); then as
  /// the other constructor.
  explicit TensorParallel(const std::string& model_path, TensorParallelOptions options = {});
  /// A state dict file and its GptConfig (config.dtype is replaced by options.dtype).
  ///
  /// Errors:  ValueError for a world size < 1 or that does not divide n_head, n_embd or
  ///          n_inner (naming them), a missing file, float16 without CPU kernels (naming the
  ///          op), bfloat16 with gloo; WorkerError when a worker fails to start (a file it
  ///          cannot read, a shard that does not fit: the worker's message) or dies;
  ///          TimeoutError when the workers are not ready within options.timeout. Every worker
  ///          started is killed and reaped before it throws.
  TensorParallel(const std::string& state_dict_path, const GptConfig& config,
                 TensorParallelOptions options = {});
  /// A model registered by name (register_tensor_parallel_model): any start method.
  explicit TensorParallel(const TensorParallelModelName& model, TensorParallelOptions options = {});
  /// A single-rank Gpt in this process, split across the workers without a file:
  /// TensorParallel(gpt_tensor_parallel_factory(model, options.vocab_parallel), options), so
  /// the "fork" start method (the default here; another: ValueError naming
  /// save_gpt_checkpoint and the path constructor, which every start method takes).
  ///
  ///   torchpar::Gpt gpt(config);  /* ... train ... */
  ///   torchpar::TensorParallel tp(*gpt, {.world_size = 2});
  explicit TensorParallel(GptImpl& model, TensorParallelOptions options = {});
  /// A factory called in each worker: needs the "fork" start method (a std::function cannot
  /// cross exec; register it by name for spawn). Errors: ValueError for another start method.
  explicit TensorParallel(TensorParallelFactory factory, TensorParallelOptions options = {});

  TensorParallel(TensorParallel&&) noexcept;
  TensorParallel& operator=(TensorParallel&&) noexcept;
  /// shutdown(10 s), errors swallowed: never throws, leaves no worker.
  ~TensorParallel();

  /// Logits of every position.
  ///
  /// Shapes:  input_ids [batch, tokens] int64 (CPU), ids in [0, vocab_size) -> [batch, tokens,
  ///          vocab_size] in options.dtype, in shared memory (aliasing rank 0's result).
  /// Units:   options.timeout: seconds for the whole call.
  /// Errors, Safety: see the class.
  /// Source:  a parallelized Hugging Face model's forward() in parallelformers.
  ///
  ///   auto logits = tp.forward(torch::tensor({{464, 2068}}, torch::kLong));
  at::Tensor forward(const at::Tensor& input_ids, const ForwardOptions& options = {});

  /// Continues every row of `prompt_ids` by max_new_tokens tokens: one forward over the prompt
  /// fills each worker's KV cache, then one forward per new token (greedy: argmax; otherwise
  /// softmax(logits / temperature) over the top_k likeliest, sampled on rank 0 from the
  /// engine's generator and broadcast).
  ///
  /// Shapes:  prompt_ids [batch, tokens] int64 (tokens >= 1) -> [batch, tokens +
  ///          max_new_tokens] int64: the prompt, then the new tokens. tokens + max_new_tokens
  ///          must not exceed the model's n_positions (Gpt; custom models check their own).
  /// Units:   options.timeout: seconds for the whole call. Tokens per second are the caller's
  ///          to measure: batch * max_new_tokens / the call's wall time.
  /// Errors:  ValueError for max_new_tokens < 0, a temperature < 0 or not finite (NaN, inf),
  ///          top_k < 0, a timeout that is not finite, <= 0 or above 1e7 s; see the class.
  /// Source:  Hugging Face generate() (max_new_tokens, temperature, top_k, do_sample = !greedy)
  ///          on a parallelformers model.
  at::Tensor generate(const at::Tensor& prompt_ids, const GenerateOptions& options = {});

  /// One step of continuous batching: the sequences in `leave` leave the running batch,
  /// every sequence still running gets its next token (for a Gpt: one batched forward over a
  /// per-sequence KV cache in a batched layout, GptBatchCache; nothing is recomputed when a
  /// sequence joins or leaves), and each sequence of `join` is prefilled with its prompt and
  /// gets its first new token. Rank 0 samples every token with the sequence's own options and
  /// broadcasts them. A sequence runs until the caller names it in `leave` (at max tokens, a
  /// stop string, a client gone): its cache stays in the workers until then.
  ///
  ///   auto r = tp.step({{.id = 7, .prompt_ids = prompt, .temperature = 0}}, {});
  ///   // r.ids = {7}, r.tokens = {first token}; next: tp.step({}, {}) -> its second token
  ///
  /// Shapes:  StepJoin::prompt_ids [tokens] or [1, tokens] int64. A Gpt sequence holds its
  ///          prompt's positions plus one per step after the first; it cannot continue at the
  ///          model's n_positions (ValueError: leave it).
  /// Units:   options.timeout: seconds for the step.
  /// Errors:  ValueError (nothing sent, the engine goes on) for a leave id that is not
  ///          running, a join id already running (after the leaves) or given twice, a bad
  ///          prompt (shape, dtype, ids outside the vocabulary, longer than n_positions), bad
  ///          sampling options, a running sequence at n_positions; the rest as the class
  ///          (WorkerError, TimeoutError, ClosedError). With no sequence running, joining or
  ///          leaving it returns an empty result without calling the workers.
  /// Safety:  as the class (one call at a time); one batch per engine: generate and forward
  ///          between steps run beside it and leave it as it is.
  /// Source:  continuous batching (Orca, OSDI '22; vLLM, llama.cpp's server,
  ///          text-generation-inference): sequences join and leave between decoding steps.
  StepResult step(const std::vector<StepJoin>& join, const std::vector<int64_t>& leave,
                  const StepOptions& options = {});

  /// The sequences step() is running, by id, with the positions each holds in the workers'
  /// caches (its prompt, plus one per step after the first).
  std::vector<std::pair<int64_t, int64_t>> running() const;

  /// Stops the workers (parallelformers' deparallelize): a stop request to each, up to
  /// `timeout` for all to exit, then SIGTERM, then SIGKILL to the rest; all are reaped. Always
  /// returns (within timeout + about 6 s, after a call running on another thread ended; a
  /// timeout above 1e7 s counts as 1e7 s, NaN or negative as 0) and
  /// leaves no worker process. A second call does nothing; later calls raise ClosedError.
  /// Never throws.
  void shutdown(std::chrono::duration<double> timeout = std::chrono::seconds(10)) noexcept;

  int world_size() const;
  /// The sampling seed rank 0 broadcast at start.
  uint64_t seed() const;
  /// The workers' process ids, by rank (for monitoring; they may have exited).
  std::vector<int> pids() const;
  /// True until shutdown() and until a call broke the engine.
  bool is_alive() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace torchpar
