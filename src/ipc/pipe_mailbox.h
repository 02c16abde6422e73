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
//     same socket by the same thread. A sender that goes to the socket while a reader is
//     announced takes the announcement back, and the reader returns to the socket at once.
//     A reader peeks at the socket before it announces itself (unless it found the socket
//     empty since the last completed send of an end with the mailbox: the state word counts
//     them) and every 2 us while it spins, so that a record is not left waiting.
//   - poll on fileno(): a message in the slot was claimed for a reader inside recv, which
//     takes it; only when that reader gave up (its timeout passed while the sender was
//     stopped between claim and publish, or it was killed) does a message wait in the slot,
//     where Connection::poll and the next recv of any copy of the end find it, but a select
//     on fileno() does not.
//   - Ends without the mailbox (an end rebuilt from its fd alone, Python's reduction of a
//     socket) still work: they never announce, so senders use the socket; and a reader with
//     the mailbox peeks at the socket while it spins, so their messages are not held back.
//   - Faults: a reader's wait on a claimed slot honours its deadline; a claimer found dead
//     (kill(pid, 0): ESRCH) frees the slot; a reader or sender killed mid-way leaves the
//     word in a state where later calls use the socket (degraded, not stuck).
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
  };

  /// Reader: what receive found.
  struct Received {
    std::optional<std::string> bytes;  ///< a message from the slot
    bool spin_on_socket = false;       ///< else: read the socket; spin first when true
  };
  /// Reader: takes a message waiting in the slot, or announces itself and spins until a
  /// sender delivers one, `spin` passes, the socket `sock` holds something, or a sender
  /// goes to the socket. Never past `deadline` (TimeoutError only when a sender claimed the
  /// slot and did not publish in time: its message waits for the next recv).
  /// Errors: ProtocolError for a slot whose length is out of range (a corrupted mailbox).
  Received receive(int sock, const Deadline& deadline, std::chrono::microseconds spin);

  /// True when a message waits in the slot this side reads (Connection::poll).
  bool published() const;

 private:
  PipeMailbox(std::shared_ptr<SharedPage> page, int side);
  std::optional<std::string> take(uint64_t seen);
  Received wait_claimed(const Deadline& deadline);

  std::shared_ptr<SharedPage> page_;
  int side_;
  void* read_ctl_;
  void* write_ctl_;
  char* read_data_;
  char* write_data_;
  /// The count of completed socket sends (the state word's top 48 bits) when this side last
  /// found its socket empty.
  std::atomic<uint64_t> last_empty_{~uint64_t{0}};
};

}  // namespace torchpar::detail
