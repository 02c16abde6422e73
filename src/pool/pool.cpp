// The process Pool: each worker has its own inbox queue, so the manager thread knows
// exactly which tasks a worker holds; when a worker dies those tasks fail with
// WorkerLostError, the worker is replaced, and the pool goes on.
#include "torchpar/pool/pool.h"

#include <c10/util/Type.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <thread>

#include <fmt/format.h>

namespace torchpar {
namespace detail {

namespace {
std::shared_ptr<Payload> g_worker_context;
}  // namespace

const Payload& worker_context_payload() {
  static const Payload empty;
  return g_worker_context ? *g_worker_context : empty;
}

// Runs in every worker process.
void pool_worker_main(int index, Queue<PoolTask> inbox, Queue<PoolResult> results,
                      uint64_t maxtasks, PoolInit init, WorkerContext context) {
  if (context.set) g_worker_context = context.payload;
  if (init.set) {
    auto tramp = reinterpret_cast<Trampoline>(from_code_address(init.call.tramp));
    tramp(from_code_address(init.call.fn), *init.args);
  }
  for (uint64_t n = 0; maxtasks == 0 || n < maxtasks; ++n) {
    PoolTask task = inbox.get();  // the parent's death kills us (PDEATHSIG)
    if (task.job == 0) return;
    PoolResult r;
    r.job = task.job;
    r.chunk = task.chunk;
    r.worker = index;
    try {
      auto tramp = reinterpret_cast<TaskTrampoline>(from_code_address(task.call.tramp));
      void* fn = from_code_address(task.call.fn);
      r.values = tramp(fn, task.args);
    } catch (const std::exception& e) {
      r.ok = false;
      r.values.clear();
      r.type = c10::demangle(typeid(e).name());
      r.message = e.what();
    }
    results.put(r);
  }
}

class PoolCore {
 public:
  PoolCore(PoolOptions o, WorkerContextFn worker_context)
      : options_(std::move(o)), worker_context_(std::move(worker_context)) {
    if (options_.processes == 0)
      options_.processes = std::max(1u, std::thread::hardware_concurrency());
    workers_.resize(options_.processes);
    worker_pids_.assign(workers_.size(), -1);
    for (size_t i = 0; i < workers_.size(); ++i) start_worker(i);
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
      const uint64_t id = next_job_++;
      jobs_[id] = job;
      for (uint32_t c = 0; c < chunks.size(); ++c)
        pending_.push_back(PoolTask{id, c, call, std::move(chunks[c])});
      if (!broken_) dispatch(done);  // idle workers start now, not at the manager's next turn
    }
    finish(done);
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
    {
      std::lock_guard<std::mutex> lock(pid_mu_);
      for (int pid : worker_pids_)
        if (pid > 0) ::kill(pid, SIGKILL);
    }
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
    std::vector<int> out;
    for (auto& w : workers_) out.push_back(w.proc ? w.proc->pid() : -1);
    return out;
  }

 private:
  struct Worker {
    std::unique_ptr<Process> proc;
    Queue<PoolTask> inbox{0, {.capacity_bytes = 1 << 20}};
    std::vector<std::pair<uint64_t, uint32_t>> outstanding;
    uint64_t sent = 0;
    uint64_t answered = 0;  // results received from it
    bool told_to_exit = false;
  };

  void start_worker(size_t i) {
    Worker& w = workers_[i];
    w = Worker();
    ProcessOptions po;
    po.name = fmt::format("PoolWorker-{}", i);
    po.daemon = options_.daemon;
    po.start_method = options_.start_method;
    po.threads = options_.threads;
    PoolInit init = pool_init(options_.init);
    if (init.set)
      init.args = std::make_shared<Payload>(init.make_args());  // fresh exports per worker
    WorkerContext context;
    if (worker_context_) {
      context.set = true;
      context.payload = std::make_shared<Payload>(worker_context_(i));
    }
    w.proc = std::make_unique<Process>(po, pool_worker_main, static_cast<int>(i), w.inbox, results_,
                                       options_.maxtasksperchild, init, context);
    std::lock_guard<std::mutex> lock(pid_mu_);  // terminate() must see every live worker
    if (stop_.load()) throw ClosedError("the pool was terminated");
    w.proc->start();
    worker_pids_[i] = w.proc->pid();
  }

  // Under pid_mu_, so terminate() never signals a pid that was already reaped (and reused).
  bool worker_alive(size_t i) {
    std::lock_guard<std::mutex> lock(pid_mu_);
    if (workers_[i].proc->is_alive()) return true;
    worker_pids_[i] = -1;
    return false;
  }

