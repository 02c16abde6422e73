#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/cpu_relax.h"
#include "core/futex.h"
#include "serialize/payload_io.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"
#include "torchpar/serialize/payload.h"

namespace torchpar {
namespace {

constexpr uint32_t kFrameMagic = 0x46524150;  // "PARF"
constexpr size_t kFdsPerMessage = 250;        // below the kernel's SCM_MAX_FD (253)
constexpr uint32_t kMaxFds = 1 << 16;
// A spinning receive yields its core after this many failed non-blocking reads (each read is
// a system call of 1.5-2 us on these VMs, so about every 6 us).
constexpr int kReadsPerYield = 3;

struct FrameHeader {
  uint32_t magic;
  uint32_t nfds;
  uint64_t nbytes;
};

// Sends the `iovcnt` buffers of `iov` in order, attaching `fds` (if any) to the first byte.
// `iov` is consumed (advanced past what was sent).
void send_iov(int sock, struct iovec* iov, int iovcnt, const int* fds, size_t nfds) {
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * kFdsPerMessage)];
  for (;;) {
    while (iovcnt > 0 && iov->iov_len == 0) {
      ++iov;
      --iovcnt;
    }
    if (iovcnt == 0) return;
    struct msghdr msg {};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iovcnt);
    if (nfds > 0) {
      std::memset(control, 0, sizeof control);
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
      struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
      std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
    }
    auto n = static_cast<size_t>(
        detail::check_syscall("sendmsg", fmt::format("socket fd {}", sock),
                              [&] { return ::sendmsg(sock, &msg, MSG_NOSIGNAL); }));
    nfds = 0;  // the fds went with the first byte
    for (; iovcnt > 0 && n >= iov->iov_len; ++iov, --iovcnt) n -= iov->iov_len;
    if (n > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + n;
      iov->iov_len -= n;
    }
  }
}

// Sends `len` bytes, attaching `fds` (if any) to the first byte.
void send_with_fds(int sock, const char* data, size_t len, const int* fds, size_t nfds) {
  struct iovec iov {
    const_cast<char*>(data), len
  };
  send_iov(sock, &iov, 1, fds, nfds);
}

using Clock = detail::SteadyClock;
using detail::Deadline;

// Waits until `sock` is readable or the deadline passes (TimeoutError).
void wait_readable(int sock, const Deadline& deadline) {
  if (!deadline) return;
  for (;;) {
    // Rounded up: poll's milliseconds must not wake before the deadline and spin.
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - Clock::now());
    struct pollfd pfd {
      sock, POLLIN, 0
    };
    const int r =
        ::poll(&pfd, 1, static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT32_MAX)));
    if (r > 0) return;
    if (r < 0 && errno != EINTR)
      detail::throw_system_error("poll", errno, fmt::format("socket fd {}", sock));
    if (r == 0 && Clock::now() >= *deadline)
      throw TimeoutError("recv_payload: the frame did not arrive before the deadline");
  }
}

// Receives exactly `len` bytes; fds that arrive are appended to `fds`. Until `spin_until`
// (if set) it retries a non-blocking read instead of sleeping in poll or recvmsg.
void recv_exact(int sock, char* data, size_t len, std::vector<UniqueFd>* fds, bool at_start,
                const Deadline& deadline, const Deadline& spin_until = std::nullopt) {
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * kFdsPerMessage)];
  size_t got = 0;
  bool spinning = spin_until.finite();
  int failed_reads = 0;
  while (got < len) {
    struct iovec iov {
      data + got, len - got
    };
    struct msghdr msg {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    // With a deadline, try first and poll only when nothing is there: the bytes of a frame
    // usually arrive together, and a poll per read was a system call each time.
    const int flags = MSG_CMSG_CLOEXEC | (deadline || spinning ? MSG_DONTWAIT : 0);
    ssize_t n = ::recvmsg(sock, &msg, flags);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (spinning && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        // The read is the check: a reply that arrives is taken by the call that sees it.
        const auto now = Clock::now();
        spinning = now < *spin_until && !(deadline && now >= *deadline);
        // Every few failed reads the core goes to whoever else can run on it: when the peer
        // that is to answer shares this core (more runnable processes than cores), a spin
        // that never yields keeps it off the core for the whole spin (Pipe round trip at
        // load 3 on 2 cores: 127 us against the Queue's 23, whose spin yields). sched_yield
        // returns at once when nothing else waits for the core.
        if (++failed_reads % kReadsPerYield == 0) {
          ::sched_yield();
        } else {
          detail::cpu_relax();
        }
        continue;
      }
      if (deadline && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        wait_readable(sock, deadline);
        continue;
      }
      detail::throw_system_error("recvmsg", errno, fmt::format("socket fd {}", sock));
    }
    for (struct cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; ++i) {
          int fd = -1;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          fds->emplace_back(fd);
        }
      }
    }
    if ((msg.msg_flags & MSG_CTRUNC) != 0)
      throw SerializationError(
          "file descriptors were dropped in transit (MSG_CTRUNC); raise "
          "RLIMIT_NOFILE");
    if (n == 0) {
      if (at_start && got == 0) throw ClosedError("recv_payload: the peer closed the connection");
      throw ClosedError(
          fmt::format("recv_payload: the peer closed the connection mid-frame "
                      "({} of {} bytes)",
                      got, len));
    }
    got += static_cast<size_t>(n);
  }
}

}  // namespace

