#pragma once
/// AsyncResult and IMapIterator: results of pool calls that arrive later
/// (multiprocessing.pool.AsyncResult / IMapIterator).

#include <any>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "torchpar/core/error.h"
#include "torchpar/core/timeout.h"

namespace torchpar {
namespace detail {

/// The chunks of one pool call, filled in by pool threads.
struct JobState {
  struct Chunk {
    bool done = false;
    std::vector<std::any> values;  // decoded by the typed front
    std::exception_ptr error;
  };
  /// Decodes one chunk's results into values (process pools; unset for ThreadPool).
  using Unpack = std::vector<std::any> (*)(const std::string&);
  explicit JobState(size_t nchunks, Unpack unpack_fn = nullptr)
      : chunks(nchunks), unpack(unpack_fn) {}

  /// Records one chunk's outcome without waking anyone; `mu` must be held. A chunk already
  /// done is left as it is. Returns true when this was the last chunk, and then moves
  /// on_done into `cb`: the caller notifies `cv` and runs it with run_on_done, outside `mu`.
  bool record_locked(size_t chunk, std::vector<std::any>&& values, std::exception_ptr error,
                     std::function<void()>& cb) {
    auto& c = chunks[chunk];
    if (c.done) return false;
    c.done = true;
    c.values = std::move(values);
    c.error = error;
    if (error && !first_error) first_error = error;
    order.push_back(chunk);
    if (++ndone != chunks.size()) return false;
    cb = std::move(on_done);
    return true;
  }
  /// Runs a job's on_done callback; a throwing callback must not take the pool's thread
  /// down (Python logs and goes on).
  static void run_on_done(const std::function<void()>& cb) noexcept {
    if (!cb) return;
    try {
      cb();
    } catch (...) {
    }
  }
  /// Records one chunk's outcome and wakes the job's waiters at once.
  void complete(size_t chunk, std::vector<std::any> values, std::exception_ptr error) {
    std::function<void()> cb;
    {
      std::lock_guard<std::mutex> lock(mu);
      record_locked(chunk, std::move(values), error, cb);
    }
    cv.notify_all();
    run_on_done(cb);
  }
  bool wait(Timeout timeout) {
    std::unique_lock<std::mutex> lock(mu);
    auto all = [&] { return ndone == chunks.size(); };
    if (!timeout) {
      cv.wait(lock, all);
      return true;
    }
    return cv.wait_for(lock, *timeout, all);
  }

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Chunk> chunks;
  size_t ndone = 0;
  std::deque<size_t> order;  // chunks in completion order
  std::exception_ptr first_error;
  std::function<void()> on_done;  // runs once, in the thread that completes the last chunk
  const Unpack unpack;
};

}  // namespace detail

class Pool;
class ThreadPool;

/// The result of apply_async / map_async / starmap_async. Copies share the result.
/// Made only by the pools (its constructor is private).
/// Safety: thread-safe. Source: multiprocessing.pool.AsyncResult.
template <class R>
class AsyncResult {
 public:
  /// Waits and returns the result (a copy: get() may be called again).
  ///
  /// Units:   `timeout` wall-clock (nullopt: no limit).
  /// Errors:  TimeoutError when `timeout` passes (nothing changed; call again); the task's
  ///          exception (ThreadPool: the original; Pool: TaskError with type and message,
  ///          or WorkerLostError when its worker died); ClosedError when the pool was
  ///          terminated first.
  /// Safety:  thread-safe. Source: multiprocessing.pool.AsyncResult.get.
  R get(Timeout timeout = std::nullopt) {
    if (!job_->wait(timeout)) throw TimeoutError("AsyncResult::get timed out");
    if (job_->first_error) std::rethrow_exception(job_->first_error);
    return decode_(*job_);
  }
  /// True when the result is ready within `timeout` (nullopt: waits without a limit).
  /// Never throws. Safety: thread-safe. Source: multiprocessing.pool.AsyncResult.wait.
  bool wait(Timeout timeout = std::nullopt) { return job_->wait(timeout); }
  /// True when the call has completed. Safety: thread-safe.
  /// Source: multiprocessing.pool.AsyncResult.ready.
  bool ready() const {
    std::lock_guard<std::mutex> lock(job_->mu);
    return job_->ndone == job_->chunks.size();
  }
  /// True when the call completed without an exception.
  /// Errors: torchpar::Error when not ready yet (as Python's ValueError).
  /// Safety: thread-safe. Source: multiprocessing.pool.AsyncResult.successful.
  bool successful() const {
    if (!ready()) throw Error("AsyncResult::successful: the result is not ready");
    return !job_->first_error;
  }

