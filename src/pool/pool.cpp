// The process Pool: each worker has its own inbox queue, so the manager thread knows
// exactly which tasks a worker holds. Chunks travel to a worker in batches and their
// answers come back together when they come quickly (kAnswerEvery). A worker counts the
// chunks it begins, and stages its answers, in a page it shares with the manager
// (AnswerStage), so when it dies its staged answers are still delivered, the chunk it was
// running fails with WorkerLostError, the ones it had not begun run elsewhere, the
// worker is replaced, and the pool goes on.
#include "torchpar/pool/pool.h"

#include <c10/util/Type.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iterator>
#include <limits>
#include <string_view>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>

#include "torchpar/ipc/shared_value.h"

namespace torchpar {
namespace detail {

namespace {
std::shared_ptr<Payload> g_worker_context;
}  // namespace

const Payload& worker_context_payload() {
  static const Payload empty;
  return g_worker_context ? *g_worker_context : empty;
}

/// One chunk of a job: its place in the job and its encoded argument tuples (run_chunk).
struct PoolTask {
  uint64_t job = 0;
  uint32_t chunk = 0;
  std::string args;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(job, chunk, args);
  }
};

/// One inbox message: chunks of one job that a worker runs in order, and the job's call
/// (sent once a batch: its code addresses name a module by path). No chunks: the worker
/// exits.
struct PoolBatch {
  PoolCall call;
  std::vector<PoolTask> tasks;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(call, tasks);
  }
};

/// A chunk's answer: its results (run_chunk) when ok, else the exception's type and message.
struct PoolResult {
  uint64_t job = 0;
  uint32_t chunk = 0;
  int32_t worker = 0;
  bool ok = true;
  std::string values;
  std::string type, message;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(job, chunk, worker, ok, values, type, message);
  }
};

namespace {

// A worker's answers wait for company until its batch is done, or kAnswerEvery after its
// last send, or until kAnswerBytes of them gathered: a batch of trivial tasks costs the
// results queue one message, not one a chunk.
constexpr auto kAnswerEvery = std::chrono::microseconds(50);
constexpr size_t kAnswerBytes = 64 << 10;

}  // namespace

/// A worker's page shared with the manager. The worker counts each chunk in `begun`
/// before running it, and stages each answer in `records` (a 4-byte length, then the
/// encoded PoolResult) before it publishes `staged` and, later, sends them all as one
/// results message (then `staged` goes back to 0). After the worker's death the manager
/// reads both: staged answers are delivered (one already sent is dropped as a duplicate),
/// chunks begun and not answered fail, the others run elsewhere.
struct AnswerStage {
  uint64_t begun = 0;
  uint64_t staged = 0;  // bytes of `records` that hold whole records
  char records[kAnswerBytes];
};

namespace {

// `r` as one record of AnswerStage::records (and of a results message): a 4-byte length,
// then the payload, encoded in place after it (the archive appends to the bytes it finds).
std::string encode_answer(const PoolResult& r) {
  Payload p;
  uint32_t n = 0;
  p.bytes.assign(sizeof n, '\0');
  {
    OutputArchive ar(p, {});
    ar(r);
  }
  n = static_cast<uint32_t>(p.bytes.size() - sizeof n);
  std::memcpy(p.bytes.data(), &n, sizeof n);
  return std::move(p.bytes);
}

// Appends the records in `bytes` to `out`. Throws SerializationError for a malformed one.
void decode_answers(std::string_view bytes, std::vector<PoolResult>& out) {
  while (!bytes.empty()) {
    uint32_t n = 0;
    if (bytes.size() < sizeof n) throw SerializationError("Pool: a truncated answer record");
    std::memcpy(&n, bytes.data(), sizeof n);
    bytes.remove_prefix(sizeof n);
    if (n > bytes.size()) throw SerializationError("Pool: a truncated answer record");
    out.push_back(loads<PoolResult>(Payload{std::string(bytes.substr(0, n)), {}}));
    bytes.remove_prefix(n);
  }
}

}  // namespace

