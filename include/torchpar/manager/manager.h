#pragma once
/// Manager: a server process that holds objects (dicts, lists, namespaces, values, arrays,
/// queues, locks and the other synchronization primitives of torchpar/manager/sync.h, and
/// user types registered with torchpar/manager/register.h) for other processes, which reach
/// them through proxies, on this host or, by TCP, from others (Python's
/// multiprocessing.Manager / managers.BaseManager).
///
/// The server is a torchpar Process (any start method) listening with a Listener
/// (torchpar/ipc/listener.h) on loopback unless told otherwise; every client proves the
/// manager's key with Python's handshake, each connection on its own server thread within
/// 5 s, so peers that connect and stay silent hold up no client (at most 64 handshakes are
/// pending: one more closes the oldest). Each request is one message on that connection
/// (src/manager/protocol.h, docs/wire_format.md): create an object of a typeid, call a
/// method of an object by id, incref, decref, shutdown. The server counts references per
/// object and frees an object when the last proxy anywhere is gone. Calls from processes of
/// the server's host travel through shared memory instead of the socket (a few
/// microseconds a round trip); TORCHPAR_MANAGER_SHM=0 in a client's environment keeps its
/// calls on the socket.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "torchpar/core/auth.h"
#include "torchpar/core/timeout.h"
#include "torchpar/manager/containers.h"
#include "torchpar/manager/proxy.h"
#include "torchpar/manager/python.h"
#include "torchpar/manager/register.h"
#include "torchpar/manager/sync.h"
#include "torchpar/process/start_method.h"

namespace torchpar {

class Process;
namespace detail {
class ManagerClient;
}  // namespace detail

/// Options of a Manager.
struct ManagerOptions {
  /// Where the server listens (Listener address forms): "" is 127.0.0.1 on a free port;
  /// "0.0.0.0:5000" serves other hosts; a path or "@name" a Unix socket.
  std::string address;
  /// The key every client must prove. nullopt: the job's key, default_authkey() (as
  /// Python's Manager uses current_process().authkey).
  std::optional<AuthKey> authkey = std::nullopt;
  /// Start method of the server process (default: get_start_method()).
  std::optional<StartMethod> start_method = std::nullopt;
  /// How long the server may take to start and report its address.
  Timeout start_timeout = std::chrono::seconds(60);
  /// How long connecting and each request or proxy call may take; a method that blocks by
  /// design (Queue::get, Lock::acquire, ProxyCallOptions::wait) gets its own wait on top.
  /// Default 60 s (Python's Manager has no limit: nullopt restores that). Past it the call
  /// raises TimeoutError and only that call failed: this process's connection and
  /// references stay (a request's late reply is skipped), even when the server is stopped
  /// or busy with a flood of unauthenticated connections. A new connection is tried again
  /// within it while the server is there (the server closes the oldest stalled handshake
  /// when 64 are pending, and answers a client with the key in milliseconds).
  /// Proxies made by this Manager, and their copies in other processes, keep it.
  Timeout timeout = std::chrono::seconds(60);
  /// false (default): tensor values travel as copies of their bytes, through the server.
  /// true: they travel as shared-memory handles (no copy of the data): a tensor a proxy
  /// sends is moved to shared memory in place first (as torch.multiprocessing's queues
  /// do), and every process that reads the value aliases the sender's memory, so a later
  /// write by either is seen by both. No fds cross the manager's connection: the handle
  /// is a segment name (file_system strategy) or the sender's pid and fd number, which
  /// readers open through /proc (file_descriptor strategy, the default). Proxies made by
  /// this Manager, and their copies in other processes, keep the setting.
  ///
  /// One host only: readers must run on the sender's host as the same user. Elsewhere a
  /// handle names nothing (SerializationError at the read) or, for a file_system name
  /// reused on that host, unrelated memory: do not set it for proxies used on other
  /// hosts. The built-in objects keep the bytes and never open the memory.
  /// Lifetime: a value can be read any number of times while its sender lives, and a
  /// tensor already read stays valid after the sender exits. After the sender's exit only
  /// a process that still maps the segment (it holds a tensor read before) can read the
  /// value again; elsewhere the read raises SerializationError naming the sender's exit,
  /// with either sharing strategy. Each shared value pins its block
  /// (DumpsContext::pin_shared): the sender never reuses that memory, which goes back to
  /// the system once the sender has exited and no reader maps it; its file_system name
  /// goes at the sender's exit. So share large, long-lived tensors (weights, buffers), not
  /// a stream of fresh ones.
  /// Source: issue 16; Python's Manager with torch.multiprocessing's reductions shares
  /// tensors through the server instead.
  bool share_tensors = false;
};

/// A manager server process and this process's connection to it.
///
/// Example:
///   torchpar::Manager manager;                        // starts the server
///   auto d = manager.dict<std::string, int64_t>();
///   torchpar::Process p(worker, d);                   // the child uses the same dict
///   p.start(); p.join(30s);
///   std::optional<int64_t> v = d.get("done");
///
/// Lifetime: a Manager made by the constructor owns the server: shutdown() or the
///           destructor stops it (then SIGKILL if it does not exit within 10 s), and the
///           server also dies with this process (PR_SET_PDEATHSIG), so it never outlives
///           its owner. A Manager from connect() owns nothing. Proxies outlive the
///           Manager object; after shutdown their calls raise ClosedError.
/// Safety:   thread-safe (each call in flight has a connection of its own; see BaseProxy).
/// Source:   multiprocessing.managers.BaseManager / SyncManager.
class Manager {
 public:
  /// Starts the server process and returns once it listens.
  /// Errors: Error when the server cannot start or bind (the server's own message:
  ///         "EADDRINUSE ..."), TimeoutError when it did not report within start_timeout
  ///         (it is killed); what Process::start and Client raise.
  explicit Manager(ManagerOptions options = {});
  /// Connects to a running manager at `address` (options.address is ignored).
  /// Errors: as Client (AuthenticationError for a wrong key, SystemError when nothing
  ///         listens there, TimeoutError).
  /// Source: BaseManager.connect.
  static Manager connect(const std::string& address, ManagerOptions options = {});
  /// Connects to a running manager at `address` proving `authkey` (bytes, or a string's
  /// bytes: "secret" and AuthKey{...} both work); options.authkey and options.address are
  /// ignored. The form of Python's BaseManager(address, authkey).connect().
  /// Errors: as the form above (AuthenticationError when the server holds another key).
  static Manager connect(const std::string& address, const AuthKey& authkey,
                         ManagerOptions options = {});

