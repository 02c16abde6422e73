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

// Puts `nfds` fds (at most kFdsPerMessage) on `msg` as one SCM_RIGHTS message built in
// `control` (`room` bytes); none: no control message.
void attach_fds(struct msghdr& msg, char* control, size_t room, const int* fds, size_t nfds) {
  if (nfds == 0) return;
  std::memset(control, 0, room);
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
  struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
  std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
}

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
    attach_fds(msg, control, sizeof control, fds, nfds);
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

// How a receive waits for data: until `spin_until` (if set) it retries a non-blocking read
// instead of sleeping in poll or recvmsg; then it polls until `deadline` (if set) or blocks.
struct ReadWait {
  Deadline deadline;
  Deadline spin_until;
  bool spinning = false;
  int failed_reads = 0;
  bool reset_seen = false;  // ECONNRESET reported once: the peer is gone

  ReadWait(const Deadline& d, const Deadline& spin) : deadline(d), spin_until(spin) {
    spinning = spin.finite();
  }
  // Spins again for up to `spin` (none: 0) before the next read sleeps.
  void spin_for(std::chrono::microseconds spin) {
    spinning = spin.count() > 0;
    if (spinning) spin_until = Deadline(Clock::now() + spin);
  }
};

// One recvmsg into `msg`'s iovecs, waiting as `w` says; fds that arrive are appended to
// `fds`. Returns the bytes read (0: the peer closed). msg_flags tells of truncation.
size_t recv_some(int sock, struct msghdr& msg, std::vector<UniqueFd>* fds, ReadWait& w) {
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * kFdsPerMessage)];
  for (;;) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    msg.msg_flags = 0;
    // With a deadline, try first and poll only when nothing is there: the bytes of a frame
    // usually arrive together, and a poll per read was a system call each time.
    const int flags = MSG_CMSG_CLOEXEC | (w.deadline || w.spinning ? MSG_DONTWAIT : 0);
    const ssize_t n = ::recvmsg(sock, &msg, flags);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == ECONNRESET && !w.reset_seen) {
        // The peer closed with data of ours unread. A SOCK_SEQPACKET socket says so before
        // the records still queued for us (a stream after them); reported once, then the
        // reads return what is queued and 0: read on, as from a stream.
        w.reset_seen = true;
        continue;
      }
      if (w.spinning && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        // The read is the check: a reply that arrives is taken by the call that sees it.
        const auto now = Clock::now();
        w.spinning = now < *w.spin_until && !(w.deadline && now >= *w.deadline);
        // Every few failed reads the core goes to whoever else can run on it: when the peer
        // that is to answer shares this core (more runnable processes than cores), a spin
        // that never yields keeps it off the core for the whole spin (Pipe round trip at
        // load 3 on 2 cores: 127 us against the Queue's 23, whose spin yields). sched_yield
        // returns at once when nothing else waits for the core.
        if (++w.failed_reads % kReadsPerYield == 0) {
          ::sched_yield();
        } else {
          detail::cpu_relax();
        }
        continue;
      }
      if (w.deadline && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        wait_readable(sock, w.deadline);
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
    return static_cast<size_t>(n);
  }
}

