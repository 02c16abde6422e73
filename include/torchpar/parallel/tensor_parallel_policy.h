#pragma once
/// Tensor-parallel policies (parallelformers' Policy and Layer): which parameters of a block
/// type are column-sliced, row-sliced or fused, which attributes shrink per rank, and
/// shard_state_dict, which applies policies to a full state dict for one rank.
///
/// Custom policies are user structs: fill a TensorParallelPolicy (parallelformers'
/// custom_policies) for your block type and pass it, alone or with others, to
/// shard_state_dict; build the model's blocks from ColumnParallelLinear / RowParallelLinear
/// with the per-rank attributes of arguments_per_rank.
///
///   torchpar::TensorParallelPolicy encoder{
///       .block_type = "EncoderLayer",
///       .block_pattern = "encoder.layers.{}.",
///       .attn_qkv = {{.weight = "self_attn.q.weight", .bias = "self_attn.q.bias"},
///                    {.weight = "self_attn.k.weight", .bias = "self_attn.k.bias"},
///                    {.weight = "self_attn.v.weight", .bias = "self_attn.v.bias"}},
///       .attn_out = {{.weight = "self_attn.out.weight", .bias = "self_attn.out.bias"}},
///       .mlp_in = {{.weight = "fc1.weight", .bias = "fc1.bias"}},
///       .mlp_out = {{.weight = "fc2.weight", .bias = "fc2.bias"}},
///       .replace_arguments = {{"self_attn.num_heads", 16}, {"self_attn.embed_dim", 1024}}};
///   auto shard = torchpar::shard_state_dict(std::move(full), {encoder}, rank, world_size);

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "torchpar/parallel/state_dict.h"

namespace torchpar {

/// One projection of a block (parallelformers' Layer). Paths are relative to the block
/// ("attn.c_attn.weight" inside "h.3.").
struct TensorParallelLayer {
  /// Path of the weight inside the block.
  std::string weight;
  /// Path of its bias, "" when it has none.
  std::string bias{};
  /// Projections fused along the output features (3 for a q|k|v weight); see SliceOptions.
  int64_t n_fused = 1;
  /// The weight is stored [in, out] (Conv1D; parallelformers' `reversed`).
  bool transposed = false;
  /// A block without this weight / bias is no error (parallelformers' ignore_checker: layers
  /// that exist only in some configurations).
  bool ignore_checker = false;
};

/// A block attribute that tensor parallelism divides by the world size, with its full value
/// ("attn.num_heads", 12). parallelformers' replace_arguments returns the divided values;
/// here the policy holds the full ones and arguments_per_rank divides, so that a value that
/// does not divide is reported with the block type, the attribute and both numbers.
struct TensorParallelArgument {
  std::string name;
  int64_t value = 0;
};

/// How to split one block type (parallelformers' Policy). Every parameter of the state dict
/// that no policy names is replicated: each rank keeps the whole tensor (embeddings,
/// LayerNorms, the output head).
struct TensorParallelPolicy {
  /// The block type, for messages ("GPT2Block"; parallelformers' original_layer_class).
  std::string block_type;
  /// Where blocks of this type sit in parameter names: a prefix with "{}" standing for the
  /// block's index ("h.{}." matches "h.0.", "h.11."; "{}" matches one or more digits), or a
  /// plain prefix without "{}" for a single block. Parameters whose names start with a match
  /// belong to that block; the rest of the name is the path the layers below use.
  std::string block_pattern;
  /// Column-sliced (output features split): attention q/k/v projections.
  std::vector<TensorParallelLayer> attn_qkv{};
  /// Row-sliced (input features split; the bias stays whole): attention output projection.
  std::vector<TensorParallelLayer> attn_out{};
  /// Column-sliced: the MLP's h -> 4h projection.
  std::vector<TensorParallelLayer> mlp_in{};
  /// Row-sliced: the MLP's 4h -> h projection.
  std::vector<TensorParallelLayer> mlp_out{};
  /// Attributes the block divides by the world size, with their full values.
  std::vector<TensorParallelArgument> replace_arguments{};
};

/// Each of policy.replace_arguments divided by `world_size`: {"attn.num_heads": 6, ...}.
///
/// Errors:  ValueError naming the block type, the attribute, its value and the world size when
///          it does not divide (e.g. "GPT2Block: attn.num_heads = 12 is not divisible by the
///          world size 5"), or when world_size < 1.
/// Safety:  thread-safe. Source: parallelformers Policy.replace_arguments.
std::map<std::string, int64_t> arguments_per_rank(const TensorParallelPolicy& policy,
                                                  int world_size);

/// Rank `rank`'s shard of a full state dict under `policies`: for every parameter of a block
/// that a policy covers, column_slice (attn_qkv, mlp_in: weight and bias) or row_slice
/// (attn_out, mlp_out: weight only) it; every other entry is kept whole.
///
/// Shapes:  as column_slice / row_slice; weights of `transposed` layers come back in
///          nn.Linear's [out, in] layout (what ColumnParallelLinear / RowParallelLinear hold),
///          sliced in one copy. Names are unchanged.
/// Memory:  `full` is taken by value and each entry is released once sliced, so with a moved-in
///          dict (or one from load_state_dict_file, which maps the file) the peak is about
///          this rank's shard plus the replicated tensors. Sliced tensors are new contiguous
///          tensors; replicated ones are the same tensors as in `full`.
/// Errors:  ValueError from arguments_per_rank for every policy first; naming the block and
///          path of a weight or bias a policy lists that a block lacks (unless
///          ignore_checker), of a path two layers of one policy both claim, of a size that does
///          not split (from the slicing functions), and for rank / world_size out of range.
/// Safety:  thread-safe (no shared state). Source: parallelformers TensorReplacer
///          (_preprocess, _make_megatron_layer) applied to names instead of modules.
StateDict shard_state_dict(StateDict full, const std::vector<TensorParallelPolicy>& policies,
                           int rank, int world_size);

}  // namespace torchpar
