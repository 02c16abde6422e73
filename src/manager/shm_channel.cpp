#include "manager/shm_channel.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <random>

#include "core/liveness.h"
#include "core/waiter.h"
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
  // Owned by our cleaner: the name goes with this process, however it exits.
  ShmRegion region = ShmRegion::create_owned(kTotalBytes, channel_name);
  auto& h = region.as<ShmChannelHeader>();
  h.data_bytes = kDataBytes;
  word64(h.magic).store(kMagic, std::memory_order_release);
  std::string name = region.name();
  return std::unique_ptr<ShmChannel>(new ShmChannel(std::move(region), std::move(name), true));
}

std::unique_ptr<ShmChannel> ShmChannel::open(const std::string& name) {
  if (name.rfind("/torchpar_", 0) != 0 || name.find("_mgr") == std::string::npos) {
    throw ProtocolError(fmt::format("'{}' is no manager call channel name", name));
  }
  ShmRegion region = ShmRegion::open_named(name, /*writable=*/true, kTotalBytes);
  auto& h = region.as<ShmChannelHeader>();
  if (word64(h.magic).load(std::memory_order_acquire) != kMagic ||
      word64(h.data_bytes).load(std::memory_order_relaxed) != kDataBytes) {
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
  const auto arrived = [seen = seen_](uint32_t seq) { return seq != seen; };
  if (arrived(word(l.seq).load(std::memory_order_acquire))) return;
  const WaitOptions o{
      .spin = {.looks = kMaxSpins, .budget = kSpin},
      .sleep = {.slice = kLongSlice, .short_slice = kShortSlice, .short_for = kShortSlicesFor},
      .sleeper = SleeperMark::flag(&l.sleeping),
      .what = "message on the call channel"};
  // The peer sends nothing on the socket while the channel is in use, except a message too
  // big for the data area, which is announced in seq before its frame is sent: the waiter
  // looks at seq once more before it reports the peer gone.
  if (wait_until(&l.seq, arrived, deadline, o, [fd] { return !socket_peer_gone(fd); }) ==
      WaitStatus::kGone) {
    throw ClosedError("the peer of the call channel closed its connection");
  }
}

std::string ShmChannel::recv(Connection& socket, const Deadline& deadline,
                             size_t max_socket_bytes) {
  wait_for_message(socket.fileno(), deadline);
  ShmChannelLane& l = lane(in_);
  seen_ = word(l.seq).load(std::memory_order_acquire);
  const uint64_t length = word64(l.length).load(std::memory_order_relaxed);
  if (length == kOnSocket) {
    Timeout left = deadline.remaining();
    // recv_bytes takes <= 0 as "do not wait": the frame is already on its way.
    if (left && left->count() <= 0) left = std::chrono::duration<double>(1e-3);
    return socket.recv_bytes(left, max_socket_bytes);
  }
  if (length > kDataBytes) {
    throw ProtocolError(fmt::format("call channel {}: message length {} over its data area of {}",
                                    name_, length, kDataBytes));
  }
  return std::string(data(in_), static_cast<size_t>(length));
}

}  // namespace torchpar::detail
