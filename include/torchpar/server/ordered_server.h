#pragma once
/// Ordered key-value servers on an RpcGroup (machin.parallel.server.ordered_server):
/// OrderedServerBase (the interface), OrderedServerSimpleImpl (the server, hosted by one
/// member) and OrderedServerSimple (the accessor, usable from every member).
///
/// Values are typed: a server and its accessors share one value type V, any value torchpar
/// serializes (cereal types, at::Tensor, c10::IValue, StateDict = std::map<std::string,
/// at::Tensor>, std::optional, std::pair, ...). Semantics, the differences from machin and
/// the fault model: docs/servers.md.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "torchpar/rpc/rpc_group.h"
#include "torchpar/shm/share.h"

namespace torchpar {

/// A state dictionary: parameter and buffer names (as torch::nn::Module::named_parameters /
/// named_buffers spell them) to tensors. The value type of the parameter servers.
using StateDict = std::map<std::string, at::Tensor>;

/// The interface of an ordered server (machin OrderedServerBase): a map from keys to a short
/// chain of versioned values, where a push succeeds only on top of the version the pusher
/// saw last. Implementations need not be strongly consistent, but OrderedServerSimple is.
///
/// Contract of every implementation: push stores a copy (the caller may modify `value`
/// after push returns) and pull returns a value the caller owns (modifying it does not
/// change the server).
template <class V>
class OrderedServerBase {
 public:
  virtual ~OrderedServerBase() = default;

  /// Pushes `value` as `version` of `key`. A key the server does not know always takes it;
  /// otherwise it succeeds iff `prev_version` equals the key's newest version (versions
  /// need not increase: machin's tests push -1 after 2). Returns true on success.
  /// Units:   `timeout` wall-clock seconds for the whole call.
  /// Errors:  see the implementation (OrderedServerSimple::push).
  /// Safety:  thread- and process-safe: of concurrent pushes with the same prev_version,
  ///          exactly one succeeds. Source: machin OrderedServerBase.push.
  virtual bool push(const std::string& key, const V& value, int64_t version,
                    std::optional<int64_t> prev_version, Timeout timeout = kDefaultRpcTimeout) = 0;

  /// The value of `version` of `key` (newest when `version` is nullopt) and its version;
  /// nullopt for an unknown key, an unknown version or one already evicted.
  /// Safety:  thread- and process-safe. Source: machin OrderedServerBase.pull.
  virtual std::optional<std::pair<V, int64_t>> pull(const std::string& key,
                                                    std::optional<int64_t> version = std::nullopt,
                                                    Timeout timeout = kDefaultRpcTimeout) = 0;

  /// As pull, but the value may share memory with the stored one instead of being a copy:
  /// for readers that only copy out of it (the model servers' load_state_dict), which saves
  /// a copy of every pulled tensor. Never write to it: a write could change the stored
  /// version for every reader. The default is pull (a copy, which is always allowed).
  /// Safety:  as pull. Source: no machin original (machin's pull always copies).
  virtual std::optional<std::pair<V, int64_t>> pull_view(
      const std::string& key, std::optional<int64_t> version = std::nullopt,
      Timeout timeout = kDefaultRpcTimeout) {
    return pull(key, version, timeout);
  }
};

namespace detail {

/// The version chains of one ordered server, values type-erased (shared_ptr<const V>).
/// Thread-safe. Keeps at most `version_depth` versions of each key (oldest evicted first).
class OrderedStore {
 public:
  OrderedStore(std::string server_name, int64_t version_depth);
  bool push(const std::string& key, std::shared_ptr<const void> value, int64_t version,
            std::optional<int64_t> prev_version);
  std::optional<std::pair<std::shared_ptr<const void>, int64_t>> pull(
      const std::string& key, std::optional<int64_t> version) const;
  /// Later push/pull raise ClosedError (a local accessor outliving its server).
  void close();
  const std::string& server_name() const { return name_; }