// Receives exactly `len` bytes of a stream; fds that arrive are appended to `fds`.
void recv_exact(int sock, char* data, size_t len, std::vector<UniqueFd>* fds, bool at_start,
                ReadWait& w) {
  size_t got = 0;
  while (got < len) {
    struct iovec iov {
      data + got, len - got
    };
    struct msghdr msg {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    const size_t n = recv_some(sock, msg, fds, w);
    if (n == 0) {
      if (at_start && got == 0) throw ClosedError("recv_payload: the peer closed the connection");
      throw ClosedError(
          fmt::format("recv_payload: the peer closed the connection mid-frame "
                      "({} of {} bytes)",
                      got, len));
    }
    got += n;
  }
}

// Records of a SOCK_SEQPACKET socket (Pipe): one recvmsg takes one whole record.
// A frame's first record holds its header and up to this many of its bytes: one read of a
// small frame, into a buffer on the stack.
constexpr size_t kFirstRecordBytes = 16384;
// Later records: bytes each, below the 208 KiB send buffer Linux gives a Unix socket by
// default (a record must fit in it whole), and short enough that the kernel keeps all but
// ~16 KiB of one in pages (it holds up to 68 KiB of a record in page fragments and the rest
// in one contiguous allocation); halved while the socket refuses them (EMSGSIZE, ENOBUFS).
constexpr size_t kRecordBytes = 81920;
constexpr size_t kMinRecordBytes = 1024;
// The longest later record a receiver takes (a longer one is a protocol error).
constexpr size_t kMaxRecordBytes = 2 * kRecordBytes;
// A frame's buffer grows by at most this much before its bytes have arrived: a lying
// header cannot make us allocate.
constexpr size_t kStep = 64 << 20;

std::vector<int> raw_fds(const Payload& payload) {
  if (payload.fds.size() > kMaxFds)
    throw ValueError(
        fmt::format("send_payload: {} fds exceed the limit of {}", payload.fds.size(), kMaxFds));
  std::vector<int> raw;
  raw.reserve(payload.fds.size());
  for (const auto& fd : payload.fds) raw.push_back(fd.get());
  return raw;
}

void check_header(const FrameHeader& h) {
  if (h.magic != kFrameMagic) throw SerializationError("recv_payload: bad frame magic");
  if (h.nfds > kMaxFds)
    throw SerializationError(fmt::format("recv_payload: frame claims {} fds", h.nfds));
}

// Once the fds of a frame are in: their count, then the frame's length against `max_bytes`.
void check_fds_and_length(const FrameHeader& h, size_t nfds, size_t max_bytes) {
  if (nfds != h.nfds)
    throw SerializationError(fmt::format("recv_payload: expected {} fds, got {}", h.nfds, nfds));
  if (h.nbytes > max_bytes) {
    throw ProtocolError(
        fmt::format("recv_payload: bad message length: the frame holds {} bytes, "
                    "at most {} accepted",
                    h.nbytes, max_bytes));
  }
}

// Sends one record with `fds` attached: all of it or nothing. False when the socket cannot
// take a record this long (EMSGSIZE; ENOBUFS: no memory for one now).
bool send_record(int sock, struct iovec* iov, int iovcnt, const int* fds, size_t nfds) {
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * kFdsPerMessage)];
  struct msghdr msg {};
  msg.msg_iov = iov;
  msg.msg_iovlen = static_cast<size_t>(iovcnt);
  attach_fds(msg, control, sizeof control, fds, nfds);
  const ssize_t n = detail::retry_eintr([&] { return ::sendmsg(sock, &msg, MSG_NOSIGNAL); });
  if (n < 0 && (errno == EMSGSIZE || errno == ENOBUFS)) return false;
  if (n < 0) detail::throw_system_error("sendmsg", errno, fmt::format("socket fd {}", sock));
  return true;
}

// True when the peer of `sock` closed or shut down its sending side.
bool peer_hung_up(int sock) {
  struct pollfd pfd {
    sock, POLLRDHUP, 0
  };
  return detail::retry_eintr([&] { return ::poll(&pfd, 1, 0); }) > 0 &&
         (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

// Receives one record into `iov`; a record longer than `iov` is an error (its tail would be
// lost). Returns its length (0: the peer closed). An empty record (a raw write of no bytes
// on the socket: no frame has one) is skipped, not taken for the end of the stream.
size_t recv_record(int sock, struct iovec* iov, int iovcnt, std::vector<UniqueFd>* fds,
                   ReadWait& w) {
  for (;;) {
    struct msghdr msg {};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iovcnt);
    const size_t n = recv_some(sock, msg, fds, w);
    if ((msg.msg_flags & MSG_TRUNC) != 0)
      throw SerializationError(
          "recv_payload: a record longer than the frame's next part arrived (not a torchpar "
          "peer?); it was dropped");
    if (n > 0 || peer_hung_up(sock)) return n;
  }
}

}  // namespace

