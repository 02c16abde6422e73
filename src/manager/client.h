#pragma once
// The client side of the manager protocol: one connection per (manager, process), shared
// by every proxy of that process, and ProxyRef, one reference a process holds on a served
// object.

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "manager/protocol.h"
#include "manager/shm_channel.h"
#include "torchpar/core/auth.h"
#include "torchpar/core/timeout.h"
#include "torchpar/ipc/connection.h"

namespace torchpar::detail {

/// This process's connections to the manager at one address: one control connection that
/// holds the process's references (create, incref, decref, shutdown; one request at a
/// time) and a pool of call connections, one per call in flight, so that a call blocking in
/// the server (Queue::get, Lock::acquire) holds up no other thread (Python keeps one
/// connection per thread for the same reason). A new call connection first attaches a
/// ShmChannel (kAttachChannel): when the server opens it (same host and user), the
/// connection's requests and responses travel through shared memory, the socket only
/// telling each side that the other is alive (and carrying messages over
/// ShmChannel::kDataBytes). TORCHPAR_MANAGER_SHM=0 in the environment when the client is
/// made keeps every call on its socket.
/// Safety: thread-safe.
class ManagerClient {
 public:
  /// The connection of this process to `address`: a live one made earlier by this
  /// process (not one inherited through fork) with the same key and `share_tensors`, or a
  /// new one. `share_tensors`: its proxies send tensors as shared-memory handles
  /// (ManagerOptions::share_tensors).
  /// Errors: as Client.
  static std::shared_ptr<ManagerClient> get(const std::string& address,
                                            const std::optional<AuthKey>& authkey, Timeout timeout,
                                            bool share_tensors = false);

  /// One round trip on the control connection. Returns the result's payload bytes.
  /// Errors: RemoteError for a failure the server reports; ClosedError naming the address
  ///         when the server is gone (and at every later call); TimeoutError past the
  ///         timeout: the request may still run; the connection stays open and the next
  ///         request first skips the late reply (waiting up to the timeout for it, then
  ///         TimeoutError again), so this process keeps its references. Only a reply that
  ///         arrived in part closes the connection (final, as ClosedError).
  std::string request(const manager::Request& request);

  /// One kCall round trip on a call connection of its own (an idle one, or a new one).
  /// `wait` is how long the method may block in the server (nullopt: no limit); the reply
  /// is awaited for timeout() + wait. Sets request.caller to this thread's caller_id().
  /// Errors: as request(); a TimeoutError closes only that call's connection. A new
  ///         connection that cannot be made (refused, reset, shed by a server flooded
  ///         with strangers) is tried again until timeout() and is then a TimeoutError of
  ///         this call; ClosedError ("gone") only when the control connection shows the
  ///         server gone.
  std::string call(manager::Request request, Timeout wait = std::chrono::duration<double>(0));

  /// This thread's identity in calls (Request::caller): unique per process and thread, so
  /// the server can tell RLock owners apart (a fork child gets its own).
  static uint64_t caller_id();

  /// False when TORCHPAR_MANAGER_SHM=0 was set when this client was made: no call
  /// connection attaches a ShmChannel.
  bool shm_channel() const { return shm_channel_; }

  /// Marks the connection unusable: later requests raise ClosedError with `why`.
  void break_with(std::string why);

  const std::string& address() const { return address_; }
  const std::optional<AuthKey>& authkey() const { return authkey_; }
  Timeout timeout() const { return timeout_; }
  bool share_tensors() const { return share_tensors_; }
  pid_t pid() const { return pid_; }
  bool broken() const;
  /// True while the server owes replies to control requests that timed out.
  bool stalled() const;
  /// Why calls fail ("" while usable).
  std::string broken_text() const;

  ManagerClient(Connection connection, std::string address, std::optional<AuthKey> authkey,
                Timeout timeout, bool share_tensors = false);

 private:
  mutable std::mutex mu_;
  Connection connection_;
  std::string address_;
  std::optional<AuthKey> authkey_;
  Timeout timeout_;
  bool share_tensors_;
  pid_t pid_;
  std::string broken_;       // why requests fail at once; empty while usable
  size_t late_replies_ = 0;  // replies on connection_ of requests that timed out

  /// True when the server is gone: this client is broken, or its control connection hung
  /// up. Waits for a control request in flight (mu_).
  bool server_gone();
  /// A new authenticated call connection for a call of `method`, tried until timeout()
  /// while the server is there. Errors: TimeoutError (nothing broken); ClosedError after
  /// break_with when the server is gone.
  Connection connect_call(const std::string& method);

  bool shm_channel_;

  /// A call connection: its socket and, once the server opened it, its channel.
  struct CallConnection {
    Connection connection;
    std::unique_ptr<ShmChannel> channel;  // null: requests go on the socket
  };
  /// Makes a channel and asks the server over `c`'s socket to attach it (the first
  /// request of a new connection). No channel when it cannot be made or the server cannot
  /// open it. Errors: as a round trip on the socket.
  void attach_channel(CallConnection& c);

  std::mutex pool_mu_;
  std::vector<CallConnection> idle_;  // call connections between calls
};

/// One reference on a served object, held by one process. Its destructor sends decref (in
/// the process that took it only; a fork child's inherited copy does nothing).
struct ProxyRef {
  ProxyRef(std::shared_ptr<ManagerClient> client, std::string type_id, uint64_t id);
  ~ProxyRef();
  ProxyRef(const ProxyRef&) = delete;
  ProxyRef& operator=(const ProxyRef&) = delete;

  /// A new reference of this process on the object `id` (incref first).
  static std::shared_ptr<ProxyRef> adopt(std::shared_ptr<ManagerClient> client, std::string type_id,
                                         uint64_t id);

  std::shared_ptr<ManagerClient> client;
  std::string type_id;
  uint64_t id;
  pid_t pid;
};

}  // namespace torchpar::detail