 private:
  void check_open() const;
  struct Entry {
    int64_t version;
    std::shared_ptr<const void> value;
  };
  std::string name_;
  int64_t depth_;
  mutable std::mutex mu_;
  bool closed_ = false;
  std::map<std::string, std::vector<Entry>> chains_;  // oldest first; size <= depth_
};

/// What an OrderedServerSimpleImpl pairs under its name: the host, the depth and the value
/// type travel (get_paired); `store` is the live store, set only in the host's own copy
/// (local_paired), so an accessor on the host skips RPC.
struct OrderedServerInfo {
  std::string host;
  int64_t version_depth = 1;
  std::string value_type;  ///< typeid(V).name() of the server
  std::shared_ptr<OrderedStore> store;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(host, version_depth, value_type);
  }
};

std::string ordered_push_service(const std::string& server_name);
std::string ordered_pull_service(const std::string& server_name);

/// Registers the two services (`register_service(store, push)`: true for the push service,
/// false for the pull one) and pairs the info of a new server; undoes what it did and
/// rethrows when a step fails.
std::shared_ptr<OrderedStore> open_ordered_server(
    const std::string& server_name, RpcGroup& group, int64_t version_depth,
    const std::type_info& value_type,
    const std::function<void(const std::shared_ptr<OrderedStore>&, bool push)>& register_service);
/// Unpairs, deregisters and closes. Errors of the group (destroyed) are reported when
/// `report` is true and swallowed otherwise.
void close_ordered_server(const std::string& server_name, RpcGroup& group,
                          const std::shared_ptr<OrderedStore>& store, bool report);

/// Where a server is: its member, and its live store when that is this member.
struct OrderedServerLocation {
  std::string host;
  std::shared_ptr<OrderedStore> local;
};
/// Finds the server `server_name` through its pair and checks its value type.
/// Errors: RpcKeyNotFoundError (no such server yet), ValueError (another value type), the
/// errors of RRef::to_here within `timeout`.
OrderedServerLocation resolve_ordered_server(RpcGroup& group, const std::string& server_name,
                                             const std::type_info& value_type, Timeout timeout);

/// Inside a catch block: re-raises the RPC failure of `what` (an operation of `subject`,
/// e.g. "ordered server 'ps'") sent to `member`, with a message naming both; TimeoutError
/// and RpcPeerLostError keep their types, every other error is rethrown as it is.
[[noreturn]] void rethrow_server_call_error(const std::string& subject, const char* what,
                                            const std::string& member);

/// A copy of `value` sharing no memory with it (tensors cloned). Generic values round-trip
/// through dumps/loads; StateDict and at::Tensor clone their tensors directly.
template <class V>
V deep_copy(const V& value) {
  if constexpr (std::is_same_v<V, at::Tensor>) {
    return value.defined() ? value.detach().clone() : value;
  } else if constexpr (std::is_same_v<V, StateDict>) {
    StateDict out;
    for (const auto& [k, t] : value) out.emplace(k, t.defined() ? t.detach().clone() : t);
    return out;
  } else {
    return loads<V>(dumps(value));
  }
}

/// A CPU copy of `tensors` in torchpar shared memory: one segment holding them all (each
/// contiguous, at a 64-byte aligned offset), so that the RPC layer sends the whole dict to
/// a member on this host as one handle and the receiver maps one segment. Undefined entries
/// stay undefined. A private CPU copy instead when a tensor cannot live in shared memory
/// (sparse, quantized), when the dict holds no bytes, or when shared memory is short.
StateDict shared_copy(const StateDict& tensors);
/// The same for one tensor.
at::Tensor shared_copy(const at::Tensor& tensor);

/// What a server stores for a value pushed on its host: a copy, in shared memory for an
/// at::Tensor or StateDict on the CPU (so that pulls from other processes of the host
/// travel as handles to it, see OrderedServerSimple::pull_view); deep_copy otherwise.
template <class V>
V stored_copy(const V& value) {
  if constexpr (std::is_same_v<V, at::Tensor>) {
    return !value.defined() || value.device().is_cpu() ? shared_copy(value) : deep_copy(value);
  } else if constexpr (std::is_same_v<V, StateDict>) {
    for (const auto& [k, t] : value) {
      if (t.defined() && !t.device().is_cpu()) return deep_copy(value);
    }
    return shared_copy(value);
  } else {
    return deep_copy(value);
  }
}

/// `value` ready for an RPC push: tensors in torchpar shared memory, which the RPC layer
/// sends as handles to a member on this host (so the server would alias the caller's
/// memory), are cloned. For at::Tensor and StateDict; other types travel as they are.
template <class V>
V unshared(const V& value) {
  if constexpr (std::is_same_v<V, at::Tensor>) {
    return value.defined() && is_shared(value) ? value.detach().clone() : value;
  } else if constexpr (std::is_same_v<V, StateDict>) {
    StateDict out;
    for (const auto& [k, t] : value) out.emplace(k, unshared(t));
    return out;
  } else {
    return value;
  }
}

}  // namespace detail

