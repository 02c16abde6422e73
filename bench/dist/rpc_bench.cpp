// RPC between two processes on this host: torchpar's RpcGroup calling functions registered
// by name (rpc_sync / rpc_async). The peer, torch.distributed.rpc with its TensorPipe backend,
// runs from bench/peers/python_rpc.py; bench/run_bench.py (`torchpar bench`, section rpc)
// runs both side by side and prints ratios.
//
// This program is rank 0 ("caller") of a 2-rank World on 127.0.0.1; before its first
// benchmark it forks rank 1 ("callee"), both join one RpcGroup, and every benchmark reuses
// it (the callee only serves calls, on its RPC thread pool). An iteration is one batch of N
// calls, timed in the caller; a warm-up batch (100 calls, 20 of 1 MiB) runs first, and every
// reply is checked.
//   BM_RpcSyncTiny                rpc_sync<int>(callee, "add", {i, 1}): two ints, one back
//   BM_RpcSyncTensor1M/shared:0   rpc_sync<float>(callee, "first_element", {t}), t a fresh
//                                 at::full({262144}, i) each call (1 MiB float32, its
//                                 creation timed too); the reply is one float, so this is
//                                 the 1 MiB transfer
//   BM_RpcSyncTensor1M/shared:1   the same with one tensor moved to torchpar shared memory
//                                 (share_memory_) before the loop, t[0] = i before each
//                                 call: it travels as a handle
//   BM_RpcAsyncInFlight64         rpc_async<int>(callee, "add") keeping 64 calls outstanding
//                                 (waits for the oldest before issuing the 65th)
// Round trips report the counter us_per_call = the median batch time / N; the in-flight
// benchmark reports items_per_second (calls/s). Not measured: raw TensorPipe ping-pong (the
// transport's limit), since TensorPipe's headers stay inside
// src/dist/rpc/transport/tensorpipe/.
//   rpc_bench [--calls N] [--tensor-calls N] [Google Benchmark flags]
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "support/bench_main.h"
#include "torchpar/dist/rpc_group.h"
#include "torchpar/dist/world.h"
#include "torchpar/ipc/connection.h"
#include "torchpar/process/process.h"
#include "torchpar/process/start_method.h"
#include "torchpar/shm/share.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

int64_t g_calls = 2000;        // calls per tiny or in-flight batch (--calls)
int64_t g_tensor_calls = 200;  // calls per 1 MiB batch (--tensor-calls)
constexpr int64_t kWarmup = 100;
constexpr int64_t kWarmupTensor = 20;
constexpr int64_t kNumel = 262144;  // float32: 1 MiB
constexpr size_t kInFlight = 64;
constexpr auto kWait = 60s;  // rendezvous and stop bound; every call has RPC's 60 s timeout
const std::string kCaller = "caller", kCallee = "callee", kGroup = "rpc_bench";

// Functions by name: registered in both processes (static initializers of this binary).
const bool kAdd = tp::register_function(
    "add", +[](int a, int b) { return a + b; });
const bool kFirstElement = tp::register_function(
    "first_element", +[](at::Tensor t) { return t.data_ptr<float>()[0]; });

tp::WorldOptions world_options(int rank, int port) {
  return tp::WorldOptions{.name = rank == 0 ? kCaller : kCallee,
                          .rank = rank,
                          .world_size = 2,
                          .master_addr = "127.0.0.1",
                          .master_port = port,
                          .timeout = kWait};
}

/// Rank 1: joins the group and serves calls until the caller says stop (or is gone).
void callee_main(int port, tp::Connection ctl) {
  tp::World world(world_options(1, port));
  tp::RpcGroup group = world.create_rpc_group(kGroup, {kCaller, kCallee});
  // Unbounded: the stop message or EOF ends it, and this child dies with its parent anyway.
  try {
    (void)ctl.recv<int64_t>();
  } catch (const tp::ClosedError&) {  // the caller is gone
  }
  group.destroy();
}

/// The caller's World and group plus the callee process, made once for every benchmark.
/// Lifetime: close() (or the destructor) leaves the group, stops the callee (killed after
/// 10 s) and then leaves the World, whose store this process hosts.
class Session {
 public:
  Session() : Session(tp::find_free_port(), tp::Pipe()) {}
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session() { close(); }

  tp::RpcGroup& group() { return group_; }

  void close() noexcept {
    if (closed_) return;
    closed_ = true;
    try {
      group_.destroy();
    } catch (const std::exception&) {  // the callee is stopped below either way
    }
    try {
      ctl_.send(int64_t{0});
      if (!callee_.join(10s)) {
        callee_.kill();
        callee_.join(10s);
      }
    } catch (const std::exception&) {
    }
    world_.reset();
  }

