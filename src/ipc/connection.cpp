#include "torchpar/ipc/connection.h"

#include <poll.h>
#include <sys/socket.h>

#include <fmt/format.h>

#include "core/futex.h"
#include "ipc/pipe_mailbox.h"
#include "serialize/fd_elision.h"
#include "serialize/payload_io.h"
#include "torchpar/core/auth.h"
#include "torchpar/core/syscall.h"

namespace torchpar {
namespace {

constexpr std::string_view kWhat = "Connection";
// CPython's _send_bytes writes a message of up to 16 KiB in one write with its header.
constexpr size_t kCoalesceBytes = 16384;
// A message grows by at most this much before its bytes have arrived.
constexpr size_t kRecvStep = size_t{64} << 20;

// True when `fd` is a SOCK_SEQPACKET socket (a Pipe's end): frames go as records.
bool is_seqpacket(int fd) {
  int type = 0;
  socklen_t len = sizeof type;
  return fd >= 0 && ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 &&
         type == SOCK_SEQPACKET;
}

AuthDeadline or_never(const detail::Deadline& d) { return d ? *d : AuthDeadline::max(); }

uint64_t big_endian(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v = (v << 8) | p[i];
  return v;
}

/// Writes one multiprocessing.connection frame.
void send_python_frame(int fd, std::string_view bytes) {
  std::string header = detail::frame_header(bytes.size());
  const auto never = AuthDeadline::max();
  if (bytes.size() <= kCoalesceBytes) {
    header.append(bytes);
    detail::send_all(fd, header.data(), header.size(), never, kWhat);
  } else {
    detail::send_all(fd, header.data(), header.size(), never, kWhat);
    detail::send_all(fd, bytes.data(), bytes.size(), never, kWhat);
  }
}

/// Reads one multiprocessing.connection frame of at most `max_bytes` bytes (CPython's
/// _recv_bytes: a 4-byte signed length; -1 announces an 8-byte unsigned one).
std::string recv_python_frame(int fd, const detail::Deadline& deadline, size_t max_bytes) {
  const AuthDeadline until = or_never(deadline);
  unsigned char header[8];
  detail::recv_all(fd, header, 4, until, kWhat);
  const auto n = static_cast<int32_t>(static_cast<uint32_t>(big_endian(header, 4)));
  uint64_t length = static_cast<uint64_t>(n);
  if (n == -1) {
    detail::recv_all(fd, header, 8, until, kWhat);
    length = big_endian(header, 8);
  } else if (n < 0) {
    throw ProtocolError(fmt::format("Connection: bad message length {}", n));
  }
  if (length > max_bytes) {
    throw ProtocolError(
        fmt::format("Connection: bad message length: the message holds {} bytes, maxlength is {}",
                    length, max_bytes));
  }
  std::string out;
  out.reserve(std::min<uint64_t>(length, kRecvStep));
  while (out.size() < length) {
    const size_t old = out.size();
    out.resize(old + std::min<uint64_t>(length - old, kRecvStep));
    detail::recv_all(fd, out.data() + old, out.size() - old, until, kWhat);
  }
  return out;
}

}  // namespace

Connection::Connection(UniqueFd fd, bool readable, bool writable, Framing framing)
    : fd_(std::make_shared<UniqueFd>(std::move(fd))),
      readable_(readable),
      writable_(writable),
      framing_(framing),
      records_(is_seqpacket(fd_->get())),
      elision_(framing == Framing::kPayload ? std::make_shared<detail::FdElision>() : nullptr) {}

bool Connection::closed() const { return !fd_ || !fd_->valid(); }

int Connection::fileno() const {
  if (closed()) throw ClosedError("Connection is closed");
  return fd_->get();
}

void Connection::close() {
  // No shutdown(): a child may hold a duplicate of this end, and shutdown would close the
  // socket for it too. A thread blocked in recv on this end must use a timeout.
  if (fd_) fd_->reset();
  // The segments pinned for this end's peers are unmapped (their memory freed when no one
  // else maps them); a copy of this end in another process keeps its own.
  if (elision_) elision_->forget();
}

void Connection::send_payload_checked(const Payload& p) {
  if (!writable_) throw Error("Connection is read-only");
  if (framing_ == Framing::kPayload) {
    if (!records_) {
      send_payload(fileno(), p);
      return;
    }
    // A reader already waiting in recv takes a small message from shared memory.
    const int fd = fileno();
    if (mailbox_ && p.fds.empty() && mailbox_->try_deliver(fd, p.bytes)) return;
    detail::PipeMailbox::SocketSend on_socket(mailbox_.get());
    bool started = false;
    try {
      detail::send_payload_records(fd, p, &started);
    } catch (...) {
      // Part of the frame went out: the peer waits for the rest, and a next frame would be
      // read as its continuation. Closed, the peer sees the end (when no other process
      // holds this end).
      if (started) close();
      throw;
    }
    return;
  }
  if (!p.fds.empty()) {
    throw Error(
        "Connection: this value carries file descriptors (a Queue, Lock, Connection, Value or "
        "Array), which cannot travel over a Listener/Client connection; nothing was sent");
  }
  send_python_frame(fileno(), p.bytes);
}

void Connection::send_payload_borrowed(Payload& p) {
  struct Release {
    Payload& p;
    ~Release() {
      for (auto& fd : p.fds) (void)fd.release();
    }
  } release{p};
  send_payload_checked(p);
}

Payload Connection::recv_payload_checked(Timeout timeout, size_t max_bytes) {
  if (!readable_) throw Error("Connection is write-only");
  const detail::Deadline deadline = detail::deadline_after(timeout);
  if (framing_ == Framing::kPython) {
    // Wait for the first byte apart: a timeout before it leaves the stream intact.
    if (!poll(timeout)) {
      throw TimeoutError(
          fmt::format("Connection::recv: no message within {} s", timeout ? timeout->count() : 0));
    }
    try {
      return Payload{recv_python_frame(fileno(), deadline, max_bytes), {}};
    } catch (const TimeoutError&) {
      close();
      throw TimeoutError(
          "Connection::recv: the message did not arrive whole within the timeout; the "
          "connection was closed (its stream is out of sync)");
    } catch (const ProtocolError& e) {
      close();
      throw ProtocolError(fmt::format("{}; the connection was closed", e.what()));
    }
  }
  // Spin briefly before sleeping: a blocking wake-up costs tens of microseconds on these
  // VMs, while a reply in a ping-pong usually arrives within a few. The spin retries the
  // read itself (a poll loop then a read was one system call more per message).
  try {
    constexpr auto kSpin = std::chrono::microseconds(50);
    if (records_ && mailbox_) {
      // The wait happens on the mailbox's word and the socket together: a message from the
      // slot, or the socket holds something now (pipe_mailbox.h).
      const int fd = fileno();
      if (auto bytes = mailbox_->receive(fd, deadline, kSpin)) {
        if (bytes->size() > max_bytes) {
          throw ProtocolError(
              fmt::format("recv_payload: bad message length: the frame holds {} bytes, at most "
                          "{} accepted",
                          bytes->size(), max_bytes));
        }
        return Payload{std::move(*bytes), {}};
      }
      return detail::recv_payload_records(fd, deadline.remaining(), max_bytes, kSpin);
    }
    if (records_) return detail::recv_payload_records(fileno(), timeout, max_bytes, kSpin);
    return detail::recv_payload_spinning(fileno(), timeout, max_bytes, kSpin);
  } catch (const ProtocolError& e) {
    close();
    throw ProtocolError(fmt::format("{}; the connection was closed", e.what()));
  }
}

void Connection::send_bytes(std::string_view bytes) {
  if (framing_ == Framing::kPython && writable_) {
    send_python_frame(fileno(), bytes);  // no copy into a Payload
    return;
  }
  send_payload_checked(Payload{std::string(bytes), {}});
}

std::string Connection::recv_bytes(Timeout timeout, std::optional<size_t> maxlength) {
  return std::move(recv_payload_checked(timeout, maxlength.value_or(SIZE_MAX)).bytes);
}

bool Connection::poll(Timeout timeout) {
  if (!readable_) throw Error("Connection is write-only: poll() needs a readable end");
  if (mailbox_) return mailbox_->poll(fileno(), detail::deadline_after(timeout));
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
  ar(idx, readable_, writable_, static_cast<uint8_t>(framing_));
  const bool mailbox = mailbox_ != nullptr;
  ar(mailbox);
  if (mailbox) {
    const uint32_t box = ar.fd_index(mailbox_->fd());
    ar(box, static_cast<uint8_t>(mailbox_->side()));
  }
}

void Connection::load(detail::InputArchive& ar) {
  uint32_t idx = 0;
  uint8_t framing = 0;
  ar(idx, readable_, writable_, framing);
  if (framing > static_cast<uint8_t>(Framing::kPython)) {
    throw SerializationError(fmt::format("Connection: unknown framing {}", framing));
  }
  framing_ = static_cast<Framing>(framing);
  fd_ = std::make_shared<UniqueFd>(ar.take_fd(idx));
  records_ = is_seqpacket(fd_->get());
  elision_ = framing_ == Framing::kPayload ? std::make_shared<detail::FdElision>() : nullptr;
  bool mailbox = false;
  ar(mailbox);
  mailbox_.reset();
  if (mailbox) {
    uint32_t box = 0;
    uint8_t side = 0;
    ar(box, side);
    // Only a Pipe's end (records, torchpar frames) uses one.
    auto opened = detail::PipeMailbox::open(ar.take_fd(box), side);
    if (records_ && framing_ == Framing::kPayload) mailbox_ = std::move(opened);
  }
}

std::pair<Connection, Connection> Pipe(bool duplex) {
  // Records, not a byte stream: a small message is read whole in one system call (a stream
  // needs one read for the header and one for the rest, or a read-ahead that would hide
  // messages from poll on fileno()).
  int sv[2];
  detail::check_syscall("socketpair", "Pipe", [&] {
    return ::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv);
  });
  UniqueFd a(sv[0]);
  UniqueFd b(sv[1]);
  // Small messages to a reader already waiting go through shared memory (pipe_mailbox.h).
  auto [box_a, box_b] = detail::PipeMailbox::create_pair();
  std::pair<Connection, Connection> ends;
  if (duplex) {
    ends = {Connection(std::move(a), true, true), Connection(std::move(b), true, true)};
  } else {
    ::shutdown(a.get(), SHUT_WR);
    ::shutdown(b.get(), SHUT_RD);
    ends = {Connection(std::move(a), true, false), Connection(std::move(b), false, true)};
  }
  ends.first.mailbox_ = std::move(box_a);
  ends.second.mailbox_ = std::move(box_b);
  return ends;
}

}  // namespace torchpar
