#pragma once
// Is a process of this pid namespace still running (not exited, not a zombie)? Is the
// peer of a socket still there?

#include <poll.h>
#include <signal.h>

#include <cerrno>
#include <fstream>
#include <string>

namespace torchpar::detail {

/// False when `pid` has exited (or is a zombie); true while it runs or is stopped, and for
/// pid <= 0 (unknown: let the caller's deadline decide).
inline bool pid_alive(int pid) {
  if (pid <= 0) return true;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return true;
  const char state = line[close + 2];
  return state != 'Z' && state != 'X';
}

/// True once the peer of the stream socket `fd` closed its end or died, for a protocol in
/// which the peer sends nothing on the socket while this side waits (a manager call in
/// flight): anything readable (data, EOF, a reset) counts as gone. False for fd < 0.
inline bool socket_peer_gone(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  const int n = ::poll(&p, 1, 0);
  return n > 0 && (p.revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

}  // namespace torchpar::detail