// Runs in every worker process; `stage` is its page shared with the manager (AnswerStage).
void pool_worker_main(int index, Queue<PoolBatch> inbox, Queue<std::string> results,
                      Value<AnswerStage> stage, uint64_t maxtasks, PoolInit init,
                      WorkerContext context) {
  if (context.set) g_worker_context = context.payload;
  if (init.set) {
    auto tramp = reinterpret_cast<Trampoline>(from_code_address(init.call.tramp));
    tramp(from_code_address(init.call.fn), *init.args);
  }
  AnswerStage& page = *stage.get_obj();
  std::atomic_ref<uint64_t> begun(page.begun), staged(page.staged);
  // The last call's code addresses, resolved: resolving searches the loaded modules, and
  // batches mostly share one call.
  PoolCall resolved_call;
  TaskTrampoline tramp = nullptr;
  void* fn = nullptr;
  auto same = [](const CodeAddress& a, const CodeAddress& b) {
    return a.offset == b.offset && a.module == b.module;
  };
  auto last_send = std::chrono::steady_clock::now();
  auto send_staged = [&] {
    const uint64_t n = staged.load(std::memory_order_relaxed);
    if (n == 0) return;
    results.put(std::string(page.records, n));
    staged.store(0, std::memory_order_release);
  };
  for (uint64_t n = 0; maxtasks == 0 || n < maxtasks;) {
    // Waits as every Queue get does: spins (kSpinIterations, tens of µs), then sleeps on
    // the queue's futex. The parent's death kills us (PDEATHSIG).
    PoolBatch batch = inbox.get();
    if (batch.tasks.empty()) return;
    // The manager never sends past the maxtasksperchild budget; a batch runs whole.
    for (size_t i = 0; i < batch.tasks.size(); ++i) {
      const PoolTask& task = batch.tasks[i];
      begun.store(++n, std::memory_order_release);
      PoolResult r;
      r.job = task.job;
      r.chunk = task.chunk;
      r.worker = index;
      try {
        // Resolved in the try: a module this process lacks fails the chunk (TaskError).
        if (tramp == nullptr || !same(batch.call.tramp, resolved_call.tramp) ||
            !same(batch.call.fn, resolved_call.fn)) {
          tramp = nullptr;
          fn = from_code_address(batch.call.fn);
          tramp = reinterpret_cast<TaskTrampoline>(from_code_address(batch.call.tramp));
          resolved_call = batch.call;
        }
        r.values = tramp(fn, task.args);
      } catch (const std::exception& e) {
        r.ok = false;
        r.values.clear();
        r.type = c10::demangle(typeid(e).name());
        r.message = e.what();
      }
      const std::string rec = encode_answer(r);
      uint64_t used = staged.load(std::memory_order_relaxed);
      if (used + rec.size() > kAnswerBytes) {
        send_staged();
        used = 0;
      }
      if (rec.size() > kAnswerBytes) {
        results.put(rec);  // too large to stage: it travels alone, now
      } else {
        std::memcpy(page.records + used, rec.data(), rec.size());
        staged.store(used + rec.size(), std::memory_order_release);
      }
      const auto now = std::chrono::steady_clock::now();
      if (i + 1 == batch.tasks.size() || now - last_send >= kAnswerEvery) {
        send_staged();
        last_send = now;
      }
    }
  }
}

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxBatch = 64;              // chunks in one inbox message, at most
constexpr size_t kBatchBytes = 64 << 10;      // a batch stops growing at this many argument bytes
constexpr size_t kInflightBytes = 256 << 10;  // a worker holding 2+ chunks and this much waits
// A batch aims at about this much work, estimated from the job's answers so far (so slow
// tasks still go out one or two at a time and balance across the workers).
constexpr std::chrono::duration<double> kBatchWork = std::chrono::microseconds(500);
// The weight of older answers in a job's estimate of a chunk's time (about 256 answers).
constexpr double kEstimateDecay = 1.0 - 1.0 / 256;
// Waiters on a job that is not done are woken at most this often (its last chunk: at once).
constexpr std::chrono::duration<double> kWakeEvery = std::chrono::microseconds(200);
constexpr auto kReapEvery = std::chrono::milliseconds(1);  // waitpid while results stream
constexpr auto kIdleWait = std::chrono::milliseconds(5);   // the manager's longest wait
constexpr size_t kDrainMax = 64;  // results taken in one round before dispatching again

}  // namespace