void send_payload(int sock, const Payload& payload) {
  if (payload.fds.size() > kMaxFds)
    throw ValueError(
        fmt::format("send_payload: {} fds exceed the limit of {}", payload.fds.size(), kMaxFds));
  std::vector<int> raw;
  raw.reserve(payload.fds.size());
  for (const auto& fd : payload.fds) raw.push_back(fd.get());
  FrameHeader h{kFrameMagic, static_cast<uint32_t>(raw.size()), payload.bytes.size()};
  const size_t first = std::min(raw.size(), kFdsPerMessage);
  if (first == raw.size()) {
    // The header and the bytes in one sendmsg: one system call, and the receiver wakes once.
    struct iovec iov[2] = {{&h, sizeof h},
                           {const_cast<char*>(payload.bytes.data()), payload.bytes.size()}};
    send_iov(sock, iov, 2, raw.data(), first);
    return;
  }
  send_with_fds(sock, reinterpret_cast<const char*>(&h), sizeof h, raw.data(), first);
  for (size_t i = first; i < raw.size(); i += kFdsPerMessage) {
    const char one = 0;
    send_with_fds(sock, &one, 1, raw.data() + i, std::min(kFdsPerMessage, raw.size() - i));
  }
  send_with_fds(sock, payload.bytes.data(), payload.bytes.size(), nullptr, 0);
}

Payload recv_payload(int sock, Timeout timeout, size_t max_bytes) {
  return detail::recv_payload_spinning(sock, timeout, max_bytes, std::chrono::microseconds(0));
}

Payload detail::recv_payload_spinning(int sock, Timeout timeout, size_t max_bytes,
                                      std::chrono::microseconds spin) {
  const Deadline deadline = detail::deadline_after(timeout);
  const Deadline spin_until =
      spin.count() > 0 ? Deadline(Clock::now() + spin) : Deadline(std::nullopt);
  Payload p;
  FrameHeader h{};
  recv_exact(sock, reinterpret_cast<char*>(&h), sizeof h, &p.fds, /*at_start=*/true, deadline,
             spin_until);
  if (h.magic != kFrameMagic) throw SerializationError("recv_payload: bad frame magic");
  if (h.nfds > kMaxFds)
    throw SerializationError(fmt::format("recv_payload: frame claims {} fds", h.nfds));
  while (p.fds.size() < h.nfds) {
    char one = 0;
    const size_t before = p.fds.size();
    recv_exact(sock, &one, 1, &p.fds, false, deadline);
    if (p.fds.size() == before) throw SerializationError("recv_payload: fd message without fds");
  }
  if (p.fds.size() != h.nfds)
    throw SerializationError(
        fmt::format("recv_payload: expected {} fds, got {}", h.nfds, p.fds.size()));
  if (h.nbytes > max_bytes) {
    throw ProtocolError(
        fmt::format("recv_payload: bad message length: the frame holds {} bytes, "
                    "at most {} accepted",
                    h.nbytes, max_bytes));
  }
  // Grow with what actually arrives: a lying header cannot make us allocate.
  constexpr size_t kStep = 64 << 20;
  p.bytes.reserve(std::min<uint64_t>(h.nbytes, kStep));
  while (p.bytes.size() < h.nbytes) {
    const size_t old = p.bytes.size();
    const size_t step = std::min<uint64_t>(h.nbytes - old, kStep);
    p.bytes.resize(old + step);
    recv_exact(sock, p.bytes.data() + old, step, &p.fds, false, deadline);
  }
  return p;
}

}  // namespace torchpar
