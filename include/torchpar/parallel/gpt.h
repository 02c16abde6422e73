#pragma once
/// Gpt: a GPT-2-architecture decoder (pre-LayerNorm blocks, fused QKV attention, tanh-GELU MLP,
/// tied embedding head) in torch::nn, tensor-parallel by its policy, with a KV cache for
/// incremental decoding.
///
/// Not included by torchpar/torchpar.h (it pulls in torch::nn): include it where it is used.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "torchpar/parallel/state_dict.h"
#include "torchpar/parallel/tensor_parallel_layers.h"
#include "torchpar/parallel/tensor_parallel_policy.h"

namespace torchpar {

/// Shape of a Gpt. Field names are Hugging Face's GPT2Config ones; the defaults are GPT-2
/// small's (124,439,808 parameters).
struct GptConfig {
  int64_t vocab_size = 50257;
  /// Context: the most positions one sequence may have (cached ones included).
  int64_t n_positions = 1024;
  /// Width (hidden size); divisible by n_head.
  int64_t n_embd = 768;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  /// Width of the MLP's hidden layer; 0 means 4 * n_embd.
  int64_t n_inner = 0;
  double layer_norm_epsilon = 1e-5;
  /// Dtype of every parameter and of the computation: float32, bfloat16 (or float16, float64).
  at::ScalarType dtype = at::kFloat;

  /// n_inner, or 4 * n_embd when it is 0.
  int64_t inner_size() const { return n_inner > 0 ? n_inner : 4 * n_embd; }
};

/// GPT-2's policy for a GptConfig: in every block "h.{}.", attn.c_attn is column-sliced with
/// n_fused = 3 (q, k, v), attn.c_proj and mlp.c_proj are row-sliced, mlp.c_fc is
/// column-sliced, all with transposed = true (Conv1D [in, out] weights, as GPT-2's
/// checkpoints store them); attn.embed_dim (n_embd), attn.num_heads (n_head) and
/// mlp.inner_dim (n_inner) shrink per rank. wpe and the LayerNorms are replicated; wte and the
/// tied head are split by vocabulary rows (GptOptions::vocab_parallel) or replicated.
///
/// A checkpoint with nn.Linear [out, in] weights (nanoGPT's layout) loads with the same policy
/// after setting `transposed = false` on its four layers.
/// Source: parallelformers.policies.gpt2.GPT2Policy.
TensorParallelPolicy gpt2_policy(const GptConfig& config);

/// Keys and values of the positions a Gpt has already processed, per layer, for incremental
/// decoding: forward(ids, &cache) attends to them and appends its own.
///
/// Shapes:  keys[l], values[l]: [batch, n_head / world_size, length(), n_embd / n_head] (this
///          rank's heads), in the model's dtype. Every row of the batch has the same length.
/// Safety:  not thread-safe; one cache per sequence batch, used by one model.
struct GptKvCache {
  std::vector<at::Tensor> keys;
  std::vector<at::Tensor> values;

  /// Positions cached (0 for an empty cache).
  int64_t length() const;
  /// Forgets every position (the next forward starts at position 0).
  void clear();
};

/// The KV caches of many sequences of different lengths in one batched layout: what continuous
/// batching decodes with (GptImpl::prefill_rows adds sequences, GptImpl::decode_rows gives every
/// sequence its next position in one forward, remove_row drops one). Rows 0 .. rows() - 1 are
/// the sequences; remove_row moves the last row into the freed one, so the running rows stay
/// contiguous and a step attends over views of the cache, never over copies of it. A sequence
/// that joins or leaves never makes the others recompute anything.
///
/// Shapes:  keys[l], values[l]: [row capacity, n_head / world_size, position capacity,
///          n_embd / n_head] in the model's dtype, zeros where no position is cached; both
///          capacities grow by doubling (positions up to n_positions). lengths[r]: positions
///          cached for row r.
/// Safety:  not thread-safe; one cache per model, used from the model's thread.
/// Source:  the batched KV cache of continuous batching (Orca, OSDI '22; vLLM and llama.cpp's
///          server keep one per running sequence, joined into the batch between steps).
struct GptBatchCache {
  std::vector<at::Tensor> keys;
  std::vector<at::Tensor> values;
  std::vector<int64_t> lengths;

