#pragma once
// What "the same host" means, once for the whole library: the rendezvous groups ranks by it
// (the shm and hierarchical backends), the RPC agent decides by it whether a tensor in shared
// memory travels as a handle or a copy, and the RPC transport whether a peer is reached over
// TensorPipe's shared memory or TCP. One definition, so those decisions always agree.

#include <cstdint>
#include <string>
#include <string_view>

namespace torchpar::detail {

/// This process's host as torchpar sees it. Two processes are on one host when every field
/// matches: then they share /dev/shm, see each other's pids, and reach each other's abstract
/// Unix sockets and shared memory. A network namespace is a host of its own (as TensorPipe's
/// shm domain), so namespaces joined by a veth pair stand in for hosts in the tests.
struct HostIdentity {
  std::string host_name;  ///< gethostname (the UTS namespace's)
  std::string boot_id;    ///< /proc/sys/kernel/random/boot_id; empty when unreadable
  uint64_t pid_ns = 0;    ///< inode of /proc/self/ns/pid (0 when unreadable)
  uint64_t net_ns = 0;    ///< inode of /proc/self/ns/net (0 when unreadable)
  uint64_t shm_dev = 0;   ///< device of /dev/shm (0 when unreadable)

  /// "<host name>/<boot id>/<pid ns>/<net ns>/<shm dev>", numbers in hex: the rendezvous's
  /// host key (MemberInfo::host). Equal keys, equal hosts.
  std::string key() const;
  /// The compact form carried in RPC transport addresses: "<boot id>_<64-bit FNV-1a of key()
  /// in hex>", 1 to kMaxHostToken bytes of [0-9a-f_-]; equal exactly when key() is (up to a
  /// hash collision). Empty when the boot id or the network namespace cannot be read: such a
  /// process never counts as sharing a host over the transport.
  std::string token() const;
};

/// Longest token() accepted from a peer.
inline constexpr size_t kMaxHostToken = 128;

/// Reads this process's identity (the files on every call). Never throws. Thread-safe.
HostIdentity this_host();

/// this_host().key().
std::string host_key();

/// Whether `token` may be a HostIdentity::token(): 1 to kMaxHostToken bytes of [0-9a-f_-].
bool is_host_token(std::string_view token);

}  // namespace torchpar::detail