  Manager(Manager&&) noexcept;
  Manager& operator=(Manager&&) noexcept;
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;
  /// Shuts an owned server down (errors swallowed); never throws.
  ~Manager();

  /// A new empty dict in the server. Source: SyncManager.dict.
  template <class K, class V>
  DictProxy<K, V> dict() {
    return DictProxy<K, V>(create("dict"));
  }

  /// A new list in the server holding copies of `initial` (tensors copied).
  /// Errors: as every call (ClosedError, TimeoutError; see BaseProxy).
  /// Safety: thread-safe. Source: SyncManager.list.
  template <class T>
  ListProxy<T> list(const std::vector<T>& initial = {}) {
    return ListProxy<T>(create("list", detail::encode_for_manager(std::make_tuple(
                                           detail::encode_each_for_manager(initial)))));
  }
  /// A new empty Namespace in the server. Errors, safety: as list. Source:
  /// SyncManager.Namespace.
  NamespaceProxy Namespace() { return NamespaceProxy(create("Namespace")); }
  /// A new Value in the server holding a copy of `initial` (Python's Value(typecode, value):
  /// T plays the typecode). Errors, safety: as list. Source: SyncManager.Value.
  template <class T>
  ValueProxy<T> Value(const T& initial) {
    return ValueProxy<T>(create(
        "Value", detail::encode_for_manager(std::make_tuple(detail::encode_for_manager(initial)))));
  }
  /// A new Array in the server holding copies of `initial`; its length stays
  /// initial.size() (Python's Array(typecode, sequence): T plays the typecode). Errors,
  /// safety: as list. Source: SyncManager.Array.
  template <class T>
  ArrayProxy<T> Array(const std::vector<T>& initial) {
    return ArrayProxy<T>(create("Array", detail::encode_for_manager(std::make_tuple(
                                             detail::encode_each_for_manager(initial)))));
  }
  /// A new queue of items of type T, holding at most `maxsize` items (<= 0: no limit).
  /// Source: SyncManager.Queue.
  template <class T>
  QueueProxy<T> Queue(int64_t maxsize = 0) {
    return QueueProxy<T>(create("Queue", encode_args(maxsize)));
  }
  /// A new unlocked threading.Lock. Source: SyncManager.Lock.
  LockProxy Lock() { return LockProxy(create("Lock")); }
  /// A new unlocked threading.RLock. Source: SyncManager.RLock.
  RLockProxy RLock() { return RLockProxy(create("RLock")); }
  /// A new threading.Event, not set. Source: SyncManager.Event.
  EventProxy Event() { return EventProxy(create("Event")); }
  /// A new threading.Semaphore with `value` units. Errors: RemoteError "ValueError" for
  /// value < 0. Source: SyncManager.Semaphore.
  SemaphoreProxy Semaphore(int64_t value = 1) {
    return SemaphoreProxy(create("Semaphore", encode_args(value)));
  }
  /// A new threading.BoundedSemaphore with `value` units, never more. Errors: RemoteError
  /// "ValueError" for value < 0. Source: SyncManager.BoundedSemaphore.
  SemaphoreProxy BoundedSemaphore(int64_t value = 1) {
    return SemaphoreProxy(create("BoundedSemaphore", encode_args(value)));
  }
  /// A new threading.Condition over a lock of its own (RLock semantics). Source:
  /// SyncManager.Condition (without its `lock` argument).
  ConditionProxy Condition() { return ConditionProxy(create("Condition")); }
  /// A new threading.Barrier of `parties`; `timeout` is the default of its wait() (nullopt:
  /// no limit). Errors: RemoteError "ValueError" for parties < 1. Source:
  /// SyncManager.Barrier (without `action`).
  BarrierProxy Barrier(int64_t parties, Timeout timeout = std::nullopt) {
    return BarrierProxy(create("Barrier", encode_args(parties, detail::timeout_seconds(timeout))));
  }
  /// A new object of the registered type `type_id` (torchpar/manager/register.h), made in
  /// the server as T(args...) by the registration's init<A...>().
  ///
  /// Example:
  ///   static const auto kCounterType = torchpar::register_managed_type<Counter>("Counter")
  ///                                        .init<int64_t>()
  ///                                        .expose("increment", &Counter::increment);
  ///   torchpar::Manager manager;
  ///   torchpar::Proxy<Counter> c = manager.make<Counter>("Counter", int64_t{10});
  ///   c.call<int64_t>("increment", int64_t{1});       // 11
  ///
  /// Types:  `args` travel as std::tuple<managed_wire_t<A>...> (a string literal as
  ///         std::string); they must be exactly init's decayed argument types.
  /// Errors: ValueError, before anything is sent, when `type_id` is registered in this
  ///         process for another C++ type or with other init arguments;
  ///         RemoteError("ValueError", "the manager has no typeid ...") when the server
  ///         does not know it (registered too late, see register.h); RemoteError for what
  ///         T's constructor threw, or "TypeError" when T has no registered constructor;
  ///         ClosedError, TimeoutError as every request.
  /// Safety: thread-safe. Source: BaseManager.register's generated factory method.
  template <class T, class... A>
  Proxy<T> make(const std::string& type_id, const A&... args) {
    using Args = std::tuple<detail::managed_wire_t<A>...>;
    detail::check_managed_init(type_id, typeid(T), typeid(Args));
    return Proxy<T>(create(
        type_id,
        dumps(Args(static_cast<detail::managed_wire_t<A>>(args)...), {.copy_tensor = true}).bytes));
  }
  /// The same, with the typeid of `type` (what register_managed_type returned).
  template <class T, class... A>
  Proxy<T> make(const ManagedType<T>& type, const A&... args) {
    return make<T>(type.type_id(), args...);
  }

