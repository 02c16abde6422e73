#include "workers.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <string.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "outputs.h"
#include "torchpar/dist/launch_env.h"

namespace torchpar::train {
namespace {

volatile sig_atomic_t g_stop_signal = 0;
void on_stop_signal(int sig) { g_stop_signal = sig; }

/// A worker as reports name it: index, role (pserver) and pid.
std::string worker_label(const TrainConfig& cfg, Process& p, int index) {
  if (cfg.strategy == "pserver") {
    return fmt::format("worker {} ({}, pid {})", index, index == 0 ? "parameter server" : "trainer",
                       p.pid());
  }
  return fmt::format("worker {} (pid {})", index, p.pid());
}

/// A worker that ended: how, in words. Empty while it runs.
std::string worker_failure(const TrainConfig& cfg, Process& p, int index) {
  auto code = p.exitcode();
  if (!code) return "";
  const std::string who = worker_label(cfg, p, index);
  if (auto e = p.error()) return fmt::format("{} raised {}: {}", who, e->first, e->second);
  if (*code < 0) {
    return fmt::format("{} was killed by signal {} ({})", who, -*code, ::strsignal(-*code));
  }
  return fmt::format("{} exited with code {}", who, *code);
}

/// After a worker ended: how long the others get to end on their own, so that their errors
/// join the report. pserver trainers fail within their RPC timeout once the server is gone;
/// a server does not notice a lost trainer and ddp ranks may sit out a collective timeout, so
/// those are not waited for.
Seconds settle_time(const TrainConfig& cfg, Workers& w) {
  if (cfg.strategy == "pserver" && w.procs[0].exitcode()) return Seconds(cfg.timeout + 5);
  return Seconds(0.2);
}

}  // namespace

int rank_from_env(TrainConfig& cfg, std::optional<EnvRank>& env) {
  env.reset();
  auto refuse = [](std::string_view why) {
    std::fprintf(stderr, "torchpar train: %.*s\n", static_cast<int>(why.size()), why.data());
    return 2;
  };
  // World's own reading of the launcher's variables (rendezvous's parser): what it refuses,
  // World would refuse later, after the data is loaded.
  std::optional<LaunchEnv> launch;
  std::string bad;
  try {
    launch = launch_env();
  } catch (const ValueError& e) {
    bad = e.what_without_backtrace();
  }
  if (!launch && bad.empty()) return 0;  // no launcher: train spawns its own workers
  if (cfg.strategy != "ddp") {
    return refuse(fmt::format(
        "--strategy {} cannot run as one rank of a job: RANK and WORLD_SIZE are set in the "
        "environment (by torchrun or `torchpar run`), and only --strategy ddp trains across the "
        "ranks of a job; unset RANK and WORLD_SIZE to run {} with its own workers on this host",
        cfg.strategy, cfg.strategy));
  }
  if (!launch) return refuse(bad);
  if (cfg.workers != 0 && cfg.workers != launch->world_size) {
    return refuse(fmt::format(
        "--workers {} does not match WORLD_SIZE={}: RANK and WORLD_SIZE are set in the "
        "environment, so this process is one rank of a job of WORLD_SIZE ranks and starts no "
        "workers; drop --workers or start the job with as many ranks",
        cfg.workers, launch->world_size));
  }
  cfg.workers = launch->world_size;
  env = EnvRank{.rank = launch->rank, .world_size = launch->world_size};
  return 0;
}

World join_env_world(const TrainConfig& cfg) {
  WorldOptions wo;  // rank, world size, master and key: from the environment
  wo.timeout = Seconds(cfg.timeout);
  return World(wo);
}

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

int stop_signal() { return g_stop_signal; }

void throw_if_stopped() {
  if (g_stop_signal != 0) throw Interrupted(fmt::format("signal {}", int(g_stop_signal)));
}

int complete_common_config(TrainConfig& cfg) {
  const bool pserver = cfg.strategy == "pserver";
  if (cfg.strategy != "single" && cfg.strategy != "hogwild" && cfg.strategy != "ddp" && !pserver) {
    std::fprintf(stderr,
                 "torchpar train: unknown strategy '%s' (single, hogwild, ddp or pserver)\n",
                 cfg.strategy.c_str());
    return 2;
  }
  if (cfg.workers <= 0) {
    cfg.workers =
        static_cast<int>(std::max(pserver ? 2u : 1u, std::thread::hardware_concurrency()));
  }
  if (cfg.strategy == "single") cfg.workers = 1;
  if (pserver && cfg.workers < 2) {
    std::fprintf(stderr,
                 "torchpar train: pserver needs --workers 2 or more: 1 parameter server and at "
                 "least 1 trainer (got %d)\n",
                 cfg.workers);
    return 2;
  }
  // NaN passes every comparison-based check; a timeout past kMaxTimeout overflows a deadline.
  if (!std::isfinite(cfg.lr) || !(cfg.lr > 0) || !std::isfinite(cfg.momentum) ||
      !(cfg.momentum >= 0 && cfg.momentum <= 1) || !std::isfinite(cfg.timeout) ||
      !(cfg.timeout > 0 && cfg.timeout <= kMaxTimeout)) {
    std::fprintf(stderr,
                 "torchpar train: need a finite --lr > 0 (got %g), --momentum in [0, 1] (got %g) "
                 "and --timeout in (0, %g] seconds (got %g)\n",
                 cfg.lr, cfg.momentum, kMaxTimeout, cfg.timeout);
    return 2;
  }
  if (cfg.out.empty()) cfg.out = "runs/" + now_stamp();
  if (cfg.checkpoint_dir.empty()) cfg.checkpoint_dir = cfg.out + "/checkpoints";
  try {
    (void)backend_from_string(cfg.backend);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: %s\n", e.what());
    return 2;
  }
  return 0;
}

int trainers(const TrainConfig& c) { return c.strategy == "pserver" ? c.workers - 1 : c.workers; }
int first_trainer(const TrainConfig& c) { return c.strategy == "pserver" ? 1 : 0; }
bool uses_world(const TrainConfig& c) { return c.strategy == "ddp" || c.strategy == "pserver"; }

World join_world(int rank, const TrainConfig& cfg, int port, AuthKey key) {
  WorldOptions wo;
  if (cfg.strategy == "pserver") wo.name = rank == 0 ? "server" : fmt::format("trainer{}", rank);
  wo.rank = rank;
  wo.world_size = cfg.workers;
  wo.master_addr = "127.0.0.1";
  wo.master_port = port;
  wo.timeout = Seconds(cfg.timeout);
  wo.authkey = std::move(key);
  return World(wo);
}

std::vector<at::Tensor> clone_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> copy;
  for (const auto& p : module.parameters()) copy.push_back(p.detach().clone());
  return copy;
}

