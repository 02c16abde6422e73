#pragma once
/// The launcher behind `torchpar run` (torchrun's in C++): starts a program's ranks on this
/// node with the environment torchrun sets, watches them, restarts them, and, in elastic
/// mode, takes part in rendezvous rounds with the agents of the other nodes so that a job
/// survives losing a node and grows when one joins. The CLI only parses and reports.

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace torchpar {

/// What `torchpar run` was asked for. Fixed mode: min_nodes == max_nodes and no
/// rdzv_endpoint (every node is given its node_rank and the master address). Elastic mode:
/// an rdzv_endpoint (or min_nodes < max_nodes): node ranks, MASTER_ADDR and MASTER_PORT
/// come from each round of the rendezvous.
struct LaunchOptions {
  int nproc_per_node = 1;
  int min_nodes = 1;  ///< --nnodes MIN:MAX (N: both N)
  int max_nodes = 1;
  /// Restarts of the job after a failure (a rank failed, a node lost), all nodes counted
  /// together (fixed mode: of this node's ranks). A node joining or leaving cleanly does
  /// not use one.
  int max_restarts = 0;
  double grace_seconds = 5.0;  ///< SIGTERM to SIGKILL when ranks are stopped
  bool prefix_output = true;   ///< "[rank]: " before every output line
  std::vector<std::string> program;

  // ---- fixed mode
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  ///< 0: a free port on one node, else 29500

  // ---- elastic mode
  /// "host:port" of the rendezvous store: the agent that can listen there hosts it (the
  /// job's key required), the others connect. Required when max_nodes > 1; empty with
  /// --nnodes 1:1 elastic: "127.0.0.1:29400".
  std::string rdzv_endpoint;
  std::string rdzv_id = "none";  ///< the job's name in the store
  /// Seconds a round stays open for more nodes once min_nodes have joined (torchrun's
  /// last_call_timeout), unless every node known to be alive has joined.
  double rdzv_last_call_seconds = 30.0;
  /// Seconds a node waits for a round to close, and a waiting node for a round to end,
  /// before giving up (torchrun's join_timeout).
  double rdzv_join_seconds = 600.0;
  /// Seconds between two looks at the ranks and the store (heartbeat, end of round).
  double monitor_interval_seconds = 0.5;
  /// A node whose heartbeat has not moved for this long is lost: its round ends (a node
  /// whose agent died on a host that is still up is known lost at once: its connection to
  /// the store closes). At least 3 x monitor_interval_seconds.
  double heartbeat_timeout_seconds = 5.0;
  /// The address other nodes reach this one at (its rank 0's store and RPC). Empty: the
  /// local address of the route to the rendezvous endpoint.
  std::string local_addr;

  /// Polled between steps: a signal number to stop the job with (SIGINT/SIGTERM caught by
  /// the caller), or 0.
  std::function<int()> pending_signal = [] { return 0; };
};

/// Runs the job on this node to its end and returns the exit code the launcher exits with:
/// 0 when every rank of the last round exited 0 (also for a node that waited to join and
/// saw the job finish); the failing rank's code (128 + signal for a signal) when restarts ran
/// out, with a line on stderr naming the rank and node; 1 when a node was lost with no
/// restart left, this node was declared lost by the others (it was stopped or cut off), the
/// rendezvous endpoint went away, a round could not gather min_nodes within
/// rdzv_join_seconds, or a waiting node could not join within it; 2 for bad options (also
/// named on stderr); 128 + the signal when pending_signal() returned one (fixed mode: the
/// failing rank's code when a rank had failed first).
/// Elastic mode needs TORCHPAR_AUTHKEY when max_nodes > 1 (the store refuses other keys).
/// Safety: call from the main thread (ranks get PR_SET_PDEATHSIG) of a process that does
/// nothing else meanwhile; it reaps only its own children. Source: torchrun
/// (torch.distributed.run, elastic agent with the c10d rendezvous backend).
int launch_job(const LaunchOptions& options);

}  // namespace torchpar
