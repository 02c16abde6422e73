#pragma once
// The options every message-size sweep of bench/dist/ takes (coll_bench, scaleout_bench),
// in CLI11: --sizes (comma-separated bytes), --iters, --warmup.

#include <vector>

#include <CLI/CLI.hpp>

namespace torchpar::bench {

inline void add_size_options(CLI::App& app, std::vector<long>& sizes, int& iters, int& warmup) {
  app.add_option("--sizes", sizes, "message sizes (bytes)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  app.add_option("--iters", iters, "timed calls per size")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed calls per size first")->check(CLI::NonNegativeNumber);
}

}  // namespace torchpar::bench
