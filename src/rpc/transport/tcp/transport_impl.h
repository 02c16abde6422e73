#pragma once
// The TCP implementation of the RPC transport (factory.h); split in
// listener.cpp (listening, handshakes both ways, close) and connection.cpp (an authenticated
// connection: its reader, its writer, send). Wire format:
// docs/wire_format.md, "RPC transport" (TCP).
//
// Threads: threads per connection, no epoll loop (a member holds one connection per peer it
// talks to; blocking reads keep each connection's code straight-line).
//   - The accept thread polls the listening socket and an eventfd that close() writes. Each
//     accepted socket gets its handshake thread at once. At most kMaxPendingHandshakes
//     accepted sockets are strangers (have not proven the key yet, which a member does within
//     a round trip of its challenge): a newcomer beyond that evicts the oldest stranger (shut
//     down, its thread returns); beyond kMaxHandshakeThreads the newcomer is closed unheard.
//     Dialers whose handshake was closed so try again. A silent stranger holds a slot for at
//     most kAcceptedHandshakeTimeout and cannot keep a member out.
//   - A connection thread runs the handshake, then reads that connection's frames until EOF,
//     an error, a protocol violation or close(). With inline_handlers it runs on_message
//     itself, in order; otherwise it hands each message to the dispatch thread (support.h),
//     which runs the handlers one at a time, in order. on_peer_lost always runs on the
//     dispatch thread.
//   - A sender connects (a non-blocking connect polled together with the eventfd) and
//     handshakes on its own thread, bounded by its deadline; a handshake the member closes
//     before it ends (over its pending bound) is tried again until the deadline. Then it starts
//     the new connection's reader thread. It writes what the socket takes at once (sendmsg,
//     MSG_DONTWAIT, over iovecs that point at the message's own bytes) and queues the rest
//     for the connection's writer thread (started the first time a message has to wait), so a
//     send never waits for the peer to read: a stopped peer stalls the writer, not the caller.
//   - The writer thread writes queued messages in order; one whose write has not begun by its
//     deadline is dropped (the caller's timeout reports it). A socket that takes no byte for
//     kWriteStallLimit while messages wait ends the connection (on_peer_lost).
//   - close() marks the transport closed and shuts down every socket (shutdown(2) wakes
//     blocked reads, writes and handshakes without freeing a descriptor number that a thread
//     still uses), stops the writers, writes the eventfd, waits for send calls to leave, then
//     joins the accept thread, every connection thread and the dispatch thread.
// Sockets are blocking (a reader waits in recv); handshakes and writes wait with poll and
// MSG_DONTWAIT until their deadline. Waiting for the next frame has no deadline: an idle
// connection is normal, and close() or the peer ends it.
//
// One mutex, mutex_ (support.h's ConnectionTable), guards the tables (members, connections'
// `dead`, sockets in their handshake, counters); no call that blocks runs under it. Each
// connection's write queue has its own mutex, Conn::wmu, taken after mutex_ when both are
// held (never the other way round). Senders to one member are serialized by its `busy` flag
// (run_send), held while a sender connects, writes what the socket takes, and queues the rest.

#include "rpc/transport/tcp/factory.h"

#include <arpa/inet.h>
#include <c10/core/CPUAllocator.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "core/socket_address.h"
#include "rpc/transport/support.h"
#include "torchpar/core/auth.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"

