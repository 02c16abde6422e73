// The TCP implementation of the RPC transport (tcp_transport.h). Wire format:
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

#include "dist/rpc/transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <c10/core/CPUAllocator.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
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

#include "dist/rpc/transport/support.h"
#include "ipc/socket_address.h"
#include "torchpar/core/auth.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"

namespace torchpar::rpc {
namespace {

using Clock = std::chrono::steady_clock;
using detail::kMaxPendingHandshakes;
using detail::log_line;
using detail::printable;
using detail::seconds;
using torchpar::detail::SocketAddress;

constexpr int kBacklog = 128;
/// The fixed part of a frame: magic, header bytes (u32), body bytes (u64), storages (u32),
/// reserved (u32, 0); all little-endian. The storages' lengths (u64 each) follow.
constexpr size_t kFixedBytes = 24;
constexpr char kMagic[4] = {'R', 'P', 'C', '1'};
/// How long the accept thread rests after accept4 failed for want of descriptors or memory.
constexpr int kAcceptBackoffMs = 100;
/// Longest an accepted connection may take to prove the key (options.handshake_timeout when
/// shorter): a silent stranger holds a handshake slot no longer.
constexpr auto kAcceptedHandshakeTimeout = std::chrono::seconds(5);
/// Accepted-handshake threads at most, evicted ones that have not returned yet included
/// (beyond it, newcomers are closed unheard and their dialers try again).
constexpr int kMaxHandshakeThreads = 2 * kMaxPendingHandshakes;
/// A dialer whose handshake the member closed unheard tries again after this, doubling up to
/// kRetryMax, until its deadline.
constexpr auto kRetryFirst = std::chrono::milliseconds(10);
constexpr auto kRetryMax = std::chrono::milliseconds(200);
/// A connection whose socket takes no byte for this long while messages wait for it ends.
constexpr auto kWriteStallLimit = std::chrono::seconds(30);
/// How often a stalled writer drops queued messages whose deadline passed (their storages).
constexpr auto kPruneEvery = std::chrono::milliseconds(500);
/// How often the accept thread reports evicted and refused handshakes at most.
constexpr auto kReportEvery = std::chrono::seconds(10);

void put_le(unsigned char* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

uint64_t get_le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

/// Milliseconds for poll until `deadline` (rounded up; -1 for time_point::max()).
int poll_ms(Clock::time_point deadline) {
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
};

/// Writes what `fd` takes of `out` now, without waiting. Returns whether all of it is out;
/// sets `*moved` when some bytes went out.
/// Errors: ClosedError when the connection ended (EPIPE, ECONNRESET); SystemError.
bool write_some(int fd, Outgoing& out, const std::string& where, bool* moved = nullptr) {
  while (out.next < out.iov.size()) {
    msghdr mh{};
    mh.msg_iov = out.iov.data() + out.next;
    mh.msg_iovlen = std::min<size_t>(out.iov.size() - out.next, IOV_MAX);
    const ssize_t w = ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      out.started = true;
      if (moved) *moved = true;
      for (auto left = static_cast<size_t>(w); left > 0;) {
        auto& v = out.iov[out.next];
        if (left >= v.iov_len) {
          left -= v.iov_len;
          ++out.next;
        } else {
          v.iov_base = static_cast<char*>(v.iov_base) + left;
          v.iov_len -= left;
          left = 0;
        }
      }
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w == 0 || errno == EAGAIN || errno == EWOULDBLOCK) return false;
    if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN) {
      throw ClosedError(fmt::format("the connection ended ({})", std::strerror(errno)));
    }
    torchpar::detail::throw_system_error("sendmsg", errno, where);
  }
  return true;
}

/// Moves the queued messages of `conn` whose write has not begun and whose deadline passed
/// into `dropped` (destroyed by the caller, unlocked). Requires conn.wmu held.
void prune_locked(Conn& conn, Clock::time_point now,
                  std::vector<std::unique_ptr<Outgoing>>& dropped) {
  for (auto it = conn.queue.begin(); it != conn.queue.end();) {
    if (!(*it)->started && (*it)->deadline <= now) {
      dropped.push_back(std::move(*it));
      it = conn.queue.erase(it);
    } else {
      ++it;
    }
  }
}

class TcpTransport final : public Transport, private detail::ConnectionTable<Conn> {
 public:
  TcpTransport(TransportOptions options, TransportHandlers handlers);
  ~TcpTransport() override;

