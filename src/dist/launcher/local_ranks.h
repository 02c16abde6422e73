#pragma once
// The ranks a launcher runs on its node: started with an argv into one JobGroup, their
// output forwarded line by line with a "[rank]: " prefix, reaped, and stopped as a whole.
// Used by both modes of `torchpar run` (launcher.cpp: fixed nodes; elastic_agent.cpp).

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "torchpar/process/exec.h"

namespace torchpar::detail {

/// One rank to start: its global rank (the output prefix), environment entries and the
/// descriptors it inherits.
struct RankLaunch {
  int rank = 0;
  std::vector<std::string> env;
  std::vector<int> inherit_fds;
};

/// The first rank that failed: its rank, pid and raw wait status.
struct RankFailure {
  int rank = 0;
  pid_t pid = -1;
  int status = 0;
};

/// Safety: single-threaded (the launcher's main thread: ranks get PR_SET_PDEATHSIG).
/// Lifetime: the destructor stops whatever still runs (SIGKILL to the group) and reaps it.
class LocalRanks {
 public:
  /// Starts every rank of `launches` running `program`. `grace`: seconds from SIGTERM to
  /// SIGKILL in terminate(). Errors: torchpar::Error when a program cannot be started (the
  /// ranks started before it are stopped).
  LocalRanks(const std::vector<std::string>& program, const std::vector<RankLaunch>& launches,
             std::chrono::duration<double> grace, bool prefix_output);
  ~LocalRanks();
  LocalRanks(const LocalRanks&) = delete;
  LocalRanks& operator=(const LocalRanks&) = delete;

  /// Forwards output and reaps exited ranks, waiting up to `wait` for output. After
  /// terminate(), sends SIGKILL once the grace period has passed.
  void poll(std::chrono::milliseconds wait);
  /// Sends `sig` to every process of the group; SIGKILL follows after the grace period
  /// (the first call arms it).
  void terminate(int sig);
  /// terminate(SIGTERM) then poll until finished() (at most grace + about 1 s).
  void stop();

  /// The first rank that exited non-zero or by a signal, in the order reaped.
  const std::optional<RankFailure>& failure() const { return failure_; }
  /// Every rank exited (whatever the code).
  bool all_exited() const;
  /// Every rank exited 0.
  bool all_succeeded() const;
  /// All exited and their output is forwarded (or the grace for their children passed).
  bool finished() const;

 private:
  struct Rank;
  void start(const std::vector<std::string>& program, const std::vector<RankLaunch>& launches);
  /// SIGKILL to the group, every started rank reaped, every pipe closed.
  void reap_all() noexcept;
  std::vector<Rank> ranks_;
  JobGroup group_;
  std::chrono::duration<double> grace_;
  bool prefix_output_;
  std::optional<RankFailure> failure_;
  std::optional<std::chrono::steady_clock::time_point> kill_at_;
  std::optional<std::chrono::steady_clock::time_point> stop_reading_at_;
};

/// Writes all of `data` to `fd` (going on after EINTR and short writes; gives up on other
/// errors, a closed stdout).
void write_all(int fd, const std::string& data);

}  // namespace torchpar::detail
