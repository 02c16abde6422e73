#pragma once
// Is a process of this pid namespace still running (not exited, not a zombie)?

#include <fmt/format.h>
#include <signal.h>

#include <cerrno>
#include <fstream>
#include <string>

namespace torchpar::detail {

inline bool pid_alive(int pid) {
  if (pid <= 0) return true;  // unknown: let the deadline decide
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return true;
  const char state = line[close + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace torchpar::detail
