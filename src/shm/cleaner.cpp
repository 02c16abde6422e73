#include "cleaner.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "segment_probe.h"
#include "torchpar/core/env.h"

extern char** environ;

namespace torchpar::detail {
namespace {

std::atomic<uint64_t> g_counter{0};
std::atomic<bool> g_counter_seeded{false};
// Heap-allocated so that a forked child can replace it: a fork while another thread holds
// it must not leave the child's first file_system allocation deadlocked.
std::mutex* g_cleaner_mu = new std::mutex();
int g_cleaner_for_pid = 0;  // pid whose cleaner runs; a forked child compares and starts its own

unsigned long pid_namespace() {
  static const unsigned long ns = [] {
    struct stat st {};
    return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<unsigned long>(st.st_ino) : 0UL;
  }();
  return ns;
}

void atexit_unlink() { unlink_own_segments(); }

/// The cleaner program: $TORCHPAR_SHM_CLEANER, else libexec/torchpar/ beside the installed
/// library, else the build tree's. Empty when none is executable.
std::string cleaner_program() {
  if (auto p = env_value("TORCHPAR_SHM_CLEANER")) return *p;
  std::vector<std::string> candidates;
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&cleaner_program), &info) != 0 && info.dli_fname) {
    std::string lib = info.dli_fname;
    const size_t slash = lib.rfind('/');
    if (slash != std::string::npos)
      candidates.push_back(lib.substr(0, slash) + "/" TORCHPAR_LIBEXEC_FROM_LIB
                                                  "/torchpar-shm-cleaner");
  }
#ifdef TORCHPAR_BUILD_LIBEXEC_DIR
  candidates.push_back(TORCHPAR_BUILD_LIBEXEC_DIR "/torchpar-shm-cleaner");
#endif
  for (const auto& c : candidates)
    if (::access(c.c_str(), X_OK) == 0) return c;
  return "";
}

void register_fork_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    ::pthread_atfork(nullptr, nullptr, [] {
      g_cleaner_mu = new std::mutex();  // the old one may be locked forever: leak it
      g_counter_seeded.store(false);
    });
  });
}

}  // namespace

void unlink_own_segments() noexcept {
  const std::string prefix = segment_prefix(static_cast<int>(::getpid()));
  int dirfd = ::open("/dev/shm", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0) return;
  DIR* d = ::fdopendir(dirfd);
  if (d == nullptr) {
    ::close(dirfd);
    return;
  }
  while (auto* e = ::readdir(d)) {
    // A name whose handle is still in flight stays for its receiver; the cleaner program
    // unlinks it once the receiver has mapped it.
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0 &&
        !segment_in_flight_at(dirfd, e->d_name))
      ::unlinkat(dirfd, e->d_name, 0);
  }
  ::closedir(d);
}

std::string segment_prefix(int pid) {
  return fmt::format("torchpar_{}_{:x}_", pid, pid_namespace());
}

size_t sweep_dead_segments() {
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return 0;
  const unsigned long ns = pid_namespace();
  size_t removed = 0;
  while (auto* e = ::readdir(d)) {
    if (std::strncmp(e->d_name, "torchpar_", 9) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(e->d_name + 9, &end, 10);
    if (pid <= 0 || end == nullptr || *end != '_') continue;
    const unsigned long their_ns = std::strtoul(end + 1, &end, 16);
    if (end == nullptr || *end != '_' || their_ns != ns)
      continue;  // another namespace: not ours to judge
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      struct stat st {};
      const bool young = ::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                         ::time(nullptr) - st.st_ctime < 3600;
      if (young && segment_in_flight_at(::dirfd(d), e->d_name)) continue;  // its receiver's
      if (::unlinkat(::dirfd(d), e->d_name, 0) == 0) ++removed;
    }
  }
  ::closedir(d);
  return removed;
}

std::string make_segment_name() {
  if (!g_counter_seeded.exchange(true)) {
    // A random start keeps names unique even if a crashed process with our pid left some.
    std::random_device rd;
    g_counter.store((static_cast<uint64_t>(rd()) << 32) ^ rd());
  }
  return fmt::format("/{}{:x}", segment_prefix(static_cast<int>(::getpid())),
                     g_counter.fetch_add(1));
}

void ensure_cleaner() {
  register_fork_handler();
  std::lock_guard<std::mutex> lock(*g_cleaner_mu);
  const int self = static_cast<int>(::getpid());
  if (g_cleaner_for_pid == self) return;
  static bool atexit_registered = false;
  if (!atexit_registered) {
    std::atexit(atexit_unlink);
    atexit_registered = true;
  }
  sweep_dead_segments();

  // The cleaner is a program of ours started with an argv (no shell): it waits for this
  // process to exit and unlinks our names, keeping those still in flight to a receiver.
  const std::string program = cleaner_program();
  if (program.empty()) {
    static std::once_flag warned;
    std::call_once(warned, [] {
      std::fprintf(stderr,
                   "torchpar: warning: torchpar-shm-cleaner not found (set TORCHPAR_SHM_CLEANER);"
                   " file_system segments of a process killed by SIGKILL stay in /dev/shm until "
                   "the next torchpar process sweeps them\n");
    });
    g_cleaner_for_pid = self;
    return;
  }
  const std::string pid_arg = std::to_string(self);
  const std::string prefix = segment_prefix(self);
  const char* argv[] = {program.c_str(), pid_arg.c_str(), prefix.c_str(), nullptr};
  struct rlimit rl {};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  const unsigned max_fd = rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > 1 << 20
                              ? 1u << 20
                              : static_cast<unsigned>(rl.rlim_cur);

  // Raw clone: no atfork handlers run (the cleaner takes no references on segments), and
  // a double fork so the cleaner is never our child (no zombie, invisible to waitpid(-1)).
  long mid = ::syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
  if (mid < 0) return;  // best effort: the atexit handler and the next sweep still clean
  if (mid == 0) {
    long grand = ::syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
    if (grand == 0) {
      struct sigaction ign {};
      ign.sa_handler = SIG_IGN;
      for (int s : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGQUIT, SIGUSR1, SIGUSR2})
        ::sigaction(s, &ign, nullptr);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      int nullfd = static_cast<int>(::syscall(SYS_openat, AT_FDCWD, "/dev/null", O_RDWR));
      if (nullfd >= 0) {
        ::dup2(nullfd, 0);
        ::dup2(nullfd, 1);
        ::dup2(nullfd, 2);
      }
      if (::syscall(SYS_close_range, 3U, ~0U, 0U) != 0) {
        for (unsigned fd = 3; fd < max_fd; ++fd) ::syscall(SYS_close, fd);
      }
      ::execve(argv[0], const_cast<char* const*>(argv), environ);
      ::_exit(127);
    }
    ::_exit(0);
  }
  int status = 0;
  while (::waitpid(static_cast<pid_t>(mid), &status, 0) < 0 && errno == EINTR) {
  }
  g_cleaner_for_pid = self;
}

}  // namespace torchpar::detail
