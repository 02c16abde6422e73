// The TCP implementation of the RPC transport (tcp_transport.h). Wire format:
// docs/wire_format.md, "RPC transport" (TCP).
//
// Threads: one thread per connection, no epoll loop (a member holds one connection per peer it
// talks to; blocking reads keep each connection's code straight-line).
//   - The accept thread polls the listening socket and an eventfd that close() writes. Each
//     accepted socket gets its connection thread at once, at most kMaxPendingHandshakes of
//     them still handshaking (more are closed unheard).
//   - A connection thread runs the handshake (bounded by handshake_timeout), then reads that
//     connection's frames until EOF, an error, a protocol violation or close(). With
//     inline_handlers it runs on_message itself, in order; otherwise it hands each message to
//     the dispatch thread (support.h), which runs the handlers one at a time, in order.
//     on_peer_lost always runs on the dispatch thread.
//   - A sender connects (a non-blocking connect polled together with the eventfd) and
//     handshakes on its own thread, bounded by its deadline, then starts the new connection's
//     reader thread; it writes its message itself (sendmsg over iovecs that point at the
//     message's own bytes, polled until its deadline).
//   - close() marks the transport closed and shuts down every socket (shutdown(2) wakes
//     blocked reads, writes and handshakes without freeing a descriptor number that a thread
//     still uses), writes the eventfd, waits for send calls to leave, then joins the accept
//     thread, every connection thread and the dispatch thread.
// Sockets are blocking (a reader waits in recv); handshakes and writes wait with poll and
// MSG_DONTWAIT until their deadline. Waiting for the next frame has no deadline: an idle
// connection is normal, and close() or the peer ends it.
//
// One mutex, mutex_ (support.h's ConnectionTable), guards the tables (members, connections'
// `dead`, sockets in their handshake, counters); no call that blocks runs under it. Writes to
// a connection are serialized by its member's `busy` flag, a lock with a deadline (writes go
// only to `out`), held by run_send until the write is done.

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
#include <cstring>
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

/// Waits until `fd` takes more bytes (or has an error for the next call to report).
/// Errors: TimeoutError past `deadline`; SystemError.
void wait_writable(int fd, Clock::time_point deadline, const std::string& where) {
  for (;;) {
    pollfd p{fd, POLLOUT, 0};
    const int r = ::poll(&p, 1, poll_ms(deadline));
    if (r > 0) return;
    if (r == 0) throw TimeoutError("the peer did not take the message's bytes before the deadline");
    if (errno != EINTR) torchpar::detail::throw_system_error("poll", errno, where);
  }
}

/// One connection of an authenticated member (made by this side or accepted).
struct Conn {
  UniqueFd fd;
  std::string peer;   // the member's name
  std::string where;  // its socket address, for messages
  bool dead = false;  // guarded by the transport's mutex_: lost (reported once) or closing
};

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

  // Connections.
  UniqueFd open_connection(const SocketAddress& to, Clock::time_point deadline);
  std::shared_ptr<Conn> connect(const std::string& peer, const std::string& address,
                                Clock::time_point deadline);
  bool track(int fd);  // false once closed
  /// Files `fd` (moved from only on success) as a connection of `peer`; nullptr once closed.
  std::shared_ptr<Conn> add_conn(UniqueFd& fd, const std::string& peer, const std::string& where);
  void lose(const std::shared_ptr<Conn>& conn, const std::string& why);

  // Messages.
  void read_loop(const std::shared_ptr<Conn>& conn);
  Message read_message(const Conn& conn) const;
  void write(const std::shared_ptr<Conn>& conn, const Message& msg, Clock::time_point deadline);

  const TransportOptions options_;
  std::string address_;  // "tcp://ip:port"
  UniqueFd listen_fd_;
  UniqueFd wake_;  // eventfd, written once by close(): wakes the accept thread and connects

  std::once_flag close_once_;
  int pending_handshakes_ = 0;  // guarded by mutex_, as the next
  std::set<int> handshaking_;   // sockets in their handshake (Tracked)

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
    close_locked([](Conn& c) { ::shutdown(c.fd.get(), SHUT_RDWR); });  // senders fail now
    for (int fd : handshaking_) ::shutdown(fd, SHUT_RDWR);
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
  bool refuse = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    refuse = pending_handshakes_ >= kMaxPendingHandshakes;
    if (!refuse) ++pending_handshakes_;
  }
  if (refuse) {
    log_line(fmt::format("rpc transport {}: {} handshakes pending; closing a connection from {}",
                         printable(options_.name), kMaxPendingHandshakes,
                         torchpar::detail::describe_peer(fd.get())));
    return;
  }
  const int one = 1;  // small request/reply messages: no Nagle delay
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  auto held = std::make_shared<UniqueFd>(std::move(fd));  // std::function copies its callable
  try {
    threads_.start([this, held] { serve_accepted(std::move(*held)); });
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --pending_handshakes_;
    }
    log_line(fmt::format("rpc transport {}: no thread for a handshake ({}); closing a connection",
                         printable(options_.name), e.what()));
  }
}

