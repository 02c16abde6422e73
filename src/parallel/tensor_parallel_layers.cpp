#include "torchpar/parallel/tensor_parallel_layers.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "parallel/decode_linear.h"
#include "shape_text.h"
#include "torchpar/core/error.h"

// With LibTorch's OpenMP backend, the inline at::parallel_for is a `#pragma omp parallel`:
// without -fopenmp (CMakeLists.txt sets it for this file) the decode kernel would run on one
// thread whatever at::get_num_threads() says (it did until 2026-11-30: TP=1 decoded at 127
// tokens/s on 2 threads, 205 since).
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "tensor_parallel_layers.cpp must be compiled with OpenMP (see CMakeLists.txt)"
#endif

namespace torchpar {
namespace detail {
namespace {

bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

/// The sum of the 8 lanes, in a fixed order.
__attribute__((target("avx2,fma"))) inline float lanes_sum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

/// y[m, n] for n in [n0, n1) and the M rows of x: R weight rows at a time, so that R * M
/// independent accumulators hide the FMA latency and each weight row is loaded once.
template <int M, int R>
__attribute__((target("avx2,fma"))) void decode_rows(const float* x, const float* w,
                                                     const float* bias, float* y, int64_t k,
                                                     int64_t n, int64_t n0, int64_t n1) {
  const int64_t k8 = k - k % 8;
  int64_t r = n0;
  for (; r + R <= n1; r += R) {
    __m256 acc[R][M];
#pragma GCC unroll 16
    for (int i = 0; i < R * M; ++i) acc[i / M][i % M] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k8; c += 8) {
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const __m256 wv = _mm256_loadu_ps(w + (r + i) * k + c);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m)
          acc[i][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * k + c), acc[i][m]);
      }
    }
    for (int i = 0; i < R; ++i) {
      for (int m = 0; m < M; ++m) {
        float s = lanes_sum(acc[i][m]);
        for (int64_t c = k8; c < k; ++c) s += w[(r + i) * k + c] * x[m * k + c];
        y[m * n + r + i] = bias != nullptr ? s + bias[r + i] : s;
      }
    }
  }
  if (r < n1) decode_rows<M, 1>(x, w, bias, y, k, n, r, n1);
}

template <int M>
void decode_kernel(const float* x, const float* w, const float* bias, float* y, int64_t k,
                   int64_t n) {
  // About 64 KiB of weights per task: the intra-op threads share the rows evenly.
  const int64_t grain = std::max<int64_t>(8, (64 << 10) / (4 * std::max<int64_t>(k, 1)));
  constexpr int R = M == 1 ? 4 : M == 2 ? 4 : M <= 4 ? 2 : 1;
  at::parallel_for(0, n, grain,
                   [&](int64_t n0, int64_t n1) { decode_rows<M, R>(x, w, bias, y, k, n, n0, n1); });
}

}  // namespace

at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t k = weight.dim() == 2 ? weight.size(1) : -1;
  const int64_t rows = x.dim() >= 1 && x.size(-1) == k && k > 0 ? x.numel() / k : 0;
  const bool fits = rows >= 1 && rows <= kDecodeRows && x.scalar_type() == at::kFloat &&
                    weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                    x.device().is_cpu() && weight.device().is_cpu() &&
                    (!bias.defined() || (bias.scalar_type() == at::kFloat && bias.dim() == 1 &&
                                         bias.size(0) == weight.size(0) && bias.is_contiguous())) &&
                    (!at::GradMode::is_enabled() || !(x.requires_grad() || weight.requires_grad() ||
                                                      (bias.defined() && bias.requires_grad()))) &&
                    has_avx2_fma();
  if (!fits) return at::linear(x, weight, bias);
  const int64_t n = weight.size(0);
  const at::Tensor xc = x.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  switch (rows) {
    case 1:
      decode_kernel<1>(xp, wp, bp, yp, k, n);
      break;
    case 2:
      decode_kernel<2>(xp, wp, bp, yp, k, n);
      break;
    case 3:
      decode_kernel<3>(xp, wp, bp, yp, k, n);
      break;
    case 4:
      decode_kernel<4>(xp, wp, bp, yp, k, n);
      break;
    case 5:
      decode_kernel<5>(xp, wp, bp, yp, k, n);
      break;
    case 6:
      decode_kernel<6>(xp, wp, bp, yp, k, n);
      break;
    case 7:
      decode_kernel<7>(xp, wp, bp, yp, k, n);
      break;
    default:
      decode_kernel<8>(xp, wp, bp, yp, k, n);
      break;
  }
  return y;
}

}  // namespace detail

