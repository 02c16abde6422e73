// The TCP transport's authenticated connections: filing and losing them, the frame reader,
// the writer and its queue, send. Threads and locks: transport_impl.h.

#include "rpc/transport/tcp/transport_impl.h"

namespace torchpar::rpc::tcp {

bool write_some(int fd, Outgoing& out, const std::string& where, bool* moved) {
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

// ---- connections ------------------------------------------------------------------------------

bool TcpTransport::track(int fd) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return false;
  handshaking_.insert(fd);
  return true;
}

namespace {

/// Whether both ends of connected TCP socket `fd` have one address (loopback, or this host's
/// own address on both ends). Never throws; false when either address is unknown.
bool same_host(int fd) {
  sockaddr_storage a{}, b{};
  socklen_t la = sizeof a, lb = sizeof b;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &la) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&b), &lb) != 0 || a.ss_family != b.ss_family) {
    return false;
  }
  if (a.ss_family == AF_INET) {
    return reinterpret_cast<sockaddr_in&>(a).sin_addr.s_addr ==
           reinterpret_cast<sockaddr_in&>(b).sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<sockaddr_in6&>(a).sin6_addr,
                       &reinterpret_cast<sockaddr_in6&>(b).sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

}  // namespace

std::shared_ptr<Conn> TcpTransport::add_conn(UniqueFd& fd, const std::string& peer,
                                             const std::string& where) {
  // Between two processes of one host there is no network to be fair to, and a pacing
  // congestion control (BBR, the default of these VMs) made large messages slow at random: a
  // raw 1 MiB ping-pong over loopback had a median of 330-600 us in 5 of 8 runs under BBR
  // (140-200 us in the others), 143-202 us in 8 of 8 under Reno. Reno is built into every
  // kernel and allowed without privileges. Best effort: a refusal keeps the system's default.
  if (same_host(fd.get())) {
    static constexpr char kReno[] = "reno";
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_CONGESTION, kReno, sizeof kReno - 1);
  }
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
// ---- messages ---------------------------------------------------------------------------------

/// Bytes one recv asks for ahead of the frame being read.
/// 16 KiB holds ~180 small frames (a call is ~90 bytes), and what it reads of a large frame's
/// storage is copied once more (64 KiB cost a 64 KiB memcpy per large message).
constexpr size_t kReadAhead = size_t{16} << 10;

