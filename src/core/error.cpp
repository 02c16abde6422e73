#include "torchpar/core/error.h"

#include <string.h>
#include <cstring>

#include <fmt/format.h>

namespace torchpar {

Error::Error(std::string msg) : c10::Error(std::move(msg), /*backtrace=*/"") {}

SystemError::SystemError(std::string syscall, int err, std::string object, std::string detail)
    : Error(fmt::format("{} failed on {}: {} (errno {}){}{}", syscall, object, std::strerror(err),
                        err, detail.empty() ? "" : "; ", detail)),
      syscall_(std::move(syscall)),
      errno_(err),
      object_(std::move(object)) {}

ProcessRaisedException::ProcessRaisedException(int index, int pid, std::string type,
                                               std::string message)
    : RemoteRaisedError(
          fmt::format("process {} (pid {}) terminated with {}: {}", index, pid, type, message),
          type, message),
      index_(index),
      pid_(pid) {}

ProcessExitedException::ProcessExitedException(int index, int pid, int exit_code)
    : PeerLostError(exit_code < 0 ? fmt::format("process {} (pid {}) terminated with signal {}",
                                                index, pid, torchpar::signal_name(-exit_code))
                                  : fmt::format("process {} (pid {}) terminated with exit code {}",
                                                index, pid, exit_code)),
      index_(index),
      pid_(pid),
      exit_code_(exit_code) {}

WorkerLostError::WorkerLostError(int pid, int exit_code)
    : PeerLostError(
          exit_code < 0
              ? fmt::format("pool worker (pid {}) was killed by {} while it held this task "
                            "(running or queued behind the running one)",
                            pid, signal_name(-exit_code))
              : fmt::format("pool worker (pid {}) exited with code {} while it held this task "
                            "(running or queued behind the running one)",
                            pid, exit_code)),
      pid_(pid),
      exit_code_(exit_code) {}

WorkerError::WorkerError(const std::string& where, int rank, int pid, std::string type,
                         std::string message)
    : PeerLostError(
          fmt::format("{}: rank {} (pid {}) raised {}: {}", where, rank, pid, type, message)),
      rank_(rank),
      pid_(pid),
      type_(std::move(type)),
      message_(std::move(message)) {}

WorkerError::WorkerError(const std::string& where, int rank, int pid, int exit_code)
    : PeerLostError(exit_code < 0 ? fmt::format("{}: rank {} (pid {}) was killed by {}", where,
                                                rank, pid, torchpar::signal_name(-exit_code))
                                  : fmt::format("{}: rank {} (pid {}) exited with code {}", where,
                                                rank, pid, exit_code)),
      rank_(rank),
      pid_(pid),
      exit_code_(exit_code) {}

std::string WorkerError::signal_name() const {
  return exit_code_ && *exit_code_ < 0 ? torchpar::signal_name(-*exit_code_) : std::string();
}

TaskError::TaskError(std::string type, std::string message)
    : RemoteRaisedError(fmt::format("{}: {}", type, message), type, message) {}

RemoteError::RemoteError(std::string type, std::string message)
    : RemoteError(std::move(type), std::move(message), "the manager's server process") {}

RemoteError::RemoteError(std::string type, std::string message, const std::string& where)
    : RemoteRaisedError(fmt::format("{}: {} (raised in {})", type, message, where), type, message) {
}

std::string ProcessExitedException::signal_name() const {
  return exit_code_ < 0 ? torchpar::signal_name(-exit_code_) : std::string();
}

std::string signal_name(int signo) {
  const char* abbrev = ::sigabbrev_np(signo);
  return abbrev != nullptr ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", signo);
}

}  // namespace torchpar

#include "torchpar/version.h"

namespace torchpar {
const char* version() { return TORCHPAR_VERSION; }
}  // namespace torchpar
