// The process Pool: each worker has its own inbox queue, so the manager thread knows
// exactly which tasks a worker holds. Chunks travel to a worker in batches and their
// answers come back together when they come quickly (kAnswerEvery). A worker counts the
// chunks it begins, and stages its answers, in a page it shares with the manager
// (AnswerStage), so when it dies its staged answers are still delivered, the chunk it was
// running fails with WorkerLostError, the ones it had not begun run elsewhere, the
// worker is replaced, and the pool goes on.
//
// PoolCore is the manager thread and the lock over its three parts: the worker set
// (worker_set.cpp: processes, reaping, replacement), the dispatcher (dispatcher.cpp:
// pending chunks, batches, what each worker holds) and the completions (completions.cpp:
// the results queue, delivery to AsyncResult / IMapIterator, callbacks). The loop a worker
// process runs is worker_main.cpp.
#include "torchpar/pool/pool.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <limits>
#include <thread>

#include "pool/completions.h"
#include "pool/dispatcher.h"
#include "pool/messages.h"
#include "pool/worker_set.h"

namespace torchpar {
namespace detail {

namespace {

constexpr auto kReapEvery = std::chrono::milliseconds(1);  // waitpid while results stream
constexpr size_t kDrainMax = 64;  // results taken in one round before dispatching again

}  // namespace

class PoolCore {
 public:
  PoolCore(PoolOptions o, WorkerContextFn worker_context)
      : dispatcher_(o.maxtasksperchild),
        workers_(std::move(o), std::move(worker_context), completions_.results()) {
    thread_ = std::thread([this] { manage(); });
  }

  ~PoolCore() { terminate(); }

  std::shared_ptr<JobState> submit(PoolCall call, std::vector<std::string> chunks,
                                   JobState::Unpack unpack) {
    auto job = std::make_shared<JobState>(chunks.size(), unpack);
    std::vector<Completion> done;  // chunks whose dispatch failed
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_ || stop_) throw ClosedError("Pool is closed");
      if (chunks.empty()) return job;
      dispatcher_.add(job, std::move(call), std::move(chunks));
      // Idle workers start now, not at the manager's next turn.
      if (!broken_) dispatcher_.dispatch(workers_, done);
    }
    PoolCompletions::finish_now(done);
    return job;
  }

