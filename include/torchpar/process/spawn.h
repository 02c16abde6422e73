#pragma once
/// spawn / start_processes: N children running fn(i, args...), with error propagation
/// (torch.multiprocessing.spawn).

#include <chrono>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "torchpar/core/error.h"
#include "torchpar/process/process.h"

namespace torchpar {

/// Options of spawn / start_processes.
struct SpawnOptions {
  bool join = true;                           ///< join() before returning
  bool daemon = false;                        ///< children's daemon flag
  std::optional<StartMethod> start_method{};  ///< spawn(): "spawn"; start_processes(): default
  int threads = 1;                            ///< LibTorch intra-op threads per child
};

/// The children of one spawn / start_processes call.
///
/// Lifetime: the destructor kills (SIGKILL) and reaps children still running.
/// Safety: one thread at a time.
/// Source: torch.multiprocessing.ProcessContext.
class ProcessContext {
 public:
  explicit ProcessContext(std::vector<Process> processes);
  ProcessContext(ProcessContext&&) noexcept = default;
  ProcessContext& operator=(ProcessContext&&) noexcept = default;
  ~ProcessContext();

  /// Waits until every child exited (true), or `timeout` passed (false). As soon as one
  /// child fails, the others are terminated (SIGTERM, then SIGKILL after 1 s), all are
  /// reaped, and this throws ProcessRaisedException (the child threw: its index, pid,
  /// exception type and message) or ProcessExitedException (non-zero exit code or a
  /// signal, named as e.g. "SIGKILL").
  bool join(Timeout timeout = std::nullopt);
  std::vector<int> pids() const;
  std::vector<Process>& processes() { return processes_; }

 private:
  void terminate_all();
  std::vector<Process> processes_;
};

/// Starts `nprocs` children running fn(i, args...) for i in [0, nprocs) with the given
/// start method (default: get_start_method()); joins them when options.join.
/// Errors: ValueError for nprocs < 1; as Process::start; from join: ProcessRaisedException /
///         ProcessExitedException.
/// Source: torch.multiprocessing.start_processes.
template <class Fn, class... Args>
ProcessContext start_processes(Fn fn, std::tuple<Args...> args, int nprocs,
                               SpawnOptions options = {}) {
  if (nprocs < 1)
    throw ValueError("start_processes: nprocs must be >= 1, got " + std::to_string(nprocs));
  std::vector<Process> procs;
  procs.reserve(static_cast<size_t>(nprocs));
  for (int i = 0; i < nprocs; ++i) {
    ProcessOptions po;
    po.daemon = options.daemon;
    po.start_method = options.start_method;
    po.threads = options.threads;
    po.name = "SpawnProcess-" + std::to_string(i);
    procs.push_back(detail::make_process(
        po, std::apply([&](auto&... a) { return detail::make_launch_spec(fn, i, a...); }, args)));
  }
  ProcessContext ctx(std::move(procs));
  for (auto& p : ctx.processes()) p.start();
  if (options.join) ctx.join();
  return ctx;
}

/// start_processes with the "spawn" start method unless options say otherwise.
/// Source: torch.multiprocessing.spawn.
template <class Fn, class... Args>
ProcessContext spawn(Fn fn, std::tuple<Args...> args, int nprocs, SpawnOptions options = {}) {
  if (!options.start_method) options.start_method = StartMethod::kSpawn;
  return start_processes(fn, std::move(args), nprocs, options);
}

}  // namespace torchpar