void send_payload(int sock, const Payload& payload) {
  const std::vector<int> raw = raw_fds(payload);
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

namespace detail {
namespace {

Deadline spin_deadline(std::chrono::microseconds spin) {
  return spin.count() > 0 ? Deadline(Clock::now() + spin) : Deadline(std::nullopt);
}

}  // namespace

Payload recv_payload_spinning(int sock, Timeout timeout, size_t max_bytes,
                              std::chrono::microseconds spin) {
  ReadWait w(deadline_after(timeout), spin_deadline(spin));
  Payload p;
  FrameHeader h{};
  recv_exact(sock, reinterpret_cast<char*>(&h), sizeof h, &p.fds, /*at_start=*/true, w);
  w.spinning = false;  // the rest of a frame follows its header: poll or block for it
  check_header(h);
  while (p.fds.size() < h.nfds) {
    char one = 0;
    const size_t before = p.fds.size();
    recv_exact(sock, &one, 1, &p.fds, false, w);
    if (p.fds.size() == before) throw SerializationError("recv_payload: fd message without fds");
  }
  check_fds_and_length(h, p.fds.size(), max_bytes);
  p.bytes.reserve(std::min<uint64_t>(h.nbytes, kStep));
  while (p.bytes.size() < h.nbytes) {
    const size_t old = p.bytes.size();
    const size_t step = std::min<uint64_t>(h.nbytes - old, kStep);
    p.bytes.resize(old + step);
    recv_exact(sock, p.bytes.data() + old, step, &p.fds, false, w);
  }
  return p;
}

void send_payload_records(int sock, const Payload& payload, bool* started) {
  const std::vector<int> raw = raw_fds(payload);
  FrameHeader h{kFrameMagic, static_cast<uint32_t>(raw.size()), payload.bytes.size()};
  char* data = const_cast<char*>(payload.bytes.data());
  const size_t size = payload.bytes.size();
  const size_t nfds = std::min(raw.size(), kFdsPerMessage);
  size_t first = std::min(size, kFirstRecordBytes);
  for (;;) {
    struct iovec iov[2] = {{&h, sizeof h}, {data, first}};
    if (send_record(sock, iov, 2, raw.data(), nfds)) break;
    if (first == 0) throw_system_error("sendmsg", EMSGSIZE, fmt::format("socket fd {}", sock));
    first /= 2;
  }
  if (started != nullptr) *started = true;
  for (size_t i = nfds; i < raw.size(); i += kFdsPerMessage) {
    char one = 0;
    struct iovec iov {
      &one, 1
    };
    if (!send_record(sock, &iov, 1, raw.data() + i, std::min(kFdsPerMessage, raw.size() - i)))
      throw_system_error("sendmsg", EMSGSIZE, fmt::format("socket fd {}", sock));
  }
  size_t record = kRecordBytes;
  for (size_t off = first; off < size;) {
    const size_t len = std::min(record, size - off);
    struct iovec iov {
      data + off, len
    };
    if (send_record(sock, &iov, 1, nullptr, 0)) {
      off += len;
    } else if (record > kMinRecordBytes) {
      record /= 2;
    } else {
      throw_system_error("sendmsg", EMSGSIZE, fmt::format("socket fd {}", sock),
                         "the socket's send buffer holds no record of 1 KiB");
    }
  }
}

namespace {

// The records of a frame after its first (which held its header and `n` bytes at `first`):
// fd records, then the bytes.
void recv_frame_rest(int sock, const FrameHeader& h, const char* first, size_t n, Payload& p,
                     ReadWait& w, size_t max_bytes, std::chrono::microseconds spin) {
  const auto mid_frame = [&](uint64_t got) {
    return ClosedError(fmt::format(
        "recv_payload: the peer closed the connection mid-frame ({} of {} bytes)", got, h.nbytes));
  };
  w.spin_for(std::chrono::microseconds(0));  // fd records: poll or block for them
  while (p.fds.size() < h.nfds) {
    char one = 0;
    struct iovec one_iov {
      &one, 1
    };
    const size_t before = p.fds.size();
    if (recv_record(sock, &one_iov, 1, &p.fds, w) == 0) throw mid_frame(n);
    if (p.fds.size() == before) throw SerializationError("recv_payload: fd message without fds");
  }
  check_fds_and_length(h, p.fds.size(), max_bytes);
  p.bytes.reserve(std::min<uint64_t>(h.nbytes, kStep));
  p.bytes.assign(first, n);
  size_t pos = n;
  while (pos < h.nbytes) {
    // Room for the longest record the rest may come in, the buffer growing with what arrives.
    if (p.bytes.size() - pos < std::min<uint64_t>(h.nbytes - pos, kMaxRecordBytes))
      p.bytes.resize(std::min<uint64_t>(h.nbytes, pos + kStep));
    struct iovec part {
      p.bytes.data() + pos, p.bytes.size() - pos
    };
    // The sender is writing the next record now (two or three fill the socket's buffer): a
    // sleep per record would cost two wake-ups each (1 MiB: 0.24 ms against 0.18 with the
    // spin, the stream's figure).
    w.spin_for(spin);
    const size_t k = recv_record(sock, &part, 1, &p.fds, w);
    if (k == 0) throw mid_frame(pos);
    pos += k;
  }
}

}  // namespace

Payload recv_payload_records(int sock, Timeout timeout, size_t max_bytes,
                             std::chrono::microseconds spin) {
  ReadWait w(deadline_after(timeout), spin_deadline(spin));
  Payload p;
  FrameHeader h{};
  char first[kFirstRecordBytes];
  struct iovec iov[2] = {{&h, sizeof h}, {first, sizeof first}};
  size_t n = recv_record(sock, iov, 2, &p.fds, w);
  if (n == 0) throw ClosedError("recv_payload: the peer closed the connection");
  if (n < sizeof h)
    throw SerializationError(
        fmt::format("recv_payload: a record of {} bytes is shorter than a frame header", n));
  check_header(h);
  n -= sizeof h;
  if (n > h.nbytes)
    throw SerializationError(
        fmt::format("recv_payload: the first record holds {} bytes of a frame of {}", n, h.nbytes));
  try {
    recv_frame_rest(sock, h, first, n, p, w, max_bytes, spin);
  } catch (const SerializationError& e) {
    // The frame's later records may still be queued: the next read would take one for a
    // frame's start. ProtocolError: Connection closes itself.
    throw ProtocolError(fmt::format("{} (in the middle of a frame)", e.what()));
  }
  return p;
}

}  // namespace detail
}  // namespace torchpar
