#pragma once
// The manager's server process: a Listener, one thread per client connection, and a table
// of served objects with reference counts. Private to the library; the public side is
// torchpar/manager/manager.h.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "manager/protocol.h"
#include "torchpar/core/auth.h"
#include "torchpar/ipc/connection.h"
#include "torchpar/ipc/listener.h"

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

/// One object held by the server. Calls on one object are serialized by the server (one
/// at a time), so implementations need no lock of their own.
class ServedObject {
 public:
  virtual ~ServedObject() = default;
  /// Runs `method` with `args` (payload bytes, as the proxy encoded them) and returns the
  /// result's payload bytes ("" for none). Throws ServedError for typed failures
  /// (AttributeError for a method that is not exposed); any other exception reaches the
  /// client as RemoteError with its demangled type.
  virtual std::string call(const std::string& method, const std::string& args) = 0;
};

/// Makes the object of a typeid from the create request's args.
std::unique_ptr<ServedObject> make_served_object(const std::string& type_id,
                                                 const std::string& args);

/// The built-in "dict": keys and values are the payload bytes the proxy sent (the server
/// never decodes them), kept in insertion order, as Python's dict.
std::unique_ptr<ServedObject> make_served_dict();

/// The server: serve_forever() accepts clients on `listener` until a shutdown request.
class ManagerServer : public std::enable_shared_from_this<ManagerServer> {
 public:
  explicit ManagerServer(Listener listener) : listener_(std::move(listener)) {}
  const std::string& address() const { return listener_.address(); }
  /// Accepts and serves clients (a thread each) until shutdown. Returns then; the caller's
  /// process exits (connection threads are detached and end with it).
  void serve_forever();
  /// References one connection holds: object id -> count. The server gives them back when
  /// the connection ends, so a client that exits or is killed without its decrefs (a fork
  /// child _exits, SIGKILL) leaks nothing.
  using Held = std::unordered_map<uint64_t, int64_t>;
  /// One request, as a connection thread handles it. Sets *shutdown for kShutdown; counts
  /// the references the connection takes and gives back in *held.
  manager::Response handle(const manager::Request& request, bool* shutdown, Held* held);

 private:
  struct Served {
    std::mutex mu;  // one call at a time on this object
    std::string type_id;
    std::unique_ptr<ServedObject> object;
  };
  struct Entry {
    std::shared_ptr<Served> served;
    int64_t refcount = 0;
  };

  void serve_connection(Connection connection);
  std::shared_ptr<Served> find(uint64_t id);
  /// Drops `count` references to `id` (the object goes at zero); false if it is gone.
  bool decref(uint64_t id, int64_t count);

  Listener listener_;
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

}  // namespace torchpar::detail