  std::string address() const override { return address_; }
  void send(const std::string& peer, const std::string& address, Message msg,
            Clock::time_point deadline) override;
  void close() override;

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
  void read_loop(const std::shared_ptr<Conn>& conn);
  Message read_message(const Conn& conn) const;
  /// Writes what the socket takes of `out` now and queues the rest for the writer thread.
  void write(const std::shared_ptr<Conn>& conn, std::unique_ptr<Outgoing> out);
  void write_loop(const std::shared_ptr<Conn>& conn);
  /// The writer thread's write of `out`: false when it was dropped, not begun, at its deadline.
  /// Errors: ClosedError, SystemError; TimeoutError after kWriteStallLimit without progress
  /// (`progress` is when the socket last took bytes, updated).
  bool finish(Conn& conn, Outgoing& out, Clock::time_point& progress);

  const TransportOptions options_;
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
};

// ---- construction and close ----------------------------------------------------------------

TcpTransport::TcpTransport(TransportOptions options, TransportHandlers handlers)
    : options_(std::move(options)), dispatcher_(options_.name, std::move(handlers)) {
  detail::check_options(options_);
  std::string bound;
  dev_t device = 0;
  ino_t inode = 0;
  listen_fd_ = torchpar::detail::listen_on(detail::bind_address(options_), kBacklog, &bound,
                                           &device, &inode);
  address_ = "tcp://" + bound;
  wake_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_) torchpar::detail::throw_system_error("eventfd", errno, address_);
  try {
    dispatcher_.start();
    accept_thread_ = std::thread([this] { accept_loop(); });
  } catch (...) {
    close();  // joins what started; no destructor runs after a constructor throws
    throw;
  }
}

TcpTransport::~TcpTransport() {
  try {
    close();
  } catch (const std::exception& e) {
    log_line(fmt::format("rpc transport {}: close failed: {}", printable(options_.name), e.what()));
  }
}

void TcpTransport::close() {
  // A second caller waits until the first one is done: after close returns, no handler runs.
  std::call_once(close_once_, [this] { close_now(); });
}

void TcpTransport::close_now() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    close_locked([](Conn& c) {  // senders fail now, writers stop
      ::shutdown(c.fd.get(), SHUT_RDWR);
      stop_writer(c);
    });
    for (int fd : handshaking_) ::shutdown(fd, SHUT_RDWR);
    for (const auto& a : accepting_) ::shutdown(a.fd, SHUT_RDWR);
  }
  if (wake_) {
    const uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof one);
  }
  dispatcher_.stop();
  if (accept_thread_.joinable()) accept_thread_.join();
  const auto peers = drain_after_close();  // connections close when this goes, unlocked
  // No thread starts any more: the accept thread is gone and so are the senders.
  threads_.join_all();
  dispatcher_.join();
  listen_fd_.reset();
}

// ---- listening --------------------------------------------------------------------------------

