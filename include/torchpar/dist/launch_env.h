#pragma once
/// A rank's place in a job as its launcher (torchrun, `torchpar run`) puts it in the
/// environment: what World's env:// rendezvous reads, for programs that must know it first
/// (`torchpar train` decides from it whether to spawn workers or be one rank).

#include <optional>
#include <string>

namespace torchpar {

/// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, checked.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;        ///< LOCAL_RANK, else rank
  int local_world_size = 1;  ///< LOCAL_WORLD_SIZE, else world_size
  std::string master_addr;
  int master_port = 0;
};

/// Reads the launcher's variables with the parser World's rendezvous uses (core/env.h's
/// env_int and env_text: a variable set to "" counts as unset).
///
///   if (auto env = torchpar::launch_env()) std::printf("rank %d of %d\n", env->rank,
///                                                      env->world_size);
///
/// Returns nullopt when neither RANK nor WORLD_SIZE is set (no launcher started this process).
/// Errors:  ValueError naming the variables (and their values) when only one of RANK and
///          WORLD_SIZE is set, a number is not a whole number, WORLD_SIZE < 1, RANK is outside
///          [0, WORLD_SIZE), or MASTER_ADDR is unset or MASTER_PORT unset or outside 1..65535.
/// Safety:  reads the environment (std::getenv): do not call it while another thread changes
///          it.
/// Source:  torch.distributed's env:// rendezvous (_env_rendezvous_handler: RANK, WORLD_SIZE,
///          MASTER_ADDR, MASTER_PORT), torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE.
std::optional<LaunchEnv> launch_env();

}  // namespace torchpar
