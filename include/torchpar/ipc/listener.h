#pragma once
/// Listener and Client: connections by address between any two processes, on one host or
/// across hosts, optionally authenticated with a shared key; wire compatible with Python's
/// multiprocessing.connection.Listener / Client.
///
/// Addresses are strings:
///   "host:port"     TCP. Hostnames resolve to IPv4, as Python's ('host', port) does.
///   ":port", ""     TCP on 127.0.0.1 (loopback unless a host is given; "" is ":0").
///   "[v6]:port"     TCP over IPv6 (a literal in brackets).
///   port 0          the kernel picks a free port; Listener::address() reports it.
///   "/path", "./p"  a Unix socket file (any string containing '/'). The Listener creates it
///                   with mode 0600 (before listening, so nobody connects while it is wider)
///                   and close() unlinks it. An existing file is an error (not replaced).
///   "@name"         a Linux abstract Unix socket: no file, no mode, gone with its last fd;
///                   any process in the same network namespace can connect, so use a key.
///                   Python spells it "\0name"; that spelling is accepted too, and
///                   address() always reports the "@name" form (printable, survives argv).
///
/// The Connection that accept() and Client() return uses Python's framing
/// (Connection::Framing::kPython, torchpar/ipc/connection.h): send_bytes / recv_bytes
/// interoperate with Python's Connection, and send<T> / recv<T> carry torchpar payloads
/// inside those frames, with tensors copied (no fds cross a TCP connection). One Connection
/// class serves Pipe and Listener/Client, as in Python, so code taking a Connection works
/// with both.
///
/// Authentication (`authkey`): Python's mutual HMAC handshake from torchpar/core/auth.h,
/// server challenge first; nullopt skips it, as Python's authkey=None does. The legacy
/// HMAC-MD5 form that Python <= 3.11 speaks (Debian 12's python3) is refused unless
/// `allow_legacy_md5` is set on our side (auth.h).

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "torchpar/core/auth.h"
#include "torchpar/core/timeout.h"
#include "torchpar/ipc/connection.h"

namespace torchpar {

/// Options of a Listener.
struct ListenerOptions {
  /// The key every peer must prove (and that we prove to it). nullopt: no handshake, so
  /// anyone who can reach the address is accepted (Python's authkey=None). A Manager uses
  /// the job's key (default_authkey()).
  std::optional<AuthKey> authkey = std::nullopt;
  /// Connections the kernel queues before accept() takes them (listen(2)'s backlog).
  int backlog = 128;
  /// How long an accepted peer has to complete the handshake (bounded by accept()'s own
  /// timeout too), so a peer that connects and never speaks cannot block accept() forever.
  std::chrono::duration<double> handshake_timeout = std::chrono::seconds(20);
  /// Accept peers answering with the legacy bare HMAC-MD5 of Python <= 3.11, and answer
  /// their 20-byte challenges. Off: such a peer is refused with AuthenticationError
  /// ("legacy HMAC-MD5 ... set allow_legacy_md5").
  bool allow_legacy_md5 = false;
};

/// A listening socket: accept() returns one Connection per peer.
///
/// Example:
///   torchpar::Listener l(":0", {.authkey = key});
///   std::cout << l.address();                       // "127.0.0.1:43125"
///   torchpar::Connection c = l.accept(10s);
///   std::string hello = c.recv_bytes(10s, 1 << 20);
///
/// Lifetime: copies share one socket; close() (or the last copy's destructor) closes it for
///           every copy and unlinks a Unix socket file this Listener created (only if the
///           path still names that socket). Connections already accepted stay open.
/// Safety:   thread-safe: several threads may accept() at once, and close() from another
///           thread wakes a waiting accept() (it raises ClosedError).
/// Source:   multiprocessing.connection.Listener.
class Listener {
 public:
  /// Binds and listens on `address` (forms above).
  /// Errors: ValueError for an address that is none of the forms; SystemError naming the
  ///         address when bind/listen fail (EADDRINUSE: the port is taken or the socket
  ///         file exists; EACCES); Error when the host does not resolve.
  explicit Listener(const std::string& address = "", ListenerOptions options = {});

  /// Waits for a peer, runs the handshake (when an authkey is set) and returns the
  /// connection (framing kPython, readable and writable).
  ///
  /// Units:  `timeout` covers both the wait for a peer and its handshake (nullopt: no limit
  ///         for the wait; the handshake is always bounded by options.handshake_timeout).
  /// Errors: TimeoutError when no peer came in time, or a peer did not complete the
  ///         handshake in time; AuthenticationError when a peer proved another key,
  ///         refused ours, broke the handshake protocol (garbage, a frame over 256 bytes)
  ///         or closed during it. In both cases that peer's connection was closed, a line
  ///         naming it went to stderr (AuthenticationError only), and the Listener is
  ///         unchanged: call accept() again. ClosedError once close() was called;
  ///         SystemError for accept(2) failures (EMFILE).
  /// Safety: thread-safe.
  /// Source: multiprocessing.connection.Listener.accept.
  Connection accept(Timeout timeout = std::nullopt);

  /// The bound address in canonical form: "127.0.0.1:43125" (the real port when 0 was
  /// asked), "[::1]:5000", the socket path, or "@name". Stays valid after close().
  const std::string& address() const;

  /// Stops listening: closes the socket and unlinks its Unix socket file. Idempotent;
  /// never throws.
  void close() noexcept;
  bool closed() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

/// Options of Client.
struct ClientOptions {
  /// The key to prove (and to demand of the listener). nullopt: no handshake (Python's
  /// authkey=None); the listener must then have none either.
  std::optional<AuthKey> authkey = std::nullopt;
  /// Covers connecting and the handshake (nullopt: no limit). Python's Client has none.
  Timeout timeout = std::chrono::seconds(30);
  /// Answer a Python <= 3.11 Listener's legacy 20-byte challenge with HMAC-MD5 (and accept
  /// its bare HMAC-MD5 answer to ours). Off: AuthenticationError ("legacy HMAC-MD5
  /// challenge from a Python <= 3.11 peer: set allow_legacy_md5").
  bool allow_legacy_md5 = false;
};

/// Connects to a Listener (ours or Python's) at `address` (forms above) and runs the
/// handshake when an authkey is set. A refused connection is not retried (as Python).
///
/// Returns: a Connection with framing kPython, readable and writable.
/// Errors:  ValueError for a malformed address; SystemError naming the address when the
///          connection is refused (nothing listens: ECONNREFUSED), the socket file is
///          missing (ENOENT) or the host unreachable; Error when the host does not
///          resolve; TimeoutError when connecting or the handshake outlast
///          options.timeout; AuthenticationError when the listener has another key, speaks
///          the legacy HMAC-MD5 form without allow_legacy_md5, or breaks the handshake (a line
///          naming the address goes to stderr). Nothing is left open after an error.
/// Safety:  thread-safe.
/// Source:  multiprocessing.connection.Client.
Connection Client(const std::string& address, ClientOptions options = {});

}  // namespace torchpar
