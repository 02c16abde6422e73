// Process pools: tasks/s of map over N trivial tasks at chunksize 1 and 1000, the round
// trip of one apply_async, and map over 2,000 1-KiB tensors. Peers (multiprocessing.Pool,
// torch.multiprocessing.Pool) run from bench/peers/python_pool.py; bench/run_bench.py runs
// both side by side. A pool of 2 worker processes (fork start method, as Python's default
// on Linux), created once per benchmark.
//
// Starting a worker, BM_ProcessStart/<fork|forkserver|spawn>: the time from Process::start
// to the child running its target. The parent reads CLOCK_MONOTONIC (system-wide, so the
// child's reading is comparable) just before start(); the target's first action reads it
// and stores it in a shared Value<int64_t>; the parent joins the child, then takes child -
// parent. One untimed start first (forkserver: it starts the server), then --starts timed
// starts one after another, each joined before the next. Counters: start_us_median and
// start_us_p99 (nearest rank: the slowest start when --starts < 100); the manual time is
// the median. Peer: multiprocessing.Process in python_pool.py, the same way.
//   pool_bench [--tasks N] [--starts N] [Google Benchmark flags]
#include <benchmark/benchmark.h>

#include <ATen/ATen.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "torchpar/torchpar.h"

namespace tp = torchpar;

namespace {

int64_t g_tasks = 200000;
int64_t g_starts = 50;

int inc(int x) { return x + 1; }
double tensor_sum(at::Tensor t) { return t.sum().item<double>(); }

tp::Pool make_pool() {
  return tp::Pool(tp::PoolOptions{.processes = 2, .start_method = tp::StartMethod::kFork});
}

void BM_PoolMapTrivial(benchmark::State& state) {
  const size_t chunksize = static_cast<size_t>(state.range(0));
  auto pool = make_pool();
  std::vector<int> items(static_cast<size_t>(g_tasks));
  for (size_t i = 0; i < items.size(); ++i) items[i] = static_cast<int>(i);
  (void)pool.map(&inc, std::vector<int>(1000, 1), chunksize);  // warm-up
  for (auto _ : state) {
    auto r = pool.map(&inc, items, chunksize);
    if (r.size() != items.size() || r.back() != g_tasks) state.SkipWithError("wrong results");
  }
  state.SetItemsProcessed(state.iterations() * g_tasks);
  state.counters["tasks_per_s"] = benchmark::Counter(static_cast<double>(g_tasks),
                                                     benchmark::Counter::kIsIterationInvariantRate);
}

void BM_PoolApplyAsyncRoundTrip(benchmark::State& state) {
  auto pool = make_pool();
  for (int i = 0; i < 100; ++i) (void)pool.apply(&inc, std::make_tuple(i));
  int x = 0;
  for (auto _ : state) {
    x = pool.apply_async(&inc, std::make_tuple(x)).get();
  }
  benchmark::DoNotOptimize(x);
}

void BM_PoolMapTensors1K(benchmark::State& state) {
  auto pool = make_pool();
  std::vector<at::Tensor> items;
  for (int i = 0; i < 2000; ++i) items.push_back(at::full({256}, 1.0f));  // 1 KiB each
  (void)pool.map(&tensor_sum, items, 1);
  for (auto _ : state) {
    auto r = pool.map(&tensor_sum, items);
    if (r.size() != items.size() || r[0] != 256.0) state.SkipWithError("wrong results");
  }
}

int64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

static_assert(tp::detail::is_serializable_v<tp::Value<int64_t>>,
              "record_start must be spawnable: its argument crosses exec");

// The child's target: reading the clock is its first action; the store is outside the
// measure (the parent reads the value after join).
void record_start(tp::Value<int64_t> started_ns) {
  const int64_t now = monotonic_ns();
  started_ns.set(now);
}

// One start with `method`: microseconds from just before start() to the target's first
// action. Empty `error` on success.
double start_latency_us(tp::StartMethod method, tp::Value<int64_t>& started_ns,
                        std::string& error) {
  started_ns.set(0);
  tp::Process p(tp::ProcessOptions{.start_method = method}, &record_start, started_ns);
  const int64_t t0 = monotonic_ns();
  p.start();
  if (!p.join(std::chrono::seconds(120))) {
    p.kill();
    p.join();
    error = "a child did not exit within 120 s";
    return 0;
  }
  const int64_t t1 = started_ns.get();
  if (p.exitcode() != 0 || t1 == 0) {
    error = "a child failed (exit code " + std::to_string(p.exitcode().value_or(-1)) + ")";
    return 0;
  }
  return static_cast<double>(t1 - t0) / 1e3;
}

// The nearest-rank percentile q (0..1] of sorted values.
double percentile(const std::vector<double>& sorted, double q) {
  const auto rank = static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

double median(const std::vector<double>& sorted) {
  const size_t n = sorted.size();
  return n % 2 == 1 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}

void BM_ProcessStart(benchmark::State& state, tp::StartMethod method) {
  tp::Value<int64_t> started_ns(0, /*lock=*/false);
  const size_t starts = static_cast<size_t>(std::max<int64_t>(g_starts, 1));
  std::vector<double> us;
  std::string error;
  for (auto _ : state) {
    (void)start_latency_us(method, started_ns, error);  // warm-up (forkserver: the server)
    us.clear();
    for (size_t i = 0; i < starts && error.empty(); ++i)
      us.push_back(start_latency_us(method, started_ns, error));
    if (!error.empty()) {
      state.SkipWithError(error.c_str());
      break;
    }
    std::sort(us.begin(), us.end());
    state.SetIterationTime(median(us) * 1e-6);
  }
  if (!error.empty()) return;
  state.counters["start_us_median"] = median(us);
  state.counters["start_us_p99"] = percentile(us, 0.99);
  state.counters["starts"] = static_cast<double>(starts);
}

}  // namespace

BENCHMARK(BM_PoolMapTrivial)
    ->ArgName("chunksize")
    ->Arg(1)
    ->Arg(1000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_PoolApplyAsyncRoundTrip)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_PoolMapTensors1K)->Unit(benchmark::kMillisecond)->UseRealTime();
// One iteration of --starts starts each (names: BM_ProcessStart/fork/iterations:1/manual_time).
BENCHMARK_CAPTURE(BM_ProcessStart, fork, tp::StartMethod::kFork)
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_ProcessStart, forkserver, tp::StartMethod::kForkserver)
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_ProcessStart, spawn, tp::StartMethod::kSpawn)
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  tp::init(argc, argv);
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--tasks") == 0 && i + 1 < argc) {
      g_tasks = std::atoll(argv[++i]);
    } else if (std::strcmp(argv[i], "--starts") == 0 && i + 1 < argc) {
      g_starts = std::atoll(argv[++i]);
    } else {
      rest.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
