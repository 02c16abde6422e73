// Parameter server push+pull: torchpar's PushPullGradServer, trainers pushing gradients and
// pulling the newest parameters from one server process. The peer, the same pattern written
// with torch.distributed.rpc, runs from bench/peers/python_pserver.py; bench/run_bench.py
// (`torchpar bench`, section pserver) runs both side by side and prints ratios.
//
// This program is rank 0 ("server") of a 4-rank World on 127.0.0.1; before its first
// benchmark it forks ranks 1-3 ("trainer1" .. "trainer3"), and all four join one RpcGroup that
// every benchmark reuses. The server hosts one PushPullGradServerImpl per model (created on
// first use; primary and only secondary reducer: "server"; the other options are the
// library's defaults: reduce_batch_size 4 at both levels, sum, max_queue_size 64,
// flush_after 1 s) managing its own copy of the model with SGD (lr 0.01), and the default
// ordered server the primary publishes to. Its main thread only coordinates: it tells the
// first T trainers over a control pipe to run N cycles and waits for all of them, which is one
// timed batch (an iteration). Trainers idle on their pipe otherwise.
// A cycle of a trainer, on its own copy of the model (connected with
// PushPullGradServer::connect, one pull before the first batch):
//   every parameter's gradient filled with 1e-4 (no forward/backward: the measure is the
//   server path), then client.push(vm): a CPU copy of the gradients sent to the server's
//   queue (one rpc round trip), then pull: zero_grad, the newest state dict fetched from the
//   ordered server (a second round trip) and loaded when newer than the trainer's.
// The server's reducer thread runs meanwhile: batches of 4 pushes summed as they arrive, batches
// of 4 of those set as gradients, optimizer step, the new state dict published (a copy).
//   BM_PushPull/model:0/trainers:T   the mnist_hogwild network (21,840 float32 parameters,
//                                    85 KiB): the layers of tools/torchpar/train/net.h, copied
//                                    here without its forward (only the parameters are used)
//   BM_PushPull/model:1/trainers:T   4 x Linear(1024, 1024, bias=false): 4 Mi float32
//                                    parameters, 16 MiB
// T = 1 or 3 (1 + 3 processes oversubscribe a 2-core machine). A warm-up batch (20 cycles per
// trainer, 2 for 16 MiB) runs first. Counters: cycles_per_s (all trainers' cycles / all
// batches' wall time), steps_per_s (the server's optimizer steps in that time) and
// dropped_per_push (queue entries the server dropped, oldest first, per push).
//   pserver_bench [--cycles N] [--cycles-16m N] [Google Benchmark flags]
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "support/bench_main.h"
#include "torchpar/core/auth.h"
#include "torchpar/dist/world.h"
#include "torchpar/ipc/connection.h"
#include "torchpar/process/process.h"
#include "torchpar/process/start_method.h"
#include "torchpar/rpc/rpc_group.h"
#include "torchpar/server/push_pull_grad_server.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

constexpr int kMnist = 0, k16M = 1;  // the benchmark's model argument
constexpr int kMaxTrainers = 3;
constexpr std::array<int64_t, 2> kWarmup = {20, 2};  // cycles per trainer, by model
std::array<int64_t, 2> g_cycles = {300, 10};         // per trainer per batch (--cycles[-16m])
constexpr float kGrad = 1e-4F;
constexpr double kLr = 0.01;
constexpr auto kWait = 60s;        // rendezvous and stop bound; every call has RPC's 60 s
constexpr auto kBatchWait = 600s;  // a trainer that does not finish its batch fails the run
const std::string kServer = "server", kGroup = "pserver_bench";

std::string trainer_name(int rank) { return "trainer" + std::to_string(rank); }
std::string server_name(int model) { return model == kMnist ? "ps_mnist" : "ps_16m"; }

std::vector<std::string> members() {
  std::vector<std::string> m = {kServer};
  for (int r = 1; r <= kMaxTrainers; ++r) m.push_back(trainer_name(r));
  return m;
}

// The parameters of tools/torchpar/train/net.h (pytorch/examples' mnist_hogwild Net), copied:
// that header lives in the CLI's tree, and no forward is run here.
struct MnistNet : torch::nn::Module {
  MnistNet() {
    register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 10, 5)));
    register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(10, 20, 5)));
    register_module("conv2_drop", torch::nn::Dropout2d());
    register_module("fc1", torch::nn::Linear(320, 50));
    register_module("fc2", torch::nn::Linear(50, 10));
  }
};

