#include "torchpar/pool/thread_pool.h"

namespace torchpar::detail {

namespace {
// The index of the pool thread running on this thread (CtxThreadPool's context lookup).
thread_local size_t t_worker_index = SIZE_MAX;
}  // namespace

ThreadPoolCore::ThreadPoolCore(size_t threads) {
  for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this, i] { run(i); });
}

size_t ThreadPoolCore::current_worker() { return t_worker_index; }

ThreadPoolCore::~ThreadPoolCore() { terminate(); }

void ThreadPoolCore::submit(std::function<void()> task, std::function<void()> cancel) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_ || stop_) throw ClosedError("pool is closed");
    tasks_.emplace_back(std::move(task), std::move(cancel));
  }
  cv_.notify_one();
}

void ThreadPoolCore::run(size_t index) {
  t_worker_index = index;
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty() || closed_; });
      if (stop_ || (tasks_.empty() && closed_)) return;
      task = std::move(tasks_.front().first);
      tasks_.pop_front();
      ++busy_;
    }
    task();  // tasks catch their own exceptions into their job
    {
      std::lock_guard<std::mutex> lock(mu_);
      --busy_;
    }
    idle_cv_.notify_all();
  }
}

void ThreadPoolCore::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

bool ThreadPoolCore::join(Timeout timeout) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!closed_ && !stop_) throw Error("join() before close() or terminate()");
    auto done = [&] { return tasks_.empty() && busy_ == 0; };
    if (!timeout)
      idle_cv_.wait(lock, done);
    else if (!idle_cv_.wait_for(lock, *timeout, done))
      return false;
  }
  join_threads();
  return true;
}

void ThreadPoolCore::join_threads() {
  std::lock_guard<std::mutex> lock(join_mu_);  // join/terminate/destructor may race
  for (auto& t : threads_)
    if (t.joinable() && t.get_id() != std::this_thread::get_id()) t.join();
}

void ThreadPoolCore::terminate() {
  std::deque<std::pair<std::function<void()>, std::function<void()>>> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    closed_ = true;
    dropped.swap(tasks_);
  }
  cv_.notify_all();
  for (auto& [task, cancel] : dropped)
    if (cancel) cancel();  // their results fail with ClosedError instead of never arriving
  join_threads();
}

}  // namespace torchpar::detail
