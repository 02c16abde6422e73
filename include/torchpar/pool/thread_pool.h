#pragma once
/// ThreadPool: the Pool API on threads of this process (multiprocessing.pool.ThreadPool).
/// Any callable works, captures included; nothing is serialized.

#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "torchpar/pool/async_result.h"

namespace torchpar {

namespace detail {
class ThreadPoolCore {
 public:
  explicit ThreadPoolCore(size_t threads);
  ~ThreadPoolCore();
  /// Queues `task`; `cancel` runs instead if terminate() drops it. Throws ClosedError after
  /// close/terminate.
  void submit(std::function<void()> task, std::function<void()> cancel);
  size_t size() const { return threads_.size(); }
  /// The index, in [0, size()), of the pool thread calling this; SIZE_MAX on any other
  /// thread. A thread belongs to one pool, so the index is that pool's.
  static size_t current_worker();
  void close();
  bool join(Timeout timeout);
  void terminate();

 private:
  void run(size_t index);
  void join_threads();
  std::mutex mu_, join_mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::pair<std::function<void()>, std::function<void()>>> tasks_;
  std::vector<std::thread> threads_;
  size_t busy_ = 0;
  bool closed_ = false;
  bool stop_ = false;
};
}  // namespace detail

/// The Pool API on threads of this process: any callable (captures included), arguments
/// and results by value, nothing serialized, tensors never copied.
///
/// Lifetime: copies share one pool; the last copy's destructor terminates it (drops queued
/// tasks, waits for running ones), as Python's context-manager exit does.
/// Safety: submitting and close() are thread-safe; join/terminate: see each.
/// Errors: submitting after close()/terminate() throws ClosedError; task exceptions come
/// back from AsyncResult::get / IMapIterator::next as themselves.
/// Units: timeouts are wall-clock seconds (Timeout); chunksize counts items.
/// Source: multiprocessing.pool.ThreadPool / machin.parallel.pool.ThreadPool.
class ThreadPool {
 public:
  /// `threads` workers (0: std::thread::hardware_concurrency()).
  explicit ThreadPool(size_t threads = 0)
      : core_(std::make_shared<detail::ThreadPoolCore>(
            threads == 0 ? std::max(1u, std::thread::hardware_concurrency()) : threads)) {}

  /// fn(args...) on a pool thread; the result arrives later. `fn` and `args` are copied
  /// into the task.
  ///
  /// Units:   the returned AsyncResult's timeouts are seconds.
  /// Errors:  ClosedError after close()/terminate(), in the calling thread. get() then
  ///          rethrows the task's own exception, or ClosedError when terminate() dropped it.
  /// Callbacks: `callback(result)` or `error_callback(error)` runs once, on the pool thread
  ///          that ran the task (or in this call when already done); it must not block or
  ///          call join()/terminate().
  /// Safety:  thread-safe. Source: multiprocessing.pool.ThreadPool.apply_async.
  template <class Fn, class... Args>
  auto apply_async(Fn fn, std::tuple<Args...> args,
                   std::function<void(const detail::result_of_t<Fn, Args...>&)> callback = {},
                   std::function<void(std::exception_ptr)> error_callback = {}) {
    using R = std::invoke_result_t<Fn, Args&...>;
    using V = detail::result_of_t<Fn, Args...>;
    auto job = std::make_shared<detail::JobState>(1);
    core_->submit(
        [job, fn, args]() mutable {
          try {
            if constexpr (std::is_void_v<R>) {
              std::apply(fn, args);
              job->complete(0, {std::any(true)}, nullptr);
            } else {
              job->complete(0, {std::any(std::apply(fn, args))}, nullptr);
            }
          } catch (...) {
            job->complete(0, {}, std::current_exception());
          }
        },
        cancel_chunk(job, 0));
    AsyncResult<V> result(
        job, [](detail::JobState& j) { return std::any_cast<V>(j.chunks[0].values[0]); });
    detail::attach_callbacks<V>(job, result, callback, error_callback);
    return result;
  }

  /// fn(args...) on a pool thread, waited for: apply_async(fn, args).get().
  ///
  /// Units:   no timeout. Errors: as apply_async, then the task's own exception.
  /// Safety:  thread-safe; not from a task or callback of this pool (it may wait for a
  ///          thread it occupies). Source: multiprocessing.pool.ThreadPool.apply.
  template <class Fn, class... Args>
  auto apply(Fn fn, std::tuple<Args...> args) {
    return apply_async(fn, std::move(args)).get();
  }