  /// Sequences held.
  int64_t rows() const { return static_cast<int64_t>(lengths.size()); }
  /// Drops row `row`: the last row moves into its place (its cached positions are copied
  /// once), so the row numbers of the others but the last stay.
  /// Errors: ValueError for a row outside [0, rows()).
  void remove_row(int64_t row);
  /// Drops every row and frees the memory.
  void clear();
};

/// How a Gpt is built.
struct GptOptions {
  /// This rank and the collectives of its tensor-parallel group; the default is a single rank
  /// (TP = 1, no group). TensorParallelComm::from_group(world.create_collective_group()).
  TensorParallelComm comm{};
  /// nullopt: gpt2_policy(config). A custom policy may change only how the checkpoint is
  /// laid out (the layers' `transposed` flags); its paths, n_fused and attribute names must be
  /// GPT-2's.
  std::optional<TensorParallelPolicy> policy{};
  /// true: GPT-2's initialisation (normal(0, 0.02) weights, c_proj weights scaled by
  /// 1/sqrt(2 n_layer), zero biases, LayerNorms 1 and 0), drawn from the global generator:
  /// seed every rank alike (torch::manual_seed) so that replicated parameters agree.
  /// false: parameters are uninitialised (at::empty, pages untouched), for load_state_dict
  /// right after: load_gpt does this.
  bool initialize = true;
  /// With world_size > 1: true splits the token embedding (and so the tied head) by rows, as
  /// Megatron-LM's VocabParallelEmbedding and parallel LM head do: rank r holds ids [r * Vp,
  /// min((r + 1) * Vp, vocab_size)) with Vp = ceil(vocab_size / world_size), zero-padded to
  /// Vp rows (wte.weight [Vp, n_embd]); the embedding is looked up locally and summed with an
  /// all_reduce, the head's [.., Vp] logits are all_gathered. For GPT-2 small at TP = 2 this
  /// takes 19.3M of the 38.6M embedding parameters off each rank, and their share of every
  /// token's matmuls. false: every rank holds the whole wte (parallelformers' layout), one
  /// collective fewer per forward. Ignored at world_size 1.
  bool vocab_parallel = true;
};

/// A GPT-2 decoder: token + position embeddings, n_layer pre-LayerNorm blocks (x += attn(ln_1
/// x); x += mlp(ln_2 x)), a final LayerNorm and a head tied to the token embedding. With
/// world_size > 1 each rank holds n_head / world_size heads of every attention and
/// inner_size() / world_size units of every MLP (ColumnParallelLinear c_attn and c_fc,
/// RowParallelLinear c_proj), its part of the vocabulary (GptOptions::vocab_parallel) and a
/// full copy of the rest; every rank computes the same logits.
///
/// Parameters: named as the Python reference and GPT-2 (wte.weight, wpe.weight,
///          h.<i>.ln_1.{weight,bias}, h.<i>.attn.c_attn.{weight,bias}, h.<i>.attn.c_proj...,
///          h.<i>.ln_2..., h.<i>.mlp.c_fc..., h.<i>.mlp.c_proj..., ln_f.{weight,bias}); the
///          projection weights are held in nn.Linear's [out, in] layout and sliced, so their
///          shapes are this rank's (c_attn.weight [3 n_embd / world, n_embd]; with
///          vocab_parallel wte.weight [ceil(vocab_size / world), n_embd]).
/// Errors:  ValueError at construction, naming the block type, attribute and numbers, when
///          n_head, n_embd or n_inner do not divide by the world size; for n_embd not divisible
///          by n_head, a size < 1, or a policy that does not fit GPT-2.
/// Safety:  one forward at a time; with world_size > 1 every rank calls forward with the same
///          shapes, in the same order (they meet in all_reduces), and forward runs without
///          autograd. At world_size 1 it is an ordinary module (trainable).
/// Lifetime: holds the comm (a group handle, shared).
/// Source:  GPT-2 (Radford et al. 2019; Hugging Face GPT2LMHeadModel) as parallelformers
///          parallelizes it; tests/parallel/gpt_reference.py is the outside reference.
class GptImpl : public torch::nn::Module {
 public:
  explicit GptImpl(const GptConfig& config, GptOptions options = {});
  ~GptImpl() override;

  /// Logits of the next token at every position.
  ///
  /// Shapes:  input_ids [batch, tokens] int64, values in [0, vocab_size) -> logits [batch,
  ///          tokens, vocab_size] in the model's dtype. With `cache`, the tokens continue the
  ///          cached positions (positions cache->length() ... + tokens - 1) and the cache
  ///          grows by `tokens`; the logits equal those of a full forward over the whole
  ///          sequence.
  /// Errors:  ValueError for another dtype or rank of input_ids, an id out of range, more than
  ///          n_positions positions in all, or a cache from another model or batch size; the
  ///          comm's errors (RankLostError, TimeoutError) with world_size > 1. After an error
  ///          the cache is unchanged.
  ///
  ///   torchpar::GptKvCache cache;
  ///   auto logits = gpt->forward(prompt, &cache);        // [1, P, V]
  ///   auto next = logits.select(1, -1).argmax(-1, true);  // [1, 1]
  ///   logits = gpt->forward(next, &cache);                // [1, 1, V]
  at::Tensor forward(const at::Tensor& input_ids, GptKvCache* cache = nullptr);

