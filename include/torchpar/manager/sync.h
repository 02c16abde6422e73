#pragma once
/// Proxies of the manager's blocking types: a Queue and the synchronization primitives of
/// Python's threading module, living in a Manager's server process (Python's
/// SyncManager.Queue, Lock, RLock, Event, Semaphore, BoundedSemaphore, Condition, Barrier
/// and their proxies, managers.AcquirerProxy, EventProxy, ConditionProxy, BarrierProxy).
///
/// Unlike torchpar's own Queue and primitives (torchpar/ipc/), which live in shared memory
/// of one host, these are reachable from every process that can reach the manager, other
/// hosts included, at the cost of one round trip per call. A call that blocks waits in the
/// server on a connection of its own, so it holds up no other thread of the caller. When the
/// caller dies (or closes its connection) while blocked, its call ends in the server
/// without taking anything: a get of a dead client consumes no item, an acquire takes no
/// lock. What a dead client already holds stays held (a Lock it acquired stays locked,
/// as with Python's manager).
///
/// Timeouts: a blocking method's `timeout` is how long it may wait in the server (nullopt:
/// no limit; zero or negative: try once); the reply is awaited for that plus the manager's
/// call timeout (ManagerOptions::timeout).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "torchpar/core/error.h"
#include "torchpar/core/timeout.h"
#include "torchpar/manager/proxy.h"

namespace torchpar {

namespace detail {
/// A Timeout as the served types take it: seconds, nullopt for no limit.
inline std::optional<double> timeout_seconds(Timeout timeout) {
  return timeout ? std::optional<double>(timeout->count()) : std::nullopt;
}
/// How long a call may block in the server: `timeout` when blocking (at least 0), 0 when
/// not.
inline Timeout blocking_wait(bool block, Timeout timeout) {
  const std::chrono::duration<double> zero(0);
  if (!block) return zero;
  return timeout ? Timeout(std::max(*timeout, zero)) : Timeout(std::nullopt);
}
}  // namespace detail

/// A queue.Queue in the manager's server. Items are any torchpar-serializable type
/// (tensors included, copied both ways), delivered in FIFO order, each to one getter.
///
/// Example:
///   torchpar::Manager manager;
///   auto q = manager.Queue<at::Tensor>(8);           // at most 8 items
///   torchpar::Process producer(produce, q);           // calls q.put(...)
///   producer.start();
///   at::Tensor t = q.get(true, std::chrono::seconds(10));
///
/// Errors:   get raises torchpar::Empty and put torchpar::Full (the types torchpar::Queue
///           raises) when the timeout passes or, not blocking, at once; otherwise as
///           BaseProxy.
/// Lifetime, safety: see BaseProxy. Source: multiprocessing.managers.SyncManager.Queue
///           (queue.Queue behind a proxy).
template <class T>
class QueueProxy : public BaseProxy {
 public:
  QueueProxy() = default;
  /// A proxy for the queue `ref` refers to (Manager::Queue makes them).
  explicit QueueProxy(std::shared_ptr<detail::ProxyRef> ref) : BaseProxy(std::move(ref)) {}

  /// Appends `item`; when the queue is full (maxsize > 0), waits for room up to `timeout`
  /// (block false: not at all). Errors: Full when there was no room. Source: Queue.put.
  void put(const T& item, bool block = true, Timeout timeout = std::nullopt) {
    call("put", encode(std::make_tuple(encode(item), block, detail::timeout_seconds(timeout))),
         detail::blocking_wait(block, timeout));
  }
  /// Removes and returns the oldest item, waiting for one up to `timeout` (block false: not
  /// at all). Errors: Empty when none came. Source: Queue.get.
  T get(bool block = true, Timeout timeout = std::nullopt) {
    return decode<T>(call("get", encode(std::make_tuple(block, detail::timeout_seconds(timeout))),
                          detail::blocking_wait(block, timeout)));
  }
  /// put(item, false). Source: Queue.put_nowait.
  void put_nowait(const T& item) { put(item, false); }
  /// get(false). Source: Queue.get_nowait.
  T get_nowait() { return get(false); }
  /// Items in the queue now (others may change it right after). Source: Queue.qsize.
  size_t qsize() const { return static_cast<size_t>(decode<int64_t>(call_method("qsize", {}))); }
  /// qsize() == 0. Source: Queue.empty.
  bool empty() const { return decode<bool>(call_method("empty", {})); }
  /// maxsize > 0 and qsize() >= maxsize. Source: Queue.full.
  bool full() const { return decode<bool>(call_method("full", {})); }
  /// Marks one item got earlier as processed (for join). Errors: RemoteError "ValueError"
  /// when called more often than items were put. Source: Queue.task_done.
  void task_done() { call_method("task_done", {}); }
  /// Waits until every item put was marked with task_done, up to `timeout`; false when the
  /// timeout passed. Source: Queue.join (which has no timeout).
  bool join(Timeout timeout = std::nullopt) {
    return decode<bool>(call_method("join",
                                    encode(std::make_tuple(detail::timeout_seconds(timeout))),
                                    detail::blocking_wait(true, timeout)));
  }

