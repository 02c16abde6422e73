// `torchpar train`: options -> torchpar::train::run_train.
#include <thread>

#include "commands.h"
#include "train/trainer.h"

namespace torchpar::cli {

Command add_train(CLI::App& app) {
  auto c = std::make_shared<train::TrainConfig>();
  auto* cmd = app.add_subcommand(
      "train",
      "Train the mnist_hogwild network on Fashion-MNIST: one process (single), N processes "
      "updating shared parameters lock-free (hogwild), N ranks averaging gradients with "
      "all_reduce (ddp), or a parameter server and N-1 trainers pushing gradients and pulling "
      "parameters over RPC (pserver). Writes metrics.json, curves.png and model.pt to --out.");
  cmd->add_option("--strategy", c->strategy, "single | hogwild | ddp | pserver")
      ->check(CLI::IsMember({"single", "hogwild", "ddp", "pserver"}))
      ->capture_default_str();
  cmd->add_option("--workers", c->workers,
                  "worker processes (default: number of cores); pserver: 1 server + N-1 "
                  "trainers, N >= 2")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--epochs", c->epochs, "passes over the training set")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd->add_option("--batch-size", c->batch_size, "samples per step and worker")
      ->check(CLI::Range(1, 60000))
      ->capture_default_str();
  cmd->add_option("--lr", c->lr, "SGD learning rate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--momentum", c->momentum, "SGD momentum")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--seed", c->seed, "seed of the initial weights and the shuffles")
      ->capture_default_str();
  cmd->add_option("--data", c->data, "directory of the Fashion-MNIST idx .gz files")
      ->default_str("/usr/share/datasets/fashion-mnist");
  cmd->add_option("--out", c->out, "output directory")->default_str("runs/<timestamp>");
  cmd->add_option("--threads-per-worker", c->threads_per_worker,
                  "LibTorch intra-op threads per worker")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--backend", c->backend, "ddp's collective backend: auto | shm | gloo")
      ->check(CLI::IsMember({"auto", "shm", "gloo"}))
      ->capture_default_str();
  cmd->add_option("--lr-scaling", c->lr_scaling,
                  "ddp: linear (lr x workers, as the gradient of workers batches is averaged) "
                  "or none")
      ->check(CLI::IsMember({"linear", "none"}))
      ->capture_default_str();
  cmd->add_option("--reduce-batch-size", c->reduce_batch_size,
                  "pserver: most pushes the server averages at once, at each of its two "
                  "reduction levels")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--max-queue-size", c->max_queue_size,
                  "pserver: pushes the server queues before it drops the oldest "
                  "(>= --reduce-batch-size)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--limit", c->limit, "use only the first N training samples (quick runs)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--timeout", c->timeout,
                  "seconds: collective and RPC timeout, and how long workers may stay silent")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  return [c] { return train::run_train(*c); };
}

}  // namespace torchpar::cli
