#pragma once
// What the TensorParallel engine and its workers exchange: the worker's start specification
// (a Process argument, so it crosses exec for spawn) and the request / response messages of
// their queues. Private to src/parallel/.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "torchpar/core/auth.h"
#include "torchpar/ipc/queue.h"
#include "torchpar/parallel/tensor_parallel.h"

namespace torchpar {

// cereal needs these for TpWorkerSpec::policy; found by ADL.
template <class Archive>
void serialize(Archive& ar, TensorParallelLayer& l) {
  ar(l.weight, l.bias, l.n_fused, l.transposed, l.ignore_checker);
}
template <class Archive>
void serialize(Archive& ar, TensorParallelArgument& a) {
  ar(a.name, a.value);
}
template <class Archive>
void serialize(Archive& ar, TensorParallelPolicy& p) {
  ar(p.block_type, p.block_pattern, p.attn_qkv, p.attn_out, p.mlp_in, p.mlp_out,
     p.replace_arguments);
}

namespace detail {

/// Where a worker's model comes from.
enum class TpSource : int32_t { kGptFile = 1, kRegistered = 2, kFactory = 3 };

/// Everything a worker needs to start (all but a TensorParallelFactory, which only a forked
/// worker gets, through its closure).
struct TpWorkerSpec {
  int32_t world_size = 1;
  int32_t source = 0;  // TpSource
  // kGptFile: the state dict file, the config (without dtype) and the policy.
  std::string path;
  int64_t vocab_size = 0, n_positions = 0, n_embd = 0, n_layer = 0, n_head = 0, n_inner = 0;
  double layer_norm_epsilon = 1e-5;
  bool has_policy = false;
  TensorParallelPolicy policy;
  bool vocab_parallel = true;
  // kRegistered
  std::string model_name;
  std::string model_argument;
  // every source
  int8_t dtype = static_cast<int8_t>(at::kFloat);
  int32_t backend = 0;  // Backend
  int32_t master_port = 0;
  AuthKey authkey;
  double timeout_s = 300;
  bool has_seed = false;
  uint64_t seed = 0;

  GptConfig gpt_config() const;
  void set_gpt_config(const GptConfig& c);

  template <class Archive>
  void serialize(Archive& ar) {
    ar(world_size, source, path, vocab_size, n_positions, n_embd, n_layer, n_head, n_inner,
       layer_norm_epsilon, has_policy, policy, vocab_parallel, model_name, model_argument, dtype,
       backend, master_port, authkey, timeout_s, has_seed, seed);
  }
};

enum class TpRequestKind : int32_t { kForward = 1, kGenerate = 2, kStop = 3, kStep = 4 };

/// A sequence joining the running batch (kStep): its prompt is input_ids[0, offset ..
/// offset + length).
struct TpJoin {
  int64_t id = 0;
  int64_t length = 0;
  double temperature = 1.0;
  int64_t top_k = 0;
  bool greedy = false;
  bool has_seed = false;
  uint64_t seed = 0;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(id, length, temperature, top_k, greedy, has_seed, seed);
  }
};

/// One call, sent to every rank alike.
struct TpRequest {
  uint64_t id = 0;
  int32_t kind = 0;  // TpRequestKind
  at::Tensor input_ids;
  int64_t max_new_tokens = 0;
  double temperature = 1.0;
  int64_t top_k = 0;
  bool greedy = false;
  bool has_seed = false;
  uint64_t seed = 0;
  /// kStep: the sequences that leave the batch first, then those that join it (their prompts
  /// concatenated in join_tokens). Plain vectors: a step's few bytes travel inline, not as a
  /// shared-memory tensor.
  std::vector<int64_t> leave;
  std::vector<TpJoin> join;
  std::vector<int64_t> join_tokens;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(id, kind, input_ids, max_new_tokens, temperature, top_k, greedy, has_seed, seed, leave, join,
       join_tokens);
  }
};

/// A rank's answer to request `id` (id 0: the worker is ready, or failed to start).
struct TpResponse {
  uint64_t id = 0;
  int32_t rank = 0;
  bool ok = false;
  /// Rank 0's result (logits or tokens); undefined from the other ranks.
  at::Tensor result;
  /// Rank 0's answer to kStep: (sequence id, token) pairs.
  std::vector<int64_t> values;
  /// The ready answer: the seed every rank agreed on.
  uint64_t seed = 0;
  /// !ok: the exception's type name and message.
  std::string type;
  std::string message;
  /// !ok: the rank failed because a peer did (RankLostError, a collective's TimeoutError):
  /// the peer, not this rank, is the one to name.
  bool secondary = false;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(id, rank, ok, result, values, seed, type, message, secondary);
  }
};

/// A worker process's body: starts, reports ready (or its failure) on `out`, then serves
/// `in` until a stop request, a closed queue, or its parent's death. A failure is reported on
/// `out` and rethrown (the process ends with it). `factory` is used for kFactory only (fork).
void run_tensor_parallel_worker(int rank, const TpWorkerSpec& spec, Queue<TpRequest>& in,
                                Queue<TpResponse>& out, const TensorParallelFactory* factory);

/// The Process target for every start method (spawnable: a free function of serializable
/// arguments).
void tensor_parallel_worker(int rank, TpWorkerSpec spec, Queue<TpRequest> in,
                            Queue<TpResponse> out);

/// The factory registered as `name` in this process, or an empty function.
TensorParallelFactory find_tensor_parallel_model(const std::string& name);

}  // namespace detail
}  // namespace torchpar
