// The Pool's parts alone (src/pool/): the batching policy against Python's chunksize rule,
// the answer records, the completions (delivery to a JobState, callbacks), and the worker
// set with real worker processes (start, reap, replace, exit), and one task through the
// worker set, the dispatcher and the completions without the manager thread.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <thread>

#include "pool/completions.h"
#include "pool/dispatcher.h"
#include "pool/messages.h"
#include "pool/worker_set.h"
#include "support/run_tests.h"
#include "support/start_methods.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
namespace pd = torchpar::detail;
using namespace std::chrono_literals;

namespace {

int triple(int x) { return 3 * x; }

// Python's multiprocessing.Pool._map_async: chunksize, extra = divmod(n, workers * 4);
// if extra: chunksize += 1 (and no chunks at all for no items).
size_t python_chunksize(size_t n, size_t workers) {
  size_t chunksize = n / (workers * 4);
  if (n % (workers * 4) != 0) ++chunksize;
  return chunksize;
}

// One chunk of int arguments, encoded as Pool::encode_chunk does.
std::string int_chunk(std::initializer_list<int> items) {
  tp::Payload p;
  {
    pd::OutputArchive ar(p, {});
    ar(static_cast<uint64_t>(items.size()));
    for (int i : items) ar(std::tuple<int>(i));
  }
  return std::move(p.bytes);
}

// The results of one chunk, as run_chunk encodes them.
std::string int_results(std::initializer_list<int> values) {
  tp::Payload p;
  {
    pd::OutputArchive ar(p, {});
    ar(static_cast<uint64_t>(values.size()));
    for (int v : values) ar(v);
  }
  return std::move(p.bytes);
}

// Waits (polling, bounded) until slot i of `ws` is seen dead.
bool wait_dead(pd::WorkerSet& ws, size_t i) {
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < until) {
    if (!ws.alive(i)) return true;
    std::this_thread::yield();
  }
  return false;
}

}  // namespace

TEST(PoolBatchPolicy, DefaultChunksizeIsPythons) {
  // Spot values from CPython 3.11: Pool(4).map(f, range(100)) uses chunksize 7.
  EXPECT_EQ(pd::split_chunks(100, 0, 4).size(), 15u);
  EXPECT_EQ(pd::split_chunks(100, 0, 4)[0], std::make_pair(size_t{0}, size_t{7}));
  EXPECT_EQ(pd::split_chunks(100, 0, 4).back(), std::make_pair(size_t{98}, size_t{100}));
  EXPECT_TRUE(pd::split_chunks(0, 0, 4).empty());
  for (size_t workers = 1; workers <= 9; ++workers) {
    for (size_t n = 1; n <= 300; ++n) {
      const auto chunks = pd::split_chunks(n, 0, workers);
      const size_t cs = python_chunksize(n, workers);
      ASSERT_EQ(chunks.size(), (n + cs - 1) / cs) << n << " items, " << workers << " workers";
      size_t next = 0;
      for (auto [b, e] : chunks) {
        ASSERT_EQ(b, next);
        ASSERT_EQ(e, std::min(n, b + cs));
        next = e;
      }
      ASSERT_EQ(next, n);
    }
  }
  // An explicit chunksize is taken as given.
  EXPECT_EQ(pd::split_chunks(10, 4, 2).size(), 3u);
  EXPECT_EQ(pd::split_chunks(10, 4, 2).back(), std::make_pair(size_t{8}, size_t{10}));
}

TEST(PoolBatchPolicy, BatchLimitFollowsBacklogAndChunkTime) {
  using P = pd::BatchPolicy;
  // No answer yet: one chunk at a time.
  EXPECT_EQ(P::limit(0, 0, 10000, 4), 1u);
  // Trivial chunks: a fair share of the backlog (pending / (2 x takers)), capped at kMaxBatch.
  EXPECT_EQ(P::limit(1e-9, 1, 40, 4), 5u);
  EXPECT_EQ(P::limit(1e-9, 1, 100000, 4), P::kMaxBatch);
  EXPECT_EQ(P::limit(1e-9, 1, 3, 4), 1u);    // the last chunks go out one by one
  EXPECT_EQ(P::limit(1e-9, 1, 40, 0), 20u);  // no taker counts as one
  // About kBatchWork (500 us) of estimated work: 100 us chunks go 5 at a time, 1 ms ones alone.
  EXPECT_EQ(P::limit(100e-6, 1, 100000, 4), 5u);
  EXPECT_EQ(P::limit(2 * 100e-6, 2, 100000, 4), 5u);
  EXPECT_EQ(P::limit(1e-3, 1, 100000, 4), 1u);
  // The estimate decays: after many fast answers a slow history fades.
  double busy = 1.0, answers = 1;
  for (int i = 0; i < 4096; ++i) P::estimate(busy, answers, 1e-9);
  EXPECT_EQ(P::limit(busy, answers, 100000, 4), P::kMaxBatch);
}

