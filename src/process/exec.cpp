#include "torchpar/process/exec.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <thread>

#include <fmt/format.h>

#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"

extern char** environ;

namespace torchpar {
using detail::check_syscall;
using detail::throw_system_error;
namespace {

/// The environment for the child: ours, with `extra`'s names replaced.
std::vector<std::string> merged_env(const std::vector<std::string>& extra) {
  std::vector<std::string> out;
  auto overridden = [&](const char* entry) {
    for (const auto& e : extra) {
      const size_t eq = e.find('=');
      const size_t n = eq == std::string::npos ? e.size() : eq + 1;
      if (std::strncmp(entry, e.c_str(), n) == 0) return true;
    }
    return false;
  };
  for (char** e = environ; e != nullptr && *e != nullptr; ++e)
    if (!overridden(*e)) out.emplace_back(*e);
  for (const auto& e : extra) out.push_back(e);
  return out;
}

std::vector<char*> pointers(std::vector<std::string>& v) {
  std::vector<char*> out;
  out.reserve(v.size() + 1);
  for (auto& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

void sleep_seconds(double s) {
  struct timespec ts {};
  ts.tv_sec = static_cast<time_t>(s);
  ts.tv_nsec = static_cast<long>((s - static_cast<double>(ts.tv_sec)) * 1e9);
  while (::nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

}  // namespace

pid_t exec_program(const std::vector<std::string>& argv, const ExecOptions& options) {
  if (argv.empty() || argv[0].empty()) throw Error("exec_program: empty argv");
  // Everything the child touches is built before the fork: after it, only raw syscalls.
  std::vector<std::string> args = argv;
  std::vector<char*> arg_ptrs = pointers(args);
  std::vector<std::string> env = merged_env(options.env);
  std::vector<char*> env_ptrs = pointers(env);
  int report[2];  // the child writes its exec errno here; EOF means exec succeeded
  check_syscall("pipe2", "exec_program", [&] { return ::pipe2(report, O_CLOEXEC); });
  UniqueFd report_read(report[0]);
  UniqueFd report_write(report[1]);
  const pid_t parent = ::getpid();
  const pid_t group = options.process_group.value_or(-1);

  const pid_t pid = ::fork();
  if (pid < 0) throw_system_error("fork", errno, argv[0]);
  if (pid == 0) {
    if (options.die_with_parent) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(128 + SIGKILL);
    }
    if (group >= 0) ::setpgid(0, group);
    if (options.stdin_fd >= 0) ::dup2(options.stdin_fd, STDIN_FILENO);
    if (options.stdout_fd >= 0) ::dup2(options.stdout_fd, STDOUT_FILENO);
    if (options.stderr_fd >= 0) ::dup2(options.stderr_fd, STDERR_FILENO);
    for (const int fd : options.inherit_fds) ::fcntl(fd, F_SETFD, 0);
    if (options.default_signals) {
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::signal(SIGPIPE, SIG_DFL);
    }
    sigset_t none;
    ::sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execvpe(arg_ptrs[0], arg_ptrs.data(), env_ptrs.data());
    const int err = errno;
    (void)!::write(report[1], &err, sizeof err);
    ::_exit(127);
  }
  // Set the group from this side too, so it holds before the caller signals the group.
  if (group >= 0) ::setpgid(pid, group);
  report_write.reset();
  int err = 0;
  ssize_t n;
  do {
    n = ::read(report_read.get(), &err, sizeof err);
  } while (n < 0 && errno == EINTR);
  if (n == static_cast<ssize_t>(sizeof err)) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    throw Error(fmt::format("cannot execute '{}': {}", argv[0], std::strerror(err)));
  }
  return pid;
}

std::optional<int> wait_program(pid_t pid, Timeout timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline =
      timeout ? std::optional<Clock::time_point>(
                    Clock::now() + std::chrono::duration_cast<Clock::duration>(*timeout))
              : std::nullopt;
  auto pause = std::chrono::microseconds(200);
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, deadline ? WNOHANG : 0);
    if (r == pid) return status;
    if (r < 0 && errno != EINTR) throw_system_error("waitpid", errno, fmt::format("pid {}", pid));
    if (deadline) {
      if (Clock::now() >= *deadline) return std::nullopt;
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(20));
    }
  }
}

int run_program(const std::vector<std::string>& argv, const ExecOptions& options, Timeout timeout) {
  const pid_t pid = exec_program(argv, options);
  if (auto status = wait_program(pid, timeout)) return exit_code_of(*status);
  ::kill(pid, SIGKILL);
  wait_program(pid, std::nullopt);
  throw TimeoutError(
      fmt::format("'{}' did not finish within {:.3g} s; killed", argv[0], timeout->count()));
}

int exit_code_of(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

std::string describe_wait_status(int wait_status) {
  if (WIFSIGNALED(wait_status)) {
    return fmt::format("was killed by signal {} ({})", WTERMSIG(wait_status),
                       ::strsignal(WTERMSIG(wait_status)));
  }
  return fmt::format("exited with code {}", exit_code_of(wait_status));
}

JobGroup::JobGroup(std::chrono::duration<double> grace) {
  int life[2];
  check_syscall("pipe2", "job group", [&] { return ::pipe2(life, O_CLOEXEC); });
  const double grace_s = std::max(0.0, grace.count());
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(life[0]);
    ::close(life[1]);
    throw_system_error("fork", errno, "job group keeper");
  }
  if (pid == 0) {
    // The keeper: leader of the group, holds nothing of ours but the lifeline.
    ::setpgid(0, 0);
    ::signal(SIGTERM, SIG_IGN);
    ::signal(SIGINT, SIG_IGN);
    ::signal(SIGHUP, SIG_IGN);
    ::close(life[1]);
    if (life[0] != 3) {
      ::dup2(life[0], 3);
      ::close(life[0]);
    }
    ::syscall(SYS_close_range, 4U, ~0U, 0U);
    const int devnull = ::open("/dev/null", O_RDWR);
    if (devnull >= 0) {  // keep no pipe of the launcher's output open
      ::dup2(devnull, 0);
      ::dup2(devnull, 1);
      ::dup2(devnull, 2);
      if (devnull > 3) ::close(devnull);
    }
    char c;
    while (::read(3, &c, 1) < 0 && errno == EINTR) {
    }
    // Our creator is gone (or closed the lifeline): end the group, gently first.
    ::kill(0, SIGTERM);
    sleep_seconds(grace_s);
    ::kill(0, SIGKILL);
    ::_exit(0);
  }
  ::setpgid(pid, pid);
  ::close(life[0]);
  keeper_ = pid;
  lifeline_ = life[1];
}

JobGroup::~JobGroup() {
  if (keeper_ > 0) {
    ::kill(-keeper_, SIGKILL);
    int status = 0;
    while (::waitpid(keeper_, &status, 0) < 0 && errno == EINTR) {
    }
  }
  if (lifeline_ >= 0) ::close(lifeline_);
}

pid_t JobGroup::start(const std::vector<std::string>& argv, ExecOptions options) {
  options.process_group = keeper_;
  return exec_program(argv, options);
}

void JobGroup::signal(int sig) const {
  if (keeper_ > 0) ::kill(-keeper_, sig);
}

}  // namespace torchpar