void TcpTransport::accept_loop() {
  Clock::time_point complained{};
  for (;;) {
    pollfd p[2] = {{listen_fd_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    const int r = ::poll(p, 2, -1);  // until a peer connects or close() writes wake_
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      log_line(
          fmt::format("rpc transport {}: poll on {} failed ({}): no member can connect to "
                      "this one any more",
                      printable(options_.name), address_, std::strerror(errno)));
      return;
    }
    if (p[1].revents != 0) return;
    UniqueFd c(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (c) {
      start_handshake(std::move(c));
      continue;
    }
    const int err = errno;
    if (err == EINTR || err == EAGAIN || err == EWOULDBLOCK || err == ECONNABORTED) continue;
    // Out of descriptors or memory, or a network error: the connection stays queued (or is
    // gone); rest a moment rather than spin, and say so at most every 10 s.
    if (Clock::now() - complained > std::chrono::seconds(10)) {
      complained = Clock::now();
      log_line(fmt::format("rpc transport {}: accepting on {} failed ({}); trying again",
                           printable(options_.name), address_, std::strerror(err)));
    }
    pollfd w{wake_.get(), POLLIN, 0};
    if (::poll(&w, 1, kAcceptBackoffMs) > 0) return;
  }
}

void TcpTransport::start_handshake(UniqueFd fd) {
  const int raw = fd.get();
  std::string report;  // logged unlocked
  bool admit = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    const auto now = Clock::now();
    admit = handshake_threads_ < kMaxHandshakeThreads;
    if (admit && accepting_.size() >= static_cast<size_t>(kMaxPendingHandshakes)) {
      // The oldest stranger makes room for the newcomer (a member proves the key within a
      // round trip of its challenge, so the oldest is the likeliest to have stalled); its
      // thread wakes and returns.
      ::shutdown(accepting_.front().fd, SHUT_RDWR);
      accepting_.pop_front();
      ++evicted_;
    }
    if (admit) {
      accepting_.push_back(Accepting{raw, now});
      ++handshake_threads_;
    } else {
      ++refused_;
    }
    if (evicted_ + refused_ > 0 && now - reported_ >= kReportEvery) {
      report = fmt::format(
          "rpc transport {}: {} connections at once had not proven the key: closed {} of them "
          "(the oldest) and refused {} newcomers (members try again) since the last report; "
          "the latest from {}",
          printable(options_.name), kMaxPendingHandshakes, evicted_, refused_,
          torchpar::detail::describe_peer(raw));
      evicted_ = refused_ = 0;
      reported_ = now;
    }
  }
  if (!report.empty()) log_line(report);
  if (!admit) return;  // closed unheard
  const int one = 1;   // small request/reply messages: no Nagle delay
  ::setsockopt(raw, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  auto held = std::make_shared<UniqueFd>(std::move(fd));  // std::function copies its callable
  try {
    threads_.start([this, held] { serve_accepted(std::move(*held)); });
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      leave_accepting_locked(raw);  // before `held` closes the socket
      --handshake_threads_;
    }
    log_line(fmt::format("rpc transport {}: no thread for a handshake ({}); closing a connection",
                         printable(options_.name), e.what()));
  }
}

bool TcpTransport::leave_accepting_locked(int fd) {
  const auto it =
      std::find_if(accepting_.begin(), accepting_.end(), [&](const auto& a) { return a.fd == fd; });
  if (it == accepting_.end()) return false;
  accepting_.erase(it);
  return true;
}

void TcpTransport::serve_accepted(UniqueFd fd) {
  const int raw = fd.get();
  const std::string where = torchpar::detail::describe_peer(raw);
  const auto deadline =
      Clock::now() +
      std::min(std::chrono::duration_cast<Clock::duration>(kAcceptedHandshakeTimeout),
               std::chrono::duration_cast<Clock::duration>(options_.handshake_timeout));
  std::string error;
  try {
    deliver_challenge(raw, options_.authkey, deadline, options_.auth);  // the peer proves the key
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "the handshake failed";
  }
  bool evicted = false, closing = false;
  {
    // Proven (or failed): no longer a stranger that counts against the pending bound.
    std::lock_guard<std::mutex> lock(mutex_);
    evicted = !leave_accepting_locked(raw);
    --handshake_threads_;
    closing = closed_;
    if (error.empty() && !evicted && !closing) handshaking_.insert(raw);  // Tracked below
  }
  if (evicted || closing) return;  // counted by the accept thread, or no matter
  std::shared_ptr<Conn> conn;
  if (error.empty()) {
    Tracked tracked{this, raw};
    try {
      answer_challenge(raw, options_.authkey, deadline, options_.auth);
      const std::string name = recv_frame(raw, kMaxHandshakeFrame, deadline);
      if (name.empty()) throw AuthenticationError("protocol error: an empty member name");
      send_frame(raw, options_.name, deadline);
      conn = add_conn(fd, name, where);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (!conn) {
    if (!closed()) {
      log_line(fmt::format("rpc transport {}: refused a connection from {}: {}",
                           printable(options_.name), where, error));
    }
    return;
  }
  read_loop(conn);
}

// ---- connections ------------------------------------------------------------------------------

bool TcpTransport::track(int fd) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return false;
  handshaking_.insert(fd);
  return true;
}

std::shared_ptr<Conn> TcpTransport::add_conn(UniqueFd& fd, const std::string& peer,
                                             const std::string& where) {
  auto conn = std::make_shared<Conn>();
  conn->peer = peer;
  conn->where = where;
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return nullptr;
  conn->fd = std::move(fd);
  file_locked(conn);
  return conn;
}

void TcpTransport::lose(const std::shared_ptr<Conn>& conn, const std::string& why) {
  bool report = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (conn->dead) return;
    report = unfile_locked(conn);
    // The peer sees EOF; this side's reader (if it is not the caller) wakes and returns.
    ::shutdown(conn->fd.get(), SHUT_RDWR);
  }
  stop_writer(*conn);
  if (report) dispatcher_.post_lost(conn->peer, why);
}

void TcpTransport::stop_writer(Conn& conn) noexcept {
  {
    std::lock_guard<std::mutex> lock(conn.wmu);
    conn.stop = true;
  }
  conn.wcv.notify_all();
}

UniqueFd TcpTransport::open_connection(const SocketAddress& to, Clock::time_point deadline) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (to.ipv6) {
    auto& in6 = reinterpret_cast<sockaddr_in6&>(ss);
    in6.sin6_family = AF_INET6;
    in6.sin6_port = htons(to.port);
    ::inet_pton(AF_INET6, to.host.c_str(), &in6.sin6_addr);  // checked by parse_tcp_address
    len = sizeof in6;
  } else {
    auto& in = reinterpret_cast<sockaddr_in&>(ss);
    in.sin_family = AF_INET;
    in.sin_port = htons(to.port);
    ::inet_pton(AF_INET, to.host.c_str(), &in.sin_addr);
    len = sizeof in;
  }
  const std::string where = to.text();
  UniqueFd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) torchpar::detail::throw_system_error("socket", errno, where);
  int err = 0;
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&ss), len) != 0) {
    err = errno;
    while (err == EINPROGRESS || err == EINTR) {
      pollfd p[2] = {{fd.get(), POLLOUT, 0}, {wake_.get(), POLLIN, 0}};
      const int r = ::poll(p, 2, poll_ms(deadline));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) torchpar::detail::throw_system_error("poll", errno, where);
      if (p[1].revents != 0) throw ClosedError("rpc transport: closed while connecting");
      if (r == 0) throw TimeoutError("no connection before the deadline");
      socklen_t err_len = sizeof err;
      if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &err_len) != 0) err = errno;
    }
  }
  if (err != 0) throw ClosedError(fmt::format("cannot connect: {}", std::strerror(err)));
  const int flags = torchpar::detail::check_syscall("fcntl(F_GETFL)", where,
                                                    [&] { return ::fcntl(fd.get(), F_GETFL); });
  torchpar::detail::check_syscall("fcntl(F_SETFL)", where,
                                  [&] { return ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK); });
  const int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

