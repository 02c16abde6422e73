#include "core/socket_address.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstring>
#include <thread>

#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {
namespace {

constexpr std::string_view kForms =
    "expected \"host:port\", \":port\", \"[v6 address]:port\", a Unix socket path containing "
    "'/', or \"@name\" for an abstract Unix socket";

// sun_path holds 108 bytes: a path needs its NUL, an abstract name its leading NUL.
constexpr size_t kMaxUnixPath = sizeof(sockaddr_un::sun_path) - 1;

std::string printable(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '\0') {
      out += "\\0";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

uint16_t parse_port(std::string_view digits, std::string_view text) {
  unsigned value = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size() ||
      value > 65535) {
    throw ValueError(fmt::format("address \"{}\": port \"{}\" is not a number from 0 to 65535",
                                 printable(text), digits));
  }
  return static_cast<uint16_t>(value);
}

/// sockaddr_un of a Unix address and its length.
std::pair<sockaddr_un, socklen_t> unix_sockaddr(const SocketAddress& a) {
  sockaddr_un sun{};
  sun.sun_family = AF_UNIX;
  socklen_t len = 0;
  if (a.kind == SocketAddress::Kind::kUnixPath) {
    std::memcpy(sun.sun_path, a.path.data(), a.path.size());
    len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + a.path.size() + 1);
  } else {
    std::memcpy(sun.sun_path + 1, a.path.data(), a.path.size());  // sun_path[0] stays NUL
    len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + a.path.size());
  }
  return {sun, len};
}

/// getaddrinfo for a TCP address; the caller frees the list.
addrinfo* resolve(const SocketAddress& a, bool passive) {
  addrinfo hints{};
  // Hostnames resolve to IPv4 as Python's ('host', port) addresses do (AF_INET);
  // a bracketed literal is IPv6.
  hints.ai_family = a.ipv6 ? AF_INET6 : AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(a.host.c_str(), std::to_string(a.port).c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    throw Error(fmt::format("cannot resolve the host of {}: {}", a.text(),
                            rc == EAI_SYSTEM ? std::strerror(errno) : ::gai_strerror(rc)));
  }
  return res;
}

std::string sockaddr_text(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(ss);
    ::inet_ntop(AF_INET, &in.sin_addr, host, sizeof host);
    return fmt::format("{}:{}", host, ntohs(in.sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(ss);
    ::inet_ntop(AF_INET6, &in6.sin6_addr, host, sizeof host);
    return fmt::format("[{}]:{}", host, ntohs(in6.sin6_port));
  }
  return "unknown address";
}

void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void set_blocking(int fd, const std::string& what) {
  const int flags = check_syscall("fcntl(F_GETFL)", what, [&] { return ::fcntl(fd, F_GETFL); });
  check_syscall("fcntl(F_SETFL)", what, [&] { return ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK); });
}

/// Milliseconds for poll() until `deadline` (rounded up; -1 without one).
int poll_ms(const Deadline& deadline) {
  if (!deadline) return -1;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - SteadyClock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT32_MAX));
}

/// One non-blocking connect of `fd` to `sa`, waited for until `deadline`. Returns 0 or an
/// errno (ETIMEDOUT past the deadline).
int connect_once(int fd, const sockaddr* sa, socklen_t len, const Deadline& deadline) {
  if (::connect(fd, sa, len) == 0) return 0;
  if (errno != EINPROGRESS && errno != EINTR) return errno;
  for (;;) {
    pollfd p{fd, POLLOUT, 0};
    const int r = ::poll(&p, 1, poll_ms(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno;
    if (r == 0) return ETIMEDOUT;
    int err = 0;
    socklen_t err_len = sizeof err;
    if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &err_len) != 0) return errno;
    return err;
  }
}

}  // namespace

