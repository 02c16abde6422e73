#pragma once
// The RPC layer's transport: authenticated, message-oriented connections between named
// members of a World. Implementations: transport/tcp/ (ours, POSIX sockets: what the network
// reaches) and transport/tensorpipe/ (TensorPipe: uv + shm for tests and benchmarks, or shm
// alone); create_transport composes TCP with TensorPipe's shm, and is what the RPC agent
// uses. RpcGroup code sees only this header, so no TensorPipe header appears outside that
// folder (upstream TensorPipe is frozen and PyTorch is removing it).

#include <c10/core/Storage.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "torchpar/core/auth.h"

namespace torchpar::rpc {

/// One message between two members.
///
/// `header` and `body` are bytes of the RPC layer (its framing, and a serialized value);
/// `storages` are CPU tensor storages that travel beside them, never through `body` (TCP:
/// written from and read into the storages' own memory; TensorPipe: tensors, copied once by
/// the channel). A received storage is a fresh CPU storage of the sent length, owned by the
/// receiver.
struct Message {
  std::string header;
  std::string body;
  std::vector<c10::Storage> storages;
  /// Set by a transport on a message it delivers inline (options.inline_handlers) when the
  /// handler may run long or blocking work on the delivering thread: the transport then gives
  /// the connection another reader when the handler runs longer than kReaderRescueAfter or
  /// calls release_reader_thread(), so the messages behind this one are still read (TCP).
  /// False where the delivering thread must never block (TensorPipe's loop thread, the
  /// dispatch thread). Ignored on sending.
  bool may_block = false;
};

/// How long an inline handler of a message with `may_block` holds its connection's reader
/// before the transport starts another reader for the connection (TCP).
inline constexpr std::chrono::milliseconds kReaderRescueAfter{10};

/// Called by a thread that is about to wait: when it is a transport's reader running an inline
/// handler of a message with `may_block`, its connection gets another reader now (so a reply
/// this thread waits for, from the same peer, is read meanwhile) and this thread stops reading
/// once the handler returns. Elsewhere a no-op. Never throws; thread-safe.
void release_reader_thread() noexcept;

/// Options of a transport.
struct TransportOptions {
  /// This member's name; peers see it as the sender of its messages.
  std::string name{};
  /// Host or IP the listener binds to and publishes ("127.0.0.1" unless given: loopback
  /// only, DESIGN's security defaults).
  std::string bind_host = "127.0.0.1";
  /// The job's key. Every connection, both directions, proves it with multiprocessing's
  /// mutual handshake before any message is read. Empty: ValueError at creation.
  AuthKey authkey{};
  /// Handshake options (legacy MD5 is never needed between torchpar members).
  AuthOptions auth{};
  /// Use TensorPipe's shm transport between members of one host and network namespace
  /// (create_transport: chosen by the peer's address; create_tensorpipe_transport: negotiated
  /// per connection), TCP otherwise. create_tcp_transport ignores it. Off by default: its
  /// listener is an abstract Unix socket that any local user can end the process through,
  /// its reactor polls without sleeping (about a third of a core per idle member), and it
  /// aborts the process when it runs out of file descriptors (docs/wire_format.md, "RPC
  /// transport"). Opt in only on a host without untrusted local users; the World does with
  /// TORCHPAR_RPC_SHM=1. Unusable above ~16 members: pytorch/tensorpipe#397.
  bool shm = false;
  /// Bound of one connect + handshake (seconds).
  std::chrono::duration<double> handshake_timeout = std::chrono::seconds(10);
  /// Largest message accepted (header + body + storages, bytes). A larger descriptor
  /// closes that connection (ProtocolError reported to on_peer_lost); nothing is allocated.
  size_t max_message_bytes = size_t{16} << 30;
  /// Most storages in one message; more closes the connection like an oversized message.
  size_t max_storages = 1 << 16;
  /// Largest header (bytes); more closes the connection.
  size_t max_header_bytes = 64 << 10;
  /// The handlers neither block nor call this transport: run on_message on the thread that
  /// read the message (TCP: the connection's reader; TensorPipe: its loop thread), in order
  /// per connection, instead of handing it to the transport's dispatch thread. Saves a thread
  /// hand-off per message (the RPC agent's handlers only queue work and complete futures);
  /// messages of different connections may then be handled concurrently. on_peer_lost still
  /// runs on the dispatch thread. TCP marks such messages `may_block` (Message).
  bool inline_handlers = false;
};

/// Callbacks of a transport. Both run on the transport's own threads: they must not block
/// (hand work to a thread pool) and must not call Transport::close. They run one at a time
/// and in order per transport unless options.inline_handlers; create_transport's composite
/// has two transports inside, so its handlers may run concurrently (for different peers)
/// and must be thread-safe.
struct TransportHandlers {
  /// A whole message from the member named `peer`.
  std::function<void(const std::string& peer, Message msg)> on_message;
  /// A connection to `peer` ended (EOF, reset, protocol violation, the peer's close):
  /// messages in flight on it are lost. `why` says what happened, for error messages.
  /// Called once per connection that had been authenticated; a later send reconnects.
  std::function<void(const std::string& peer, const std::string& why)> on_peer_lost;
};

/// Authenticated message transport. Thread-safe: any thread may send.
class Transport {
 public:
  virtual ~Transport() = default;

