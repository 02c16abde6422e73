#pragma once
// Is a process of this pid namespace still running (not exited, not a zombie)?

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

}  // namespace torchpar::detail