std::string SocketAddress::text() const {
  switch (kind) {
    case Kind::kUnixPath:
      return path;
    case Kind::kUnixAbstract:
      return "@" + path;
    case Kind::kTcp:
      break;
  }
  return ipv6 ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

SocketAddress parse_socket_address(std::string_view text) {
  SocketAddress a;
  if (!text.empty() && (text.front() == '@' || text.front() == '\0')) {
    a.kind = SocketAddress::Kind::kUnixAbstract;
    a.path = std::string(text.substr(1));
    if (a.path.empty() || a.path.size() > kMaxUnixPath) {
      throw ValueError(fmt::format("address \"{}\": an abstract socket name needs 1 to {} bytes",
                                   printable(text), kMaxUnixPath));
    }
    return a;
  }
  if (text.find('/') != std::string_view::npos) {
    a.kind = SocketAddress::Kind::kUnixPath;
    a.path = std::string(text);
    if (a.path.find('\0') != std::string::npos || a.path.size() > kMaxUnixPath) {
      throw ValueError(
          fmt::format("address \"{}\": a Unix socket path must hold at most {} bytes and no NUL",
                      printable(text), kMaxUnixPath));
    }
    return a;
  }
  a.kind = SocketAddress::Kind::kTcp;
  if (text.empty()) {
    a.host = "127.0.0.1";
    return a;
  }
  std::string_view host;
  std::string_view port;
  if (text.front() == '[') {
    const size_t close = text.find("]:");
    if (close == std::string_view::npos) {
      throw ValueError(fmt::format("address \"{}\": {}", printable(text), kForms));
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
    a.ipv6 = true;
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) {
      throw ValueError(fmt::format("address \"{}\": {}", printable(text), kForms));
    }
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (host.find(':') != std::string_view::npos) {
      throw ValueError(fmt::format(
          "address \"{}\": an IPv6 address goes in brackets, as \"[::1]:5000\"", printable(text)));
    }
  }
  if (host.find('\0') != std::string_view::npos) {
    throw ValueError(fmt::format("address \"{}\": {}", printable(text), kForms));
  }
  a.host = host.empty() ? (a.ipv6 ? "::1" : "127.0.0.1") : std::string(host);
  a.port = parse_port(port, text);
  return a;
}

UniqueFd listen_on(const SocketAddress& address, int backlog, std::string* bound, dev_t* device,
                   ino_t* inode) {
  const std::string where = address.text();
  *device = 0;
  *inode = 0;
  if (address.kind != SocketAddress::Kind::kTcp) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) throw_system_error("socket", errno, where);
    const auto [sun, len] = unix_sockaddr(address);
    if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&sun), len) != 0) {
      const int err = errno;
      throw_system_error("bind", err, where,
                         err == EADDRINUSE && address.kind == SocketAddress::Kind::kUnixPath
                             ? "the path exists (a socket left by a process that did not close "
                               "its Listener?); remove it or choose another path"
                             : "");
    }
    if (address.kind == SocketAddress::Kind::kUnixPath) {
      // Before listen(): until then nobody can connect, whatever the umask made the mode.
      struct stat st {};
      if (::chmod(address.path.c_str(), 0600) != 0 || ::stat(address.path.c_str(), &st) != 0) {
        const int err = errno;
        ::unlink(address.path.c_str());
        throw_system_error("chmod", err, where);
      }
      *device = st.st_dev;
      *inode = st.st_ino;
    }
    if (::listen(fd.get(), backlog) != 0) {
      const int err = errno;
      if (address.kind == SocketAddress::Kind::kUnixPath) ::unlink(address.path.c_str());
      throw_system_error("listen", err, where);
    }
    *bound = where;
    return fd;
  }
  addrinfo* res = resolve(address, /*passive=*/true);
  int last_err = 0;
  const char* last_call = "socket";
  UniqueFd fd;
  for (addrinfo* ai = res; ai != nullptr && !fd; ai = ai->ai_next) {
    UniqueFd s(
        ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!s) {
      last_err = errno;
      continue;
    }
    const int one = 1;
    ::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      last_err = errno;
      last_call = "bind";
      continue;
    }
    if (::listen(s.get(), backlog) != 0) {
      last_err = errno;
      last_call = "listen";
      continue;
    }
    fd = std::move(s);
  }
  ::freeaddrinfo(res);
  if (!fd) throw_system_error(last_call, last_err, where);
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  check_syscall("getsockname", where,
                [&] { return ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len); });
  *bound = sockaddr_text(ss);
  return fd;
}

UniqueFd connect_to(const SocketAddress& address, const Deadline& deadline) {
  const std::string where = address.text();
  if (address.kind != SocketAddress::Kind::kTcp) {
    const auto [sun, len] = unix_sockaddr(address);
    for (;;) {
      UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (!fd) throw_system_error("socket", errno, where);
      const int err =
          connect_once(fd.get(), reinterpret_cast<const sockaddr*>(&sun), len, deadline);
      if (err == 0) {
        set_blocking(fd.get(), where);
        return fd;
      }
      // A full backlog: the listener is there but busy; try again until the deadline.
      if (err == EAGAIN && !past(deadline)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (err == ETIMEDOUT || err == EAGAIN) {
        throw TimeoutError(fmt::format("Client: could not connect to {} in time", where));
      }
      throw_system_error("connect", err, where,
                         err == ECONNREFUSED ? "no Listener accepts connections there" : "");
    }
  }
  addrinfo* res = resolve(address, /*passive=*/false);
  int last_err = ECONNREFUSED;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(
        ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!fd) {
      last_err = errno;
      continue;
    }
    const int err = connect_once(fd.get(), ai->ai_addr, ai->ai_addrlen, deadline);
    if (err == 0) {
      ::freeaddrinfo(res);
      set_nodelay(fd.get());
      set_blocking(fd.get(), where);
      return fd;
    }
    last_err = err;
    if (err == ETIMEDOUT && past(deadline)) break;
  }
  ::freeaddrinfo(res);
  if (last_err == ETIMEDOUT && past(deadline)) {
    throw TimeoutError(fmt::format("Client: could not connect to {} in time", where));
  }
  throw_system_error("connect", last_err, where,
                     last_err == ECONNREFUSED ? "nothing listens on that port" : "");
}

std::string describe_peer(int fd) noexcept {
  try {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "unknown peer";
    if (ss.ss_family == AF_UNIX) {
      ucred cred{};
      socklen_t cred_len = sizeof cred;
      if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0) {
        return "unknown Unix peer";
      }
      return fmt::format("pid {} (uid {})", cred.pid, cred.uid);
    }
    return sockaddr_text(ss);
  } catch (...) {
    return "unknown peer";
  }
}

}  // namespace torchpar::detail
