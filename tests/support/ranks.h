#pragma once
// Runs a function as N ranks of a World (forked processes on one host) and reports how
// each ended. Ranks get RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT through their arguments.

#include <unistd.h>

#include <fmt/format.h>

#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "torchpar/dist/world.h"
#include "torchpar/process/process.h"

/// Inside a rank: throws (failing the rank, whose error run_ranks reports) when `cond` is
/// false, with an fmt message.
#define TORCHPAR_RCHECK(cond, ...) \
  if (!(cond)) throw std::runtime_error(fmt::format(__VA_ARGS__))

namespace torchpar::testing {

/// A TCP port nobody listens on right now.
inline int free_port() { return torchpar::find_free_port(); }

struct RankResult {
  std::optional<int> exitcode;
  std::string error;  // "Type: message" when the rank threw
};

/// The start method of the ranks: fork, or what TORCHPAR_TEST_RANKS_START_METHOD names
/// (tests/sanitizers/run.sh sets spawn under ThreadSanitizer, which cannot follow threads
/// started in a child forked from a threaded parent).
inline StartMethod ranks_start_method() {
  const char* name = std::getenv("TORCHPAR_TEST_RANKS_START_METHOD");
  return name && *name ? start_method_from_string(name) : StartMethod::kFork;
}

/// Starts fn(rank, args...) in `n` processes (ranks_start_method()), waits up to `timeout`
/// seconds for all, kills the stragglers, returns how each ended.
template <class Fn, class... Args>
std::vector<RankResult> run_ranks(int n, double timeout, Fn fn, Args... args) {
  std::vector<Process> procs;
  for (int r = 0; r < n; ++r) {
    procs.emplace_back(
        ProcessOptions{.name = "rank" + std::to_string(r), .start_method = ranks_start_method()},
        fn, r, args...);
    procs.back().start();
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout));
  std::vector<RankResult> out;
  for (auto& p : procs) {
    const auto left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now());
    if (!p.join(std::max(left, std::chrono::duration<double>(0.01)))) {
      p.kill();
      p.join(std::chrono::seconds(30));  // SIGKILLed: bounded, exitcode() tells if it ended
    }
    RankResult r;
    r.exitcode = p.exitcode();
    if (auto e = p.error()) r.error = e->first + ": " + e->second;
    out.push_back(r);
  }
  return out;
}

}  // namespace torchpar::testing