  // A dead worker's inbox: the tasks it never took go back to the front of pending_ (in
  // order) and leave its outstanding list; what stays there is what it had begun.
  void requeue_unstarted(Worker& w) {
    std::vector<PoolTask> unstarted;
    for (;;) {
      try {
        unstarted.push_back(w.inbox.get_nowait());
      } catch (...) {
        break;  // Empty, or a message the worker was taking when it died (it counts as begun)
      }
    }
    for (auto it = unstarted.rbegin(); it != unstarted.rend(); ++it) {
      if (it->job == 0) continue;
      auto& out = w.outstanding;
      auto o = std::find(out.begin(), out.end(), std::make_pair(it->job, it->chunk));
      if (o == out.end()) continue;
      out.erase(o);
      pending_.push_front(std::move(*it));
    }
  }

  // Completes (job, chunk) outside the lock: callbacks may run user code.
  // A chunk's results stay encoded until finish(): decoding runs outside the lock.
  struct Completion {
    std::shared_ptr<JobState> job;
    uint32_t chunk;
    std::string results;
    std::exception_ptr error;
  };

  void take_result(PoolResult& r, std::vector<Completion>& done) {
    early_deaths_ = 0;  // workers do get work done
    if (r.worker >= 0 && static_cast<size_t>(r.worker) < workers_.size()) {
      ++workers_[r.worker].answered;
      auto& out = workers_[r.worker].outstanding;
      for (auto it = out.begin(); it != out.end(); ++it) {
        if (it->first == r.job && it->second == r.chunk) {
          out.erase(it);
          break;
        }
      }
    }
    auto it = jobs_.find(r.job);
    if (it == jobs_.end()) return;
    std::exception_ptr err = r.ok ? nullptr : std::make_exception_ptr(TaskError(r.type, r.message));
    done.push_back(Completion{it->second, r.chunk, std::move(r.values), err});
    if (++remaining_done_[r.job] == it->second->chunks.size()) {
      remaining_done_.erase(r.job);
      jobs_.erase(it);
    }
  }

  void fail_all_pending(std::exception_ptr err, std::vector<Completion>& done) {
    for (auto& t : pending_) fail_chunk(t.job, t.chunk, err, done);
    pending_.clear();
  }

  void fail_chunk(uint64_t job, uint32_t chunk, std::exception_ptr err,
                  std::vector<Completion>& done) {
    auto it = jobs_.find(job);
    if (it == jobs_.end()) return;
    done.push_back(Completion{it->second, chunk, {}, err});
    if (++remaining_done_[job] == it->second->chunks.size()) {
      remaining_done_.erase(job);
      jobs_.erase(it);
    }
  }

  // Never throws (it runs with mu_ released by hand). A result that cannot be read is
  // reported once on stderr; its chunk then fails when its worker exits.
  void drain_results(std::vector<Completion>& done, Timeout wait) {
    for (bool first = true;; first = false) {
      try {
        PoolResult r = results_.get(first ? wait.value_or(std::chrono::duration<double>(0))
                                          : std::chrono::duration<double>(0));
        std::lock_guard<std::mutex> lock(mu_);
        take_result(r, done);
      } catch (const Empty&) {
        return;
      } catch (const std::exception& e) {
        if (!result_error_reported_)
          std::fprintf(stderr, "torchpar: Pool: a worker's result could not be read: %s\n",
                       e.what());
        result_error_reported_ = true;
        return;
      }
    }
  }

