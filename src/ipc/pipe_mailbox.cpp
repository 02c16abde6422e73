#include "ipc/pipe_mailbox.h"

#include <linux/sockios.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "core/cpu_relax.h"
#include "core/liveness.h"
#include "shm/segment.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"
#include "torchpar/ipc/detail/shared_page.h"

namespace torchpar::detail {
namespace {

using W = PipeMailbox::Word;
constexpr uint64_t kModeMask = W::kModeMask;
constexpr uint64_t kInflightOne = uint64_t{1} << 3;
constexpr uint64_t kInflightMask = uint64_t{0x1FF} << 3;
constexpr int kSentShift = 34;
constexpr uint64_t kSentOne = uint64_t{1} << kSentShift;
constexpr int32_t kPidLimit = 1 << 22;

constexpr size_t kControlStride = 128;  // a direction's control line, and one apart
constexpr size_t kDataOffset = 4096;
constexpr size_t kPageBytes = kDataOffset + 2 * PipeMailbox::kBytes;

// Looks at the state word between two clock reads, between two yields of the core (so that a
// sender sharing this core runs: more runnable processes than cores); the time between two
// peeks at the socket while announced (a sender without the mailbox writes there) and while
// not; the longest sleep in poll before the slot is looked at again.
constexpr int kLooksPerClock = 16;
constexpr int kLooksPerYield = 64;
constexpr auto kPeekAnnounced = std::chrono::microseconds(2);
constexpr auto kPeekNotAnnounced = std::chrono::nanoseconds(500);
constexpr int kSliceMs = 10;

struct alignas(64) Control {
  std::atomic<uint64_t> state;
  std::atomic<uint32_t> length;
};
static_assert(sizeof(Control) <= kControlStride);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

Control& ctl(void* p) { return *static_cast<Control*>(p); }
uint64_t mode(uint64_t v) { return v & kModeMask; }
int32_t pid_of(uint64_t v) { return static_cast<int32_t>((v & W::kPidMask) >> W::kPidShift); }
uint64_t sent_of(uint64_t v) { return v >> kSentShift; }

// This process's pid when it fits the word (else the mailbox is not used by it).
int32_t my_pid() {
  const int32_t pid = cached_pid();
  return pid > 0 && pid < kPidLimit ? pid : 0;
}

// True when the socket holds something for a read (a record, the end, an error): the socket
// path then takes it. Consumes nothing.
bool socket_has_data(int sock) {
  char c = 0;
  const ssize_t n = ::recv(sock, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n >= 0) return true;
  return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

// True when every record sent from `sock` (through any fd of it, in any process, with or
// without a mailbox) has been read by the peer: SIOCOUTQ of a Unix socket counts the memory
// of the records it sent that the receiver has not consumed yet.
bool all_sent_read(int sock) {
  int queued = 0;
  return ::ioctl(sock, SIOCOUTQ, &queued) == 0 && queued == 0;
}

// Exited, a zombie included (its fds are closed, it will never move the word on).
bool process_dead(int32_t pid) { return pid > 0 && !pid_alive(pid); }

// Clears the mark of a dead process from the word (`v` as last seen): a spinner, claimer,
// taker or orphaned claimer that will never move it on. True when it did.
bool clear_dead_mark(Control& c, uint64_t v) {
  const uint64_t m = mode(v);
  if (m == W::kIdle || m == W::kPublished || !process_dead(pid_of(v))) return false;
  return c.state.compare_exchange_strong(v, W::make(v, W::kIdle, 0), std::memory_order_acq_rel,
                                         std::memory_order_relaxed);
}

// Marks the claim in `v` orphaned (its reader stops waiting for it; its sender, finding it
// so, sends the message on the socket). False when the claim is gone already.
bool orphan(Control& c, uint64_t v) {
  const int32_t claimer = pid_of(v);
  while (mode(v) == W::kClaimed && pid_of(v) == claimer) {
    if (c.state.compare_exchange_weak(v, W::make(v, W::kOrphaned, claimer),
                                      std::memory_order_acq_rel, std::memory_order_relaxed))
      return true;
  }
  return false;
}

std::atomic<uint64_t> g_deliveries{0};

void nap(std::chrono::microseconds d) {
  struct timespec ts {
    0, static_cast<long>(std::chrono::nanoseconds(d).count())
  };
  ::nanosleep(&ts, nullptr);
}

// One poll of `sock` for reading, for at most kSliceMs and never past `deadline` (0 once it
// passed); poll's result.
int poll_slice(int sock, const Deadline& deadline) {
  int ms = kSliceMs;
  if (deadline) {
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(*deadline - SteadyClock::now()).count();
    ms = static_cast<int>(std::clamp<int64_t>(left, 0, kSliceMs));
  }
  struct pollfd pfd {
    sock, POLLIN, 0
  };
  return ::poll(&pfd, 1, ms);
}

[[noreturn]] void timed_out() {
  throw TimeoutError("Connection::recv: no message before the deadline");
}

}  // namespace

PipeMailbox::PipeMailbox(std::shared_ptr<SharedPage> page, int side)
    : page_(std::move(page)), side_(side) {
  auto* base = static_cast<char*>(page_->data());
  read_ctl_ = base + static_cast<size_t>(side) * kControlStride;
  write_ctl_ = base + static_cast<size_t>(1 - side) * kControlStride;
  read_data_ = base + kDataOffset + static_cast<size_t>(side) * kBytes;
  write_data_ = base + kDataOffset + static_cast<size_t>(1 - side) * kBytes;
}

std::pair<std::shared_ptr<PipeMailbox>, std::shared_ptr<PipeMailbox>> PipeMailbox::create_pair() {
  auto page = SharedPage::create(kPageBytes, "Pipe mailbox");  // zero: both directions idle
  return {std::shared_ptr<PipeMailbox>(new PipeMailbox(page, 0)),
          std::shared_ptr<PipeMailbox>(new PipeMailbox(page, 1))};
}

std::shared_ptr<PipeMailbox> PipeMailbox::open(UniqueFd fd, int side) {
  if (side != 0 && side != 1)
    throw SerializationError(fmt::format("Connection: bad mailbox side {}", side));
  return std::shared_ptr<PipeMailbox>(
      new PipeMailbox(SharedPage::open(std::move(fd), kPageBytes), side));
}

int PipeMailbox::fd() const { return page_->fd(); }

bool PipeMailbox::try_deliver(int sock, std::string_view bytes) {
  if (bytes.size() > kBytes) return false;
  const int32_t me = my_pid();
  Control& c = ctl(write_ctl_);
  uint64_t v = c.state.load(std::memory_order_relaxed);
  // A record of an earlier send (this end's, or of a copy of it without the mailbox) still
  // unread: this message goes after it, on the socket.
  if (me == 0 || mode(v) != W::kSpinning || !all_sent_read(sock)) return false;
  for (;;) {
    if (mode(v) != W::kSpinning) return false;
    if (c.state.compare_exchange_weak(v, W::make(v, W::kClaimed, me), std::memory_order_acquire,
                                      std::memory_order_relaxed))
      break;
  }
  std::memcpy(write_data_, bytes.data(), bytes.size());
  c.length.store(static_cast<uint32_t>(bytes.size()), std::memory_order_relaxed);
  // Publish our claim; the counters may move meanwhile. A claim the reader orphaned (its
  // deadline passed) or cleared (it took this process for dead) publishes nothing: the
  // message goes on the socket.
  v = c.state.load(std::memory_order_relaxed);
  for (;;) {
    if (pid_of(v) != me) return false;
    if (mode(v) == W::kClaimed) {
      if (c.state.compare_exchange_weak(v, W::make(v, W::kPublished, me), std::memory_order_release,
                                        std::memory_order_relaxed)) {
        g_deliveries.fetch_add(1, std::memory_order_relaxed);
        return true;
      }
    } else if (mode(v) == W::kOrphaned) {
      // Release: the next claimer's writes of the slot come after ours.
      if (c.state.compare_exchange_weak(v, W::make(v, W::kIdle, 0), std::memory_order_release,
                                        std::memory_order_relaxed))
        return false;
    } else {
      return false;
    }
  }
}

PipeMailbox::SocketSend::SocketSend(PipeMailbox* box) : box_(box) {
  if (box_ == nullptr) return;
  Control& c = ctl(box_->write_ctl_);
  uint64_t v = c.state.load(std::memory_order_relaxed);
  for (;;) {
    if ((v & kInflightMask) == kInflightMask) return;  // 511 at once: this one goes uncounted
    uint64_t next = v + kInflightOne;
    if (mode(v) == W::kSpinning) next = W::make(next, W::kIdle, 0);  // its reader: the socket
    if (c.state.compare_exchange_weak(v, next, std::memory_order_acq_rel,
                                      std::memory_order_relaxed)) {
      counted_ = true;
      return;
    }
  }
}

PipeMailbox::SocketSend::~SocketSend() {
  if (box_ == nullptr) return;
  // One sender fewer on the socket, one send more completed (the fields do not carry into
  // each other: this sender is counted; the completed count wraps off the top).
  ctl(box_->write_ctl_)
      .state.fetch_add(counted_ ? kSentOne - kInflightOne : kSentOne, std::memory_order_acq_rel);
}

bool PipeMailbox::published() const {
  return mode(ctl(read_ctl_).state.load(std::memory_order_acquire)) == W::kPublished;
}

std::optional<std::string> PipeMailbox::take(uint64_t v) {
  Control& c = ctl(read_ctl_);
  const int32_t me = my_pid();
  for (;;) {
    if (mode(v) != W::kPublished) return std::nullopt;  // another reader took it
    if (c.state.compare_exchange_weak(v, W::make(v, W::kTaking, me), std::memory_order_acquire,
                                      std::memory_order_relaxed))
      break;
  }
  const uint32_t n = c.length.load(std::memory_order_relaxed);
  std::optional<std::string> out;
  if (n <= kBytes) out.emplace(read_data_, n);
  v = c.state.load(std::memory_order_relaxed);
  while (mode(v) == W::kTaking && pid_of(v) == me &&
         !c.state.compare_exchange_weak(v, W::make(v, W::kIdle, 0), std::memory_order_release,
                                        std::memory_order_relaxed)) {
  }
  if (!out) {
    throw ProtocolError(fmt::format(
        "Connection: the Pipe's mailbox says its message holds {} bytes (at most {})", n, kBytes));
  }
  return out;
}

uint64_t PipeMailbox::deliveries() { return g_deliveries.load(std::memory_order_relaxed); }

std::optional<std::string> PipeMailbox::wait_claimed(int sock, const Deadline& deadline) {
  // A sender is copying the bytes for us: microseconds, unless it was stopped or killed.
  Control& c = ctl(read_ctl_);
  auto sleep = std::chrono::microseconds(20);
  for (int looks = 1;; ++looks) {
    const uint64_t v = c.state.load(std::memory_order_acquire);
    if (mode(v) == W::kPublished) return take(v);
    if (mode(v) != W::kClaimed) return std::nullopt;  // cleared: wait on the socket
    const bool napping = looks >= 4096;
    if ((napping || looks % kLooksPerYield == 0) && deadline.expired()) {
      if (orphan(c, v)) timed_out();
      continue;
    }
    if (!napping) {
      if (looks % kLooksPerYield == 0) {
        ::sched_yield();
      } else {
        cpu_relax();
      }
      continue;
    }
    if (clear_dead_mark(c, v)) return std::nullopt;  // its message never comes
    // Records of other senders, or the end: not held up behind a stopped claimer.
    if (socket_has_data(sock)) {
      if (orphan(c, v)) return std::nullopt;
      continue;
    }
    nap(sleep);
    sleep = std::min(sleep * 2, std::chrono::microseconds(1000));
  }
}

std::optional<std::string> PipeMailbox::sleep_on_socket(int sock, const Deadline& deadline) {
  Control& c = ctl(read_ctl_);
  for (;;) {
    const uint64_t v = c.state.load(std::memory_order_acquire);
    if (mode(v) == W::kPublished) {
      if (auto s = take(v)) return s;
      continue;
    }
    clear_dead_mark(c, v);
    // Past the deadline: one look without waiting (a zero timeout tries once).
    const int r = poll_slice(sock, deadline);
    if (r < 0 && errno != EINTR) return std::nullopt;  // the socket read reports it
    if (r > 0) {
      // A message in the slot is older than what the socket holds (or concurrent).
      const uint64_t w = c.state.load(std::memory_order_acquire);
      if (mode(w) == W::kPublished) {
        if (auto s = take(w)) return s;
      }
      return std::nullopt;
    }
    if (deadline.expired()) {
      const uint64_t w = c.state.load(std::memory_order_acquire);
      if (mode(w) == W::kPublished) {
        if (auto s = take(w)) return s;
      }
      timed_out();
    }
  }
}

bool PipeMailbox::poll(int sock, const Deadline& deadline) {
  Control& c = ctl(read_ctl_);
  for (;;) {
    const uint64_t v = c.state.load(std::memory_order_acquire);
    if (mode(v) == W::kPublished) return true;
    clear_dead_mark(c, v);
    const int r = poll_slice(sock, deadline);
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) throw_system_error("poll", errno, "Connection");
    if (deadline.expired()) return published();
  }
}

std::optional<std::string> PipeMailbox::receive(int sock, const Deadline& deadline,
                                                std::chrono::microseconds spin) {
  Control& c = ctl(read_ctl_);
  const int32_t me = my_pid();
  const auto start = SteadyClock::now();
  const auto until = std::min(start + spin, deadline.at());
  bool announced = false;
  // The first peek: at once, unless the socket was found empty since the last completed
  // send through it of an end with the mailbox (the usual case in a ping-pong: a system
  // call saved). Order does not depend on it (senders deliver only once the socket is
  // empty), only how soon a record is read.
  const uint64_t v0 = c.state.load(std::memory_order_relaxed);
  auto next_peek =
      sent_of(v0) == last_empty_.load(std::memory_order_relaxed) && (v0 & kInflightMask) == 0
          ? start + kPeekAnnounced
          : start;
  // Withdraws an announcement; false when a sender changed the word first (look again).
  const auto withdraw = [&] {
    uint64_t v = c.state.load(std::memory_order_relaxed);
    while (mode(v) == W::kSpinning && pid_of(v) == me) {
      if (c.state.compare_exchange_weak(v, W::make(v, W::kIdle, 0), std::memory_order_acq_rel,
                                        std::memory_order_relaxed))
        return true;
    }
    return false;
  };
  for (int looks = 0;; ++looks) {
    const uint64_t v = c.state.load(std::memory_order_acquire);
    const uint64_t m = mode(v);
    if (m == W::kPublished) {
      if (auto s = take(v)) return s;
      continue;
    }
    if (announced && m == W::kClaimed) {
      if (auto s = wait_claimed(sock, deadline)) return s;
      return sleep_on_socket(sock, deadline);
    }
    // A sender went to the socket (or, two threads reading one end, the other withdrew us).
    if (announced && !(m == W::kSpinning && pid_of(v) == me)) announced = false;
    if (looks % kLooksPerClock == 0) {
      const auto now = SteadyClock::now();
      if (now >= until) {
        if (announced && !withdraw()) continue;  // claimed meanwhile: wait for it
        return sleep_on_socket(sock, deadline);
      }
      if (now >= next_peek) {
        next_peek =
            now + (announced ? std::chrono::nanoseconds(kPeekAnnounced) : kPeekNotAnnounced);
        if (socket_has_data(sock)) {
          if (announced && !withdraw()) continue;  // claimed meanwhile: its message is first
          // Not announced: a message put in the slot meanwhile (for a reader killed while
          // announced) is older than the record; and such a reader's mark is cleared.
          const uint64_t w = c.state.load(std::memory_order_acquire);
          if (mode(w) == W::kPublished) {
            if (auto s = take(w)) return s;
          }
          clear_dead_mark(c, w);
          return std::nullopt;
        }
        // Empty: announce now, unless a send on the socket is under way or another reader
        // is announced (then keep peeking). The word unchanged since before the peek.
        uint64_t expected = v;
        if (!announced && me != 0 && m == W::kIdle && (v & kInflightMask) == 0 &&
            c.state.compare_exchange_strong(expected, W::make(v, W::kSpinning, me),
                                            std::memory_order_acq_rel, std::memory_order_relaxed)) {
          announced = true;
          last_empty_.store(sent_of(v), std::memory_order_relaxed);
        }
        continue;
      }
    }
    if (!announced && me != 0 && m == W::kIdle && (v & kInflightMask) == 0 &&
        sent_of(v) == last_empty_.load(std::memory_order_relaxed)) {
      // Found empty since the last completed send: announce without a peek.
      uint64_t expected = v;
      if (c.state.compare_exchange_strong(expected, W::make(v, W::kSpinning, me),
                                          std::memory_order_acq_rel, std::memory_order_relaxed))
        announced = true;
      continue;
    }
    if (looks % kLooksPerYield == kLooksPerYield - 1) {
      ::sched_yield();
    } else {
      cpu_relax();
    }
  }
}

}  // namespace torchpar::detail
