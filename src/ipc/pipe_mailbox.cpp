#include "ipc/pipe_mailbox.h"

#include <linux/sockios.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "core/cpu_relax.h"
#include "shm/segment.h"
#include "torchpar/core/error.h"
#include "torchpar/ipc/detail/shared_page.h"

namespace torchpar::detail {
namespace {

// The state word of a direction: mode (3 bits), senders on the socket now (13 bits), sends
// on the socket completed (48 bits, wrapping).
constexpr uint64_t kModeMask = 7;
constexpr uint64_t kIdle = 0;       // nobody announced
constexpr uint64_t kSpinning = 1;   // a reader waits in recv for the slot
constexpr uint64_t kClaimed = 2;    // a sender is writing the slot for that reader
constexpr uint64_t kPublished = 3;  // the slot holds a message
constexpr uint64_t kTaking = 4;     // a reader is copying it out
constexpr uint64_t kInflightOne = uint64_t{1} << 3;
constexpr uint64_t kInflightMask = ((uint64_t{1} << 13) - 1) << 3;
constexpr uint64_t kSentOne = uint64_t{1} << 16;

constexpr size_t kControlStride = 128;  // a direction's control line, and one apart
constexpr size_t kDataOffset = 4096;
constexpr size_t kPageBytes = kDataOffset + 2 * PipeMailbox::kBytes;

// Looks at the state word between two clock reads, between two yields of the core (so that a
// sender sharing this core runs: more runnable processes than cores), and the time between
// two peeks at the socket (a sender without the mailbox writes there).
constexpr int kLooksPerClock = 16;
constexpr int kLooksPerYield = 64;
constexpr auto kPeekEvery = std::chrono::microseconds(2);

struct alignas(64) Control {
  std::atomic<uint64_t> state;
  std::atomic<uint32_t> length;
  std::atomic<int32_t> claimer;  // pid of the sender that claimed the slot (0: not yet known)
};
static_assert(sizeof(Control) <= kControlStride);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

Control& ctl(void* p) { return *static_cast<Control*>(p); }
uint64_t mode(uint64_t v) { return v & kModeMask; }
uint64_t with_mode(uint64_t v, uint64_t m) { return (v & ~kModeMask) | m; }

// Moves the word from mode `from` to `to`, keeping its counters; false when it is not in
// `from` (any more).
bool move(Control& c, uint64_t from, uint64_t to) {
  uint64_t v = c.state.load(std::memory_order_relaxed);
  while (mode(v) == from) {
    if (c.state.compare_exchange_weak(v, with_mode(v, to), std::memory_order_acq_rel,
                                      std::memory_order_relaxed))
      return true;
  }
  return false;
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
// without a mailbox) has been read by the peer: SIOCOUTQ of a Unix socket counts the bytes
// of the records it sent that the receiver has not consumed yet.
bool all_sent_read(int sock) {
  int queued = 0;
  return ::ioctl(sock, SIOCOUTQ, &queued) == 0 && queued == 0;
}

bool process_dead(int32_t pid) { return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH; }

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
  Control& c = ctl(write_ctl_);
  uint64_t v = c.state.load(std::memory_order_relaxed);
  // A record of an earlier send (this end's, or of a copy of it without the mailbox) still
  // unread: this message goes after it, on the socket.
  if (mode(v) != kSpinning || !all_sent_read(sock)) return false;
  while (mode(v) == kSpinning) {
    if (!c.state.compare_exchange_weak(v, with_mode(v, kClaimed), std::memory_order_acquire,
                                       std::memory_order_relaxed))
      continue;
    c.claimer.store(cached_pid(), std::memory_order_relaxed);
    std::memcpy(write_data_, bytes.data(), bytes.size());
    c.length.store(static_cast<uint32_t>(bytes.size()), std::memory_order_relaxed);
    // Only this sender moves the word out of kClaimed (a reader frees it only once this
    // process is dead); the counters may move meanwhile.
    v = c.state.load(std::memory_order_relaxed);
    while (!c.state.compare_exchange_weak(v, with_mode(v, kPublished), std::memory_order_release,
                                          std::memory_order_relaxed)) {
    }
    return true;
  }
  return false;
}

PipeMailbox::SocketSend::SocketSend(PipeMailbox* box) : box_(box) {
  if (box_ == nullptr) return;
  Control& c = ctl(box_->write_ctl_);
  uint64_t v = c.state.load(std::memory_order_relaxed);
  for (;;) {
    uint64_t next = v + kInflightOne;
    if (mode(v) == kSpinning) next = with_mode(next, kIdle);  // its reader goes to the socket
    if (c.state.compare_exchange_weak(v, next, std::memory_order_acq_rel,
                                      std::memory_order_relaxed))
      return;
  }
}

PipeMailbox::SocketSend::~SocketSend() {
  if (box_ == nullptr) return;
  // One sender fewer on the socket, one send more completed (the fields do not carry into
  // each other: this sender is counted).
  ctl(box_->write_ctl_).state.fetch_add(kSentOne - kInflightOne, std::memory_order_acq_rel);
}

bool PipeMailbox::published() const {
  return mode(ctl(read_ctl_).state.load(std::memory_order_acquire)) == kPublished;
}

std::optional<std::string> PipeMailbox::take(uint64_t seen) {
  Control& c = ctl(read_ctl_);
  if (mode(seen) != kPublished ||
      !c.state.compare_exchange_strong(seen, with_mode(seen, kTaking), std::memory_order_acquire,
                                       std::memory_order_relaxed))
    return std::nullopt;  // another reader took it
  const uint32_t n = c.length.load(std::memory_order_relaxed);
  std::optional<std::string> out;
  if (n <= kBytes) out.emplace(read_data_, n);
  move(c, kTaking, kIdle);
  if (!out) {
    throw ProtocolError(fmt::format(
        "Connection: the Pipe's mailbox says its message holds {} bytes (at most {})", n, kBytes));
  }
  return out;
}

PipeMailbox::Received PipeMailbox::wait_claimed(const Deadline& deadline) {
  // A sender is copying the bytes: microseconds, unless it was stopped or killed meanwhile.
  Control& c = ctl(read_ctl_);
  auto nap = std::chrono::microseconds(20);
  for (int looks = 0;; ++looks) {
    const uint64_t v = c.state.load(std::memory_order_acquire);
    if (mode(v) == kPublished) {
      if (auto s = take(v)) return {std::move(s), false};
      return {std::nullopt, true};
    }
    if (mode(v) != kClaimed) return {std::nullopt, true};
    if (looks < 4096) {
      cpu_relax();
      if (looks % kLooksPerYield == kLooksPerYield - 1) ::sched_yield();
      continue;
    }
    if (process_dead(c.claimer.load(std::memory_order_relaxed))) {
      move(c, kClaimed, kIdle);  // its message never came; the socket is the channel again
      return {std::nullopt, false};
    }
    if (deadline.expired()) {
      throw TimeoutError(
          "Connection::recv: the sender that took this message's way through shared memory "
          "did not finish writing it within the timeout (the next recv gets it)");
    }
    struct timespec ts {
      0, static_cast<long>(std::chrono::nanoseconds(nap).count())
    };
    ::nanosleep(&ts, nullptr);
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
  }
}

PipeMailbox::Received PipeMailbox::receive(int sock, const Deadline& deadline,
                                           std::chrono::microseconds spin) {
  Control& c = ctl(read_ctl_);
  // Announce, unless a message or a sender is on the way through the socket.
  for (;;) {
    uint64_t v = c.state.load(std::memory_order_acquire);
    if (mode(v) == kPublished) {
      if (auto s = take(v)) return {std::move(s), false};
      continue;
    }
    // Another reader announced, or a sender is on the socket: read there.
    if (mode(v) != kIdle || (v & kInflightMask) != 0) return {std::nullopt, true};
    if (deadline.expired() || spin.count() <= 0) return {std::nullopt, true};
    // Peek unless the socket was found empty since the last send through it of an end with
    // the mailbox (the usual case in a ping-pong: a system call saved). Order does not depend
    // on it (senders deliver only once the socket is empty), only how soon a record is read.
    const bool peeked = (v >> 16) != last_empty_.load(std::memory_order_relaxed);
    if (peeked && socket_has_data(sock)) return {std::nullopt, true};
    if (c.state.compare_exchange_strong(v, with_mode(v, kSpinning), std::memory_order_acq_rel,
                                        std::memory_order_relaxed)) {
      if (peeked) last_empty_.store(v >> 16, std::memory_order_relaxed);
      break;
    }
  }
  const auto start = SteadyClock::now();
  const auto until = std::min(start + spin, deadline.at());
  auto next_peek = start + kPeekEvery;
  for (int looks = 1;; ++looks) {
    const uint64_t v = c.state.load(std::memory_order_acquire);
    switch (mode(v)) {
      case kSpinning:
        break;
      case kClaimed:
        return wait_claimed(deadline);
      case kPublished:
        if (auto s = take(v)) return {std::move(s), false};
        return {std::nullopt, true};
      default:  // a sender went to the socket (kIdle), or another reader is taking
        return {std::nullopt, true};
    }
    if (looks % kLooksPerClock == 0) {
      const auto now = SteadyClock::now();
      const bool over = now >= until;
      const bool socket = !over && now >= next_peek && socket_has_data(sock);
      if (now >= next_peek) next_peek = now + kPeekEvery;
      if (over || socket) {
        // Withdraw; a sender that claimed meanwhile is waited for (its message is first).
        if (move(c, kSpinning, kIdle)) return {std::nullopt, socket};
        continue;
      }
    }
    if (looks % kLooksPerYield == 0) {
      ::sched_yield();
    } else {
      cpu_relax();
    }
  }
}

}  // namespace torchpar::detail
