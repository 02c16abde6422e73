// all_reduce across hosts: torchpar's hierarchical backend (shared memory inside each host,
// Gloo between one leader per host) against flat Gloo among every rank. One rank of a job
// started by `torchpar run` (or torchrun) on each host:
//
//   torchpar run --nnodes H --node-rank K --master-addr A --master-port P -n L --
//       scaleout_bench [--systems torchpar-hier,torchpar-gloo] [--sizes 4096,1048576,16777216]
//                      [--iters 200] [--warmup 10] [--link unshaped] [--timeout 120]
//
// bench/run_bench.py (section scale-out) starts it in two network namespaces joined by a
// veth pair, the link shaped with tc or not (--link only labels the output).
//
// For each system: one group over every rank (Backend::kHierarchical or Backend::kGloo),
// then for each size a check (every rank contributes rank + 1, every element must come back
// as n(n+1)/2 on every rank; any mismatch fails the run on every rank, naming it), a
// barrier, warm-up calls and timed calls of all_reduce (SUM, float32), each timed alone with
// steady_clock. Iterations shrink with size as coll_bench's: max(3, iters * 1 MiB / bytes)
// above 1 MiB. Rank 0 prints one JSON line per (system, size), coll_bench's keys plus
// "hosts", "link", "backend" (the group's backend()) and "calls" (all_reduce calls of that
// size, check included: what crossed the link, for the bytes model):
//   {"system", "op", "bytes", "ranks", "hosts", "link", "backend", "median_us", "p99_us",
//    "min_us", "busbw_GBps", "iters", "calls"}
// median_us = the upper median of rank 0's per-call times (sorted[iters / 2]), p99_us = the
// nearest-rank 99th percentile (sorted[ceil(0.99 iters) - 1]), min_us = the fastest call;
// busbw_GBps = 2(n-1)/n x bytes / median with n = ranks (nccl-tests' all_reduce bus
// bandwidth). hosts = WORLD_SIZE / LOCAL_WORLD_SIZE.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/call_times.h"
#include "support/size_options.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;

namespace {

struct Args {
  std::vector<std::string> systems{"torchpar-hier", "torchpar-gloo"};
  std::vector<long> sizes{4096, 1 << 20, 16 << 20};
  int iters = 200;
  int warmup = 10;
  std::string link = "unshaped";
  double timeout_s = 120;
};

tp::Backend backend_of(const std::string& system) {
  if (system == "torchpar-hier") return tp::Backend::kHierarchical;
  if (system == "torchpar-gloo") return tp::Backend::kGloo;
  throw std::invalid_argument(
      fmt::format("unknown system '{}' (torchpar-hier or torchpar-gloo)", system));
}

/// Every rank contributes rank + 1; throws on every rank when any rank got a wrong element,
/// so a broken backend cannot print a timing.
void check_sum(tp::CollectiveGroup& g, const std::string& system, long numel) {
  const int n = g.size();
  at::Tensor t = at::full({numel}, static_cast<float>(g.rank() + 1));
  g.all_reduce(t);
  const float want = static_cast<float>(n * (n + 1) / 2);
  const auto wrong = (t != want).nonzero();
  const long bad = wrong.size(0);
  std::string mine;
  if (bad > 0) {
    const long at_index = wrong[0].item<long>();
    mine = fmt::format("rank {} got {} wrong elements of {} (first: [{}] = {}, expected {})",
                       g.rank(), bad, numel, at_index, t[at_index].item<float>(), want);
    std::fprintf(stderr, "scaleout_bench %s: %s\n", system.c_str(), mine.c_str());
  }
  // The verdict travels through the group itself: every rank stops, not just the wrong one.
  at::Tensor flag = at::full({1}, bad > 0 ? 1.0F : 0.0F);
  g.all_reduce(flag);
  const int ranks_wrong = static_cast<int>(flag.item<float>());
  if (ranks_wrong > 0) {
    throw std::runtime_error(
        fmt::format("{}: all_reduce SUM of {} floats is wrong on {} of {} ranks{}", system, numel,
                    ranks_wrong, n, mine.empty() ? "" : " (" + mine + ")"));
  }
}

void measure(const Args& a, const std::string& system, tp::World& world, int hosts) {
  auto g = world.create_collective_group({}, backend_of(system));
  const int n = g.size();
  for (long bytes : a.sizes) {
    const long numel = std::max(1L, bytes / 4);
    check_sum(g, system, numel);
    // Zeros: a sum of zeros stays finite however many calls run (ones would overflow).
    at::Tensor t = at::zeros({numel});
    const int iters = torchpar::bench::iters_for(bytes, a.iters);
    g.barrier();
    const int warmup = torchpar::bench::warmup_for(iters, a.warmup);
    for (int i = 0; i < warmup; ++i) g.all_reduce(t);
    const auto times = torchpar::bench::time_calls(iters, [&] { g.all_reduce(t); });
    const double busbw =
        static_cast<double>(bytes) / (times.median_us * 1e-6) * 2.0 * (n - 1) / n / 1e9;
    if (g.rank() == 0) {
      std::printf(
          "%s\n",
          fmt::format("{{\"system\": \"{}\", \"op\": \"all_reduce\", \"bytes\": {}, "
                      "\"ranks\": {}, \"hosts\": {}, \"link\": \"{}\", \"backend\": \"{}\", "
                      "\"median_us\": {:.3f}, \"p99_us\": {:.3f}, \"min_us\": {:.3f}, "
                      "\"busbw_GBps\": {:.4f}, \"iters\": {}, \"calls\": {}}}",
                      system, bytes, n, hosts, a.link, tp::to_string(g.backend()), times.median_us,
                      times.p99_us, times.min_us, busbw, iters, warmup + iters + 1)
              .c_str());
      std::fflush(stdout);
    }
  }
  g.barrier();
}

// Lists are comma-separated; a bad value or an unknown option exits with CLI11's code.
void add_options(CLI::App& app, Args& a) {
  app.add_option("--systems", a.systems, "torchpar-hier and/or torchpar-gloo")
      ->delimiter(',')
      ->check(CLI::IsMember({"torchpar-hier", "torchpar-gloo"}));
  torchpar::bench::add_size_options(app, a.sizes, a.iters, a.warmup);
  app.add_option("--link", a.link, "label of the link in the output")
      ->check(CLI::IsMember({"shaped", "unshaped"}));
  app.add_option("--timeout", a.timeout_s, "the World's timeout (seconds)")
      ->check(CLI::PositiveNumber);
}

}  // namespace

int main(int argc, char** argv) {
  tp::init(argc, argv);
  Args a;
  CLI::App app{
      "all_reduce across hosts: hierarchical vs flat Gloo (one rank of a torchpar run job)"};
  add_options(app, a);
  CLI11_PARSE(app, argc, argv);
  // One thread per rank, as coll_bench's ranks: the reduction's own threads would compete
  // with the other ranks of the host for its cores.
  at::set_num_threads(1);
  int rank = -1;
  try {
    tp::World world(tp::WorldOptions{.timeout = std::chrono::duration<double>(a.timeout_s)});
    rank = world.get_rank();
    const int hosts = world.get_world_size() / world.get_local_world_size();
    for (const auto& system : a.systems) measure(a, system, world, hosts);
    world.destroy();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "scaleout_bench rank %d: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