std::shared_ptr<Conn> TcpTransport::connect(const std::string& peer, const std::string& address,
                                            Clock::time_point deadline) {
  const SocketAddress to = detail::parse_tcp_address(address);
  const std::string what = fmt::format("rpc transport {}: connection to {} at {}",
                                       printable(options_.name), printable(peer), to.text());
  const auto started = Clock::now();
  UniqueFd fd;  // outlives `tracked`
  std::string remote;
  auto backoff = std::chrono::duration_cast<Clock::duration>(kRetryFirst);
  for (int closed_unheard = 0;; ++closed_unheard) {
    const auto handshake_deadline = std::min(
        deadline,
        Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.handshake_timeout));
    bool connected = false;
    try {
      fd = open_connection(to, handshake_deadline);
      connected = true;
      if (!track(fd.get())) throw ClosedError("rpc transport: closed while connecting");
      Tracked tracked{this, fd.get()};
      auth_connect(fd.get(), options_.authkey, handshake_deadline, options_.auth);
      send_frame(fd.get(), options_.name, handshake_deadline);
      remote = recv_frame(fd.get(), kMaxHandshakeFrame, handshake_deadline);
      break;
    } catch (const Error& e) {
      if (closed()) throw ClosedError("rpc transport: closed while connecting");
      if (dynamic_cast<const TimeoutError*>(&e)) {
        const std::string before =
            closed_unheard > 0 ? fmt::format("; {} handshakes closed before", closed_unheard) : "";
        throw TimeoutError(fmt::format("{}: {} (after {:.3g} s{})", what, e.what(),
                                       seconds(Clock::now() - started), before));
      }
      if (dynamic_cast<const AuthenticationError*>(&e)) {
        throw AuthenticationError(fmt::format("{}: {}", what, e.what()));
      }
      // The member accepted the connection and closed it before the handshake ended: over
      // its bound of pending handshakes (strangers crowd it), or exiting. Try again until the
      // deadline; a member that is gone refuses the next connect.
      if (!connected || !dynamic_cast<const ClosedError*>(&e)) {
        throw ClosedError(fmt::format("{}: {}", what, e.what()));  // refused, socket errors
      }
      fd.reset();
      if (Clock::now() + backoff >= deadline) {
        throw TimeoutError(fmt::format(
            "{}: the member closed {} handshakes before they ended, until the deadline (after "
            "{:.3g} s; too many connections in their handshake there?)",
            what, closed_unheard + 1, seconds(Clock::now() - started)));
      }
      pollfd w{wake_.get(), POLLIN, 0};  // close() ends the pause
      const auto pause = std::chrono::ceil<std::chrono::milliseconds>(backoff);
      if (::poll(&w, 1, static_cast<int>(pause.count())) > 0) {
        throw ClosedError("rpc transport: closed while connecting");
      }
      backoff = std::min(2 * backoff, std::chrono::duration_cast<Clock::duration>(kRetryMax));
    }
  }
  if (remote != peer) {
    throw ClosedError(fmt::format("{}: the member listening there is \"{}\" (a stale address?)",
                                  what, printable(remote)));
  }
  auto conn = add_conn(fd, peer, to.text());
  if (!conn) throw ClosedError("rpc transport: closed while connecting");
  try {
    threads_.start([this, conn] { read_loop(conn); });
  } catch (const std::exception& e) {
    lose(conn, fmt::format("no thread to read the connection: {}", e.what()));
    throw ClosedError(fmt::format("{}: no thread to read it: {}", what, e.what()));
  }
  return conn;
}

