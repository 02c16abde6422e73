#include "dist/group_executor.h"

#include <fmt/format.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>

#include "torchpar/core/error.h"

namespace torchpar::detail {

struct GroupExecutor::State {
  std::shared_ptr<GroupBackend> backend;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;  // guarded by mu
  bool stop = false;                        // guarded by mu
  // Who runs a call now: kIdle, kInline or kWorker. Taken with a compare-and-swap from kIdle,
  // so a synchronous call with nothing queued takes no lock (a 4-byte all_reduce on shm is
  // a fraction of a microsecond; the mutex and notify per call were a tenth of it).
  std::atomic<int> runner{0};
  std::atomic<size_t> queued{0};  // queue.size(), readable without the lock
  std::atomic<bool> stopped{false};
};

namespace {

void run_one(const GroupExecutor::Op& op, GroupBackend& backend, PromiseWork& work) {
  try {
    op(backend);
    work.set_value();
  } catch (...) {
    work.set_error(std::current_exception());
  }
}

}  // namespace

GroupExecutor::GroupExecutor(std::shared_ptr<GroupBackend> backend)
    : state_(std::make_shared<State>()) {
  state_->backend = std::move(backend);
}

GroupExecutor::~GroupExecutor() { stop(); }

std::shared_ptr<PromiseWork> completed_work() {
  // Never destroyed, and handed out without a control block (the aliasing constructor with
  // an empty owner): copying and dropping it touch no reference count, where a shared one
  // cost two locked instructions per synchronous call on the caller's hot path.
  static PromiseWork* const done = [] {
    auto* w = new PromiseWork();  // NOLINT: intentionally immortal
    w->set_value();
    return w;
  }();
  return std::shared_ptr<PromiseWork>(std::shared_ptr<void>(), done);
}

namespace {
constexpr int kIdle = 0, kInline = 1, kWorker = 2;
}  // namespace

bool GroupExecutor::try_run_inline(c10::function_ref<void(GroupBackend&)> op) {
  State& s = *state_;
  if (s.stopped.load()) {
    throw ClosedError(fmt::format("{}: the group was destroyed", s.backend->name()));
  }
  // Calls queued before this one run first (submit counts them before it notifies).
  if (s.queued.load() != 0) return false;
  int expected = kIdle;
  if (!s.runner.compare_exchange_strong(expected, kInline)) return false;
  struct Idle {  // on return and on throw: the next call (or the thread) may run
    State& s;
    ~Idle() {
      s.runner.store(kIdle);
      // A call submitted meanwhile waits for the runner: wake the thread. (Both sides use
      // sequentially consistent operations: either the thread saw kIdle, or this sees it
      // queued.)
      if (s.queued.load() != 0) {
        std::lock_guard<std::mutex> g(s.mu);
        s.cv.notify_all();
      }
    }
  } idle{s};
  op(*s.backend);
  return true;
}

std::shared_ptr<PromiseWork> GroupExecutor::submit(Op op) {
  auto work = std::make_shared<PromiseWork>();
  State& s = *state_;
  std::unique_lock<std::mutex> lk(s.mu);
  if (s.stop) {
    throw ClosedError(fmt::format("{}: the group was destroyed", s.backend->name()));
  }
  if (!worker_.joinable()) worker_ = std::thread(&GroupExecutor::worker_loop, state_);
  s.queue.push_back(
      [op = std::move(op), work, backend = s.backend] { run_one(op, *backend, *work); });
  s.queued.fetch_add(1);
  s.cv.notify_all();
  return work;
}

void GroupExecutor::worker_loop(const std::shared_ptr<State>& state) {
  State& s = *state;
  std::unique_lock<std::mutex> lk(s.mu);
  for (;;) {
    s.cv.wait(lk, [&] {
      return (!s.queue.empty() && s.runner.load() == kIdle) || (s.stop && s.queue.empty());
    });
    if (s.queue.empty()) return;  // stopped, and nothing is left to run
    int expected = kIdle;
    if (!s.runner.compare_exchange_strong(expected, kWorker)) continue;  // an inline call won
    auto fn = std::move(s.queue.front());
    s.queue.pop_front();
    s.queued.fetch_sub(1);
    lk.unlock();
    fn();
    lk.lock();
    s.runner.store(kIdle);
    s.cv.notify_all();
  }
}

void GroupExecutor::stop() noexcept {
  {
    std::lock_guard<std::mutex> g(state_->mu);
    state_->stop = true;
    state_->stopped.store(true);
  }
  state_->cv.notify_all();
  if (!worker_.joinable()) return;
  if (worker_.get_id() == std::this_thread::get_id()) {
    worker_.detach();  // a queued call dropped the last group: the thread holds the state
  } else {
    worker_.join();
  }
}

}  // namespace torchpar::detail
