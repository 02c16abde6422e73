#include "torchpar/core/env.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <climits>
#include <cstdlib>

#include "torchpar/core/error.h"

namespace torchpar {
namespace {

constexpr std::array kTable{
    EnvVariable{"TORCHPAR_AUTHKEY", EnvType::kRaw,
                "the per-user key file ${XDG_CACHE_HOME:-$HOME/.cache}/torchpar/authkey (store, "
                "Manager); none for RPC",
                "the job's key in hex, proved by every store, RPC and Manager connection", true},
    EnvVariable{"TORCHPAR_STORE_BIND_ADDR", EnvType::kText, "MASTER_ADDR",
                "address rank 0's store listens on (0.0.0.0: every interface)", true},
    EnvVariable{"TORCHPAR_GLOO_ADDR", EnvType::kText, "the local address that routes to the master",
                "local address Gloo binds to, when GLOO_SOCKET_IFNAME is unset", true},
    EnvVariable{"TORCHPAR_RPC_ADDR", EnvType::kText, "127.0.0.1",
                "address an RPC member's TCP listener binds to and publishes", true},
    EnvVariable{"TORCHPAR_RPC_SHM", EnvType::kFlag, "0",
                "1: TensorPipe's shm transport between RPC members of one host", true},
    EnvVariable{"TORCHPAR_RPC_READ_SPIN_US", EnvType::kUnsigned, "50",
                "microseconds a TCP RPC reader retries a non-blocking read for a frame's start "
                "before it blocks (0: blocks at once)",
                true},
    EnvVariable{"TORCHPAR_MANAGER_SHM", EnvType::kFlag, "1",
                "0: a Manager client's calls stay on their sockets (no shared-memory channel)",
                true},
    EnvVariable{"TORCHPAR_SHM_CACHE_BYTES", EnvType::kUnsigned, "1073741824",
                "bound of the cache of free large shared-memory segments (0: no cache)", true},
    EnvVariable{"TORCHPAR_SHM_CLEANER", EnvType::kPath,
                "libexec/torchpar/torchpar-shm-cleaner beside libtorchpar.so, else the build "
                "tree's",
                "the cleaner program that unlinks a process's file_system names after it exits",
                true},
    EnvVariable{"TORCHPAR_SHM_SLOT_BYTES", EnvType::kUnsigned, "262144",
                "bytes of each rank's slot in the shm collective backend (below 4096: the "
                "default)",
                true},
    EnvVariable{"TORCHPAR_SHM_SINGLE_COPY", EnvType::kFlag, "1",
                "0: the shm collective backend never copies straight between the ranks' "
                "tensors (process_vm_readv/writev); every byte goes through its slots",
                true},
    EnvVariable{"TORCHPAR_SPAWN", EnvType::kRaw, "a normal start",
                "set by the library for a spawn child: its launch record", true},
    EnvVariable{"TORCHPAR_FORKSERVER", EnvType::kRaw, "a normal start",
                "set by the library for a forkserver being started: its socket fd", true},
    EnvVariable{"TORCHPAR_BENCH_DIR", EnvType::kPath,
                "share/torchpar/bench under the install prefix, else the source tree's bench/",
                "torchpar bench: the directory that holds run_bench.py", true},
    EnvVariable{"TORCHPAR_TOOLS_DIR", EnvType::kPath,
                "the source tree's tools/, else the installed share/torchpar",
                "torchpar train: the directory that holds plot_curves.py", true},
    EnvVariable{"TORCHPAR_ELASTIC_STATE_FDS", EnvType::kRaw, "no in-memory snapshots",
                "set by `torchpar run` in elastic mode for each rank: its two snapshot memfds "
                "(\"FD_A,FD_B\"), read by ElasticState",
                true},
    EnvVariable{"TORCHPAR_RDZV_ROUND", EnvType::kInteger, "TORCHELASTIC_RESTART_COUNT",
                "set by `torchpar run`: the rendezvous round this rank was started in "
                "(World::rendezvous_round)",
                true},
    EnvVariable{"RANK", EnvType::kInteger, "WorldOptions::rank",
                "this process's rank in the job (torchrun's)", false},
    EnvVariable{"WORLD_SIZE", EnvType::kInteger, "WorldOptions::world_size",
                "ranks in the job (torchrun's)", false},
    EnvVariable{"LOCAL_RANK", EnvType::kInteger, "RANK", "this rank's index on its host", false},
    EnvVariable{"LOCAL_WORLD_SIZE", EnvType::kInteger, "WORLD_SIZE", "ranks on this host", false},
    EnvVariable{"MASTER_ADDR", EnvType::kText, "WorldOptions::master_addr",
                "rank 0's address (the store's)", false},
    EnvVariable{"MASTER_PORT", EnvType::kInteger, "WorldOptions::master_port", "the store's port",
                false},
    EnvVariable{"TORCHELASTIC_RESTART_COUNT", EnvType::kInteger, "0",
                "restarts of the job's workers so far (torchrun's; World::restart_count)", false},
    EnvVariable{"TORCHELASTIC_RUN_ID", EnvType::kRaw, "not started by an elastic launcher",
                "the job's rendezvous id (torchrun's); torchpar train resumes from "
                "--checkpoint-dir under it",
                false},
    EnvVariable{"GLOO_SOCKET_IFNAME", EnvType::kText, "TORCHPAR_GLOO_ADDR",
                "the interface Gloo binds to (torch.distributed's)", false},
    EnvVariable{"XDG_CACHE_HOME", EnvType::kPath, "$HOME/.cache",
                "where the per-user key file lives", false},
    EnvVariable{"HOME", EnvType::kPath, "none", "where the per-user key file lives", false},
    EnvVariable{"CUDA_VISIBLE_DEVICES", EnvType::kRaw, "every GPU",
                "which GPUs count (CUDA's rules)", false},
    EnvVariable{"OMP_WAIT_POLICY", EnvType::kRaw, "passive for torchpar train",
                "OpenMP's; torchpar train sets passive when unset and starts over once", false},
};

const char* type_name(EnvType t) {
  switch (t) {
    case EnvType::kText:
      return "text";
    case EnvType::kPath:
      return "a path";
    case EnvType::kFlag:
      return "a flag (0 or 1)";
    case EnvType::kUnsigned:
      return "an unsigned number";
    case EnvType::kInteger:
      return "an integer";
    case EnvType::kRaw:
      return "a raw value";
  }
  return "?";
}

/// The raw value of a table variable of type `type` (nullptr when unset).
const char* read(std::string_view name, EnvType type, const char* accessor) {
  const EnvVariable& v = environment_variable(name);
  if (v.type != type) {
    throw ValueError(fmt::format("{}: the environment variable {} is {}, not {}", accessor, name,
                                 type_name(v.type), type_name(type)));
  }
  return std::getenv(v.name.data());  // the table's names are NUL-terminated literals
}

}  // namespace

std::span<const EnvVariable> environment_variables() { return kTable; }

const EnvVariable& environment_variable(std::string_view name) {
  const auto it =
      std::find_if(kTable.begin(), kTable.end(), [&](const auto& v) { return v.name == name; });
  if (it == kTable.end()) {
    throw ValueError(fmt::format(
        "the environment variable {} is not in torchpar's table (src/core/env.cpp)", name));
  }
  return *it;
}

std::optional<std::string> env_value(std::string_view name) {
  const char* s = std::getenv(environment_variable(name).name.data());
  if (s == nullptr) return std::nullopt;
  return std::string(s);
}

std::optional<std::string> env_text(std::string_view name) {
  const char* s = read(name, EnvType::kText, "env_text");
  if (s == nullptr || *s == '\0') return std::nullopt;
  return std::string(s);
}

bool env_flag(std::string_view name, bool fallback) {
  const char* s = read(name, EnvType::kFlag, "env_flag");
  if (s == nullptr || *s == '\0') return fallback;
  const std::string_view v(s);
  if (v == "1") return true;
  if (v == "0") return false;
  throw ValueError(fmt::format("{} must be 0 or 1, got '{}'", name, v));
}

uint64_t env_unsigned(std::string_view name, uint64_t fallback, uint64_t min, uint64_t max) {
  const char* s = read(name, EnvType::kUnsigned, "env_unsigned");
  if (s == nullptr || *s == '\0') return fallback;
  const std::string_view v(s);
  uint64_t x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc() || end != v.data() + v.size() || x < min || x > max) {
    throw ValueError(
        fmt::format("{} must be a whole decimal number in [{}, {}], got '{}'", name, min, max, v));
  }
  return x;
}

std::optional<int> env_int(std::string_view name) {
  const char* s = read(name, EnvType::kInteger, "env_int");
  if (s == nullptr || *s == '\0') return std::nullopt;
  const std::string_view v(s);
  int x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc() || end != v.data() + v.size()) {
    throw ValueError(
        fmt::format("{} must be a whole number in [{}, {}], got '{}'", name, INT_MIN, INT_MAX, v));
  }
  return x;
}

}  // namespace torchpar
