#pragma once
// The RPC layer's transport: authenticated, message-oriented connections between named
// members of a World. One implementation today (transport/tensorpipe/); RpcGroup code
// sees only this header, so no TensorPipe header appears outside that folder (upstream
// TensorPipe is frozen and PyTorch is removing it).

#include <c10/core/Storage.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "torchpar/core/auth.h"

namespace torchpar::rpc {

/// One message between two members.
///
/// `header` and `body` are bytes of the RPC layer (its framing, and a serialized value);
/// `storages` are CPU tensor storages that travel beside them (TensorPipe tensors: copied
/// once by the channel, never through `body`). A received storage is a fresh CPU storage of
/// the sent length, owned by the receiver.
struct Message {
  std::string header;
  std::string body;
  std::vector<c10::Storage> storages;
};

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
  /// Offer TensorPipe's shm transport (same host and network namespace; negotiated per
  /// connection, TCP otherwise). Off above ~16 members: pytorch/tensorpipe#397.
  bool shm = true;
  /// Bound of one connect + handshake (seconds).
  std::chrono::duration<double> handshake_timeout = std::chrono::seconds(10);
  /// Largest message accepted (header + body + storages, bytes). A larger descriptor
  /// closes that connection (ProtocolError reported to on_peer_lost); nothing is allocated.
  size_t max_message_bytes = size_t{16} << 30;
  /// Most storages in one message; more closes the connection like an oversized message.
  size_t max_storages = 1 << 16;
  /// Largest header (bytes); more closes the connection.
  size_t max_header_bytes = 64 << 10;
  /// The handlers neither block nor call this transport: run on_message on TensorPipe's
  /// own thread as each message is read (in order), instead of handing it to the
  /// transport's dispatch thread. Saves a thread hand-off per message (the RPC agent's
  /// handlers only queue work and complete futures). on_peer_lost still runs on the
  /// dispatch thread.
  bool inline_handlers = false;
};

/// Callbacks of a transport. Both run on the transport's own thread: they must not block
/// (hand work to a thread pool) and must not call Transport::close.
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

  /// The address peers connect to (for TensorPipe: "tcp://<bind_host>:<port>"); the RPC
  /// layer publishes it in the World's store. Never contains a secret.
  virtual std::string address() const = 0;

  /// Sends `msg` to the member `peer`. Uses the open connection to `peer` (one this side
  /// made, or one `peer` made to this side); without one, connects to `address` and runs
  /// the handshake first, blocking at most until `deadline`. The write itself is
  /// asynchronous: send returns once the message is queued; a failure after that is
  /// reported through on_peer_lost. Messages sent to one peer arrive in the order their
  /// send calls returned.
  ///
  /// Errors: TimeoutError past `deadline` (connecting or handshaking); AuthenticationError
  /// when the peer proves another key or refuses ours; ClosedError after close() or when
  /// the peer is gone before the message is queued; ValueError for a non-CPU storage.
  virtual void send(const std::string& peer, const std::string& address, Message msg,
                    std::chrono::steady_clock::time_point deadline) = 0;

  /// Stops listening, closes every connection (peers see EOF), fails pending handshakes
  /// and joins the transport's threads. No handler runs after close returns. Idempotent.
  virtual void close() = 0;
};

/// A TensorPipe transport (uv = TCP, plus shm when options.shm; channels cma and basic)
/// listening on options.bind_host, port chosen by the kernel.
/// Errors: ValueError for an empty key or name (or one over 256 bytes); SystemError when it
/// cannot listen.
/// Process: sets SIGPIPE to "ignore" when it is at its default (libuv writes without
/// MSG_NOSIGNAL), as World does. TensorPipe aborts the process on garbage sent to its TCP
/// port before any handshake can run: keep bind_host on loopback or a trusted network
/// (docs/wire_format.md, "RPC transport").
std::unique_ptr<Transport> create_tensorpipe_transport(TransportOptions options,
                                                       TransportHandlers handlers);

}  // namespace torchpar::rpc
