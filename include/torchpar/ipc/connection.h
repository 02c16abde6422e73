#pragma once
/// Connection and Pipe: two-ended channels between processes (Python's
/// multiprocessing.Pipe / Connection).
///
/// One Connection type with two framings, as Python has one Connection class for Pipe()
/// and for Listener/Client:
///   - `Framing::kPayload` (Pipe): a Unix socket pair between related processes
///     (SOCK_SEQPACKET: a small message is one record, read whole in one system call).
///     Values travel as torchpar payloads (16-byte frame header, docs/wire_format.md) and
///     the fds of shared tensors, queues and locks travel with SCM_RIGHTS, so tensors are
///     shared. A shared-memory segment's fd crosses once: while it is among the last 16
///     the sender passed, its tensors go as handles that the receiver resolves to the
///     segment it kept mapped (at most 16 segments of up to 4 MiB per sending process, until
///     close(); docs/ipc.md), so they arrive even after their sender exited. A message
///     without fds of up to 16 KiB to a reader already waiting in recv skips the socket:
///     the Pipe's ends share a small shared-memory mailbox (docs/ipc.md), used only when
///     every earlier record of that end has been read, so order and a select on fileno()
///     hold as on the socket (but for a message to a reader killed while it waited:
///     poll() and the next recv see it, a select does not).
///   - `Framing::kPython` (Listener::accept, Client; torchpar/ipc/listener.h): a TCP or
///     Unix stream socket to any process, on this host or another, possibly Python's own
///     multiprocessing.connection. Frames are Python's: a 4-byte big-endian signed length
///     then the bytes, or the length -1, an 8-byte big-endian length and the bytes for
///     frames over 2 GiB, so send_bytes / recv_bytes interoperate with Python's
///     Connection.send_bytes / recv_bytes. send<T> / recv<T> carry a torchpar payload inside
///     one such frame (only torchpar reads those bytes). No fds travel: tensors are always
///     copied (copy_tensor is forced on), and a value that would carry fds (a Queue, Lock,
///     Connection, Value, Array) is refused.
/// Code written against Connection works on either; the framing only changes what can
/// travel.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "torchpar/core/fd.h"
#include "torchpar/core/timeout.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar {
namespace detail {
class PipeMailbox;
}  // namespace detail

/// Options of Connection::send.
struct SendOptions {
  /// As DumpsOptions::copy_tensor, but false by default: kPayload shares tensors, as
  /// torch.multiprocessing's Connection does. Ignored (always true) on a kPython connection.
  bool copy_tensor = false;
};

/// One end of a Pipe, or of a connection made by Listener::accept / Client.
///
/// Lifetime: copies share the same end (the fd closes when the last copy goes); close()
/// closes it for every copy, and unmaps the segments kept for its peers' handles. A
/// Connection passed to a child (as a Process argument or through a Pipe) becomes an
/// independent fd there and keeps its framing.
/// Safety: one sender and one receiver thread at a time per end.
/// Errors: ClosedError when this end is closed, or recv finds the peer gone (EOFError);
///         TimeoutError when recv's timeout passes; ProtocolError for a frame over
///         recv_bytes' maxlength or a Pipe frame broken after its first record (this end
///         is closed then; a send that fails after its first record closes it too);
///         SerializationError for a first record that starts no frame (dropped whole: the
///         Pipe stays usable); SystemError for socket errors.
/// Source: multiprocessing.connection.Connection.
class Connection {
 public:
  /// How messages are laid out on the socket (see the header comment).
  enum class Framing : uint8_t {
    kPayload = 0,  ///< torchpar payload frames with SCM_RIGHTS fds (Pipe)
    kPython = 1,   ///< multiprocessing.connection frames, bytes only (Listener, Client)
  };

  Connection() = default;
  /// Adopts the connected socket `fd`. kPython needs a stream socket (TCP or Unix);
  /// kPayload a Unix one, stream or SOCK_SEQPACKET (found with getsockopt SO_TYPE: frames
  /// then go as records, as Pipe's do).
  Connection(UniqueFd fd, bool readable, bool writable, Framing framing = Framing::kPayload);

