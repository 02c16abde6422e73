// torchpar: the command-line program. Thin: parses arguments and calls the library.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <exception>
#include <vector>

#include "commands.h"

#include "torchpar/process/start_method.h"

int main(int argc, char** argv) {
  torchpar::init(argc, argv);  // spawned children of torchpar commands run here
  CLI::App app{"torchpar: shared-memory tensors, processes, pools and collectives for LibTorch"};
  app.require_subcommand(1);
  std::vector<torchpar::cli::Command> commands;
  auto info = torchpar::cli::add_info(app);
  auto run = torchpar::cli::add_run(app);
  auto train = torchpar::cli::add_train(app);
  CLI11_PARSE(app, argc, argv);
  try {
    if (app.got_subcommand("info")) return info();
    if (app.got_subcommand("run")) return run();
    if (app.got_subcommand("train")) return train();
  } catch (const std::exception& e) {
    fmt::print(stderr, "torchpar: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
