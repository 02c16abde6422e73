// torchpar-shm-cleaner <pid> <prefix>: waits until process <pid> has exited (however it
// exits, SIGKILL included), then unlinks /dev/shm/<prefix>*. A name whose segment still
// has an export in flight (a handle sent, not yet loaded by its receiver) is kept until the
// receiver has mapped it, or for at most an hour, as PyTorch's torch_shm_manager keeps a
// segment alive for its receiver.
//
// Started by the library (src/shm/cleaner.cpp) with an argv, never a shell. It is exec'd,
// so it holds none of the process's memory or descriptors. No LibTorch: it starts in
// milliseconds and costs a few hundred KiB.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

#include "segment_probe.h"

namespace {

constexpr long kHoldSeconds = 3600;  // longest a name is kept for an unclaimed export

void nap_ms(long ms) {
  struct timespec ts {
    ms / 1000, (ms % 1000) * 1000000
  };
  while (::nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

void wait_for_exit(pid_t pid) {
  const long pidfd = ::syscall(SYS_pidfd_open, pid, 0);
  if (pidfd >= 0) {
    struct pollfd p {
      static_cast<int>(pidfd), POLLIN, 0
    };
    while (::poll(&p, 1, -1) < 0 && errno == EINTR) {
    }
    ::close(static_cast<int>(pidfd));
    return;
  }
  if (errno == ESRCH) return;
  while (::kill(pid, 0) == 0 || errno != ESRCH) nap_ms(200);  // kernels before 5.3
}

/// Unlinks every name with `prefix` that is not held for a receiver; true if any is left.
bool sweep(const std::string& prefix) {
  const int dirfd = ::open("/dev/shm", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0) return false;
  DIR* d = ::fdopendir(dirfd);
  if (d == nullptr) {
    ::close(dirfd);
    return false;
  }
  bool left = false;
  const time_t now = ::time(nullptr);
  while (auto* e = ::readdir(d)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) != 0) continue;
    struct stat st {};
    const bool young = ::fstatat(dirfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                       now - st.st_ctime < kHoldSeconds;
    if (young && torchpar::detail::segment_in_flight_at(dirfd, e->d_name)) {
      left = true;
      continue;
    }
    ::unlinkat(dirfd, e->d_name, 0);
  }
  ::closedir(d);
  return left;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    static const char usage[] = "usage: torchpar-shm-cleaner <pid> <prefix>\n";
    (void)!::write(2, usage, sizeof usage - 1);
    return 2;
  }
  char* end = nullptr;
  const long pid = std::strtol(argv[1], &end, 10);
  const std::string prefix = argv[2];
  // Only ever our own names: "torchpar_<pid>_<ns>_", nothing with a '/'.
  if (pid <= 0 || *end != '\0' || prefix.rfind("torchpar_", 0) != 0 ||
      prefix.find('/') != std::string::npos || prefix.size() < 12)
    return 2;
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGQUIT, SIGUSR1, SIGUSR2}) ::signal(s, SIG_IGN);
  wait_for_exit(static_cast<pid_t>(pid));
  // Names held for a receiver are checked again until it has taken them.
  for (long waited_ms = 0; sweep(prefix) && waited_ms < kHoldSeconds * 1000; waited_ms += 200)
    nap_ms(200);
  return 0;
}
