#pragma once
// Large payload buffers, kept for reuse, and CPU storages that alias them.
//
// Why: a block of 32 MiB or more comes from glibc as a fresh mapping and goes back to the
// kernel at free, so each large dumps or copied load paid for fresh pages: ~7.5 ms for
// 64 MiB in transparent huge pages on the 2-core VMs we measure on, and 200-350 ms in
// 4 KiB pages (when no huge page is free), against 3.9 ms for the copy itself. The cache
// hands such a buffer from the tensor that was loaded out of it back to the next dumps.

#include <c10/core/Storage.h>

#include <atomic>
#include <cstddef>
#include <string>

#include "core/prefault.h"

namespace torchpar::detail {

/// Buffers below this capacity are never kept: glibc's heap already reuses them warm (its
/// dynamic mmap threshold stops at 32 MiB), the same line as prefault_private_for_write's.
constexpr size_t kCachedBufferBytes = kPrivatePrefaultBytes;
/// The cache keeps at most this many buffers and this many bytes of capacity in all.
constexpr size_t kCachedBufferCount = 2;
constexpr size_t kCachedBufferLimit = size_t{256} << 20;

/// The capacity to reserve for a fresh large buffer that must hold `n` bytes: rounded up
/// (64 KiB of headroom, then to a 2 MiB huge page) so that a dumps of a tensor and a load of
/// the same tensor fit in each other's buffers.
constexpr size_t payload_buffer_capacity(size_t n) {
  constexpr size_t kHuge = size_t{2} << 20;
  return (n + (size_t{64} << 10) + kHuge - 1) / kHuge * kHuge;
}

/// A cleared cached buffer with min_capacity <= capacity() <= 2 * min_capacity, or an
/// empty string (no heap block) when none fits. Safety: thread-safe.
std::string take_payload_buffer(size_t min_capacity);

/// Keeps `buffer` for reuse when its capacity is at least kCachedBufferBytes and the cache
/// has room within its limits; frees it otherwise. Safety: thread-safe.
void recycle_payload_buffer(std::string&& buffer) noexcept;

/// Frees every cached buffer. Safety: thread-safe.
void clear_payload_buffers() noexcept;

/// A heap-held byte buffer shared by the storages that alias it. It starts with one
/// reference, its creator's; each storage_over takes one more. The last release recycles
/// the bytes (recycle_payload_buffer) and deletes the holder.
struct SharedBuffer {
  explicit SharedBuffer(std::string&& b) : bytes(std::move(b)) {}
  std::string bytes;
  std::atomic<size_t> refs{1};
};

/// Drops one reference of `buffer`. Safety: thread-safe.
void release_shared_buffer(SharedBuffer* buffer) noexcept;

/// A resizable CPU storage of `nbytes` bytes at `data` (inside buffer->bytes) that holds a
/// reference of `buffer` until its memory is freed. A resize reallocates with the CPU
/// allocator and lets the buffer go.
c10::Storage storage_over(SharedBuffer* buffer, const char* data, size_t nbytes);

}  // namespace torchpar::detail
