#pragma once
/// Proxies for objects of Python's kind in a manager: the objects CPython's own
/// multiprocessing.managers client creates in a `torchpar manager` (SyncManager.dict(),
/// .list(), .Queue(), ...), or that Manager::python_object makes for Python clients to use.
/// Their items are pickle values (torchpar/manager/pickle.h), so a C++ client and a Python
/// client share one object: what one writes, the other reads, with Python's semantics (keys
/// compare as Python compares them: 1 == 1.0 == True, "a" != b"a").
///
/// Example (C++ side; the Python side is docs/manager.md, "Sharing objects with Python
/// clients", and examples/04_python_shared_dict.cpp):
///   auto manager = torchpar::Manager::connect("127.0.0.1:50000", key);
///   torchpar::PythonDictProxy d = manager.python_dict(ident);  // a Python client's dict
///   using torchpar::pickle::Value;
///   d.set(Value::str("step"), int64_t{10});
///   std::optional<Value> lr = d.get(Value::str("lr"));        // 0.1 if Python set it
///
/// A PythonProxy is a BaseProxy: the same reference counting, timeouts and errors (a Python
/// exception raised in the server arrives as RemoteError whose type() is its name:
/// "KeyError", "IndexError", "Empty" for queue.Empty, "Full", "BrokenBarrierError").

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torchpar/core/timeout.h"
#include "torchpar/manager/pickle.h"
#include "torchpar/manager/proxy.h"

namespace torchpar {

/// One object of Python's kind in the manager's server, called with pickle values.
///
/// Lifetime, safety and errors: see BaseProxy (each call one round trip; the server runs
/// one call at a time on dicts, lists and values, so a single call is atomic).
/// Errors: RemoteError for what the object raised (type(): the Python exception's name),
///         "AttributeError" for a method the object does not expose (Python's proxies'
///         `_exposed_`), "PickleError" when the server cannot read the arguments.
/// Source: multiprocessing.managers.BaseProxy._callmethod.
class PythonProxy : public BaseProxy {
 public:
  PythonProxy() = default;
  /// A proxy for the object `ref` refers to (Manager::python_object and python_proxy make
  /// them).
  explicit PythonProxy(std::shared_ptr<detail::ProxyRef> ref) : BaseProxy(std::move(ref)) {}

  /// The object's id as Python's Token carries it (`proxy._token.id`): id() in lowercase hex.
  /// A Python client rebuilds a proxy from it: DictProxy(Token('dict', address, ident),
  /// 'pickle', authkey=key).
  std::string ident() const;

  /// Calls `method` with positional `args`, as a Python proxy's
  /// `_callmethod(method, tuple(args))`, and returns its result. A method Python serves as
  /// a new proxy (dict.__iter__) returns its items as a list here. `wait`: how long the
  /// method may block in the server (Queue.get's timeout; nullopt: no limit), added to the
  /// manager's timeout for the reply. Errors: see the class.
  pickle::Value call(const std::string& method, std::vector<pickle::Value> args = {},
                     Timeout wait = std::chrono::duration<double>(0)) const;

  /// The object as a value (a copy: a dict as a pickle Dict, a list as a List, a Namespace
  /// as its dict of names). Source: BaseProxy._getvalue.
  pickle::Value copy() const;
};

/// A dict of Python's kind (SyncManager.dict) from C++.
/// Keys: the key types of torchpar/manager/pickle.h (None, bool, int, float, str, bytes and
/// tuples of them); another key is a RemoteError "TypeError" naming its type.
/// Source: multiprocessing.managers.DictProxy.
class PythonDictProxy : public PythonProxy {
 public:
  PythonDictProxy() = default;
  explicit PythonDictProxy(std::shared_ptr<detail::ProxyRef> ref) : PythonProxy(std::move(ref)) {}

  /// d[key] = value. Source: dict.__setitem__.
  void set(const pickle::Value& key, const pickle::Value& value) {
    call("__setitem__", {key, value});
  }
  /// d[key], or nullopt when the dict has no such key (a stored None is a Value holding
  /// None). Source: dict.__getitem__ (KeyError -> nullopt).
  std::optional<pickle::Value> get(const pickle::Value& key) const;
  /// key in d. Source: dict.__contains__.
  bool contains(const pickle::Value& key) const;
  /// Removes `key` and returns its value. Errors: RemoteError "KeyError" when absent.
  /// Source: dict.pop.
  pickle::Value pop(const pickle::Value& key) { return call("pop", {key}); }
  /// del d[key]. Errors: RemoteError "KeyError" when absent. Source: dict.__delitem__.
  void erase(const pickle::Value& key) { call("__delitem__", {key}); }
  /// len(d). Source: dict.__len__.
  size_t size() const;
  /// The keys / (key, value) pairs in insertion order, one round trip each. Source:
  /// dict.keys, dict.items.
  std::vector<pickle::Value> keys() const;
  std::vector<std::pair<pickle::Value, pickle::Value>> items() const;
  /// Removes every item. Source: dict.clear.
  void clear() { call("clear"); }
};

}  // namespace torchpar