  /// The address peers connect to ("tcp://<ip>:<port>"; create_transport's adds the shm part,
  /// see parse_transport_address); the RPC layer publishes it in the World's store. Never
  /// contains a secret. Thread-safe.
  virtual std::string address() const = 0;

  /// Sends `msg` to the member `peer`. Uses the open connection to `peer` (one this side
  /// made, or one `peer` made to this side); without one, connects to `address` and runs
  /// the handshake first, blocking at most until `deadline`. Then the write is queued:
  /// send returns once the message is queued (TCP: after writing what the socket takes at
  /// once), never waiting for the peer to read it; its storages are read until it is
  /// written, so do not modify them meanwhile. TCP drops a queued message whose write has
  /// not begun by `deadline`. A failure after send returned is reported through
  /// on_peer_lost, and only a reply proves delivery. Messages sent to one peer arrive in the
  /// order their send calls returned.
  ///
  /// Errors: TimeoutError past `deadline` (connecting, handshaking, or waiting for an earlier
  /// send to the same peer that is connecting);
  /// AuthenticationError when the peer proves another key or refuses ours; ClosedError
  /// after close(), when the peer is gone before the message is queued or written, or (TCP)
  /// when another member answers at `address`; ValueError for a non-CPU storage or an
  /// address that does not parse.
  /// Safety: thread-safe; concurrent sends to one peer wait for each other (in order).
  virtual void send(const std::string& peer, const std::string& address, Message msg,
                    std::chrono::steady_clock::time_point deadline) = 0;

  /// Stops listening, closes every connection (peers see EOF), fails pending handshakes
  /// and joins the transport's threads. No handler runs after close returns. Idempotent.
  virtual void close() = 0;

  /// Whether every message arrives, for now, through a reader that spins for it before it
  /// sleeps (TCP with TORCHPAR_RPC_READ_SPIN_US > 0, no TensorPipe shm path, and no recent
  /// sign of more runnable threads than cores): a caller waiting for a small reply then
  /// sleeps at once instead of spinning beside that reader (RpcFutureState::spin).
  /// Thread-safe.
  virtual bool reader_spins() const { return false; }
};

/// The transport of the RPC agent: our TCP transport (create_tcp_transport, tcp/) always,
/// plus, when options.shm, TensorPipe's shm transport alone (no TensorPipe TCP listener) for
/// peers on this host. address() is the TCP address, plus the shm listener's URL and this
/// host's identity when shm is on (parse_transport_address). send() routes by the peer's
/// address: TensorPipe shm when both addresses carry shm and the same host identity, TCP
/// otherwise; both ends compute the same choice, so a pair of members uses one transport.
/// When shm is on but unusable here (no boot id or network namespace to read, TensorPipe's
/// shm transport not viable, or a soft RLIMIT_NOFILE under kMinFilesForShm, since TensorPipe
/// aborts the process when a memfd_create fails), it logs one line and uses TCP alone.
///
/// Errors:  as create_tcp_transport (ValueError for an empty key or name or a bad bind_host;
///          SystemError when it cannot listen); send() also ValueError for an address that
///          parse_transport_address refuses.
/// Security: with shm off (the default) a member listens only on its TCP port, which
///          survives garbage (our code, which authenticates every connection before reading
///          anything else). With shm on, TensorPipe's shm listener is an abstract Unix socket
///          that any local user in this network namespace can connect to (whatever its uid),
///          and eight bytes of garbage there end the process (docs/wire_format.md, "RPC
///          transport"); TensorPipe reads them before any hook could authenticate the peer.
/// CPU:     with shm off an idle transport blocks (no polling); with shm on, TensorPipe's
///          reactor busy-polls (about a third of a core) for as long as the transport lives.
/// Process: sets SIGPIPE to "ignore" when it is at its default and shm is on (TensorPipe's
///          shm setup writes without MSG_NOSIGNAL), as World does.
std::unique_ptr<Transport> create_transport(TransportOptions options, TransportHandlers handlers);

/// The soft RLIMIT_NOFILE below which create_transport leaves TensorPipe's shm off: each shm
/// pipe holds about 14 descriptors on each side (its socket, ring buffers and the peer's
/// reactor, twice: the pipe's own connection and the cma channel's), and TensorPipe aborts
/// the process when it cannot create one.
inline constexpr uint64_t kMinFilesForShm = 1024;

/// The parts of an address of create_transport (docs/wire_format.md, "RPC transport"):
///   tcp://<ip>:<port>                                          shm off (or unusable)
///   tcp://<ip>:<port>;shm=shm://<name>;host=<boot-id>_<hash>   shm on (HostIdentity::token())
struct TransportAddress {
  std::string tcp;   ///< "tcp://<ip>:<port>"
  std::string shm;   ///< "shm://<name>" (the abstract socket of TensorPipe's shm), or empty
  std::string host;  ///< the host's token (core/host_identity.h), empty exactly when `shm` is
};

/// Parses an address of create_transport (and so also a plain "tcp://<ip>:<port>").
/// Errors: ValueError naming the (printable) address for anything else: a host name instead
/// of an IP, a missing or zero port, unknown or misplaced fields, a bad shm name or host
/// identity. Addresses come from the store: nothing here trusts them.
TransportAddress parse_transport_address(std::string_view address);

}  // namespace torchpar::rpc
