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
