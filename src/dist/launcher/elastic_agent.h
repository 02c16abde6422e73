#pragma once
// The elastic mode of `torchpar run`: one agent per node, rendezvous rounds through the
// authenticated store (docs/distributed.md, "Elastic jobs").

#include "torchpar/dist/launcher.h"

namespace torchpar::detail {

/// Runs this node's agent until the job ends; the exit code as launch_job documents.
int run_elastic(const LaunchOptions& options);

}  // namespace torchpar::detail
