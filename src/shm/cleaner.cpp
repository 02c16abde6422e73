#include "cleaner.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>

#include <fmt/format.h>

namespace torchpar::detail {
namespace {

std::atomic<uint64_t> g_counter{0};
std::once_flag g_counter_seed;
std::mutex g_cleaner_mu;
int g_cleaner_for_pid = 0;  // pid whose cleaner is running (fork resets by comparison)

// Async-signal-safe helpers (no malloc, no locks): only raw syscalls below.
size_t fmt_uint(char* out, unsigned long v) {
  char tmp[24];
  size_t n = 0;
  do {
    tmp[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0);
  for (size_t i = 0; i < n; ++i) out[i] = tmp[n - 1 - i];
  return n;
}

struct LinuxDirent64 {
  uint64_t d_ino;
  int64_t d_off;
  unsigned short d_reclen;
  unsigned char d_type;
  char d_name[];
};

// Calls fn(name) for every entry of /dev/shm starting with "torchpar_".
template <class Fn>
void for_each_torchpar_entry(int dirfd, Fn&& fn) noexcept {
  alignas(8) char buf[8192];
  for (;;) {
    long n = ::syscall(SYS_getdents64, dirfd, buf, sizeof buf);
    if (n <= 0) return;
    for (long off = 0; off < n;) {
      auto* d = reinterpret_cast<LinuxDirent64*>(buf + off);
      if (std::strncmp(d->d_name, "torchpar_", 9) == 0) fn(d->d_name);
      off += d->d_reclen;
    }
  }
}

unsigned long parse_hex(char*& p) noexcept {
  unsigned long v = 0;
  for (;; ++p) {
    char c = *p;
    if (c >= '0' && c <= '9') v = v * 16 + static_cast<unsigned long>(c - '0');
    else if (c >= 'a' && c <= 'f') v = v * 16 + static_cast<unsigned long>(c - 'a' + 10);
    else return v;
  }
}

void atexit_unlink() { unlink_segments_of(static_cast<int>(::getpid())); }

// Drops every shared mapping inherited from the parent so that the cleaner never keeps
// segment memory alive. Parses /proc/self/maps with raw reads only.
void unmap_shared_mappings() noexcept {
  int fd = static_cast<int>(::syscall(SYS_openat, AT_FDCWD, "/proc/self/maps", O_RDONLY));
  if (fd < 0) return;
  static char buf[1 << 20];  // the cleaner is single-threaded; static avoids a huge stack
  size_t len = 0;
  for (;;) {
    long n = ::syscall(SYS_read, fd, buf + len, sizeof(buf) - 1 - len);
    if (n <= 0) break;
    len += static_cast<size_t>(n);
    if (len >= sizeof(buf) - 1) break;
  }
  ::syscall(SYS_close, fd);
  buf[len] = '\0';
  char* line = buf;
  while (*line != '\0') {
    // "start-end perms ..."
    char* p = line;
    unsigned long start = parse_hex(p);
    if (*p == '-') {
      ++p;
      unsigned long stop = parse_hex(p);
      if (*p == ' ' && p[1] != '\0' && p[2] != '\0' && p[3] != '\0' && p[4] == 's')
        ::syscall(SYS_munmap, start, stop - start);
    }
    while (*line != '\0' && *line != '\n') ++line;
    if (*line == '\n') ++line;
  }
}

[[noreturn]] void cleaner_main(int parent) noexcept {
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGQUIT, SIGUSR1, SIGUSR2})
    ::sigaction(s, &ign, nullptr);
  ::syscall(SYS_close_range, 0U, ~0U, 0U);
  int nullfd = static_cast<int>(::syscall(SYS_openat, AT_FDCWD, "/dev/null", O_RDWR));
  if (nullfd >= 0) {
    ::dup2(nullfd, 0);
    ::dup2(nullfd, 1);
    ::dup2(nullfd, 2);
    if (nullfd > 2) ::syscall(SYS_close, nullfd);
  }
  unmap_shared_mappings();
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, parent, 0));
  if (pidfd >= 0) {
    struct pollfd pfd {pidfd, POLLIN, 0};
    while (::poll(&pfd, 1, -1) < 0 && errno == EINTR) {
    }
  } else {
    struct timespec ts {0, 200 * 1000 * 1000};
    while (::kill(parent, 0) == 0 || errno == EPERM) ::nanosleep(&ts, nullptr);
  }
  unlink_segments_of(parent);
  ::_exit(0);
}

}  // namespace

void unlink_segments_of(int pid) noexcept {
  char prefix[48] = "torchpar_";
  size_t n = 9;
  n += fmt_uint(prefix + n, static_cast<unsigned long>(pid));
  prefix[n++] = '_';
  prefix[n] = '\0';
  int dirfd = static_cast<int>(
      ::syscall(SYS_openat, AT_FDCWD, "/dev/shm", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dirfd < 0) return;
  for_each_torchpar_entry(dirfd, [&](const char* name) {
    if (std::strncmp(name, prefix, n) == 0) ::syscall(SYS_unlinkat, dirfd, name, 0);
  });
  ::syscall(SYS_close, dirfd);
}

size_t sweep_dead_segments() {
  int dirfd = ::open("/dev/shm", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0) return 0;
  size_t removed = 0;
  for_each_torchpar_entry(dirfd, [&](const char* name) {
    char* end = nullptr;
    long pid = std::strtol(name + 9, &end, 10);
    if (pid <= 0 || end == nullptr || *end != '_') return;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      if (::unlinkat(dirfd, name, 0) == 0) ++removed;
    }
  });
  ::close(dirfd);
  return removed;
}

std::string make_segment_name() {
  std::call_once(g_counter_seed, [] {
    std::random_device rd;
    // A random start keeps names unique even if a crashed process with our pid left some.
    g_counter.store((static_cast<uint64_t>(rd()) << 32) ^ rd());
  });
  return fmt::format("/torchpar_{}_{:x}", ::getpid(), g_counter.fetch_add(1));
}

void ensure_cleaner() {
  std::lock_guard<std::mutex> lock(g_cleaner_mu);
  const int self = static_cast<int>(::getpid());
  if (g_cleaner_for_pid == self) return;
  static bool atexit_registered = false;
  if (!atexit_registered) {
    std::atexit(atexit_unlink);
    atexit_registered = true;
  }
  sweep_dead_segments();
  // Raw fork (no atfork handlers: the cleaner must not take references on segments);
  // the child only makes async-signal-safe calls. Double fork so the cleaner is never
  // our child: no zombie, and waitpid(-1) in user code never sees it.
  long mid = ::syscall(SYS_fork);
  if (mid < 0) return;  // best effort: the atexit handler and the next sweep still clean
  if (mid == 0) {
    long grand = ::syscall(SYS_fork);
    if (grand == 0) cleaner_main(self);
    ::_exit(0);
  }
  int status = 0;
  while (::waitpid(static_cast<pid_t>(mid), &status, 0) < 0 && errno == EINTR) {
  }
  g_cleaner_for_pid = self;
}

}  // namespace torchpar::detail