  /// Sends `value`. kPayload: tensors are shared by default (the receiver aliases them, as
  /// with torch.multiprocessing's Connection; Queue and Pool share too; dumps alone
  /// copies, as machin's dumps), `{.copy_tensor = true}` copies them. kPython: tensors are
  /// always copied (there is no shared memory across a TCP connection).
  /// Errors: Error for a value carrying fds on a kPython connection (nothing is sent);
  ///         ClosedError, SystemError as send_bytes; what dumps throws.
  template <class T>
  void send(const T& value, SendOptions options = {}) {
    // Sent at once: the value's own fds travel, no duplicates (borrow_fds).
    // A segment whose fd went over this connection lately goes without it (fd_elision).
    Payload p = detail::dumps_with(
        value, {.copy_tensor = options.copy_tensor || framing_ == Framing::kPython,
                .borrow_fds = true,
                .fd_elision = elision_.get()});
    send_payload_borrowed(p);
  }
  /// Receives a value sent with send<T>. Errors: as recv_bytes, and SerializationError when
  /// the bytes are not a `T` (the frame was read whole: the connection stays usable).
  template <class T>
  T recv(Timeout timeout = std::nullopt) {
    // Segments that came with their fds are pinned for the sender's later handles.
    return detail::loads_with<T>(recv_payload_checked(timeout, SIZE_MAX),
                                 {.fd_elision = elision_.get()});
  }
  /// Sends `bytes` as one message (Python's send_bytes; an empty message is allowed).
  /// Blocks until the kernel took every byte (no timeout, as Python).
  /// Errors: ClosedError when this end is closed or the peer is gone (EPIPE/ECONNRESET:
  ///         never SIGPIPE); SystemError for other socket errors.
  void send_bytes(std::string_view bytes);
  /// Receives one message (Python's recv_bytes(maxlength)).
  ///
  /// Units:  `timeout` covers the whole message (nullopt: no limit); `maxlength` in bytes.
  /// Errors: TimeoutError when the message has not arrived in time: if none of it had
  ///         arrived, nothing was consumed and the connection is usable; if part had, a
  ///         kPython connection is closed (its stream would be out of sync), and a kPayload
  ///         one should be. ProtocolError when the message is longer than `maxlength`: the
  ///         connection is closed before its body is read (Python: OSError "bad message
  ///         length"). ClosedError when the peer closed. SystemError.
  /// Memory grows with the bytes that arrive, never with what a length prefix claims.
  std::string recv_bytes(Timeout timeout = std::nullopt,
                         std::optional<size_t> maxlength = std::nullopt);
  /// True when data (or EOF) is ready within `timeout` (0, the default: just look;
  /// nullopt: wait without a limit, as Python's poll(None)).
  /// Errors: torchpar::Error on a write-only end (as recv), ClosedError when closed.
  bool poll(Timeout timeout = std::chrono::duration<double>(0));
  void close();
  bool closed() const;
  bool readable() const { return readable_; }
  bool writable() const { return writable_; }
  Framing framing() const { return framing_; }
  int fileno() const;

  void save(detail::OutputArchive& ar) const;
  void load(detail::InputArchive& ar);

 private:
  void send_payload_checked(const Payload& p);
  /// send_payload_checked of a payload made with DumpsContext::borrow_fds; releases its
  /// fds afterwards, also when the send throws.
  void send_payload_borrowed(Payload& p);
  Payload recv_payload_checked(Timeout timeout, size_t max_bytes);
  std::shared_ptr<UniqueFd> fd_;
  bool readable_ = false;
  bool writable_ = false;
  Framing framing_ = Framing::kPayload;
  bool records_ = false;  ///< a SOCK_SEQPACKET socket (Pipe): kPayload frames go as records
  /// The segments whose fds crossed this connection lately, both ways (kPayload only;
  /// shared by the copies of this end in this process).
  std::shared_ptr<detail::FdElision> elision_;
  /// A Pipe end's shared-memory slots for small messages to a reader that waits in recv
  /// (null: every message on the socket, as for an end adopted from its fd alone).
  std::shared_ptr<detail::PipeMailbox> mailbox_;
  friend std::pair<Connection, Connection> Pipe(bool duplex);
};

/// A connected pair. duplex: both ends send and receive; otherwise the first end only
/// receives and the second only sends. Source: multiprocessing.Pipe.
std::pair<Connection, Connection> Pipe(bool duplex = true);

}  // namespace torchpar
