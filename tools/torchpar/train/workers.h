#pragma once
// What every model of `torchpar train` shares: the stop signals, the configuration's common
// defaults, the spawned workers and the queues between them and the parent (a worker's end
// named in the error), and the World of ddp / pserver ranks.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "torchpar/torchpar.h"
#include "trainer.h"

namespace torch::nn {
class Module;
}

namespace torchpar::train {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

// Messages from workers: (kind, worker, round, samples, loss_sum, batches). A round is an
// epoch of the mnist model and the steps between two evaluations of the gpt model; samples
// count images (mnist) or tokens (gpt), batches count batches or optimizer steps. kEpochDone
// of an mnist worker carries (0, seconds, steps) of its SyncTime instead.
enum Kind : int { kReady = 0, kProgress = 1, kEpochDone = 2 };
using Msg = std::tuple<int, int, int, int64_t, double, int64_t>;

/// Time a ddp worker spent in DistributedDataParallel::synchronize_gradients over a round:
/// seconds, and the calls (one per step).
struct SyncTime {
  double seconds = 0;
  int64_t steps = 0;
};
/// Sent on the `go` queue instead of a round: the worker returns.
constexpr int kStop = -1;

/// A worker ended (or went silent): the run fails with this message.
class Failed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
/// SIGINT or SIGTERM arrived: the run stops and keeps what it finished.
class Interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Makes SIGINT and SIGTERM set the stop signal instead of ending the process.
void install_stop_handlers();
/// The SIGINT / SIGTERM that arrived since install_stop_handlers(), or 0.
int stop_signal();

/// The longest --timeout, in seconds (about 115 days; a deadline now + 1e10 s overflows).
inline constexpr double kMaxTimeout = 1e7;

/// Fills in what both models default alike: workers (the number of cores; single: 1), --out
/// (runs/<timestamp>), and checks the strategy, the worker count, the backend, and that lr,
/// momentum and timeout are finite and in range (NaN refused). Returns 2 (after a message on
/// stderr) for a bad value, else 0.
int complete_common_config(TrainConfig& cfg);

/// The workers that train: all of them, but for pserver's rank 0 (the server).
int trainers(const TrainConfig& c);
/// The index of the first worker that trains.
int first_trainer(const TrainConfig& c);
/// ddp and pserver workers form a World.
bool uses_world(const TrainConfig& c);

/// Rank `rank` of the World of ddp / pserver; rank 0 hosts its store. pserver's members are
/// named "server" and "trainer<rank>", so RPC errors name the role. `key`: the run's job key
/// (a fresh one per run, as `torchpar run` makes per job; the store and pserver's RPC
/// connections prove it).
World join_world(int rank, const TrainConfig& cfg, int port, AuthKey key);

/// This process's place in a job whose launcher started it as one rank (torchrun, or
/// `torchpar run`, on one node or several): RANK and WORLD_SIZE from the environment.
struct EnvRank {
  int rank = 0;
  int world_size = 1;
};

/// Reads RANK and WORLD_SIZE as torchrun and `torchpar run` set them, with launch_env()
/// (torchpar/dist/launch_env.h: World's own parser). Leaves `env` empty when neither is set
/// (train spawns its own workers on this host). When they are, `torchpar train` is one rank
/// of the job: only --strategy ddp trains that way, and cfg.workers becomes WORLD_SIZE.
///
/// Returns 2 (after a message on stderr naming the variables) when the strategy is not ddp,
/// launch_env() refuses the variables (only one of RANK and WORLD_SIZE set, not whole
/// numbers, RANK outside [0, WORLD_SIZE), MASTER_ADDR or MASTER_PORT missing or malformed),
/// or --workers was given with another value than WORLD_SIZE; else 0.
int rank_from_env(TrainConfig& cfg, std::optional<EnvRank>& env);

/// The World of a job that started this process as one of its ranks: rank, world size,
/// master address and port from the environment (see rank_from_env), the job key from
/// TORCHPAR_AUTHKEY (`torchpar run` passes its own to every rank; all nodes' launchers must
/// be given the same). cfg.timeout bounds the rendezvous and every collective.
World join_env_world(const TrainConfig& cfg);

/// Copies of the module's parameters (recursively, in parameters() order), detached.
std::vector<at::Tensor> clone_parameters(const torch::nn::Module& module);
/// Copies `values` (as clone_parameters returned them) into the module's parameters.
void copy_parameters(torch::nn::Module& module, const std::vector<at::Tensor>& values);

/// The spawned workers of a run, and the queues between them and the parent.
struct Workers {
  std::vector<Process> procs;
  Queue<Msg> msgs;
  Queue<int> go;                          // a round to train, or kStop (one per trainer)
  Queue<int> requests;                    // pserver: the parent asks the server for parameters
  Queue<std::vector<at::Tensor>> params;  // ddp: rank 0's parameters; pserver: the server's
  Clock::time_point last_heard = Clock::now();
};

/// Throws Failed when a worker has ended: after a short settling time (pserver: the trainers'
/// RPC timeout, once the server is gone), naming the killed workers first (the others usually
/// fail because of them), then the others that ended, a line each.
void check_workers(Workers& w, const TrainConfig& cfg);

/// The next item the workers put in `q` (msgs, params), checking signals and that the
/// workers live. Returns nullopt after 100 ms without one. Throws Interrupted on a stop
/// signal, Failed when a worker ended or no worker spoke for cfg.timeout.
/// Throws Interrupted when a stop signal arrived.
void throw_if_stopped();
/// Throws Failed when a worker ended (check_workers) or no worker spoke for cfg.timeout.
void check_alive(Workers& w, const TrainConfig& cfg);

/// The next item the workers put in `q` (msgs, params), checking signals and that the
/// workers live. Returns nullopt after 100 ms without one. Throws Interrupted on a stop
/// signal, Failed when a worker ended or no worker spoke for cfg.timeout.
template <class T>
std::optional<T> poll(Queue<T>& q, Workers& w, const TrainConfig& cfg) {
  throw_if_stopped();
  try {
    auto m = q.get(Seconds(0.1));
    w.last_heard = Clock::now();
    return m;
  } catch (const Empty&) {
  }
  check_alive(w, cfg);
  return std::nullopt;
}

/// Blocks until `q` has an item, as poll does (signals, workers' ends, silence).
template <class T>
T wait_for(Queue<T>& q, Workers& w, const TrainConfig& cfg) {
  for (;;) {
    if (auto item = poll(q, w, cfg)) return std::move(*item);
  }
}

/// Sends kStop to every trainer (and pserver's server) and joins the workers; a worker that
/// has not ended within 10 s is killed.
void stop_workers(Workers& w, const TrainConfig& cfg);
/// Kills and joins every worker (after an error or a signal).
void kill_workers(std::optional<Workers>& w);

}  // namespace torchpar::train