void TcpTransport::serve_accepted(UniqueFd fd) {
  const std::string where = torchpar::detail::describe_peer(fd.get());
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.handshake_timeout);
  std::shared_ptr<Conn> conn;
  if (track(fd.get())) {
    Tracked tracked{this, fd.get()};
    try {
      auth_accept(fd.get(), options_.authkey, deadline, options_.auth);
      const std::string name = recv_frame(fd.get(), kMaxHandshakeFrame, deadline);
      if (name.empty()) throw AuthenticationError("protocol error: an empty member name");
      send_frame(fd.get(), options_.name, deadline);
      conn = add_conn(fd, name, where);
    } catch (const std::exception& e) {
      if (!closed()) {
        log_line(fmt::format("rpc transport {}: refused a connection from {}: {}",
                             printable(options_.name), where, e.what()));
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --pending_handshakes_;
  }
  if (conn) read_loop(conn);
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
  if (report) dispatcher_.post_lost(conn->peer, why);
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
  const auto handshake_deadline = std::min(
      deadline, started + std::chrono::duration_cast<Clock::duration>(options_.handshake_timeout));
  UniqueFd fd;  // outlives `tracked`
  std::string remote;
  try {
    fd = open_connection(to, handshake_deadline);
    if (!track(fd.get())) throw ClosedError("rpc transport: closed while connecting");
    Tracked tracked{this, fd.get()};
    auth_connect(fd.get(), options_.authkey, handshake_deadline, options_.auth);
    send_frame(fd.get(), options_.name, handshake_deadline);
    remote = recv_frame(fd.get(), kMaxHandshakeFrame, handshake_deadline);
  } catch (const Error& e) {
    if (closed()) throw ClosedError("rpc transport: closed while connecting");
    if (dynamic_cast<const TimeoutError*>(&e)) {
      throw TimeoutError(
          fmt::format("{}: {} (after {:.3g} s)", what, e.what(), seconds(Clock::now() - started)));
    }
    if (dynamic_cast<const AuthenticationError*>(&e)) {
      throw AuthenticationError(fmt::format("{}: {}", what, e.what()));
    }
    throw ClosedError(fmt::format("{}: {}", what, e.what()));  // refused, reset, socket errors
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

void TcpTransport::write(const std::shared_ptr<Conn>& conn, const Message& msg,
                         Clock::time_point deadline) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (conn->dead) {
      throw ClosedError(
          fmt::format("rpc transport: the connection to {} was lost", printable(conn->peer)));
    }
  }
  std::string head(kFixedBytes + 8 * msg.storages.size(), '\0');
  auto* h = reinterpret_cast<unsigned char*>(head.data());
  std::memcpy(h, kMagic, sizeof kMagic);
  put_le(h + 4, msg.header.size(), 4);
  put_le(h + 8, msg.body.size(), 8);
  put_le(h + 16, msg.storages.size(), 4);
  for (size_t i = 0; i < msg.storages.size(); ++i) {
    put_le(h + kFixedBytes + 8 * i, msg.storages[i].nbytes(), 8);
  }
  std::vector<iovec> iov;
  iov.reserve(3 + msg.storages.size());
  auto add = [&](const void* p, size_t n) {
    if (n > 0) iov.push_back(iovec{const_cast<void*>(p), n});
  };
  add(head.data(), head.size());
  add(msg.header.data(), msg.header.size());
  add(msg.body.data(), msg.body.size());
  for (const auto& s : msg.storages) add(s.data(), s.nbytes());

  bool started = false;  // some bytes are out: a failure now leaves the stream out of sync
  try {
    for (size_t next = 0; next < iov.size();) {
      msghdr mh{};
      mh.msg_iov = iov.data() + next;
      mh.msg_iovlen = std::min<size_t>(iov.size() - next, IOV_MAX);
      const ssize_t w = ::sendmsg(conn->fd.get(), &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) {
        started = true;
        for (auto left = static_cast<size_t>(w); left > 0;) {
          if (left >= iov[next].iov_len) {
            left -= iov[next].iov_len;
            ++next;
          } else {
            iov[next].iov_base = static_cast<char*>(iov[next].iov_base) + left;
            iov[next].iov_len -= left;
            left = 0;
          }
        }
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w == 0 || errno == EAGAIN || errno == EWOULDBLOCK) {
        wait_writable(conn->fd.get(), deadline, conn->where);
        continue;
      }
      if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN) {
        throw ClosedError(fmt::format("the connection ended ({})", std::strerror(errno)));
      }
      torchpar::detail::throw_system_error("sendmsg", errno, conn->where);
    }
  } catch (const TimeoutError& e) {
    const std::string what = fmt::format("rpc transport {}: send to {}: {}",
                                         printable(options_.name), printable(conn->peer), e.what());
    if (started) lose(conn, what + " (the message was cut off, so the connection closed)");
    throw TimeoutError(what);
  } catch (const Error& e) {
    lose(conn, e.what());
    if (closed()) throw ClosedError("rpc transport: closed");
    throw ClosedError(fmt::format("rpc transport {}: send to {}: {}", printable(options_.name),
                                  printable(conn->peer), e.what()));
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
  run_send(
      peer, deadline, [&] { return connect(peer, address, deadline); },
      [&](const std::shared_ptr<Conn>& conn) { write(conn, msg, deadline); });
}

}  // namespace

std::unique_ptr<Transport> create_tcp_transport(TransportOptions options,
                                                TransportHandlers handlers) {
  return std::make_unique<TcpTransport>(std::move(options), std::move(handlers));
}

}  // namespace torchpar::rpc
