#pragma once
// Test support for the manager suites (tests/manager/): their Manager and child options,
// waits for children and servers, and the main every suite runs.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>

#include "support/child.h"
#include "support/run_tests.h"
#include "torchpar/core/auth.h"
#include "torchpar/manager/manager.h"
#include "torchpar/process/process.h"
#include "torchpar/process/start_method.h"

namespace torchpar::testing {

/// Options of a test's Manager: every call of the tests is bounded (plus its own wait).
/// The server starts from the forkserver: one LibTorch start per test binary instead of one
/// per server (the default, spawn, is what the parametrized suites vary).
inline ManagerOptions manager_options() {
  ManagerOptions o;
  o.start_method = StartMethod::kForkserver;
  o.timeout = std::chrono::seconds(30);
  o.start_timeout = std::chrono::seconds(60);
  return o;
}

/// Options of a child started with `method`: daemon, so that a failed test kills its
/// children instead of waiting for them.
inline ProcessOptions child_options(const std::string& method) {
  ProcessOptions po;
  po.start_method = start_method_from_string(method);
  po.daemon = true;
  return po;
}

/// What a child checks: throws (the child fails) when `ok` does not hold.
inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

/// Joins `p` for at most 60 s (then kills it and returns -1000); its exit code, -1000 when
/// it has none.
inline int exit_code(Process& p) {
  if (!p.join(std::chrono::seconds(60))) {
    p.kill();
    p.join(std::chrono::seconds(10));
    return -1000;
  }
  return p.exitcode().value_or(-1000);
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Polls `done` (every 10 ms) until it holds or `within` passes.
template <class F>
bool eventually(F&& done, std::chrono::seconds within = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

/// True when process `pid` is gone (or a zombie).
inline bool gone(int pid) {
  const char s = proc_state(pid);
  return s == '?' || s == 'Z';
}

/// Polls (every 20 ms) until `pid` is gone, for at most `within`.
inline bool gone_within(int pid, std::chrono::seconds within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (!gone(pid)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

/// The main of a manager suite: torchpar::init, then the job's key for every Manager
/// without an explicit one, here and in the children (spawned ones inherit the
/// environment), without touching ~/.cache; then the tests.
inline int manager_test_main(int argc, char** argv) {
  init(argc, argv);
  ::setenv("TORCHPAR_AUTHKEY", to_hex(random_authkey()).c_str(), 0);
  return torchpar::testing::run_tests(argc, argv);
}

}  // namespace torchpar::testing
