#pragma once
// Subcommands of the torchpar CLI. Each registers its options on `app` and returns the
// function to run when it was chosen.

#include <CLI/CLI.hpp>

#include <functional>

namespace torchpar::cli {

using Command = std::function<int()>;

Command add_info(CLI::App& app);
Command add_run(CLI::App& app);
Command add_train(CLI::App& app);
Command add_bench(CLI::App& app);
Command add_infer(CLI::App& app);

}  // namespace torchpar::cli