/// The server half of OrderedServerSimple: hosted by the member that constructs it, which
/// registers the services `<server_name>/_push_service` and `<server_name>/_pull_service`
/// and pairs its description under `server_name` (machin pairs the accessor itself there).
///
/// ```cpp
/// // on member "0"
/// torchpar::OrderedServerSimpleImpl<torchpar::StateDict> impl("ps", group, /*depth*/ 2);
/// // on any member, after a barrier
/// torchpar::OrderedServerSimple<torchpar::StateDict> server("ps", group);
/// server.push("model", sd, 1, std::nullopt);
/// ```
///
/// version_depth: the number of versions kept per key (>= 1; 1 keeps only the newest), as
/// machin documents it. machin itself keeps version_depth + 1: machin's depth 1 is depth 2
/// here. Pushing a version that is still stored replaces it and makes it the newest.
///
/// Errors:  ValueError for version_depth < 1; RpcKeyTakenError when `server_name` (or one of
///          its service names) is taken in the group; ClosedError after the group's destroy.
/// Safety:  thread- and process-safe; services run on the RPC threads behind one mutex.
/// Lifetime: `group` must outlive this object. The destructor (or close()) unpairs and
///          deregisters; accessors then fail (RpcKeyNotFoundError remotely, ClosedError on
///          this member). Stored values live in this process and die with it.
/// Source:  machin.parallel.server.OrderedServerSimpleImpl.
template <class V>
class OrderedServerSimpleImpl {
 public:
  OrderedServerSimpleImpl(std::string server_name, RpcGroup& group, int64_t version_depth = 1)
      : name_(std::move(server_name)), group_(&group) {
    store_ = detail::open_ordered_server(
        name_, group, version_depth, typeid(V),
        [this](const std::shared_ptr<detail::OrderedStore>& s, bool push) {
          std::weak_ptr<detail::OrderedStore> weak = s;
          if (push) {
            group_->register_service(detail::ordered_push_service(name_),
                                     [weak](std::string key, V value, int64_t version,
                                            std::optional<int64_t> prev_version) -> bool {
                                       return lock(weak)->push(
                                           key, std::make_shared<const V>(std::move(value)),
                                           version, prev_version);
                                     });
          } else {
            group_->register_service(
                detail::ordered_pull_service(name_),
                [weak](std::string key,
                       std::optional<int64_t> version) -> std::optional<std::pair<V, int64_t>> {
                  auto got = lock(weak)->pull(key, version);
                  if (!got) return std::nullopt;
                  return std::pair<V, int64_t>(*std::static_pointer_cast<const V>(got->first),
                                               got->second);
                });
          }
        });
  }
  OrderedServerSimpleImpl(const OrderedServerSimpleImpl&) = delete;
  OrderedServerSimpleImpl& operator=(const OrderedServerSimpleImpl&) = delete;
  /// Unpairs and deregisters; never throws (see close()).
  ~OrderedServerSimpleImpl() {
    if (store_) detail::close_ordered_server(name_, *group_, std::exchange(store_, nullptr), false);
  }

  /// Unpairs, deregisters and drops the stored values. Idempotent.
  /// Errors: ClosedError when the group was destroyed first (the server is closed anyway).
  void close() {
    if (store_) detail::close_ordered_server(name_, *group_, std::exchange(store_, nullptr), true);
  }
  const std::string& server_name() const { return name_; }

 private:
  static std::shared_ptr<detail::OrderedStore> lock(const std::weak_ptr<detail::OrderedStore>& w) {
    auto s = w.lock();
    if (!s) throw ClosedError("ordered server: closed");
    return s;
  }
  std::string name_;
  RpcGroup* group_;
  std::shared_ptr<detail::OrderedStore> store_;
};

