#include "manager/shm_channel.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <random>

#include "core/cpu_relax.h"
#include "core/liveness.h"
#include "shm/cleaner.h"
#include "torchpar/core/error.h"

namespace torchpar::detail {
namespace {

// The layout docs/wire_format.md gives.
static_assert(sizeof(ShmChannelLane) == 64);
static_assert(offsetof(ShmChannelHeader, lanes) == 64);
static_assert(sizeof(ShmChannelHeader) <= ShmChannel::kDataOffset);

std::atomic_ref<uint32_t> word(uint32_t& w) { return std::atomic_ref<uint32_t>(w); }
std::atomic_ref<uint64_t> word64(uint64_t& w) { return std::atomic_ref<uint64_t>(w); }

// Under this process's segment prefix: its cleaner (the one of file_system segments)
// unlinks the name if the process dies before unlink(), SIGKILL included.
std::string channel_name() {
  std::random_device rd;
  return fmt::format("/{}mgr{:08x}{:08x}{:08x}{:08x}", segment_prefix(::getpid()), rd(), rd(), rd(),
                     rd());
}

// Spin iterations between two looks at the clock.
constexpr int kSpinCheckEvery = 64;
// At most this many spin iterations, whatever the clock says (a clock that stalls).
constexpr int kMaxSpins = 1 << 16;

}  // namespace

ShmChannel::ShmChannel(ShmRegion region, std::string name, bool creator)
    : region_(std::move(region)),
      name_(std::move(name)),
      creator_(creator),
      unlinked_(!creator),
      out_(creator ? 0 : 1),
      in_(creator ? 1 : 0) {}

ShmChannel::~ShmChannel() { unlink(); }

std::unique_ptr<ShmChannel> ShmChannel::create() {
  ensure_cleaner();
  for (int attempt = 0;; ++attempt) {
    std::string name = channel_name();
    ShmRegion region;
    try {
      region = ShmRegion::create_named(name, kTotalBytes);
    } catch (const ShmError& e) {
      if (e.error_code() != EEXIST || attempt >= 10) throw;
      continue;  // 128 random bits collided: take others
    }
    auto* h = reinterpret_cast<ShmChannelHeader*>(region.data());
    h->data_bytes = kDataBytes;
    word64(h->magic).store(kMagic, std::memory_order_release);
    return std::unique_ptr<ShmChannel>(new ShmChannel(std::move(region), std::move(name), true));
  }
}

std::unique_ptr<ShmChannel> ShmChannel::open(const std::string& name) {
  if (name.rfind("/torchpar_", 0) != 0 || name.find("_mgr") == std::string::npos) {
    throw ProtocolError(fmt::format("'{}' is no manager call channel name", name));
  }
  ShmRegion region = ShmRegion::open_named(name, /*writable=*/true, kTotalBytes);
  auto* h = reinterpret_cast<ShmChannelHeader*>(region.data());
  if (word64(h->magic).load(std::memory_order_acquire) != kMagic ||
      word64(h->data_bytes).load(std::memory_order_relaxed) != kDataBytes) {
    throw ProtocolError(fmt::format("shared object {} is no manager call channel", name));
  }
  return std::unique_ptr<ShmChannel>(new ShmChannel(std::move(region), name, false));
}

void ShmChannel::unlink() noexcept {
  if (unlinked_) return;
  unlinked_ = true;
  ::shm_unlink(name_.c_str());
}

void ShmChannel::send(std::string_view bytes, Connection& socket) {
  ShmChannelLane& l = lane(out_);
  const bool fits = bytes.size() <= kDataBytes;
  if (fits && !bytes.empty()) std::memcpy(data(out_), bytes.data(), bytes.size());
  word64(l.length).store(fits ? bytes.size() : kOnSocket, std::memory_order_relaxed);
  // seq_cst on both sides (seq here, sleeping in the reader): either the reader sees the
  // new seq before it sleeps, or this sees it sleeping and wakes it.
  word(l.seq).fetch_add(1, std::memory_order_seq_cst);
  if (word(l.sleeping).load(std::memory_order_seq_cst) != 0) futex_wake_n(&l.seq, 1);
  if (!fits) socket.send_bytes(bytes);
}

void ShmChannel::wait_for_message(int fd, const Deadline& deadline) {
  ShmChannelLane& l = lane(in_);
  auto seq = word(l.seq);
  if (seq.load(std::memory_order_acquire) != seen_) return;
  const auto spin_until = SteadyClock::now() + kSpin;
  for (int i = 1; i <= kMaxSpins; ++i) {
    cpu_relax();
    if (seq.load(std::memory_order_acquire) != seen_) return;
    if (i % kSpinCheckEvery == 0 && SteadyClock::now() >= spin_until) break;
  }
  const auto slept_from = SteadyClock::now();
  auto sleeping = word(l.sleeping);
  for (;;) {
    const auto slice = SteadyClock::now() - slept_from < kShortSlicesFor ? kShortSlice : kLongSlice;
    sleeping.store(1, std::memory_order_seq_cst);
    if (seq.load(std::memory_order_seq_cst) == seen_) {
      futex_wait_until(&l.seq, seen_, deadline, slice);
    }
    sleeping.store(0, std::memory_order_relaxed);
    if (seq.load(std::memory_order_acquire) != seen_) return;
    if (socket_peer_gone(fd)) {
      // A message too big for the data area is announced here before its frame is sent,
      // so a readable socket may be that frame: the announcement is visible by now.
      if (seq.load(std::memory_order_acquire) != seen_) return;
      throw ClosedError("the peer of the call channel closed its connection");
    }
    if (past(deadline)) throw TimeoutError("no message on the call channel before the deadline");
  }
}

std::string ShmChannel::recv(Connection& socket, const Deadline& deadline,
                             size_t max_socket_bytes) {
  wait_for_message(socket.fileno(), deadline);
  ShmChannelLane& l = lane(in_);
  seen_ = word(l.seq).load(std::memory_order_acquire);
  const uint64_t length = word64(l.length).load(std::memory_order_relaxed);
  if (length == kOnSocket) {
    Timeout left = std::nullopt;
    if (deadline) {
      left = std::chrono::duration<double>(*deadline - SteadyClock::now());
      // recv_bytes takes <= 0 as "do not wait": the frame is already on its way.
      if (left->count() <= 0) left = std::chrono::duration<double>(1e-3);
    }
    return socket.recv_bytes(left, max_socket_bytes);
  }
  if (length > kDataBytes) {
    throw ProtocolError(fmt::format("call channel {}: message length {} over its data area of {}",
                                    name_, length, kDataBytes));
  }
  return std::string(data(in_), static_cast<size_t>(length));
}

}  // namespace torchpar::detail
