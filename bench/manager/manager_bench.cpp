// Manager round trips: dict set+get pairs and list appends from a child process, and 4 KiB
// float32 tensors (1024 elements, fresh each) through a manager Queue of 64 from a producer
// child to the parent. Each over TCP 127.0.0.1 (a Manager's default address) and over an
// abstract Unix socket ("@name"; Python's Manager listens on AF_UNIX). The peer, Python's
// multiprocessing.Manager, runs from bench/peers/python_manager.py; bench/run_bench.py
// (`torchpar bench`, section manager) runs both side by side and prints ratios.
//
// Each benchmark starts a manager (fork) and a child (fork). An iteration is one batch: the
// parent asks the child for N operations over a Pipe and waits for its reply (for the queue:
// the parent gets the N items the child puts and checks each). items_per_second counts
// set+get pairs, appends and tensors. A warm-up batch of 100 runs first.
//   manager_bench [--ops N] [--items N] [Google Benchmark flags]
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "support/bench_main.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

int64_t g_ops = 2000;    // dict set+get pairs or list appends per batch (--ops)
int64_t g_items = 1000;  // tensors per queue batch (--items)
constexpr int64_t kWarmup = 100;
constexpr int64_t kQueueMax = 64;
constexpr int64_t kNumel = 1024;  // float32: 4 KiB
constexpr auto kWait = 60s;       // every wait is bounded: a stuck run fails instead of hanging

using Dict = tp::DictProxy<std::string, int64_t>;
using List = tp::ListProxy<int64_t>;
using TensorQueue = tp::QueueProxy<at::Tensor>;

/// A manager served on TCP 127.0.0.1 or on a fresh abstract Unix socket.
tp::Manager start_manager(bool unix_socket) {
  static int n = 0;
  tp::ManagerOptions o;
  o.start_method = tp::StartMethod::kFork;
  o.timeout = kWait;
  if (unix_socket) o.address = fmt::format("@torchpar_manager_bench_{}_{}", ::getpid(), n++);
  return tp::Manager(o);
}

tp::ProcessOptions child_options() {
  tp::ProcessOptions o;
  o.start_method = tp::StartMethod::kFork;
  o.daemon = true;  // killed with its Process object if the benchmark fails
  return o;
}

/// Child: runs the batches the parent asks for, ("dict", n) or ("list", n), and replies with
/// the number of operations it checked; anything else ends it.
void client_child(tp::Connection ctl, Dict d, List l) {
  for (;;) {
    const auto [op, n] = ctl.recv<std::tuple<std::string, int64_t>>(kWait);
    int64_t ok = 0;
    if (op == "dict") {
      for (int64_t i = 0; i < n; ++i) {
        d.set("key", i);
        ok += d.get("key") == std::optional<int64_t>(i) ? 1 : 0;
      }
    } else if (op == "list") {
      const auto before = static_cast<int64_t>(l.size());
      for (int64_t i = 0; i < n; ++i) l.append(i);
      ok = static_cast<int64_t>(l.size()) - before;
    } else {
      return;
    }
    ctl.send(ok);
  }
}

/// Child: for every n the parent sends, puts n fresh tensors (item i filled with i); a
/// negative n ends it.
void producer_child(tp::Connection ctl, TensorQueue q) {
  for (;;) {
    const auto n = ctl.recv<int64_t>(kWait);
    if (n < 0) return;
    for (int64_t i = 0; i < n; ++i) q.put(at::full({kNumel}, static_cast<float>(i)), true, kWait);
  }
}

/// Stops a child: tells it to end, then kills it if it does not within 10 s.
template <class Stop>
void stop_child(tp::Connection& ctl, tp::Process& child, const Stop& stop) {
  try {
    ctl.send(stop);
  } catch (const std::exception&) {  // already gone: joined below
  }
  if (!child.join(10s)) {
    child.kill();
    child.join(10s);
  }
}

/// Dict or list batches from a client child (op "dict" or "list").
void client_batches(benchmark::State& state, const std::string& op) {
  try {
    tp::Manager manager = start_manager(state.range(0) != 0);
    Dict d = manager.dict<std::string, int64_t>();
    List l = manager.list<int64_t>();
    auto [mine, theirs] = tp::Pipe();
    tp::Process child(child_options(), client_child, theirs, d, l);
    child.start();
    auto batch = [&](int64_t n) {
      mine.send(std::make_tuple(op, n));
      const auto checked = mine.recv<int64_t>(kWait);
      if (checked != n)
        throw std::runtime_error(fmt::format("{}: {} of {} checked", op, checked, n));
    };
    batch(kWarmup);
    for (auto _ : state) batch(g_ops);
    state.SetItemsProcessed(state.iterations() * g_ops);
    stop_child(mine, child, std::make_tuple(std::string("stop"), int64_t{0}));
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void BM_ManagerDictSetGet(benchmark::State& state) { client_batches(state, "dict"); }
void BM_ManagerListAppend(benchmark::State& state) { client_batches(state, "list"); }

void BM_ManagerQueueTensor4K(benchmark::State& state) {
  try {
    tp::Manager manager = start_manager(state.range(0) != 0);
    TensorQueue q = manager.Queue<at::Tensor>(kQueueMax);
    auto [mine, theirs] = tp::Pipe();
    tp::Process child(child_options(), producer_child, theirs, q);
    child.start();
    auto batch = [&](int64_t n) {
      mine.send(n);
      for (int64_t i = 0; i < n; ++i) {
        const at::Tensor t = q.get(true, kWait);
        if (t.numel() != kNumel || t.data_ptr<float>()[kNumel - 1] != static_cast<float>(i))
          throw std::runtime_error(fmt::format("queue item {} has the wrong contents", i));
      }
    };
    batch(kWarmup);
    for (auto _ : state) batch(g_items);
    state.SetItemsProcessed(state.iterations() * g_items);
    stop_child(mine, child, int64_t{-1});
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

}  // namespace

BENCHMARK(BM_ManagerDictSetGet)
    ->ArgName("unix")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_ManagerListAppend)
    ->ArgName("unix")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_ManagerQueueTensor4K)
    ->ArgName("unix")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

int main(int argc, char** argv) {
  return tp::bench::run_benchmarks(argc, argv, {{"--ops", &g_ops}, {"--items", &g_items}});
}
