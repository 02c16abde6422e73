#pragma once
/// Starting other programs: argv + environment, never a shell.
///
/// `exec_program` starts a program with fork + execve and reports a failed exec (program
/// not found, not executable) as an exception in the parent, so a typo never looks like a
/// child that "exited with 127". `run_program` starts one and waits for it with a
/// timeout. `JobGroup` keeps every program started into it in one process group and ends
/// the whole tree (the programs and whatever they started) when it is stopped, when it is
/// destroyed, and also when this process dies by SIGKILL: a small keeper process watches a
/// pipe from this process and signals the group when the pipe closes.
///
/// Nothing here goes through /bin/sh: arguments with quotes, spaces, `;` or `$` reach the
/// program as they are. Source: Python's subprocess.Popen(args, shell=False),
/// torchrun's process-group handling of its workers.

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "torchpar/core/timeout.h"

namespace torchpar {

/// How to start a program.
struct ExecOptions {
  /// "NAME=value" entries added to (or replacing in) this process's environment.
  std::vector<std::string> env{};
  /// Descriptors that become the child's stdin/stdout/stderr (-1: inherit ours).
  int stdin_fd = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
  /// Process group to join: 0 makes the child the leader of a new group; nullopt keeps ours.
  std::optional<pid_t> process_group{};
  /// SIGKILL the child when this process ends (PR_SET_PDEATHSIG). Only safe to rely on
  /// when the calling thread lives as long as the process (the main thread, say).
  bool die_with_parent = true;
  /// SIGINT and SIGTERM dispositions reset to default in the child (a launcher that
  /// handles them should not pass its handlers' "ignore" on).
  bool default_signals = true;
  /// Descriptors the child keeps under the same numbers: their close-on-exec flag is
  /// cleared in the child only (this process's copies keep theirs), so a launcher can hand
  /// a rank a descriptor it owns (the elastic agent's snapshot memfds) without leaking it
  /// into every other program it starts.
  std::vector<int> inherit_fds{};
};

/// Starts argv[0] (looked up in PATH when it has no '/') with `argv`.
///
/// Returns: the child's pid; the caller reaps it (waitpid, `wait_program`).
/// Errors:  torchpar::Error naming the program and errno when it cannot be executed
///          (the child has then already been reaped); on an empty argv.
/// Safety:  thread-safe; only async-signal-safe calls run between fork and exec.
pid_t exec_program(const std::vector<std::string>& argv, const ExecOptions& options = {});

/// Waits for `pid` (a child of this process) at most `timeout` (nullopt: forever; 0: look
/// once). Returns the raw wait status, or nullopt on timeout (the child is left running).
/// Errors: torchpar::Error when `pid` is not a child of ours.
std::optional<int> wait_program(pid_t pid, Timeout timeout);

/// Starts a program, waits for it and returns its exit code as a shell would report it
/// (128 + signal number when killed). On timeout the program is SIGKILLed, reaped and
/// TimeoutError is thrown; nullopt waits without a limit (the timeout has no default, so
/// that a caller chooses one).
int run_program(const std::vector<std::string>& argv, const ExecOptions& options, Timeout timeout);

/// The exit code a shell would report for a wait status: the code, or 128 + signal.
int exit_code_of(int wait_status);

/// "exited with code 3" / "was killed by signal 9 (Killed)".
std::string describe_wait_status(int wait_status);

/// A process group for the programs of one job; see the header comment.
///
/// Lifetime: the destructor kills the group (SIGKILL) and reaps the keeper. stop() sends
///           `sig` to every process of the group. If this process is SIGKILLed, the keeper
///           sends SIGTERM to the group, waits `grace`, then SIGKILL.
/// Safety:   not thread-safe; create and use it from one thread.
class JobGroup {
 public:
  explicit JobGroup(std::chrono::duration<double> grace = std::chrono::seconds(5));
  ~JobGroup();
  JobGroup(const JobGroup&) = delete;
  JobGroup& operator=(const JobGroup&) = delete;

  /// Starts a program in the group (options.process_group is overridden).
  pid_t start(const std::vector<std::string>& argv, ExecOptions options = {});
  /// Sends `sig` to every process of the group (the keeper ignores SIGTERM and SIGINT).
  void signal(int sig) const;
  /// The group id (the keeper's pid).
  pid_t id() const { return keeper_; }

 private:
  pid_t keeper_ = -1;
  int lifeline_ = -1;  // write end; the keeper sees EOF when we are gone
};

}  // namespace torchpar
