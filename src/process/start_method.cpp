#include "torchpar/process/start_method.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include <fmt/format.h>

#include "child.h"
#include "launch.h"
#include "shm/region.h"
#include "torchpar/core/env.h"
#include "torchpar/process/process.h"

namespace torchpar {
namespace {
std::atomic<StartMethod> g_method{StartMethod::kSpawn};
std::atomic<bool> g_initialized{false};
}  // namespace

namespace detail {

std::vector<std::string>& saved_argv() {
  static std::vector<std::string> argv;
  return argv;
}

namespace {

// TORCHPAR_SPAWN=<record fd>,<slot fd>,<parent pid>[,<fd>...]: set by the parent of a
// spawned child; the listed fds are the argument payload's, in order.
[[noreturn]] void run_spawned_child(const char* spec) {
  std::vector<long> nums;
  for (const char* p = spec; *p != '\0';) {
    char* end = nullptr;
    nums.push_back(std::strtol(p, &end, 10));
    if (end == p) break;
    p = *end == ',' ? end + 1 : end;
  }
  ::unsetenv("TORCHPAR_SPAWN");
  if (nums.size() < 3) {
    std::fprintf(stderr, "torchpar: malformed TORCHPAR_SPAWN '%s'\n", spec);
    ::_exit(70);
  }
  const int record_fd = static_cast<int>(nums[0]);
  const int slot_fd = static_cast<int>(nums[1]);
  void* slot = map_shared_fd_noexcept(slot_fd, kErrorSlotBytes);
  ::close(slot_fd);
  if (slot == nullptr) ::_exit(71);
  std::string name;  // from the launch record, for the error report
  const int code = run_child_body(slot, name, [&] {
    struct stat st {};
    if (::fstat(record_fd, &st) != 0) throw Error("spawned child: cannot stat its launch record");
    std::string bytes(static_cast<size_t>(st.st_size), '\0');
    if (::pread(record_fd, bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size()))
      throw Error("spawned child: cannot read its launch record");
    ::close(record_fd);
    LaunchRecord rec = loads<LaunchRecord>(Payload{std::move(bytes), {}});
    name = rec.name;
    std::vector<UniqueFd> fds;
    for (size_t i = 3; i < nums.size(); ++i) {
      const int fd = static_cast<int>(nums[i]);
      ::fcntl(fd, F_SETFD, FD_CLOEXEC);
      fds.emplace_back(fd);
    }
    run_launch_record(std::move(rec), std::move(fds));
  });
  exit_child(code);
}

}  // namespace

void run_launch_record(LaunchRecord rec, std::vector<UniqueFd> fds) {
  Payload args{std::move(rec.args), std::move(fds)};
  set_child_threads(rec.threads);
  auto tramp = reinterpret_cast<Trampoline>(from_code_address(rec.trampoline));
  void* fn = from_code_address(rec.fn);
  tramp(fn, args);
}

}  // namespace detail

void init(int argc, char** argv) {
  auto& saved = detail::saved_argv();
  saved.assign(argv, argv + argc);
  g_initialized.store(true);
  if (const auto spec = env_value("TORCHPAR_SPAWN")) detail::run_spawned_child(spec->c_str());
  if (const auto fd = env_value("TORCHPAR_FORKSERVER")) {
    const int sock = std::atoi(fd->c_str());
    ::unsetenv("TORCHPAR_FORKSERVER");
    detail::run_forkserver(sock);
  }
}

bool is_initialized() { return g_initialized.load(); }

std::vector<std::string> get_all_start_methods() { return {"fork", "forkserver", "spawn"}; }

std::string get_start_method() { return to_string(g_method.load()); }

StartMethod current_start_method() { return g_method.load(); }

void set_start_method(const std::string& method) {
  g_method.store(start_method_from_string(method));
}

std::string to_string(StartMethod m) {
  switch (m) {
    case StartMethod::kFork:
      return "fork";
    case StartMethod::kSpawn:
      return "spawn";
    case StartMethod::kForkserver:
      return "forkserver";
  }
  return "?";
}

StartMethod start_method_from_string(const std::string& name) {
  if (name == "fork") return StartMethod::kFork;
  if (name == "spawn") return StartMethod::kSpawn;
  if (name == "forkserver") return StartMethod::kForkserver;
  throw ValueError("unknown start method '" + name +
                   "'; valid start methods are: fork, forkserver, spawn");
}

}  // namespace torchpar
