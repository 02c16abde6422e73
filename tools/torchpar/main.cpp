// torchpar: the command-line program. Thin: parses arguments and calls the library.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <malloc.h>
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "commands.h"

#include "torchpar/core/env.h"
#include "torchpar/process/start_method.h"

int main(int argc, char** argv) {
  // Training frees and reallocates the same MiB-sized activations every step. Under glibc's
  // default (a dynamic mmap threshold, and trimming of free memory at the top of the heap),
  // some runs handed those blocks back to the kernel on every free and faulted them in
  // afresh on the next step: 2.4x the page faults and 3x slower training, depending only
  // on the heap's layout. Keeping freed memory in the process makes every run the fast one.
  // Spawned workers run this binary too, so they get the same settings.
  ::mallopt(M_MMAP_THRESHOLD, 256 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // Training runs one LibTorch thread per process; OpenMP threads that spin while idle
  // (libgomp's default) steal the core from it. libgomp reads OMP_WAIT_POLICY when it loads,
  // so set it and start over once (torchrun likewise sets OMP_NUM_THREADS for its workers).
  if (argc > 1 && std::string(argv[1]) == "train" && !torchpar::env_value("OMP_WAIT_POLICY")) {
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
  auto infer = torchpar::cli::add_infer(app);
  auto serve = torchpar::cli::add_serve(app);
  auto manager = torchpar::cli::add_manager(app);
  CLI11_PARSE(app, argc, argv);
  try {
    if (app.got_subcommand("info")) return info();
    if (app.got_subcommand("run")) return run();
    if (app.got_subcommand("train")) return train();
    if (app.got_subcommand("bench")) return bench();
    if (app.got_subcommand("infer")) return infer();
    if (app.got_subcommand("serve")) return serve();
    if (app.got_subcommand("manager")) return manager();
  } catch (const std::exception& e) {
    fmt::print(stderr, "torchpar: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
