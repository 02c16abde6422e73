#pragma once
// Process-wide signal dispositions the library sets, in one place.

#include <signal.h>

namespace torchpar::detail {

/// Sets SIGPIPE to "ignore" when it is at its default disposition, as Python does at startup.
/// Gloo, the store and TensorPipe (through libuv) write to sockets without MSG_NOSIGNAL: a
/// peer that died would otherwise kill this process with SIGPIPE instead of failing the write
/// with EPIPE. A disposition the program chose (a handler, or SIG_IGN) stays.
/// Safety: thread-safe; callers that race both set SIG_IGN.
inline void ignore_sigpipe_if_default() noexcept {
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && !(old.sa_flags & SA_SIGINFO) &&
      old.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace torchpar::detail
