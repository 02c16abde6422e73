#pragma once
/// Registered (custom) manager types: a user type with the member functions it exposes,
/// made and called in a Manager's server through a typed proxy (Python's
/// BaseManager.register(typeid, callable, exposed=...)).
///
/// Registration fills a process-global registry keyed by typeid. The server process
/// looks its typeids up there, so registration must have run in the server too, before
/// the Manager's server starts, whatever the start method:
///   - at namespace scope, by a static (runs in every process of the binary: the fork
///     child inherits it, a spawned or forkserver server runs static initializers when it
///     execs the binary):
///       static const auto kCounterType =
///           torchpar::register_managed_type<Counter>("Counter")
///               .init<int64_t>()
///               .expose("increment", &Counter::increment)
///               .expose("value", &Counter::value);
///     (or the same chain inside TORCHPAR_REGISTER_MANAGED_TYPE(...), below);
///   - or in main() before torchpar::init(argc, argv): a spawned or forkserver server
///     re-runs main up to init, so registrations before it run there too.
/// Registering later (after torchpar::init, or after a Manager started) leaves spawned
/// servers without the type: creating it raises RemoteError("ValueError", "the manager
/// has no typeid ...").
///
/// Arguments and results are torchpar payloads with tensors copied (dumps with
/// copy_tensor): the constructor's arguments are decoded as std::tuple<std::decay_t<A>...>
/// of init<A...>(), each exposed member function's as std::tuple<std::decay_t<Args>...> of
/// its parameters, and its result is encoded as std::decay_t<R> (a void member returns
/// nothing). A string literal argument travels as std::string.

#include <c10/util/Type.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeindex>
#include <typeinfo>
#include <utility>

#include "torchpar/core/timeout.h"
#include "torchpar/manager/proxy.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar {

namespace detail {

/// What the server needs of one registered typeid (type-erased), and what a client uses to
/// check its calls' types when the typeid is registered in its own process too.
struct ManagedTypeInfo {
  struct Method {
    /// Decodes the arguments, calls the member on `object` (a T*), encodes the result.
    std::function<std::string(void* object, const std::string& args)> call;
    std::type_index args = typeid(void);    ///< std::tuple<std::decay_t<Args>...>
    std::type_index result = typeid(void);  ///< std::decay_t<R>; void for none
  };
  std::string type_id;
  std::type_index cpp_type = typeid(void);  ///< T
  std::string cpp_name;                     ///< demangled T, for messages
  bool thread_safe = false;
  /// Makes a T from the create request's args (nullptr: T has no constructor registered).
  std::function<std::shared_ptr<void>(const std::string& args)> make;
  std::type_index init_args = typeid(std::tuple<>);
  std::map<std::string, Method> methods;  ///< sorted, so messages list them in order
};

/// Publishes `info` under info->type_id, replacing an earlier registration. Thread-safe.
void publish_managed_type(std::shared_ptr<const ManagedTypeInfo> info);
/// The registration of `type_id` in this process, or nullptr. Thread-safe.
std::shared_ptr<const ManagedTypeInfo> find_managed_type(const std::string& type_id);

/// Client-side checks against this process's registry (no-ops for a typeid that is not
/// registered here: the server then checks). Errors: ValueError naming the expected and
/// the given C++ types.
void check_managed_init(const std::string& type_id, const std::type_info& cpp_type,
                        const std::type_info& args);
void check_managed_call(const std::string& type_id, const std::type_info& cpp_type,
                        const std::string& method, const std::type_info& args,
                        const std::type_info& result);

/// How an argument travels: a string literal or char pointer as std::string, everything
/// else as its decayed type.
template <class A>
using managed_wire_t = std::conditional_t<std::is_same_v<std::decay_t<A>, const char*> ||
                                              std::is_same_v<std::decay_t<A>, char*>,
                                          std::string, std::decay_t<A>>;

template <class M>
struct MemberTraits;
template <class R, class C, class... A>
struct MemberTraits<R (C::*)(A...)> {
  using Class = C;
  using Result = R;
  using Params = std::tuple<A...>;
};
template <class R, class C, class... A>
struct MemberTraits<R (C::*)(A...) const> : MemberTraits<R (C::*)(A...)> {};
template <class R, class C, class... A>
struct MemberTraits<R (C::*)(A...) noexcept> : MemberTraits<R (C::*)(A...)> {};
template <class R, class C, class... A>
struct MemberTraits<R (C::*)(A...) const noexcept> : MemberTraits<R (C::*)(A...)> {};

template <class T>
T decode_managed(const std::string& bytes) {
  return loads<T>(Payload{bytes, {}});
}
template <class T>
std::string encode_managed(const T& value) {
  return dumps(value, {.copy_tensor = true}).bytes;
}

/// Calls `method` on `self` with the decoded arguments, each passed as its parameter type
/// asks (by value: moved; by reference: the decoded value).
template <class T, class M, class... A, size_t... I>
std::string invoke_member(T& self, M method, std::tuple<std::decay_t<A>...>& args,
                          std::tuple<A...>* /*params*/, std::index_sequence<I...> /*indices*/) {
  using R = typename MemberTraits<M>::Result;
  if constexpr (std::is_void_v<R>) {
    (self.*method)(static_cast<A&&>(std::get<I>(args))...);
    return {};
  } else {
    return encode_managed<std::decay_t<R>>((self.*method)(static_cast<A&&>(std::get<I>(args))...));
  }
}

template <class T, class M, class... A>
std::string call_member(void* object, M method, const std::string& bytes, std::tuple<A...>* p) {
  auto args = bytes.empty() && sizeof...(A) == 0
                  ? std::tuple<std::decay_t<A>...>()
                  : decode_managed<std::tuple<std::decay_t<A>...>>(bytes);
  return invoke_member<T, M, A...>(*static_cast<T*>(object), method, args, p,
                                   std::index_sequence_for<A...>());
}

}  // namespace detail

