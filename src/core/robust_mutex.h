#pragma once
// The robust, process-shared pthread mutex that lives in shared memory, with a deadline
// and owner-death recovery. The one copy of this mechanism; see tests/core/core_test.cpp.
//
// Guarantees: lock_robust never blocks past its deadline, even when the holder is stopped
// (SIGSTOP) or hung; a holder that died hands the mutex over (EOWNERDEAD), the caller's
// recovery runs while it holds the mutex, and the mutex is made consistent again.
// Fast path: an uncontended lock is one trylock (no clock read, no syscall).

#include <pthread.h>
#include <time.h>

#include <cerrno>

#include "core/cpu_relax.h"
#include "core/futex.h"

namespace torchpar::detail {

/// Initializes `m` (in shared memory) as robust and process-shared (recursive on request).
void init_robust_mutex(pthread_mutex_t* m, bool recursive = false);

enum class LockStatus {
  kAcquired,   ///< held by the caller
  kOwnerDied,  ///< held by the caller; the previous owner died holding it (recovered)
  kTimedOut,   ///< not held: the deadline passed (a passed deadline: a single try)
};

/// Locks `m` until `deadline` (nullopt: blocks). On owner death, calls `recover()` while
/// holding the mutex, then marks it consistent. Throws ShmError-family errors only for
/// misuse (EINVAL, EDEADLK...).
template <class Recover>
LockStatus lock_robust(pthread_mutex_t* m, const Deadline& deadline, Recover&& recover);

inline LockStatus lock_robust(pthread_mutex_t* m, const Deadline& deadline) {
  return lock_robust(m, deadline, [] {});
}

/// RAII holder of a robust mutex taken with lock_robust. Check locked() (false: timed out).
class RobustLock {
 public:
  template <class Recover>
  RobustLock(pthread_mutex_t* m, const Deadline& deadline, Recover&& recover)
      : m_(m), status_(lock_robust(m, deadline, recover)) {}
  RobustLock(pthread_mutex_t* m, const Deadline& deadline) : RobustLock(m, deadline, [] {}) {}
  ~RobustLock() {
    if (locked()) ::pthread_mutex_unlock(m_);
  }
  RobustLock(const RobustLock&) = delete;
  RobustLock& operator=(const RobustLock&) = delete;
  bool locked() const { return status_ != LockStatus::kTimedOut; }
  LockStatus status() const { return status_; }

 private:
  pthread_mutex_t* m_;
  LockStatus status_;
};

// ---- implementation -----------------------------------------------------------------

/// Throws torchpar::Error naming `call` and the error (out of line: keeps the header light).
[[noreturn]] void throw_robust_mutex_error(const char* call, int err);
/// The slow path: waits for `m` until `deadline` (CLOCK_MONOTONIC), returning its errno.
int robust_mutex_wait(pthread_mutex_t* m, const Deadline& deadline);

/// The short spin of a contended lock_robust before it sleeps in the kernel: this many
/// trylocks, kRobustSpinPauses CPU pauses apart (1024 pauses, some tens of microseconds).
inline constexpr int kRobustSpinTries = 64;
inline constexpr int kRobustSpinPauses = 16;

template <class Recover>
LockStatus lock_robust(pthread_mutex_t* m, const Deadline& deadline, Recover&& recover) {
  int r = ::pthread_mutex_trylock(m);
  // Contended: holders keep these mutexes for a copy of at most a few KiB, so try again for
  // a moment before sleeping (glibc's adaptive mutexes do the same, but a robust mutex cannot
  // be adaptive). A futex sleep and wake-up costs both sides several microseconds on these
  // VMs: without the spin, a queue's 4 KiB one-way rate was 10-25% lower (ipc_bench).
  for (int t = 0; r == EBUSY && t < kRobustSpinTries; ++t) {
    for (int i = 0; i < kRobustSpinPauses; ++i) cpu_relax();
    r = ::pthread_mutex_trylock(m);
  }
  if (r == EBUSY) r = robust_mutex_wait(m, deadline);
  if (r == 0) return LockStatus::kAcquired;
  if (r == EOWNERDEAD) {
    recover();
    ::pthread_mutex_consistent(m);
    return LockStatus::kOwnerDied;
  }
  if (r == EBUSY || r == ETIMEDOUT) return LockStatus::kTimedOut;
  throw_robust_mutex_error("pthread_mutex_lock", r);
}

}  // namespace torchpar::detail
