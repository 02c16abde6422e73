#pragma once
// The manager's server process: one accepting thread, one thread per connection (it runs
// the handshake, then serves the client), and a table of served objects with reference
// counts. Private to the library; the public side is
// torchpar/manager/manager.h.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "manager/protocol.h"
#include "torchpar/core/auth.h"
#include "torchpar/core/timeout.h"
#include "torchpar/ipc/connection.h"
#include "torchpar/ipc/listener.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar::detail {

/// An error a served object raises with a Python-style type name ("KeyError",
/// "AttributeError"); the client sees RemoteError(type, message).
class ServedError : public std::runtime_error {
 public:
  ServedError(std::string type, const std::string& message)
      : std::runtime_error(message), type_(std::move(type)) {}
  const std::string& type() const noexcept { return type_; }

 private:
  std::string type_;
};

/// What a served object knows about the call it is running.
struct CallContext {
  /// The calling client thread (Request::caller): the owner of RLocks and Conditions.
  uint64_t caller = 0;
  /// The connection the call came on (-1 in unit tests: never gone).
  int fd = -1;

  /// True once the client closed its end or died: it sends nothing while its call is
  /// pending, so anything readable on the socket (EOF, a reset) means it is gone.
  bool peer_gone() const;

  /// Waits on `cv` (with `lock` held, as std::condition_variable) until `pred()` holds or
  /// `timeout` passes (nullopt: no limit). Looks at the client every 50 ms: when it is
  /// gone, throws ServedError("ConnectionAbortedError") so that a blocking call of a dead
  /// client takes nothing (no item, no lock) that nobody would receive.
  /// Returns pred() at the end, as wait_for with a predicate.
  template <class Pred>
  bool wait(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, Timeout timeout,
            Pred pred) const {
    using Clock = std::chrono::steady_clock;
    const auto slice = std::chrono::milliseconds(50);
    const std::optional<Clock::time_point> deadline =
        timeout ? std::optional(Clock::now() + std::chrono::duration_cast<Clock::duration>(std::max(
                                                   *timeout, std::chrono::duration<double>(0))))
                : std::nullopt;
    while (!pred()) {
      if (peer_gone()) {
        throw ServedError("ConnectionAbortedError", "the client left while its call was waiting");
      }
      const auto now = Clock::now();
      if (deadline && now >= *deadline) return pred();
      const auto until = deadline ? std::min(*deadline, now + slice) : now + slice;
      cv.wait_until(lock, until);
    }
    return true;
  }
};

/// A served object's arguments or result from the payload bytes the proxy sent (no
/// out-of-band tensors: they travel in the bytes).
template <class T>
T served_decode(const std::string& args) {
  return loads<T>(Payload{args, {}});
}

/// The payload bytes of a served object's result (tensors copied into the bytes).
template <class T>
std::string served_encode(const T& value) {
  return dumps(value, {.copy_tensor = true}).bytes;
}

/// One object held by the server.
class ServedObject {
 public:
  virtual ~ServedObject() = default;
  /// Runs `method` with `args` (payload bytes, as the proxy encoded them) and returns the
  /// result's payload bytes ("" for none). Throws ServedError for typed failures
  /// (AttributeError for a method that is not exposed); any other exception reaches the
  /// client as RemoteError with its demangled type.
  virtual std::string call(const std::string& method, const std::string& args,
                           const CallContext& context) = 0;
  /// True (the default): the server runs one call at a time on this object, so it needs no
  /// lock of its own and must not block. False: calls run concurrently (one per client
  /// connection) and the object locks itself; its blocking methods (Queue::get,
  /// Lock::acquire) wait with CallContext::wait.
  virtual bool serialized() const { return true; }
};

/// Makes the object of a typeid from the create request's args (payload bytes of the
/// constructor's arguments, as the Manager's factory method encoded them).
/// The builtin typeids first, then the registered ones (make_served_registered).
/// Errors: ServedError("ValueError") for an unknown typeid; what the factory throws.
std::unique_ptr<ServedObject> make_served_object(const std::string& type_id,
                                                 const std::string& args);