class PoolCore {
 public:
  PoolCore(PoolOptions o, WorkerContextFn worker_context)
      : options_(std::move(o)), worker_context_(std::move(worker_context)) {
    if (options_.processes == 0)
      options_.processes = std::max(1u, std::thread::hardware_concurrency());
    workers_.resize(options_.processes);
    generations_.assign(workers_.size(), 0);
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
      Job& j = jobs_[id];
      j.state = job;
      j.call = std::move(call);
      for (uint32_t c = 0; c < chunks.size(); ++c)
        pending_.push_back(PoolTask{id, c, std::move(chunks[c])});
      if (!broken_) dispatch(done);  // idle workers start now, not at the manager's next turn
    }
    finish_now(done);
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
  // A chunk in a worker's hands: sent, not answered yet.
  struct Sent {
    PoolTask task;         // kept: a chunk the worker never began is sent again, elsewhere
    uint64_t seq = 0;      // chunks sent to this process before it (it begins them in order)
    Clock::time_point at;  // when it was sent
  };

  struct Worker {
    std::unique_ptr<Process> proc;
    Queue<PoolBatch> inbox{0, {.capacity_bytes = 1 << 20}};
    Value<AnswerStage> stage{AnswerStage{}, /*lock=*/false};  // shared with the process
    int32_t id = -1;  // PoolResult::worker of this process's results (the slot, and a generation)
    std::deque<Sent> outstanding;  // in the order the worker runs them
    size_t outstanding_bytes = 0;  // their argument bytes
    uint64_t sent = 0;             // chunks sent to this process
    uint64_t answered = 0;         // results received from it
    Clock::time_point last_answer;
    bool told_to_exit = false;
  };

  // A submitted job until its last chunk finishes (completed or failed).
  struct Job {
    std::shared_ptr<JobState> state;
    PoolCall call;
    size_t finished = 0;
    // A chunk's time in a worker, estimated from the answers (decayed sums): sizes batches.
    double busy_s = 0, answers = 0;
  };

  // Completes (job, chunk) outside the lock: callbacks may run user code.
  // A chunk's results stay encoded until finish(): decoding runs outside the lock.
  struct Completion {
    std::shared_ptr<JobState> job;
    uint32_t chunk;
    std::string results;
    std::exception_ptr error;
    std::vector<std::any> values;  // decoded from `results` by finish
  };

