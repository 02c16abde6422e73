// Collective latency and bandwidth between ranks on this host: all_reduce (SUM), broadcast
// (root 0), all_gather, reduce_scatter (SUM) and all_to_all of float32 tensors, for torchpar's
// shm and gloo backends and for c10d's ProcessGroupGloo driven directly from C++ (the peer a
// C++ user would write by hand; it has no reduce_scatter on CPU, and its all_to_all takes one
// flat tensor: c10d-gloo-cpp prints neither row).
//
//   coll_bench [--systems torchpar-shm,torchpar-gloo,c10d-gloo-cpp] [--ops all_reduce,...]
//              [--sizes 4,4096,1048576,16777216,67108864] [--iters 200] [--warmup 10]
//              [--ranks 2]
//
// Forks --ranks processes per system, each bound to a CPU of its own when there are enough (as
// mpirun binds its ranks); after 50 ms of 4-byte all_reduces (settle() says why),
// each op is timed on its own (steady_clock) and rank 0
// prints one JSON line per (system, op, size) like the peers in bench/peers/:
//   {"system", "op", "bytes", "ranks", "median_us", "p99_us", "min_us", "busbw_GBps", "iters"}
// over rank 0's per-iteration times: median_us = the upper median (sorted[iters / 2]), p99_us =
// the nearest-rank 99th percentile (sorted[ceil(0.99 iters) - 1]; with fewer than 100 iterations
// that is the maximum), min_us = the fastest iteration. busbw uses the median.
// Iterations shrink with size: max(3, iters * 1 MiB / bytes) above 1 MiB, and the untimed
// warm-up calls before them to max(1, min(warmup, iterations)), as in the peers.
// Sizes: bytes of each rank's input (all_reduce, broadcast, all_gather: one tensor; reduce_scatter
// and all_to_all: the whole input list of n tensors of max(1, bytes / 4 / n) floats each).
// Bus bandwidth as nccl-tests: all_reduce 2(n-1)/n x bytes/t, broadcast bytes/t,
// all_gather (n-1)/n x n*bytes/t, reduce_scatter and all_to_all (n-1)/n x bytes/t.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "support/call_times.h"
#include "support/size_options.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;

namespace {

struct Args {
  std::vector<std::string> systems{"torchpar-shm", "torchpar-gloo", "c10d-gloo-cpp"};
  std::vector<std::string> ops{"all_reduce", "broadcast", "all_gather", "reduce_scatter",
                               "all_to_all"};
  std::vector<long> sizes{4, 4096, 1 << 20, 16 << 20, 64 << 20};
  int iters = 200;
  int warmup = 10;
  int ranks = 2;
};

enum class OpKind { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kAllToAll };

OpKind op_kind(const std::string& op) {
  if (op == "all_reduce") return OpKind::kAllReduce;
  if (op == "broadcast") return OpKind::kBroadcast;
  if (op == "reduce_scatter") return OpKind::kReduceScatter;
  if (op == "all_to_all") return OpKind::kAllToAll;
  return OpKind::kAllGather;
}

/// One call's tensors: `t` (all_reduce, broadcast, all_gather's input, reduce_scatter's output),
/// `out` (all_gather's and all_to_all's outputs), `in` (reduce_scatter's and all_to_all's inputs).
struct Bufs {
  at::Tensor t;
  std::vector<at::Tensor> out;
  std::vector<at::Tensor> in;
};

/// One call of an op. The op is an enum, resolved before timing (as the OpenMPI peer's
/// `int op`): a string compare per call was a few ns of each timed 4-byte call.
/// Returns false when the system has no such op (nothing is printed for it).
using Op = std::function<bool(OpKind op, Bufs& b)>;

double busbw(const std::string& op, long bytes, int n, double seconds) {
  const double b = static_cast<double>(bytes);
  if (op == "all_reduce") return b / seconds * 2.0 * (n - 1) / n / 1e9;
  if (op == "broadcast") return b / seconds / 1e9;
  if (op == "all_gather") return b * n / seconds * (n - 1) / n / 1e9;
  return b / seconds * (n - 1) / n / 1e9;  // reduce_scatter, all_to_all
}

/// 4-byte all_reduces for at least `settle` after the group is made, rank 0 deciding when to
/// stop (its flag is in the sum). Freshly forked ranks start on their parent's core until the
/// kernel's load balancing moves one, a few ms later; timing from the first call would time
/// that placement (the bimodal small-collective rows of issue 19), not the collective.
void settle(int rank, const Op& run, std::chrono::milliseconds settle) {
  const auto t0 = std::chrono::steady_clock::now();
  Bufs go{at::zeros({1}), {}, {}};
  for (;;) {
    go.t.fill_(rank == 0 && std::chrono::steady_clock::now() - t0 < settle ? 1.0 : 0.0);
    run(OpKind::kAllReduce, go);
    if (go.t.item<float>() == 0) return;
  }
}

/// Times every op and size; rank 0 prints. `barrier` separates the groups.
void measure(const Args& a, const std::string& system, int rank, const Op& run,
             const std::function<void()>& barrier) {
  settle(rank, run, std::chrono::milliseconds(50));
  for (const auto& op : a.ops) {
    for (long bytes : a.sizes) {
      const OpKind kind = op_kind(op);
      const bool lists = kind == OpKind::kReduceScatter || kind == OpKind::kAllToAll;
      const long numel = std::max(1L, bytes / 4 / (lists ? a.ranks : 1));
      Bufs b{at::ones({numel}), {}, {}};
      if (kind == OpKind::kAllGather || kind == OpKind::kAllToAll) {
        for (int q = 0; q < a.ranks; ++q) b.out.push_back(at::empty({numel}));
      }
      if (lists) {
        for (int q = 0; q < a.ranks; ++q) b.in.push_back(at::ones({numel}));
      }
      const int iters = torchpar::bench::iters_for(bytes, a.iters);
      barrier();
      const int warmup = torchpar::bench::warmup_for(iters, a.warmup);
      bool has = true;
      for (int i = 0; i < warmup && has; ++i) has = run(kind, b);
      if (!has) continue;
      const auto times = torchpar::bench::time_calls(iters, [&] { run(kind, b); });
      if (rank == 0) {
        std::printf("%s\n", fmt::format("{{\"system\": \"{}\", \"op\": \"{}\", \"bytes\": {}, "
                                        "\"ranks\": {}, \"median_us\": {:.3f}, "
                                        "\"p99_us\": {:.3f}, \"min_us\": {:.3f}, "
                                        "\"busbw_GBps\": {:.4f}, \"iters\": {}}}",
                                        system, op, bytes, a.ranks, times.median_us, times.p99_us,
                                        times.min_us,
                                        busbw(op, bytes, a.ranks, times.median_us * 1e-6), iters)
                                .c_str());
        std::fflush(stdout);
      }
    }
  }
}

void run_torchpar(const Args& a, const std::string& system, int rank, int port) {
  tp::WorldOptions options;
  options.rank = rank;
  options.world_size = a.ranks;
  options.master_addr = "127.0.0.1";
  options.master_port = port;
  options.timeout = std::chrono::seconds(120);
  tp::World world(options);
  auto g = world.create_collective_group(
      {}, system == "torchpar-shm" ? tp::Backend::kShm : tp::Backend::kGloo);
  measure(
      a, system, rank,
      [&](OpKind op, Bufs& b) {
        if (op == OpKind::kAllReduce) {
          g.all_reduce(b.t);
        } else if (op == OpKind::kBroadcast) {
          g.broadcast(b.t, 0);
        } else if (op == OpKind::kReduceScatter) {
          g.reduce_scatter(b.t, b.in);
        } else if (op == OpKind::kAllToAll) {
          g.all_to_all(b.out, b.in);
        } else {
          g.all_gather(b.out, b.t);
        }
        return true;
      },
      [&] { g.barrier(); });
}

void run_c10d(const Args& a, int rank, int port) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = rank == 0;
  o.numWorkers = a.ranks;
  o.timeout = std::chrono::seconds(120);
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
  auto opts = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(120));
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>("bench", store), rank, a.ranks, opts);
  measure(
      a, "c10d-gloo-cpp", rank,
      [&](OpKind op, Bufs& b) {
        std::vector<at::Tensor> v{b.t};
        if (op == OpKind::kAllReduce) {
          pg->allreduce(v)->wait();
        } else if (op == OpKind::kBroadcast) {
          pg->broadcast(v)->wait();
        } else if (op == OpKind::kAllGather) {
          std::vector<std::vector<at::Tensor>> outs{b.out};
          pg->allgather(outs, v)->wait();
        } else {
          return false;  // no reduce_scatter on CPU; all_to_all only of flat tensors
        }
        return true;
      },
      [&] { pg->barrier()->wait(); });
}