// ---- messages ---------------------------------------------------------------------------------

/// Reads exactly `n` bytes of `conn`. Errors: ClosedError at EOF or a reset; SystemError.
void read_exact(const Conn& conn, void* data, size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(conn.fd.get(), p, std::min<size_t>(n, size_t{1} << 30), 0);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) throw ClosedError("the peer closed the connection");
    if (errno == EINTR) continue;
    if (errno == ECONNRESET) throw ClosedError("the peer reset the connection");
    torchpar::detail::throw_system_error("recv", errno, conn.where);
  }
}

Message TcpTransport::read_message(const Conn& conn) const {
  unsigned char fixed[kFixedBytes];
  read_exact(conn, fixed, sizeof fixed);
  if (std::memcmp(fixed, kMagic, sizeof kMagic) != 0 || get_le(fixed + 20, 4) != 0) {
    throw ProtocolError(
        fmt::format("protocol error: not an RPC frame (it starts with {:02x} {:02x} {:02x} {:02x})",
                    fixed[0], fixed[1], fixed[2], fixed[3]));
  }
  const uint64_t header_bytes = get_le(fixed + 4, 4);
  const uint64_t body_bytes = get_le(fixed + 8, 8);
  const uint64_t count = get_le(fixed + 16, 4);
  if (header_bytes > options_.max_header_bytes) {
    throw ProtocolError(fmt::format("protocol error: a header of {} bytes (at most {})",
                                    header_bytes, options_.max_header_bytes));
  }
  if (count > options_.max_storages) {
    throw ProtocolError(
        fmt::format("protocol error: {} storages (at most {})", count, options_.max_storages));
  }
  std::vector<uint64_t> lengths(count);  // at most max_storages entries
  read_exact(conn, lengths.data(), lengths.size() * sizeof(uint64_t));
  for (auto& length : lengths) length = get_le(reinterpret_cast<const unsigned char*>(&length), 8);
  // total <= limit throughout, so no sum can overflow.
  const uint64_t limit = options_.max_message_bytes;
  uint64_t total = 0;
  bool fits = true;
  auto add = [&](uint64_t n) {
    if (n > limit - total) fits = false;
    if (fits) total += n;
  };
  add(header_bytes);
  add(body_bytes);
  for (uint64_t length : lengths) add(length);
  if (!fits) {
    throw ProtocolError(
        fmt::format("protocol error: a message of more than {} bytes (max_message_bytes)", limit));
  }
  // Allocated only now, each of the announced size; storages are read into straight.
  Message msg;
  try {
    msg.header.resize(header_bytes);
    msg.body.resize(body_bytes);
    msg.storages.reserve(lengths.size());
    for (uint64_t length : lengths) {
      msg.storages.emplace_back(c10::Storage::use_byte_size_t(), length, c10::GetCPUAllocator(),
                                /*resizable=*/false);
    }
  } catch (const std::exception& e) {
    throw Error(fmt::format("cannot receive a message of {} bytes: {}", total, e.what()));
  }
  read_exact(conn, msg.header.data(), msg.header.size());
  read_exact(conn, msg.body.data(), msg.body.size());
  for (auto& s : msg.storages) {
    if (s.nbytes() > 0) read_exact(conn, s.data(), s.nbytes());
  }
  return msg;
}