  void start_worker(size_t i) {
    Worker& w = workers_[i];
    w = Worker();
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
    if (worker_context_) {
      context.set = true;
      context.payload = std::make_shared<Payload>(worker_context_(i));
    }
    w.proc = std::make_unique<Process>(po, pool_worker_main, static_cast<int>(w.id), w.inbox,
                                       results_, w.stage, options_.maxtasksperchild, init, context);
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

  Worker* worker_of(int32_t id) {
    if (id < 0) return nullptr;
    Worker& w = workers_[static_cast<size_t>(id) % workers_.size()];
    return w.id == id ? &w : nullptr;
  }

  // Under mu_, once a dead worker's sent results were taken. First the answers it had
  // staged and not sent (AnswerStage). It began its chunks one at a time in the order they
  // were sent, counting them in `begun` first, so what it still holds then splits exactly:
  // the chunks it began and did not answer fail with WorkerLostError (the one it was
  // running, and any whose answer could not be read); the ones it never began go back to
  // the front of pending_, in order, and run elsewhere.
  void settle_dead(Worker& w, int pid, int code, std::vector<Completion>& done) {
    AnswerStage& page = *w.stage.get_obj();
    const uint64_t staged = std::min<uint64_t>(
        std::atomic_ref<uint64_t>(page.staged).load(std::memory_order_acquire), kAnswerBytes);
    std::vector<PoolResult> answers;
    try {
      decode_answers(std::string_view(page.records, staged), answers);
    } catch (const std::exception& e) {
      report_unreadable(e);  // the records before the bad one still count
    }
    const auto now = Clock::now();
    for (auto& r : answers) take_result(r, now, done);
    const uint64_t begun = std::atomic_ref<uint64_t>(page.begun).load(std::memory_order_acquire);
    const auto lost = std::make_exception_ptr(WorkerLostError(pid, code));
    std::vector<PoolTask> again;
    for (Sent& s : w.outstanding) {
      if (s.seq >= begun)
        again.push_back(std::move(s.task));
      else
        fail_chunk(s.task.job, s.task.chunk, lost, done);
    }
    pending_.insert(pending_.begin(), std::make_move_iterator(again.begin()),
                    std::make_move_iterator(again.end()));
    w.outstanding.clear();
    w.outstanding_bytes = 0;
  }

  // Under mu_. A result its worker's outstanding list does not hold is dropped: it comes
  // from a process already settled as dead, whose chunks failed or were sent again.
  void take_result(PoolResult& r, Clock::time_point now, std::vector<Completion>& done) {
    early_deaths_ = 0;  // workers do get work done
    Worker* w = worker_of(r.worker);
    if (w == nullptr) return;
    auto& out = w->outstanding;
    size_t p = 0;
    while (p < out.size() && !(out[p].task.job == r.job && out[p].task.chunk == r.chunk)) ++p;
    if (p == out.size()) return;  // earlier ones (p > 0): answers lost, they fail at its death
    ++w->answered;
    // It began this chunk when it was sent or when its previous answer came, the later.
    const auto began = std::max(out[p].at, w->last_answer);
    w->last_answer = now;
    w->outstanding_bytes -= std::min(w->outstanding_bytes, out[p].task.args.size());
    out.erase(out.begin() + static_cast<std::ptrdiff_t>(p));
    auto it = jobs_.find(r.job);
    if (it == jobs_.end()) return;
    Job& job = it->second;
    job.busy_s = job.busy_s * kEstimateDecay +
                 std::chrono::duration<double>(now - std::min(now, began)).count();
    job.answers = job.answers * kEstimateDecay + 1;
    std::exception_ptr err = r.ok ? nullptr : std::make_exception_ptr(TaskError(r.type, r.message));
    done.push_back(Completion{job.state, r.chunk, std::move(r.values), err, {}});
    if (++job.finished == job.state->chunks.size()) jobs_.erase(it);
  }

  void fail_all_pending(std::exception_ptr err, std::vector<Completion>& done) {
    for (auto& t : pending_) fail_chunk(t.job, t.chunk, err, done);
    pending_.clear();
  }

  void fail_chunk(uint64_t job, uint32_t chunk, std::exception_ptr err,
                  std::vector<Completion>& done) {
    auto it = jobs_.find(job);
    if (it == jobs_.end()) return;
    done.push_back(Completion{it->second.state, chunk, {}, err, {}});
    if (++it->second.finished == it->second.state->chunks.size()) jobs_.erase(it);
  }

  // Takes up to `max` results, waiting up to `wait` for the first (nullopt: not at all).
  // The wait spins briefly before it sleeps (the queue's get), so a stream of results
  // never puts the manager to sleep. Never throws (it runs with mu_ released by hand). A
  // result that cannot be read is reported once on stderr; its chunk then fails when its
  // worker exits.
  void drain_results(std::vector<PoolResult>& out, Timeout wait, size_t max) {
    for (bool first = true; out.size() < max; first = false) {
      try {
        decode_answers(results_.get(first && wait ? *wait : std::chrono::duration<double>(0)), out);
      } catch (const Empty&) {
        return;
      } catch (const std::exception& e) {
        report_unreadable(e);
        return;
      }
    }
  }

  void report_unreadable(const std::exception& e) {
    if (!result_error_reported_)
      std::fprintf(stderr, "torchpar: Pool: a worker's result could not be read: %s\n", e.what());
    result_error_reported_ = true;
  }

  static void decode(Completion& c) {
    if (c.error) return;
    try {
      c.values = c.job->unpack(c.results);
    } catch (...) {
      c.error = std::current_exception();
    }
    c.results.clear();
  }

  // Any thread: completes each chunk through JobState::complete (waking its waiters).
  static void finish_now(std::vector<Completion>& done) {
    for (auto& c : done) {
      decode(c);
      c.job->complete(c.chunk, std::move(c.values), c.error);
    }
    done.clear();
  }

  // The manager thread: completes the chunks as JobState::complete does, but wakes the
  // waiters of a job that is not done at most every kWakeEvery (see wake_later). A job's
  // last chunk wakes them at once and runs its on_done callback.
  void finish(std::vector<Completion>& done) {
    for (auto& c : done) decode(c);
    const auto now = Clock::now();
    for (size_t i = 0; i < done.size();) {
      const std::shared_ptr<JobState> job = done[i].job;
      JobState& j = *job;
      std::function<void()> on_done;
      bool last = false;
      size_t e = i;
      {
        std::lock_guard<std::mutex> lock(j.mu);
        for (; e < done.size() && done[e].job.get() == &j; ++e)
          last |= j.record_locked(done[e].chunk, std::move(done[e].values), done[e].error, on_done);
      }
      i = e;
      if (last) {
        quiet_.erase(&j);
        j.cv.notify_all();
        JobState::run_on_done(on_done);
      } else {
        wake_later(job, now);
      }
    }
    done.clear();
  }

  // A job with chunks completed since its waiters were last woken. A caller of map waits
  // for the last chunk only, yet every completion used to wake it (a futex wake-up and a
  // context switch a chunk); an imap consumer takes what is done when it calls next(),
  // and one already asleep wakes within kWakeEvery.
  struct Quiet {
    std::shared_ptr<JobState> job;
    Clock::time_point woken;
    bool pending = false;
  };

  void wake_later(const std::shared_ptr<JobState>& job, Clock::time_point now) {
    auto [it, fresh] = quiet_.try_emplace(job.get());
    Quiet& q = it->second;
    q.job = job;
    if (fresh || now - q.woken >= kWakeEvery) {
      job->cv.notify_all();
      q.woken = now;
      q.pending = false;
    } else {
      q.pending = true;
    }
  }

  // Wakes the waiters whose kWakeEvery has passed (all of them when `all`); forgets the
  // jobs quiet for a whole period (their next completion wakes at once).
  void wake_due(Clock::time_point now, bool all) {
    for (auto it = quiet_.begin(); it != quiet_.end();) {
      Quiet& q = it->second;
      if (!all && now - q.woken < kWakeEvery) {
        ++it;
      } else if (q.pending) {
        q.job->cv.notify_all();
        q.woken = now;
        q.pending = false;
        if (all)
          it = quiet_.erase(it);
        else
          ++it;
      } else {
        it = quiet_.erase(it);
      }
    }
  }

  // How long the manager may wait for results: until the next due wake-up, at most kIdleWait.
  std::chrono::duration<double> drain_wait(Clock::time_point now) const {
    std::chrono::duration<double> wait = kIdleWait;
    for (const auto& [key, q] : quiet_)
      if (q.pending)
        wait = std::min(wait, std::max(std::chrono::duration<double>(0),
                                       std::chrono::duration<double>(q.woken - now) + kWakeEvery));
    return wait;
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
    std::vector<PoolResult> got;
    auto last_reap = Clock::now();
    for (;;) {
      // 1. Results, then (same lock) refill the workers they came from, then complete.
      drain_results(got, drain_wait(Clock::now()), kDrainMax);
      const auto now = Clock::now();
      const bool idle_round = got.empty();
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& r : got) take_result(r, now, done);
        if (!stop_) dispatch(done);
      }
      got.clear();
      finish(done);
      wake_due(Clock::now(), false);
      // 2. Dead workers, close and terminate. A waitpid a worker each round cost about as
      // much as a trivial task: while results stream in, look at most every kReapEvery.
      if (!idle_round && !stop_.load() && now - last_reap < kReapEvery) continue;
      last_reap = now;
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
          drain_results(got, std::nullopt, std::numeric_limits<size_t>::max());
          lock.lock();
          for (auto& r : got) take_result(r, Clock::now(), done);
          got.clear();
          const int code = w.proc->exitcode().value_or(-1);
          const int pid = w.proc->pid();
          // Fails the chunk it was running; what it never began goes to the others.
          settle_dead(w, pid, code, done);
          // Died without answering anything (a failing initializer?). Counted on answers,
          // not on tasks sent: its unstarted tasks went back to pending_ above.
          if (code != 0 && w.answered == 0) ++early_deaths_;
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
                  w.inbox.put(PoolBatch{}, std::chrono::duration<double>(0));  // exit
                } catch (...) {
                  w.proc->kill();  // it holds no task: ending it is as good
                }
              }
            }
          }
        }
      }
      finish(done);
      wake_due(Clock::now(), false);
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
      for (auto& s : w.outstanding)
        fail_chunk(s.task.job, s.task.chunk, error("the pool was terminated while this task ran"),
                   done);
      w.outstanding.clear();
      w.outstanding_bytes = 0;
      w.proc.reset();
    }
    for (auto& t : pending_)
      fail_chunk(t.job, t.chunk, error("the pool was terminated before this task ran"), done);
    pending_.clear();
    closed_ = true;
    finished_ = true;
    finished_cv_.notify_all();
    lock.unlock();
    finish_now(done);
    wake_due(Clock::now(), true);
  }

  // How many chunks go to a worker in one inbox message for the job at the front of
  // pending_: about a fair share of the backlog (pending / (2 x workers): a short job still
  // spreads over every worker, and the last chunks go out one by one), at most kMaxBatch,
  // and at most about kBatchWork of the job's estimated chunk time (slow tasks balance as
  // before). A job not answered yet goes one chunk at a time until its first answer.
  size_t batch_limit(uint64_t job, size_t takers) const {
    auto it = jobs_.find(job);
    if (it == jobs_.end() || it->second.answers <= 0) return 1;
    double k = static_cast<double>(
        std::min(kMaxBatch, pending_.size() / (2 * std::max<size_t>(takers, 1))));
    const double per_chunk = it->second.busy_s / it->second.answers;
    if (per_chunk > 0) k = std::min(k, kBatchWork.count() / per_chunk);
    return std::max<size_t>(1, static_cast<size_t>(k));
  }

  // Under mu_: hands pending chunks to workers, in batches. Never blocks.
  //
  // Why batches. A chunk used to travel alone, with at most two in flight a worker, and
  // with chunksize 1 every task paid the whole path: the manager's inbox put (a lock and
  // an archive), the worker's inbox running dry whenever the manager was late (the worker
  // spun, then slept on the inbox's futex, and the next put paid a futex wake-up), the
  // result's put waking a sleeping manager, the map caller woken by every chunk (a futex
  // wake-up and a context switch, though it waits for the last one), a waitpid a worker
  // every manager round, and the worker resolving the call's code addresses: about 20 µs
  // a trivial task (47k tasks/s), of which the wake-ups and hops (~75 µs each on these
  // VMs when they happen) were most. Now one message carries up to K chunks (batch_limit:
  // K from the backlog and the job's chunk time, capped at kMaxBatch and kBatchBytes), and a
  // worker is refilled when it holds K or fewer, so while a job has a backlog each worker
  // has K to 2K chunks queued and never sleeps, the manager never sleeps either (results
  // stream in; its get spins before sleeping), the caller is woken at most every
  // kWakeEvery, waitpid runs every kReapEvery, and a worker resolves a call once a batch.
  //
  // Answers: a worker sends what it has answered when its batch is done, or kAnswerEvery
  // after its last send, or when kAnswerBytes have gathered (a batch of trivial tasks costs
  // the results queue one message, not one a chunk; an answer waits at most for the rest
  // of its batch, which batch_limit keeps to about kBatchWork). It begins its chunks
  // strictly in the order sent, counting them, and stages each answer before sending it,
  // both in shared memory (AnswerStage), so a dead worker's losses are exact (settle_dead):
  // its staged answers are delivered, the chunk it was running fails, the ones it had not
  // begun run elsewhere. In flight a worker: at most 2K chunks (K = 1, two in flight, for an
  // apply_async or a job not answered yet), and no more once it holds two chunks and
  // kInflightBytes; never beyond its remaining maxtasksperchild budget.
  //
  // An inbox that is full (in bytes) keeps the chunks pending for a later turn while its
  // worker has chunks to take; any other failure of the put (or Full at an idle worker)
  // is retried with the first chunk alone, and then fails that chunk with the put's error,
  // and the pool goes on.
  void dispatch(std::vector<Completion>& done) {
    if (pending_.empty()) return;
    size_t takers = 0;
    for (auto& w : workers_) takers += (w.proc && !w.told_to_exit) ? 1 : 0;
    const auto now = Clock::now();
    for (auto& w : workers_) {
      if (!w.proc || w.told_to_exit) continue;
      while (!pending_.empty()) {
        uint64_t budget = std::numeric_limits<uint64_t>::max();
        if (options_.maxtasksperchild != 0) {
          if (w.sent >= options_.maxtasksperchild) break;
          budget = options_.maxtasksperchild - w.sent;
        }
        const size_t held = w.outstanding.size();
        if (held >= 2 && w.outstanding_bytes >= kInflightBytes) break;
        const uint64_t job = pending_.front().job;
        const size_t k = batch_limit(job, takers);
        // The batch: the front chunks of one job, up to k, the budget and kBatchBytes.
        const size_t want = static_cast<size_t>(std::min<uint64_t>(k, budget));
        size_t n = 0, bytes = 0;
        while (n < want && n < pending_.size() && pending_[n].job == job &&
               (n == 0 || bytes + pending_[n].args.size() <= kBatchBytes))
          bytes += pending_[n++].args.size();
        // A busy worker waits for room for the whole batch: batches stay large.
        if (held + n > 2 * k && held != 0) break;
        if (!send_batch(w, n, now, done)) break;
      }
    }
  }

  // Sends the first `n` pending chunks to `w` as one batch. False: `w` gets nothing more
  // this turn.
  bool send_batch(Worker& w, size_t n, Clock::time_point now, std::vector<Completion>& done) {
    for (;;) {
      PoolBatch b;
      b.call = jobs_.at(pending_.front().job).call;
      b.tasks.assign(std::make_move_iterator(pending_.begin()),
                     std::make_move_iterator(pending_.begin() + static_cast<std::ptrdiff_t>(n)));
      pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(n));
      std::exception_ptr err;
      bool full = false;
      try {
        w.inbox.put(b, std::chrono::duration<double>(0));
      } catch (const Full&) {
        err = std::current_exception();
        full = true;
      } catch (...) {
        err = std::current_exception();
      }
      if (!err) {
        // Marked after the put succeeded; the worker's result needs mu_, which we hold.
        for (auto& t : b.tasks) {
          w.outstanding_bytes += t.args.size();
          w.outstanding.push_back(Sent{std::move(t), w.sent++, now});
        }
        return true;
      }
      pending_.insert(pending_.begin(), std::make_move_iterator(b.tasks.begin()),
                      std::make_move_iterator(b.tasks.end()));
      if (full && !w.outstanding.empty()) return false;  // room comes as it takes its batches
      if (n > 1) {
        n = 1;  // maybe too large as a batch: the first chunk alone
        continue;
      }
      fail_chunk(pending_.front().job, pending_.front().chunk, err, done);
      pending_.pop_front();
      return true;
    }
  }

  PoolOptions options_;
  WorkerContextFn worker_context_;  // CtxPool: serializes worker i's context
  std::mutex mu_;
  std::condition_variable finished_cv_;
  std::vector<Worker> workers_;
  std::vector<uint64_t> generations_;                           // processes started in each slot
  Queue<std::string> results_{0, {.capacity_bytes = 8 << 20}};  // answer records
  std::deque<PoolTask> pending_;
  std::unordered_map<uint64_t, Job> jobs_;
  uint64_t next_job_ = 1;
  bool closed_ = false;
  std::atomic<bool> stop_{false};
  bool finished_ = false;
  bool broken_ = false;
  bool result_error_reported_ = false;
  size_t early_deaths_ = 0;
  // The manager thread's own: jobs whose waiters it has not woken for every completion.
  std::unordered_map<const JobState*, Quiet> quiet_;
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
