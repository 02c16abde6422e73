#pragma once
// Deadlines and futex waits on 32-bit words in shared memory (process-shared: no
// FUTEX_PRIVATE_FLAG). The one copy of this mechanism; see tests/core/core_test.cpp.

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <optional>

namespace torchpar::detail {

/// CLOCK_MONOTONIC (libstdc++'s steady_clock), so a deadline converts to the timespec
/// that pthread_mutex_clocklock(CLOCK_MONOTONIC) takes.
using SteadyClock = std::chrono::steady_clock;
/// A point in time a blocking call gives up at; nullopt: never.
using Deadline = std::optional<SteadyClock::time_point>;

/// Now + `timeout` (negative counts as 0); nullopt for nullopt.
inline Deadline deadline_after(std::optional<std::chrono::duration<double>> timeout) {
  if (!timeout) return std::nullopt;
  const auto t = std::max(*timeout, std::chrono::duration<double>(0));
  return SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(t);
}

/// True once `d` has passed (never for nullopt).
inline bool past(const Deadline& d) { return d && SteadyClock::now() >= *d; }

/// The longest single futex sleep: a wake-up lost to a peer killed between its store and
/// its wake costs at most this.
inline constexpr std::chrono::milliseconds kMaxFutexSleep{100};

/// Sleeps while *addr == expected, until woken, the deadline, or `max_sleep` (spurious
/// returns are allowed: callers re-check their condition). Returns at once when the
/// deadline has passed.
inline void futex_wait_until(uint32_t* addr, uint32_t expected, const Deadline& deadline,
                             std::chrono::nanoseconds max_sleep = kMaxFutexSleep) {
  auto left = max_sleep;
  if (deadline) {
    const auto d =
        std::chrono::duration_cast<std::chrono::nanoseconds>(*deadline - SteadyClock::now());
    if (d.count() <= 0) return;
    left = std::min(left, d);
  }
  struct timespec ts {};
  ts.tv_sec = left.count() / 1000000000;
  ts.tv_nsec = left.count() % 1000000000;
  ::syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

/// An atomic view of a 32-bit word in shared memory (futex words, counters).
inline std::atomic_ref<uint32_t> atomic_word(uint32_t& w) { return std::atomic_ref<uint32_t>(w); }

/// Wakes up to `n` waiters on `addr`; returns how many were woken.
inline int futex_wake_n(uint32_t* addr, int n) {
  return static_cast<int>(::syscall(SYS_futex, addr, FUTEX_WAKE, n, nullptr, nullptr, 0));
}

}  // namespace torchpar::detail