  /// Adds sequences to `cache` (continuous batching): one forward over their prompts, all of
  /// the same length, fills new last rows, in order.
  ///
  /// Shapes:  prompt_ids [k, tokens] int64, k >= 1, 1 <= tokens <= n_positions, ids in [0,
  ///          vocab_size) -> the logits of each one's last position [k, vocab_size]; the new
  ///          rows are cache.rows() - k ... cache.rows() - 1, with lengths = tokens. The logits
  ///          equal forward(prompt_ids)'s last position.
  /// Errors:  as forward; a cache of another model (layers, heads, dtype). After an error the
  ///          cache holds the rows it held.
  at::Tensor prefill_rows(const at::Tensor& prompt_ids, GptBatchCache& cache);

  /// One new position for every row of `cache` in one forward: row r's token `tokens[r]` at
  /// position cache.lengths[r]; then each row's length grows by 1. Rows of different lengths
  /// attend only to their own positions (a mask), so each row's logits are those forward
  /// would give that sequence alone, up to the order of floating-point sums.
  ///
  /// Shapes:  tokens [cache.rows()] int64 in [0, vocab_size) -> logits [cache.rows(),
  ///          vocab_size] in the model's dtype.
  /// Errors:  ValueError for an empty cache, tokens of another shape or dtype, an id out of
  ///          range, or a row already holding n_positions positions (naming it); the comm's
  ///          errors with world_size > 1 (the cache is then unusable: clear() it).
  at::Tensor decode_rows(const at::Tensor& tokens, GptBatchCache& cache);

  /// Copies this rank's shard of a full state dict (the Python reference's names and Conv1D
  /// layout, under the model's policy) into the parameters, converting to the model's dtype.
  /// `full` is consumed entry by entry (see shard_state_dict). strict: every parameter must
  /// be present and every entry used (torch's load_state_dict(strict=True)); false ignores
  /// extra entries (Hugging Face's lm_head.weight, attn.bias masks) and leaves missing
  /// parameters as they are.
  /// Errors:  ValueError naming the entry: missing, unexpected (strict), or of the wrong shape.
  void load_state_dict(StateDict full, bool strict = true);

  const GptConfig& config() const { return config_; }
  const TensorParallelComm& comm() const { return comm_; }
  /// Heads of every attention on this rank (n_head / world_size).
  int64_t heads_per_rank() const { return heads_; }
  /// Parameters on this rank (elements; the tied head counts once; padded vocabulary rows
  /// count). GPT-2 small at TP = 1: 124,439,808; at TP = 2 with vocab_parallel: 62,641,920.
  int64_t num_parameters() const;
  /// True when this rank holds only its part of the vocabulary (vocab_parallel, world_size > 1).
  bool vocab_parallel() const { return vocab_rows_ != config_.vocab_size; }

  struct Block;

 private:
  /// Token + position embeddings: ids [B, T], positions broadcastable to [B, T] -> [B, T, C].
  at::Tensor embed(const at::Tensor& input_ids, const at::Tensor& positions);
  /// The final LayerNorm and the tied head: [B, T, C] -> [B, T, vocab_size].
  at::Tensor head(const at::Tensor& x);
  /// Refuses a cache of another model.
  void check_batch_cache(const GptBatchCache& cache, const char* where) const;
  /// Real (unpadded) vocabulary rows of wte_ on this rank.
  int64_t owned_vocab_rows() const;

  GptConfig config_;
  TensorParallelComm comm_;
  TensorParallelPolicy policy_;
  int64_t heads_ = 0;
  /// Rows of wte_ (Vp, or vocab_size when replicated), and the first id this rank holds.
  int64_t vocab_rows_ = 0;
  int64_t vocab_start_ = 0;
  at::Tensor wte_, wpe_, ln_f_weight_, ln_f_bias_;
  std::vector<std::shared_ptr<Block>> blocks_;
};
TORCH_MODULE(Gpt);

/// Builds rank options.comm.rank's Gpt and loads its shard of `full` (load_state_dict with
/// strict): the parameters are allocated but never initialised, and each full tensor is
/// sliced as it is copied, so a rank's peak is about its shard plus the replicated tensors
/// (with `full` from load_state_dict_file, which maps the file instead of reading it).
///
/// Errors: as the GptImpl constructor and load_state_dict. Source: parallelformers'
/// parallelize() of a from_pretrained model, one rank's part.
///
///   auto full = torchpar::load_state_dict_file("gpt2/state_dict.pt");
///   auto comm = torchpar::TensorParallelComm::from_group(world.create_collective_group());
///   torchpar::Gpt gpt = torchpar::load_gpt(torchpar::GptConfig{}, std::move(full), {.comm =
///   comm});
Gpt load_gpt(const GptConfig& config, StateDict full, GptOptions options = {});

}  // namespace torchpar