TEST(PoolBatchPolicy, BatchTakesOneJobUpToItsLimitAndByteBudget) {
  using P = pd::BatchPolicy;
  std::deque<pd::PoolTask> pending;
  for (uint32_t c = 0; c < 5; ++c) pending.push_back({1, c, std::string(10, 'a')});
  for (uint32_t c = 0; c < 5; ++c) pending.push_back({2, c, std::string(10, 'b')});
  EXPECT_EQ(P::take({}, 8), 0u);
  EXPECT_EQ(P::take(pending, 3), 3u);
  EXPECT_EQ(P::take(pending, 8), 5u);  // stops at the next job
  pending.erase(pending.begin(), pending.begin() + 5);
  EXPECT_EQ(P::take(pending, 8), 5u);
  // kBatchBytes: a batch stops growing there, but its first chunk always goes.
  std::deque<pd::PoolTask> big;
  for (uint32_t c = 0; c < 4; ++c) big.push_back({3, c, std::string(P::kBatchBytes / 2, 'c')});
  EXPECT_EQ(P::take(big, 8), 2u);
  big.front().args.assign(P::kBatchBytes * 2, 'c');
  EXPECT_EQ(P::take(big, 8), 1u);
  // A worker holding two chunks and kInflightBytes is full; a busy one waits for room.
  EXPECT_FALSE(P::full(1, P::kInflightBytes * 4));
  EXPECT_TRUE(P::full(2, P::kInflightBytes));
  EXPECT_FALSE(P::waits(0, 64, 1));  // an idle worker takes any batch
  EXPECT_FALSE(P::waits(1, 1, 1));   // K = 1: two in flight
  EXPECT_TRUE(P::waits(2, 1, 1));
  EXPECT_FALSE(P::waits(8, 8, 8));
  EXPECT_TRUE(P::waits(9, 8, 8));
}

TEST(PoolAnswers, RecordsRoundTripAndATruncatedOneFails) {
  pd::PoolResult a{7, 3, 1, true, "values", "", ""};
  pd::PoolResult b{7, 4, 1, false, "", "std::domain_error", "no"};
  const std::string bytes = pd::encode_answer(a) + pd::encode_answer(b);
  std::vector<pd::PoolResult> out;
  pd::decode_answers(bytes, out);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].chunk, 3u);
  EXPECT_EQ(out[0].values, "values");
  EXPECT_FALSE(out[1].ok);
  EXPECT_EQ(out[1].type, "std::domain_error");
  out.clear();
  EXPECT_THROW(pd::decode_answers(std::string_view(bytes).substr(0, bytes.size() - 1), out),
               tp::SerializationError);
  EXPECT_EQ(out.size(), 1u);  // the whole records before the bad one are kept
}

TEST(PoolCompletions, DeliversChunksAndRunsOnDoneAfterTheLast) {
  pd::PoolCompletions completions;
  auto job = std::make_shared<pd::JobState>(3, &pd::unpack_values<int>);
  int on_done_runs = 0;
  job->on_done = [&] { ++on_done_runs; };
  std::vector<pd::Completion> done;
  done.push_back({job, 1, int_results({4, 5}), nullptr, {}});
  completions.finish(done);
  EXPECT_TRUE(done.empty());
  EXPECT_EQ(job->ndone, 1u);
  ASSERT_EQ(job->chunks[1].values.size(), 2u);
  EXPECT_EQ(std::any_cast<int>(job->chunks[1].values[1]), 5);
  EXPECT_EQ(on_done_runs, 0);
  EXPECT_LE(completions.drain_wait(pd::PoolClock::now()), pd::PoolCompletions::kIdleWait);
  // A chunk whose results cannot be decoded fails with the decoder's error.
  done.push_back({job, 0, "not an archive", nullptr, {}});
  done.push_back({job, 2, {}, std::make_exception_ptr(tp::TaskError("E", "m")), {}});
  completions.finish(done);
  EXPECT_EQ(job->ndone, 3u);
  EXPECT_EQ(on_done_runs, 1);
  EXPECT_TRUE(job->chunks[0].error);
  EXPECT_TRUE(job->first_error);
  EXPECT_TRUE(job->wait(0s));
  // Done jobs are forgotten: the manager may wait its longest again.
  EXPECT_EQ(completions.drain_wait(pd::PoolClock::now()), pd::PoolCompletions::kIdleWait);
  // finish_now, from any thread, completes at once; a chunk is recorded only once.
  auto one = std::make_shared<pd::JobState>(1, &pd::unpack_values<int>);
  done.push_back({one, 0, int_results({9}), nullptr, {}});
  done.push_back({one, 0, int_results({10}), nullptr, {}});
  pd::PoolCompletions::finish_now(done);
  EXPECT_EQ(pd::decode_one<int>(*one), 9);
}

