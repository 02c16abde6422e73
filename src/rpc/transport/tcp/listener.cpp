// The TCP transport's listening side and handshakes (accepted and dialed), construction and
// close. Threads and locks: transport_impl.h.

#include "rpc/transport/tcp/transport_impl.h"

namespace torchpar::rpc::tcp {

// ---- construction and close ----------------------------------------------------------------

TcpTransport::TcpTransport(TransportOptions options, TransportHandlers handlers)
    : options_(std::move(options)),
      read_spin_(static_cast<int64_t>(env_unsigned("TORCHPAR_RPC_READ_SPIN_US", 50, 0, 1000000))),
      dispatcher_(options_.name, std::move(handlers)) {
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
    watch_thread_ = std::thread([this] { watch_loop(); });
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
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watch_thread_.joinable()) watch_thread_.join();  // it starts no reader once closed
  const auto peers = drain_after_close();              // connections close when this goes, unlocked
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

// ---- dialing -----------------------------------------------------------------------------------

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

}  // namespace torchpar::rpc::tcp