/// The built-in "dict": keys and values are the payload bytes the proxy sent (the server
/// never decodes them), kept in insertion order, as Python's dict.
std::unique_ptr<ServedObject> make_served_dict(const std::string& args);

/// The built-in "list" (args: a tuple of the initial items' bytes, or "" for none),
/// "Namespace" (no args), "Value" (args: a tuple of the value's bytes) and "Array" (as
/// "list"; its length stays the initial one), each keeping the payload bytes the proxy sent
/// (served_containers.cpp).
std::unique_ptr<ServedObject> make_served_list(const std::string& args);
std::unique_ptr<ServedObject> make_served_namespace(const std::string& args);
std::unique_ptr<ServedObject> make_served_value(const std::string& args);
std::unique_ptr<ServedObject> make_served_array(const std::string& args);
/// The blocking types (served_sync.cpp; concurrent calls, waits that abort when the caller
/// is gone): "Queue" (args: int64 maxsize, <= 0 unbounded; items are payload bytes),
/// "Lock", "RLock", "Event", "Condition" (no args), "Semaphore" and "BoundedSemaphore"
/// (args: int64 value), "Barrier" (args: int64 parties, optional f64 default timeout in s).
std::unique_ptr<ServedObject> make_served_queue(const std::string& args);
std::unique_ptr<ServedObject> make_served_lock(const std::string& args);
std::unique_ptr<ServedObject> make_served_rlock(const std::string& args);
std::unique_ptr<ServedObject> make_served_event(const std::string& args);
std::unique_ptr<ServedObject> make_served_semaphore(const std::string& args);
std::unique_ptr<ServedObject> make_served_bounded_semaphore(const std::string& args);
std::unique_ptr<ServedObject> make_served_condition(const std::string& args);
std::unique_ptr<ServedObject> make_served_barrier(const std::string& args);
/// An object of a type registered with register_managed_type (torchpar/manager/register.h)
/// in this process; nullptr when `type_id` is not registered. Errors: ServedError
/// ("TypeError") when the type has no constructor registered; what its constructor throws.
std::unique_ptr<ServedObject> make_served_registered(const std::string& type_id,
                                                     const std::string& args);

/// An object of Python's kind for a C++ client (Manager::python_object: the request's
/// typeid is "python:" + `type_id`, its args a pickled tuple), as a Python client's create
/// makes it (py_values.cpp). Errors: ServedError with the Python exception's name
/// ("ValueError" for an unknown typeid, "TypeError", "PickleError").
std::unique_ptr<ServedObject> make_python_object(const std::string& type_id,
                                                 const std::string& pickled_args);

/// The server: serve_forever() accepts clients on `listener` until a shutdown request.
///
/// Handshakes: the Listener has no key; the server runs the key's handshake (`authkey`,
/// nullopt: none) itself, on the new connection's own thread, with kHandshakeTimeout for each
/// peer, so a stranger that connects and stays silent (or sends garbage slowly) holds up no
/// other peer. At most kMaxPendingHandshakes connections are in the handshake at once: one
/// more closes the oldest of them (a client that proves the key takes a few milliseconds, a
/// stalled stranger seconds, so the oldest is a stranger), so strangers cost the server a
/// bounded number of fds and threads and never fill the kernel's accept queue.
class ManagerServer : public std::enable_shared_from_this<ManagerServer> {
 public:
  /// How long one peer may take to complete the handshake.
  static constexpr auto kHandshakeTimeout = std::chrono::seconds(5);
  /// Connections in the handshake at once; a new one closes the oldest.
  static constexpr size_t kMaxPendingHandshakes = 64;

