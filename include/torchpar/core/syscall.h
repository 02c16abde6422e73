#pragma once
/// One wrapper for system calls: retries EINTR and turns failures into exceptions
/// that name the syscall, errno and the object acted on.

#include <cerrno>
#include <string>
#include <string_view>

#include "torchpar/core/error.h"

namespace torchpar::detail {

/// Calls `fn()` until it does not fail with EINTR; returns its result.
template <class Fn>
auto retry_eintr(Fn&& fn) {
  for (;;) {
    auto r = fn();
    if (!(r == -1 && errno == EINTR)) return r;
  }
}

/// Throws SystemError{syscall, errno, object}.
[[noreturn]] void throw_system_error(std::string_view syscall, int err, std::string_view object,
                                     std::string_view detail = {});

/// Calls `fn()` retrying EINTR; on -1 throws SystemError naming `syscall` and `object`.
template <class Fn>
auto check_syscall(std::string_view syscall, std::string_view object, Fn&& fn) {
  auto r = retry_eintr(fn);
  if (r == -1) throw_system_error(syscall, errno, object);
  return r;
}

/// Human-readable bytes ("64.0 MiB").
std::string format_bytes(unsigned long long bytes);

}  // namespace torchpar::detail
