#include "core/robust_mutex.h"

#include <fmt/format.h>

#include <cstring>

#include "torchpar/core/error.h"

namespace torchpar::detail {

void init_robust_mutex(pthread_mutex_t* m, bool recursive) {
  pthread_mutexattr_t attr;
  ::pthread_mutexattr_init(&attr);
  ::pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  ::pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  if (recursive) ::pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
  const int r = ::pthread_mutex_init(m, &attr);
  ::pthread_mutexattr_destroy(&attr);
  if (r != 0) throw_robust_mutex_error("pthread_mutex_init", r);
}

void throw_robust_mutex_error(const char* call, int err) {
  throw Error(fmt::format("{} on a process-shared mutex failed: {}", call, std::strerror(err)));
}

int robust_mutex_wait(pthread_mutex_t* m, const Deadline& deadline) {
  if (!deadline) return ::pthread_mutex_lock(m);
  if (SteadyClock::now() >= *deadline) return EBUSY;
  const auto ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(deadline->time_since_epoch()).count();
  struct timespec ts {};
  ts.tv_sec = ns / 1000000000;
  ts.tv_nsec = ns % 1000000000;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30)) && \
    !defined(__SANITIZE_THREAD__)
  return ::pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &ts);
#else
  // No clocklock (or ThreadSanitizer, which does not intercept it and would then miss this
  // acquire): convert to CLOCK_REALTIME (a wall-clock step may stretch this wait).
  const auto left = *deadline - SteadyClock::now();
  struct timespec now {};
  ::clock_gettime(CLOCK_REALTIME, &now);
  const auto abs_ns = static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec +
                      std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
  ts.tv_sec = abs_ns / 1000000000;
  ts.tv_nsec = abs_ns % 1000000000;
  return ::pthread_mutex_timedlock(m, &ts);
#endif
}

}  // namespace torchpar::detail
