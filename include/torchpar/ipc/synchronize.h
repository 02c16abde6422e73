#pragma once
/// Process-shared synchronization primitives (Python's multiprocessing.synchronize):
/// Lock, RLock, Semaphore, BoundedSemaphore, Condition, Event, Barrier.
///
/// Each lives in a small shared-memory object. Copies share it; pass one to a child as a
/// Process argument (every start method). Every blocking call takes a timeout
/// (std::chrono duration; nullopt blocks).
///
/// Owner death: Lock and RLock are robust mutexes. When the process holding one dies, the
/// next acquire succeeds and reports it: owner_died() is true after that acquire (the data
/// the lock guarded may be half-updated; check it). Semaphore units held by a dead process
/// are not returned (as with POSIX semaphores). A Barrier whose party dies times out
/// (BrokenBarrierError) rather than hanging, when a timeout is given.

#include <chrono>
#include <functional>
#include <memory>
#include <optional>

#include "torchpar/core/error.h"
#include "torchpar/core/timeout.h"
#include "torchpar/ipc/detail/shared_page.h"

namespace torchpar {

/// Mutual exclusion between processes and threads.
/// Requires: release() by the holder (unlike Python's Lock, which any thread may release).
/// Guarantees: acquire returns false only when the timeout passed (timeout 0: a try).
/// Safety: thread- and process-safe. Source: multiprocessing.Lock.
class Lock {
 public:
  Lock();
  bool acquire(Timeout timeout = std::nullopt);
  void release();
  /// True when the last successful acquire through this object recovered the lock from a
  /// dead owner.
  bool owner_died() const { return owner_died_; }
  void save(detail::OutputArchive& ar) const;
  void load(detail::InputArchive& ar);

 protected:
  explicit Lock(bool recursive);
  std::shared_ptr<detail::SharedPage> page_;
  bool owner_died_ = false;

 private:
  friend class Condition;
  /// Releases every level the calling holder holds (RLock) and returns how many; with
  /// acquire_n, what Condition::wait uses.
  uint32_t release_all();
  void acquire_n(uint32_t n);
};

/// A Lock the holder may acquire again (released as often as acquired). Source:
/// multiprocessing.RLock.
class RLock : public Lock {
 public:
  RLock();
};

/// RAII holder: acquires in the constructor (blocking), releases in the destructor.
template <class L>
class LockGuard {
 public:
  explicit LockGuard(L& l) : l_(l) { l_.acquire(); }
  ~LockGuard() { l_.release(); }
  LockGuard(const LockGuard&) = delete;
  LockGuard& operator=(const LockGuard&) = delete;

 private:
  L& l_;
};

/// A counter: acquire takes one unit (waiting while 0), release returns one.
/// Source: multiprocessing.Semaphore.
class Semaphore {
 public:
  explicit Semaphore(uint32_t value = 1);
  bool acquire(Timeout timeout = std::nullopt);
  /// Errors: torchpar::Error for a BoundedSemaphore released above its initial value.
  void release();
  uint32_t get_value() const;
  void save(detail::OutputArchive& ar) const;
  void load(detail::InputArchive& ar);

 protected:
  Semaphore(uint32_t value, bool bounded);
  std::shared_ptr<detail::SharedPage> page_;
};

/// A Semaphore whose release may not exceed the initial value. Source:
/// multiprocessing.BoundedSemaphore.
class BoundedSemaphore : public Semaphore {
 public:
  explicit BoundedSemaphore(uint32_t value = 1);
};

/// A flag processes wait for. Source: multiprocessing.Event.
class Event {
 public:
  Event();
  void set();
  void clear();
  bool is_set() const;
  /// True when the flag is set (now or within `timeout`).
  bool wait(Timeout timeout = std::nullopt);
  void save(detail::OutputArchive& ar) const;
  void load(detail::InputArchive& ar);

 private:
  std::shared_ptr<detail::SharedPage> page_;
};

/// A condition variable bound to a Lock (an RLock by default).
/// Requires: the lock held around wait / notify (wait releases every level of an RLock and
/// restores them). wait returns true only for a notify meant for it; use wait_for to
/// re-check the predicate (another waiter may have changed it first).
/// Source: multiprocessing.Condition.
class Condition {
 public:
  Condition();
  explicit Condition(Lock lock);
  bool acquire(Timeout timeout = std::nullopt) { return lock_.acquire(timeout); }
  void release() { lock_.release(); }
  /// Releases the lock, waits for a notify (or the timeout), re-acquires. False on timeout.
  bool wait(Timeout timeout = std::nullopt);
  /// Waits until pred() is true; returns its last value (false: timed out).
  bool wait_for(const std::function<bool()>& pred, Timeout timeout = std::nullopt);
  /// Wakes exactly min(n, waiting) waiters, the longest waiting first and only those that
  /// waited before this call (each of their waits returns true); a notify with no waiter is
  /// not remembered. Python: Condition.notify(n).
  /// Limits: at most 1000 waiters at once; a waiter whose process died is skipped (and its
  /// place freed) by the notify that finds it.
  void notify(int n = 1);
  void notify_all();
  Lock& lock() { return lock_; }
  void save(detail::OutputArchive& ar) const;
  void load(detail::InputArchive& ar);

 private:
  Lock lock_;
  std::shared_ptr<detail::SharedPage> page_;
};

/// N parties meet: wait() returns when `parties` processes/threads called it; one of them
/// runs `action` first. Errors: BrokenBarrierError on abort, reset, or a timeout (which
/// breaks the barrier for every waiter). Source: multiprocessing.Barrier.
class Barrier {
 public:
  explicit Barrier(uint32_t parties = 1, std::function<void()> action = {},
                   Timeout timeout = std::nullopt);
  /// Returns this party's index in [0, parties).
  uint32_t wait(Timeout timeout = std::nullopt);
  void reset();
  void abort();
  uint32_t parties() const;
  uint32_t n_waiting() const;
  bool broken() const;
  /// The action this copy runs when its wait() is the one that trips the barrier. Actions
  /// do not cross processes: a copy loaded in another process has none until it sets one
  /// (the Python package sets the unpickled callable). Not thread-safe against wait().
  void set_action(std::function<void()> action) { action_ = std::move(action); }
  void save(detail::OutputArchive& ar) const;
  void load(detail::InputArchive& ar);

 private:
  std::shared_ptr<detail::SharedPage> page_;
  std::function<void()> action_;
  Timeout default_timeout_;
};

}  // namespace torchpar
