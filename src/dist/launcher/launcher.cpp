// launch_job: the fixed mode of `torchpar run` (every node given its rank) and the entry to
// the elastic one (elastic_agent.cpp).
#include "torchpar/dist/launcher.h"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "core/signals.h"
#include "dist/launcher/elastic_agent.h"
#include "dist/launcher/local_ranks.h"
#include "torchpar/core/auth.h"
#include "torchpar/core/error.h"
#include "torchpar/dist/world.h"

namespace torchpar {
namespace {

using detail::LocalRanks;
using detail::RankLaunch;

/// One attempt of the fixed mode: 0 when every rank exited 0, else the first failure's code
/// (or 128 + the signal that stopped the job; *interrupted is then set).
int run_fixed_once(const LaunchOptions& o, int port, int restart, bool* interrupted) {
  const int world = o.max_nodes * o.nproc_per_node;
  std::vector<RankLaunch> launches;
  for (int local = 0; local < o.nproc_per_node; ++local) {
    const int rank = o.node_rank * o.nproc_per_node + local;
    launches.push_back({rank,
                        {
                            fmt::format("RANK={}", rank),
                            fmt::format("WORLD_SIZE={}", world),
                            fmt::format("LOCAL_RANK={}", local),
                            fmt::format("LOCAL_WORLD_SIZE={}", o.nproc_per_node),
                            fmt::format("GROUP_RANK={}", o.node_rank),
                            fmt::format("MASTER_ADDR={}", o.master_addr),
                            fmt::format("MASTER_PORT={}", port),
                            fmt::format("TORCHELASTIC_RESTART_COUNT={}", restart),
                            fmt::format("TORCHELASTIC_MAX_RESTARTS={}", o.max_restarts),
                        },
                        {}});
  }
  // Every rank and whatever it starts share one process group, ended as a whole, also when
  // this launcher is SIGKILLed (the group's keeper sees its lifeline close).
  LocalRanks ranks(o.program, launches, std::chrono::duration<double>(o.grace_seconds),
                   o.prefix_output);
  int code = 0;
  bool stopping = false;
  while (!ranks.finished()) {
    if (const int sig = o.pending_signal(); sig != 0 && !*interrupted) {
      *interrupted = true;
      std::fprintf(stderr, "torchpar run: got signal %d; stopping every rank\n", sig);
      ranks.terminate(sig);
      stopping = true;
      if (code == 0) code = 128 + sig;
    }
    ranks.poll(std::chrono::milliseconds(50));
    if (const auto& f = ranks.failure(); f && !stopping) {
      code = exit_code_of(f->status);
      std::fprintf(stderr, "torchpar run: rank %d (pid %d) %s; stopping the other ranks\n", f->rank,
                   static_cast<int>(f->pid), describe_wait_status(f->status).c_str());
      ranks.terminate(SIGTERM);
      stopping = true;
    }
  }
  return code;
}

int run_fixed(const LaunchOptions& o) {
  int code = 0;
  bool interrupted = false;
  for (int attempt = 0; attempt <= o.max_restarts; ++attempt) {
    int port = o.master_port;
    if (port == 0) port = o.max_nodes == 1 ? find_free_port(/*loopback_only=*/false) : 29500;
    code = run_fixed_once(o, port, attempt, &interrupted);
    if (code == 0 || interrupted) break;
    if (attempt < o.max_restarts) {
      std::fprintf(stderr, "torchpar run: restarting every rank (%d of %d)\n", attempt + 1,
                   o.max_restarts);
    }
  }
  return code;
}

}  // namespace

int launch_job(const LaunchOptions& o) {
  const bool elastic = !o.rdzv_endpoint.empty() || o.min_nodes != o.max_nodes;
  if (o.min_nodes < 1 || o.max_nodes < o.min_nodes) {
    std::fprintf(stderr, "torchpar run: --nnodes %d:%d: need 1 <= MIN <= MAX\n", o.min_nodes,
                 o.max_nodes);
    return 2;
  }
  if (elastic && o.max_nodes > 1 && o.rdzv_endpoint.empty()) {
    std::fprintf(stderr,
                 "torchpar run: --nnodes %d:%d needs --rdzv-endpoint HOST:PORT (the same on every "
                 "node): without it each node would meet only itself\n",
                 o.min_nodes, o.max_nodes);
    return 2;
  }
  if (elastic && o.heartbeat_timeout_seconds < 3 * o.monitor_interval_seconds) {
    std::fprintf(stderr,
                 "torchpar run: --heartbeat-timeout %g s must be at least 3 x --monitor-interval "
                 "(%g s): heartbeats come once an interval, and a late one would look like a "
                 "lost node\n",
                 o.heartbeat_timeout_seconds, o.monitor_interval_seconds);
    return 2;
  }
  if (!elastic && o.node_rank >= o.max_nodes) {
    std::fprintf(stderr, "torchpar run: --node-rank %d must be below --nnodes %d\n", o.node_rank,
                 o.max_nodes);
    return 2;
  }
  // The job's key reaches the ranks in their environment, never through the store: the
  // caller's TORCHPAR_AUTHKEY (the same on every node), else 32 fresh random bytes for a
  // one-node job (kept across restarts: one job, one key). A key that is set but unusable
  // stops the launch here instead of in every rank.
  try {
    if (!authkey_from_env()) {
      if (o.max_nodes == 1) {
        ::setenv(kAuthKeyEnv, to_hex(random_authkey(32)).c_str(), 1);
      } else if (elastic) {
        std::fprintf(stderr,
                     "torchpar run: an elastic job of up to %d nodes needs TORCHPAR_AUTHKEY in "
                     "every node's environment (the same 64 hex digits, e.g. from `openssl rand "
                     "-hex 32`): the rendezvous store accepts only agents proving it\n",
                     o.max_nodes);
        return 2;
      } else {
        std::fprintf(stderr,
                     "torchpar run: warning: --nnodes %d without TORCHPAR_AUTHKEY: nodes cannot "
                     "agree on a fresh key, so the ranks' store falls back to the per-user key "
                     "file (a shared home directory) and RPC refuses to start; give every "
                     "node's launcher the same TORCHPAR_AUTHKEY (64 hex digits, e.g. from "
                     "`openssl rand -hex 32`)\n",
                     o.max_nodes);
      }
    }
  } catch (const ValueError& e) {
    std::fprintf(stderr, "torchpar run: %s\n", e.what());
    return 2;
  }
  // A closed stdout (`torchpar run ... | head`, a dropped ssh session) must not kill the
  // launcher (and with an elastic agent, the store it may host): writes fail with EPIPE.
  detail::ignore_sigpipe_if_default();
  return elastic ? detail::run_elastic(o) : run_fixed(o);
}

}  // namespace torchpar
