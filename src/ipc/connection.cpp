#include "torchpar/ipc/connection.h"

#include <poll.h>
#include <sys/socket.h>

#include <fmt/format.h>

#include "core/futex.h"
#include "torchpar/core/syscall.h"

namespace torchpar {

Connection::Connection(UniqueFd fd, bool readable, bool writable)
    : fd_(std::make_shared<UniqueFd>(std::move(fd))), readable_(readable), writable_(writable) {}

bool Connection::closed() const { return !fd_ || !fd_->valid(); }

int Connection::fileno() const {
  if (closed()) throw ClosedError("Connection is closed");
  return fd_->get();
}

void Connection::close() {
  // No shutdown(): a child may hold a duplicate of this end, and shutdown would close the
  // socket for it too. A thread blocked in recv on this end must use a timeout.
  if (fd_) fd_->reset();
}

void Connection::send_payload_checked(const Payload& p) {
  if (!writable_) throw Error("Connection is read-only");
  send_payload(fileno(), p);
}

Payload Connection::recv_payload_checked(Timeout timeout) {
  if (!readable_) throw Error("Connection is write-only");
  // Spin briefly before sleeping: a blocking wake-up costs tens of microseconds on these
  // VMs, while a reply in a ping-pong usually arrives within a few.
  {
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
    struct pollfd pfd {
      fileno(), POLLIN, 0
    };
    while (::poll(&pfd, 1, 0) == 0 && std::chrono::steady_clock::now() < spin_until) {
    }
  }
  return recv_payload(fileno(), timeout);
}

void Connection::send_bytes(std::string_view bytes) {
  send_payload_checked(Payload{std::string(bytes), {}});
}

std::string Connection::recv_bytes(Timeout timeout) {
  return std::move(recv_payload_checked(timeout).bytes);
}

bool Connection::poll(Timeout timeout) {
  if (!readable_) throw Error("Connection is write-only: poll() needs a readable end");
  struct pollfd pfd {
    fileno(), POLLIN, 0
  };
  const auto deadline = detail::deadline_after(timeout);
  for (;;) {
    int ms = -1;  // no timeout: wait without a limit
    if (deadline) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(*deadline - detail::SteadyClock::now());
      ms = static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT32_MAX));
    }
    const int r = ::poll(&pfd, 1, ms);
    if (r >= 0) return r > 0;
    if (errno != EINTR) detail::throw_system_error("poll", errno, "Connection");
  }
}

void Connection::save(detail::OutputArchive& ar) const {
  const uint32_t idx = ar.fd_index(fileno());
  ar(idx, readable_, writable_);
}

void Connection::load(detail::InputArchive& ar) {
  uint32_t idx = 0;
  ar(idx, readable_, writable_);
  fd_ = std::make_shared<UniqueFd>(ar.take_fd(idx));
}

std::pair<Connection, Connection> Pipe(bool duplex) {
  int sv[2];
  detail::check_syscall("socketpair", "Pipe",
                        [&] { return ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv); });
  if (duplex)
    return {Connection(UniqueFd(sv[0]), true, true), Connection(UniqueFd(sv[1]), true, true)};
  ::shutdown(sv[0], SHUT_WR);
  ::shutdown(sv[1], SHUT_RD);
  return {Connection(UniqueFd(sv[0]), true, false), Connection(UniqueFd(sv[1]), false, true)};
}

}  // namespace torchpar
