#pragma once
/// Connection and Pipe: two-ended channels between processes over a Unix socket pair
/// (Python's multiprocessing.Pipe / Connection). Values travel as torchpar payloads; the
/// fds of shared tensors travel with SCM_RIGHTS.

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "torchpar/core/fd.h"
#include "torchpar/core/timeout.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar {

/// One end of a Pipe.
///
/// Lifetime: copies share the same end (the fd closes when the last copy goes); close()
/// closes it for every copy. A Connection passed to a child (as a Process argument)
/// becomes an independent fd there.
/// Safety: one sender and one receiver thread at a time per end.
/// Errors: ClosedError when this end is closed, or recv finds the peer gone (EOFError);
///         TimeoutError when recv's timeout passes; SystemError for socket errors.
/// Source: multiprocessing.connection.Connection.
class Connection {
 public:
  Connection() = default;
  Connection(UniqueFd fd, bool readable, bool writable);

  /// Sends `value`. Tensors are shared by default: the receiver aliases them, as with
  /// torch.multiprocessing's Connection (Queue and Pool share too; dumps alone copies, as
  /// machin's dumps). `{.copy_tensor = true}` copies them.
  template <class T>
  void send(const T& value, DumpsOptions options = {.copy_tensor = false}) {
    send_payload_checked(dumps(value, options));
  }
  /// Receives a value sent with send<T>.
  template <class T>
  T recv(Timeout timeout = std::nullopt) {
    return loads<T>(recv_payload_checked(timeout));
  }
  /// Raw bytes (Python's send_bytes / recv_bytes).
  void send_bytes(std::string_view bytes);
  std::string recv_bytes(Timeout timeout = std::nullopt);
  /// True when data (or EOF) is ready within `timeout` (0, the default: just look;
  /// nullopt: wait without a limit, as Python's poll(None)).
  /// Errors: torchpar::Error on a write-only end (as recv), ClosedError when closed.
  bool poll(Timeout timeout = std::chrono::duration<double>(0));
  void close();
  bool closed() const;
  bool readable() const { return readable_; }
  bool writable() const { return writable_; }
  int fileno() const;

  void save(detail::OutputArchive& ar) const;
  void load(detail::InputArchive& ar);

 private:
  void send_payload_checked(const Payload& p);
  Payload recv_payload_checked(Timeout timeout);
  std::shared_ptr<UniqueFd> fd_;
  bool readable_ = false;
  bool writable_ = false;
};

/// A connected pair. duplex: both ends send and receive; otherwise the first end only
/// receives and the second only sends. Source: multiprocessing.Pipe.
std::pair<Connection, Connection> Pipe(bool duplex = true);

}  // namespace torchpar