  static void finish(std::vector<Completion>& done) {
    for (auto& c : done) {
      std::vector<std::any> values;
      if (!c.error) {
        try {
          values = c.job->unpack(c.results);
        } catch (...) {
          c.error = std::current_exception();
        }
      }
      c.job->complete(c.chunk, std::move(values), c.error);
    }
    done.clear();
  }

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
    for (;;) {
      drain_results(done, std::chrono::milliseconds(5));
      finish(done);
      bool stop = false, all_exited = true, closed = false;
      {
        std::unique_lock<std::mutex> lock(mu_);
        stop = stop_.load();
        closed = closed_;
        for (size_t i = 0; i < workers_.size(); ++i) {
          Worker& w = workers_[i];
          if (!w.proc) continue;
          if (worker_alive(i)) {
            all_exited = false;
            continue;
          }
          // terminate() kills the workers before the manager sees stop_: such a death is
          // the pool's end, not a lost worker (its tasks fail with ClosedError below).
          if (stop_.load()) {
            stop = true;
            break;
          }
          // Results it sent before dying are already queued: take them first.
          lock.unlock();
          drain_results(done, std::nullopt);
          lock.lock();
          // Tasks still in its inbox never ran: they go to the others. The rest had begun.
          requeue_unstarted(w);
          const int code = w.proc->exitcode().value_or(-1);
          const int pid = w.proc->pid();
          for (auto [job, chunk] : w.outstanding)
            fail_chunk(job, chunk, std::make_exception_ptr(WorkerLostError(pid, code)), done);
          // Died without answering anything (a failing initializer?). Counted on answers,
          // not on tasks sent: its unstarted tasks went back to pending_ above.
          if (code != 0 && w.answered == 0) ++early_deaths_;
          w.outstanding.clear();
          w.proc.reset();
          if (early_deaths_ > 3 * workers_.size()) {
            // Workers die before doing anything (a failing initializer?): stop replacing them.
            fail_all_pending(std::make_exception_ptr(WorkerLostError(pid, code)), done);
            if (!broken_)
              std::fprintf(stderr,
                           "torchpar: Pool workers keep dying at start (last exit code %d); "
                           "not replacing them\n",
                           code);
            broken_ = true;
            continue;
          }
          if (!stop_ && !broken_ && !(closed_ && pending_.empty())) {
            try {
              start_worker(i);
              all_exited = false;
            } catch (...) {
              // Could not start a replacement: fail what waits rather than hang.
              workers_[i].proc.reset();
              fail_all_pending(std::current_exception(), done);
              broken_ = true;
            }
          }
        }
        if (!stop_) dispatch(done);
        if (broken_ && !pending_.empty()) {
          bool any_alive = false;
          for (auto& w : workers_) any_alive = any_alive || (w.proc != nullptr);
          if (!any_alive)
            fail_all_pending(std::make_exception_ptr(Error("the pool has no workers left")), done);
        }
        if (closed_ && !stop_ && pending_.empty()) {
          bool idle = true;
          for (auto& w : workers_) idle = idle && w.outstanding.empty();
          if (idle) {
            for (auto& w : workers_) {
              if (w.proc && !w.told_to_exit) {
                w.told_to_exit = true;
                try {
                  w.inbox.put(PoolTask{}, std::chrono::duration<double>(0));  // job 0: exit
                } catch (...) {
                  w.proc->kill();  // it holds no task: ending it is as good
                }
              }
            }
          }
        }
      }
      finish(done);
      if (stop) break;
      if (all_exited && closed) break;
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
      Worker& w = workers_[i];
      if (w.proc) {
        std::lock_guard<std::mutex> pl(pid_mu_);
        try {
          w.proc->kill();
          w.proc->join(std::chrono::seconds(10));
        } catch (...) {
        }
        worker_pids_[i] = -1;
      }
      for (auto [job, chunk] : w.outstanding)
        fail_chunk(job, chunk, error("the pool was terminated while this task ran"), done);
      w.outstanding.clear();
      w.proc.reset();
    }
    for (auto& t : pending_)
      fail_chunk(t.job, t.chunk, error("the pool was terminated before this task ran"), done);
    pending_.clear();
    closed_ = true;
    finished_ = true;
    finished_cv_.notify_all();
    lock.unlock();
    finish(done);
  }

  // Under mu_: hands pending chunks to workers with room (two in flight each, never more
  // than a worker's remaining maxtasksperchild budget). Never blocks: an inbox that is full
  // (in bytes) keeps the chunk pending for a later turn while its worker has tasks to take;
  // any other failure of the put (or Full at an idle worker: it can never fit) fails that
  // chunk with the put's error, and the pool goes on.
  void dispatch(std::vector<Completion>& done) {
    for (auto& w : workers_) {
      if (!w.proc || w.told_to_exit) continue;
      while (!pending_.empty() && w.outstanding.size() < 2 &&
             (options_.maxtasksperchild == 0 || w.sent < options_.maxtasksperchild)) {
        PoolTask& t = pending_.front();
        try {
          w.inbox.put(t, std::chrono::duration<double>(0));
        } catch (const Full&) {
          if (!w.outstanding.empty()) break;  // room comes as this worker takes its tasks
          fail_chunk(t.job, t.chunk, std::current_exception(), done);
          pending_.pop_front();
          continue;
        } catch (...) {
          fail_chunk(t.job, t.chunk, std::current_exception(), done);
          pending_.pop_front();
          continue;
        }
        // Marked after the put succeeded; the worker's result needs mu_, which we hold.
        w.outstanding.emplace_back(t.job, t.chunk);
        ++w.sent;
        pending_.pop_front();
      }
    }
  }

  PoolOptions options_;
  WorkerContextFn worker_context_;  // CtxPool: serializes worker i's context
  std::mutex mu_;
  std::condition_variable finished_cv_;
  std::vector<Worker> workers_;
  Queue<PoolResult> results_{0, {.capacity_bytes = 8 << 20}};
  std::deque<PoolTask> pending_;
  std::map<uint64_t, std::shared_ptr<JobState>> jobs_;
  std::map<uint64_t, size_t> remaining_done_;
  uint64_t next_job_ = 1;
  bool closed_ = false;
  std::atomic<bool> stop_{false};
  bool finished_ = false;
  bool broken_ = false;
  bool result_error_reported_ = false;
  size_t early_deaths_ = 0;
  // Workers' pids for terminate(), which must not take mu_. Held only for non-blocking
  // calls (start, a WNOHANG reap) and the final kill + bounded join.
  std::mutex pid_mu_;
  std::vector<int> worker_pids_;
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
