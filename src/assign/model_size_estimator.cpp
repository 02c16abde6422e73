#include "torchpar/assign/model_size_estimator.h"

#include <c10/util/accumulate.h>
#include <fmt/format.h>

#include <cmath>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torchpar/core/error.h"

namespace torchpar {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// Bytes of the distinct defined tensors of `tensors` (a tensor listed twice counts once).
int64_t distinct_nbytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const c10::TensorImpl*> seen;
  int64_t total = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
    total += ModelSizeEstimator::nbytes(t.sizes(), t.scalar_type());
  }
  return total;
}

}  // namespace

ModelSizeEstimator::ModelSizeEstimator(std::shared_ptr<torch::nn::Module> model,
                                       double size_multiplier)
    : model_(std::move(model)), size_multiplier_(size_multiplier) {
  if (!model_) throw ValueError("ModelSizeEstimator: model is null");
  if (!(size_multiplier_ >= 0)) {
    throw ValueError(
        fmt::format("ModelSizeEstimator: size_multiplier must be >= 0, got {}", size_multiplier_));
  }
}

int64_t ModelSizeEstimator::nbytes(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::Undefined ||
      static_cast<int>(dtype) >= static_cast<int>(c10::ScalarType::NumOptions)) {
    throw ValueError("Invalid data type.");
  }
  const auto item = static_cast<int64_t>(c10::elementSize(dtype));
  // LibTorch packs these along the innermost dimension and rounds each row up to a byte
  // (aten's get_sub_byte_tensor_size); their elementSize is that of the packed byte.
  int64_t per_byte = 1;
  if (dtype == c10::ScalarType::QUInt4x2) per_byte = 2;
  if (dtype == c10::ScalarType::QUInt2x4) per_byte = 4;
  if (per_byte == 1 || sizes.empty()) return c10::multiply_integers(sizes) * item;
  const int64_t row_bytes = (sizes.back() * item + per_byte - 1) / per_byte;
  return c10::multiply_integers(sizes.begin(), sizes.end() - 1) * row_bytes;
}

double ModelSizeEstimator::get_parameter_sizes() const {
  return static_cast<double>(distinct_nbytes(model_->parameters())) / kMiB;
}

double ModelSizeEstimator::get_buffer_sizes() const {
  return static_cast<double>(distinct_nbytes(model_->buffers())) / kMiB;
}

double ModelSizeEstimator::estimate_size() const {
  return (get_parameter_sizes() + get_buffer_sizes()) * size_multiplier_;
}

}  // namespace torchpar
