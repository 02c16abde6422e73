#pragma once
// Test support: suites parametrized over the start methods (fork, spawn, forkserver).

#include <gtest/gtest.h>

#include <string>

#include "torchpar/pool/pool.h"
#include "torchpar/process/spawn.h"

namespace torchpar::testing {

class StartMethodTest : public ::testing::TestWithParam<std::string> {
 protected:
  /// Spawn options with this suite's start method. Tests join with a timeout themselves
  /// (`EXPECT_TRUE(ctx.join(60s))`): start_processes' own join has none.
  SpawnOptions opts(bool join = false) {
    SpawnOptions o;
    o.start_method = start_method_from_string(GetParam());
    o.join = join;
    return o;
  }
  /// Pool options with this suite's start method.
  PoolOptions options(size_t processes = 2) {
    PoolOptions o;
    o.processes = processes;
    o.start_method = start_method_from_string(GetParam());
    return o;
  }
};

inline std::string start_method_name(const ::testing::TestParamInfo<std::string>& info) {
  return info.param;
}

}  // namespace torchpar::testing

#define TORCHPAR_INSTANTIATE_FOR_START_METHODS(Suite)                                        \
  INSTANTIATE_TEST_SUITE_P(Methods, Suite, ::testing::Values("fork", "spawn", "forkserver"), \
                           ::torchpar::testing::start_method_name)

/// In a TEST_P over start methods whose subject is not how a child starts (chunking, errors,
/// timeouts, faults): skipped under spawn, where each child only adds a LibTorch start
/// (~0.66 CPU-seconds on the 2-core machines) to what fork and forkserver already cover.
/// Forkserver's children are not forks of the test either, so name-based lookups and
/// argument passing stay covered; the tests of exactly those keep spawn.
#define TORCHPAR_SKIP_UNDER_SPAWN()                                               \
  do {                                                                            \
    if (GetParam() == "spawn")                                                    \
      GTEST_SKIP() << "start-method independent: runs under fork and forkserver"; \
  } while (0)
