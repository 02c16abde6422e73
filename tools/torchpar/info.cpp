// `torchpar info`: what this machine offers torchpar.
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "commands.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"
#include "torchpar/process/start_method.h"
#include "torchpar/shm/sharing_strategy.h"
#include "torchpar/version.h"

namespace torchpar::cli {
namespace {

std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line)) return "unavailable";
  return line;
}

/// A positive count from the environment variable `name`, else `fallback` (also for a value
/// that is not one: info reports, it does not refuse).
int env_count(const char* name, int fallback) {
  try {
    const std::optional<int> n = torchpar::env_int(name);
    return n && *n > 0 && *n < (1 << 20) ? *n : fallback;
  } catch (const torchpar::ValueError&) {
    return fallback;
  }
}

struct InfoOptions {
  int nnodes = 0;          // 0: WORLD_SIZE / LOCAL_WORLD_SIZE, else 1
  int nproc_per_node = 0;  // 0: LOCAL_WORLD_SIZE, else 1
};

int run_info(const InfoOptions& o) {
  fmt::print("torchpar          {}\n", torchpar::version());
  fmt::print("LibTorch          {}\n", TORCH_VERSION);
  fmt::print("sharing strategies {} (current: {})\n", fmt::join(get_all_sharing_strategies(), ", "),
             get_sharing_strategy());
  fmt::print("start methods     {} (current: {})\n", fmt::join(get_all_start_methods(), ", "),
             get_start_method());
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) == 0) {
    const auto total = static_cast<unsigned long long>(st.f_blocks) * st.f_frsize;
    const auto free = static_cast<unsigned long long>(st.f_bavail) * st.f_frsize;
    fmt::print("/dev/shm          size {}, free {}\n", detail::format_bytes(total),
               detail::format_bytes(free));
    if (total < (512ULL << 20))
      fmt::print(
          "warning: /dev/shm is small; the file_system strategy will run out early "
          "(docker: --shm-size)\n");
  } else {
    fmt::print("/dev/shm          unavailable\n");
  }
  struct rlimit rl {};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  fmt::print("RLIMIT_NOFILE     soft {}, hard {}\n", rl.rlim_cur, rl.rlim_max);
  fmt::print("vm.max_map_count  {}\n", read_first_line("/proc/sys/vm/max_map_count"));
  fmt::print("shmem huge pages  {}\n",
             read_first_line("/sys/kernel/mm/transparent_hugepage/shmem_enabled"));
  // Backend::kAuto's rule (World::create_collective_group): shm on one host, hierarchical
  // across hosts with several ranks on some host, gloo with one rank per host. Under
  // `torchpar run` the job's shape comes from its environment.
  const int per_node = o.nproc_per_node > 0 ? o.nproc_per_node : env_count("LOCAL_WORLD_SIZE", 1);
  const int nodes =
      o.nnodes > 0 ? o.nnodes : std::max(1, env_count("WORLD_SIZE", per_node) / per_node);
  const char* backend = nodes == 1 ? "shm" : per_node > 1 ? "hierarchical" : "gloo";
  fmt::print(
      "collectives       backend auto for {} node(s) x {} rank(s): {} (shm inside one host, "
      "hierarchical = shm inside each host + gloo between host leaders, gloo for one rank per "
      "host)\n",
      nodes, per_node, backend);
  return 0;
}

}  // namespace

Command add_info(CLI::App& app) {
  auto o = std::make_shared<InfoOptions>();
  auto* cmd = app.add_subcommand(
      "info",
      "print versions, sharing strategies, start methods, limits, and the collective backend "
      "a job of this shape would use");
  cmd->add_option("--nnodes", o->nnodes,
                  "hosts of the job (default: WORLD_SIZE / LOCAL_WORLD_SIZE, else 1)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--nproc-per-node", o->nproc_per_node,
                  "ranks per host (default: LOCAL_WORLD_SIZE, else 1)")
      ->check(CLI::Range(1, 1 << 20));
  return [o] { return run_info(*o); };
}

}  // namespace torchpar::cli