 private:
  std::string call(const std::string& method, const std::string& args, Timeout wait) {
    try {
      return call_method(method, args, wait);
    } catch (const RemoteError& e) {
      if (e.type() == "Empty") throw Empty("manager queue at " + address() + ": " + e.message());
      if (e.type() == "Full") throw Full("manager queue at " + address() + ": " + e.message());
      throw;
    }
  }
};

/// Acquire and release of a lock or semaphore in the manager's server, plus the members
/// std::lock_guard and std::unique_lock use (lock, try_lock, unlock).
///
/// Example:
///   auto lock = manager.Lock();
///   {
///     std::lock_guard<torchpar::LockProxy> hold(lock);   // acquire() ... release()
///     ...
///   }
///
/// Lifetime, safety and errors: see BaseProxy. Source: multiprocessing.managers.AcquirerProxy.
class AcquirerProxy : public BaseProxy {
 public:
  /// Takes the lock (a unit of a semaphore), waiting up to `timeout` (blocking false: not
  /// at all); true when taken. Source: Lock.acquire(blocking, timeout).
  bool acquire(bool blocking = true, Timeout timeout = std::nullopt) {
    return decode<bool>(
        call_method("acquire", encode(std::make_tuple(blocking, detail::timeout_seconds(timeout))),
                    detail::blocking_wait(blocking, timeout)));
  }
  /// Gives the lock (one unit, one level of an RLock) back. Errors: RemoteError
  /// "RuntimeError" for a lock not held ("release unlocked lock"; for an RLock or a
  /// Condition held by another thread or not at all, "cannot release un-acquired lock").
  /// Source: Lock.release.
  void release() { call_method("release", {}); }
  /// acquire() without a limit (std::lock_guard).
  void lock() { acquire(); }
  /// acquire(false) (std::unique_lock's try_lock).
  bool try_lock() { return acquire(false); }
  /// release(), with errors swallowed, as the destructors of std::lock_guard and
  /// std::unique_lock call it and must not throw; call release() to see them.
  void unlock() noexcept {
    try {
      release();
    } catch (...) {  // the manager is gone, or the lock was not held
    }
  }