namespace {

std::string label(const SliceOptions& o) { return o.name.empty() ? "tensor" : "'" + o.name + "'"; }

using detail::shape_of;

void check_slice_args(const at::Tensor& t, int rank, int world_size, const SliceOptions& o,
                      const char* fn) {
  if (!t.defined()) throw ValueError(fmt::format("{}: {} is an undefined tensor", fn, label(o)));
  if (world_size < 1)
    throw ValueError(
        fmt::format("{}: world size {} (of {}) must be >= 1", fn, world_size, label(o)));
  if (rank < 0 || rank >= world_size)
    throw ValueError(
        fmt::format("{}: rank {} (of {}) is outside [0, {})", fn, rank, label(o), world_size));
  if (o.n_fused < 1)
    throw ValueError(fmt::format("{}: n_fused {} (of {}) must be >= 1", fn, o.n_fused, label(o)));
  if (t.dim() != 1 && t.dim() != 2)
    throw ValueError(
        fmt::format("{}: {} has shape {}; only weights (2-D) and biases (1-D) are "
                    "sliced",
                    fn, label(o), shape_of(t.sizes())));
}

/// Rank `rank`'s piece of each of the n_fused parts of `t` along `dim`, concatenated; a new
/// contiguous tensor.
at::Tensor take_part(const at::Tensor& t, int64_t dim, int rank, int world_size,
                     const SliceOptions& o, const char* fn) {
  const int64_t size = t.size(dim);
  if (size % (o.n_fused * world_size) != 0)
    throw ValueError(fmt::format(
        "{}: {} has {} features along dimension {} (shape {}), which do not split into {} fused "
        "part(s) x {} ranks (the world size)",
        fn, label(o), size, dim, shape_of(t.sizes()), o.n_fused, world_size));
  const int64_t fused_size = size / o.n_fused;
  const int64_t piece = fused_size / world_size;
  if (o.n_fused == 1) return t.narrow(dim, rank * piece, piece).clone(at::MemoryFormat::Contiguous);
  std::vector<at::Tensor> pieces;
  pieces.reserve(static_cast<size_t>(o.n_fused));
  for (int64_t f = 0; f < o.n_fused; ++f)
    pieces.push_back(t.narrow(dim, f * fused_size + rank * piece, piece));
  return at::cat(pieces, dim).contiguous();
}

void check_shape(const char* what, const char* which, const at::Tensor& got,
                 const at::Tensor& param) {
  if (!got.defined())
    throw ValueError(fmt::format("{}: no {} given; the layer has one of shape {}", what, which,
                                 shape_of(param.sizes())));
  if (got.sizes() != param.sizes())
    throw ValueError(fmt::format("{}: {} has shape {}, this rank's layer needs {}", what, which,
                                 shape_of(got.sizes()), shape_of(param.sizes())));
}

/// Copies a shard into the layer's parameters (converting the dtype), checking shapes.
void copy_shard(const char* what, at::Tensor& weight, at::Tensor& bias, const at::Tensor& w,
                const at::Tensor& b) {
  check_shape(what, "weight", w, weight);
  if (bias.defined()) {
    check_shape(what, "bias", b, bias);
  } else if (b.defined()) {
    throw ValueError(
        fmt::format("{}: a bias was given, but the layer has none (bias = false)", what));
  }
  at::NoGradGuard no_grad;
  weight.copy_(w);
  if (bias.defined()) bias.copy_(b);
}

/// nn.Linear's initialisation: kaiming_uniform(a = sqrt(5)) is uniform(-1/sqrt(in), 1/sqrt(in))
/// for the weight, and the bias takes the same bound. `fan_in` is the full layer's.
void init_uniform(at::Tensor& weight, at::Tensor& bias, int64_t fan_in) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  at::NoGradGuard no_grad;
  weight.uniform_(-bound, bound);
  if (bias.defined()) bias.uniform_(-bound, bound);
}

