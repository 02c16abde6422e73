#pragma once
/// RpcGroup: machin.parallel.distributed's RpcGroup in C++ (services registered by key,
/// paired values, registered_sync/async/remote), plus rpc_sync / rpc_async / remote to
/// functions registered by name (torch.distributed.rpc's API, without pickled code).
///
/// A group is created collectively by its members with World::create_rpc_group. Messages
/// travel over authenticated connections (the job's key, Python multiprocessing.connection's
/// handshake: see torchpar/core/auth.h): TCP, or TensorPipe's shared memory between members
/// of one host; listeners bind to 127.0.0.1 unless TORCHPAR_RPC_ADDR names a host. Arguments
/// and results are any torchpar-serializable values (cereal types, at::Tensor, c10::IValue);
/// tensors travel beside the message (never through the serialization buffer), and
/// tensors already in torchpar shared memory travel as handles (no copy) to a member on the
/// same host. Calls are executed on a thread pool of the callee (RpcOptions::num_threads).
///
/// Timeouts: every call takes one (seconds, fractions allowed). `kDefaultRpcTimeout`
/// (60 s, torch.distributed.rpc's default) unless given; std::nullopt waits forever.

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeindex>
#include <utility>
#include <vector>

#include "torchpar/core/error.h"
#include "torchpar/core/timeout.h"
#include "torchpar/rpc/detail/rpc_detail.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar {

/// torch.distributed.rpc's default timeout of one call (seconds).
inline constexpr std::chrono::duration<double> kDefaultRpcTimeout{60.0};

// The RPC errors (RpcKeyTakenError, RpcKeyNotOwnedError, RpcKeyNotFoundError, RpcRemoteError,
// RpcPeerLostError) are in torchpar/core/error.h with the rest of the family.

/// The result of an asynchronous call (torch.futures.Future / machin's future).
/// Thread-safe; copies share one outcome.
template <class T>
class RpcFuture {
 public:
  RpcFuture() = default;
  explicit RpcFuture(std::shared_ptr<detail::RpcFutureState> state) : state_(std::move(state)) {}

  /// True once the call ended (value or error).
  bool done() const { return detail::rpc_future_done(*state_); }

  /// Waits for the result (extra bound `timeout`; the call's own timeout always applies)
  /// and returns it, or rethrows the call's error: RpcRemoteError (the callee threw),
  /// TimeoutError (the call's timeout or this wait's passed), RpcPeerLostError,
  /// RpcKeyNotFoundError, SerializationError (the result is not a T). May be called
  /// repeatedly; each call decodes the value again.
  T wait(Timeout timeout = std::nullopt) const {
    if (!state_) throw ValueError("RpcFuture: default-constructed future has no call");
    return detail::rpc_result<T>(detail::rpc_future_value(*state_, timeout));
  }

 private:
  std::shared_ptr<detail::RpcFutureState> state_;
};

/// A reference to a value owned by one member (torch.distributed.rpc.RRef). Copies share
/// one reference; when the last RRef to a remote() result in every process is gone, its
/// owner frees the value (messages to the owner; when the member that made the remote()
/// call dies, the owner frees the values it held at once, as no one else can reach them).
/// RRefs to paired values are not counted: the value lives until the owner unpairs it.
/// Cannot be sent inside RPC arguments (yet).
/// Thread-safe.
template <class T>
class RRef {
 public:
  RRef() = default;
  explicit RRef(std::shared_ptr<detail::RRefState> state) : state_(std::move(state)) {}

  /// The member that owns the value.
  const std::string& owner() const { return detail::rref_owner(state()); }
  /// True in the owner's process.
  bool is_owner() const;
  /// A copy of the value (fetched from the owner; the owner decodes its own copy). Waits
  /// up to `timeout` for a remote() result still being computed.
  /// Errors: TimeoutError; RpcRemoteError when the remote() call threw; RpcPeerLostError
  /// when the owner is gone; SerializationError when the value is not a T.
  T to_here(Timeout timeout = kDefaultRpcTimeout) const {
    return detail::rpc_decode<T>(detail::rref_fetch(state(), timeout));
  }
  /// The state shared by copies (for the RPC layer).
  const std::shared_ptr<detail::RRefState>& state_ptr() const { return state_; }

