#pragma once
/// ModelSizeEstimator: how much memory a module's parameters and buffers take, in MiB
/// (machin.parallel.assigner.ModelSizeEstimator). Used by ModelAssigner; see docs/assign.md.

#include <ATen/core/TensorBody.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>

namespace torchpar {

/// Estimates the memory a module takes from the shapes and dtypes of its parameters and
/// buffers (recursive), times a safety multiplier for activations and inputs.
///
/// ```cpp
/// auto net = torch::nn::Linear(1024, 1024);
/// torchpar::ModelSizeEstimator est(net, /*size_multiplier=*/2);
/// double mib = est.estimate_size();  // (4 MiB weight + 4 KiB bias) * 2
/// ```
///
/// Units:  MiB (2^20 bytes; machin says "MB" and means the same) for every size method.
/// Counts: each tensor by shape times element size, whatever its device (meta tensors
///         count as if allocated); a tensor reachable under two names (tied weights, a
///         submodule registered twice) counts once, as Python's `parameters()` dedupes;
///         undefined buffers count 0. A sparse tensor counts as its dense shape.
/// Fixes:  every dtype LibTorch has is sized (machin raises ValueError on bfloat16 and the
///         complex and quantized types, and counts complex32 as 8 bytes instead of 4);
///         the sub-byte quint4x2 / quint2x4 count as LibTorch stores them (two / four
///         values a byte, each innermost row rounded up to a whole byte).
/// Safety: the methods read the module's tensor list; do not add or remove parameters or
///         buffers meanwhile. Otherwise thread-safe (no state besides the module pointer).
/// Errors: ValueError for a tensor of an undefined dtype ("Invalid data type.", machin's
///         text) or a negative or NaN `size_multiplier`.
/// Source: machin.parallel.assigner.ModelSizeEstimator.
class ModelSizeEstimator {
 public:
  explicit ModelSizeEstimator(std::shared_ptr<torch::nn::Module> model, double size_multiplier = 2);
  /// From a module holder (torch::nn::Linear, a TORCH_MODULE type).
  template <class M>
  explicit ModelSizeEstimator(const torch::nn::ModuleHolder<M>& holder, double size_multiplier = 2)
      : ModelSizeEstimator(holder.ptr(), size_multiplier) {}

  /// Size of all parameters (recursive), in MiB.
  double get_parameter_sizes() const;
  /// Size of all buffers (recursive), in MiB.
  double get_buffer_sizes() const;
  /// (parameters + buffers) * size_multiplier, in MiB.
  double estimate_size() const;

  /// Bytes a dense tensor of `sizes` and `dtype` takes, as above (sub-byte types packed).
  /// Throws ValueError for ScalarType::Undefined. Safety: thread-safe.
  static int64_t nbytes(c10::IntArrayRef sizes, c10::ScalarType dtype);

  double size_multiplier() const { return size_multiplier_; }
  const std::shared_ptr<torch::nn::Module>& model() const { return model_; }

 private:
  std::shared_ptr<torch::nn::Module> model_;
  double size_multiplier_;
};

}  // namespace torchpar
