// The blocking types of Python clients: Queue, JoinableQueue, Lock, RLock, Semaphore,
// BoundedSemaphore, Condition, Event, Barrier. Each wraps the served object the C++ clients
// use (served_sync.cpp: the same waits, timeouts and aborts when a client is gone), turning
// Python's arguments into its arguments, a queue's items into pickles, and its errors into
// the exceptions Python raises (queue.Empty, threading.BrokenBarrierError, RuntimeError, ...).
#include <fmt/format.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "manager/py_objects.h"

namespace torchpar::detail::py {
namespace {

using Seconds = std::optional<double>;

/// The Python exception of a served object's error.
[[noreturn]] void rethrow(const ServedError& e) {
  const std::string& t = e.type();
  if (t == "Empty") throw PyException("_queue", "Empty", {}, e.what());
  if (t == "Full") throw PyException("queue", "Full", {}, e.what());
  if (t == "BrokenBarrierError") throw PyException("threading", "BrokenBarrierError", {}, e.what());
  if (t == "ValueError" || t == "RuntimeError" || t == "KeyError" || t == "TypeError" ||
      t == "AttributeError" || t == "ConnectionAbortedError" || t == "IndexError")
    raise(t, e.what());
  raise("RuntimeError", fmt::format("{}: {}", t, e.what()));
}

class PySync final : public PyServed {
 public:
  PySync(std::string type_id, std::unique_ptr<ServedObject> inner, std::vector<std::string> methods)
      : type_id_(std::move(type_id)), inner_(std::move(inner)), methods_(std::move(methods)) {}
  bool serialized() const override { return false; }
  std::vector<std::string> exposed() const override { return methods_; }
  std::string repr() const override { return fmt::format("<{} served by torchpar>", type_id_); }

  Value py_call(const std::string& m, std::vector<Value>& a, const pickle::Dict& kw,
                const CallContext& context) override {
    try {
      return dispatch(m, a, kw, context);
    } catch (const ServedError& e) {
      rethrow(e);
    }
  }

 private:
  std::string run(const std::string& method, const std::string& args, const CallContext& c) {
    return inner_->call(method, args, c);
  }
  template <class T>
  static T result(const std::string& bytes) {
    return served_decode<T>(bytes);
  }

  Value dispatch(const std::string& m, std::vector<Value>& a, const pickle::Dict& kw,
                 const CallContext& c) {
    static const Value kTrue = true;
    static const Value kNone;
    static const Value kMinusOne = int64_t{-1};
    static const Value kOne = int64_t{1};
    const auto arg = [&](size_t i, const char* name, const Value* dflt = nullptr) -> const Value& {
      return argument(a, kw, i, name, dflt);
    };
    if (type_id_ == "Queue" || type_id_ == "JoinableQueue") {
      if (m == "put" || m == "put_nowait") {
        const bool block = m == "put" && truthy(arg(1, "block", &kTrue));
        const Seconds t = m == "put" ? to_timeout(arg(2, "timeout", &kNone)) : std::nullopt;
        run("put", served_encode(std::make_tuple(pickle::encode(arg(0, "item")), block, t)), c);
        return {};
      }
      if (m == "get" || m == "get_nowait") {
        const bool block = m == "get" && truthy(arg(0, "block", &kTrue));
        const Seconds t = m == "get" ? to_timeout(arg(1, "timeout", &kNone)) : std::nullopt;
        return pickle::decode(run("get", served_encode(std::make_tuple(block, t)), c));
      }
      if (m == "qsize") return result<int64_t>(run("qsize", {}, c));
      if (m == "empty" || m == "full") return result<bool>(run(m, {}, c));
      if (m == "task_done") {
        run("task_done", {}, c);
        return {};
      }
      if (m == "join") {
        run("join", served_encode(std::make_tuple(Seconds{})), c);
        return {};
      }
    } else if (m == "acquire") {  // Lock, RLock, Semaphore, BoundedSemaphore, Condition
      const bool blocking = truthy(arg(0, "blocking", &kTrue));
      const bool lock_like = type_id_ != "Semaphore" && type_id_ != "BoundedSemaphore";
      const Value& tv = arg(1, "timeout", lock_like ? &kMinusOne : &kNone);
      const Seconds t = to_timeout(tv, lock_like);
      if (!blocking && t) raise("ValueError", "can't specify a timeout for a non-blocking call");
      return result<bool>(run("acquire", served_encode(std::make_tuple(blocking, t)), c));
    } else if (m == "release") {
      if (type_id_ == "Semaphore" || type_id_ == "BoundedSemaphore") {
        run("release", served_encode(std::make_tuple(to_int(arg(0, "n", &kOne), "n"))), c);
      } else {
        run("release", {}, c);
      }
      return {};
    } else if (m == "wait") {  // Event, Condition, Barrier
      const Seconds t = to_timeout(arg(0, "timeout", &kNone));
      const std::string r = run("wait", served_encode(std::make_tuple(t)), c);
      if (type_id_ == "Barrier") return result<int64_t>(r);
      return result<bool>(r);
    } else if (m == "is_set") {
      return result<bool>(run("is_set", {}, c));
    } else if (m == "set" || m == "clear" || m == "abort" || m == "reset" || m == "notify_all") {
      run(m, {}, c);
      return {};
    } else if (m == "notify") {
      run("notify", served_encode(std::make_tuple(to_int(arg(0, "n", &kOne), "n"))), c);
      return {};
    } else if (m == "__getattribute__" && type_id_ == "Barrier") {
      const Value& name = arg(0, "name");
      const std::string n = name.is<pickle::Str>() ? name.as<pickle::Str>().utf8 : "";
      if (n == "parties" || n == "n_waiting") return result<int64_t>(run(n, {}, c));
      if (n == "broken") return result<bool>(run(n, {}, c));
      raise("AttributeError", fmt::format("'Barrier' object has no attribute '{}'", n));
    }
    raise("AttributeError", fmt::format("'{}' object has no method '{}'", type_id_, m));
  }

