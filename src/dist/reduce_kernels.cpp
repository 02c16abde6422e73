#include "dist/reduce_kernels.h"

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fmt/format.h>

#include <algorithm>

#include "torchpar/core/error.h"

namespace torchpar::detail {
namespace {

template <class T>
inline __attribute__((always_inline)) void combine_typed(T* d, const T* a, const T* b, size_t n,
                                                         ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(a[i] + b[i]);
      break;
    case ReduceOp::kProduct:
      for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(a[i] * b[i]);
      break;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) d[i] = b[i] < a[i] ? b[i] : a[i];
      break;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) d[i] = a[i] < b[i] ? b[i] : a[i];
      break;
  }
}

// float and double (gradients) get a loop per x86 vector width, picked once from what the
// CPU supports: the reduction of a chunk reads its own operand from a tensor larger than the
// caches, and with SSE2's four floats per instruction the loop's memory parallelism ran out
// first. 128 KiB from a 16 MiB tensor on the 2-core EPYC VM: SSE2 10.1-10.8 us, AVX2
// 6.4-7.0, AVX-512 5.3-6.6; 16 MiB all_reduce on 2 ranks: see docs/distributed.md.
// A plain function pointer, not GCC's target_clones: an ifunc resolver runs while the
// dynamic linker relocates the library, before a sanitizer's runtime is up (TSan builds
// crashed there).
template <class T>
using CombineFn = void (*)(T*, const T*, const T*, size_t, ReduceOp);

template <class T>
void combine_base(T* d, const T* a, const T* b, size_t n, ReduceOp op) {
  combine_typed<T>(d, a, b, n, op);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define TORCHPAR_VECTOR_KERNELS 1
template <class T>
__attribute__((target("avx2"))) void combine_avx2(T* d, const T* a, const T* b, size_t n,
                                                  ReduceOp op) {
  combine_typed<T>(d, a, b, n, op);
}
template <class T>
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq"))) void combine_avx512(T* d, const T* a,
                                                                                  const T* b,
                                                                                  size_t n,
                                                                                  ReduceOp op) {
  combine_typed<T>(d, a, b, n, op);
}
#endif

bool cpu_runs(CombineLoop loop) {
#ifdef TORCHPAR_VECTOR_KERNELS
  __builtin_cpu_init();
  switch (loop) {
    case CombineLoop::kBaseline:
      return true;
    case CombineLoop::kAvx2:
      return __builtin_cpu_supports("avx2");
    case CombineLoop::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  }
  return false;
#else
  return loop == CombineLoop::kBaseline;
#endif
}

template <class T>
CombineFn<T> loop_fn(CombineLoop loop) {
#ifdef TORCHPAR_VECTOR_KERNELS
  if (loop == CombineLoop::kAvx512) return &combine_avx512<T>;
  if (loop == CombineLoop::kAvx2) return &combine_avx2<T>;
#endif
  (void)loop;
  return &combine_base<T>;
}

/// The widest loop this CPU runs, chosen at the first call (thread-safe static).
template <class T>
CombineFn<T> pick_combine() {
  for (auto loop : {CombineLoop::kAvx512, CombineLoop::kAvx2}) {
    if (cpu_runs(loop)) return loop_fn<T>(loop);
  }
  return &combine_base<T>;
}

template <class T>
void combine_fast(T* d, const T* a, const T* b, size_t n, ReduceOp op) {
  static const CombineFn<T> fn = pick_combine<T>();
  fn(d, a, b, n, op);
}

void combine_bool(bool* d, const bool* a, const bool* b, size_t n, ReduceOp op) {
  const bool any = op == ReduceOp::kSum || op == ReduceOp::kMax;  // OR; PRODUCT/MIN: AND
  for (size_t i = 0; i < n; ++i) d[i] = any ? (a[i] || b[i]) : (a[i] && b[i]);
}

}  // namespace

void check_reducible(at::ScalarType dtype, ReduceOp op, const char* where) {
  if (at::isComplexType(dtype)) {
    throw Error(fmt::format("{}: complex dtype {} is not supported", where, c10::toString(dtype)));
  }
  if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) {
    throw Error(fmt::format("{}: ReduceOp AVG needs a floating dtype, got {}", where,
                            c10::toString(dtype)));
  }
}

void reduce_combine(void* dst, const void* a, const void* b, size_t n, at::ScalarType dtype,
                    ReduceOp op) {
  if (dtype == at::kBool) {
    combine_bool(static_cast<bool*>(dst), static_cast<const bool*>(a), static_cast<const bool*>(b),
                 n, op);
    return;
  }
  if (dtype == at::kFloat) {
    combine_fast<float>(static_cast<float*>(dst), static_cast<const float*>(a),
                        static_cast<const float*>(b), n, op);
    return;
  }
  if (dtype == at::kDouble) {
    combine_fast<double>(static_cast<double*>(dst), static_cast<const double*>(a),
                         static_cast<const double*>(b), n, op);
    return;
  }
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "reduce_combine", [&] {
    combine_typed<scalar_t>(static_cast<scalar_t*>(dst), static_cast<const scalar_t*>(a),
                            static_cast<const scalar_t*>(b), n, op);
  });
}

bool combine_loop_supported(CombineLoop loop) { return cpu_runs(loop); }

void reduce_combine_with(CombineLoop loop, void* dst, const void* a, const void* b, size_t n,
                         at::ScalarType dtype, ReduceOp op) {
  if (!cpu_runs(loop)) {
    throw Error(
        fmt::format("reduce_combine_with: this CPU does not run loop {}", static_cast<int>(loop)));
  }
  if (dtype == at::kFloat) {
    loop_fn<float>(loop)(static_cast<float*>(dst), static_cast<const float*>(a),
                         static_cast<const float*>(b), n, op);
  } else if (dtype == at::kDouble) {
    loop_fn<double>(loop)(static_cast<double*>(dst), static_cast<const double*>(a),
                          static_cast<const double*>(b), n, op);
  } else {
    throw Error(
        fmt::format("reduce_combine_with: float or double only, got {}", c10::toString(dtype)));
  }
}

void reduce_divide(void* dst, size_t n, at::ScalarType dtype, int divisor) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "reduce_divide", [&] {
    auto* d = static_cast<scalar_t*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<scalar_t>(d[i] / divisor);
  });
}

}  // namespace torchpar::detail