  /// fn(item) for each item, in chunks of `chunksize` items (0: about four chunks a
  /// thread); the results, in order, arrive later as one vector.
  ///
  /// Units:   chunksize counts items; AsyncResult timeouts are seconds.
  /// Errors:  as apply_async; get() rethrows the first failed chunk's exception (the other
  ///          chunks still run). Callbacks: as apply_async, with the whole vector.
  /// Safety:  thread-safe. Source: multiprocessing.pool.ThreadPool.map_async.
  template <class Fn, class T>
  auto map_async(Fn fn, std::vector<T> items, size_t chunksize = 0,
                 std::function<void(const std::vector<detail::result_of_t<Fn, T>>&)> callback = {},
                 std::function<void(std::exception_ptr)> error_callback = {}) {
    using R = detail::result_of_t<Fn, T>;
    auto job = run_chunks(fn, std::move(items), chunksize);
    AsyncResult<std::vector<R>> result(job, [](detail::JobState& j) {
      std::vector<R> out;  // copies: get() may be called again
      for (auto& c : j.chunks)
        for (auto& v : c.values) out.push_back(std::any_cast<R>(v));
      return out;
    });
    detail::attach_callbacks<std::vector<R>>(job, result, std::move(callback),
                                             std::move(error_callback));
    return result;
  }
  /// fn(item) for each item, waited for: map_async(fn, items, chunksize).get().
  ///
  /// Units, Errors: as map_async. Safety: as apply.
  /// Source:  multiprocessing.pool.ThreadPool.map.
  template <class Fn, class T>
  auto map(Fn fn, std::vector<T> items, size_t chunksize = 0) {
    return map_async(fn, std::move(items), chunksize).get();
  }
  /// fn(item) for each item; an iterator yielding the results in order as they come.
  ///
  /// Units:   chunksize counts items (default 1); IMapIterator::next's timeout is seconds.
  /// Errors:  as apply_async; IMapIterator::next rethrows a failed chunk's exception once,
  ///          then goes on.
  /// Safety:  thread-safe; the iterator has one consumer.
  /// Source:  multiprocessing.pool.ThreadPool.imap.
  template <class Fn, class T>
  auto imap(Fn fn, std::vector<T> items, size_t chunksize = 1) {
    using R = detail::result_of_t<Fn, T>;
    return IMapIterator<R>(run_chunks(fn, std::move(items), chunksize), true,
                           [](std::any& v) { return std::any_cast<R>(std::move(v)); });
  }
  /// fn(item) for each item; an iterator yielding the results in completion order.
  ///
  /// Units, Errors, Safety: as imap.
  /// Source:  multiprocessing.pool.ThreadPool.imap_unordered.
  template <class Fn, class T>
  auto imap_unordered(Fn fn, std::vector<T> items, size_t chunksize = 1) {
    using R = detail::result_of_t<Fn, T>;
    return IMapIterator<R>(run_chunks(fn, std::move(items), chunksize), false,
                           [](std::any& v) { return std::any_cast<R>(std::move(v)); });
  }
  /// fn(a, b, ...) for each tuple of `items`; the results, in order, arrive later.
  ///
  /// Units, Errors, Callbacks, Safety: as map_async.
  /// Source:  multiprocessing.pool.ThreadPool.starmap_async.
  template <class Fn, class... Args>
  auto starmap_async(
      Fn fn, std::vector<std::tuple<Args...>> items, size_t chunksize = 0,
      std::function<void(const std::vector<detail::result_of_t<Fn, Args...>>&)> callback = {},
      std::function<void(std::exception_ptr)> error_callback = {}) {
    auto call = [fn](std::tuple<Args...>& t) { return std::apply(fn, t); };
    return map_async(call, std::move(items), chunksize, std::move(callback),
                     std::move(error_callback));
  }
  /// fn(a, b, ...) for each tuple, waited for: starmap_async(fn, items, chunksize).get().
  ///
  /// Units, Errors: as map_async. Safety: as apply.
  /// Source:  multiprocessing.pool.ThreadPool.starmap.
  template <class Fn, class... Args>
  auto starmap(Fn fn, std::vector<std::tuple<Args...>> items, size_t chunksize = 0) {
    return starmap_async(fn, std::move(items), chunksize).get();
  }

