#pragma once
/// The byte-level engine under Queue, SimpleQueue and JoinableQueue: a multi-producer,
/// multi-consumer ring of messages in one shared-memory segment, guarded by a robust
/// process-shared mutex, with futex wake-ups after a short spin.
///
/// Internal: nothing here is public API (namespace torchpar::detail); it may change without
/// notice. It is an installed header only because the templates of queue.h (Queue,
/// SimpleQueue, JoinableQueue) hold a ShmQueue in the user's translation units; include
/// "torchpar/ipc/queue.h" instead. Test hooks: src/ipc/shm_queue_test_access.h.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "torchpar/core/fd.h"
#include "torchpar/core/timeout.h"

namespace torchpar::detail {

class OutputArchive;
class InputArchive;

struct QueueControl;
class ShmRegion;
class ShmQueueTestAccess;

class ShmQueue {
 public:
  /// `maxsize` items (0: unbounded); `capacity_bytes` of ring (messages larger than a
  /// quarter of it travel in a shared segment of their own).
  ShmQueue(uint64_t maxsize, uint64_t capacity_bytes);
  /// Maps an existing queue from its segment fd (a child's copy).
  explicit ShmQueue(UniqueFd fd);
  ~ShmQueue();
  ShmQueue(const ShmQueue&) = delete;
  ShmQueue& operator=(const ShmQueue&) = delete;

  /// Throws Full (timeout passed or no room with timeout 0) or ClosedError. Never blocks
  /// past the timeout, even when a peer holding the internal lock is stopped (timeout 0
  /// waits up to 10 ms for the lock).
  void put(const std::string& bytes, Timeout timeout);
  /// Throws Empty (timeout, also when the internal lock stays held by a stopped peer) or
  /// ClosedError (closed and empty).
  std::string get(Timeout timeout);
  uint64_t qsize() const;
  uint64_t maxsize() const;
  void close();
  bool closed() const;
  /// JoinableQueue: one task done; join waits until every put item was task_done'd.
  void task_done();
  bool join(Timeout timeout);
  /// The ring's sealed memfd (what a child's copy maps).
  int fd() const;

 private:
  friend class ShmQueueTestAccess;  // tests' hooks (src/ipc/shm_queue_test_access.h)

  std::unique_ptr<ShmRegion> region_;
  QueueControl* ctl_ = nullptr;
  char* ring_ = nullptr;
};

}  // namespace torchpar::detail
