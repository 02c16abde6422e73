#pragma once
/// Proxies for the manager's containers: ListProxy<T>, NamespaceProxy, ValueProxy<T> and
/// ArrayProxy<T> (Python's multiprocessing.managers ListProxy, NamespaceProxy, ValueProxy
/// and ArrayProxy). Manager::list, Namespace, Value and Array make them.

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "torchpar/manager/proxy.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar {
namespace detail {

/// Payload bytes of `value` as a proxy sends it (tensors copied), for the Manager's factory
/// methods, which encode the initial values of the objects they create.
template <class T>
std::string encode_for_manager(const T& value) {
  return dumps(value, {.copy_tensor = true}).bytes;
}

/// The payload bytes of each of `values`: how "list" and "Array" hold their items.
template <class T>
std::vector<std::string> encode_each_for_manager(const std::vector<T>& values) {
  std::vector<std::string> out;
  out.reserve(values.size());
  for (const auto& v : values) out.push_back(encode_for_manager(v));
  return out;
}

}  // namespace detail

/// A list in the manager's server. Items are any torchpar-serializable type (tensors
/// included, copied both ways: changing a tensor after set, or the one get returned,
/// changes nothing in the server). Indices are Python's: -1 is the last item.
///
/// Example:
///   torchpar::Manager manager;
///   auto l = manager.list<int64_t>({1, 2, 3});
///   l.append(4);
///   int64_t last = l.pop();                      // 4
///   std::vector<int64_t> all = l.to_vector();    // {1, 2, 3}
///
/// A proxy stored as an item (a ListProxy<DictProxy<K, V>>) is loaded, and works, wherever
/// the item is read; unlike Python's server, the list does not keep that object alive:
/// keep a proxy of it elsewhere as long as the item is in use.
/// Lifetime, safety and errors: see BaseProxy; each method is one round trip, run in the
/// server one call at a time on this list, so a single call is atomic (append from many
/// processes loses nothing) and a sequence of calls is not.
/// Source: multiprocessing.managers.ListProxy (SyncManager.list).
template <class T>
class ListProxy : public BaseProxy {
 public:
  ListProxy() = default;
  /// A proxy for the list `ref` refers to (Manager::list makes them).
  explicit ListProxy(std::shared_ptr<detail::ProxyRef> ref) : BaseProxy(std::move(ref)) {}

  /// Adds `value` at the end. Source: list.append.
  void append(const T& value) { call_method("append", encode(std::make_tuple(encode(value)))); }
  /// The item at `index` (negative: from the end). Errors: RemoteError with type
  /// "IndexError" ("list index out of range") outside [-size, size). Source:
  /// list.__getitem__.
  T get(int64_t index) const {
    return decode<T>(call_method("get", encode(std::make_tuple(index))));
  }
  /// l[index] = value. Errors: RemoteError "IndexError" ("list assignment index out of
  /// range") outside [-size, size). Source: list.__setitem__.
  void set(int64_t index, const T& value) {
    call_method("set", encode(std::make_tuple(index, encode(value))));
  }
  /// Removes the item at `index` (default: the last) and returns it. Errors: RemoteError
  /// "IndexError": "pop from empty list", or "pop index out of range". Source: list.pop.
  T pop(int64_t index = -1) {
    return decode<T>(call_method("pop", encode(std::make_tuple(index))));
  }
  /// len(l). Source: list.__len__.
  size_t size() const { return static_cast<size_t>(decode<uint64_t>(call_method("size", {}))); }
  /// Appends every value, in order, in one round trip. Source: list.extend.
  void extend(const std::vector<T>& values) {
    call_method("extend", encode(std::make_tuple(detail::encode_each_for_manager(values))));
  }
  /// Inserts `value` before `index`; as Python, never fails: an index past either end
  /// inserts at that end, a negative one counts from the end. Source: list.insert.
  void insert(int64_t index, const T& value) {
    call_method("insert", encode(std::make_tuple(index, encode(value))));
  }
  /// Removes every item. Source: list.clear.
  void clear() { call_method("clear", {}); }
  /// Every item, in order, in one round trip. Source: list(l) / l[:].
  std::vector<T> to_vector() const {
    std::vector<T> out;
    for (const auto& item : decode<std::vector<std::string>>(call_method("items", {}))) {
      out.push_back(decode<T>(item));
    }
    return out;
  }
};

