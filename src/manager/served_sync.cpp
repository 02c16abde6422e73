// The manager's blocking types: "Queue", "Lock", "RLock", "Event", "Semaphore",
// "BoundedSemaphore", "Condition" and "Barrier" (what the proxies of
// torchpar/manager/sync.h talk to). Python's queue.Queue and threading's primitives, as
// SyncManager serves them.
//
// Each object has its own mutex and condition variable and runs calls concurrently
// (serialized() is false): a blocked call waits with CallContext::wait, which aborts when
// its client is gone. A waiter whose client is gone takes nothing: the predicate may hold
// when the wait ends (an item came, the lock was freed) just as the client died, so every
// wait is followed by one more look at the client (wait_alive) before the call takes what it
// waited for. Every change of state wakes every waiter (notify_all): a waiter that aborts
// must not swallow a wakeup meant for a live one.

#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "manager/server.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar::detail {
namespace {

using Bytes = std::string;
/// A timeout as the proxies send it: seconds, nullopt for no limit.
using Seconds = std::optional<double>;

Timeout to_timeout(Seconds s) {
  return s ? Timeout(std::chrono::duration<double>(*s)) : Timeout(std::nullopt);
}

/// The timeout of a call that may block: none when not blocking (try once).
Timeout blocking_timeout(bool block, Seconds s) {
  return block ? to_timeout(s) : Timeout(std::chrono::duration<double>(0));
}

std::string describe(Seconds s) {
  return s ? fmt::format("within {} s", *s) : std::string("(no timeout)");
}

[[noreturn]] void client_gone() {
  throw ServedError("ConnectionAbortedError", "the client left while its call was waiting");
}

/// CallContext::wait, then one more look at the client when pred() holds: a call of a dead
/// client must not take what it waited for.
template <class Pred>
bool wait_alive(const CallContext& context, std::condition_variable& cv,
                std::unique_lock<std::mutex>& lock, Timeout timeout, Pred pred) {
  const bool ok = context.wait(cv, lock, timeout, pred);
  if (ok && context.peer_gone()) client_gone();
  return ok;
}

[[noreturn]] void not_exposed(const std::string& type_id, const std::string& method) {
  throw ServedError(
      "AttributeError",
      fmt::format("method '{}' of '{}' is not exposed by the manager", method, type_id));
}

// ---- Queue ----------------------------------------------------------------------------

/// queue.Queue of payload bytes (the server never decodes the items).
class ServedQueue final : public ServedObject {
 public:
  explicit ServedQueue(int64_t maxsize) : maxsize_(maxsize) {}
  bool serialized() const override { return false; }

  std::string call(const std::string& method, const std::string& args,
                   const CallContext& context) override {
    std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
    if (method == "put") {
      // Decoded (a copy of the item) before the lock: other calls need not wait for it.
      auto [item, block, timeout] = served_decode<std::tuple<Bytes, bool, Seconds>>(args);
      lock.lock();
      if (!wait_alive(context, cv_, lock, blocking_timeout(block, timeout),
                      [&] { return !full(); })) {
        throw ServedError(
            "Full", block ? fmt::format("put: the queue (maxsize {}) had no room {}", maxsize_,
                                        describe(timeout))
                          : fmt::format("put: the queue is full (maxsize {})", maxsize_));
      }
      items_.push_back(std::move(item));
      ++unfinished_;
      cv_.notify_all();
      return {};
    }
    lock.lock();
    if (method == "get") {
      const auto [block, timeout] = served_decode<std::tuple<bool, Seconds>>(args);
      bool got = false;
      ++getters_;
      try {
        got = wait_alive(context, cv_, lock, blocking_timeout(block, timeout),
                         [&] { return !items_.empty(); });
      } catch (...) {
        --getters_;
        throw;
      }
      --getters_;
      if (!got) {
        throw ServedError("Empty", block ? fmt::format("get: no item came {}", describe(timeout))
                                         : std::string("get: the queue is empty"));
      }
      Bytes item = std::move(items_.front());
      items_.pop_front();
      cv_.notify_all();
      return item;  // the item's payload bytes are the result
    }
    if (method == "qsize") return served_encode(static_cast<int64_t>(items_.size()));
    if (method == "empty") return served_encode(items_.empty());
    if (method == "full") return served_encode(full());
    // Getters waiting now: for tests and debugging (as Manager::number_of_objects).
    if (method == "_n_getters") return served_encode(getters_);
    if (method == "task_done") {
      if (unfinished_ <= 0) throw ServedError("ValueError", "task_done() called too many times");
      if (--unfinished_ == 0) cv_.notify_all();
      return {};
    }
    if (method == "join") {
      const auto [timeout] = served_decode<std::tuple<Seconds>>(args);
      return served_encode(
          context.wait(cv_, lock, to_timeout(timeout), [&] { return unfinished_ == 0; }));
    }
    not_exposed("Queue", method);
  }