void TcpTransport::read_loop(const std::shared_ptr<Conn>& conn) {
  for (;;) {
    Message msg;
    try {
      msg = read_message(*conn);
    } catch (const std::exception& e) {
      lose(conn, e.what());
      return;
    }
    if (options_.inline_handlers) {
      if (!closed()) dispatcher_.deliver(conn->peer, std::move(msg));
    } else {
      dispatcher_.post_message(conn->peer, std::move(msg));
    }
  }
}

void TcpTransport::write(const std::shared_ptr<Conn>& conn, std::unique_ptr<Outgoing> out) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (conn->dead) {
      throw ClosedError(
          fmt::format("rpc transport: the connection to {} was lost", printable(conn->peer)));
    }
  }
  std::vector<std::unique_ptr<Outgoing>> dropped;  // destroyed unlocked: they own storages
  std::unique_lock<std::mutex> wl(conn->wmu);
  if (conn->stop) {
    throw ClosedError(
        fmt::format("rpc transport: the connection to {} was lost", printable(conn->peer)));
  }
  prune_locked(*conn, Clock::now(), dropped);
  if (!conn->writing && conn->queue.empty()) {
    // Nothing waits: write what the socket takes now, on this thread (no hand-off for the
    // common small message).
    conn->writing = true;
    wl.unlock();
    bool done = false;
    std::string error;
    try {
      done = write_some(conn->fd.get(), *out, conn->where);
    } catch (const Error& e) {
      error = e.what();
    }
    wl.lock();
    conn->writing = false;
    conn->wcv.notify_all();
    if (!error.empty()) {
      wl.unlock();
      lose(conn, error);
      if (closed()) throw ClosedError("rpc transport: closed");
      throw ClosedError(fmt::format("rpc transport {}: send to {}: {}", printable(options_.name),
                                    printable(conn->peer), error));
    }
    if (done) return;
  }
  // The rest waits for the writer thread, in order after what is queued.
  conn->queue.push_back(std::move(out));
  conn->wcv.notify_all();
  if (conn->writer) return;
  conn->writer = true;
  wl.unlock();
  try {
    threads_.start([this, conn] { write_loop(conn); });
  } catch (const std::exception& e) {
    lose(conn, fmt::format("no thread to write the connection: {}", e.what()));
    throw ClosedError(fmt::format("rpc transport {}: send to {}: no thread to write: {}",
                                  printable(options_.name), printable(conn->peer), e.what()));
  }
}