  /// The server's address ("127.0.0.1:43125", a path, "@name").
  /// A new object of Python's kind for C++ and Python clients to share: `type_id` is one of
  /// SyncManager's ("dict", "list", "Namespace", "Value", "Array", "Queue", "JoinableQueue",
  /// "Lock", "RLock", "Semaphore", "BoundedSemaphore", "Condition", "Event", "Barrier"),
  /// made from `args` as SyncManager.<type_id>(*args) makes it (python_object("list",
  /// {Value::list({1, 2})}), python_object("Queue", {int64_t{8}})). A Python client reaches
  /// it through its ident() (torchpar/manager/python.h). Only a `torchpar manager` or
  /// serve_manager server has Python's kinds; a Manager's own server has them too.
  /// Errors: RemoteError "ValueError" for an unknown type_id, "TypeError" for bad args.
  PythonProxy python_object(const std::string& type_id, std::vector<pickle::Value> args = {});
  /// python_object("dict") as a PythonDictProxy. Source: SyncManager.dict.
  PythonDictProxy python_dict() { return PythonDictProxy(create_python("dict", {})); }
  /// This process's proxy for the object of Python's kind a Python client made: its
  /// typeid and its token's id (`proxy._token.id`, hex), as a Python client rebuilds a proxy
  /// from a Token. Takes a reference (the object lives while this proxy does).
  /// Errors: RemoteError "KeyError" when the server holds no object `ident`; ValueError
  /// when `ident` is not hex.
  PythonProxy python_proxy(const std::string& type_id, const std::string& ident);
  /// python_proxy("dict", ident) as a PythonDictProxy.
  PythonDictProxy python_dict(const std::string& ident) {
    return PythonDictProxy(attach("dict", ident));
  }

