// Process pools: tasks/s of map over N trivial tasks at chunksize 1 and 1000, the round
// trip of one apply_async, and map over 2,000 1-KiB tensors. Peers (multiprocessing.Pool,
// torch.multiprocessing.Pool) run from bench/peers/python_pool.py; bench/run_bench.py runs
// both side by side. A pool of 2 worker processes (fork start method, as Python's default
// on Linux), created once per benchmark.
//   pool_bench [--tasks N] [Google Benchmark flags]
#include <benchmark/benchmark.h>

#include <ATen/ATen.h>

#include <cstring>

#include "torchpar/torchpar.h"

namespace tp = torchpar;

namespace {

int64_t g_tasks = 200000;

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

}  // namespace

BENCHMARK(BM_PoolMapTrivial)
    ->ArgName("chunksize")
    ->Arg(1)
    ->Arg(1000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_PoolApplyAsyncRoundTrip)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_PoolMapTensors1K)->Unit(benchmark::kMillisecond)->UseRealTime();

int main(int argc, char** argv) {
  tp::init(argc, argv);
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--tasks") == 0 && i + 1 < argc) {
      g_tasks = std::atoll(argv[++i]);
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
