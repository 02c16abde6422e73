#pragma once
// The one spin-then-futex waiter: waits for a condition on a 32-bit word in shared memory
// (a sequence number, a flag, a semaphore's count) that another thread or process changes
// and then wakes with futex_wake_n. Spins first (a wait that ends within microseconds costs
// no system call), then sleeps on the word's futex in slices, looking after each slice at
// the condition, at whether the other side is still alive, and at the deadline. Each caller
// keeps its own spin and sleep policy as parameters. See tests/core/core_test.cpp.

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "core/cpu_relax.h"
#include "core/deadline.h"
#include "core/futex.h"
#include "torchpar/core/error.h"

namespace torchpar::detail {

/// How a waiter spins before it sleeps. The default spins not at all.
struct SpinPolicy {
  /// Looks at the condition while spinning (0: no spin).
  int looks = 0;
  /// CPU pauses (cpu_relax) before each look.
  int pauses = 1;
  /// Stop spinning once it took this long, too (0: `looks` alone bounds it). The clock is
  /// read once at the start and then every kClockEvery looks.
  std::chrono::nanoseconds budget{0};
  /// Counted in pauses: sched_yield after a failed look once `yield_every` pauses passed
  /// since the last (0: never), so that a peer that shares this core can run; and ask the
  /// spin's yield hint once `hint_every` passed (0: never), yielding when it says so. With
  /// `pauses` dividing them (or above them: every look) this is every N pauses exactly.
  int yield_every = 0;
  int hint_every = 0;
  /// Once the spin ended: this many rounds of sched_yield, each followed by a look.
  int yields = 0;

  static constexpr int kClockEvery = 64;
};

/// How a waiter sleeps, once its spin ended.
struct SleepPolicy {
  /// The longest single futex sleep: liveness is looked at after each (a wake-up lost to a
  /// peer that died between its store and its wake costs at most this).
  std::chrono::nanoseconds slice = kMaxFutexSleep;
  /// During the first `short_for` of the sleep: slices of `short_slice` (0: none).
  std::chrono::nanoseconds short_slice{0};
  std::chrono::nanoseconds short_for{0};
  /// Ask the liveness predicate at most this often (0: after every slice).
  std::chrono::nanoseconds check_every{0};
};

/// How a sleeping waiter tells wakers that it sleeps, so that they call futex_wake only
/// then. The waiter marks (seq_cst), then looks at the word (seq_cst); a waker must change
/// the word (seq_cst) before it looks at the mark (seq_cst): either the waiter sees the
/// change and does not sleep, or the waker sees the mark and wakes it.
struct SleeperMark {
  enum class Kind {
    kNone,   ///< wakers always call futex_wake
    kFlag,   ///< one sleeper at most: 1 while it sleeps, 0 otherwise
    kCount,  ///< a count of sleepers
  };
  uint32_t* word = nullptr;
  Kind kind = Kind::kNone;

  static SleeperMark flag(uint32_t* w) { return {w, Kind::kFlag}; }
  static SleeperMark count(uint32_t* w) { return {w, Kind::kCount}; }

