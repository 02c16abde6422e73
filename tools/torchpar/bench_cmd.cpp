// `torchpar bench`: runs bench/run_bench.py, which runs every benchmark beside its peers and
// writes bench/results/<date>/report.md, results.json and plots.
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "commands.h"
#include "torchpar/core/env.h"

namespace torchpar::cli {

namespace {
struct BenchOptions {
  bool quick = false;
  std::string only;
  std::string out;
  int rounds = 0;
};
}  // namespace

Command add_bench(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  auto* cmd = app.add_subcommand(
      "bench",
      "Run every benchmark and its peers (torch.multiprocessing, multiprocessing.Pool and Manager, "
      "torch.distributed.rpc and a parameter server written with it, torch.distributed gloo, c10d "
      "Gloo, OpenMPI, the PyTorch training recipes) interleaved, and write a report with ratios "
      "and plots to bench/results/<date>/.");
  cmd->add_flag("--quick", o->quick, "small sizes and 1 round: a smoke check (< 3 min)");
  cmd->add_option("--only", o->only,
                  "comma-separated subset of handoff, pools, manager, rpc, pserver, collectives, "
                  "scale-out (root: two network namespaces), train, inference, serve (torchpar "
                  "serve against a Python http.server peer, 1 to 32 streaming clients), python "
                  "(the Python package against torch.multiprocessing and multiprocessing), "
                  "python_dist (torch.distributed on backend torchpar against gloo), elastic "
                  "(a node lost and back under torchpar run --nnodes 1:2 against torchrun), "
                  "limits");
  cmd->add_option("--out", o->out, "output directory (default bench/results/<date>)");
  cmd->add_option("--rounds", o->rounds, "interleaved rounds per benchmark (default 3; --quick 1)")
      ->check(CLI::Range(1, 100));
  return [o] {
    // Where the runner and the benchmark programs are: TORCHPAR_BENCH_DIR, else an install
    // prefix around this program (bin/ -> share/torchpar/bench, libexec/torchpar), else the
    // build tree this program was built in (the programs sit beside it).
    const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe");
    const std::filesystem::path prefix = exe.parent_path().parent_path();
    std::filesystem::path runner, bin = exe.parent_path();
    if (const auto d = env_value("TORCHPAR_BENCH_DIR")) {
      runner = std::filesystem::path(*d) / "run_bench.py";
    } else if (std::filesystem::exists(prefix / "share/torchpar/bench/run_bench.py")) {
      runner = prefix / "share/torchpar/bench/run_bench.py";
      bin = prefix / "libexec/torchpar";
    }
#ifdef TORCHPAR_SOURCE_BENCH_DIR
    if (runner.empty()) runner = TORCHPAR_SOURCE_BENCH_DIR "/run_bench.py";
#endif
    if (runner.empty() || !std::filesystem::exists(runner)) {
      std::fprintf(stderr,
                   "torchpar bench: cannot find run_bench.py (looked in %s; set "
                   "TORCHPAR_BENCH_DIR to the bench/ directory of a torchpar source tree)\n",
                   (prefix / "share/torchpar/bench").c_str());
      return 2;
    }
    std::vector<std::string> args = {"/usr/bin/python3", runner.string(), "--bin",
                                     bin.string(),       "--cli",         exe.string()};
    if (o->quick) args.push_back("--quick");
    if (!o->only.empty()) args.insert(args.end(), {"--only", o->only});
    if (!o->out.empty()) args.insert(args.end(), {"--out", o->out});
    if (o->rounds > 0) args.insert(args.end(), {"--rounds", std::to_string(o->rounds)});
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    std::perror("torchpar bench: cannot run /usr/bin/python3 (install python3)");
    return 2;
  };
}

}  // namespace torchpar::cli
