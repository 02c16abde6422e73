#pragma once
// Element-wise reduction loops over raw buffers, for every dtype the shm backend carries.

#include <c10/core/ScalarType.h>

#include <cstddef>

#include "torchpar/dist/collective_group.h"

namespace torchpar::detail {

/// dst[i] = a[i] op b[i] for i < n (dst may alias a). kAvg combines like kSum.
void reduce_combine(void* dst, const void* a, const void* b, size_t n, at::ScalarType dtype,
                    ReduceOp op);
/// dst[i] /= divisor (AVG's last step, which CollectiveGroup takes for every backend;
/// floating dtypes only).
void reduce_divide(void* dst, size_t n, at::ScalarType dtype, int divisor);
/// Throws torchpar::Error when `op` cannot apply to `dtype` (AVG on integers, complex);
/// CollectiveGroup asks before every reducing call, whatever the backend.
void check_reducible(at::ScalarType dtype, ReduceOp op, const char* where);

}  // namespace torchpar::detail
