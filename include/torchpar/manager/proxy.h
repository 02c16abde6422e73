#pragma once
/// Proxies: handles to objects that live in a Manager's server process (Python's
/// multiprocessing.managers.BaseProxy and DictProxy). Every call is one request/response
/// round trip to the server; values travel as torchpar payloads with tensors copied, or as
/// shared-memory handles when the manager was made with ManagerOptions::share_tensors.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "torchpar/core/timeout.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar {

namespace detail {
struct ProxyRef;  // one reference on the server (src/manager/client.h)
}  // namespace detail

/// What every proxy holds: one reference to an object in a manager's server, counted there.
///
/// Lifetime: copies in one process share that reference; the server frees the object
///           when the last reference anywhere is gone (each process holding the proxy holds
///           one). A proxy serialized to another process (a Process argument, a Pipe, a
///           Queue) takes its own reference when it is loaded there, so the sender must keep
///           its proxy until then. A fork child that uses an inherited proxy connects and
///           takes a reference of its own at its first call.
/// Safety:   thread-safe: each call in flight takes a connection of its own from this
///           process's pool for that manager (references go over one control connection), so a
///           call blocking in the server holds up no other thread.
/// Errors:   RemoteError when the method raised in the server (type and message);
///           ClosedError naming the manager's address when it is gone (shut down, exited,
///           killed) and at every later call; TimeoutError when the manager's `timeout`
///           (default 60 s) passes, connecting included: only that call failed (its
///           connection is closed, a late reply would be taken for the next one's); the
///           proxy, its reference and later calls go on. A slow or refused connect while
///           the server is there is never taken for "gone".
/// Source:   multiprocessing.managers.BaseProxy.
class BaseProxy {
 public:
  /// The manager's address, the object's typeid ("dict") and its id in the server.
  const std::string& address() const;
  const std::string& type_id() const;
  uint64_t id() const;
  /// False for a default-constructed proxy (referring to nothing).
  explicit operator bool() const { return static_cast<bool>(ref_); }
  /// Whether this proxy sends tensors as shared-memory handles
  /// (ManagerOptions::share_tensors of the manager it came from).
  bool share_tensors() const;

  /// Serialized form: the manager's address, its key (as Python passes its authkey to the
  /// children it starts: send proxies only where the key may go), the call timeout, the
  /// typeid, the object id and share_tensors.
  void save(detail::OutputArchive& ar) const;
  void load(detail::InputArchive& ar);

 protected:
  BaseProxy() = default;
  explicit BaseProxy(std::shared_ptr<detail::ProxyRef> ref) : ref_(std::move(ref)) {}

  /// Runs `method` on the object in the server with `args` (payload bytes); returns the
  /// result's payload bytes. `wait` is how long the method may block in the server
  /// (Queue::get's timeout; nullopt: no limit): the reply is awaited for the manager's
  /// timeout plus `wait`. Each call in flight has a connection of its own, so a blocked
  /// call holds up no other thread. Errors: see the class.
  std::string call_method(const std::string& method, const std::string& args,
                          Timeout wait = std::chrono::duration<double>(0)) const;

  /// Payload bytes of `value` for the server: tensors copied, or as shared-memory handles
  /// (no fds: names, or the sender's /proc fd path) that pin their blocks for borrowers
  /// (DumpsContext::pin_shared) when share_tensors() is set.
  template <class T>
  std::string encode(const T& value) const {
    const bool share = share_tensors();
    return detail::dumps_with(value,
                              {.copy_tensor = !share, .pass_fds = !share, .pin_shared = share})
        .bytes;
  }
  /// As encode, for bytes the server loads once, adopting their shared tensors (a
  /// registered member's arguments): the exports wait in flight for that one load
  /// instead of pinning their blocks.
  template <class T>
  std::string encode_once(const T& value) const {
    const bool share = share_tensors();
    return detail::dumps_with(value, {.copy_tensor = !share, .pass_fds = !share}).bytes;
  }
  /// The value of payload bytes from the server. Shared tensors are borrowed, not adopted
  /// (LoadsContext::adopt_shared), as a stored value may be read any number of times.
  template <class T>
  static T decode(const std::string& bytes) {
    return detail::loads_with<T>(Payload{bytes, {}}, {.adopt_shared = false});
  }

 private:
  /// The reference this process holds (a fork child takes its own first).
  std::shared_ptr<detail::ProxyRef> ref() const;
  mutable std::shared_ptr<detail::ProxyRef> ref_;
};