void copy_parameters(torch::nn::Module& module, const std::vector<at::Tensor>& values) {
  at::NoGradGuard no_grad;
  auto mine = module.parameters();
  if (mine.size() != values.size())
    throw Error(fmt::format("copy_parameters: {} tensors for a module of {} parameters",
                            values.size(), mine.size()));
  for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_(values[i]);
}

void check_workers(Workers& w, const TrainConfig& cfg) {
  auto ended = [](Process& p) { return p.exitcode().has_value(); };
  if (std::none_of(w.procs.begin(), w.procs.end(), ended)) return;
  const auto deadline = Clock::now() + settle_time(cfg, w);
  while (Clock::now() < deadline && g_stop_signal == 0 &&
         !std::all_of(w.procs.begin(), w.procs.end(), ended)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::vector<std::string> lines;
  ptrdiff_t killed = 0;
  for (size_t i = 0; i < w.procs.size(); ++i) {
    std::string f = worker_failure(cfg, w.procs[i], static_cast<int>(i));
    if (f.empty()) continue;
    if (w.procs[i].exitcode().value_or(0) < 0) {
      lines.insert(lines.begin() + killed++, std::move(f));
    } else {
      lines.push_back(std::move(f));
    }
  }
  throw Failed(fmt::format("{}", fmt::join(lines, "\n  ")));
}

void check_alive(Workers& w, const TrainConfig& cfg) {
  check_workers(w, cfg);
  if (Seconds(Clock::now() - w.last_heard).count() > cfg.timeout) {
    throw Failed(fmt::format("no word from any worker for {:.0f} s", cfg.timeout));
  }
}

void stop_workers(Workers& w, const TrainConfig& cfg) {
  for (int i = 0; i < trainers(cfg); ++i) {
    try {
      w.go.put(kStop, Seconds(1));
    } catch (const std::exception&) {
    }
  }
  if (cfg.strategy == "pserver") {
    try {
      w.requests.put(kStop, Seconds(1));
    } catch (const std::exception&) {
    }
  }
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (auto& p : w.procs) {
    const double left = std::max(0.01, Seconds(deadline - Clock::now()).count());
    if (!p.join(Seconds(left))) {
      p.kill();
      p.join();
    }
  }
}

void kill_workers(std::optional<Workers>& w) {
  if (!w) return;
  for (auto& p : w->procs) p.kill();
  for (auto& p : w->procs) p.join(Seconds(10));
}

}  // namespace torchpar::train
