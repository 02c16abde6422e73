#pragma once
// Socket addresses: parsing the text forms, binding, connecting, and naming a peer in
// messages. Used by ipc's Listener and Client, the Manager's server and the RPC transports;
// private to the library.

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "core/futex.h"
#include "torchpar/core/fd.h"

namespace torchpar::detail {

/// One parsed address. Text forms (docs/ipc.md, "Listener and Client"):
///   "host:port", ":port", ""   TCP; host defaults to 127.0.0.1, port 0 picks a free one;
///   "[v6]:port"                TCP over IPv6 (a literal in brackets);
///   a string containing '/'    a Unix socket at that path ("./name" for the cwd);
///   "@name" or "\0name"        a Linux abstract Unix socket (Python spells it "\0name").
struct SocketAddress {
  enum class Kind { kTcp, kUnixPath, kUnixAbstract };
  Kind kind = Kind::kTcp;
  std::string host;   // kTcp: as given, without brackets
  uint16_t port = 0;  // kTcp
  std::string path;   // kUnixPath: the path; kUnixAbstract: the name without '@' or NUL
  bool ipv6 = false;  // kTcp: the host was a bracketed literal

  /// The canonical text: "host:port", "[v6]:port", the path, or "@name".
  std::string text() const;
};

/// Parses `text`. Errors: ValueError naming the text and the accepted forms (no port, a
/// port over 65535, an IPv6 literal without brackets, a Unix name too long for sun_path).
SocketAddress parse_socket_address(std::string_view text);

/// A listening socket (non-blocking, close-on-exec) bound to `address`.
/// TCP: SO_REUSEADDR; hostnames resolve to IPv4 (as Python's AF_INET Listener).
/// Unix path: the socket file gets mode 0600 before listen(), so nobody can connect while
/// it is wider; *inode and *device identify it for a later unlink.
/// Returns the fd; `*bound` is the canonical address with the port actually bound.
/// Errors: SystemError naming the address (EADDRINUSE, EACCES, ...); Error when a host does
///         not resolve.
UniqueFd listen_on(const SocketAddress& address, int backlog, std::string* bound, dev_t* device,
                   ino_t* inode);

/// A connected stream socket (close-on-exec, blocking) to `address`, trying until
/// `deadline` for the TCP connect and while a Unix listener's backlog is full (EAGAIN).
/// TCP sockets get TCP_NODELAY.
/// Errors: SystemError naming the address for a refused connection, a missing path, an
///         unreachable host; TimeoutError past the deadline; Error when a host does not
///         resolve.
UniqueFd connect_to(const SocketAddress& address, const Deadline& deadline);

/// The peer of a connected socket for messages: "127.0.0.1:43122", "[::1]:5000", or for a
/// Unix socket "pid 4242 (uid 1000)". Never throws ("unknown peer").
std::string describe_peer(int fd) noexcept;

}  // namespace torchpar::detail
