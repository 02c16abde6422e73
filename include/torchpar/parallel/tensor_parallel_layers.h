#pragma once
/// Tensor-parallel building blocks (parallelformers' TensorSlicer and AllReduceLinear, Megatron's
/// ColumnParallelLinear / RowParallelLinear): slicing a full weight into one rank's shard, and
/// the two linear layers that compute on shards.
///
/// Layout: weights are nn.Linear's [out_features, in_features] unless `transposed` says they
/// are Conv1D's [in_features, out_features] (GPT-2's checkpoints; parallelformers' `reversed`).
/// "Column" slicing splits the output features (rows of an nn.Linear weight), "row" slicing the
/// input features (its columns), as in the Megatron-LM paper.
///
/// Not included by torchpar/torchpar.h (it pulls in torch::nn): include it where it is used.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <string>

#include "torchpar/dist/collective_group.h"

namespace torchpar {

// ---- slicing ------------------------------------------------------------------------------------

/// How a tensor is sliced (the per-layer attributes of parallelformers' Layer).
struct SliceOptions {
  /// Number of projections fused along the sliced dimension (3 for GPT-2's c_attn: q, k and
  /// v). Each is split across the ranks separately and rank r gets [q_r, k_r, v_r]
  /// concatenated, so that every rank holds its own heads of each. Must be >= 1.
  int64_t n_fused = 1;
  /// The weight is stored [in_features, out_features] (Conv1D) instead of [out, in]. Ignored
  /// for 1-D tensors (biases).
  bool transposed = false;
  /// Name used in error messages ("h.3.attn.c_attn.weight"); may be empty.
  std::string name{};
};

/// Rank `rank`'s part of the output features of `tensor` (a weight, or a 1-D bias): dimension
/// 0 of an [out, in] weight or of a bias, dimension 1 of a transposed [in, out] weight.
///
/// Shapes:  weight [out, in] -> [out / world_size, in]; transposed [in, out] -> [in, out /
///          world_size]; bias [out] -> [out / world_size]. Any strides.
/// Returns: a new contiguous tensor (never a view of `tensor`), so the full tensor can be freed
///          as soon as every rank took its part. Same dtype and device.
/// Errors:  ValueError naming options.name, the dimension's size, n_fused and world_size when
///          the size does not divide into n_fused * world_size parts; for rank outside [0,
///          world_size), world_size < 1, n_fused < 1, or a tensor that is not 1-D or 2-D.
/// Safety:  thread-safe (reads `tensor` only).
/// Source:  parallelformers TensorSlicer.column_slice (its fused regrouping), Megatron-LM's
///          ColumnParallelLinear weight split.
///
///   auto w0 = torchpar::column_slice(c_attn_w, 0, 2, {.n_fused = 3, .transposed = true});
at::Tensor column_slice(const at::Tensor& tensor, int rank, int world_size,
                        const SliceOptions& options = {});

/// Rank `rank`'s part of the input features of a weight: dimension 1 of an [out, in] weight,
/// dimension 0 of a transposed [in, out] one. Biases of row-parallel layers are not sliced:
/// every rank keeps the full bias and adds it once, after the all_reduce.
///
/// Shapes:  [out, in] -> [out, in / world_size]; transposed [in, out] -> [in / world_size, out].
/// Returns, Errors, Safety: as column_slice (a 1-D tensor is refused: a bias is never
///          row-sliced).
/// Source:  parallelformers TensorSlicer.row_slice, Megatron-LM's RowParallelLinear split.
at::Tensor row_slice(const at::Tensor& tensor, int rank, int world_size,
                     const SliceOptions& options = {});

// ---- communication ------------------------------------------------------------------------------

/// What the tensor-parallel layers need from the ranks that share a model: this rank, the
/// number of ranks, and two collectives. A value type: copies share whatever the functions
/// capture (a CollectiveGroup handle, say).
///
/// The default value is a single rank (rank 0 of 1): no collective is ever called, so TP = 1
/// needs no group. Tests and other transports provide their own functions.
/// Safety:  the layers call the functions from the thread that runs forward(); the functions
///          must be collective-safe in that sense (a CollectiveGroup is used by one thread at a
///          time).
struct TensorParallelComm {
  /// This rank, in [0, world_size).
  int rank = 0;
  /// Number of ranks that hold a shard of the model.
  int world_size = 1;
  /// In place: `t` = the sum of every rank's `t` (same shape and dtype on every rank).
  /// Required when world_size > 1.
  std::function<void(at::Tensor& t)> all_reduce_sum{};
  /// Returns every rank's `t` concatenated along `dim`, in rank order (same shape and dtype on
  /// every rank). Needed only by ColumnParallelLinear with gather_output.
  std::function<at::Tensor(const at::Tensor& t, int64_t dim)> all_gather{};

  /// The communication of `group`: rank and size are the group's, all_reduce_sum is
  /// group.all_reduce(t, {.op = kSum}), all_gather is group.all_gather + cat. The group's
  /// timeout applies; its errors (RankLostError, TimeoutError) propagate out of forward().
  /// Dtypes: what the group's backend reduces (float32 on both; bfloat16 and float16 on shm
  /// only).
  static TensorParallelComm from_group(CollectiveGroup group);