  void mark() const {
    if (kind == Kind::kFlag) atomic_word(*word).store(1, std::memory_order_seq_cst);
    if (kind == Kind::kCount) atomic_word(*word).fetch_add(1, std::memory_order_seq_cst);
  }
  void unmark() const {
    // A flag's clear needs no order: the waiter looks at the word again right after.
    if (kind == Kind::kFlag) atomic_word(*word).store(0, std::memory_order_relaxed);
    if (kind == Kind::kCount) atomic_word(*word).fetch_sub(1, std::memory_order_seq_cst);
  }
};

/// A wait's parameters besides its word, condition and deadline.
struct WaitOptions {
  SpinPolicy spin{};
  SleepPolicy sleep{};
  SleeperMark sleeper{};
  /// Return WaitStatus::kSlept after this many slices (0: no limit), for a caller that
  /// re-checks its state under a lock between slices.
  int max_slices = 0;
  /// What is waited for, for the timeout's message: when set, a timeout throws
  /// TimeoutError("no <what> before the deadline") instead of returning kTimedOut.
  const char* what = nullptr;
};

/// How a wait ended, when it did not throw.
enum class WaitStatus {
  kReady,     ///< the condition held at the last look
  kTimedOut,  ///< the deadline passed (WaitOptions::what unset)
  kGone,      ///< the liveness predicate said false (and the condition did not hold)
  kSlept,     ///< WaitOptions::max_slices slices passed
};

/// The defaults of the waits' hooks.
struct AlwaysAlive {
  bool operator()() const { return true; }
};
struct NoHook {
  void operator()() const {}
};
struct NeverYield {
  bool operator()() const { return false; }
};

/// The spin phase alone: returns true as soon as `ready(value of *word)` holds (acquire
/// loads), false when `policy` is used up. `looks`, when given, counts the looks made.
/// `yield_hint()` (policy.hint_every) may ask to give the core away.
template <class Ready, class YieldHint = NeverYield>
bool spin_until(uint32_t* word, Ready&& ready, const SpinPolicy& policy, int* looks = nullptr,
                YieldHint&& yield_hint = {}) {
  auto w = atomic_word(*word);
  if (policy.looks > 0) {
    const bool timed = policy.budget.count() > 0;
    const auto until = timed ? SteadyClock::now() + policy.budget : SteadyClock::time_point{};
    // Pauses left until the next yield and the next look at the hint: countdowns, so that
    // the spin's hot path has no division.
    int to_yield = policy.yield_every;
    int to_hint = policy.hint_every;
    for (int i = 1; i <= policy.looks; ++i) {
      for (int p = 0; p < policy.pauses; ++p) cpu_relax();
      if (looks) ++*looks;
      if (ready(w.load(std::memory_order_acquire))) return true;
      if (timed && i % SpinPolicy::kClockEvery == 0 && SteadyClock::now() >= until) break;
      bool give_way = false;
      if (policy.yield_every > 0 && (to_yield -= policy.pauses) <= 0) {
        to_yield = policy.yield_every;
        give_way = true;
      }
      if (policy.hint_every > 0 && (to_hint -= policy.pauses) <= 0) {
        to_hint = policy.hint_every;
        give_way = give_way || yield_hint();
      }
      if (give_way) ::sched_yield();
    }
  }
  for (int i = 0; i < policy.yields; ++i) {
    ::sched_yield();
    if (ready(w.load(std::memory_order_acquire))) return true;
  }
  return false;
}

/// The sleep phase alone: until `ready(value of *word)` holds, sleeps on the word's futex
/// in slices (marking itself as `o.sleeper` says, `before_look()` between the mark and the
/// look that decides to sleep). After each slice: the condition (kReady), then `alive()`
/// (at most every o.sleep.check_every; false: the condition once more, else kGone), then
/// the deadline (kTimedOut, or TimeoutError when o.what is set), then o.max_slices (kSlept).
/// Safety: `ready` may be called any number of times and must not change state.
template <class Ready, class Alive = AlwaysAlive, class BeforeLook = NoHook>
WaitStatus sleep_until(uint32_t* word, Ready&& ready, const Deadline& deadline,
                       const WaitOptions& o, Alive&& alive = {}, BeforeLook&& before_look = {}) {
  auto w = atomic_word(*word);
  const SleepPolicy& p = o.sleep;
  const bool timed = p.short_for.count() > 0 || p.check_every.count() > 0;
  const auto from = timed ? SteadyClock::now() : SteadyClock::time_point{};
  auto last_check = from;
  for (int slices = 1;; ++slices) {
    const auto slice = p.short_for.count() > 0 && SteadyClock::now() - from < p.short_for
                           ? p.short_slice
                           : p.slice;
    o.sleeper.mark();
    before_look();
    const uint32_t seen = w.load(std::memory_order_seq_cst);
    if (!ready(seen)) futex_wait_until(word, seen, deadline, slice);
    o.sleeper.unmark();
    if (ready(w.load(std::memory_order_acquire))) return WaitStatus::kReady;
    bool check = true;
    if (p.check_every.count() > 0) {
      const auto now = SteadyClock::now();
      check = now - last_check > p.check_every;
      if (check) last_check = now;
    }
    if (check && !alive()) {
      // The other side may have changed the word just before it went away.
      return ready(w.load(std::memory_order_acquire)) ? WaitStatus::kReady : WaitStatus::kGone;
    }
    if (deadline.expired()) {
      if (o.what) throw TimeoutError(std::string("no ") + o.what + " before the deadline");
      return WaitStatus::kTimedOut;
    }
    if (o.max_slices > 0 && slices >= o.max_slices) return WaitStatus::kSlept;
  }
}

/// Waits until `ready(value of *word)` holds: spin_until(o.spin), then sleep_until.
/// Returns and throws as sleep_until; kReady at once when the spin saw the condition.
///
/// Requires: whoever makes the condition true changes *word and then calls futex_wake_n on
///           it (when o.sleeper is set: only if the mark is set, see SleeperMark).
/// Guarantees: returns within the deadline plus one slice; without a deadline, waits
///           until the condition holds or `alive()` says false.
/// Safety: any number of waiters on one word, from any threads and processes.
template <class Ready, class Alive = AlwaysAlive>
WaitStatus wait_until(uint32_t* word, Ready&& ready, const Deadline& deadline,
                      const WaitOptions& o = {}, Alive&& alive = {}) {
  if (spin_until(word, ready, o.spin)) return WaitStatus::kReady;
  return sleep_until(word, ready, deadline, o, alive);
}

}  // namespace torchpar::detail