  void close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }

  bool join(Timeout timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!closed_ && !stop_) throw Error("Pool::join() before close() or terminate()");
    auto done = [&] { return finished_; };
    if (!timeout)
      finished_cv_.wait(lock, done);
    else if (!finished_cv_.wait_for(lock, *timeout, done))
      return false;
    lock.unlock();
    join_thread();
    return true;
  }

  // Kills the workers first, without mu_: the manager may be blocked (holding mu_) on a
  // queue lock that a stopped worker holds, and only that worker's death (the queue's
  // robust mutex) releases it. Then every wait of the manager is bounded.
  void terminate() {
    stop_.store(true);
    workers_.kill_all();
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    join_thread();
  }

  void join_thread() {
    std::lock_guard<std::mutex> lock(join_mu_);  // join/terminate/destructor may race
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  }

  size_t size() const { return workers_.size(); }

  std::vector<int> pids() {
    std::lock_guard<std::mutex> lock(mu_);
    return workers_.pids();
  }

 private:
  // What a round of reaping saw (manage_loop's exit conditions).
  struct Reaped {
    bool stop = false;
    bool all_exited = true;
    bool closed = false;
  };

  // The manager thread. No exception leaves it: an unexpected one is reported on stderr
  // and ends the pool as terminate() does (what waits fails instead of hanging).
  void manage() {
    std::vector<Completion> done;
    std::exception_ptr fatal;
    try {
      manage_loop(done);
    } catch (...) {
      fatal = std::current_exception();
      try {
        std::rethrow_exception(fatal);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "torchpar: Pool manager thread failed, terminating the pool: %s\n",
                     e.what());
      } catch (...) {
        std::fprintf(stderr, "torchpar: Pool manager thread failed, terminating the pool\n");
      }
      stop_.store(true);
    }
    shut_down(done, fatal);
  }

  void manage_loop(std::vector<Completion>& done) {
    std::vector<PoolResult> got;
    auto last_reap = PoolClock::now();
    for (;;) {
      // 1. Results, then (same lock) refill the workers they came from, then complete.
      const auto now = take_results(got, done);
      const bool idle_round = got.empty();
      got.clear();
      completions_.finish(done);
      completions_.wake_due(PoolClock::now(), false);
      // 2. Dead workers, close and terminate. A waitpid a worker each round cost about as
      // much as a trivial task: while results stream in, look at most every kReapEvery.
      if (!idle_round && !stop_.load() && now - last_reap < kReapEvery) continue;
      last_reap = now;
      const Reaped r = reap(got, done);
      completions_.finish(done);
      completions_.wake_due(PoolClock::now(), false);
      if (r.stop) break;
      if (r.all_exited && r.closed) break;
    }
  }

  // Waits for results (drain_wait), takes up to kDrainMax and dispatches, under mu_.
  // Returns when they were taken; `got` keeps them (empty: an idle round).
  PoolClock::time_point take_results(std::vector<PoolResult>& got, std::vector<Completion>& done) {
    completions_.drain(got, completions_.drain_wait(PoolClock::now()), kDrainMax);
    const auto now = PoolClock::now();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& r : got) dispatcher_.take_result(workers_, r, now, done);
    if (!stop_) dispatcher_.dispatch(workers_, done);
    return now;
  }

  // Under mu_: settles dead workers and starts their replacements, dispatches, fails what
  // a pool without workers holds, and tells idle workers to exit once closed.
  Reaped reap(std::vector<PoolResult>& got, std::vector<Completion>& done) {
    Reaped r;
    std::unique_lock<std::mutex> lock(mu_);
    r.stop = stop_.load();
    r.closed = closed_;
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (!workers_[i].proc) continue;
      if (workers_.alive(i)) {
        r.all_exited = false;
        continue;
      }
      // terminate() kills the workers before the manager sees stop_: such a death is the
      // pool's end, not a lost worker (its tasks fail with ClosedError in shut_down).
      if (stop_.load()) {
        r.stop = true;
        break;
      }
      if (replace_dead(i, lock, got, done)) r.all_exited = false;
    }
    if (!stop_) dispatcher_.dispatch(workers_, done);
    if (broken_ && !dispatcher_.idle() && !workers_.any_process())
      dispatcher_.fail_pending(std::make_exception_ptr(Error("the pool has no workers left")),
                               done);
    if (closed_ && !stop_ && dispatcher_.idle() && workers_.all_idle()) workers_.tell_to_exit();
    return r;
  }

  // Under `lock` (mu_), released while it takes the results already queued: slot i's
  // process is dead. Settles what it held, then starts a replacement unless the pool is
  // terminating, closed with nothing pending, or broken. True when a replacement started.
  bool replace_dead(size_t i, std::unique_lock<std::mutex>& lock, std::vector<PoolResult>& got,
                    std::vector<Completion>& done) {
    // Results it sent before dying are already queued: take them first.
    lock.unlock();
    completions_.drain(got, std::nullopt, std::numeric_limits<size_t>::max());
    lock.lock();
    for (auto& r : got) dispatcher_.take_result(workers_, r, PoolClock::now(), done);
    got.clear();
    // Then the answers it staged and did not send; it fails the chunk it was running and
    // what it never began goes to the others.
    WorkerDeath death =
        workers_.autopsy(i, [this](const std::exception& e) { completions_.report_unreadable(e); });
    const auto now = PoolClock::now();
    for (auto& r : death.staged) dispatcher_.take_result(workers_, r, now, done);
    dispatcher_.settle_dead(workers_[i], death.begun,
                            std::make_exception_ptr(WorkerLostError(death.pid, death.code)), done);
    workers_.bury(i, death);
    if (workers_.keep_dying()) {
      // Workers die before doing anything (a failing initializer?): stop replacing them.
      dispatcher_.fail_pending(std::make_exception_ptr(WorkerLostError(death.pid, death.code)),
                               done);
      if (!broken_)
        std::fprintf(stderr,
                     "torchpar: Pool workers keep dying at start (last exit code %d); "
                     "not replacing them\n",
                     death.code);
      broken_ = true;
      return false;
    }
    if (stop_ || broken_ || (closed_ && dispatcher_.idle())) return false;
    try {
      workers_.start(i);
      return true;
    } catch (...) {
      // Could not start a replacement: fail what waits rather than hang.
      workers_[i].proc.reset();
      dispatcher_.fail_pending(std::current_exception(), done);
      broken_ = true;
      return false;
    }
  }

  // terminate (or a clean close): kill what is left; fail what never ran. Bounded: the
  // workers are dead before any join, and a join waits at most 10 s.
  void shut_down(std::vector<Completion>& done, std::exception_ptr fatal) noexcept {
    std::unique_lock<std::mutex> lock(mu_);
    auto error = [&](const char* what) {
      return fatal ? fatal : std::make_exception_ptr(ClosedError(what));
    };
    for (size_t i = 0; i < workers_.size(); ++i) {
      workers_.end(i);
      dispatcher_.fail_held(workers_[i], error("the pool was terminated while this task ran"),
                            done);
    }
    dispatcher_.fail_pending(error("the pool was terminated before this task ran"), done);
    closed_ = true;
    finished_ = true;
    finished_cv_.notify_all();
    lock.unlock();
    PoolCompletions::finish_now(done);
    completions_.wake_due(PoolClock::now(), true);
  }

  std::mutex mu_;  // over the three parts below, and the flags
  std::condition_variable finished_cv_;
  PoolCompletions completions_;  // before workers_: they answer into its queue
  PoolDispatcher dispatcher_;
  WorkerSet workers_;
  bool closed_ = false;
  std::atomic<bool> stop_{false};
  bool finished_ = false;
  bool broken_ = false;
  std::mutex join_mu_;
  std::thread thread_;
};

const PoolInit& pool_init(const Initializer& init) { return init.init_; }

}  // namespace detail

Pool::Pool(PoolOptions options) : Pool(std::move(options), nullptr) {}
Pool::Pool(PoolOptions options, detail::WorkerContextFn worker_context)
    : copy_tensor_(options.copy_tensor) {
  core_ = std::make_unique<detail::PoolCore>(std::move(options), std::move(worker_context));
}
Pool::~Pool() = default;

std::shared_ptr<detail::JobState> Pool::submit(detail::PoolCall call,
                                               std::vector<std::string> chunks,
                                               detail::JobState::Unpack unpack) {
  return core_->submit(std::move(call), std::move(chunks), unpack);
}
void Pool::close() { core_->close(); }
bool Pool::join(Timeout timeout) { return core_->join(timeout); }
void Pool::terminate() { core_->terminate(); }
size_t Pool::size() const { return core_->size(); }
std::vector<int> Pool::pids() const { return core_->pids(); }

}  // namespace torchpar
