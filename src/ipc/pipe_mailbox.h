#pragma once
// PipeMailbox: the shared-memory path of a Pipe's small messages, for a reader that is
// already waiting.
//
// A Pipe's socket stays the channel: every message goes there, except one that finds its
// reader spinning in recv. Such a reader has announced itself in its direction's state word
// (kSpinning); a sender of a message without fds of at most kBytes claims the word, writes
// the bytes into the direction's slot and publishes them, and the reader takes them: no
// system call on either side (a round trip over the socket is two sendmsg and two recvmsg,
// ~3.7 us of kernel time on these VMs; the Queue's, without them, ~2 us).
//
// What stays true:
//   - Order: a sender delivers through the slot only when every record sent from its socket
//     has been read (SIOCOUTQ is 0: this covers copies of the end without the mailbox, and
//     other processes' copies), so a message never overtakes an earlier one sent through the
//     same socket by the same thread; and a reader takes a message in the slot before it
//     reads the socket (whatever is there came after it, or from a concurrent sender). A
//     sender that goes to the socket while a reader is announced takes the announcement back,
//     and the reader returns to the socket at once.
//   - poll / select on fileno(): a message is put in the slot only for a reader inside recv
//     that announced itself, and that reader takes it: if its timeout passes while the
//     sender is between claim and publish, the claim is marked orphaned and the sender sends
//     the message on the socket instead. Only a reader killed while announced can leave a
//     message in the slot: Connection::poll and the next recv of any copy of the end find
//     it (a reader that waits on the socket looks at the slot every 10 ms and frees a dead
//     process's mark), a select on fileno() does not.
//   - Ends without the mailbox (an end rebuilt from its fd alone, Python's reduction of a
//     socket) still work: they never announce, so senders use the socket; and a reader with
//     the mailbox peeks at the socket while it spins, so their messages are not held back.
//   - Faults: every wait honours its deadline; the word names the process that set its mode
//     (spinner, claimer, taker), and a mark of a dead process (exited or a zombie) is
//     cleared by the next reader that looks; a sender publishes only its own claim; a reader
//     waiting for a stopped claimer stops waiting when the socket has a record (the claim is
//     orphaned). A sender killed inside its sendmsg leaves the count of senders on the socket
//     raised for good: readers of that direction then never announce (the socket carries
//     everything, as without the mailbox).
//
// The state word of a direction: mode (3 bits: idle, spinning, claimed, published, taking,
// orphaned), senders on the socket now (9 bits), the pid of the process that set the mode
// (22 bits: Linux's pid_max is at most 2^22), sends on the socket completed (30 bits,
// wrapping; compared for equality only).
//
// Layout (one sealed memfd, 36 KiB): a control line per direction at offsets 0 and 128
// (state word, length, claimer's pid), the slots' bytes at 4096 and 4096 + 16384. End `side`
// reads direction `side` and writes direction 1 - side.
//
// Safety: thread- and process-safe (the state word is the only synchronisation).
// Internal: not public API.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "core/deadline.h"
#include "torchpar/core/fd.h"

namespace torchpar::detail {

class SharedPage;

class PipeMailbox {
 public:
  /// The largest message that goes through the slot (a socket record's first part too).
  static constexpr size_t kBytes = 16384;

  /// The two ends' views of a new mailbox: the first is side 0, the second side 1.
  /// Throws ShmError.
  static std::pair<std::shared_ptr<PipeMailbox>, std::shared_ptr<PipeMailbox>> create_pair();
  /// The view of side `side` (0 or 1) of the mailbox behind `fd` (from a payload).
  /// Throws SerializationError for a bad side, ShmError for an fd that is no such mailbox.
  static std::shared_ptr<PipeMailbox> open(UniqueFd fd, int side);

  int fd() const;
  int side() const { return side_; }

  /// Sender: hands `bytes` to a reader of the other side that waits in recv; false (nothing
  /// done) when none waits, a record sent from `sock` (this end's socket) is still unread,
  /// or the message is too long: send it on the socket then.
  bool try_deliver(int sock, std::string_view bytes);

  /// Sender: marks a send on the socket for its duration (readers do not announce
  /// themselves meanwhile, and one announced returns to the socket).
  class SocketSend {
   public:
    explicit SocketSend(PipeMailbox* box);
    ~SocketSend();
    SocketSend(const SocketSend&) = delete;
    SocketSend& operator=(const SocketSend&) = delete;

   private:
    PipeMailbox* box_;
    bool counted_ = false;
  };

  /// Reader: waits until a message is in the slot (returned) or the socket `sock` holds
  /// something, its end or an error (nullopt: read the socket now). Spins for up to `spin`
  /// (announced on the word when it can, so that a sender delivers through the slot; else
  /// peeking at the socket), then sleeps in poll on the socket, looking at the slot every
  /// 10 ms. Errors: TimeoutError when `deadline` passes first (nothing consumed);
  /// ProtocolError for a slot whose length is out of range (a corrupted mailbox; the slot
  /// is freed).
  std::optional<std::string> receive(int sock, const Deadline& deadline,
                                     std::chrono::microseconds spin);

  /// The state word's layout, for tests: mode values and field positions.
  struct Word {
    static constexpr uint64_t kIdle = 0, kSpinning = 1, kClaimed = 2, kPublished = 3, kTaking = 4,
                              kOrphaned = 5, kModeMask = 7;
    static constexpr int kPidShift = 12;
    static constexpr uint64_t kPidMask = ((uint64_t{1} << 22) - 1) << kPidShift;
    static constexpr uint64_t make(uint64_t v, uint64_t mode, int32_t pid) {
      return (v & ~(kModeMask | kPidMask)) | mode | (static_cast<uint64_t>(pid) << kPidShift);
    }
  };

  /// True when a message waits in the slot this side reads.
  bool published() const;
  /// Connection::poll: true when a message waits in the slot or the socket `sock` is
  /// readable (data, its end, an error) before `deadline`; sleeps in poll in 10 ms slices,
  /// looking at the slot between them. Errors: SystemError from poll.
  bool poll(int sock, const Deadline& deadline);
  /// Messages this process delivered through a mailbox (for tests).
  static uint64_t deliveries();

 private:
  PipeMailbox(std::shared_ptr<SharedPage> page, int side);
  std::optional<std::string> take(uint64_t seen);
  std::optional<std::string> wait_claimed(int sock, const Deadline& deadline);
  std::optional<std::string> sleep_on_socket(int sock, const Deadline& deadline);

  std::shared_ptr<SharedPage> page_;
  int side_;
  void* read_ctl_;
  void* write_ctl_;
  char* read_data_;
  char* write_data_;
  /// The count of completed socket sends (the state word's top 30 bits) when this side last
  /// found its socket empty.
  std::atomic<uint64_t> last_empty_{~uint64_t{0}};
};

}  // namespace torchpar::detail