 private:
  bool full() const { return maxsize_ > 0 && static_cast<int64_t>(items_.size()) >= maxsize_; }

  std::mutex mu_;
  std::condition_variable cv_;  // any change: an item in or out, unfinished_ at 0
  const int64_t maxsize_;       // <= 0: unbounded, as Python
  std::deque<Bytes> items_;
  int64_t unfinished_ = 0;  // puts not yet matched by task_done
  int64_t getters_ = 0;     // get calls waiting
};

// ---- Lock, RLock --------------------------------------------------------------------

/// A lock's state, guarded by its object's mutex: a threading.Lock (not recursive; any
/// caller may release it) or a threading.RLock (the owner is the calling client thread,
/// CallContext::caller). ServedLock and ServedCondition hold one.
struct LockState {
  bool recursive = false;
  uint64_t owner = 0;  // the caller that holds it (count > 0)
  int64_t count = 0;   // levels held (0 or 1 when not recursive)

  bool owned_by(uint64_t caller) const { return count > 0 && owner == caller; }

  /// Waits (on `cv`, with `lock` of the object's mutex) until the lock is free, up to
  /// `timeout`; true when taken.
  bool acquire(const CallContext& context, std::condition_variable& cv,
               std::unique_lock<std::mutex>& lock, Timeout timeout) {
    if (recursive && owned_by(context.caller)) {
      ++count;
      return true;
    }
    if (!wait_alive(context, cv, lock, timeout, [&] { return count == 0; })) return false;
    owner = context.caller;
    count = 1;
    return true;
  }

  /// One level back; wakes the waiters (`cv`) when the lock is free.
  void release(uint64_t caller, std::condition_variable& cv) {
    if (count == 0 || (recursive && owner != caller)) {
      throw ServedError("RuntimeError",
                        recursive ? "cannot release un-acquired lock" : "release unlocked lock");
    }
    if (--count == 0) {
      owner = 0;
      cv.notify_all();
    }
  }

  /// The lock's own methods, "acquire" and "release", called on an object that holds it
  /// (ServedLock, ServedCondition): their result's payload bytes; nullopt for any other
  /// method.
  std::optional<std::string> call(const std::string& method, const std::string& args,
                                  const CallContext& context, std::condition_variable& cv,
                                  std::unique_lock<std::mutex>& lock) {
    if (method == "acquire") {
      const auto [blocking, timeout] = served_decode<std::tuple<bool, Seconds>>(args);
      return served_encode(acquire(context, cv, lock, blocking_timeout(blocking, timeout)));
    }
    if (method == "release") {
      release(context.caller, cv);
      return std::string();
    }
    return std::nullopt;
  }
};

class ServedLock final : public ServedObject {
 public:
  explicit ServedLock(bool recursive) { state_.recursive = recursive; }
  bool serialized() const override { return false; }

  std::string call(const std::string& method, const std::string& args,
                   const CallContext& context) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (auto result = state_.call(method, args, context, cv_, lock)) return *std::move(result);
    if (method == "locked") return served_encode(state_.count > 0);
    not_exposed(state_.recursive ? "RLock" : "Lock", method);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;  // the lock was freed
  LockState state_;
};

// ---- Event --------------------------------------------------------------------------

class ServedEvent final : public ServedObject {
 public:
  bool serialized() const override { return false; }

  std::string call(const std::string& method, const std::string& args,
                   const CallContext& context) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (method == "set") {
      flag_ = true;
      cv_.notify_all();
      return {};
    }
    if (method == "clear") {
      flag_ = false;
      return {};
    }
    if (method == "is_set") return served_encode(flag_);
    if (method == "wait") {
      const auto [timeout] = served_decode<std::tuple<Seconds>>(args);
      return served_encode(context.wait(cv_, lock, to_timeout(timeout), [&] { return flag_; }));
    }
    not_exposed("Event", method);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool flag_ = false;
};

// ---- Semaphore, BoundedSemaphore ----------------------------------------------------

class ServedSemaphore final : public ServedObject {
 public:
  ServedSemaphore(int64_t value, bool bounded) : value_(value), initial_(value), bounded_(bounded) {
    if (value < 0) throw ServedError("ValueError", "semaphore initial value must be >= 0");
  }
  bool serialized() const override { return false; }

