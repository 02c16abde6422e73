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
  void close();
  bool join(Timeout timeout);
  void terminate();

 private:
  void run();
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

/// Lifetime: the destructor terminates (drops queued tasks, waits for running ones), as
/// Python's context-manager exit does. Safety: thread-safe.
/// Errors: submitting after close()/terminate() throws ClosedError; task exceptions come
/// back from AsyncResult::get / IMapIterator::next as themselves.
/// Source: multiprocessing.pool.ThreadPool / machin.parallel.pool.ThreadPool.
class ThreadPool {
 public:
  /// `threads` workers (0: std::thread::hardware_concurrency()).
  explicit ThreadPool(size_t threads = 0)
      : core_(std::make_shared<detail::ThreadPoolCore>(
            threads == 0 ? std::max(1u, std::thread::hardware_concurrency()) : threads)) {}

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

  template <class Fn, class... Args>
  auto apply(Fn fn, std::tuple<Args...> args) {
    return apply_async(fn, std::move(args)).get();
  }

  template <class Fn, class T>
  auto map_async(Fn fn, std::vector<T> items, size_t chunksize = 0) {
    using R = detail::result_of_t<Fn, T>;
    auto job = run_chunks(fn, std::move(items), chunksize);
    return AsyncResult<std::vector<R>>(job, [](detail::JobState& j) {
      std::vector<R> out;  // copies: get() may be called again
      for (auto& c : j.chunks)
        for (auto& v : c.values) out.push_back(std::any_cast<R>(v));
      return out;
    });
  }
  template <class Fn, class T>
  auto map(Fn fn, std::vector<T> items, size_t chunksize = 0) {
    return map_async(fn, std::move(items), chunksize).get();
  }
  template <class Fn, class T>
  auto imap(Fn fn, std::vector<T> items, size_t chunksize = 1) {
    using R = detail::result_of_t<Fn, T>;
    return IMapIterator<R>(run_chunks(fn, std::move(items), chunksize), true,
                           [](std::any& v) { return std::any_cast<R>(std::move(v)); });
  }
  template <class Fn, class T>
  auto imap_unordered(Fn fn, std::vector<T> items, size_t chunksize = 1) {
    using R = detail::result_of_t<Fn, T>;
    return IMapIterator<R>(run_chunks(fn, std::move(items), chunksize), false,
                           [](std::any& v) { return std::any_cast<R>(std::move(v)); });
  }
  template <class Fn, class... Args>
  auto starmap(Fn fn, std::vector<std::tuple<Args...>> items, size_t chunksize = 0) {
    auto call = [fn](std::tuple<Args...>& t) { return std::apply(fn, t); };
    return map(call, std::move(items), chunksize);
  }

  void close() { core_->close(); }
  bool join(Timeout timeout = std::nullopt) {
    return core_->join(timeout);
  }
  void terminate() { core_->terminate(); }
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

}  // namespace torchpar
