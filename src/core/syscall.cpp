#include "torchpar/core/syscall.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include "torchpar/core/fd.h"

namespace torchpar {

void UniqueFd::reset(int fd) noexcept {
  if (fd_ >= 0 && fd_ != fd) ::close(fd_);  // close is never retried on Linux (EINTR still closes)
  fd_ = fd;
}

UniqueFd UniqueFd::dup() const {
  int nfd = detail::check_syscall("fcntl(F_DUPFD_CLOEXEC)", fmt::format("fd {}", fd_),
                                  [&] { return ::fcntl(fd_, F_DUPFD_CLOEXEC, 0); });
  return UniqueFd(nfd);
}

namespace detail {

void throw_system_error(std::string_view syscall, int err, std::string_view object,
                        std::string_view detail) {
  throw SystemError(std::string(syscall), err, std::string(object), std::string(detail));
}

std::string format_bytes(unsigned long long bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.1f} {} ({} bytes)", v, kUnits[u], bytes);
}

}  // namespace detail
}  // namespace torchpar