  /// No more tasks: later calls raise ClosedError; queued tasks still run.
  ///
  /// Errors:  none. Safety: thread-safe. Source: multiprocessing.pool.ThreadPool.close.
  void close() { core_->close(); }
  /// Waits until the queue is empty and no task runs, then joins the threads (after
  /// close() or terminate()).
  ///
  /// Units:   `timeout` wall-clock (nullopt: no limit). Returns true when done, false when
  ///          `timeout` passed first (nothing changed; call again).
  /// Errors:  torchpar::Error when neither close() nor terminate() was called.
  /// Safety:  one thread at a time (with terminate and the last copy's destructor); never
  ///          from a task or callback of this pool (it would wait for its own thread).
  /// Source:  multiprocessing.pool.ThreadPool.join.
  bool join(Timeout timeout = std::nullopt) { return core_->join(timeout); }
  /// Drops the queued tasks (their results fail with ClosedError; their error callbacks
  /// run in this thread) and waits for the running ones: a thread cannot be killed, so a
  /// task that never returns blocks it.
  ///
  /// Errors:  never throws. Safety: one thread at a time (with join and the last copy's
  ///          destructor); from a task it does not wait for that task's own thread.
  /// Source:  multiprocessing.pool.ThreadPool.terminate.
  void terminate() { core_->terminate(); }
  /// The number of threads. Safety: thread-safe.
  size_t size() const { return core_->size(); }

 private:
  static std::function<void()> cancel_chunk(std::shared_ptr<detail::JobState> job, size_t c) {
    return [job, c] {
      job->complete(
          c, {},
          std::make_exception_ptr(ClosedError("the pool was terminated before this task ran")));
    };
  }

  template <class Fn, class T>
  std::shared_ptr<detail::JobState> run_chunks(Fn fn, std::vector<T> items, size_t chunksize) {
    auto shared = std::make_shared<std::vector<T>>(std::move(items));
    auto ranges = detail::split_chunks(shared->size(), chunksize, core_->size());
    auto job = std::make_shared<detail::JobState>(ranges.size());
    for (size_t c = 0; c < ranges.size(); ++c) {
      core_->submit(
          [job, fn, shared, c, r = ranges[c]]() mutable {
            std::vector<std::any> values;
            try {
              for (size_t i = r.first; i < r.second; ++i) {
                if constexpr (std::is_void_v<std::invoke_result_t<Fn, T&>>) {
                  fn((*shared)[i]);
                  values.emplace_back(true);
                } else {
                  values.emplace_back(fn((*shared)[i]));
                }
              }
              job->complete(c, std::move(values), nullptr);
            } catch (...) {
              job->complete(c, {}, std::current_exception());
            }
          },
          cancel_chunk(job, c));
    }
    return job;
  }

  std::shared_ptr<detail::ThreadPoolCore> core_;
};

/// A ThreadPool whose thread i holds worker_contexts[i] and calls fn(context, args...):
/// per-thread state (a model replica, an RNG, a connection) without globals or locks.
/// One thread per context; each context is only ever used by its own thread, so `Ctx`
/// needs no synchronization of its own. Every call passes the context: `fn` takes `Ctx&`
/// first, then the item (or the tuple's elements). Contexts are neither copied per task
/// nor serialized; the pool owns them until its last copy is gone.
///
/// Units, errors, callbacks, safety: as the ThreadPool method of the same name.
/// Source: machin.parallel.pool.CtxThreadPool (worker_contexts).
///
/// ```cpp
/// tp::CtxThreadPool<std::mt19937> pool({std::mt19937(1), std::mt19937(2)});
/// auto draws = pool.map([](std::mt19937& rng, int) { return rng(); }, std::vector<int>(8));
/// ```
template <class Ctx>
class CtxThreadPool {
 public:
  /// Errors: ValueError when `worker_contexts` is empty.
  explicit CtxThreadPool(std::vector<Ctx> worker_contexts)
      : contexts_(std::make_shared<std::vector<Ctx>>(std::move(worker_contexts))),
        pool_(checked_size(*contexts_)) {}

