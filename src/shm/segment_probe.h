#pragma once
// Reads a named segment's header from outside the allocator: is any of its blocks exported
// and not yet imported (a handle in flight)? Used by the exiting process and by the
// cleaner program (torchpar-shm-cleaner) to keep such names until the receiver has mapped
// them. Header only and free of LibTorch, so the cleaner stays a tiny program; only raw
// syscalls, so an exiting child may call it.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>

#include "segment.h"

namespace torchpar::detail {

/// True when the segment open at `fd` is a torchpar segment with an export not yet
/// imported (a pinned export, kPinnedExport, is not in flight: it waits for no receiver).
/// Anything unreadable or foreign counts as not in flight.
inline bool segment_in_flight(int fd) noexcept {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(SegmentHeader))) return false;
  const size_t page = 4096;
  void* p = ::mmap(nullptr, page, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return false;
  const auto* h = static_cast<const SegmentHeader*>(p);
  const uint64_t counters = sizeof(SegmentHeader) + 8ULL * h->num_blocks;
  const bool ours = h->magic == kSegmentMagic && h->num_blocks > 0 &&
                    counters <= static_cast<uint64_t>(st.st_size) && counters <= h->data_offset;
  const uint32_t blocks = ours ? h->num_blocks : 0;
  ::munmap(p, page);
  if (!ours) return false;
  const size_t len = (counters + page - 1) / page * page;
  p = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return false;
  const auto* exports =
      reinterpret_cast<const uint32_t*>(static_cast<const char*>(p) + sizeof(SegmentHeader)) +
      blocks;
  bool in_flight = false;
  for (uint32_t b = 0; b < blocks && !in_flight; ++b)
    in_flight = (__atomic_load_n(&exports[b], __ATOMIC_ACQUIRE) & ~kPinnedExport) != 0;
  ::munmap(p, len);
  return in_flight;
}

/// Same, by name relative to the directory `dirfd` (/dev/shm).
inline bool segment_in_flight_at(int dirfd, const char* name) noexcept {
  const int fd = ::openat(dirfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;
  const bool r = segment_in_flight(fd);
  ::close(fd);
  return r;
}

}  // namespace torchpar::detail
