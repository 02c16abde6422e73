#pragma once
// The one deadline type of the library's internals: when a blocking call gives up, as a
// point on the steady clock, or never. Public signatures keep taking a Timeout (seconds,
// torchpar/core/timeout.h); a call turns it into a Deadline once, on entry, and passes that
// down, so nested waits share one limit. See tests/core/core_test.cpp.

#include <time.h>

#include <algorithm>
#include <chrono>
#include <optional>

#include "torchpar/core/timeout.h"

namespace torchpar::detail {

/// CLOCK_MONOTONIC (libstdc++'s steady_clock), so a deadline converts to the timespec
/// that pthread_mutex_clocklock(CLOCK_MONOTONIC) takes.
using SteadyClock = std::chrono::steady_clock;

/// A point in time a blocking call gives up at, or never (default-constructed, or from
/// std::nullopt). Spelled like the std::optional<time_point> it replaced: `if (deadline)`
/// asks "is there a limit", `*deadline` is the point (only when there is one).
///
/// Units:  SteadyClock (CLOCK_MONOTONIC); a wall-clock step does not move it.
/// Safety: a value type; const members are safe from any thread.
class Deadline {
 public:
  /// Never.
  constexpr Deadline() = default;
  constexpr Deadline(std::nullopt_t) {}  // NOLINT(google-explicit-constructor): as optional
  /// At `at`.
  constexpr Deadline(SteadyClock::time_point at)  // NOLINT(google-explicit-constructor)
      : at_(at), finite_(true) {}

  /// Timeouts longer than this (~31 years) wait without a limit: now + the timeout in
  /// nanoseconds would overflow the clock's range.
  static constexpr std::chrono::duration<double> kLongest{1e9};

  /// Now + `timeout` (zero, negative or NaN: now, so that the deadline has passed at the
  /// first look); never for std::nullopt or a timeout over kLongest.
  static Deadline after(Timeout timeout) {
    if (!timeout || timeout->count() > kLongest.count()) return {};
    const double t = timeout->count() > 0 ? timeout->count() : 0.0;  // NaN compares false
    return SteadyClock::now() +
           std::chrono::duration_cast<SteadyClock::duration>(std::chrono::duration<double>(t));
  }

  /// True when there is a limit.
  constexpr bool finite() const { return finite_; }
  constexpr explicit operator bool() const { return finite_; }
  /// The point; only when finite().
  constexpr const SteadyClock::time_point& operator*() const { return at_; }
  constexpr const SteadyClock::time_point* operator->() const { return &at_; }
  /// The point, or SteadyClock::time_point::max() for never.
  constexpr SteadyClock::time_point at() const {
    return finite_ ? at_ : SteadyClock::time_point::max();
  }

  /// True once the point has passed (never for never). Reads the clock when finite.
  bool expired() const { return finite_ && SteadyClock::now() >= at_; }

  /// The time left (zero once passed), as the Timeout to hand to a call that takes one;
  /// std::nullopt for never.
  Timeout remaining() const {
    if (!finite_) return std::nullopt;
    return std::max(std::chrono::duration<double>(at_ - SteadyClock::now()),
                    std::chrono::duration<double>(0));
  }

  /// One futex sleep's relative timeout: the time left, at most `max`; std::nullopt once
  /// the point has passed (do not sleep).
  std::optional<struct timespec> futex_slice(std::chrono::nanoseconds max) const {
    auto left = max;
    if (finite_) {
      const auto d = std::chrono::duration_cast<std::chrono::nanoseconds>(at_ - SteadyClock::now());
      if (d.count() <= 0) return std::nullopt;
      left = std::min(left, d);
    }
    struct timespec ts {};
    ts.tv_sec = static_cast<time_t>(left.count() / 1000000000);
    ts.tv_nsec = static_cast<long>(left.count() % 1000000000);
    return ts;
  }

 private:
  SteadyClock::time_point at_{};
  bool finite_ = false;
};

/// Deadline::after(timeout): the spelling most call sites use.
inline Deadline deadline_after(Timeout timeout) { return Deadline::after(timeout); }

/// d.expired(), for call sites written against the optional this type replaced.
inline bool past(const Deadline& d) { return d.expired(); }

}  // namespace torchpar::detail
