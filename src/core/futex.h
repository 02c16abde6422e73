#pragma once
// Futex waits and wakes on 32-bit words in shared memory (process-shared: no
// FUTEX_PRIVATE_FLAG): the system calls. Waiting for a condition (spin, sleeper flag,
// slices, liveness, deadline) is core/waiter.h, built on these; see tests/core/core_test.cpp.

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>

#include "core/deadline.h"

namespace torchpar::detail {

/// The longest single futex sleep: a wake-up lost to a peer killed between its store and
/// its wake costs at most this.
inline constexpr std::chrono::milliseconds kMaxFutexSleep{100};

/// Sleeps while *addr == expected, until woken, the deadline, or `max_sleep` (spurious
/// returns are allowed: callers re-check their condition). Returns at once when the
/// deadline has passed.
inline void futex_wait_until(uint32_t* addr, uint32_t expected, const Deadline& deadline,
                             std::chrono::nanoseconds max_sleep = kMaxFutexSleep) {
  const auto ts = deadline.futex_slice(max_sleep);
  if (!ts) return;
  ::syscall(SYS_futex, addr, FUTEX_WAIT, expected, &*ts, nullptr, 0);
}

/// An atomic view of a 32-bit word in shared memory (futex words, counters).
inline std::atomic_ref<uint32_t> atomic_word(uint32_t& w) { return std::atomic_ref<uint32_t>(w); }

/// Wakes up to `n` waiters on `addr`; returns how many were woken.
inline int futex_wake_n(uint32_t* addr, int n) {
  return static_cast<int>(::syscall(SYS_futex, addr, FUTEX_WAKE, n, nullptr, nullptr, 0));
}

}  // namespace torchpar::detail
