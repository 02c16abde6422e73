#include "workers.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <string.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "outputs.h"

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

/// The whole of `text` as a decimal integer; nullopt for none, empty or trailing text.
std::optional<long long> parse_int(const char* text) {
  if (text == nullptr || *text == '\0') return std::nullopt;
  const char* end = text + std::strlen(text);
  long long value = 0;
  const auto [last, ec] = std::from_chars(text, end, value);
  if (ec != std::errc() || last != end) return std::nullopt;
  return value;
}

/// An environment variable for a message: its value quoted, or "unset".
std::string env_shown(const char* value) {
  return value == nullptr ? "unset" : fmt::format("'{}'", value);
}

}  // namespace

int rank_from_env(TrainConfig& cfg, std::optional<EnvRank>& env) {
  env.reset();
  const char* rank = std::getenv("RANK");
  const char* size = std::getenv("WORLD_SIZE");
  if (rank == nullptr && size == nullptr) return 0;
  auto refuse = [](const std::string& why) {
    std::fprintf(stderr, "torchpar train: %s\n", why.c_str());
    return 2;
  };
  if (rank == nullptr || size == nullptr) {
    return refuse(fmt::format(
        "{} is set in the environment but {} is not: a launcher (torchrun, `torchpar run`) sets "
        "both for each rank of a job; set both to run as one rank of a job, or neither to let "
        "train start its own workers",
        rank != nullptr ? "RANK" : "WORLD_SIZE", rank != nullptr ? "WORLD_SIZE" : "RANK"));
  }
  if (cfg.strategy != "ddp") {
    return refuse(fmt::format(
        "--strategy {} cannot run as one rank of a job: RANK and WORLD_SIZE are set in the "
        "environment (by torchrun or `torchpar run`), and only --strategy ddp trains across the "
        "ranks of a job; unset RANK and WORLD_SIZE to run {} with its own workers on this host",
        cfg.strategy, cfg.strategy));
  }
  const auto r = parse_int(rank);
  const auto n = parse_int(size);
  if (!r || !n) {
    return refuse(fmt::format(
        "RANK and WORLD_SIZE in the environment must be whole numbers (RANK={}, WORLD_SIZE={})",
        env_shown(rank), env_shown(size)));
  }
  if (*n < 1 || *n > INT_MAX || *r < 0 || *r >= *n) {
    return refuse(fmt::format(
        "RANK={} and WORLD_SIZE={} in the environment: need WORLD_SIZE >= 1 and 0 <= RANK < "
        "WORLD_SIZE",
        *r, *n));
  }
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  const auto p = parse_int(port);
  if (addr == nullptr || *addr == '\0' || !p || *p < 1 || *p > 65535) {
    return refuse(fmt::format(
        "RANK and WORLD_SIZE are set in the environment, so this process is one rank of a job, "
        "which also needs MASTER_ADDR and MASTER_PORT (rank 0's address and a port in 1..65535; "
        "got MASTER_ADDR={}, MASTER_PORT={})",
        env_shown(addr), env_shown(port)));
  }
  if (cfg.workers != 0 && cfg.workers != *n) {
    return refuse(fmt::format(
        "--workers {} does not match WORLD_SIZE={}: RANK and WORLD_SIZE are set in the "
        "environment, so this process is one rank of a job of WORLD_SIZE ranks and starts no "
        "workers; drop --workers or start the job with as many ranks",
        cfg.workers, *n));
  }
  cfg.workers = static_cast<int>(*n);
  env = EnvRank{.rank = static_cast<int>(*r), .world_size = static_cast<int>(*n)};
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
