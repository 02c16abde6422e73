#pragma once
// What a spawned child reads from its launch-record fd.

#include <string>
#include <vector>

#include "torchpar/process/process.h"

namespace torchpar::detail {

struct LaunchRecord {
  CodeAddress trampoline;
  CodeAddress fn;
  int threads = 1;
  std::string name;
  std::string args;  // bytes of the argument payload; its fds are passed by number
  template <class Archive>
  void serialize(Archive& ar) {
    ar(trampoline, fn, threads, name, args);
  }
};

/// argv recorded by torchpar::init (re-exec'd for spawn).
std::vector<std::string>& saved_argv();

/// Child side of spawn and forkserver: sets the thread budget and runs the target.
void run_launch_record(LaunchRecord rec, std::vector<UniqueFd> fds);

/// fork+exec of this program with `env_entry` added to the environment and `keep` fds
/// inherited; the child dies with this process (PR_SET_PDEATHSIG; from a thread other than
/// the main one the clone runs on a long-lived launcher thread, so the child outlives the
/// calling thread). Needs torchpar::init in main.
int exec_self(const std::vector<int>& keep, const std::string& env_entry, const std::string& what);

/// The forkserver: serves start requests on `sock` until its client goes away.
[[noreturn]] void run_forkserver(int sock);

/// Starts `record` (+ its argument fds) in a child of the forkserver (started on first
/// use). Returns the child's pid and the status channel: the server writes the raw wait
/// status there when the child exits.
std::pair<int, UniqueFd> forkserver_start(const Payload& record, std::vector<int> arg_fds,
                                          int slot_fd);

}  // namespace torchpar::detail