namespace torchpar::rpc::tcp {

using Clock = std::chrono::steady_clock;
using detail::kMaxPendingHandshakes;
using detail::log_line;
using detail::printable;
using detail::seconds;
using torchpar::detail::SocketAddress;

inline constexpr int kBacklog = 128;
/// The fixed part of a frame: magic, header bytes (u32), body bytes (u64), storages (u32),
/// reserved (u32, 0); all little-endian. The storages' lengths (u64 each) follow.
inline constexpr size_t kFixedBytes = 24;
inline constexpr char kMagic[4] = {'R', 'P', 'C', '1'};
/// How long the accept thread rests after accept4 failed for want of descriptors or memory.
inline constexpr int kAcceptBackoffMs = 100;
/// Longest an accepted connection may take to prove the key (options.handshake_timeout when
/// shorter): a silent stranger holds a handshake slot no longer.
inline constexpr auto kAcceptedHandshakeTimeout = std::chrono::seconds(5);
/// Accepted-handshake threads at most, evicted ones that have not returned yet included
/// (beyond it, newcomers are closed unheard and their dialers try again).
inline constexpr int kMaxHandshakeThreads = 2 * kMaxPendingHandshakes;
/// A dialer whose handshake the member closed unheard tries again after this, doubling up to
/// kRetryMax, until its deadline.
inline constexpr auto kRetryFirst = std::chrono::milliseconds(10);
inline constexpr auto kRetryMax = std::chrono::milliseconds(200);
/// A connection whose socket takes no byte for this long while messages wait for it ends.
inline constexpr auto kWriteStallLimit = std::chrono::seconds(30);
/// How often a stalled writer drops queued messages whose deadline passed (their storages).
inline constexpr auto kPruneEvery = std::chrono::milliseconds(500);
/// How often the accept thread reports evicted and refused handshakes at most.
inline constexpr auto kReportEvery = std::chrono::seconds(10);

inline void put_le(unsigned char* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

inline uint64_t get_le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

/// Milliseconds for poll until `deadline` (rounded up; -1 for time_point::max()).
inline int poll_ms(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return -1;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT_MAX));
}

/// One message on its way out: the frame's fixed part and the iovecs still to write, which
/// point into `msg` (heap-allocated, so they stay valid while it waits in a queue).
struct Outgoing {
  Message msg;
  std::string head;  // magic, lengths, storage lengths
  std::vector<iovec> iov;
  size_t next = 0;       // the first iovec not wholly written
  bool started = false;  // some bytes are out: the rest must follow or the stream is broken
  Clock::time_point deadline;
};

/// One connection of an authenticated member (made by this side or accepted).
struct Conn {
  UniqueFd fd;
  std::string peer;   // the member's name
  std::string where;  // its socket address, for messages
  bool dead = false;  // guarded by the transport's mutex_: lost (reported once) or closing

  // The write side (guarded by wmu; mutex_ may be held when taking it, never the reverse).
  std::mutex wmu;
  std::condition_variable wcv;                  // queue, writing or stop changed
  std::deque<std::unique_ptr<Outgoing>> queue;  // in send order, after what is being written
  bool writing = false;                         // a thread is writing to the socket
  bool writer = false;                          // the writer thread was started
  bool stop = false;                            // lost or closing: nothing more is written

  // The read side: bytes read ahead of the current frame (one recv takes what is there, so a
  // small message costs one system call). Used only by the connection's current reader.
  std::vector<char> rbuf;
  size_t rpos = 0, rend = 0;
  // Which reader thread reads (its generation) and since when it runs an inline handler of a
  // may_block message (time_point::max(): none); guarded by rmu.
  std::mutex rmu;
  uint64_t reader_gen = 0;
  Clock::time_point handler_since = Clock::time_point::max();
};

/// Writes what `fd` takes of `out` now, without waiting. Returns whether all of it is out;
/// sets `*moved` when some bytes went out.
/// Errors: ClosedError when the connection ended (EPIPE, ECONNRESET); SystemError.
bool write_some(int fd, Outgoing& out, const std::string& where, bool* moved = nullptr);

/// Moves the queued messages of `conn` whose write has not begun and whose deadline passed
/// into `dropped` (destroyed by the caller, unlocked). Requires conn.wmu held.
void prune_locked(Conn& conn, Clock::time_point now,
                  std::vector<std::unique_ptr<Outgoing>>& dropped);

/// Whether readers block without spinning for now: a recent spin lost its core for long
/// (connection.cpp, kPreempted). Thread-safe.
bool spin_backed_off();

class TcpTransport final : public Transport, private detail::ConnectionTable<Conn> {
 public:
  TcpTransport(TransportOptions options, TransportHandlers handlers);
  ~TcpTransport() override;

  std::string address() const override { return address_; }
  void send(const std::string& peer, const std::string& address, Message msg,
            Clock::time_point deadline) override;
  void close() override;
  bool reader_spins() const override { return read_spin_.count() > 0 && !spin_backed_off(); }

