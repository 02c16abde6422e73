#pragma once
// The linear layers' kernel for decoding: a few input rows against a weight streamed once.

#include <ATen/core/Tensor.h>

namespace torchpar::detail {

/// at::linear(x, weight, bias) for inference: y[..., n] = bias[n] + sum_k x[..., k] w[n, k].
///
/// With at most kDecodeRows rows in x (a decode step: one token per sequence), float32, a
/// contiguous weight and no gradient wanted, each weight row is read once for all the input
/// rows (OpenBLAS's sgemm packs the whole weight first on every call, 3-6x slower for one row);
/// the rows are split over LibTorch's intra-op threads. Otherwise, or without AVX2 and FMA, it
/// is at::linear. Deterministic: one output element's sum never depends on the thread count.
///
/// Shapes:  x [..., in]; weight [out, in]; bias [out] or undefined -> [..., out].
/// Safety:  thread-safe (reads its arguments only).
at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

/// The most input rows decode_linear computes with its own kernel.
inline constexpr int64_t kDecodeRows = 8;

}  // namespace torchpar::detail