 private:
  const detail::RRefState& state() const {
    if (!state_) throw ValueError("RRef: default-constructed RRef refers to nothing");
    return *state_;
  }
  std::shared_ptr<detail::RRefState> state_;
};

template <class T>
bool RRef<T>::is_owner() const {
  return detail::rref_is_owner(state());
}

/// Registers `fn` under `name` for rpc_sync / rpc_async / remote in this process (the
/// callee's registration is what runs). Functions travel by name, never by address, so
/// every process that may be called must register the same names, typically at namespace
/// scope:
///   static const bool kAdd = torchpar::register_function("add", +[](int a, int b) { return a + b;
///   });
/// Arguments are decoded as std::tuple of the parameters' decayed types; the caller's tuple
/// must have those types (a string literal counts as std::string). Re-registering a name
/// replaces it. Thread-safe. Returns true (for static initializers).
template <class F>
bool register_function(const std::string& name, F fn) {
  detail::register_rpc_function(name, detail::make_rpc_handler(std::move(fn)));
  return true;
}

/// Options of World::create_rpc_group.
struct RpcGroupOptions {
  /// Bound of the collective creation (every member must join), seconds.
  std::chrono::duration<double> timeout = std::chrono::seconds(60);
};

class World;

/// A named group of World members that call each other (machin's RpcGroup).
///
/// Safety: every method is thread-safe. Services and pairs are owned by the member that
/// registered them; ownership is recorded in the World's store (addresses and owners only,
/// never secrets), and owner lookups are cached, so a steady-state call is one round trip.
class RpcGroup {
 public:
  RpcGroup();
  ~RpcGroup();
  /// Copies share the group (machin's RpcGroup is a shared handle too); destroy() on any
  /// copy destroys it for all.
  RpcGroup(const RpcGroup&);
  RpcGroup& operator=(const RpcGroup&);
  RpcGroup(RpcGroup&&) noexcept;
  RpcGroup& operator=(RpcGroup&&) noexcept;

  /// Member names, sorted ascending (machin).
  std::vector<std::string> get_group_members() const;
  /// This process's member name.
  const std::string& get_cur_name() const;
  /// The group's name.
  const std::string& get_group_name() const;
  /// True when `name` is a member.
  bool is_member(const std::string& name) const;
  /// Waits until every member called barrier (store-based). Errors: TimeoutError naming
  /// the members that did not arrive.
  void barrier(Timeout timeout = kDefaultRpcTimeout);
  /// Leaves the group: deregisters this member's services and pairs, fails calls it has
  /// in flight (RpcPeerLostError) and stops answering this group's calls. The process's
  /// transport stays up for other groups until the World is destroyed. Idempotent.
  void destroy(Timeout timeout = std::chrono::seconds(10));

  // ---- services (machin: register / deregister / is_registered / registered_*) --------
  /// Registers `fn` (any callable with one operator(); its parameters are decoded as their
  /// decayed types) under `key`, owned by this member. C++ has `register` as a keyword,
  /// hence the name. Errors: RpcKeyTakenError naming the owner when `key` is taken.
  template <class F>
  void register_service(const std::string& key, F fn) {
    register_handler(key, detail::make_rpc_handler(std::move(fn)));
  }
  /// Removes a service this member registered. Errors: RpcKeyNotOwnedError when another
  /// member (or nobody) holds `key`.
  void deregister_service(const std::string& key);
  /// True when some member holds service `key`.
  bool is_registered(const std::string& key) const;

