#pragma once
/// The byte-level engine under Queue, SimpleQueue and JoinableQueue: a multi-producer,
/// multi-consumer ring of messages in one shared-memory segment, guarded by a robust
/// process-shared mutex, with futex wake-ups after a short spin.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "torchpar/core/fd.h"

namespace torchpar::detail {

class OutputArchive;
class InputArchive;

struct QueueControl;

class ShmQueue {
 public:
  using Timeout = std::optional<std::chrono::duration<double>>;

  /// `maxsize` items (0: unbounded); `capacity_bytes` of ring (messages larger than a
  /// quarter of it travel in a shared segment of their own).
  ShmQueue(uint64_t maxsize, uint64_t capacity_bytes);
  /// Maps an existing queue from its segment fd (a child's copy).
  explicit ShmQueue(UniqueFd fd);
  ~ShmQueue();
  ShmQueue(const ShmQueue&) = delete;
  ShmQueue& operator=(const ShmQueue&) = delete;

  /// Throws Full (timeout passed or no room with timeout 0) or ClosedError.
  void put(const std::string& bytes, Timeout timeout);
  /// Throws Empty (timeout) or ClosedError (closed and empty).
  std::string get(Timeout timeout);
  uint64_t qsize() const;
  uint64_t maxsize() const;
  void close();
  bool closed() const;
  /// JoinableQueue: one task done; join waits until every put item was task_done'd.
  void task_done();
  bool join(Timeout timeout);
  int fd() const { return fd_.get(); }

 private:
  UniqueFd fd_;
  QueueControl* ctl_ = nullptr;
  char* ring_ = nullptr;
  uint64_t map_bytes_ = 0;
};

}  // namespace torchpar::detail