// 4 x 1024 x 1024 float32 weights: 16 MiB.
struct Net16M : torch::nn::Module {
  Net16M() {
    for (int i = 0; i < 4; ++i) {
      register_module("fc" + std::to_string(i),
                      torch::nn::Linear(torch::nn::LinearOptions(1024, 1024).bias(false)));
    }
  }
};

std::shared_ptr<torch::nn::Module> make_model(int model) {
  if (model == kMnist) return std::make_shared<MnistNet>();
  return std::make_shared<Net16M>();
}

/// `key`: the job's key, fresh per run (Session makes it, as `torchpar run` does per job).
tp::WorldOptions world_options(int rank, int port, tp::AuthKey key) {
  return tp::WorldOptions{.name = rank == 0 ? kServer : trainer_name(rank),
                          .rank = rank,
                          .world_size = kMaxTrainers + 1,
                          .master_addr = "127.0.0.1",
                          .master_port = port,
                          .timeout = kWait,
                          .authkey = std::move(key)};
}

/// A trainer's copy of one model and its accessor of that model's server.
struct TrainerModel {
  std::shared_ptr<torch::nn::Module> net;
  tp::VersionedModule vm;
  tp::PushPullGradServer client;
};

void cycle(TrainerModel& m) {
  for (auto& p : m.net->parameters()) {
    at::Tensor& g = p.mutable_grad();
    if (!g.defined()) g = at::zeros_like(p);
    g.fill_(kGrad);
  }
  // push returns pull's result: false when the reduction this push joined is not published
  // yet (the secondary reduces asynchronously), so pull had nothing new to load; not an error.
  m.client.push(m.vm);
}

/// Ranks 1-3: run the cycles the server asks for ({model, cycles}; model -1 stops) and
/// answer each batch with "" or the error that ended it.
void trainer_main(int rank, int port, tp::AuthKey key, tp::Connection ctl) {
  tp::World world(world_options(rank, port, std::move(key)));
  tp::RpcGroup group = world.create_rpc_group(kGroup, members());
  {
    std::map<int, TrainerModel> models;
    while (true) {
      std::pair<int64_t, int64_t> cmd;
      try {
        cmd = ctl.recv<std::pair<int64_t, int64_t>>();  // unbounded: stop or EOF ends it
      } catch (const tp::ClosedError&) {                // the server is gone
        break;
      }
      if (cmd.first < 0) break;
      std::string error;
      try {
        const int model = static_cast<int>(cmd.first);
        auto it = models.find(model);
        if (it == models.end()) {
          auto net = make_model(model);
          TrainerModel m{net, tp::VersionedModule(net),
                         tp::PushPullGradServer::connect(group, server_name(model))};
          if (!m.client.pull(m.vm)) throw std::runtime_error("first pull: nothing published");
          it = models.emplace(model, std::move(m)).first;
        }
        for (int64_t i = 0; i < cmd.second; ++i) cycle(it->second);
      } catch (const std::exception& e) {
        error = e.what();
        if (error.empty()) error = "unknown error";
      }
      ctl.send(error);
    }
  }
  group.destroy();
}

/// One model's server: its managed copy of the model and the reducer.
struct ServerModel {
  std::shared_ptr<torch::nn::Module> net;
  std::unique_ptr<tp::PushPullGradServerImpl> impl;
};

/// The server's World, group and servers plus the trainer processes, made once for every
/// benchmark. Lifetime: close() (or the destructor) closes the servers, leaves the group,
/// stops the trainers (killed after 10 s) and then leaves the World, whose store this process
/// hosts.
class Session {
 public:
  Session() : Session(tp::find_free_port(), tp::random_authkey()) {}
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session() { close(); }

  /// The server of `model`, created, managing a fresh model and started on first use.
  tp::PushPullGradServerImpl& server(int model) {
    auto& s = servers_[model];
    if (!s.impl) {
      s.net = make_model(model);
      auto impl = std::make_unique<tp::PushPullGradServerImpl>(
          server_name(model), group_,
          tp::PushPullGradServerOptions{.primary_reducer = kServer,
                                        .secondary_reducers = {kServer}});
      impl->manage_model(s.net, std::make_shared<torch::optim::SGD>(s.net->parameters(),
                                                                    torch::optim::SGDOptions(kLr)));
      impl->start();
      s.impl = std::move(impl);
    }
    return *s.impl;
  }

  /// One batch: trainers 1..`trainers` each run `cycles` cycles on `model`; returns when all
  /// are done. Errors: std::runtime_error naming a trainer that failed.
  void run(int trainers, int model, int64_t cycles) {
    for (int t = 0; t < trainers; ++t) ctl_[t].send(std::pair<int64_t, int64_t>{model, cycles});
    std::string errors;
    for (int t = 0; t < trainers; ++t) {
      const auto e = ctl_[t].recv<std::string>(kBatchWait);
      if (!e.empty())
        errors += fmt::format("{}{}: {}", errors.empty() ? "" : "; ", trainer_name(t + 1), e);
    }
    if (!errors.empty()) throw std::runtime_error(errors);
  }

