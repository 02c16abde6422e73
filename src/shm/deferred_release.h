#pragma once
// The private buffer share_memory_ replaces, freed off the caller's path when it is large.

#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>

namespace torchpar::detail {

/// Buffers of at least this many bytes go to the background thread.
constexpr size_t kDeferredReleaseMinBytes = size_t{8} << 20;
/// While this many bytes wait to be freed, further buffers are freed by their caller.
constexpr size_t kDeferredReleaseMaxPendingBytes = size_t{1} << 30;

/// Frees `ptr`, a storage's previous buffer of `nbytes`. A buffer of
/// kDeferredReleaseMinBytes or more from LibTorch's default CPU allocator is freed by a
/// background thread of this process (started at the first one): glibc returns such a
/// buffer with munmap, whose page-table work and page freeing took 3.7 ms of share_memory_'s
/// 9 ms for 64 MiB on the 2-core VM (perf, 2026-11-28). Any other deleter (at::from_blob's,
/// a custom allocator's) runs here, on the calling thread, as do all buffers while
/// kDeferredReleaseMaxPendingBytes wait or when no thread can be started.
/// Thread-safe; fork-safe (a child starts its own thread when it first needs one; buffers a
/// parent had queued at the fork are freed by the child's thread then, or at its exit).
/// At exit (an atexit handler) the thread finishes its buffer and ends (joined, so its
/// thread-local state is freed), and the exiting thread frees the queued ones, before
/// LibTorch's allocator statics are destroyed.
void release_later(c10::DataPtr&& ptr, size_t nbytes) noexcept;

/// Blocks until every buffer release_later queued before the call is freed, at most
/// `timeout` seconds (torchpar::TimeoutError then; the buffers are still freed later).
/// Returns the number of buffers the background thread has freed in this process so far.
uint64_t drain_released(double timeout = 60.0);

}  // namespace torchpar::detail