class PoolWorkerSetTest : public tp::testing::StartMethodTest {};

TEST_P(PoolWorkerSetTest, StartsReapsReplacesAndEndsWorkers) {
  pd::PoolCompletions completions;
  pd::WorkerSet ws(options(2), nullptr, completions.results());
  ASSERT_EQ(ws.size(), 2u);
  const auto pids = ws.pids();
  ASSERT_GT(pids[0], 0);
  ASSERT_GT(pids[1], 0);
  EXPECT_NE(pids[0], pids[1]);
  EXPECT_TRUE(ws.alive(0));
  EXPECT_EQ(ws.takers(), 2u);
  EXPECT_EQ(ws.by_id(0), &ws[0]);
  EXPECT_EQ(ws.by_id(1), &ws[1]);
  // A worker killed: reaped, an early death (it answered nothing), replaced with a new id.
  ASSERT_EQ(::kill(pids[0], SIGKILL), 0);
  ASSERT_TRUE(wait_dead(ws, 0));
  const pd::WorkerDeath death =
      ws.autopsy(0, [](const std::exception& e) { ADD_FAILURE() << e.what(); });
  EXPECT_EQ(death.pid, pids[0]);
  EXPECT_EQ(death.code, -SIGKILL);
  EXPECT_TRUE(death.staged.empty());
  EXPECT_EQ(death.begun, 0u);
  ws.bury(0, death);
  EXPECT_FALSE(ws.keep_dying());  // one early death of the 3 x 2 allowed
  EXPECT_EQ(ws.pids()[0], -1);
  EXPECT_TRUE(ws.any_process());
  ws.start(0);
  EXPECT_GT(ws.pids()[0], 0);
  EXPECT_NE(ws.pids()[0], pids[0]);
  EXPECT_EQ(ws.by_id(0), nullptr);  // the dead process's results are not its replacement's
  EXPECT_EQ(ws.by_id(2), &ws[0]);
  // Told to exit (nothing held), both end cleanly.
  EXPECT_TRUE(ws.all_idle());
  ws.tell_to_exit();
  EXPECT_EQ(ws.takers(), 0u);
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(wait_dead(ws, i));
    EXPECT_EQ(ws.autopsy(i, [](const std::exception&) {}).code, 0);
  }
  // After kill_all nothing starts again.
  ws.kill_all();
  EXPECT_THROW(ws.start(1), tp::ClosedError);
  ws.end(0);
  ws.end(1);
  EXPECT_FALSE(ws.any_process());
}

TEST_P(PoolWorkerSetTest, OneJobThroughTheParts) {
  pd::PoolCompletions completions;
  pd::WorkerSet ws(options(1), nullptr, completions.results());
  pd::PoolDispatcher dispatcher(0);
  auto job = std::make_shared<pd::JobState>(2, &pd::unpack_values<int>);
  using Tuple = std::tuple<int>;
  dispatcher.add(job, pd::make_call<decltype(&triple), Tuple>(&triple),
                 {int_chunk({1, 2}), int_chunk({3})});
  EXPECT_FALSE(dispatcher.idle());
  std::vector<pd::Completion> done;
  dispatcher.dispatch(ws, done);
  // Not answered yet: one chunk a batch, two in flight.
  EXPECT_TRUE(dispatcher.idle());
  EXPECT_TRUE(done.empty());
  EXPECT_EQ(ws[0].outstanding.size(), 2u);
  EXPECT_EQ(ws[0].sent, 2u);
  std::vector<pd::PoolResult> got;
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (got.size() < 2 && std::chrono::steady_clock::now() < until)
    completions.drain(got, std::chrono::duration<double>(1), 2);
  ASSERT_EQ(got.size(), 2u);
  for (auto& r : got) dispatcher.take_result(ws, r, pd::PoolClock::now(), done);
  EXPECT_TRUE(ws.all_idle());
  EXPECT_EQ(ws[0].answered, 2u);
  completions.finish(done);
  ASSERT_TRUE(job->wait(0s));
  EXPECT_EQ(pd::decode_all<int>(*job), (std::vector<int>{3, 6, 9}));
  ws.kill_all();
  ws.end(0);
}

TORCHPAR_INSTANTIATE_FOR_START_METHODS(PoolWorkerSetTest);

int main(int argc, char** argv) {
  torchpar::init(argc, argv);
  return torchpar::testing::run_tests(argc, argv);
}
