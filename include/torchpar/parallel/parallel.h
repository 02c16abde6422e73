#pragma once
/// Parallelizable / Parallel: run forward_backward on several worker threads
/// (gluonnlp.utils.parallel).

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <variant>
#include <vector>

#include "torchpar/core/error.h"

namespace torchpar {

/// A unit of work Parallel invokes from several threads. Source: gluonnlp Parallelizable.
template <class In, class Out>
class Parallelizable {
 public:
  virtual ~Parallelizable() = default;
  /// Forward and backward computation for one input. Called concurrently from the
  /// workers: make it thread-safe (LibTorch autograd is, per graph).
  virtual Out forward_backward(In x) = 0;
};

/// Invokes a Parallelizable on `num_workers` threads: put() hands an input to a free
/// worker, get() returns an output (in completion order). num_workers = 0 runs every input
/// in the calling thread (for debugging); serial_init runs the first num_workers inputs in
/// the calling thread so that lazily initialized modules initialize serially.
///
/// Lifetime: the destructor stops and joins the workers (after finishing queued inputs).
/// Safety: put/get from any threads. Errors: get() rethrows an exception of
/// forward_backward; TimeoutError when `timeout` passes.
/// Source: gluonnlp.utils.parallel.Parallel.
template <class In, class Out>
class Parallel {
 public:
  Parallel(size_t num_workers, Parallelizable<In, Out>& parallelizable, bool serial_init = true)
      : p_(parallelizable), num_serial_(serial_init ? num_workers : 0) {
    for (size_t i = 0; i < num_workers; ++i) threads_.emplace_back([this] { work(); });
  }
  ~Parallel() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    in_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  Parallel(const Parallel&) = delete;
  Parallel& operator=(const Parallel&) = delete;

  void put(In x) {
    bool inline_run = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (num_serial_ > 0 || threads_.empty()) {
        if (num_serial_ > 0) --num_serial_;
        inline_run = true;
      } else {
        in_.push_back(std::move(x));
      }
    }
    if (inline_run) {
      push_out(run(std::move(x)));
    } else {
      in_cv_.notify_one();
    }
  }

  Out get(std::optional<std::chrono::duration<double>> timeout = std::nullopt) {
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [&] { return !out_.empty(); };
    if (!timeout)
      out_cv_.wait(lock, ready);
    else if (!out_cv_.wait_for(lock, *timeout, ready))
      throw TimeoutError("Parallel::get timed out");
    Result r = std::move(out_.front());
    out_.pop_front();
    lock.unlock();
    if (std::holds_alternative<std::exception_ptr>(r))
      std::rethrow_exception(std::get<std::exception_ptr>(r));
    return std::move(std::get<Out>(r));
  }

 private:
  using Result = std::variant<Out, std::exception_ptr>;

  Result run(In x) {
    try {
      return Result(std::in_place_index<0>, p_.forward_backward(std::move(x)));
    } catch (...) {
      return Result(std::in_place_index<1>, std::current_exception());
    }
  }
  void push_out(Result r) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      out_.push_back(std::move(r));
    }
    out_cv_.notify_one();
  }
  void work() {
    for (;;) {
      std::optional<In> x;
      {
        std::unique_lock<std::mutex> lock(mu_);
        in_cv_.wait(lock, [&] { return stop_ || !in_.empty(); });
        if (in_.empty()) return;  // stopping, and nothing left
        x.emplace(std::move(in_.front()));
        in_.pop_front();
      }
      push_out(run(std::move(*x)));
    }
  }

  Parallelizable<In, Out>& p_;
  size_t num_serial_;
  std::mutex mu_;
  std::condition_variable in_cv_, out_cv_;
  std::deque<In> in_;
  std::deque<Result> out_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace torchpar
