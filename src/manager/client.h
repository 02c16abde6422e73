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

#include "manager/protocol.h"
#include "torchpar/core/auth.h"
#include "torchpar/core/timeout.h"
#include "torchpar/ipc/connection.h"

namespace torchpar::detail {

/// This process's connection to the manager at one address.
/// Safety: thread-safe; one request at a time (a mutex around each round trip).
class ManagerClient {
 public:
  /// The connection of this process to `address`: a live one made earlier by this
  /// process (not one inherited through fork), or a new one.
  /// Errors: as Client.
  static std::shared_ptr<ManagerClient> get(const std::string& address,
                                            const std::optional<AuthKey>& authkey, Timeout timeout);

  /// One round trip. Returns the result's payload bytes.
  /// Errors: RemoteError for a failure the server reports; ClosedError naming the address
  ///         when the server is gone (and at every later call); TimeoutError past the
  ///         timeout (the connection is unusable afterwards, as a reply may still come).
  std::string request(const manager::Request& request);

  /// Marks the connection unusable: later requests raise ClosedError with `why`.
  void break_with(std::string why);

  const std::string& address() const { return address_; }
  const std::optional<AuthKey>& authkey() const { return authkey_; }
  Timeout timeout() const { return timeout_; }
  pid_t pid() const { return pid_; }
  bool broken() const;

  ManagerClient(Connection connection, std::string address, std::optional<AuthKey> authkey,
                Timeout timeout);

 private:
  mutable std::mutex mu_;
  Connection connection_;
  std::string address_;
  std::optional<AuthKey> authkey_;
  Timeout timeout_;
  pid_t pid_;
  std::string broken_;  // why requests fail at once; empty while usable
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
