#pragma once
/// Queue, SimpleQueue and JoinableQueue carrying any serializable T between processes
/// (Python's multiprocessing / torch.multiprocessing queues).

#include <chrono>
#include <memory>
#include <optional>

#include "torchpar/core/timeout.h"
#include "torchpar/ipc/detail/shm_queue.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar {

/// Options of a queue.
struct QueueOptions {
  /// false (default): tensors are moved to shared memory and the receiver aliases them;
  /// true: tensor bytes are copied. The default follows torch.multiprocessing.Queue (and
  /// machin's SimpleQueue(copy_tensor=False)), as Connection::send and PoolOptions do;
  /// dumps alone defaults to true (machin's dumps).
  bool copy_tensor = false;
  /// Bytes of the shared ring. Messages above a quarter of it travel in a segment of their own.
  uint64_t capacity_bytes = 4 << 20;
};

/// A multi-producer, multi-consumer FIFO of T shared by processes.
///
/// Lifetime: copies of a Queue refer to the same queue; the shared memory goes when the
/// last process holding it lets go. Pass a queue to a child as a Process argument (every
/// start method). close() marks it closed for every process.
/// Safety: thread- and process-safe.
/// Errors: put throws Full when `timeout` passes without room (timeout 0: put_nowait),
///         ClosedError on a closed queue; get throws Empty when `timeout` passes, and
///         ClosedError once the queue is closed and empty — a waiting get wakes and raises.
///         A process killed while inside put/get does not wedge the others (robust mutex).
/// Units: timeouts in seconds (std::chrono durations); nullopt blocks.
/// Source: multiprocessing.Queue / torch.multiprocessing.Queue.
template <class T>
class Queue {
 public:
  /// `maxsize` items at most (0: unbounded, as in Python).
  explicit Queue(uint64_t maxsize = 0, QueueOptions options = {})
      : q_(std::make_shared<detail::ShmQueue>(maxsize, options.capacity_bytes)),
        copy_tensor_(options.copy_tensor) {}

  /// Errors also: torchpar::Error for a value that carries file descriptors (a queue,
  /// connection, lock or shared value inside T): pass those as Process arguments instead.
  void put(const T& value, Timeout timeout = std::nullopt) {
    Payload p = detail::dumps_with(value, {.copy_tensor = copy_tensor_, .pass_fds = false});
    if (!p.fds.empty()) {
      release_exports(p);
      throw Error(
          "Queue::put: the value carries file descriptors (a queue, connection, lock or "
          "shared value); pass those as Process arguments or through a Pipe");
    }
    try {
      q_->put(p.bytes, timeout);
    } catch (...) {
      release_exports(p);  // nobody will load it: claim its shared-tensor exports here
      throw;
    }
  }
  T get(Timeout timeout = std::nullopt) { return loads<T>(Payload{q_->get(timeout), {}}); }
  void put_nowait(const T& value) { put(value, std::chrono::duration<double>(0)); }
  T get_nowait() { return get(std::chrono::duration<double>(0)); }
  /// Items in the queue now (approximate while others put and get).
  uint64_t qsize() const { return q_->qsize(); }
  bool empty() const { return qsize() == 0; }
  bool full() const { return q_->maxsize() != 0 && qsize() >= q_->maxsize(); }
  void close() { q_->close(); }
  bool closed() const { return q_->closed(); }

  void save(detail::OutputArchive& ar) const {
    const uint32_t idx = ar.fd_index(q_->fd());
    ar(idx, copy_tensor_);
  }
  void load(detail::InputArchive& ar) {
    uint32_t idx = 0;
    ar(idx, copy_tensor_);
    q_ = std::make_shared<detail::ShmQueue>(ar.take_fd(idx));
  }

 protected:
  static void release_exports(const Payload& p) noexcept {
    try {
      (void)loads<T>(Payload{p.bytes, {}});
    } catch (...) {
    }
  }
  std::shared_ptr<detail::ShmQueue> q_;
  bool copy_tensor_ = false;
};

/// An unbounded queue with Python's SimpleQueue surface and nothing more: put, get, empty
/// and close. It is a Queue underneath (same shared memory, same wire format), but not a
/// Queue: qsize, full, the _nowait calls and a maxsize are not offered, as in Python.
///
/// Lifetime, safety: as Queue (copies share one queue; pass it to a child as a Process
/// argument, every start method).
/// Errors: get throws Empty when `timeout` passes, ClosedError once closed and empty; put
///         throws Full when `timeout` passes before the ring has room, ClosedError on a
///         closed queue, torchpar::Error for a value carrying fds.
/// Source: multiprocessing.SimpleQueue / machin.parallel.queue.SimpleQueue.
template <class T>
class SimpleQueue {
 public:
  explicit SimpleQueue(QueueOptions options = {}) : q_(0, options) {}

  /// Puts `value` (tensors shared unless options.copy_tensor). Waits only while the ring
  /// has no room for it, at most `timeout` (then Full).
  void put(const T& value, Timeout timeout = std::nullopt) { q_.put(value, timeout); }
  /// The oldest item, waiting up to `timeout` (nullopt: without a limit, as Python's get()).
  T get(Timeout timeout = std::nullopt) { return q_.get(timeout); }
  bool empty() const { return q_.empty(); }
  void close() { q_.close(); }

  void save(detail::OutputArchive& ar) const { q_.save(ar); }
  void load(detail::InputArchive& ar) { q_.load(ar); }

 private:
  Queue<T> q_;
};

/// A Queue whose consumers call task_done() per item and whose join() waits until every
/// item put was done. Source: multiprocessing.JoinableQueue.
template <class T>
class JoinableQueue : public Queue<T> {
 public:
  explicit JoinableQueue(uint64_t maxsize = 0, QueueOptions options = {})
      : Queue<T>(maxsize, options) {}
  /// Errors: torchpar::Error when called more often than items were put.
  void task_done() { this->q_->task_done(); }
  /// True when all tasks are done; false when `timeout` passed first.
  bool join(Timeout timeout = std::nullopt) { return this->q_->join(timeout); }
};

}  // namespace torchpar
