#pragma once
// Private to src/pool: what travels between the Pool's parent and its worker processes
// (docs/pool.md, "Messages"), the page each worker shares with the parent (AnswerStage),
// and the loop every worker process runs (pool_worker_main, worker_main.cpp).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "torchpar/ipc/queue.h"
#include "torchpar/ipc/shared_value.h"
#include "torchpar/pool/pool.h"

namespace torchpar {
namespace detail {

using PoolClock = std::chrono::steady_clock;

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

// A worker's answers wait for company until its batch is done, or kAnswerEvery after its
// last send, or until kAnswerBytes of them gathered: a batch of trivial tasks costs the
// results queue one message, not one a chunk.
inline constexpr auto kAnswerEvery = std::chrono::microseconds(50);
inline constexpr size_t kAnswerBytes = 64 << 10;

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

/// `r` as one record of AnswerStage::records (and of a results message): a 4-byte length,
/// then the encoded PoolResult.
std::string encode_answer(const PoolResult& r);

/// Appends the records in `bytes` to `out`; those before a malformed one are kept.
/// Errors: SerializationError for a malformed (e.g. truncated) record.
void decode_answers(std::string_view bytes, std::vector<PoolResult>& out);

/// Runs in every worker process: takes batches from `inbox` until the exit message (or
/// `maxtasks` chunks, 0: no limit), answering into `results`; `stage` is its page shared
/// with the manager (AnswerStage). Errors: an exception that is not a std::exception, or
/// one from the initializer or a result's put, ends the process (the manager sees a death).
void pool_worker_main(int index, Queue<PoolBatch> inbox, Queue<std::string> results,
                      Value<AnswerStage> stage, uint64_t maxtasks, PoolInit init,
                      WorkerContext context);

}  // namespace detail
}  // namespace torchpar