/// The accessor of an OrderedServerSimpleImpl, constructed on any member (including the
/// host) by name. It finds the server through the pair `server_name`: on first use it
/// reads the pair (checking the value type); on the host it then works on the store
/// directly (values deep-copied, no RPC), elsewhere it calls the two services.
///
/// Errors (push, pull, pull_view):  RpcKeyNotFoundError when no server `server_name`
///          exists (yet); ValueError when the server holds another value type; TimeoutError
///          (the call's timeout passed) and RpcPeerLostError (the host died or left) naming
///          the server and its member; ClosedError on the host after the server was closed.
/// Safety:  thread-safe; copies may be used from several threads. Copies: push stores a
///          copy and pull returns one (pull_view need not). The server keeps the at::Tensor
///          and StateDict values pushed on its host in shared memory, so a pull from another
///          process of the host receives them as handles (no bytes through a socket): pull
///          then copies them, pull_view reads them in place. One exception: the RPC layer
///          sends tensors in torchpar shared memory as handles to a member on the same host,
///          so a value of a type other than at::Tensor or StateDict holding shared tensors is
///          stored by reference there (those two types are unshared before they travel).
/// Lifetime: `group` must outlive the accessor.
/// Source:  machin.parallel.server.OrderedServerSimple.
template <class V>
class OrderedServerSimple : public OrderedServerBase<V> {
 public:
  OrderedServerSimple(std::string server_name, RpcGroup& group)
      : state_(std::make_shared<State>()) {
    state_->name = std::move(server_name);
    state_->group = &group;
  }

  bool push(const std::string& key, const V& value, int64_t version,
            std::optional<int64_t> prev_version, Timeout timeout = kDefaultRpcTimeout) override {
    if (auto local = resolve(timeout)) {
      return local->push(key, std::make_shared<const V>(detail::stored_copy(value)), version,
                         prev_version);
    }
    try {
      return state_->group->template registered_sync<bool>(
          detail::ordered_push_service(state_->name),
          std::tuple<std::string, V, int64_t, std::optional<int64_t>>(key, detail::unshared(value),
                                                                      version, prev_version),
          timeout);
    } catch (...) {
      detail::rethrow_server_call_error("ordered server '" + state_->name + "'", "push", host());
    }
  }

  std::optional<std::pair<V, int64_t>> pull(const std::string& key,
                                            std::optional<int64_t> version = std::nullopt,
                                            Timeout timeout = kDefaultRpcTimeout) override {
    if (auto local = resolve(timeout)) {
      auto got = local->pull(key, version);
      if (!got) return std::nullopt;
      return std::pair<V, int64_t>(
          detail::deep_copy(*std::static_pointer_cast<const V>(got->first)), got->second);
    }
    auto got = remote_pull(key, version, timeout);
    // Tensors that came as handles alias the server's stored value: the caller gets copies.
    if (got) got->first = detail::unshared(got->first);
    return got;
  }

  /// As pull without the copy: on the host, the stored tensors themselves; from another
  /// process of the host, the stored tensors kept in shared memory arrive as handles and
  /// are read in place; from another host, a copy as pull. Read-only (see
  /// OrderedServerBase::pull_view).
  std::optional<std::pair<V, int64_t>> pull_view(const std::string& key,
                                                 std::optional<int64_t> version = std::nullopt,
                                                 Timeout timeout = kDefaultRpcTimeout) override {
    if (auto local = resolve(timeout)) {
      auto got = local->pull(key, version);
      if (!got) return std::nullopt;
      return std::pair<V, int64_t>(*std::static_pointer_cast<const V>(got->first), got->second);
    }
    return remote_pull(key, version, timeout);
  }

  const std::string& server_name() const { return state_->name; }

 private:
  struct State {
    std::string name;
    RpcGroup* group = nullptr;
    std::mutex mu;
    bool resolved = false;
    std::string host;
    std::shared_ptr<detail::OrderedStore> local;
  };

  std::optional<std::pair<V, int64_t>> remote_pull(const std::string& key,
                                                   std::optional<int64_t> version,
                                                   Timeout timeout) {
    try {
      return state_->group->template registered_sync<std::optional<std::pair<V, int64_t>>>(
          detail::ordered_pull_service(state_->name),
          std::tuple<std::string, std::optional<int64_t>>(key, version), timeout);
    } catch (...) {
      detail::rethrow_server_call_error("ordered server '" + state_->name + "'", "pull", host());
    }
  }

  std::shared_ptr<detail::OrderedStore> resolve(Timeout timeout) {
    {
      std::lock_guard<std::mutex> g(state_->mu);
      if (state_->resolved) return state_->local;
    }
    // Outside the lock: the lookup may take a round trip. A failure is not cached.
    auto where = detail::resolve_ordered_server(*state_->group, state_->name, typeid(V), timeout);
    std::lock_guard<std::mutex> g(state_->mu);
    state_->resolved = true;
    state_->host = std::move(where.host);
    state_->local = std::move(where.local);
    return state_->local;
  }
  std::string host() const {
    std::lock_guard<std::mutex> g(state_->mu);
    return state_->host;
  }

  std::shared_ptr<State> state_;
};

}  // namespace torchpar