  std::string call(const std::string& method, const std::string& args,
                   const CallContext& context) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (method == "acquire") {
      const auto [blocking, timeout] = served_decode<std::tuple<bool, Seconds>>(args);
      const bool ok = wait_alive(context, cv_, lock, blocking_timeout(blocking, timeout),
                                 [&] { return value_ > 0; });
      if (ok) --value_;
      return served_encode(ok);
    }
    if (method == "release") {
      // No args: Python's default, n = 1 (what AcquirerProxy::release sends).
      const int64_t n = args.empty() ? 1 : std::get<0>(served_decode<std::tuple<int64_t>>(args));
      if (n < 1) throw ServedError("ValueError", "n must be one or more");
      if (bounded_ && value_ + n > initial_) {
        throw ServedError("ValueError", "Semaphore released too many times");
      }
      value_ += n;
      cv_.notify_all();
      return {};
    }
    if (method == "get_value") return served_encode(value_);
    not_exposed(bounded_ ? "BoundedSemaphore" : "Semaphore", method);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t value_;
  const int64_t initial_;
  const bool bounded_;
};

// ---- Condition ------------------------------------------------------------------------

/// threading.Condition over its own RLock (owner: the calling client thread). A notify
/// wakes the longest-waiting waiters, each once: waiters take a ticket, notify(n) moves the
/// first n tickets from waiting_ to notified_.
class ServedCondition final : public ServedObject {
 public:
  bool serialized() const override { return false; }

  std::string call(const std::string& method, const std::string& args,
                   const CallContext& context) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (auto result = lock_.call(method, args, context, cv_, lock)) return *std::move(result);
    if (method == "wait") {
      const auto [timeout] = served_decode<std::tuple<Seconds>>(args);
      return served_encode(wait(context, lock, to_timeout(timeout)));
    }
    if (method == "notify" || method == "notify_all") {
      if (!lock_.owned_by(context.caller)) {
        throw ServedError("RuntimeError", "cannot notify on un-acquired lock");
      }
      int64_t n = static_cast<int64_t>(waiting_.size());
      if (method == "notify") n = std::get<0>(served_decode<std::tuple<int64_t>>(args));
      notify(n);
      return {};
    }
    not_exposed("Condition", method);
  }

 private:
  void notify(int64_t n) {
    for (; n > 0 && !waiting_.empty(); --n) {
      notified_.insert(waiting_.front());
      waiting_.pop_front();
    }
    cv_.notify_all();
  }

  /// Releases every level, waits for a notify (or the timeout), takes the levels back
  /// (without a limit, as Python). A waiter whose client dies passes a notify it got on.
  bool wait(const CallContext& context, std::unique_lock<std::mutex>& lock, Timeout timeout) {
    if (!lock_.owned_by(context.caller)) {
      throw ServedError("RuntimeError", "cannot wait on un-acquired lock");
    }
    const int64_t levels = lock_.count;
    lock_.owner = 0;
    lock_.count = 0;
    const uint64_t ticket = next_ticket_++;
    waiting_.push_back(ticket);
    cv_.notify_all();
    bool notified = false;
    try {
      notified = context.wait(cv_, lock, timeout, [&] { return notified_.count(ticket) > 0; });
      if (notified) {
        notified_.erase(ticket);
      } else {
        waiting_.remove(ticket);
      }
      wait_alive(context, cv_, lock, std::nullopt, [&] { return lock_.count == 0; });
    } catch (...) {
      waiting_.remove(ticket);
      if (notified_.erase(ticket) > 0 || notified) notify(1);
      throw;
    }
    lock_.owner = context.caller;
    lock_.count = levels;
    return notified;
  }

  std::mutex mu_;
  std::condition_variable cv_;  // the lock was freed, or a waiter was notified
  LockState lock_{.recursive = true};
  uint64_t next_ticket_ = 1;
  std::list<uint64_t> waiting_;  // tickets not yet notified, oldest first
  std::unordered_set<uint64_t> notified_;
};

// ---- Barrier --------------------------------------------------------------------------

