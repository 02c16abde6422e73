#pragma once
// The main of torchpar's Google Benchmark programs: torchpar::init, one intra-op thread,
// the program's own integer options ("--calls N") taken out of argv, the rest to Google
// Benchmark.

#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "torchpar/process/start_method.h"

namespace torchpar::bench {

/// Runs the registered benchmarks. `options` maps an option ("--calls") to the integer it
/// sets; `before_shutdown` runs after the benchmarks, while torchpar's statics are alive
/// (to stop the program's child processes). Returns main's exit code.
inline int run_benchmarks(int argc, char** argv, const std::map<std::string, int64_t*>& options,
                          const std::function<void()>& before_shutdown = {}) {
  torchpar::init(argc, argv);
  at::set_num_threads(1);
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    const auto it = options.find(argv[i]);
    if (it != options.end() && i + 1 < argc) {
      *it->second = std::atoll(argv[++i]);
    } else {
      rest.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  if (benchmark::ReportUnrecognizedArguments(n, rest.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  if (before_shutdown) before_shutdown();
  benchmark::Shutdown();
  return 0;
}

}  // namespace torchpar::bench