  /// Calls service `key` on its owner with `args` (a std::tuple; std::tuple<>{} for none)
  /// and returns its result as an R (void: nothing).
  /// Errors: RpcKeyNotFoundError; RpcRemoteError (the service threw); TimeoutError;
  /// RpcPeerLostError; SerializationError when argument or result types differ from the
  /// service's.
  template <class R, class... A>
  R registered_sync(const std::string& key, const std::tuple<A...>& args,
                    Timeout timeout = kDefaultRpcTimeout) {
    return registered_async<R>(key, args, timeout).wait();
  }
  template <class R, class... A>
  RpcFuture<R> registered_async(const std::string& key, const std::tuple<A...>& args,
                                Timeout timeout = kDefaultRpcTimeout) {
    const std::string owner = service_owner(key);
    return RpcFuture<R>(
        call_service(key, owner, detail::rpc_encode_args(args, same_host(owner)), timeout));
  }
  template <class R, class... A>
  RRef<R> registered_remote(const std::string& key, const std::tuple<A...>& args,
                            Timeout timeout = kDefaultRpcTimeout) {
    const std::string owner = service_owner(key);
    return RRef<R>(
        remote_service(key, owner, detail::rpc_encode_args(args, same_host(owner)), timeout));
  }
  /// The same three calls with the arguments one by one (machin's `args=(a, b)`), with the
  /// default timeout: `registered_sync<int>("add", 2, 3)`; none: `registered_sync<int>("f")`.
  /// A first argument that is a std::tuple selects the tuple form (its elements are the
  /// arguments); a duration among them does not compile (use the tuple form for a timeout).
  template <class R, class A0, class... A, detail::RpcVariadicArgs<A0, A...> = 0>
  R registered_sync(const std::string& key, const A0& a0, const A&... rest) {
    return registered_sync<R>(key, std::forward_as_tuple(a0, rest...));
  }
  template <class R>
  R registered_sync(const std::string& key) {
    return registered_sync<R>(key, std::tuple<>{});
  }
  template <class R, class A0, class... A, detail::RpcVariadicArgs<A0, A...> = 0>
  RpcFuture<R> registered_async(const std::string& key, const A0& a0, const A&... rest) {
    return registered_async<R>(key, std::forward_as_tuple(a0, rest...));
  }
  template <class R>
  RpcFuture<R> registered_async(const std::string& key) {
    return registered_async<R>(key, std::tuple<>{});
  }
  template <class R, class A0, class... A, detail::RpcVariadicArgs<A0, A...> = 0>
  RRef<R> registered_remote(const std::string& key, const A0& a0, const A&... rest) {
    return registered_remote<R>(key, std::forward_as_tuple(a0, rest...));
  }
  template <class R>
  RRef<R> registered_remote(const std::string& key) {
    return registered_remote<R>(key, std::tuple<>{});
  }

  // ---- pairs (machin: pair / unpair / is_paired / get_paired) ----------------------------
  /// Pairs `value` with `key`, owned by this member; get_paired returns RRefs to it.
  /// Errors: RpcKeyTakenError.
  template <class T>
  void pair(const std::string& key, T value) {
    auto holder = std::make_shared<T>(std::move(value));
    pair_value(key, std::type_index(typeid(T)), holder,
               [holder](bool same_host) { return detail::rpc_encode(*holder, same_host); });
  }
  /// Removes a pair this member made. Errors: RpcKeyNotOwnedError.
  void unpair(const std::string& key);
  /// True when some member paired `key`.
  bool is_paired(const std::string& key) const;
  /// An RRef to the value paired with `key`. Errors: RpcKeyNotFoundError.
  template <class T>
  RRef<T> get_paired(const std::string& key) const {
    return RRef<T>(paired_state(key));
  }
  /// On the owner of pair `key`: the paired object itself (not a copy), for servers built
  /// on pairs. Errors: RpcKeyNotOwnedError when this member does not own it; ValueError
  /// when it is not a T.
  template <class T>
  std::shared_ptr<T> local_paired(const std::string& key) const {
    return std::static_pointer_cast<T>(local_paired_object(key, std::type_index(typeid(T))));
  }

