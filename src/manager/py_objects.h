#pragma once
// The objects a Python client of the manager creates (multiprocessing.managers.SyncManager's
// typeids: dict, list, Namespace, Value, Array, Queue, JoinableQueue, Lock, RLock, Semaphore,
// BoundedSemaphore, Condition, Event, Barrier, and the Iterator a dict's __iter__ returns),
// holding pickle values (include/torchpar/manager/pickle.h) and answering calls with Python's
// semantics. The blocking types wrap the C++ clients' served objects (served_sync.cpp), items and
// all as pickles, so both kinds of client get the same waits and timeouts. Private to the library;
// py_protocol.cpp serves them.

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "manager/server.h"
#include "torchpar/manager/pickle.h"

namespace torchpar::detail::py {

using pickle::Value;

/// A Python exception a call raises: the server answers ('#ERROR', exception), and the
/// client raises that exception (KeyError, queue.Empty, ...).
class PyException : public std::runtime_error {
 public:
  /// module.name(message).
  PyException(std::string module, std::string name, const std::string& message);
  /// module.name(*args) (KeyError(key) carries the key itself).
  PyException(std::string module, std::string name, std::vector<Value> args,
              const std::string& what);
  /// The exception as a pickle value.
  Value value() const;
  const std::string& name() const noexcept { return name_; }

 private:
  std::string module_;
  std::string name_;
  std::vector<Value> args_;
};

/// builtins.<name>(message).
[[noreturn]] void raise(const std::string& name, const std::string& message);

/// A served object of a Python client.
/// Safety: serialized() objects run one call at a time (the server's per-object mutex);
///         the others lock themselves.
class PyServed : public ServedObject {
 public:
  /// The C++ clients' entry point: a Python object answers them AttributeError.
  std::string call(const std::string& method, const std::string& args,
                   const CallContext& context) override;
  /// The methods a proxy may call (what Python's server sends back from create).
  virtual std::vector<std::string> exposed() const = 0;
  /// The typeid a method's result is served as ('#PROXY': dict.__iter__ -> "Iterator").
  virtual std::optional<std::string> proxy_typeid(const std::string& /*method*/) const {
    return std::nullopt;
  }
  /// Runs an exposed method. Errors: PyException (sent as '#ERROR').
  virtual Value py_call(const std::string& method, std::vector<Value>& args,
                        const pickle::Dict& kwds, const CallContext& context) = 0;
  /// '#GETVALUE': the object as a value (a copy).
  virtual Value value() const;
  /// __repr__ / __str__ of the object.
  virtual std::string repr() const { return value().repr(); }
};

/// Makes the object of `type_id` from create's arguments, as SyncManager's registry would.
/// Errors: PyException (ValueError for an unknown typeid, TypeError for bad arguments).
std::unique_ptr<PyServed> make_py_object(const std::string& type_id, std::vector<Value> args,
                                         const pickle::Dict& kwds);
/// The blocking types (py_sync.cpp); nullptr for another typeid.
std::unique_ptr<PyServed> make_py_sync(const std::string& type_id, std::vector<Value>& args,
                                       const pickle::Dict& kwds);
/// An iterator over `items` (the "Iterator" typeid: __next__ raises StopIteration at the end)
/// that `source` returned; a dict's raises RuntimeError once the dict changed size.
std::unique_ptr<PyServed> make_py_iterator(std::vector<Value> items, const PyServed* source);

/// Argument `index` (or keyword `name`) of a call, else `fallback`; TypeError when absent and
/// no fallback.
const Value& argument(const std::vector<Value>& args, const pickle::Dict& kwds, size_t index,
                      const char* name, const Value* fallback = nullptr);
/// A Python int (bool included) as int64; TypeError otherwise.
int64_t to_int(const Value& v, const char* what);
/// A Python timeout: None -> nullopt, a number -> seconds; `negative_is_none`: -1 as
/// threading.Lock.acquire takes it.
std::optional<double> to_timeout(const Value& v, bool negative_is_none = false);
/// Python's truth value of v (bool(v)) for the builtin types.
bool truthy(const Value& v);
/// Python's == for any two values (numbers across types, containers elementwise).
bool py_equal(const Value& a, const Value& b);

}  // namespace torchpar::detail::py