/// Binds rank r to the r-th CPU this process may run on, when every rank gets one: mpirun
/// binds its ranks so by default (`--report-bindings`: rank 0 core 0, rank 1 core 1), and
/// unbound forked ranks sometimes shared one core for a whole op (a full run's round measured
/// a 10.3 us 4-byte all_reduce, the rounds around it 0.5). Best effort: left unbound on error.
void bind_to_own_core(int r, int ranks) {
  cpu_set_t allowed;
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || CPU_COUNT(&allowed) < ranks) return;
  int seen = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    if (seen++ == r) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      (void)::sched_setaffinity(0, sizeof(one), &one);
      return;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  tp::init(argc, argv);
  Args a;
  CLI::App app{"collectives of 2+ forked ranks: torchpar (shm, gloo) and c10d's Gloo"};
  app.add_option("--systems", a.systems, "torchpar-shm, torchpar-gloo, c10d-gloo-cpp")
      ->delimiter(',')
      ->check(CLI::IsMember({"torchpar-shm", "torchpar-gloo", "c10d-gloo-cpp"}));
  app.add_option("--ops", a.ops, "all_reduce, broadcast, all_gather, reduce_scatter, all_to_all")
      ->delimiter(',')
      ->check(
          CLI::IsMember({"all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"}));
  torchpar::bench::add_size_options(app, a.sizes, a.iters, a.warmup);
  app.add_option("--ranks", a.ranks, "ranks (forked processes)")->check(CLI::Range(2, 64));
  CLI11_PARSE(app, argc, argv);
  int status_all = 0;
  for (const auto& system : a.systems) {
    const int port = tp::find_free_port();
    std::vector<pid_t> kids;
    for (int r = 0; r < a.ranks; ++r) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        at::set_num_threads(1);
        bind_to_own_core(r, a.ranks);
        try {
          if (system == "c10d-gloo-cpp") {
            run_c10d(a, r, port);
          } else if (system == "torchpar-shm" || system == "torchpar-gloo") {
            run_torchpar(a, system, r, port);
          } else {
            std::fprintf(stderr, "coll_bench: unknown system %s\n", system.c_str());
            ::_exit(2);
          }
        } catch (const std::exception& e) {
          std::fprintf(stderr, "coll_bench %s rank %d: %s\n", system.c_str(), r, e.what());
          std::fflush(stdout);
          ::_exit(1);
        }
        std::fflush(stdout);
        ::_exit(0);
      }
      kids.push_back(pid);
    }
    for (pid_t k : kids) {
      int st = 0;
      ::waitpid(k, &st, 0);
      if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) status_all = 1;
    }
  }
  return status_all;
}