 private:
  friend class Pool;
  friend class ThreadPool;
  using Decode = std::function<R(detail::JobState&)>;
  AsyncResult(std::shared_ptr<detail::JobState> job, Decode decode)
      : job_(std::move(job)), decode_(std::move(decode)) {}

  std::shared_ptr<detail::JobState> job_;
  Decode decode_;
};

/// Lazy results of imap (in order) or imap_unordered (as they complete).
/// next() returns nullopt at the end. Made only by the pools (its constructor is private).
/// Safety: one consumer thread. Source: multiprocessing.pool.IMapIterator.
template <class T>
class IMapIterator {
 public:
  /// The next result; nullopt after the last.
  ///
  /// Units:   `timeout` wall-clock (nullopt: no limit).
  /// Errors:  TimeoutError after `timeout` (the cursor did not move; call again); the
  ///          task's exception when its chunk failed (the iterator then goes on with the
  ///          next chunk).
  /// Safety:  one consumer thread. Source: multiprocessing.pool.IMapIterator.next.
  std::optional<T> next(Timeout timeout = std::nullopt) {
    std::unique_lock<std::mutex> lock(job_->mu);
    for (;;) {
      if (current_ && pos_ < current_->values.size()) {
        std::any& v = current_->values[pos_++];
        lock.unlock();
        return decode_(v);
      }
      if (taken_ == job_->chunks.size()) return std::nullopt;
      auto ready = [&] {
        return ordered_ ? job_->chunks[taken_].done : job_->order.size() > taken_;
      };
      if (!timeout) {
        job_->cv.wait(lock, ready);
      } else if (!job_->cv.wait_for(lock, *timeout, ready)) {
        throw TimeoutError("IMapIterator::next timed out");
      }
      const size_t idx = ordered_ ? taken_ : job_->order[taken_];
      ++taken_;
      current_ = &job_->chunks[idx];
      pos_ = 0;
      if (current_->error) {
        auto e = current_->error;
        current_ = nullptr;
        std::rethrow_exception(e);
      }
    }
  }

 private:
  friend class Pool;
  friend class ThreadPool;
  using DecodeOne = std::function<T(std::any&)>;
  IMapIterator(std::shared_ptr<detail::JobState> job, bool ordered, DecodeOne decode)
      : job_(std::move(job)), ordered_(ordered), decode_(std::move(decode)) {}

  std::shared_ptr<detail::JobState> job_;
  bool ordered_;
  DecodeOne decode_;
  size_t taken_ = 0;
  detail::JobState::Chunk* current_ = nullptr;
  size_t pos_ = 0;
};

namespace detail {
/// What fn(args...) returns, with void as bool (a pool result must be a value).
template <class Fn, class... Args>
using result_of_t = std::conditional_t<std::is_void_v<std::invoke_result_t<Fn, Args&...>>, bool,
                                       std::decay_t<std::invoke_result_t<Fn, Args&...>>>;

/// Runs `callback(result)` or `error_callback(error)` once the job is done (now, if it is).
template <class V, class CB, class ECB>
void attach_callbacks(const std::shared_ptr<JobState>& job, AsyncResult<V> result, CB callback,
                      ECB error_callback) {
  if (!callback && !error_callback) return;
  auto run = [result, callback, error_callback, job]() mutable {
    if (job->first_error) {
      if (error_callback) error_callback(job->first_error);
    } else if (callback) {
      callback(result.get());
    }
  };
  bool now = false;
  {
    std::lock_guard<std::mutex> lock(job->mu);
    if (job->ndone == job->chunks.size())
      now = true;
    else
      job->on_done = run;
  }
  if (now) run();
}

/// Splits n items into chunks of `chunksize` (0: Python's default, n / (4 * workers) rounded up).
inline std::vector<std::pair<size_t, size_t>> split_chunks(size_t n, size_t chunksize,
                                                           size_t workers) {
  if (chunksize == 0) {
    chunksize = n / (4 * std::max<size_t>(workers, 1));
    if (n % (4 * std::max<size_t>(workers, 1)) != 0) ++chunksize;
    chunksize = std::max<size_t>(chunksize, 1);
  }
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t b = 0; b < n; b += chunksize) out.emplace_back(b, std::min(n, b + chunksize));
  return out;
}
}  // namespace detail

}  // namespace torchpar
