// The Pool's worker set: one process a slot, each with its own inbox and AnswerStage page,
// all answering into one results queue (worker_set.h).
#include "pool/worker_set.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <string_view>
#include <thread>

#include <fmt/format.h>

namespace torchpar {
namespace detail {

WorkerSet::WorkerSet(PoolOptions options, WorkerContextFn context, Queue<std::string> results)
    : options_(std::move(options)), context_(std::move(context)), results_(std::move(results)) {
  if (options_.processes == 0)
    options_.processes = std::max(1u, std::thread::hardware_concurrency());
  workers_.resize(options_.processes);
  generations_.assign(workers_.size(), 0);
  worker_pids_.assign(workers_.size(), -1);
  for (size_t i = 0; i < workers_.size(); ++i) start(i);
}

void WorkerSet::start(size_t i) {
  PoolWorker& w = workers_[i];
  w = PoolWorker();
  // Results name their process, not just its slot: an answer of a process already
  // settled as dead can never be taken for one of its replacement's.
  uint64_t id = generations_[i]++ * workers_.size() + i;
  if (id > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    generations_[i] = 1;
    id = i;
  }
  w.id = static_cast<int32_t>(id);
  ProcessOptions po;
  po.name = fmt::format("PoolWorker-{}", i);
  po.daemon = options_.daemon;
  po.start_method = options_.start_method;
  po.threads = options_.threads;
  PoolInit init = pool_init(options_.init);
  if (init.set)
    init.args = std::make_shared<Payload>(init.make_args());  // fresh exports per worker
  WorkerContext context;
  if (context_) {
    context.set = true;
    context.payload = std::make_shared<Payload>(context_(i));
  }
  w.proc = std::make_unique<Process>(po, pool_worker_main, static_cast<int>(w.id), w.inbox,
                                     results_, w.stage, options_.maxtasksperchild, init, context);
  std::lock_guard<std::mutex> lock(pid_mu_);  // kill_all() must see every live worker
  if (stopped_) throw ClosedError("the pool was terminated");
  w.proc->start();
  worker_pids_[i] = w.proc->pid();
}

// Under pid_mu_, so kill_all() never signals a pid that was already reaped (and reused).
bool WorkerSet::alive(size_t i) {
  std::lock_guard<std::mutex> lock(pid_mu_);
  if (workers_[i].proc->is_alive()) return true;
  worker_pids_[i] = -1;
  return false;
}

PoolWorker* WorkerSet::by_id(int32_t id) {
  if (id < 0) return nullptr;
  PoolWorker& w = workers_[static_cast<size_t>(id) % workers_.size()];
  return w.id == id ? &w : nullptr;
}

WorkerDeath WorkerSet::autopsy(size_t i,
                               const std::function<void(const std::exception&)>& unreadable) {
  PoolWorker& w = workers_[i];
  WorkerDeath d;
  d.code = w.proc->exitcode().value_or(-1);
  d.pid = w.proc->pid();
  AnswerStage& page = *w.stage.get_obj();
  const uint64_t staged = std::min<uint64_t>(
      std::atomic_ref<uint64_t>(page.staged).load(std::memory_order_acquire), kAnswerBytes);
  try {
    decode_answers(std::string_view(page.records, staged), d.staged);
  } catch (const std::exception& e) {
    unreadable(e);
  }
  d.begun = std::atomic_ref<uint64_t>(page.begun).load(std::memory_order_acquire);
  return d;
}

void WorkerSet::bury(size_t i, const WorkerDeath& death) {
  PoolWorker& w = workers_[i];
  // Died without answering anything (a failing initializer?). Counted on answers, not on
  // tasks sent: its unstarted tasks were sent again elsewhere.
  if (death.code != 0 && w.answered == 0) ++early_deaths_;
  w.proc.reset();
}

size_t WorkerSet::takers() const {
  size_t n = 0;
  for (auto& w : workers_) n += w.takes_tasks() ? 1 : 0;
  return n;
}

bool WorkerSet::any_process() const {
  for (auto& w : workers_)
    if (w.proc) return true;
  return false;
}

bool WorkerSet::all_idle() const {
  for (auto& w : workers_)
    if (!w.outstanding.empty()) return false;
  return true;
}

void WorkerSet::tell_to_exit() {
  for (auto& w : workers_) {
    if (w.proc && !w.told_to_exit) {
      w.told_to_exit = true;
      try {
        w.inbox.put(PoolBatch{}, std::chrono::duration<double>(0));  // exit
      } catch (...) {
        w.proc->kill();  // it holds no task: ending it is as good
      }
    }
  }
}

std::vector<int> WorkerSet::pids() const {
  std::vector<int> out;
  for (auto& w : workers_) out.push_back(w.proc ? w.proc->pid() : -1);
  return out;
}

void WorkerSet::kill_all() noexcept {
  std::lock_guard<std::mutex> lock(pid_mu_);
  stopped_ = true;
  for (int pid : worker_pids_)
    if (pid > 0) ::kill(pid, SIGKILL);
}

void WorkerSet::end(size_t i) noexcept {
  PoolWorker& w = workers_[i];
  if (!w.proc) return;
  {
    std::lock_guard<std::mutex> lock(pid_mu_);
    try {
      w.proc->kill();
      w.proc->join(std::chrono::seconds(10));
    } catch (...) {
    }
    worker_pids_[i] = -1;
  }
  w.proc.reset();
}

}  // namespace detail
}  // namespace torchpar