  /// `allow_legacy_md5`: also accept the HMAC-MD5 handshake of Python <= 3.11's clients
  /// (`torchpar manager`); the servers of C++ Managers speak {sha256} only.
  explicit ManagerServer(Listener listener, std::optional<AuthKey> authkey = std::nullopt,
                         bool allow_legacy_md5 = false)
      : listener_(std::move(listener)),
        authkey_(std::move(authkey)),
        allow_legacy_md5_(allow_legacy_md5) {}
  const std::string& address() const { return listener_.address(); }
  /// Accepts and serves clients (a thread each) until shutdown. Returns then; the caller's
  /// process exits (connection threads are detached and end with it). `ready` runs before
  /// the first accept.
  void serve_forever(const std::function<void()>& ready = {});
  /// The accepting loop: takes each connection off the Listener at once and starts its
  /// thread (serve_forever runs it).
  void accept_loop();
  /// Connections in the handshake now (tests and debugging).
  size_t pending_handshakes() const;
  /// References one connection holds: object id -> count. The server gives them back when
  /// the connection ends, so a client that exits or is killed without its decrefs (a fork
  /// child _exits, SIGKILL) leaks nothing.
  using Held = std::unordered_map<uint64_t, int64_t>;
  /// One request, as a connection thread handles it. Sets *shutdown for kShutdown; counts
  /// the references the connection takes and gives back in *held. `fd` is the
  /// connection's socket (CallContext::peer_gone; -1 in unit tests).
  manager::Response handle(const manager::Request& request, bool* shutdown, Held* held,
                           int fd = -1);

  struct Served {
    std::mutex mu;  // one call at a time on this object
    std::string type_id;
    std::unique_ptr<ServedObject> object;
  };

  // ---- Python clients (py_protocol.cpp): Python's refcounts are global, not per
  // connection (each incref / decref comes on a connection of its own).
  /// Adds `object` with refcount `refcount`; returns its id.
  uint64_t add_object(std::string type_id, std::unique_ptr<ServedObject> object, int64_t refcount);
  /// The object `id`. Errors: ServedError("KeyError") when the server holds none.
  std::shared_ptr<Served> find(uint64_t id);
  /// One more reference to `id`; false when it is gone.
  bool incref(uint64_t id);
  /// Drops `count` references to `id` (the object goes at zero); false if it is gone.
  bool decref(uint64_t id, int64_t count);
  /// Live objects.
  size_t number_of_objects();
  /// A client asked for shutdown: serve_forever returns.
  void stop();

 private:
  struct Entry {
    std::shared_ptr<Served> served;
    int64_t refcount = 0;
  };

  void serve_connection(Connection connection);
  /// Registers `connection` as in the handshake (closing the oldest pending one when
  /// kMaxPendingHandshakes are) and starts its thread; false when no thread could start
  /// (the connection is closed).
  bool admit(Connection connection);
  /// A connection's thread: the handshake, then serve_connection.
  void handshake_then_serve(Connection connection, uint64_t ticket);

  Listener listener_;
  std::optional<AuthKey> authkey_;
  bool allow_legacy_md5_ = false;
  // Connections in the handshake: ticket (in accept order: the smallest is the oldest) ->
  // fd. A thread leaves the map before it closes its fd, so an fd in the map is open and
  // the accepting thread may shut it down (under pending_mu_).
  mutable std::mutex pending_mu_;
  std::condition_variable pending_cv_;  // a handshake thread left the map
  std::map<uint64_t, int> pending_;
  size_t handshaking_ = 0;  // threads still in the handshake (evicted ones included)
  uint64_t next_ticket_ = 0;
  std::chrono::steady_clock::time_point last_eviction_log_{};
  std::mutex mu_;  // objects_, next_id_
  std::unordered_map<uint64_t, Entry> objects_;
  uint64_t next_id_ = 1;
  std::atomic<bool> stopping_{false};
};

/// What the server process runs: binds `address` with `authkey` (the handshake of every
/// client), reports {true, bound address} or {false, error} on `ready`, then serves until
/// shutdown. SIGINT is ignored (a Ctrl-C in the terminal reaches the whole process group;
/// the owner shuts the server down), and the process dies with its owner (PDEATHSIG, as
/// every torchpar Process child).
void manager_server_main(Connection ready, std::string address, AuthKey authkey);

/// Serves a Python client (multiprocessing.managers' protocol: pickled `(ident, method,
/// args, kwds)` requests, `('#RETURN' | '#ERROR' | '#TRACEBACK' | '#PROXY', value)` answers)
/// on `connection`, whose first frame `first` was a pickle, until the client leaves or asks
/// for shutdown (*shutdown set). py_protocol.cpp.
void serve_python_connection(ManagerServer& server, Connection& connection, std::string first,
                             bool* shutdown);

}  // namespace torchpar::detail
