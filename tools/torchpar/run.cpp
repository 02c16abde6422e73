// `torchpar run`: parses the options of torchrun's kind and hands them to the launcher
// (torchpar/dist/launcher.h): N ranks of a program on this node, fixed or elastic nodes.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "commands.h"
#include "torchpar/dist/launcher.h"

namespace torchpar::cli {
namespace {

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

/// "N" or "MIN:MAX" into *min and *max; false when it is neither.
bool parse_nnodes(const std::string& text, int* min, int* max) {
  const auto colon = text.find(':');
  char* end = nullptr;
  const long a = std::strtol(text.c_str(), &end, 10);
  if (colon == std::string::npos) {
    if (*end != '\0' || text.empty()) return false;
    *min = *max = static_cast<int>(a);
  } else {
    if (end != text.c_str() + colon) return false;
    const char* rest = text.c_str() + colon + 1;
    const long b = std::strtol(rest, &end, 10);
    if (*end != '\0' || end == rest) return false;
    *min = static_cast<int>(a);
    *max = static_cast<int>(b);
  }
  return *min >= 1 && *max >= *min && *max <= 4096;
}

}  // namespace

Command add_run(CLI::App& app) {
  auto o = std::make_shared<LaunchOptions>();
  auto nnodes = std::make_shared<std::string>("1");
  auto no_prefix = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand(
      "run",
      "Start N ranks of a program with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
      "MASTER_ADDR, MASTER_PORT set (like torchrun), and TORCHPAR_AUTHKEY: the caller's, else a "
      "fresh random key per one-node job (RPC needs it). Output lines get a \"[rank]: \" prefix "
      "(a line over 64 KiB is forwarded in 64 KiB lines, each prefixed); "
      "the first failing rank's exit code ends the run after the others are stopped; "
      "SIGINT/SIGTERM are forwarded. With --nnodes MIN:MAX or --rdzv-endpoint the job is "
      "elastic: one agent per node, rendezvous rounds, restarts of the whole job after a "
      "failure, a lost node's ranks dropped and a joining node's added (docs/distributed.md, "
      "\"Elastic jobs\").");
  cmd->add_option("-n,--nproc-per-node", o->nproc_per_node, "ranks on this node")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--nnodes", *nnodes, "nodes in the job: N, or MIN:MAX for an elastic job");
  cmd->add_option("--node-rank", o->node_rank, "fixed nodes: this node's index in [0, nnodes)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--master-addr", o->master_addr,
                  "fixed nodes: address of the node serving rank 0's store");
  cmd->add_option("--master-port", o->master_port,
                  "fixed nodes: port of rank 0's store (default: a free port when --nnodes is 1, "
                  "else 29500)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--max-restarts", o->max_restarts,
                  "restart the job's ranks up to this many times after a failure (elastic: all "
                  "nodes together; a node joining or leaving uses none)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--rdzv-endpoint", o->rdzv_endpoint,
                  "elastic: host:port of the rendezvous store; the agent that can listen there "
                  "hosts it (default 127.0.0.1:29400)");
  cmd->add_option("--rdzv-id", o->rdzv_id, "elastic: the job's name in the store")
      ->default_str("none");
  cmd->add_option("--rdzv-timeout", o->rdzv_last_call_seconds,
                  "elastic: seconds a round stays open for more nodes once MIN joined (last "
                  "call), unless every node still alive has joined")
      ->check(CLI::NonNegativeNumber)
      ->default_str("30");
  cmd->add_option("--rdzv-join-timeout", o->rdzv_join_seconds,
                  "elastic: seconds to wait for MIN nodes, or for a running round to end")
      ->check(CLI::PositiveNumber)
      ->default_str("600");
  cmd->add_option("--monitor-interval", o->monitor_interval_seconds,
                  "elastic: seconds between looks at the ranks and heartbeats")
      ->check(CLI::Range(0.01, 60.0))
      ->default_str("0.5");
  cmd->add_option("--heartbeat-timeout", o->heartbeat_timeout_seconds,
                  "elastic: seconds without a node's heartbeat before it is lost")
      ->check(CLI::Range(0.1, 3600.0))
      ->default_str("5");
  cmd->add_option("--local-addr", o->local_addr,
                  "elastic: the address other nodes reach this one at (default: the source "
                  "address of the route to the rendezvous endpoint)");
  cmd->add_option("--grace", o->grace_seconds,
                  "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--no-prefix", *no_prefix, "do not prefix output lines with the rank");
  cmd->add_option("program", o->program, "program and its arguments (after --)")->required();
  return [o, nnodes, no_prefix] {
    if (!parse_nnodes(*nnodes, &o->min_nodes, &o->max_nodes)) {
      std::fprintf(stderr,
                   "torchpar run: --nnodes '%s': expected N or MIN:MAX with 1 <= MIN <= MAX <= "
                   "4096\n",
                   nnodes->c_str());
      return 2;
    }
    o->prefix_output = !*no_prefix;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    ::sigaction(SIGINT, &sa, nullptr);
    ::sigaction(SIGTERM, &sa, nullptr);
    o->pending_signal = [] { return static_cast<int>(g_signal); };
    return launch_job(*o);
  };
}

}  // namespace torchpar::cli