/// The registration of a user type `T` under a typeid, built by chained calls (each one
/// publishes the registration at once). Returned by register_managed_type; keep it (or a
/// copy) to make objects with Manager::make(type, args...).
///
/// Example:
///   struct Counter {
///     explicit Counter(int64_t start) : n(start) {}
///     int64_t increment(int64_t by) { return n += by; }
///     int64_t value() const { return n; }
///     int64_t n;
///   };
///   static const auto kCounterType = torchpar::register_managed_type<Counter>("Counter")
///                                        .init<int64_t>()
///                                        .expose("increment", &Counter::increment)
///                                        .expose("value", &Counter::value);
///   int main(int argc, char** argv) {
///     torchpar::init(argc, argv);
///     torchpar::Manager manager;
///     torchpar::Proxy<Counter> c = manager.make(kCounterType, int64_t{10});
///     c.call<int64_t>("increment", int64_t{5});     // 15, run in the server
///     int64_t v = c.call<int64_t>("value");           // 15
///   }
///
/// Requires: T is constructible from init's arguments (default constructible when init is
///           never called); every exposed member's parameters and result are
///           torchpar-serializable and default constructible.
/// Safety:   registration is thread-safe, but must happen before the Manager's server starts
///           (see the header comment). In the server, calls to one object run one at a time
///           (T needs no lock, and its members must not block for long: they hold up every
///           other call on that object) unless thread_safe() was set: then calls from
///           different clients run concurrently and T locks itself.
/// Errors:   the chained calls do not throw (std::bad_alloc aside).
/// Source:   multiprocessing.managers.BaseManager.register(typeid, callable, exposed=...).
template <class T>
class ManagedType {
 public:
  /// Registers `type_id` for T: no methods exposed yet; T made with no arguments when it is
  /// default constructible. A typeid registered again is replaced.
  explicit ManagedType(std::string type_id) : info_(std::make_shared<detail::ManagedTypeInfo>()) {
    info_->type_id = std::move(type_id);
    info_->cpp_type = typeid(T);
    info_->cpp_name = c10::demangle(typeid(T).name());
    if constexpr (std::is_default_constructible_v<T>) {
      info_->make = [](const std::string&) -> std::shared_ptr<void> {
        return std::make_shared<T>();
      };
    }
    publish();
  }

  /// T is made in the server as T(A...) from the arguments of Manager::make (decoded as
  /// std::tuple<std::decay_t<A>...>). Source: register's `callable`.
  template <class... A>
  ManagedType& init() {
    static_assert(std::is_constructible_v<T, std::decay_t<A>&&...>,
                  "init<A...>(): T is not constructible from A...");
    info_->make = [](const std::string& bytes) -> std::shared_ptr<void> {
      auto args = bytes.empty() && sizeof...(A) == 0
                      ? std::tuple<std::decay_t<A>...>()
                      : detail::decode_managed<std::tuple<std::decay_t<A>...>>(bytes);
      return std::apply(
          [](auto&... a) -> std::shared_ptr<void> { return std::make_shared<T>(std::move(a)...); },
          args);
    };
    info_->init_args = typeid(std::tuple<std::decay_t<A>...>);
    publish();
    return *this;
  }

  /// Exposes the member function `method` (const, noexcept and overloads picked with a
  /// cast all accepted) under `name`; a name exposed again is replaced.
  /// Source: register's `exposed`.
  template <class M>
  requires std::is_member_function_pointer_v<M> ManagedType& expose(const std::string& name,
                                                                    M method) {
    using Traits = detail::MemberTraits<M>;
    static_assert(std::is_base_of_v<typename Traits::Class, T>,
                  "expose(): the member function is not one of T's");
    detail::ManagedTypeInfo::Method m;
    m.call = [method](void* object, const std::string& bytes) {
      return detail::call_member<T, M>(object, method, bytes,
                                       static_cast<typename Traits::Params*>(nullptr));
    };
    m.args = typeid(decltype(args_tuple(static_cast<typename Traits::Params*>(nullptr))));
    m.result = std::is_void_v<typename Traits::Result>
                   ? std::type_index(typeid(void))
                   : std::type_index(typeid(std::decay_t<typename Traits::Result>));
    info_->methods[name] = std::move(m);
    publish();
    return *this;
  }

