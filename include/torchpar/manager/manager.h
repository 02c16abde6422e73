#pragma once
/// Manager: a server process that holds objects (dicts so far) for other processes, which
/// reach them through proxies, on this host or, by TCP, from others (Python's
/// multiprocessing.Manager / managers.BaseManager).
///
/// The server is a torchpar Process (any start method) listening with a Listener
/// (torchpar/ipc/listener.h) on loopback unless told otherwise; every client proves the
/// manager's key with Python's handshake. Each request is one message on that connection
/// (src/manager/protocol.h, docs/wire_format.md): create an object of a typeid, call a
/// method of an object by id, incref, decref, shutdown. The server counts references per
/// object and frees an object when the last proxy anywhere is gone.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "torchpar/core/auth.h"
#include "torchpar/core/timeout.h"
#include "torchpar/manager/proxy.h"
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
  /// How long connecting and each proxy call may take (nullopt: no limit, as Python).
  /// Proxies made by this Manager, and their copies in other processes, keep it.
  Timeout timeout = std::nullopt;
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
/// Safety:   thread-safe (calls are serialized on one connection per process).
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

  /// The server's address ("127.0.0.1:43125", a path, "@name").
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
  std::shared_ptr<detail::ProxyRef> create(const std::string& type_id);

  std::shared_ptr<detail::ManagerClient> client_;
  std::unique_ptr<Process> server_;  // owner only
  std::string address_;
};

}  // namespace torchpar