/// A dict in the manager's server. Keys and values are any torchpar-serializable types
/// (tensors included: copied both ways, or shared with ManagerOptions::share_tensors). Two
/// keys are the same key when their serialized bytes are equal (true for integers, strings,
/// and containers of them; not for floats such as 0.0 and -0.0). Items keep insertion order,
/// as Python's dict.
///
/// Example:
///   torchpar::Manager manager;
///   auto d = manager.dict<std::string, at::Tensor>();
///   d.set("w", at::ones({2}));
///   at::Tensor w = *d.get("w");
///
/// Lifetime, safety and errors: see BaseProxy. Source: multiprocessing.managers.DictProxy.
template <class K, class V>
class DictProxy : public BaseProxy {
 public:
  DictProxy() = default;
  /// A proxy for the dict `ref` refers to (Manager::dict makes them).
  explicit DictProxy(std::shared_ptr<detail::ProxyRef> ref) : BaseProxy(std::move(ref)) {}

  /// d[key] = value. Source: dict.__setitem__.
  void set(const K& key, const V& value) {
    call_method("set", encode(std::make_tuple(encode(key), encode(value))));
  }
  /// The value of `key`, or nullopt. Source: dict.get.
  std::optional<V> get(const K& key) const {
    auto bytes = decode<std::optional<std::string>>(call_method("get", key_args(key)));
    if (!bytes) return std::nullopt;
    return decode<V>(*bytes);
  }
  /// Removes `key` and returns its value. Errors: RemoteError with type "KeyError" when the
  /// dict has no such key. Source: dict.pop.
  V pop(const K& key) { return decode<V>(decode<std::string>(call_method("pop", key_args(key)))); }
  /// `key in d`. Source: dict.__contains__.
  bool contains(const K& key) const { return decode<bool>(call_method("contains", key_args(key))); }
  /// The keys, in insertion order. Source: dict.keys.
  std::vector<K> keys() const {
    std::vector<K> out;
    for (const auto& k : decode<std::vector<std::string>>(call_method("keys", {}))) {
      out.push_back(decode<K>(k));
    }
    return out;
  }
  /// The items, in insertion order. Source: dict.items.
  std::vector<std::pair<K, V>> items() const {
    std::vector<std::pair<K, V>> out;
    for (const auto& [k, v] :
         decode<std::vector<std::pair<std::string, std::string>>>(call_method("items", {}))) {
      out.emplace_back(decode<K>(k), decode<V>(v));
    }
    return out;
  }
  /// The values, in insertion order. Source: dict.values.
  std::vector<V> values() const {
    std::vector<V> out;
    for (const auto& v : decode<std::vector<std::string>>(call_method("values", {}))) {
      out.push_back(decode<V>(v));
    }
    return out;
  }
  /// Removes and returns the last inserted item (last in, first out, as Python 3.7+).
  /// Errors: RemoteError with type "KeyError" when the dict is empty. Source: dict.popitem.
  std::pair<K, V> popitem() {
    const auto [k, v] = decode<std::pair<std::string, std::string>>(call_method("popitem", {}));
    return {decode<K>(k), decode<V>(v)};
  }
  /// The value of `key`; when the dict has none, sets it to `default_value` first. One
  /// request: racing callers agree on the value that was set. Source: dict.setdefault.
  V setdefault(const K& key, const V& default_value) {
    return decode<V>(decode<std::string>(
        call_method("setdefault", encode(std::make_tuple(encode(key), encode(default_value))))));
  }
  /// A copy of the contents, here in this process, in insertion order (Python's
  /// DictProxy.copy returns a plain dict, not a proxy). Source: dict.copy.
  std::vector<std::pair<K, V>> copy() const { return items(); }
  /// len(d). Source: dict.__len__.
  size_t size() const { return static_cast<size_t>(decode<uint64_t>(call_method("size", {}))); }
  /// Sets every pair, in order, in one round trip. Source: dict.update.
  void update(const std::vector<std::pair<K, V>>& pairs) {
    std::vector<std::pair<std::string, std::string>> encoded;
    encoded.reserve(pairs.size());
    for (const auto& [k, v] : pairs) encoded.emplace_back(encode(k), encode(v));
    call_method("update", encode(std::make_tuple(encoded)));
  }
  /// Removes every item. Source: dict.clear.
  void clear() { call_method("clear", {}); }

 private:
  std::string key_args(const K& key) const { return encode(std::make_tuple(encode(key))); }
};

}  // namespace torchpar
