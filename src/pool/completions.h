#pragma once
// Private to src/pool: how a Pool's results reach the callers (docs/pool.md, "The manager
// thread", step 1).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "pool/messages.h"

namespace torchpar {
namespace detail {

/// A chunk's outcome, to be recorded in its JobState outside the pool's lock (callbacks
/// may run user code). Its results stay encoded until then: decoding runs outside the lock.
struct Completion {
  std::shared_ptr<JobState> job;
  uint32_t chunk = 0;
  std::string results;
  std::exception_ptr error;
  std::vector<std::any> values;  // decoded from `results` when it is applied
};

/// Completions: the results queue every worker answers into, and the delivery of chunk
/// outcomes to their AsyncResult / IMapIterator (JobState): decoding, waking waiters,
/// running a job's on_done callback after its last chunk.
///
/// Waking. A caller of map waits for the last chunk only, yet waking it for every completion
/// costs a futex wake-up and a context switch a chunk. So on the manager thread (finish) a
/// job's last chunk wakes its waiters at once, other completions at most every kWakeEvery
/// (an imap consumer takes what is done when it calls next(), and one already asleep wakes
/// within kWakeEvery); wake_due() delivers the wake-ups that came due.
///
/// Safety: finish_now() from any thread; everything else on the manager thread only.
class PoolCompletions {
 public:
  /// Waiters on a job that is not done are woken at most this often (its last chunk: at once).
  static constexpr std::chrono::duration<double> kWakeEvery = std::chrono::microseconds(200);
  /// The manager's longest wait for results.
  static constexpr std::chrono::milliseconds kIdleWait{5};

  PoolCompletions() = default;

  /// The queue workers put their answer records into.
  Queue<std::string>& results() { return results_; }
  /// Takes up to `max` results, waiting up to `wait` for the first (nullopt: not at all).
  /// The wait spins briefly before it sleeps (the queue's get), so a stream of results
  /// never puts the manager to sleep. Never throws (the manager calls it with its lock
  /// released by hand). A message that cannot be read is reported once on stderr; its
  /// chunks then fail when their worker exits.
  void drain(std::vector<PoolResult>& out, Timeout wait, size_t max);
  /// Reports, once per pool, that a worker's result could not be read.
  void report_unreadable(const std::exception& e);

  /// Any thread: applies each completion as JobState::complete does (waking its waiters
  /// at once); empties `done`.
  static void finish_now(std::vector<Completion>& done);
  /// The manager thread: applies the completions, waking the waiters of a job that is not
  /// done at most every kWakeEvery; a job's last chunk wakes them at once and runs its
  /// on_done callback. Empties `done`.
  void finish(std::vector<Completion>& done);
  /// Wakes the waiters whose kWakeEvery has passed (all of them when `all`); forgets the
  /// jobs quiet for a whole period (their next completion wakes at once).
  void wake_due(PoolClock::time_point now, bool all);
  /// How long the manager may wait for results: until the next due wake-up, at most
  /// kIdleWait.
  std::chrono::duration<double> drain_wait(PoolClock::time_point now) const;

 private:
  // A job with chunks completed since its waiters were last woken.
  struct Quiet {
    std::shared_ptr<JobState> job;
    PoolClock::time_point woken;
    bool pending = false;
  };

  static void decode(Completion& c);
  void wake_later(const std::shared_ptr<JobState>& job, PoolClock::time_point now);

  Queue<std::string> results_{0, {.capacity_bytes = 8 << 20}};  // answer records
  bool result_error_reported_ = false;
  std::unordered_map<const JobState*, Quiet> quiet_;
};

}  // namespace detail
}  // namespace torchpar
