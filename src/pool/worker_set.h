#pragma once
// Private to src/pool: the Pool's worker processes, one a slot (docs/pool.md, "Parts").

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pool/messages.h"

namespace torchpar {
namespace detail {

/// A chunk in a worker's hands: sent, not answered yet.
struct SentChunk {
  PoolTask task;             // kept: a chunk the worker never began is sent again, elsewhere
  uint64_t seq = 0;          // chunks sent to this process before it (it begins them in order)
  PoolClock::time_point at;  // when it was sent
};

/// One slot's current process, its channels, and the dispatcher's ledger of what that
/// process holds (reset with every new process).
struct PoolWorker {
  std::unique_ptr<Process> proc;
  Queue<PoolBatch> inbox{0, {.capacity_bytes = 1 << 20}};
  Value<AnswerStage> stage{AnswerStage{}, /*lock=*/false};  // shared with the process
  int32_t id = -1;  // PoolResult::worker of this process's results (the slot, and a generation)
  // The ledger, kept by PoolDispatcher.
  std::deque<SentChunk> outstanding;  // in the order the worker runs them
  size_t outstanding_bytes = 0;       // their argument bytes
  uint64_t sent = 0;                  // chunks sent to this process
  uint64_t answered = 0;              // results received from it
  PoolClock::time_point last_answer;
  bool told_to_exit = false;

  /// True when the dispatcher may send it chunks.
  bool takes_tasks() const { return proc && !told_to_exit; }
};

/// What a dead worker left: how it ended, the answers it had staged and not sent (in its
/// AnswerStage), and how many chunks it had begun.
struct WorkerDeath {
  int pid = -1;
  int code = -1;
  std::vector<PoolResult> staged;
  uint64_t begun = 0;
};

/// The worker set: spawns a process a slot, reaps dead ones, starts replacements (a worker
/// that used up maxtasksperchild exits and is replaced like any other), tells idle ones to
/// exit, and notices workers that keep dying before they answer anything.
///
/// Lifetime: the constructor starts every slot's process; kill_all() and end() kill them.
/// Safety: the owner serializes every call (PoolCore's mu_), except kill_all(), which any
/// thread may call at any time: the worker pids it signals are kept under a mutex of their
/// own, so it never waits for the owner's lock (which a worker stopped while holding a
/// queue's lock could block) and never signals a pid already reaped.
class WorkerSet {
 public:
  /// Starts `options.processes` workers (0: the number of cores); each answers into
  /// `results`; worker i's context comes from `context(i)` (unset: none).
  /// Errors: what Process::start raises; the workers started before are killed.
  WorkerSet(PoolOptions options, WorkerContextFn context, Queue<std::string> results);

  size_t size() const { return workers_.size(); }
  PoolWorker& operator[](size_t i) { return workers_[i]; }

  /// Starts a new process in slot i, with a fresh ledger and a new id.
  /// Errors: ClosedError after kill_all(); what Process::start raises.
  void start(size_t i);
  /// Whether slot i's process still runs (a dead one is reaped: waitpid).
  bool alive(size_t i);
  /// The worker whose current process has result id `id`; nullptr for a process already
  /// settled as dead (or an id never given).
  PoolWorker* by_id(int32_t id);
  /// Slot i's dead process: its pid and exit code, its staged answers and begun count.
  /// A staged record that cannot be read goes to `unreadable` (those before it count).
  WorkerDeath autopsy(size_t i, const std::function<void(const std::exception&)>& unreadable);
  /// Forgets slot i's dead process once its chunks were settled; counts it as an early
  /// death when it failed without answering anything.
  void bury(size_t i, const WorkerDeath& death);
  /// True when more than 3 x size() workers died before answering anything (a failing
  /// initializer?): they should not be replaced any more.
  bool keep_dying() const { return early_deaths_ > 3 * workers_.size(); }
  /// A result arrived: workers do get work done (resets the early-death count).
  void note_answer() { early_deaths_ = 0; }
  /// Workers that take tasks (alive and not told to exit).
  size_t takers() const;
  /// True when some slot has a process (alive or not reaped yet).
  bool any_process() const;
  /// True when no worker holds a chunk.
  bool all_idle() const;
  /// Puts the exit message into every live worker's inbox, once each (one whose inbox
  /// refuses it holds nothing and is killed instead).
  void tell_to_exit();
  /// pids of the current processes (-1: none in that slot).
  std::vector<int> pids() const;

  /// SIGKILLs every live worker now; no start() succeeds after it. Never throws, never
  /// blocks on the owner's lock. Safety: any thread.
  void kill_all() noexcept;
  /// Kills slot i's process, if any, and waits for it (at most 10 s); never throws.
  void end(size_t i) noexcept;

 private:
  PoolOptions options_;
  WorkerContextFn context_;  // CtxPool: serializes worker i's context
  Queue<std::string> results_;
  std::vector<PoolWorker> workers_;
  std::vector<uint64_t> generations_;  // processes started in each slot
  size_t early_deaths_ = 0;
  // Workers' pids for kill_all(). Held only for non-blocking calls (start, a WNOHANG reap)
  // and end()'s kill + bounded join.
  mutable std::mutex pid_mu_;
  std::vector<int> worker_pids_;
  bool stopped_ = false;  // under pid_mu_: kill_all() ran
};

}  // namespace detail
}  // namespace torchpar
