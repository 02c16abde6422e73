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
  // Calls submitted, counted by the calling thread (one at a time: the class's contract),
  // and calls the executor's thread finished, which only it stores (with release). Equal:
  // nothing is queued or running, and nothing can start before the caller's next submit, so
  // a synchronous call may run inline without a lock or a locked instruction. (A
  // compare-and-swap in and a sequentially consistent store out per call each drained the
  // store buffer: a 4-byte broadcast's root waited there for its ring entry's cache line.)
  uint64_t submitted = 0;
  std::atomic<uint64_t> finished{0};
  std::atomic<bool> stopped{false};
  // Set while a call runs inline: a second thread calling meanwhile breaks the contract.
  // Relaxed: a best-effort check, not a lock.
  std::atomic<bool> inside{false};
};

namespace {

void run_one(const GroupExecutor::Op& op, GroupBackend& backend, PromiseWork& work,
             std::atomic<uint64_t>& finished) {
  std::exception_ptr error;
  try {
    op(backend);
  } catch (...) {
    error = std::current_exception();
  }
  // Counted before the Work completes: a caller woken by it finds the executor idle and
  // runs its next synchronous call inline.
  finished.store(finished.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  if (error) {
    work.set_error(error);
  } else {
    work.set_value();
  }
}

[[noreturn]] void two_threads(const GroupBackend& backend) {
  throw Error(fmt::format(
      "{}: called from two threads at once; a group is used by one thread at a time (hand it "
      "over under a mutex)",
      backend.name()));
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

bool GroupExecutor::try_run_inline(c10::function_ref<void(GroupBackend&)> op) {
  State& s = *state_;
  if (s.stopped.load(std::memory_order_relaxed)) {
    throw ClosedError(fmt::format("{}: the group was destroyed", s.backend->name()));
  }
  // Calls submitted before this one run first, on the executor's thread.
  if (s.finished.load(std::memory_order_acquire) != s.submitted) return false;
  if (s.inside.load(std::memory_order_relaxed)) two_threads(*s.backend);
  s.inside.store(true, std::memory_order_relaxed);
  struct Leave {  // on return and on throw
    State& s;
    ~Leave() { s.inside.store(false, std::memory_order_relaxed); }
  } leave{s};
  op(*s.backend);
  return true;
}

std::shared_ptr<PromiseWork> GroupExecutor::submit(Op op) {
  auto work = std::make_shared<PromiseWork>();
  State& s = *state_;
  if (s.inside.load(std::memory_order_relaxed)) two_threads(*s.backend);
  std::unique_lock<std::mutex> lk(s.mu);
  if (s.stop) {
    throw ClosedError(fmt::format("{}: the group was destroyed", s.backend->name()));
  }
  if (!worker_.joinable()) worker_ = std::thread(&GroupExecutor::worker_loop, state_);
  // The thread holds the state while it runs a call: a plain pointer (no cycle).
  s.queue.push_back(
      [op = std::move(op), work, st = &s] { run_one(op, *st->backend, *work, st->finished); });
  ++s.submitted;
  s.cv.notify_all();
  return work;
}

void GroupExecutor::worker_loop(const std::shared_ptr<State>& state) {
  State& s = *state;
  std::unique_lock<std::mutex> lk(s.mu);
  for (;;) {
    s.cv.wait(lk, [&] { return !s.queue.empty() || s.stop; });
    if (s.queue.empty()) return;  // stopped, and nothing is left to run
    auto fn = std::move(s.queue.front());
    s.queue.pop_front();
    lk.unlock();
    fn();
    fn = nullptr;  // its captures (the Work, the tensors) go before the next wait
    lk.lock();
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
