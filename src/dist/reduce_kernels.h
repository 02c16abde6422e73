#pragma once
// Element-wise reduction loops over raw buffers, for every dtype the shm backend carries.

#include <c10/core/ScalarType.h>

#include <cstddef>

#include "torchpar/dist/collective_group.h"

namespace torchpar::detail {

/// dst[i] = a[i] op b[i] for i < n (dst may alias a). kAvg combines like kSum.
void reduce_combine(void* dst, const void* a, const void* b, size_t n, at::ScalarType dtype,
                    ReduceOp op);
/// The loops float and double run: the same element-wise code compiled for three x86 vector
/// widths; reduce_combine takes the widest this CPU supports, chosen at its first call.
enum class CombineLoop { kBaseline, kAvx2, kAvx512 };
/// True when this build and CPU can run `loop` (kBaseline always).
bool combine_loop_supported(CombineLoop loop);
/// reduce_combine of float or double with the given loop, so that tests run every loop the
/// CPU has, not only the one it picks. torchpar::Error for another dtype or a loop the CPU
/// lacks.
void reduce_combine_with(CombineLoop loop, void* dst, const void* a, const void* b, size_t n,
                         at::ScalarType dtype, ReduceOp op);
/// dst[i] /= divisor (AVG's last step, which CollectiveGroup takes for every backend;
/// floating dtypes only).
void reduce_divide(void* dst, size_t n, at::ScalarType dtype, int divisor);
/// Throws torchpar::Error when `op` cannot apply to `dtype` (AVG on integers, complex);
/// CollectiveGroup asks before every reducing call, whatever the backend.
void check_reducible(at::ScalarType dtype, ReduceOp op, const char* where);

}  // namespace torchpar::detail