 private:
  /// A socket in its handshake, registered so that close() can shut it down; unregistered
  /// when this goes out of scope, which must happen before the socket closes.
  struct Tracked {
    TcpTransport* self;
    int fd;
    ~Tracked() {
      std::lock_guard<std::mutex> lock(self->mutex_);
      self->handshaking_.erase(fd);
    }
  };

  void close_now();

  // Listening.
  void accept_loop();
  void start_handshake(UniqueFd fd);
  void serve_accepted(UniqueFd fd);
  /// Takes accepted socket `fd` out of accepting_; false when it was evicted meanwhile.
  /// Requires mutex_ held.
  bool leave_accepting_locked(int fd);

  // Connections.
  UniqueFd open_connection(const SocketAddress& to, Clock::time_point deadline);
  std::shared_ptr<Conn> connect(const std::string& peer, const std::string& address,
                                Clock::time_point deadline);
  bool track(int fd);  // false once closed
  /// Files `fd` (moved from only on success) as a connection of `peer`; nullptr once closed.
  std::shared_ptr<Conn> add_conn(UniqueFd& fd, const std::string& peer, const std::string& where);
  void lose(const std::shared_ptr<Conn>& conn, const std::string& why);
  /// Stops the writer of `conn` (it drops what is queued). Never throws.
  static void stop_writer(Conn& conn) noexcept;

  // Messages.
  /// Reads and delivers the messages of `conn` while its reader generation is `gen`.
  void read_loop(const std::shared_ptr<Conn>& conn, uint64_t gen = 0);
  Message read_message(Conn& conn) const;
  /// Starts a new reader for `conn` when reader `gen` still runs an inline handler (it stops
  /// reading after it). Never throws (no thread: the connection is lost).
  void rescue(const std::shared_ptr<Conn>& conn, uint64_t gen) noexcept;
  /// The rescue thread: gives a connection whose inline handler ran kReaderRescueAfter
  /// another reader; ticks only while handlers run, sleeps otherwise.
  void watch_loop();
  /// A reader enters an inline handler: wakes the rescue thread when it sleeps.
  void note_handler();
  /// Writes what the socket takes of `out` now and queues the rest for the writer thread.
  void write(const std::shared_ptr<Conn>& conn, std::unique_ptr<Outgoing> out);
  void write_loop(const std::shared_ptr<Conn>& conn);
  /// The writer thread's write of `out`: false when it was dropped, not begun, at its deadline.
  /// Errors: ClosedError, SystemError; TimeoutError after kWriteStallLimit without progress
  /// (`progress` is when the socket last took bytes, updated).
  bool finish(Conn& conn, Outgoing& out, Clock::time_point& progress);

  const TransportOptions options_;
  /// How long a reader spins for a frame's start (TORCHPAR_RPC_READ_SPIN_US; connection.cpp).
  const std::chrono::microseconds read_spin_;
  std::string address_;  // "tcp://ip:port"
  UniqueFd listen_fd_;
  UniqueFd wake_;  // eventfd, written once by close(): wakes the accept thread and connects

  std::once_flag close_once_;
  /// An accepted socket in its handshake (guarded by mutex_, as the rest of this block).
  struct Accepting {
    int fd;
    Clock::time_point since;
  };
  /// Accepted sockets whose peer has not proven the key yet, oldest first (evicted ones are
  /// taken out).
  std::list<Accepting> accepting_;
  /// Accepted-handshake threads that have not left accepting_'s part of the handshake.
  int handshake_threads_ = 0;
  /// Evicted and refused newcomers since the last report, and when that was.
  size_t evicted_ = 0, refused_ = 0;
  Clock::time_point reported_{};
  /// Dialed sockets in their handshake, and proven accepted ones finishing it (Tracked).
  std::set<int> handshaking_;

  detail::Dispatcher dispatcher_;
  detail::TaskThreads threads_;  // connection threads
  std::thread accept_thread_;

  // The rescue thread (watch_loop) and what it watches; guarded by watch_mu_.
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watch_stop_ = false;
  std::vector<std::weak_ptr<Conn>> watched_;  // connections that have had a reader
  std::atomic<uint64_t> handlers_entered_{0};
  std::atomic<bool> watch_sleeping_{false};
  std::thread watch_thread_;
};

}  // namespace torchpar::rpc::tcp