void TcpTransport::write_loop(const std::shared_ptr<Conn>& conn) {
  // When the socket last took bytes, or the writer found work after having none: the stall
  // clock runs across messages (each dropped at its deadline) while the socket takes nothing.
  Clock::time_point progress = Clock::now();
  for (;;) {
    std::unique_ptr<Outgoing> out;
    {
      std::deque<std::unique_ptr<Outgoing>> dropped;  // destroyed unlocked
      std::unique_lock<std::mutex> wl(conn->wmu);
      if (conn->queue.empty()) {
        conn->wcv.wait(wl, [&] { return conn->stop || (!conn->queue.empty() && !conn->writing); });
        progress = Clock::now();
      }
      conn->wcv.wait(wl, [&] { return conn->stop || !conn->writing; });
      if (conn->stop) {
        dropped.swap(conn->queue);
        wl.unlock();
        return;
      }
      out = std::move(conn->queue.front());
      conn->queue.pop_front();
      conn->writing = true;
    }
    std::string error;
    try {
      finish(*conn, *out, progress);
    } catch (const Error& e) {
      error = e.what();
    }
    out.reset();
    {
      std::lock_guard<std::mutex> wl(conn->wmu);
      conn->writing = false;
    }
    conn->wcv.notify_all();
    if (!error.empty()) {
      lose(conn, fmt::format("rpc transport {}: writing to {}: {}", printable(options_.name),
                             printable(conn->peer), error));
      return;
    }
  }
}

bool TcpTransport::finish(Conn& conn, Outgoing& out, Clock::time_point& progress) {
  for (;;) {
    bool moved = false;
    if (write_some(conn.fd.get(), out, conn.where, &moved)) return true;
    const auto now = Clock::now();
    if (moved) progress = now;
    if (!out.started && out.deadline <= now) return false;  // its caller has given up
    if (now - progress >= kWriteStallLimit) {
      throw TimeoutError(fmt::format(
          "the peer took no byte for {:.3g} s (stopped or unreachable?); the connection is "
          "dropped",
          seconds(now - progress)));
    }
    {
      std::vector<std::unique_ptr<Outgoing>> dropped;  // destroyed unlocked
      std::unique_lock<std::mutex> wl(conn.wmu);
      if (conn.stop) throw ClosedError("the connection was closed");
      prune_locked(conn, now, dropped);
      wl.unlock();
    }
    auto until = std::min(progress + kWriteStallLimit, now + kPruneEvery);
    if (!out.started) until = std::min(until, out.deadline);
    pollfd p{conn.fd.get(), POLLOUT, 0};
    const int r = ::poll(&p, 1, poll_ms(until));
    if (r < 0 && errno != EINTR) torchpar::detail::throw_system_error("poll", errno, conn.where);
  }
}

void TcpTransport::send(const std::string& peer, const std::string& address, Message msg,
                        Clock::time_point deadline) {
  detail::check_storages(msg);
  if (msg.header.size() > UINT32_MAX || msg.storages.size() > UINT32_MAX) {
    throw ValueError(
        fmt::format("rpc transport: a header of {} bytes or {} storages does not fit "
                    "a frame (at most 2^32 - 1 each)",
                    msg.header.size(), msg.storages.size()));
  }
  // Framed once, here; the iovecs point into the heap-held message, which the writer may
  // hold after send returns.
  auto out = std::make_unique<Outgoing>();
  out->msg = std::move(msg);
  out->deadline = deadline;
  const Message& m = out->msg;
  out->head.assign(kFixedBytes + 8 * m.storages.size(), '\0');
  auto* h = reinterpret_cast<unsigned char*>(out->head.data());
  std::memcpy(h, kMagic, sizeof kMagic);
  put_le(h + 4, m.header.size(), 4);
  put_le(h + 8, m.body.size(), 8);
  put_le(h + 16, m.storages.size(), 4);
  for (size_t i = 0; i < m.storages.size(); ++i) {
    put_le(h + kFixedBytes + 8 * i, m.storages[i].nbytes(), 8);
  }
  out->iov.reserve(3 + m.storages.size());
  auto add = [&](const void* p, size_t n) {
    if (n > 0) out->iov.push_back(iovec{const_cast<void*>(p), n});
  };
  add(out->head.data(), out->head.size());
  add(m.header.data(), m.header.size());
  add(m.body.data(), m.body.size());
  for (const auto& s : m.storages) add(s.data(), s.nbytes());
  run_send(
      peer, deadline, [&] { return connect(peer, address, deadline); },
      [&](const std::shared_ptr<Conn>& conn) { write(conn, std::move(out)); });
}

}  // namespace

std::unique_ptr<Transport> create_tcp_transport(TransportOptions options,
                                                TransportHandlers handlers) {
  return std::make_unique<TcpTransport>(std::move(options), std::move(handlers));
}

}  // namespace torchpar::rpc