  /// Calls from different clients may run concurrently on one object (T locks itself):
  /// for types with blocking members. Default: one call at a time.
  ManagedType& thread_safe(bool yes = true) {
    info_->thread_safe = yes;
    publish();
    return *this;
  }

  const std::string& type_id() const { return info_->type_id; }

 private:
  template <class... A>
  static std::tuple<std::decay_t<A>...> args_tuple(std::tuple<A...>*);

  void publish() {
    // Copy on write: a server that already made objects keeps the registration it saw.
    detail::publish_managed_type(std::make_shared<const detail::ManagedTypeInfo>(*info_));
  }
  std::shared_ptr<detail::ManagedTypeInfo> info_;  // this builder's state
};

/// Registers T under `type_id`; chain init / expose / thread_safe on the result.
/// Source: BaseManager.register.
template <class T>
ManagedType<T> register_managed_type(std::string type_id) {
  return ManagedType<T>(std::move(type_id));
}

/// A namespace-scope registration with a unique hidden name:
///   TORCHPAR_REGISTER_MANAGED_TYPE(torchpar::register_managed_type<Counter>("Counter")
///                                      .init<int64_t>()
///                                      .expose("value", &Counter::value));
#define TORCHPAR_REGISTER_MANAGED_TYPE(...) \
  TORCHPAR_REGISTER_MANAGED_TYPE_AT_(__COUNTER__, __VA_ARGS__)
#define TORCHPAR_REGISTER_MANAGED_TYPE_AT_(n, ...) \
  TORCHPAR_REGISTER_MANAGED_TYPE_AT2_(n, __VA_ARGS__)
#define TORCHPAR_REGISTER_MANAGED_TYPE_AT2_(n, ...)                              \
  [[maybe_unused]] static const bool torchpar_managed_type_registered_##n = [] { \
    (void)(__VA_ARGS__);                                                         \
    return true;                                                                 \
  }()

/// Options of one call through a Proxy.
struct ProxyCallOptions {
  /// How long the method may block in the server (nullopt: no limit). The reply is
  /// awaited for the manager's timeout plus this.
  Timeout wait = std::chrono::duration<double>(0);
};

/// A proxy for an object of a registered type T in a manager's server: each call runs the
/// exposed member function there (Python's AutoProxy of a registered typeid).
///
/// Example: see ManagedType. `c.call<int64_t>("increment", int64_t{5})` runs
///          Counter::increment(5) in the server and returns its result; `c.call("reset")`
///          calls a member returning void.
///
/// Lifetime, safety and the errors of every call (ClosedError, TimeoutError): see
/// BaseProxy. A Proxy<T> can be sent to other processes as any proxy.
/// Source: multiprocessing.managers.AutoProxy / BaseProxy._callmethod.
template <class T>
class Proxy : public BaseProxy {
 public:
  Proxy() = default;
  /// A proxy for the object `ref` refers to (Manager::make makes them).
  explicit Proxy(std::shared_ptr<detail::ProxyRef> ref) : BaseProxy(std::move(ref)) {}

  /// Runs the member exposed as `method` with `args` in the server and returns its result.
  /// R is the member's decayed result type (void for a void member).
  ///
  /// Types:  args travel as std::tuple<managed_wire_t<A>...>; they must be exactly the
  ///         member's decayed parameter types (write int64_t{5}, not 5, for an int64_t).
  /// Errors: ValueError, before anything is sent, when T is registered in this process and
  ///         the arguments or R do not match the member (both signatures named);
  ///         RemoteError("AttributeError", "... 'Counter' exposes no method 'x' (exposed:
  ///         increment, value)") for a method not exposed; RemoteError with the demangled
  ///         C++ type ("std::out_of_range") and message of what the member threw;
  ///         RemoteError("torchpar::SerializationError") when the server could not decode
  ///         the arguments; and BaseProxy's.
  template <class R = void, class... A>
  R call(const std::string& method, const A&... args) const {
    return call<R>(ProxyCallOptions{}, method, args...);
  }
  /// The same, with per-call options (how long the member may block in the server).
  template <class R = void, class... A>
  R call(const ProxyCallOptions& options, const std::string& method, const A&... args) const {
    using Args = std::tuple<detail::managed_wire_t<A>...>;
    detail::check_managed_call(type_id(), typeid(T), method, typeid(Args),
                               std::is_void_v<R> ? typeid(void) : typeid(std::decay_t<R>));
    const std::string result = call_method(
        method, encode_once(Args(static_cast<detail::managed_wire_t<A>>(args)...)), options.wait);
    if constexpr (!std::is_void_v<R>) return decode<std::decay_t<R>>(result);
  }
};

}  // namespace torchpar
