// `torchpar info`: what this machine offers torchpar.
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <torch/version.h>

#include <fstream>
#include <string>

#include <fmt/format.h>

#include "commands.h"
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

int run_info() {
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
  return 0;
}

}  // namespace

Command add_info(CLI::App& app) {
  app.add_subcommand("info", "print versions, sharing strategies, start methods and limits");
  return run_info;
}

}  // namespace torchpar::cli