namespace {

/// A reader waiting for the next frame retries a non-blocking recv for read_spin_ (50 us by
/// default, TORCHPAR_RPC_READ_SPIN_US) before it blocks: a blocking TCP wake-up costs ~25 us
/// on these VMs (1-byte ping-pong on 127.0.0.1, 2-core VM: 56 us blocking, 7.8 spinning), and
/// a reply or the next call of a busy caller usually comes within it. The core goes to
/// whoever else can run every kReadsPerYield failed reads. Tiny rpc_sync, interleaved:
/// 30-33 us -> 16-17 (with the caller asleep, RpcFutureState). Only at a frame's start: the
/// rest of a large frame is already on its way, and spinning through it cost a fresh 1 MiB
/// call ~15%.
constexpr int kReadsPerYield = 3;

/// A spin that loses its core this long between two looks ran with more runnable threads than
/// cores: a spinning reader is not woken when its frame arrives, it waits for its next turn on
/// a core (tiny rpc_sync beside two compilers on the 2-core VM: 2,000-3,000 us spinning, 22
/// us blocking; a busy loop's turn is milliseconds). At 200 us ordinary hiccups at idle
/// tripped it too. Every reader of the process then blocks at once for kSpinBackoff. Tiny
/// rpc_sync in the benchmark's rpc section, 3 rounds: 17.2 / 15.7 / 19.3 us; with a backoff
/// doubling up to 1.6 s while it recurs, 2 of 3 rounds stayed backed off (39.2 / 16.6 / 36.5).
/// Beside 2 busy loops: 26.2 us, blocking readers 21.7-22.6.
constexpr auto kPreempted = std::chrono::microseconds(1000);
constexpr auto kSpinBackoff = std::chrono::milliseconds(100);

/// Until when (steady clock, ns since its epoch) readers block without spinning.
std::atomic<int64_t> g_no_spin_until{0};

int64_t ns_of(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

}  // namespace

bool spin_backed_off() {
  return ns_of(Clock::now()) < g_no_spin_until.load(std::memory_order_relaxed);
}

namespace {

/// recv into `into` (up to `want` bytes): blocking, or first spinning up to `spin` (none
/// while a recent spin found the cores oversubscribed, see kPreempted).
ssize_t recv_some(int fd, char* into, size_t want, std::chrono::microseconds spin) {
  auto last = Clock::now();
  if (spin.count() == 0 || ns_of(last) < g_no_spin_until.load(std::memory_order_relaxed)) {
    return ::recv(fd, into, want, 0);
  }
  const auto until = last + spin;
  for (int failed = 1;; ++failed) {
    const ssize_t r = ::recv(fd, into, want, MSG_DONTWAIT);
    const int err = errno;
    const auto now = Clock::now();
    // Also when the frame is there: it may have waited for this thread's turn.
    const bool preempted = now - last > kPreempted;
    if (preempted) g_no_spin_until.store(ns_of(now + kSpinBackoff), std::memory_order_relaxed);
    if (r >= 0 || (err != EAGAIN && err != EWOULDBLOCK)) {
      errno = err;
      return r;
    }
    if (preempted || now >= until) return ::recv(fd, into, want, 0);
    last = now;
    if (failed % kReadsPerYield == 0) ::sched_yield();
  }
}

}  // namespace

/// Reads exactly `n` bytes of `conn`: first what was read ahead; a short rest with one recv of
/// up to kReadAhead bytes (whatever is there: the next frames too), a long one straight into
/// `data`; recvs spin up to `spin` first (recv_some). Errors: ClosedError at EOF or a reset;
/// SystemError.
void read_exact(Conn& conn, void* data, size_t n,
                std::chrono::microseconds spin = std::chrono::microseconds(0)) {
  auto* p = static_cast<char*>(data);
  const size_t buffered = std::min(n, conn.rend - conn.rpos);
  if (buffered > 0) {
    std::memcpy(p, conn.rbuf.data() + conn.rpos, buffered);
    conn.rpos += buffered;
    p += buffered;
    n -= buffered;
  }
  while (n > 0) {
    const bool ahead = n < kReadAhead;
    if (ahead && conn.rbuf.size() < kReadAhead) conn.rbuf.resize(kReadAhead);
    char* into = ahead ? conn.rbuf.data() : p;
    const size_t want = ahead ? kReadAhead : std::min<size_t>(n, size_t{1} << 30);
    const ssize_t r = recv_some(conn.fd.get(), into, want, spin);
    if (r > 0) {
      const auto got = static_cast<size_t>(r);
      if (!ahead) {
        p += got;
        n -= got;
        continue;
      }
      const size_t take = std::min(n, got);
      std::memcpy(p, into, take);
      p += take;
      n -= take;
      conn.rpos = take;
      conn.rend = got;
      continue;
    }
    if (r == 0) throw ClosedError("the peer closed the connection");
    if (errno == EINTR) continue;
    if (errno == ECONNRESET) throw ClosedError("the peer reset the connection");
    torchpar::detail::throw_system_error("recv", errno, conn.where);
  }
}

Message TcpTransport::read_message(Conn& conn) const {
  unsigned char fixed[kFixedBytes];
  read_exact(conn, fixed, sizeof fixed, read_spin_);
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

namespace {

/// The hand-off of a reader thread while it runs an inline handler (release_reader_thread).
class Handoff final : public detail::ReaderHandoff {
 public:
  Handoff(TcpTransport* transport, std::shared_ptr<Conn> conn, uint64_t gen,
          void (TcpTransport::*rescue)(const std::shared_ptr<Conn>&, uint64_t) noexcept)
      : transport_(transport), conn_(std::move(conn)), gen_(gen), rescue_(rescue) {}
  void release() noexcept override { (transport_->*rescue_)(conn_, gen_); }

 private:
  TcpTransport* transport_;
  std::shared_ptr<Conn> conn_;
  uint64_t gen_;
  void (TcpTransport::*rescue_)(const std::shared_ptr<Conn>&, uint64_t) noexcept;
};

}  // namespace

void TcpTransport::read_loop(const std::shared_ptr<Conn>& conn, uint64_t gen) {
  if (gen == 0) {  // the connection's first reader: the rescue thread watches it
    std::lock_guard<std::mutex> lock(watch_mu_);
    std::erase_if(watched_, [](const std::weak_ptr<Conn>& w) { return w.expired(); });
    watched_.push_back(conn);
  }
  for (;;) {
    Message msg;
    try {
      msg = read_message(*conn);
    } catch (const std::exception& e) {
      lose(conn, e.what());
      return;
    }
    if (!options_.inline_handlers) {
      dispatcher_.post_message(conn->peer, std::move(msg));
      continue;
    }
    if (closed()) continue;
    // The handler may run user code here (a call executed inline, without a hand-off to a
    // pool): a handler that runs long or waits gets this connection a new reader.
    msg.may_block = true;
    {
      std::lock_guard<std::mutex> lock(conn->rmu);
      conn->handler_since = Clock::now();
    }
    note_handler();
    Handoff handoff(this, conn, gen, &TcpTransport::rescue);
    detail::current_reader() = &handoff;
    dispatcher_.deliver(conn->peer, std::move(msg));
    detail::current_reader() = nullptr;
    std::lock_guard<std::mutex> lock(conn->rmu);
    if (conn->reader_gen != gen) return;  // another reader took over meanwhile
    conn->handler_since = Clock::time_point::max();
  }
}

void TcpTransport::rescue(const std::shared_ptr<Conn>& conn, uint64_t gen) noexcept {
  uint64_t next = 0;
  {
    std::lock_guard<std::mutex> lock(conn->rmu);
    if (conn->reader_gen != gen || conn->handler_since == Clock::time_point::max()) return;
    next = ++conn->reader_gen;
    // The new reader reads, in no handler: the old one's handler is not the connection's.
    conn->handler_since = Clock::time_point::max();
  }
  std::string error;
  {
    // Under mutex_: close() sets closed_ before it joins the connection threads, so a reader
    // started here is one it joins.
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_ || conn->dead) return;
    try {
      threads_.start([this, conn, next] { read_loop(conn, next); });
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (!error.empty()) lose(conn, fmt::format("no thread to read the connection: {}", error));
}

void TcpTransport::note_handler() {
  handlers_entered_.fetch_add(1);
  if (watch_sleeping_.load()) {
    std::lock_guard<std::mutex> lock(watch_mu_);
    watch_cv_.notify_one();
  }
}

void TcpTransport::watch_loop() {
  // Ticks every half rescue period while handlers run or ran in the last tick; then sleeps
  // until a reader enters a handler (note_handler), so an idle transport does not wake.
  constexpr auto kTick = kReaderRescueAfter / 2;
  std::unique_lock<std::mutex> lock(watch_mu_);
  uint64_t seen = handlers_entered_.load();
  while (!watch_stop_) {
    std::vector<std::shared_ptr<Conn>> conns;
    for (const auto& w : watched_) {
      if (auto c = w.lock()) conns.push_back(std::move(c));
    }
    lock.unlock();
    const auto now = Clock::now();
    bool running = false;
    for (const auto& c : conns) {
      uint64_t gen = 0;
      bool late = false;
      {
        std::lock_guard<std::mutex> l(c->rmu);
        if (c->handler_since == Clock::time_point::max()) continue;
        running = true;
        late = now - c->handler_since >= kReaderRescueAfter;
        gen = c->reader_gen;
      }
      if (late) rescue(c, gen);
    }
    conns.clear();  // released unlocked
    lock.lock();
    const uint64_t entered = handlers_entered_.load();
    if (running || entered != seen) {
      seen = entered;
      watch_cv_.wait_for(lock, kTick, [&] { return watch_stop_; });
      continue;
    }
    // Idle: sleep until a reader enters a handler. A reader that entered after `seen` was
    // read either sees watch_sleeping_ (and notifies under watch_mu_) or is seen here.
    watch_sleeping_.store(true);
    if (handlers_entered_.load() == seen) {
      watch_cv_.wait(lock, [&] { return watch_stop_ || handlers_entered_.load() != seen; });
    }
    watch_sleeping_.store(false);
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

}  // namespace torchpar::rpc::tcp