/// A Namespace in the manager's server: named values, each of its own type (a tensor under
/// one name, a string under another). The server keeps a value's bytes and not its type:
/// get<T> must name the type set<T> stored (another type is a SerializationError when its
/// bytes do not fit, and misread when they do, as with any payload). Every name is kept in
/// the server (Python keeps names starting with '_' on the proxy itself; here there is no
/// such exception).
///
/// Example:
///   auto ns = manager.Namespace();
///   ns.set("name", std::string("Bob"));
///   ns.set("w", at::zeros({3}));
///   std::string n = ns.get<std::string>("name");
///   ns.del("w");                                  // names(): {"name"}
///
/// Lifetime, safety and errors: see BaseProxy; each call is atomic in the server.
/// Source: multiprocessing.managers.NamespaceProxy (SyncManager.Namespace).
class NamespaceProxy : public BaseProxy {
 public:
  NamespaceProxy() = default;
  /// A proxy for the Namespace `ref` refers to (Manager::Namespace makes them).
  explicit NamespaceProxy(std::shared_ptr<detail::ProxyRef> ref) : BaseProxy(std::move(ref)) {}

  /// The value of `name` (tensors copied). Errors: RemoteError with type "AttributeError"
  /// ("'Namespace' object has no attribute 'name'") when it is not set. Source:
  /// getattr(ns, name).
  template <class T>
  T get(const std::string& name) const {
    return decode<T>(call_method("get", encode(std::make_tuple(name))));
  }
  /// ns.name = value; a name set before keeps its place in names(). Source:
  /// setattr(ns, name, value).
  template <class T>
  void set(const std::string& name, const T& value) {
    call_method("set", encode(std::make_tuple(name, encode(value))));
  }
  /// Whether `name` is set. Source: hasattr(ns, name).
  bool has(const std::string& name) const {
    return decode<bool>(call_method("has", encode(std::make_tuple(name))));
  }
  /// Removes `name`. Errors: RemoteError "AttributeError" when it is not set. Source:
  /// delattr(ns, name).
  void del(const std::string& name) { call_method("del", encode(std::make_tuple(name))); }
  /// The names set, in the order they were first set. Source: vars(ns).keys().
  std::vector<std::string> names() const {
    return decode<std::vector<std::string>>(call_method("names", {}));
  }
};

/// One value in the manager's server. Python's Manager.Value(typecode, value) is
/// Manager::Value<T>(value): T is any torchpar-serializable type (tensors copied both ways).
///
/// Example:
///   auto v = manager.Value<double>(1.25);
///   v.set(2.5);
///   double x = v.get();                            // 2.5
///
/// Lifetime, safety and errors: see BaseProxy. get and set are each atomic; a
/// read-modify-write (v.set(v.get() + 1)) is not: guard it with a manager Lock.
/// Source: multiprocessing.managers.ValueProxy (SyncManager.Value).
template <class T>
class ValueProxy : public BaseProxy {
 public:
  ValueProxy() = default;
  /// A proxy for the Value `ref` refers to (Manager::Value makes them).
  explicit ValueProxy(std::shared_ptr<detail::ProxyRef> ref) : BaseProxy(std::move(ref)) {}

  /// The value. Source: ValueProxy.get / .value.
  T get() const { return decode<T>(call_method("get", {})); }
  /// Replaces the value. Source: ValueProxy.set / .value = value.
  void set(const T& value) { call_method("set", encode(std::make_tuple(encode(value)))); }
};

/// A fixed-length array of T in the manager's server: Python's Manager.Array(typecode,
/// sequence) is Manager::Array<T>(values). Its length is the initial one for good (there
/// is no append); T is any torchpar-serializable type (tensors copied both ways). Indices
/// are Python's: -1 is the last element.
///
/// Example:
///   auto a = manager.Array<int64_t>({0, 1, 2, 3});
///   a.set(-1, 30);
///   int64_t x = a.get(3);                          // 30
///
/// Lifetime, safety and errors: see BaseProxy; each call is atomic in the server.
/// Source: multiprocessing.managers.ArrayProxy (SyncManager.Array).
template <class T>
class ArrayProxy : public BaseProxy {
 public:
  ArrayProxy() = default;
  /// A proxy for the Array `ref` refers to (Manager::Array makes them).
  explicit ArrayProxy(std::shared_ptr<detail::ProxyRef> ref) : BaseProxy(std::move(ref)) {}

  /// The element at `index` (negative: from the end). Errors: RemoteError with type
  /// "IndexError" ("array index out of range") outside [-size, size). Source:
  /// array.__getitem__.
  T get(int64_t index) const {
    return decode<T>(call_method("get", encode(std::make_tuple(index))));
  }
  /// a[index] = value. Errors: RemoteError "IndexError" ("array assignment index out of
  /// range") outside [-size, size). Source: array.__setitem__.
  void set(int64_t index, const T& value) {
    call_method("set", encode(std::make_tuple(index, encode(value))));
  }
  /// len(a), fixed at creation. Source: array.__len__.
  size_t size() const { return static_cast<size_t>(decode<uint64_t>(call_method("size", {}))); }
  /// Every element, in order, in one round trip. Source: a[:] / list(a).
  std::vector<T> to_vector() const {
    std::vector<T> out;
    for (const auto& item : decode<std::vector<std::string>>(call_method("items", {}))) {
      out.push_back(decode<T>(item));
    }
    return out;
  }
};

}  // namespace torchpar