  /// fn(Ctx&, args...) on some thread, with that thread's context; the result comes later.
  /// Source: machin.parallel.pool.CtxThreadPool.apply_async.
  template <class Fn, class... Args>
  auto apply_async(Fn fn, std::tuple<Args...> args,
                   std::function<void(const detail::result_of_t<Fn, Ctx, Args...>&)> callback = {},
                   std::function<void(std::exception_ptr)> error_callback = {}) {
    auto call = [ctx = contexts_, fn](Args&... a) mutable { return fn(context(*ctx), a...); };
    return pool_.apply_async(call, std::move(args), std::move(callback), std::move(error_callback));
  }
  /// apply_async(fn, args).get(). Source: machin.parallel.pool.CtxThreadPool.apply.
  template <class Fn, class... Args>
  auto apply(Fn fn, std::tuple<Args...> args) {
    return apply_async(fn, std::move(args)).get();
  }
  /// fn(Ctx&, item) for each item; the results, in order, arrive later.
  /// Source: machin.parallel.pool.CtxThreadPool.map_async.
  template <class Fn, class T>
  auto map_async(
      Fn fn, std::vector<T> items, size_t chunksize = 0,
      std::function<void(const std::vector<detail::result_of_t<Fn, Ctx, T>>&)> callback = {},
      std::function<void(std::exception_ptr)> error_callback = {}) {
    return pool_.map_async(with_context(fn), std::move(items), chunksize, std::move(callback),
                           std::move(error_callback));
  }
  /// map_async(fn, items, chunksize).get(). Source: machin.parallel.pool.CtxThreadPool.map.
  template <class Fn, class T>
  auto map(Fn fn, std::vector<T> items, size_t chunksize = 0) {
    return map_async(fn, std::move(items), chunksize).get();
  }
  /// fn(Ctx&, item) for each item, yielded in order. Source: CtxThreadPool.imap.
  template <class Fn, class T>
  auto imap(Fn fn, std::vector<T> items, size_t chunksize = 1) {
    return pool_.imap(with_context(fn), std::move(items), chunksize);
  }
  /// fn(Ctx&, item) for each item, yielded in completion order.
  /// Source: machin.parallel.pool.CtxThreadPool.imap_unordered.
  template <class Fn, class T>
  auto imap_unordered(Fn fn, std::vector<T> items, size_t chunksize = 1) {
    return pool_.imap_unordered(with_context(fn), std::move(items), chunksize);
  }
  /// fn(Ctx&, a, b, ...) for each tuple; the results, in order, arrive later.
  /// Source: machin.parallel.pool.CtxThreadPool.starmap_async.
  template <class Fn, class... Args>
  auto starmap_async(
      Fn fn, std::vector<std::tuple<Args...>> items, size_t chunksize = 0,
      std::function<void(const std::vector<detail::result_of_t<Fn, Ctx, Args...>>&)> callback = {},
      std::function<void(std::exception_ptr)> error_callback = {}) {
    auto call = [ctx = contexts_, fn](std::tuple<Args...>& t) mutable {
      return std::apply([&](Args&... a) { return fn(context(*ctx), a...); }, t);
    };
    return pool_.map_async(call, std::move(items), chunksize, std::move(callback),
                           std::move(error_callback));
  }
  /// starmap_async(fn, items, chunksize).get(). Source: CtxThreadPool.starmap.
  template <class Fn, class... Args>
  auto starmap(Fn fn, std::vector<std::tuple<Args...>> items, size_t chunksize = 0) {
    return starmap_async(fn, std::move(items), chunksize).get();
  }

  /// As ThreadPool's (machin's CtxThreadPool has them too).
  void close() { pool_.close(); }
  bool join(Timeout timeout = std::nullopt) { return pool_.join(timeout); }
  void terminate() { pool_.terminate(); }
  size_t size() const { return pool_.size(); }

 private:
  static size_t checked_size(const std::vector<Ctx>& contexts) {
    if (contexts.empty()) throw ValueError("CtxThreadPool needs one context per thread (got none)");
    return contexts.size();
  }
  static Ctx& context(std::vector<Ctx>& contexts) {
    return contexts[detail::ThreadPoolCore::current_worker()];
  }
  template <class Fn>
  auto with_context(Fn fn) const {
    return [ctx = contexts_, fn](auto& item) mutable { return fn(context(*ctx), item); };
  }

  std::shared_ptr<std::vector<Ctx>> contexts_;
  ThreadPool pool_;
};

}  // namespace torchpar