  void close() noexcept {
    if (closed_) return;
    closed_ = true;
    for (auto& s : servers_) {
      try {
        if (s.impl) s.impl->close();
      } catch (const std::exception&) {  // the group goes next either way
      }
      s.impl.reset();
    }
    try {
      group_.destroy();
    } catch (const std::exception&) {  // the trainers are stopped below either way
    }
    for (size_t t = 0; t < trainers_.size(); ++t) {
      try {
        ctl_[t].send(std::pair<int64_t, int64_t>{-1, 0});
      } catch (const std::exception&) {
      }
    }
    for (auto& p : trainers_) {
      try {
        if (!p.join(10s)) {
          p.kill();
          p.join(10s);
        }
      } catch (const std::exception&) {
      }
    }
    world_.reset();
  }

 private:
  static tp::ProcessOptions trainer_options(int rank) {
    tp::ProcessOptions o;
    o.name = trainer_name(rank);
    o.start_method = tp::StartMethod::kFork;  // before this process starts any thread of RPC
    o.daemon = true;                          // killed with its Process object on failure
    return o;
  }

  Session(int port, const tp::AuthKey& key) {
    ctl_.reserve(kMaxTrainers);
    trainers_.reserve(kMaxTrainers);
    for (int r = 1; r <= kMaxTrainers; ++r) {
      auto [mine, theirs] = tp::Pipe();
      ctl_.push_back(std::move(mine));
      trainers_.emplace_back(trainer_options(r), trainer_main, r, port, key, std::move(theirs));
      trainers_.back().start();
    }
    world_.emplace(world_options(0, port, key));
    group_ = world_->create_rpc_group(kGroup, members());
  }

  std::vector<tp::Connection> ctl_;
  std::vector<tp::Process> trainers_;
  std::optional<tp::World> world_;
  tp::RpcGroup group_;
  std::array<ServerModel, 2> servers_;
  bool closed_ = false;
};

std::unique_ptr<Session> g_session;
std::string g_session_error;  // why the session could not start (tried once)

Session& session() {
  if (!g_session && g_session_error.empty()) {
    try {
      g_session = std::make_unique<Session>();
    } catch (const std::exception& e) {
      g_session_error = e.what();
    }
  }
  if (!g_session) throw std::runtime_error("setup failed: " + g_session_error);
  return *g_session;
}

int64_t model_nbytes(int model) {
  int64_t n = 0;
  for (const auto& p : make_model(model)->parameters()) n += p.numel() * p.element_size();
  return n;
}

void BM_PushPull(benchmark::State& state) {
  try {
    Session& s = session();
    const auto model = static_cast<int>(state.range(0));
    const auto trainers = static_cast<int>(state.range(1));
    const int64_t cycles = g_cycles.at(model);
    tp::PushPullGradServerImpl& server = s.server(model);
    s.run(trainers, model, kWarmup.at(model));
    const tp::GradServerStats before = server.stats();
    double seconds = 0;
    for (auto _ : state) {
      const auto t0 = std::chrono::steady_clock::now();
      s.run(trainers, model, cycles);
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    server.watch();  // a reducer that stopped fails the benchmark
    const tp::GradServerStats after = server.stats();
    const int64_t pushes = state.iterations() * trainers * cycles;
    state.SetItemsProcessed(pushes);
    // Gradients out and parameters back: two model sizes a cycle.
    state.SetBytesProcessed(pushes * 2 * model_nbytes(model));
    if (seconds > 0) {
      state.counters["cycles_per_s"] = static_cast<double>(pushes) / seconds;
      state.counters["steps_per_s"] = static_cast<double>(after.steps - before.steps) / seconds;
    }
    state.counters["dropped_per_push"] =
        static_cast<double>(after.dropped - before.dropped) / static_cast<double>(pushes);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

}  // namespace

BENCHMARK(BM_PushPull)
    ->ArgNames({"model", "trainers"})
    ->ArgsProduct({{kMnist, k16M}, {1, kMaxTrainers}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

int main(int argc, char** argv) {
  return tp::bench::run_benchmarks(
      argc, argv, {{"--cycles", &g_cycles[kMnist]}, {"--cycles-16m", &g_cycles[k16M]}},
      [] { g_session.reset(); });  // stops the trainers
}