 protected:
  AcquirerProxy() = default;
  explicit AcquirerProxy(std::shared_ptr<detail::ProxyRef> ref) : BaseProxy(std::move(ref)) {}
};

/// A threading.Lock in the manager's server: not recursive, and any caller may release it
/// (as Python's Lock; torchpar::Lock requires its holder to). A holder that dies leaves it
/// locked.
///
/// Example:
///   auto lock = manager.Lock();
///   if (lock.acquire(true, std::chrono::seconds(1))) { ...; lock.release(); }
///
/// Lifetime, safety and errors: see AcquirerProxy and BaseProxy. Source:
/// multiprocessing.managers.SyncManager.Lock.
class LockProxy : public AcquirerProxy {
 public:
  LockProxy() = default;
  /// A proxy for the lock `ref` refers to (Manager::Lock makes them).
  explicit LockProxy(std::shared_ptr<detail::ProxyRef> ref) : AcquirerProxy(std::move(ref)) {}
  /// True while someone holds it (it may change right after). Source: Lock.locked.
  bool locked() const { return decode<bool>(call_method("locked", {})); }
};

/// A threading.RLock in the manager's server: its owner is the calling thread of the
/// calling process (two threads of one process are two owners), which may acquire it again
/// and must release it as often.
///
/// Example:
///   auto rlock = manager.RLock();
///   rlock.acquire(); rlock.acquire();   // the same thread: both succeed
///   rlock.release(); rlock.release();
///
/// Errors:   release by a thread that does not own it: RemoteError "RuntimeError"
///           ("cannot release un-acquired lock"); otherwise as AcquirerProxy.
/// Lifetime, safety: see BaseProxy. Source: multiprocessing.managers.SyncManager.RLock.
class RLockProxy : public AcquirerProxy {
 public:
  RLockProxy() = default;
  /// A proxy for the RLock `ref` refers to (Manager::RLock makes them).
  explicit RLockProxy(std::shared_ptr<detail::ProxyRef> ref) : AcquirerProxy(std::move(ref)) {}
};

/// A threading.Semaphore or threading.BoundedSemaphore in the manager's server: acquire
/// takes a unit (waiting while there is none), release gives units back.
///
/// Example:
///   auto slots = manager.BoundedSemaphore(2);   // two holders at a time
///   std::lock_guard<torchpar::SemaphoreProxy> hold(slots);
///
/// Errors:   release(n) with n < 1, or that would lift a BoundedSemaphore above its initial
///           value: RemoteError "ValueError" ("Semaphore released too many times"), and
///           nothing is released; otherwise as AcquirerProxy.
/// Lifetime, safety: see BaseProxy. Units held by a process that dies are not returned.
/// Source:   multiprocessing.managers.SyncManager.Semaphore / BoundedSemaphore.
class SemaphoreProxy : public AcquirerProxy {
 public:
  SemaphoreProxy() = default;
  /// A proxy for the semaphore `ref` refers to (Manager::Semaphore makes them).
  explicit SemaphoreProxy(std::shared_ptr<detail::ProxyRef> ref) : AcquirerProxy(std::move(ref)) {}
  /// Gives `n` units back, waking as many waiters. Source: Semaphore.release(n).
  void release(int64_t n = 1) { call_method("release", encode(std::make_tuple(n))); }
  /// The units free now (it may change right after). Source: Semaphore._value.
  int64_t get_value() const { return decode<int64_t>(call_method("get_value", {})); }
};

/// A threading.Event in the manager's server: a flag that wait() waits for.
///
/// Example:
///   auto ready = manager.Event();
///   // in a child: ready.set();
///   if (!ready.wait(std::chrono::seconds(10))) { ... }   // timed out
///
/// Lifetime, safety and errors: see BaseProxy. Source:
/// multiprocessing.managers.SyncManager.Event / EventProxy.
class EventProxy : public BaseProxy {
 public:
  EventProxy() = default;
  /// A proxy for the event `ref` refers to (Manager::Event makes them).
  explicit EventProxy(std::shared_ptr<detail::ProxyRef> ref) : BaseProxy(std::move(ref)) {}
  /// Sets the flag and wakes every waiter. Source: Event.set.
  void set() { call_method("set", {}); }
  /// Clears the flag. Source: Event.clear.
  void clear() { call_method("clear", {}); }
  /// The flag. Source: Event.is_set.
  bool is_set() const { return decode<bool>(call_method("is_set", {})); }
  /// Waits until the flag is set, up to `timeout`; the flag at the end (false: timed out).
  /// Source: Event.wait.
  bool wait(Timeout timeout = std::nullopt) const {
    return decode<bool>(call_method("wait",
                                    encode(std::make_tuple(detail::timeout_seconds(timeout))),
                                    detail::blocking_wait(true, timeout)));
  }
};

/// A threading.Condition in the manager's server, over a lock of its own with RLock
/// semantics (owner: the calling thread of the calling process). acquire and release are
/// that lock's (AcquirerProxy); wait and notify require holding it.
///
/// Example:
///   auto cond = manager.Condition();
///   auto box = manager.dict<std::string, int64_t>();
///   std::lock_guard<torchpar::ConditionProxy> hold(cond);
///   cond.wait_for([&] { return box.contains("done"); }, std::chrono::seconds(10));
///
/// Errors:   wait, notify and notify_all without holding the lock: RemoteError
///           "RuntimeError" ("cannot wait on un-acquired lock", "cannot notify on
///           un-acquired lock"); otherwise as AcquirerProxy.
/// Lifetime, safety: see BaseProxy. Source: multiprocessing.managers.SyncManager.Condition
///           / ConditionProxy (Python's may take another lock; this one has its own).
class ConditionProxy : public AcquirerProxy {
 public:
  ConditionProxy() = default;
  /// A proxy for the condition `ref` refers to (Manager::Condition makes them).
  explicit ConditionProxy(std::shared_ptr<detail::ProxyRef> ref) : AcquirerProxy(std::move(ref)) {}
  /// Releases the lock (every level), waits for a notify up to `timeout`, and takes the
  /// lock back (as often as it was held; in the server that part has no limit, as in
  /// Python, so it counts against the manager's call timeout). True when notified, false
  /// when the timeout passed. Source: Condition.wait.
  bool wait(Timeout timeout = std::nullopt) {
    return decode<bool>(call_method("wait",
                                    encode(std::make_tuple(detail::timeout_seconds(timeout))),
                                    detail::blocking_wait(true, timeout)));
  }
  /// Waits (as wait) until `predicate()` holds, up to `timeout` in all; returns its last
  /// value. The predicate runs here, with the lock held. Source: ConditionProxy.wait_for.
  template <class Predicate>
  bool wait_for(Predicate predicate, Timeout timeout = std::nullopt) {
    using Clock = std::chrono::steady_clock;
    bool result = predicate();
    const auto start = Clock::now();
    while (!result) {
      Timeout left = std::nullopt;
      if (timeout) {
        left = *timeout - std::chrono::duration<double>(Clock::now() - start);
        if (left->count() <= 0) break;
      }
      wait(left);
      result = predicate();
    }
    return result;
  }
  /// Wakes up to `n` of the threads waiting now, the longest-waiting first. Source:
  /// Condition.notify.
  void notify(int64_t n = 1) { call_method("notify", encode(std::make_tuple(n))); }
  /// Wakes every thread waiting now. Source: Condition.notify_all.
  void notify_all() { call_method("notify_all", {}); }
};

/// A threading.Barrier (without an action) in the manager's server: `parties` callers of
/// wait() meet, then all return and the barrier is ready for the next round.
///
/// Example:
///   auto barrier = manager.Barrier(3);
///   // in each of two children: barrier.wait(std::chrono::seconds(30));
///   int64_t index = barrier.wait(std::chrono::seconds(30));   // 0, 1 or 2
///
/// Errors:   wait raises torchpar::BrokenBarrierError when the barrier is broken or breaks
///           while it waits: abort(), reset() during a round, a waiter's timeout, or a
///           waiter whose process dies (each breaks it until reset()); otherwise as
///           BaseProxy.
/// Lifetime, safety: see BaseProxy. Source: multiprocessing.managers.SyncManager.Barrier
///           / BarrierProxy.
class BarrierProxy : public BaseProxy {
 public:
  BarrierProxy() = default;
  /// A proxy for the barrier `ref` refers to (Manager::Barrier makes them).
  explicit BarrierProxy(std::shared_ptr<detail::ProxyRef> ref) : BaseProxy(std::move(ref)) {}
  /// Waits until `parties` callers wait; returns this caller's arrival index in [0,
  /// parties). `timeout` (nullopt: the barrier's own, given to Manager::Barrier) passing
  /// breaks the barrier. Source: Barrier.wait.
  int64_t wait(Timeout timeout = std::nullopt) {
    try {
      return decode<int64_t>(call_method("wait",
                                         encode(std::make_tuple(detail::timeout_seconds(timeout))),
                                         detail::blocking_wait(true, timeout)));
    } catch (const RemoteError& e) {
      if (e.type() == "BrokenBarrierError") {
        throw BrokenBarrierError("manager barrier at " + address() + ": " + e.message());
      }
      throw;
    }
  }
  /// Returns the barrier to its empty state; callers waiting now raise BrokenBarrierError.
  /// Source: Barrier.reset.
  void reset() { call_method("reset", {}); }
  /// Breaks the barrier: waiting and later callers of wait raise BrokenBarrierError until
  /// reset(). Source: Barrier.abort.
  void abort() { call_method("abort", {}); }
  /// Source: Barrier.parties.
  int64_t parties() const { return decode<int64_t>(call_method("parties", {})); }
  /// Callers waiting now. Source: Barrier.n_waiting.
  int64_t n_waiting() const { return decode<int64_t>(call_method("n_waiting", {})); }
  /// Source: Barrier.broken.
  bool broken() const { return decode<bool>(call_method("broken", {})); }
};

}  // namespace torchpar