void check_sizes(const char* what, int64_t in, int64_t out, int64_t split, const char* split_name,
                 int world_size) {
  if (in < 1 || out < 1)
    throw ValueError(
        fmt::format("{}: in_features {} and out_features {} must be >= 1", what, in, out));
  if (split % world_size != 0)
    throw ValueError(fmt::format("{}: {} = {} is not divisible by the world size {}", what,
                                 split_name, split, world_size));
}

/// Registers `module`'s "weight" [rows, cols] and, when `has_bias`, "bias" [bias_size], of
/// `dtype`; nn.Linear's initialisation for a full layer of `fan_in` inputs when `initialize`.
void register_linear(torch::nn::Module& module, at::Tensor& weight, at::Tensor& bias, int64_t rows,
                     int64_t cols, bool has_bias, int64_t bias_size, at::ScalarType dtype,
                     bool initialize, int64_t fan_in) {
  const auto opts = at::TensorOptions().dtype(dtype);
  weight = module.register_parameter("weight", at::empty({rows, cols}, opts));
  if (has_bias) bias = module.register_parameter("bias", at::empty({bias_size}, opts));
  if (initialize) init_uniform(weight, bias, fan_in);
}

void check_input(const char* what, const at::Tensor& x, int64_t features) {
  if (!x.defined() || x.dim() < 1 || x.size(-1) != features)
    throw ValueError(fmt::format("{}: input of shape {} does not end in this rank's {} features",
                                 what, x.defined() ? shape_of(x.sizes()) : "(undefined)",
                                 features));
}

/// The collectives write results into the tensor's memory behind autograd's back.
void require_inference(const char* what, const at::Tensor& weight) {
  if (at::GradMode::is_enabled() && weight.requires_grad())
    throw ValueError(fmt::format(
        "{}: with a world size > 1 the layer is inference-only (no gradient flows through its "
        "collective); run forward under at::NoGradGuard or c10::InferenceMode",
        what));
}

}  // namespace

at::Tensor column_slice(const at::Tensor& tensor, int rank, int world_size,
                        const SliceOptions& options) {
  check_slice_args(tensor, rank, world_size, options, "column_slice");
  const int64_t dim = tensor.dim() == 2 && options.transposed ? 1 : 0;
  return take_part(tensor, dim, rank, world_size, options, "column_slice");
}

at::Tensor row_slice(const at::Tensor& tensor, int rank, int world_size,
                     const SliceOptions& options) {
  check_slice_args(tensor, rank, world_size, options, "row_slice");
  if (tensor.dim() != 2)
    throw ValueError(
        fmt::format("row_slice: {} is 1-D; a row-parallel layer's bias is not "
                    "sliced (every rank adds the full bias once)",
                    label(options)));
  return take_part(tensor, options.transposed ? 0 : 1, rank, world_size, options, "row_slice");
}

TensorParallelComm TensorParallelComm::from_group(CollectiveGroup group) {
  TensorParallelComm c;
  c.rank = group.rank();
  c.world_size = group.size();
  c.all_reduce_sum = [group](at::Tensor& t) mutable {
    group.all_reduce(t, {.op = ReduceOp::kSum});
  };
  c.all_gather = [group](const at::Tensor& t, int64_t dim) mutable {
    std::vector<at::Tensor> parts;
    parts.reserve(static_cast<size_t>(group.size()));
    for (int r = 0; r < group.size(); ++r) parts.push_back(at::empty(t.sizes(), t.options()));
    group.all_gather(parts, t.contiguous());
    return at::cat(parts, dim);
  };
  return c;
}

void TensorParallelComm::check(const std::string& what) const {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw ValueError(fmt::format("{}: rank {} of world size {} is not a rank ([0, world size))",
                                 what, rank, world_size));
  if (world_size > 1 && !all_reduce_sum)
    throw ValueError(fmt::format(
        "{}: world size {} needs TensorParallelComm::all_reduce_sum (from_group(group) sets it)",
        what, world_size));
}