/// threading.Barrier without an action (Python's state machine: filling, draining,
/// resetting, broken). A party whose client dies while it waits breaks the barrier, as a
/// timeout does: the others would wait for it in vain.
class ServedBarrier final : public ServedObject {
 public:
  ServedBarrier(int64_t parties, Seconds timeout) : parties_(parties), timeout_(timeout) {
    if (parties < 1) throw ServedError("ValueError", "parties must be > 0");
  }
  bool serialized() const override { return false; }

  std::string call(const std::string& method, const std::string& args,
                   const CallContext& context) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (method == "wait") {
      const auto [timeout] = served_decode<std::tuple<Seconds>>(args);
      return served_encode(wait(context, lock, to_timeout(timeout ? timeout : timeout_)));
    }
    if (method == "reset") {
      if (count_ > 0) {
        if (state_ == State::kFilling || state_ == State::kBroken) state_ = State::kResetting;
      } else {
        state_ = State::kFilling;
      }
      cv_.notify_all();
      return {};
    }
    if (method == "abort") {
      state_ = State::kBroken;
      cv_.notify_all();
      return {};
    }
    if (method == "parties") return served_encode(parties_);
    if (method == "n_waiting")
      return served_encode(state_ == State::kFilling ? count_ : int64_t{0});
    if (method == "broken") return served_encode(state_ == State::kBroken);
    not_exposed("Barrier", method);
  }

 private:
  enum class State { kFilling, kDraining, kResetting, kBroken };

  [[noreturn]] static void broken_error() {
    throw ServedError("BrokenBarrierError",
                      "the barrier is broken (aborted, reset, or a party timed out or left)");
  }

  int64_t wait(const CallContext& context, std::unique_lock<std::mutex>& lock, Timeout timeout) {
    // Enter: a round that drains or resets ends first.
    context.wait(cv_, lock, std::nullopt,
                 [&] { return state_ != State::kDraining && state_ != State::kResetting; });
    if (state_ == State::kBroken) broken_error();
    const int64_t index = count_++;
    struct Exit {  // Python's finally: _count -= 1; _exit()
      ServedBarrier* self;
      ~Exit() {
        if (--self->count_ == 0 &&
            (self->state_ == State::kDraining || self->state_ == State::kResetting)) {
          self->state_ = State::kFilling;
          self->cv_.notify_all();
        }
      }
    } leave{this};
    if (index + 1 == parties_) {
      state_ = State::kDraining;
      cv_.notify_all();
      return index;
    }
    bool released = false;
    try {
      released = context.wait(cv_, lock, timeout, [&] { return state_ != State::kFilling; });
    } catch (const ServedError&) {
      breaks();  // the client is gone: the others would wait for it in vain
      throw;
    }
    if (!released) {
      breaks();
      broken_error();
    }
    if (state_ == State::kBroken || state_ == State::kResetting) broken_error();
    return index;
  }

  void breaks() {
    state_ = State::kBroken;
    cv_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  const int64_t parties_;
  const Seconds timeout_;  // the default of wait()
  State state_ = State::kFilling;
  int64_t count_ = 0;  // parties inside wait()
};

}  // namespace

std::unique_ptr<ServedObject> make_served_queue(const std::string& args) {
  const auto [maxsize] = served_decode<std::tuple<int64_t>>(args);
  return std::make_unique<ServedQueue>(maxsize);
}

std::unique_ptr<ServedObject> make_served_lock(const std::string& /*args: none*/) {
  return std::make_unique<ServedLock>(false);
}

std::unique_ptr<ServedObject> make_served_rlock(const std::string& /*args: none*/) {
  return std::make_unique<ServedLock>(true);
}

std::unique_ptr<ServedObject> make_served_event(const std::string& /*args: none*/) {
  return std::make_unique<ServedEvent>();
}

std::unique_ptr<ServedObject> make_served_semaphore(const std::string& args) {
  const auto [value] = served_decode<std::tuple<int64_t>>(args);
  return std::make_unique<ServedSemaphore>(value, false);
}

std::unique_ptr<ServedObject> make_served_bounded_semaphore(const std::string& args) {
  const auto [value] = served_decode<std::tuple<int64_t>>(args);
  return std::make_unique<ServedSemaphore>(value, true);
}

std::unique_ptr<ServedObject> make_served_condition(const std::string& /*args: none*/) {
  return std::make_unique<ServedCondition>();
}

std::unique_ptr<ServedObject> make_served_barrier(const std::string& args) {
  const auto [parties, timeout] = served_decode<std::tuple<int64_t, Seconds>>(args);
  return std::make_unique<ServedBarrier>(parties, timeout);
}

}  // namespace torchpar::detail