  std::string type_id_;
  std::unique_ptr<ServedObject> inner_;
  std::vector<std::string> methods_;
};

}  // namespace

std::unique_ptr<PyServed> make_py_sync(const std::string& type_id, std::vector<Value>& args,
                                       const pickle::Dict& kwds) {
  static const Value kZero = int64_t{0};
  static const Value kOne = int64_t{1};
  static const Value kNone;
  const auto make = [&](std::unique_ptr<ServedObject> inner, std::vector<std::string> methods) {
    return std::make_unique<PySync>(type_id, std::move(inner), std::move(methods));
  };
  try {
    if (type_id == "Queue" || type_id == "JoinableQueue") {
      const int64_t maxsize = to_int(argument(args, kwds, 0, "maxsize", &kZero), "maxsize");
      return make(make_served_queue(served_encode(std::make_tuple(maxsize))),
                  {"empty", "full", "get", "get_nowait", "join", "put", "put_nowait", "qsize",
                   "task_done"});
    }
    if (type_id == "Lock" || type_id == "RLock") {
      return make(type_id == "Lock" ? make_served_lock({}) : make_served_rlock({}),
                  {"acquire", "release"});
    }
    if (type_id == "Semaphore" || type_id == "BoundedSemaphore") {
      const int64_t value = to_int(argument(args, kwds, 0, "value", &kOne), "value");
      const std::string a = served_encode(std::make_tuple(value));
      return make(
          type_id == "Semaphore" ? make_served_semaphore(a) : make_served_bounded_semaphore(a),
          {"acquire", "release"});
    }
    if (type_id == "Condition") {
      // Condition(lock): a proxy of another served lock cannot be shared here; the
      // condition always has its own RLock (docs/manager.md).
      return make(make_served_condition({}),
                  {"acquire", "release", "wait", "notify", "notify_all"});
    }
    if (type_id == "Event") return make(make_served_event({}), {"is_set", "set", "clear", "wait"});
    if (type_id == "Barrier") {
      const int64_t parties = to_int(argument(args, kwds, 0, "parties"), "parties");
      if (!argument(args, kwds, 1, "action", &kNone).is<pickle::None>())
        raise("TypeError", "Barrier(action=...) needs a function, which this server cannot call");
      const Seconds timeout = to_timeout(argument(args, kwds, 2, "timeout", &kNone));
      return make(make_served_barrier(served_encode(std::make_tuple(parties, timeout))),
                  {"__getattribute__", "wait", "abort", "reset"});
    }
  } catch (const ServedError& e) {
    rethrow(e);
  }
  return nullptr;
}

}  // namespace torchpar::detail::py
