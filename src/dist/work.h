#pragma once
// Implementations of Work: a promise fulfilled by the group's executor (completed already
// when the call ran inline); the gloo backend wraps c10d's Work for isend/irecv.

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>

#include "core/futex.h"
#include "torchpar/dist/collective_group.h"

namespace torchpar {

struct Work::Impl {
  virtual ~Impl() = default;
  /// Waits until done or `deadline`; false on timeout; rethrows the operation's error.
  virtual bool wait_until(const detail::Deadline& deadline) = 0;
  virtual bool done() = 0;
  virtual int source() { return -1; }

  /// Run once, in the first successful wait (copy-backs of non-contiguous tensors).
  void add_then(std::function<void()> fn) { then_.push_back(std::move(fn)); }
  void run_then_once() {
    std::lock_guard<std::mutex> g(then_mu_);
    if (then_ran_) return;
    then_ran_ = true;
    for (auto& fn : then_) fn();
  }

 private:
  std::mutex then_mu_;
  std::vector<std::function<void()>> then_;
  bool then_ran_ = false;
};

namespace detail {

/// Completed at construction (or later, by set_value / set_error from another thread).
class PromiseWork : public Work::Impl {
 public:
  bool wait_until(const Deadline& deadline) override {
    std::unique_lock<std::mutex> lk(mu_);
    if (deadline) {
      if (!cv_.wait_until(lk, *deadline, [&] { return done_; })) return false;
    } else {
      cv_.wait(lk, [&] { return done_; });
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  bool done() override {
    std::lock_guard<std::mutex> g(mu_);
    return done_;
  }
  int source() override {
    std::lock_guard<std::mutex> g(mu_);
    return source_;
  }
  void set_value(int source = -1) {
    {
      std::lock_guard<std::mutex> g(mu_);
      source_ = source;
      done_ = true;
    }
    cv_.notify_all();
  }
  void set_error(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> g(mu_);
      error_ = std::move(e);
      done_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  int source_ = -1;
  std::exception_ptr error_;
};

}  // namespace detail
}  // namespace torchpar
