#pragma once
// Private to src/pool: how a Pool's pending chunks go to its workers (docs/pool.md, "The
// manager thread", step 3).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "pool/completions.h"
#include "pool/messages.h"
#include "pool/worker_set.h"

namespace torchpar {
namespace detail {

/// The batching policy, as pure functions (no state: testable alone).
///
/// Why batches. A chunk used to travel alone, with at most two in flight a worker, and
/// with chunksize 1 every task paid the whole path: the manager's inbox put (a lock and
/// an archive), the worker's inbox running dry whenever the manager was late (the worker
/// spun, then slept on the inbox's futex, and the next put paid a futex wake-up), the
/// result's put waking a sleeping manager, the map caller woken by every chunk (a futex
/// wake-up and a context switch, though it waits for the last one), a waitpid a worker
/// every manager round, and the worker resolving the call's code addresses: about 20 µs
/// a trivial task (47k tasks/s), of which the wake-ups and hops (~75 µs each on these
/// VMs when they happen) were most. Now one message carries up to K chunks (limit(): K
/// from the backlog and the job's chunk time, capped at kMaxBatch and kBatchBytes), and a
/// worker is refilled when it holds K or fewer, so while a job has a backlog each worker
/// has K to 2K chunks queued and never sleeps, the manager never sleeps either (results
/// stream in; its get spins before sleeping), the caller is woken at most every
/// kWakeEvery (PoolCompletions), and a worker resolves a call once a batch.
///
/// Answers: a worker sends what it has answered when its batch is done, or kAnswerEvery
/// after its last send, or when kAnswerBytes have gathered (a batch of trivial tasks costs
/// the results queue one message, not one a chunk; an answer waits at most for the rest
/// of its batch, which limit() keeps to about kBatchWork). In flight a worker: at most 2K
/// chunks (K = 1, two in flight, for an apply_async or a job not answered yet), and no
/// more once it holds two chunks and kInflightBytes; never beyond its remaining
/// maxtasksperchild budget.
///
/// How items become chunks (chunksize 0: Python's rule) is split_chunks (async_result.h).
struct BatchPolicy {
  static constexpr size_t kMaxBatch = 64;              // chunks in one inbox message, at most
  static constexpr size_t kBatchBytes = 64 << 10;      // a batch stops growing at these bytes
  static constexpr size_t kInflightBytes = 256 << 10;  // a worker holding 2+ chunks and this
                                                       // many argument bytes waits
  // A batch aims at about this much work, estimated from the job's answers so far (so slow
  // tasks still go out one or two at a time and balance across the workers).
  static constexpr std::chrono::duration<double> kBatchWork = std::chrono::microseconds(500);
  // The weight of older answers in a job's estimate of a chunk's time (about 256 answers).
  static constexpr double kEstimateDecay = 1.0 - 1.0 / 256;

  /// K, the chunks of one batch for a job: about a fair share of the backlog
  /// (pending / (2 x takers): a short job still spreads over every worker, and the last
  /// chunks go out one by one), at most kMaxBatch, and at most about kBatchWork of the
  /// job's estimated chunk time (busy_s / answers, decayed sums). A job not answered yet
  /// (answers <= 0) goes one chunk at a time until its first answer. At least 1.
  static size_t limit(double busy_s, double answers, size_t pending, size_t takers);
  /// How many front chunks of `pending` form one batch: of the front chunk's job only, at
  /// most `want` (and at least 1 when `pending` is not empty), and no more once
  /// kBatchBytes of arguments gathered.
  static size_t take(const std::deque<PoolTask>& pending, size_t want);
  /// True when a worker holding `held` chunks of `held_bytes` argument bytes gets nothing
  /// more now: it holds two or more and kInflightBytes.
  static bool full(size_t held, size_t held_bytes) {
    return held >= 2 && held_bytes >= kInflightBytes;
  }
  /// True when a busy worker (held > 0) should wait for room for a whole batch of `n` at
  /// limit `k` (it would hold more than 2k): batches stay large.
  static bool waits(size_t held, size_t n, size_t k) { return held != 0 && held + n > 2 * k; }
  /// A job's chunk-time estimate after an answer that took `took_s` seconds.
  static void estimate(double& busy_s, double& answers, double took_s) {
    busy_s = busy_s * kEstimateDecay + took_s;
    answers = answers * kEstimateDecay + 1;
  }
};

/// The dispatcher: the pending chunks and the submitted jobs, the batches it sends to the
/// workers (BatchPolicy), and the ledger of what each worker holds (PoolWorker), so an
/// answer finds its chunk and a dead worker's chunks are settled exactly.
///
/// Safety: not thread-safe; the owner serializes every call (PoolCore's mu_). Never blocks.
class PoolDispatcher {
 public:
  /// `maxtasksperchild`: no worker is sent more chunks than this (0: no limit).
  explicit PoolDispatcher(uint64_t maxtasksperchild) : maxtasks_(maxtasksperchild) {}

  /// Queues one task a chunk of a new job (`chunks` not empty), in submission order.
  void add(std::shared_ptr<JobState> state, PoolCall call, std::vector<std::string> chunks);
  /// True when no chunk waits to be sent.
  bool idle() const { return pending_.empty(); }
  /// Hands pending chunks to the workers that take tasks, in batches (BatchPolicy). An
  /// inbox that is full (in bytes) keeps the chunks pending for a later turn while its
  /// worker has chunks to take; any other failure of the put (or Full at an idle worker)
  /// is retried with the first chunk alone, and then fails that chunk with the put's
  /// error (into `done`), and the pool goes on.
  void dispatch(WorkerSet& workers, std::vector<Completion>& done);
  /// Takes one answer: its chunk leaves its worker's ledger and becomes a completion (the
  /// values, or TaskError); it feeds the job's chunk-time estimate. A result its worker's
  /// ledger does not hold is dropped: it comes from a process already settled as dead,
  /// whose chunks failed or were sent again.
  void take_result(WorkerSet& workers, PoolResult& r, PoolClock::time_point now,
                   std::vector<Completion>& done);
  /// Settles what a dead worker held, once its sent and staged answers were taken: it began
  /// its chunks one at a time in the order they were sent, counting them (`begun`), so the
  /// chunks it began and did not answer fail with `lost` (the one it was running, and any
  /// whose answer could not be read); the ones it never began go back to the front of the
  /// pending chunks, in order, and run elsewhere.
  void settle_dead(PoolWorker& w, uint64_t begun, std::exception_ptr lost,
                   std::vector<Completion>& done);
  /// Fails every chunk `w` holds with `err` (the pool ends).
  void fail_held(PoolWorker& w, std::exception_ptr err, std::vector<Completion>& done);
  /// Fails every pending chunk with `err`.
  void fail_pending(std::exception_ptr err, std::vector<Completion>& done);

 private:
  // A submitted job until its last chunk finishes (completed or failed).
  struct Job {
    std::shared_ptr<JobState> state;
    PoolCall call;
    size_t finished = 0;
    // A chunk's time in a worker, estimated from the answers (decayed sums): sizes batches.
    double busy_s = 0, answers = 0;
  };

  size_t batch_limit(uint64_t job, size_t takers) const;
  bool send_batch(PoolWorker& w, size_t n, PoolClock::time_point now,
                  std::vector<Completion>& done);
  void fail_chunk(uint64_t job, uint32_t chunk, std::exception_ptr err,
                  std::vector<Completion>& done);

  uint64_t maxtasks_;
  std::deque<PoolTask> pending_;
  std::unordered_map<uint64_t, Job> jobs_;
  uint64_t next_job_ = 1;
};

}  // namespace detail
}  // namespace torchpar
