// Tensor hand-off between processes: 4 KiB ping-pong round trips and one-way rates through
// Queue and Pipe, and 64 MiB hand-offs (fresh tensor, and re-sending a shared one). The
// peer, torch.multiprocessing, runs from bench/peers/torch_ipc.py; bench/run_bench.py (`torchpar
// bench`) runs both side by side and prints ratios.
//
// One-way rates measure as the peer does: one child and one channel for the whole benchmark,
// an untimed warm-up batch, then timed batches of n fresh tensors, each closed by the child's
// acknowledgement that it has dropped them all. (Until 2026-11-28 each timed batch had a new
// queue and a new child, so it also timed the first write of every ring page and the child's
// first import of every segment, ~12 us a page on these VMs: 323k against 441k items/s.)
#include <benchmark/benchmark.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

tp::SpawnOptions fork_no_join() {
  tp::SpawnOptions o;
  o.start_method = tp::StartMethod::kFork;
  o.join = false;
  return o;
}

// Child: returns every tensor it gets, until an empty one.
void queue_echo(int, tp::Queue<at::Tensor> in, tp::Queue<at::Tensor> out) {
  for (;;) {
    at::Tensor t = in.get(60s);
    if (t.numel() == 0) return;
    out.put(t);
  }
}

// Child: drains batches of `n` tensors, saying done after each, until an empty tensor.
void queue_drain(int, tp::Queue<at::Tensor> in, tp::Queue<int> done, int64_t n) {
  for (;;) {
    for (int64_t i = 0; i < n; ++i) {
      if (in.get(60s).numel() == 0) return;
    }
    done.put(1);
  }
}

// Child: acknowledges every tensor with an int.
void queue_ack(int, tp::Queue<at::Tensor> in, tp::Queue<int> ack) {
  for (;;) {
    at::Tensor t = in.get(120s);
    if (t.numel() == 0) return;
    ack.put(1);
  }
}

void pipe_echo(int, tp::Connection c) {
  for (;;) {
    at::Tensor t = c.recv<at::Tensor>(60s);
    if (t.numel() == 0) return;
    c.send(t);
  }
}

void pipe_drain(int, tp::Connection c, int64_t n) {
  for (;;) {
    for (int64_t i = 0; i < n; ++i) {
      if (c.recv<at::Tensor>(60s).numel() == 0) return;
    }
    c.send(1);
  }
}

void BM_QueuePingPong4K(benchmark::State& state) {
  tp::Queue<at::Tensor> a, b;
  auto ctx = tp::start_processes(queue_echo, std::make_tuple(a, b), 1, fork_no_join());
  at::Tensor t = at::ones({1024});
  for (int i = 0; i < 50; ++i) {
    a.put(t);
    t = b.get(30s);
  }
  for (auto _ : state) {
    a.put(t);
    t = b.get(30s);
  }
  a.put(at::empty({0}));
  ctx.join(30s);
  state.SetItemsProcessed(state.iterations());
}

void BM_QueueOneWay4K(benchmark::State& state) {
  const int64_t n = state.range(0);
  tp::Queue<at::Tensor> q;
  tp::Queue<int> done;
  auto ctx = tp::start_processes(queue_drain, std::make_tuple(q, done, n), 1, fork_no_join());
  auto batch = [&] {
    for (int64_t i = 0; i < n; ++i) q.put(at::ones({1024}));  // a fresh tensor each time
    (void)done.get(60s);
  };
  batch();  // warm-up
  for (auto _ : state) batch();
  q.put(at::empty({0}));
  ctx.join(30s);
  state.SetItemsProcessed(state.iterations() * n);
}

void BM_PipePingPong4K(benchmark::State& state) {
  auto [mine, theirs] = tp::Pipe();
  auto ctx = tp::start_processes(pipe_echo, std::make_tuple(theirs), 1, fork_no_join());
  at::Tensor t = at::ones({1024});
  for (int i = 0; i < 50; ++i) {
    mine.send(t);
    t = mine.recv<at::Tensor>(30s);
  }
  for (auto _ : state) {
    mine.send(t);
    t = mine.recv<at::Tensor>(30s);
  }
  mine.send(at::empty({0}));
  ctx.join(30s);
  state.SetItemsProcessed(state.iterations());
}

void BM_PipeOneWay4K(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto [mine, theirs] = tp::Pipe();
  auto ctx = tp::start_processes(pipe_drain, std::make_tuple(theirs, n), 1, fork_no_join());
  auto batch = [&, &mine = mine] {
    for (int64_t i = 0; i < n; ++i) mine.send(at::ones({1024}));  // a fresh tensor each time
    (void)mine.recv<int>(60s);
  };
  batch();  // warm-up
  for (auto _ : state) batch();
  mine.send(at::empty({0}));
  ctx.join(30s);
  state.SetItemsProcessed(state.iterations() * n);
}

void BM_QueueHandoff64M(benchmark::State& state) {
  const bool resend = state.range(0) != 0;
  tp::Queue<at::Tensor> q;
  tp::Queue<int> ack;
  auto ctx = tp::start_processes(queue_ack, std::make_tuple(q, ack), 1, fork_no_join());
  at::Tensor shared = at::ones({16 << 20});
  tp::share_memory_(shared);
  q.put(shared);
  (void)ack.get(60s);
  for (auto _ : state) {
    at::Tensor t;
    if (!resend) {
      state.PauseTiming();
      t = at::ones({16 << 20});  // fresh, private: put moves it to shared memory
      state.ResumeTiming();
    } else {
      t = shared;
    }
    q.put(t);
    (void)ack.get(60s);
  }
  q.put(at::empty({0}));
  ctx.join(30s);
  state.SetBytesProcessed(state.iterations() * (int64_t{64} << 20));
}

}  // namespace

BENCHMARK(BM_QueuePingPong4K)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_QueueOneWay4K)->Arg(20000)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_PipePingPong4K)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_PipeOneWay4K)->Arg(20000)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_QueueHandoff64M)
    ->ArgName("resend")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

int main(int argc, char** argv) {
  torchpar::init(argc, argv);
  at::set_num_threads(1);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