  // ---- functions by name (torch.distributed.rpc) -----------------------------------------
  /// Runs the function registered as `fn` (register_function) on member `to`.
  /// Errors as registered_sync; RpcKeyNotFoundError when `to` has no function `fn`;
  /// ValueError when `to` is not a member.
  template <class R, class... A>
  R rpc_sync(const std::string& to, const std::string& fn, const std::tuple<A...>& args,
             Timeout timeout = kDefaultRpcTimeout) {
    return rpc_async<R>(to, fn, args, timeout).wait();
  }
  template <class R, class... A>
  RpcFuture<R> rpc_async(const std::string& to, const std::string& fn, const std::tuple<A...>& args,
                         Timeout timeout = kDefaultRpcTimeout) {
    return RpcFuture<R>(
        call_function(to, fn, detail::rpc_encode_args(args, same_host(to)), timeout));
  }
  /// Runs `fn` on `to` and returns at once an RRef to its result, owned by `to`.
  template <class R, class... A>
  RRef<R> remote(const std::string& to, const std::string& fn, const std::tuple<A...>& args,
                 Timeout timeout = kDefaultRpcTimeout) {
    return RRef<R>(remote_function(to, fn, detail::rpc_encode_args(args, same_host(to)), timeout));
  }
  /// rpc_sync, rpc_async and remote with the arguments one by one, with the default timeout:
  /// `rpc_sync<int>("1", "add", 2, 3)`; none: `rpc_sync<int>("1", "f")` (machin's and
  /// torch.distributed.rpc's `args=(2, 3)`). A first argument that is a std::tuple selects
  /// the tuple form; a duration among them does not compile (use the tuple form for a
  /// timeout). String literals travel as std::string.
  template <class R, class A0, class... A, detail::RpcVariadicArgs<A0, A...> = 0>
  R rpc_sync(const std::string& to, const std::string& fn, const A0& a0, const A&... rest) {
    return rpc_sync<R>(to, fn, std::forward_as_tuple(a0, rest...));
  }
  template <class R>
  R rpc_sync(const std::string& to, const std::string& fn) {
    return rpc_sync<R>(to, fn, std::tuple<>{});
  }
  template <class R, class A0, class... A, detail::RpcVariadicArgs<A0, A...> = 0>
  RpcFuture<R> rpc_async(const std::string& to, const std::string& fn, const A0& a0,
                         const A&... rest) {
    return rpc_async<R>(to, fn, std::forward_as_tuple(a0, rest...));
  }
  template <class R>
  RpcFuture<R> rpc_async(const std::string& to, const std::string& fn) {
    return rpc_async<R>(to, fn, std::tuple<>{});
  }
  template <class R, class A0, class... A, detail::RpcVariadicArgs<A0, A...> = 0>
  RRef<R> remote(const std::string& to, const std::string& fn, const A0& a0, const A&... rest) {
    return remote<R>(to, fn, std::forward_as_tuple(a0, rest...));
  }
  template <class R>
  RRef<R> remote(const std::string& to, const std::string& fn) {
    return remote<R>(to, fn, std::tuple<>{});
  }

  /// Counters for tests and monitoring: RRef values this process owns (remote() results
  /// still referenced), calls waiting for a reply, services and pairs this member owns.
  struct DebugInfo {
    size_t owned_rrefs = 0;
    size_t pending_calls = 0;
    size_t services = 0;
    size_t pairs = 0;
  };
  DebugInfo debug_info() const;

  struct Impl;
  explicit RpcGroup(std::shared_ptr<Impl> impl);

 private:
  void register_handler(const std::string& key, detail::RpcHandler fn);
  /// The owner of service `key` (cached). Errors: RpcKeyNotFoundError.
  std::string service_owner(const std::string& key) const;
  /// True when `member` runs on this host (ValueError when it is not a member).
  bool same_host(const std::string& member) const;
  std::shared_ptr<detail::RpcFutureState> call_service(const std::string& key,
                                                       const std::string& owner,
                                                       detail::RpcValue args, Timeout timeout);
  std::shared_ptr<detail::RRefState> remote_service(const std::string& key,
                                                    const std::string& owner, detail::RpcValue args,
                                                    Timeout timeout);
  std::shared_ptr<detail::RpcFutureState> call_function(const std::string& to,
                                                        const std::string& fn,
                                                        detail::RpcValue args, Timeout timeout);
  std::shared_ptr<detail::RRefState> remote_function(const std::string& to, const std::string& fn,
                                                     detail::RpcValue args, Timeout timeout);
  void pair_value(const std::string& key, std::type_index type, std::shared_ptr<void> object,
                  std::function<detail::RpcValue(bool same_host)> encode);
  std::shared_ptr<detail::RRefState> paired_state(const std::string& key) const;
  std::shared_ptr<void> local_paired_object(const std::string& key, std::type_index type) const;

  std::shared_ptr<Impl> impl_;
};

}  // namespace torchpar
