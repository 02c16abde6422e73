#pragma once
// Test hooks of ShmQueue (torchpar/ipc/detail/shm_queue.h): what fault tests do to a queue
// that no user program may. Not installed; tests that include it add src/ to their include
// directories.

#include <functional>

#include "torchpar/ipc/detail/shm_queue.h"

namespace torchpar::detail {

/// ShmQueue's friend for tests.
class ShmQueueTestAccess {
 public:
  /// Runs `while_held` holding `q`'s internal lock (fault tests stop a process there to
  /// check that the others time out instead of hanging). Errors: those of `while_held`;
  /// the lock is released when it returns or throws.
  static void hold_lock(ShmQueue& q, const std::function<void()>& while_held);
};

}  // namespace torchpar::detail