  /// Throws ValueError when rank / world_size are inconsistent or a collective this world
  /// size needs is missing. `what` names the caller in the message.
  void check(const std::string& what) const;
};

// ---- layers -------------------------------------------------------------------------------------

/// Options of ColumnParallelLinear (sizes are the full layer's, across all ranks).
struct ColumnParallelLinearOptions {
  int64_t in_features = 0;
  /// Full number of output features; divisible by the world size.
  int64_t out_features = 0;
  bool bias = true;
  /// true: forward() all_gathers the ranks' outputs into the full [..., out_features];
  /// false: it returns this rank's [..., out_features / world_size] (what a following
  /// RowParallelLinear takes).
  bool gather_output = false;
  /// Dtype of the parameters (float32, bfloat16, ...).
  at::ScalarType dtype = at::kFloat;
  /// false: parameters are left uninitialised (at::empty, pages untouched), for a load_full /
  /// load_shard right after; true: nn.Linear's uniform(-1/sqrt(in), 1/sqrt(in)).
  bool initialize = true;
};

/// A linear layer whose output features are split across ranks: rank r holds rows [r * o, (r +
/// 1) * o) of the [out, in] weight (o = out / world_size) and the same part of the bias, and
/// computes its part of the output from the full input; no communication unless
/// gather_output.
///
/// Parameters: "weight" [out / world_size, in] and "bias" [out / world_size].
/// Shapes:  forward(x): x [..., in] -> [..., out / world_size], or [..., out] with
///          gather_output (in rank-major order: for a fused layer that is [q_0 k_0 v_0 q_1 ...],
///          not the full layer's [q k v]).
/// Errors:  ValueError at construction when out_features does not divide by the world size
///          (naming both) or the comm is inconsistent; at load when a shape differs. forward:
///          the comm's errors (a lost rank) with gather_output.
/// Safety:  as any torch::nn::Module: one forward at a time per module; with world_size > 1,
///          every rank runs the same forward calls in the same order. Inference only: no
///          gradient flows through the collectives.
/// Source:  Megatron-LM ColumnParallelLinear; parallelformers' column-sliced nn.Linear /
///          Conv1D (attn_qkv, mlp_in).
class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  explicit ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options,
                                    TensorParallelComm comm = {});

  /// Takes this rank's part of a full weight [out, in] (or [in, out] with
  /// slice.transposed) and bias [out] (undefined when the layer has none), slicing with
  /// slice.n_fused, and copies it into the parameters (converting the dtype). Use after
  /// construction, before forward; the full tensors are only read.
  void load_full(const at::Tensor& weight, const at::Tensor& bias, SliceOptions slice = {});
  /// Copies an already sliced shard: weight [out / world_size, in], bias [out / world_size].
  void load_shard(const at::Tensor& weight, const at::Tensor& bias);

  at::Tensor forward(const at::Tensor& x);

  const ColumnParallelLinearOptions& options() const { return options_; }
  const TensorParallelComm& comm() const { return comm_; }

  at::Tensor weight;
  at::Tensor bias;

 private:
  ColumnParallelLinearOptions options_;
  TensorParallelComm comm_;
};
TORCH_MODULE(ColumnParallelLinear);

/// Options of RowParallelLinear (sizes are the full layer's, across all ranks).
struct RowParallelLinearOptions {
  /// Full number of input features; divisible by the world size.
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
  /// true: forward() takes this rank's [..., in / world_size] part of the input (the output of
  /// a ColumnParallelLinear without gather_output); false: it takes the full [..., in] and uses
  /// its own part.
  bool input_is_parallel = true;
  at::ScalarType dtype = at::kFloat;
  /// As ColumnParallelLinearOptions::initialize.
  bool initialize = true;
};

/// A linear layer whose input features are split across ranks: rank r holds columns [r * i,
/// (r + 1) * i) of the [out, in] weight (i = in / world_size) and the full bias; forward computes
/// the local product, all_reduces it (SUM) over the ranks, then adds the bias once.
///
/// Parameters: "weight" [out, in / world_size] and "bias" [out] (the same on every rank).
/// Shapes:  forward(x): x [..., in / world_size] (or [..., in] without input_is_parallel) ->
///          [..., out], equal on every rank.
/// Errors, Safety: as ColumnParallelLinear; forward raises the comm's errors whenever
///          world_size > 1.
/// Source:  parallelformers AllReduceLinear / AllReduceConv1D (matmul, all_reduce, += bias);
///          Megatron-LM RowParallelLinear.
class RowParallelLinearImpl : public torch::nn::Module {
 public:
  explicit RowParallelLinearImpl(const RowParallelLinearOptions& options,
                                 TensorParallelComm comm = {});

  /// Takes this rank's part of a full weight [out, in] (or [in, out] with slice.transposed;
  /// slice.n_fused must be 1) and the full bias [out].
  void load_full(const at::Tensor& weight, const at::Tensor& bias, SliceOptions slice = {});
  /// Copies an already sliced shard: weight [out, in / world_size], bias [out] (full).
  void load_shard(const at::Tensor& weight, const at::Tensor& bias);

  at::Tensor forward(const at::Tensor& x);

  const RowParallelLinearOptions& options() const { return options_; }
  const TensorParallelComm& comm() const { return comm_; }

  at::Tensor weight;
  at::Tensor bias;

 private:
  RowParallelLinearOptions options_;
  TensorParallelComm comm_;
};
TORCH_MODULE(RowParallelLinear);

}  // namespace torchpar
