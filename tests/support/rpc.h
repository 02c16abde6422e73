#pragma once
// Helpers of the multi-process RPC and server suites: their main (a fresh job key, as
// `torchpar run` gives its ranks), a World per rank named "0", "1", ..., every rank's exit
// checked, and "this call throws exactly E" inside a rank.

#include <c10/util/Type.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/ranks.h"
#include "support/run_tests.h"
#include "torchpar/core/auth.h"
#include "torchpar/dist/world.h"
#include "torchpar/process/start_method.h"

namespace torchpar::testing {

/// The main of an RPC suite: torchpar::init, then a fresh random TORCHPAR_AUTHKEY for this
/// test program and every rank it starts (forked and spawned ranks inherit the
/// environment), as `torchpar run` makes one per job: RPC refuses to start without a job
/// key and never reads the per-user key file. Then the tests.
inline int rpc_test_main(int argc, char** argv) {
  init(argc, argv);
  ::setenv(kAuthKeyEnv, to_hex(random_authkey()).c_str(), 1);
  return torchpar::testing::run_tests(argc, argv);
}

/// Rank `rank` of a `world`-rank World on 127.0.0.1:`port`, named std::to_string(rank).
/// Its key (for the store and RPC) is TORCHPAR_AUTHKEY, which rpc_test_main sets.
inline World make_named_world(int rank, int world, int port) {
  return World(WorldOptions{.name = std::to_string(rank),
                            .rank = rank,
                            .world_size = world,
                            .master_addr = "127.0.0.1",
                            .master_port = port,
                            .timeout = std::chrono::seconds(60)});
}

/// Every rank exited 0 (a gtest failure per rank that did not, with its error).
inline void expect_ranks_ok(const std::vector<RankResult>& res) {
  for (size_t r = 0; r < res.size(); ++r) {
    EXPECT_EQ(res[r].exitcode, 0) << "rank " << r << ": " << res[r].error;
  }
}

/// Runs fn and returns the E it throws; throws std::runtime_error (failing the rank) when it
/// throws something else or nothing. `what` names the step in that error.
template <class E, class Fn>
E expect_throw(Fn fn, const char* what) {
  try {
    fn();
  } catch (const E& e) {
    return e;
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: threw {} ({}), not the expected type", what,
                                         c10::demangle(typeid(e).name()), e.what()));
  }
  throw std::runtime_error(fmt::format("{}: did not throw", what));
}

}  // namespace torchpar::testing
