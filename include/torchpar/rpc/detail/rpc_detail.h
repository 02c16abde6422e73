#pragma once
/// RpcGroup's detail machinery: encoding and decoding of arguments and results (RpcValue),
/// the wrapping of callables as handlers, the variadic-argument traits, and the functions
/// behind RpcFuture and RRef (their state is private: src/rpc/rpc_state.h).
///
/// Internal: nothing here is public API (namespace torchpar::detail); it may change without
/// notice. It is an installed header only because the templates of rpc_group.h (RpcFuture,
/// RRef, register_function, the RpcGroup call templates) instantiate it in the user's
/// translation units; include "torchpar/rpc/rpc_group.h" instead.

#include <c10/core/Storage.h>

#include <chrono>
#include <functional>
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

/// A serialized value: bytes plus its tensors' storages (sent out of band).
struct RpcValue {
  std::string bytes;
  std::vector<c10::Storage> storages;
};

/// Encodes `value`; tensors in torchpar shared memory travel as handles when the receiver
/// is on this host (`same_host`), every other storage out of band.
template <class T>
RpcValue rpc_encode(const T& value, bool same_host) {
  RpcValue v;
  v.bytes =
      dumps_with(value,
                 {.copy_tensor = true, .storages = &v.storages, .shared_as_handles = same_host})
          .bytes;
  return v;
}

template <class T>
T rpc_decode(const RpcValue& v) {
  return loads_with<T>(Payload{v.bytes, {}}, {.storages = &v.storages});
}

/// One call's outcome, shared by the caller's RpcFuture and the agent (src/rpc/rpc_state.h).
struct RpcFutureState;
/// True once the call ended.
bool rpc_future_done(const RpcFutureState& state);
/// Waits up to `timeout` for the call's end and returns its value. Errors: TimeoutError when
/// the wait's time passed first; the call's own error.
const RpcValue& rpc_future_value(RpcFutureState& state, Timeout timeout);

/// A type-erased callable: decodes its arguments, runs, encodes its result for a caller
/// on this host (same_host) or another.
using RpcHandler = std::function<RpcValue(const RpcValue& args, bool same_host)>;

template <class F>
struct RpcCallableTraits : RpcCallableTraits<decltype(&std::decay_t<F>::operator())> {};
template <class R, class... A>
struct RpcCallableTraits<R (*)(A...)> {
  using Result = R;
  using Args = std::tuple<std::decay_t<A>...>;
};
template <class R, class... A>
struct RpcCallableTraits<R (*)(A...) noexcept> : RpcCallableTraits<R (*)(A...)> {};
template <class R, class C, class... A>
struct RpcCallableTraits<R (C::*)(A...) const> : RpcCallableTraits<R (*)(A...)> {};
template <class R, class C, class... A>
struct RpcCallableTraits<R (C::*)(A...)> : RpcCallableTraits<R (*)(A...)> {};
template <class R, class C, class... A>
struct RpcCallableTraits<R (C::*)(A...) const noexcept> : RpcCallableTraits<R (*)(A...)> {};
template <class R, class C, class... A>
struct RpcCallableTraits<R (C::*)(A...) noexcept> : RpcCallableTraits<R (*)(A...)> {};

/// Wraps `fn` (a function pointer or a callable with one operator()) as an RpcHandler. A
/// void result travels as an empty value.
template <class F>
RpcHandler make_rpc_handler(F fn) {
  using Traits =
      RpcCallableTraits<std::conditional_t<std::is_function_v<std::remove_pointer_t<F>>,
                                           std::add_pointer_t<std::remove_pointer_t<F>>, F>>;
  using Args = typename Traits::Args;
  using R = typename Traits::Result;
  return [fn = std::move(fn)](const RpcValue& raw, bool same_host) mutable -> RpcValue {
    Args args = rpc_decode<Args>(raw);
    if constexpr (std::is_void_v<R>) {
      std::apply(fn, std::move(args));
      return RpcValue{};
    } else {
      return rpc_encode(std::apply(fn, std::move(args)), same_host);
    }
  };
}

/// How an argument tuple travels: string literals as std::string.
template <class A>
using rpc_wire_t = std::conditional_t<std::is_same_v<std::decay_t<A>, const char*> ||
                                          std::is_same_v<std::decay_t<A>, char*>,
                                      std::string, std::decay_t<A>>;
template <class... A>
RpcValue rpc_encode_args(const std::tuple<A...>& args, bool same_host) {
  return std::apply(
      [same_host](const auto&... a) {
        return rpc_encode(std::tuple<rpc_wire_t<A>...>(a...), same_host);
      },
      args);
}

template <class T>
inline constexpr bool is_std_tuple_v = false;
template <class... A>
inline constexpr bool is_std_tuple_v<std::tuple<A...>> = true;
template <class T>
inline constexpr bool is_duration_v = false;
template <class Rep, class Period>
inline constexpr bool is_duration_v<std::chrono::duration<Rep, Period>> = true;
template <class Rep, class Period>
inline constexpr bool is_duration_v<std::optional<std::chrono::duration<Rep, Period>>> = true;
/// The arguments of a variadic call (rpc_sync<R>(to, fn, a, b)): the first is not a tuple
/// (that is the tuple form) and none is a duration (a timeout would travel as an argument).
template <class A0, class... A>
inline constexpr bool rpc_variadic_args_v =
    !is_std_tuple_v<std::decay_t<A0>> &&
    !(is_duration_v<std::decay_t<A0>> || ... || is_duration_v<std::decay_t<A>>);
template <class A0, class... A>
using RpcVariadicArgs = std::enable_if_t<rpc_variadic_args_v<A0, A...>, int>;

template <class R>
R rpc_result(const RpcValue& v) {
  if constexpr (std::is_void_v<R>) {
    (void)v;
  } else {
    return rpc_decode<R>(v);
  }
}

/// One RRef as this process knows it: where its value lives and, on the owner, the value
/// (src/rpc/rpc_state.h).
struct RRefState;
/// The member owning the RRef's value.
const std::string& rref_owner(const RRefState& state);
/// True in the owner's process.
bool rref_is_owner(const RRefState& state);
/// Fetches the value of an RRef (a copy from its owner, or the owner's own). Errors as
/// RRef::to_here.
RpcValue rref_fetch(const RRefState& state, Timeout timeout);
/// Registers `fn` as the RPC function `name` of this process (see register_function).
void register_rpc_function(const std::string& name, RpcHandler fn);

}  // namespace detail

}  // namespace torchpar