 private:
  static tp::ProcessOptions callee_options() {
    tp::ProcessOptions o;
    o.name = kCallee;
    o.start_method = tp::StartMethod::kFork;  // before this process starts any thread of RPC
    o.daemon = true;                          // killed with its Process object on failure
    return o;
  }

  Session(int port, std::pair<tp::Connection, tp::Connection> pipe)
      : ctl_(std::move(pipe.first)),
        callee_(callee_options(), callee_main, port, std::move(pipe.second)) {
    callee_.start();
    world_.emplace(world_options(0, port));
    group_ = world_->create_rpc_group(kGroup, {kCaller, kCallee});
  }

  tp::Connection ctl_;
  tp::Process callee_;
  std::optional<tp::World> world_;
  tp::RpcGroup group_;
  bool closed_ = false;
};

std::unique_ptr<Session> g_session;
std::string g_session_error;  // why the session could not start (tried once)

tp::RpcGroup& rpc_group() {
  if (!g_session && g_session_error.empty()) {
    try {
      g_session = std::make_unique<Session>();
    } catch (const std::exception& e) {
      g_session_error = e.what();
    }
  }
  if (!g_session) throw std::runtime_error("setup failed: " + g_session_error);
  return g_session->group();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

/// Runs `warmup` calls of call(i), then each iteration as a batch of n calls; reports
/// us_per_call (the median batch time / n) and items_per_second.
template <class Call>
void timed_batches(benchmark::State& state, int64_t n, int64_t warmup, const Call& call) {
  for (int64_t i = 0; i < warmup; ++i) call(i);
  std::vector<double> seconds;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n; ++i) call(i);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  state.SetItemsProcessed(state.iterations() * n);
  if (!seconds.empty())
    state.counters["us_per_call"] = median(std::move(seconds)) / static_cast<double>(n) * 1e6;
}

void BM_RpcSyncTiny(benchmark::State& state) {
  try {
    tp::RpcGroup& g = rpc_group();
    timed_batches(state, g_calls, kWarmup, [&](int64_t i) {
      const int a = static_cast<int>(i);
      const int got = g.rpc_sync<int>(kCallee, "add", std::tuple{a, 1});
      if (got != a + 1) throw std::runtime_error(fmt::format("add({}, 1) returned {}", a, got));
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void BM_RpcSyncTensor1M(benchmark::State& state) {
  try {
    tp::RpcGroup& g = rpc_group();
    const bool shared = state.range(0) != 0;
    at::Tensor resent;
    if (shared) {
      resent = at::zeros({kNumel});
      tp::share_memory_(resent);
    }
    timed_batches(state, g_tensor_calls, kWarmupTensor, [&](int64_t i) {
      const auto v = static_cast<float>(i);
      at::Tensor t;
      if (shared) {
        resent.data_ptr<float>()[0] = v;
        t = resent;
      } else {
        t = at::full({kNumel}, v);
      }
      const float got = g.rpc_sync<float>(kCallee, "first_element", std::tuple{t});
      if (got != v) throw std::runtime_error(fmt::format("first_element: {}, want {}", got, v));
    });
    state.SetBytesProcessed(state.iterations() * g_tensor_calls * kNumel *
                            static_cast<int64_t>(sizeof(float)));
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void BM_RpcAsyncInFlight64(benchmark::State& state) {
  try {
    tp::RpcGroup& g = rpc_group();
    auto batch = [&](int64_t n) {
      std::deque<std::pair<int, tp::RpcFuture<int>>> pending;
      auto retire = [&] {
        const auto& [j, f] = pending.front();
        const int got = f.wait();  // bounded by the call's own timeout
        if (got != j + 1) throw std::runtime_error(fmt::format("add({}, 1) returned {}", j, got));
        pending.pop_front();
      };
      for (int64_t i = 0; i < n; ++i) {
        if (pending.size() == kInFlight) retire();
        const int a = static_cast<int>(i);
        pending.emplace_back(a, g.rpc_async<int>(kCallee, "add", std::tuple{a, 1}));
      }
      while (!pending.empty()) retire();
    };
    batch(kWarmup);
    for (auto _ : state) batch(g_calls);
    state.SetItemsProcessed(state.iterations() * g_calls);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

}  // namespace

BENCHMARK(BM_RpcSyncTiny)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_RpcSyncTensor1M)
    ->ArgName("shared")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_RpcAsyncInFlight64)->Unit(benchmark::kMillisecond)->UseRealTime();

int main(int argc, char** argv) {
  return tp::bench::run_benchmarks(argc, argv,
                                   {{"--calls", &g_calls}, {"--tensor-calls", &g_tensor_calls}},
                                   [] { g_session.reset(); });  // stops the callee
}
