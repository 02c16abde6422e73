// torchpar: the command-line program. Thin: parses arguments and calls the library.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "commands.h"

#include "torchpar/process/start_method.h"

int main(int argc, char** argv) {
  // Training runs one LibTorch thread per process; OpenMP threads that spin while idle
  // (libgomp's default) steal the core from it. libgomp reads OMP_WAIT_POLICY when it loads,
  // so set it and start over once (torchrun likewise sets OMP_NUM_THREADS for its workers).
  if (argc > 1 && std::string(argv[1]) == "train" && std::getenv("OMP_WAIT_POLICY") == nullptr) {
    ::setenv("OMP_WAIT_POLICY", "passive", 1);
    ::execv("/proc/self/exe", argv);  // on failure, go on as we are
  }
  torchpar::init(argc, argv);  // spawned children of torchpar commands run here
  CLI::App app{"torchpar: shared-memory tensors, processes, pools and collectives for LibTorch"};
  app.require_subcommand(1);
  std::vector<torchpar::cli::Command> commands;
  auto info = torchpar::cli::add_info(app);
  auto run = torchpar::cli::add_run(app);
  auto train = torchpar::cli::add_train(app);
  auto bench = torchpar::cli::add_bench(app);
  CLI11_PARSE(app, argc, argv);
  try {
    if (app.got_subcommand("info")) return info();
    if (app.got_subcommand("run")) return run();
    if (app.got_subcommand("train")) return train();
    if (app.got_subcommand("bench")) return bench();
  } catch (const std::exception& e) {
    fmt::print(stderr, "torchpar: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