  const std::string& address() const;
  /// The server's pid (owner), -1 for a Manager from connect().
  int pid() const;
  /// Objects the server holds (Python's _number_of_objects, for tests and debugging).
  size_t number_of_objects();
  /// Stops the server: it answers, closes its Listener and exits; every proxy call
  /// afterwards raises ClosedError. Idempotent.
  /// Errors: Error on a Manager from connect() (it does not own the server).
  void shutdown();

 private:
  Manager(std::shared_ptr<detail::ManagerClient> client, std::string address);
  /// A new object of `type_id` in the server, made from `args` (payload bytes of the
  /// constructor's arguments; "" for none). Returns this process's reference to it.
  std::shared_ptr<detail::ProxyRef> create(const std::string& type_id,
                                           const std::string& args = {});
  /// create() for an object of Python's kind ("python:" + type_id in the request).
  std::shared_ptr<detail::ProxyRef> create_python(const std::string& type_id,
                                                  std::vector<pickle::Value> args);
  /// A new reference of this process on the object `ident` (hex) of `type_id`.
  std::shared_ptr<detail::ProxyRef> attach(const std::string& type_id, const std::string& ident);
  /// The payload bytes of a constructor's arguments, as make_served_object decodes them.
  template <class... A>
  static std::string encode_args(const A&... args) {
    return dumps(std::make_tuple(args...), {.copy_tensor = true}).bytes;
  }

  std::shared_ptr<detail::ManagerClient> client_;
  std::unique_ptr<Process> server_;  // owner only
  std::string address_;
};

/// Runs a manager server in the calling thread, in the foreground (what `torchpar manager`
/// runs), for C++ clients (Manager::connect) and Python clients alike: CPython's own
/// multiprocessing.managers.SyncManager(address, authkey).connect() creates and calls dict,
/// list, Namespace, Value, Array, Queue, JoinableQueue, Lock, RLock, Semaphore,
/// BoundedSemaphore, Condition, Event and Barrier objects here, with Python's exceptions
/// (KeyError, queue.Empty, threading.BrokenBarrierError, ...). docs/manager.md, "Python
/// clients", lists what a foreign server supports.
///
/// `address`: "host:port" (port 0: any free one) or a filesystem path (AF_UNIX); `authkey`:
/// every client proves it (Python's handshake; `allow_legacy_md5` also accepts the HMAC-MD5
/// form of Python <= 3.11's clients). `ready(bound address)` runs once the server listens.
/// Returns when a client asks for shutdown (Python: the manager's shutdown call).
/// Errors:  Error when the address cannot be bound (naming it); what `ready` throws.
/// Safety:  one server per call; a thread per connection inside.
/// Source:  multiprocessing.managers.Server.serve_forever (BaseManager.get_server()).
void serve_manager(const std::string& address, const AuthKey& authkey,
                   const std::function<void(const std::string& bound_address)>& ready = {},
                   bool allow_legacy_md5 = true);

}  // namespace torchpar
