#pragma once
// The manager's same-host fast path: request and response bytes of one call connection
// travel through a shared-memory object instead of the socket, and each side spins for a
// few tens of microseconds before it sleeps on a futex, so a round trip costs no thread
// wake-up through the kernel's socket layer when both sides are busy.
// docs/manager.md ("Call channel"), docs/wire_format.md (kAttachChannel).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "core/futex.h"
#include "shm/region.h"
#include "torchpar/ipc/connection.h"

namespace torchpar::detail {

/// One direction of a ShmChannel (in shared memory; every field is accessed atomically).
struct ShmChannelLane {
  /// Bumped once per message, after its length and bytes are written (futex word).
  uint32_t seq;
  /// 1 while the reader sleeps on `seq` (the writer calls futex_wake only then).
  uint32_t sleeping;
  /// Bytes of the last message in the data area, or ShmChannel::kOnSocket.
  uint64_t length;
  char pad[48];  // one cache line per lane: the two sides write different lanes
};

/// The header at offset 0 of a channel's object; the data areas follow at
/// ShmChannel::kDataOffset (lane 0's) and kDataOffset + kDataBytes (lane 1's).
struct ShmChannelHeader {
  uint64_t magic;       // ShmChannel::kMagic, written by the creator
  uint64_t data_bytes;  // ShmChannel::kDataBytes
  char pad[48];
  ShmChannelLane lanes[2];  // [0]: creator -> opener (requests); [1]: opener -> creator
};

/// A two-way message channel between two processes of one host (or two threads), over one
/// named shared-memory object, paired with the stream socket the two already share: the
/// socket tells each side whether the other is still there, and carries the messages too
/// big for the data area.
///
/// Requires: one message in flight per direction (a side sends its next message only
///           after the peer answered the previous one, as requests and responses do);
///           one sending and one receiving thread per side.
/// Guarantees: a message of any size arrives whole and in order; a length in the shared
///           header larger than the data area (a corrupt or hostile peer) is a
///           ProtocolError, never a read out of bounds.
/// Lifetime: create() makes the object ("/torchpar_<pid>_<pid-ns>_mgr<32 random hex>", mode
///           0600: under the creator's file_system segment prefix, shm/cleaner.h);
///           the creator unlinks the name once the peer has opened it (unlink(), or its
///           destructor at the latest), and both keep their mapping until destroyed.
///           A creator SIGKILLed between create() and unlink() leaves the name to its
///           cleaner, which unlinks it when the creator is gone (create() starts it).
/// Safety:   not thread-safe beyond the Requires above.
class ShmChannel {
 public:
  static constexpr uint64_t kMagic = 0x3148434d52415054ULL;  // "TPARMCH1"
  /// Bytes a message may have to travel through shared memory; longer ones use the socket.
  static constexpr uint64_t kDataBytes = uint64_t{64} * 1024;
  static constexpr uint64_t kDataOffset = kPageSize;
  static constexpr uint64_t kTotalBytes = kDataOffset + 2 * kDataBytes;
  /// ShmChannelLane::length of a message that follows as one frame on the socket.
  static constexpr uint64_t kOnSocket = UINT64_MAX;
  /// How long a receiver spins before it sleeps.
  static constexpr std::chrono::microseconds kSpin{30};
  /// The longest futex sleep between two looks at the peer's socket during the first
  /// kShortSlicesFor of a wait, and after that (an idle connection wakes ~10 times a second).
  static constexpr std::chrono::milliseconds kShortSlice{10};
  static constexpr std::chrono::milliseconds kLongSlice{100};
  static constexpr std::chrono::seconds kShortSlicesFor{1};

  /// A new channel (this side writes lane 0). Errors: ShmError (no /dev/shm, no memory).
  static std::unique_ptr<ShmChannel> create();
  /// Opens the channel `name` made by a peer (this side writes lane 1).
  /// Errors: ShmError when it cannot be opened (another host, another user, gone) or is
  ///         smaller than kTotalBytes; ProtocolError when it is no channel (bad magic).
  static std::unique_ptr<ShmChannel> open(const std::string& name);

  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  const std::string& name() const { return name_; }
  /// Creator: removes the name (idempotent; errors ignored). Opener: nothing.
  void unlink() noexcept;

  /// Sends `bytes`: into the data area when it fits, else a kOnSocket marker and then one
  /// frame on `socket` (send_bytes; blocks until the kernel took it, as send_bytes).
  /// Errors: as Connection::send_bytes for the socket part.
  void send(std::string_view bytes, Connection& socket);

  /// Receives the peer's next message: spins for kSpin, then sleeps on the futex in
  /// slices, looking after each at `socket` (readable or hung up: the peer is gone, as it
  /// sends nothing there while the channel is in use) and at `deadline`.
  /// Units:  `max_socket_bytes`: the longest frame accepted on the socket.
  /// Errors: ClosedError when the peer is gone; TimeoutError past `deadline` (the
  ///         channel is then unusable: a late message would be read as the next one's);
  ///         ProtocolError for a length over kDataBytes (other than kOnSocket) or a
  ///         socket frame over `max_socket_bytes`; what Connection::recv_bytes raises.
  std::string recv(Connection& socket, const Deadline& deadline, size_t max_socket_bytes);

 private:
  ShmChannel(ShmRegion region, std::string name, bool creator);
  ShmChannelHeader* header() const { return &region_.as<ShmChannelHeader>(); }
  ShmChannelLane& lane(int i) const { return header()->lanes[i]; }
  char* data(int i) const { return region_.data() + kDataOffset + kDataBytes * i; }
  /// Returns once lane `in`'s seq differs from seen_; throws as recv.
  void wait_for_message(int fd, const Deadline& deadline);

  ShmRegion region_;
  std::string name_;
  bool creator_;
  bool unlinked_ = false;
  int out_;            // the lane this side writes
  int in_;             // the lane it reads
  uint32_t seen_ = 0;  // the in lane's seq of the last message read (a new object's is 0)
};

}  // namespace torchpar::detail