// ---- ColumnParallelLinear -----------------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options,
                                                   TensorParallelComm comm)
    : options_(options), comm_(std::move(comm)) {
  constexpr const char* kWhat = "ColumnParallelLinear";
  comm_.check(kWhat);
  check_sizes(kWhat, options_.in_features, options_.out_features, options_.out_features,
              "out_features", comm_.world_size);
  if (options_.gather_output && comm_.world_size > 1 && !comm_.all_gather)
    throw ValueError("ColumnParallelLinear: gather_output needs TensorParallelComm::all_gather");
  const int64_t out = options_.out_features / comm_.world_size;
  register_linear(*this, weight, bias, out, options_.in_features, options_.bias, out,
                  options_.dtype, options_.initialize, options_.in_features);
}

void ColumnParallelLinearImpl::load_full(const at::Tensor& full_weight, const at::Tensor& full_bias,
                                         SliceOptions slice) {
  // Slicing the transposed view along dim 0 gives [out / world, in] in one copy.
  const bool transposed = slice.transposed && full_weight.defined() && full_weight.dim() == 2;
  slice.transposed = false;
  at::Tensor w =
      column_slice(transposed ? full_weight.t() : full_weight, comm_.rank, comm_.world_size, slice);
  at::Tensor b;
  if (full_bias.defined()) {
    slice.name += slice.name.empty() ? "bias" : " (bias)";
    b = column_slice(full_bias, comm_.rank, comm_.world_size, slice);
  }
  load_shard(w, b);
}

void ColumnParallelLinearImpl::load_shard(const at::Tensor& w, const at::Tensor& b) {
  copy_shard("ColumnParallelLinear", weight, bias, w, b);
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  constexpr const char* kWhat = "ColumnParallelLinear";
  check_input(kWhat, x, options_.in_features);
  at::Tensor y = detail::decode_linear(x, weight, bias);
  if (!options_.gather_output || comm_.world_size == 1) return y;
  require_inference(kWhat, weight);
  return comm_.all_gather(y.contiguous(), -1);
}

// ---- RowParallelLinear --------------------------------------------------------------------------

RowParallelLinearImpl::RowParallelLinearImpl(const RowParallelLinearOptions& options,
                                             TensorParallelComm comm)
    : options_(options), comm_(std::move(comm)) {
  constexpr const char* kWhat = "RowParallelLinear";
  comm_.check(kWhat);
  check_sizes(kWhat, options_.in_features, options_.out_features, options_.in_features,
              "in_features", comm_.world_size);
  register_linear(*this, weight, bias, options_.out_features,
                  options_.in_features / comm_.world_size, options_.bias, options_.out_features,
                  options_.dtype, options_.initialize, options_.in_features);
}

void RowParallelLinearImpl::load_full(const at::Tensor& full_weight, const at::Tensor& full_bias,
                                      SliceOptions slice) {
  if (slice.n_fused != 1)
    throw ValueError(
        fmt::format("RowParallelLinear.load_full: n_fused {} (of {}): a row-parallel "
                    "weight is not fused",
                    slice.n_fused, label(slice)));
  const bool transposed = slice.transposed && full_weight.defined() && full_weight.dim() == 2;
  slice.transposed = false;
  at::Tensor w =
      row_slice(transposed ? full_weight.t() : full_weight, comm_.rank, comm_.world_size, slice);
  load_shard(w, full_bias);
}

void RowParallelLinearImpl::load_shard(const at::Tensor& w, const at::Tensor& b) {
  copy_shard("RowParallelLinear", weight, bias, w, b);
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  constexpr const char* kWhat = "RowParallelLinear";
  const int64_t local_in = options_.in_features / comm_.world_size;
  at::Tensor local = x;
  if (!options_.input_is_parallel && comm_.world_size > 1) {
    check_input(kWhat, x, options_.in_features);
    local = x.narrow(-1, comm_.rank * local_in, local_in);
  }
  check_input(kWhat, local, local_in);
  at::Tensor y = detail::decode_linear(local, weight, {});
  if (comm_.world_size > 1) {
    require_inference(kWhat, weight);
    y = y.contiguous();
    comm_.all_reduce_sum(y);
  }
  // After the reduction, so the bias counts once and not world_size times.
  return bias.defined() ? y + bias : y;
}

}  // namespace torchpar
