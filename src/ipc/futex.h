#pragma once
// Futex waits on words in shared memory (process-shared: no FUTEX_PRIVATE_FLAG).

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <optional>

namespace torchpar::detail {

using SteadyClock = std::chrono::steady_clock;
using Deadline = std::optional<SteadyClock::time_point>;

inline Deadline deadline_after(std::optional<std::chrono::duration<double>> timeout) {
  if (!timeout) return std::nullopt;
  const auto t = std::max(*timeout, std::chrono::duration<double>(0));
  return SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(t);
}

inline bool past(const Deadline& d) { return d && SteadyClock::now() >= *d; }

/// Sleeps while *addr == expected, until woken or the deadline; each sleep is capped at
/// 100 ms so a wake-up lost to a killed peer costs at most that.
inline void futex_wait_until(uint32_t* addr, uint32_t expected, const Deadline& deadline) {
  auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::milliseconds(100));
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

inline void futex_wake_n(uint32_t* addr, int n) {
  ::syscall(SYS_futex, addr, FUTEX_WAKE, n, nullptr, nullptr, 0);
}

}  // namespace torchpar::detail
