#include "torchpar/ipc/listener.h"

#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <mutex>

#include "core/futex.h"
#include "core/socket_address.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"

namespace torchpar {
namespace {

using detail::Deadline;
using detail::SteadyClock;

/// One line on stderr: a refused peer is worth a trace on the server even when the caller
/// swallows the exception.
void log_refusal(const std::string& line) noexcept {
  std::fprintf(stderr, "torchpar: %s\n", line.c_str());
  std::fflush(stderr);
}

/// The earlier of `deadline` and now + `limit`.
AuthDeadline handshake_deadline(const Deadline& deadline, std::chrono::duration<double> limit) {
  const auto own = SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(
                                            std::max(limit, std::chrono::duration<double>(0)));
  return deadline ? std::min(*deadline, own) : own;
}

std::string seconds_text(const Timeout& t) { return t ? fmt::format("{} s", t->count()) : "-"; }

}  // namespace

struct Listener::Impl {
  mutable std::mutex mu;
  UniqueFd fd;
  UniqueFd wake;   // eventfd: close() wakes the accepts waiting in poll
  int active = 0;  // accepts using fd; the last one out closes it after close()
  bool is_closed = false;
  std::string address;
  std::string unlink_path;  // a socket file we created
  dev_t device = 0;
  ino_t inode = 0;
  ListenerOptions options;

  ~Impl() { close(); }

  void close() noexcept {
    std::lock_guard<std::mutex> g(mu);
    if (is_closed) return;
    is_closed = true;
    const uint64_t one = 1;
    (void)!::write(wake.get(), &one, sizeof one);
    if (!unlink_path.empty()) {
      // Only if the path still names our socket: someone may have replaced it.
      struct stat st {};
      if (::stat(unlink_path.c_str(), &st) == 0 && st.st_dev == device && st.st_ino == inode) {
        ::unlink(unlink_path.c_str());
      }
    }
    if (active == 0) fd.reset();
  }

  /// Marks one accept as using fd; returns the fd number. ClosedError after close().
  int enter() {
    std::lock_guard<std::mutex> g(mu);
    if (is_closed) throw ClosedError(fmt::format("Listener {} is closed", address));
    ++active;
    return fd.get();
  }

  void leave() noexcept {
    std::lock_guard<std::mutex> g(mu);
    if (--active == 0 && is_closed) fd.reset();
  }

  /// Waits until a peer is pending; false on timeout. ClosedError when close() woke us.
  bool wait_pending(int listen_fd, const Deadline& deadline) {
    for (;;) {
      int ms = -1;
      if (deadline) {
        const auto left =
            std::chrono::ceil<std::chrono::milliseconds>(*deadline - SteadyClock::now());
        ms = static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT32_MAX));
      }
      pollfd p[2] = {{listen_fd, POLLIN, 0}, {wake.get(), POLLIN, 0}};
      const int r = ::poll(p, 2, ms);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) detail::throw_system_error("poll", errno, fmt::format("Listener {}", address));
      if (p[1].revents != 0) throw ClosedError(fmt::format("Listener {} was closed", address));
      if (r > 0) return true;
      if (detail::past(deadline)) return false;
    }
  }

  /// Takes one pending connection, or nothing when another accept took it first.
  UniqueFd take(int listen_fd) {
    for (;;) {
      UniqueFd c(::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC));
      if (c) {
        const int one = 1;  // small request/reply messages: no Nagle delay (fails on Unix: fine)
        ::setsockopt(c.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        return c;
      }
      if (errno == EINTR) continue;
      // Taken by another thread, or the peer gave up before we took it: wait again.
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED) return {};
      detail::throw_system_error("accept4", errno, fmt::format("Listener {}", address));
    }
  }

  /// The server side of the handshake on `c`; any failure closes `c` (by the caller's
  /// UniqueFd) and is reported with the peer's address.
  void authenticate(int c, const Deadline& deadline) {
    const std::string peer = detail::describe_peer(c);
    try {
      auth_accept(c, *options.authkey, handshake_deadline(deadline, options.handshake_timeout),
                  {.allow_legacy_md5 = options.allow_legacy_md5});
    } catch (const TimeoutError&) {
      throw TimeoutError(fmt::format("Listener {}: peer {} did not complete the handshake in time",
                                     address, peer));
    } catch (const AuthenticationError& e) {
      const std::string msg =
          fmt::format("Listener {}: refused peer {}: {}", address, peer, e.what());
      log_refusal(msg);
      throw AuthenticationError(msg);
    } catch (const ClosedError& e) {
      const std::string msg =
          fmt::format("Listener {}: refused peer {}: it closed the connection during the handshake",
                      address, peer);
      log_refusal(msg);
      throw AuthenticationError(msg);
    }
  }
};

Listener::Listener(const std::string& address, ListenerOptions options)
    : impl_(std::make_shared<Impl>()) {
  if (options.backlog <= 0)
    throw ValueError(fmt::format("Listener: backlog must be positive, not {}", options.backlog));
  const detail::SocketAddress parsed = detail::parse_socket_address(address);
  impl_->wake = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!impl_->wake) detail::throw_system_error("eventfd", errno, "Listener");
  impl_->fd =
      detail::listen_on(parsed, options.backlog, &impl_->address, &impl_->device, &impl_->inode);
  if (parsed.kind == detail::SocketAddress::Kind::kUnixPath) impl_->unlink_path = parsed.path;
  impl_->options = std::move(options);
}

Connection Listener::accept(Timeout timeout) {
  const Deadline deadline = detail::deadline_after(timeout);
  const int listen_fd = impl_->enter();
  struct Leave {
    Impl* impl;
    ~Leave() { impl->leave(); }
  } leave{impl_.get()};
  for (;;) {
    if (!impl_->wait_pending(listen_fd, deadline)) {
      throw TimeoutError(fmt::format("Listener {}: no connection within {}", impl_->address,
                                     seconds_text(timeout)));
    }
    UniqueFd c = impl_->take(listen_fd);
    if (!c) continue;
    if (impl_->options.authkey) impl_->authenticate(c.get(), deadline);
    return Connection(std::move(c), true, true, Connection::Framing::kPython);
  }
}

const std::string& Listener::address() const { return impl_->address; }

void Listener::close() noexcept { impl_->close(); }

bool Listener::closed() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->is_closed;
}

Connection Client(const std::string& address, ClientOptions options) {
  const detail::SocketAddress parsed = detail::parse_socket_address(address);
  const Deadline deadline = detail::deadline_after(options.timeout);
  UniqueFd fd = detail::connect_to(parsed, deadline);
  if (options.authkey) {
    const std::string where = parsed.text();
    try {
      auth_connect(fd.get(), *options.authkey, deadline ? *deadline : AuthDeadline::max(),
                   {.allow_legacy_md5 = options.allow_legacy_md5});
    } catch (const TimeoutError&) {
      throw TimeoutError(fmt::format(
          "Client: the handshake with {} did not complete within {} (is a Listener with an "
          "authkey there?)",
          where, seconds_text(options.timeout)));
    } catch (const AuthenticationError& e) {
      const std::string msg = fmt::format("Client: {} refused the handshake: {}", where, e.what());
      log_refusal(msg);
      throw AuthenticationError(msg);
    } catch (const ClosedError&) {
      const std::string msg =
          fmt::format("Client: {} closed the connection during the handshake", where);
      log_refusal(msg);
      throw AuthenticationError(msg);
    }
  }
  return Connection(std::move(fd), true, true, Connection::Framing::kPython);
}

}  // namespace torchpar
