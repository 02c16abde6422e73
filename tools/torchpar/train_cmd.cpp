// `torchpar train`: options -> torchpar::train::run_train.
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "train/trainer.h"

namespace torchpar::cli {
namespace {

/// Options of one model only (given with the other, the run is refused: exit 2), and the two
/// whose default depends on the model.
struct ModelOptions {
  std::vector<CLI::Option*> mnist_only, gpt_only;
  CLI::Option* batch_size = nullptr;
  CLI::Option* lr = nullptr;
};

/// --model, --strategy, --workers and the optimizer's: --epochs .. --seed.
void add_model_options(CLI::App* cmd, train::TrainConfig& c, ModelOptions& o) {
  cmd->add_option("--model", c.model,
                  "mnist (Fashion-MNIST, the mnist_hogwild network) | gpt (a byte-level GPT on "
                  "/usr/share/games/fortunes)")
      ->check(CLI::IsMember({"mnist", "gpt"}))
      ->capture_default_str();
  cmd->add_option("--strategy", c.strategy, "single | hogwild | ddp | pserver")
      ->check(CLI::IsMember({"single", "hogwild", "ddp", "pserver"}))
      ->capture_default_str();
  cmd->add_option("--workers", c.workers,
                  "worker processes (default: number of cores); pserver: 1 server + N-1 "
                  "trainers, N >= 2; as one rank of a job (RANK/WORLD_SIZE set): WORLD_SIZE, "
                  "any other value is refused")
      ->check(CLI::Range(1, 256));
  o.mnist_only.push_back(
      cmd->add_option("--epochs", c.epochs, "mnist: passes over the training set")
          ->check(CLI::Range(1, 1000))
          ->capture_default_str());
  o.batch_size = cmd->add_option("--batch-size", c.batch_size,
                                 "samples (gpt: windows of --context bytes) per step and "
                                 "worker; gpt's default is 8")
                     ->check(CLI::Range(1, 60000))
                     ->capture_default_str();
  o.lr = cmd->add_option("--lr", c.lr,
                         "learning rate: SGD's (mnist), AdamW's peak (gpt, default 0.001)")
             ->check(finite_number(0, 1e6, /*lo_open=*/true))
             ->capture_default_str();
  o.mnist_only.push_back(cmd->add_option("--momentum", c.momentum, "mnist: SGD momentum")
                             ->check(finite_number(0.0, 1.0))
                             ->capture_default_str());
  cmd->add_option("--seed", c.seed, "seed of the initial weights and the shuffles")
      ->check(decimal_integer<int64_t>())
      ->check(CLI::Range(-(int64_t{1} << 62), int64_t{1} << 62))  // seed + rank must not wrap
      ->capture_default_str();
}

/// Data, outputs, threads and the ddp backend: --data .. --backend.
void add_run_options(CLI::App* cmd, train::TrainConfig& c) {
  cmd->add_option("--data", c.data,
                  "directory of the Fashion-MNIST idx .gz files (mnist) or of the fortune files "
                  "(gpt: /usr/share/games/fortunes)")
      ->default_str("/usr/share/datasets/fashion-mnist");
  cmd->add_option("--out", c.out, "output directory")->default_str("runs/<timestamp>");
  cmd->add_flag_callback(
      "--no-plot", [&c] { c.plot = false; },
      "do not draw curves.png (which runs /usr/bin/python3 with matplotlib, about 1 s); "
      "metrics.json and model.pt are written as always");
  cmd->add_option("--threads-per-worker", c.threads_per_worker,
                  "LibTorch intra-op threads per worker")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--backend", c.backend,
                  "ddp's collective backend: auto (shm within a host; across hosts, shm inside "
                  "each and Gloo between them) | shm | gloo | hierarchical")
      ->check(CLI::IsMember({"auto", "shm", "gloo", "hierarchical"}))
      ->capture_default_str();
}

/// mnist's ddp and pserver options, and --limit.
void add_strategy_options(CLI::App* cmd, train::TrainConfig& c, ModelOptions& o) {
  o.mnist_only.push_back(
      cmd->add_option("--lr-scaling", c.lr_scaling,
                      "mnist ddp: linear (lr x workers, as the gradient of workers batches is "
                      "averaged) or none")
          ->check(CLI::IsMember({"linear", "none"}))
          ->capture_default_str());
  o.mnist_only.push_back(cmd->add_option("--reduce-batch-size", c.reduce_batch_size,
                                         "pserver: most pushes the server averages at once, at "
                                         "each of its two reduction levels")
                             ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
                             ->capture_default_str());
  o.mnist_only.push_back(cmd->add_option("--max-queue-size", c.max_queue_size,
                                         "pserver: pushes the server queues before it drops the "
                                         "oldest (>= --reduce-batch-size)")
                             ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
                             ->capture_default_str());
  cmd->add_option("--limit", c.limit,
                  "use only the first N training samples (mnist) or the first N bytes of the "
                  "corpus (gpt), for quick runs")
      ->check(CLI::NonNegativeNumber);
}

/// The gpt model's shape and schedule: --layers .. --eval-every.
void add_gpt_options(CLI::App* cmd, train::TrainConfig& c, ModelOptions& o) {
  o.gpt_only.push_back(cmd->add_option("--layers", c.layers, "gpt: transformer blocks")
                           ->check(CLI::Range(int64_t{1}, int64_t{256}))
                           ->capture_default_str());
  o.gpt_only.push_back(cmd->add_option("--width", c.width, "gpt: hidden size (n_embd)")
                           ->check(CLI::Range(int64_t{1}, int64_t{1} << 16))
                           ->capture_default_str());
  o.gpt_only.push_back(cmd->add_option("--heads", c.heads, "gpt: attention heads (divide --width)")
                           ->check(CLI::Range(int64_t{1}, int64_t{1} << 10))
                           ->capture_default_str());
  o.gpt_only.push_back(
      cmd->add_option("--context", c.context, "gpt: bytes of a training window (n_positions)")
          ->check(CLI::Range(int64_t{2}, int64_t{1} << 16))
          ->capture_default_str());
  o.gpt_only.push_back(cmd->add_option("--steps", c.steps, "gpt: optimizer steps (default 300)")
                           ->check(CLI::Range(int64_t{1}, int64_t{1} << 40)));
  o.gpt_only.push_back(cmd->add_option("--eval-every", c.eval_every,
                                       "gpt: steps between evaluations on the held-out split "
                                       "(default: steps / 10)")
                           ->check(CLI::Range(int64_t{1}, int64_t{1} << 40)));
}

/// Checkpoints, in-memory snapshots and resume: --checkpoint-every .. --resume.
void add_resume_options(CLI::App* cmd, train::TrainConfig& c) {
  cmd->add_option("--checkpoint-every", c.checkpoint_every,
                  "ddp as ranks of a job: write a checkpoint (model, optimizer, epoch, step, "
                  "data position; atomic: a temporary file, then a rename) every N optimizer "
                  "steps, on rank 0 (0: never)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->capture_default_str();
  cmd->add_option("--checkpoint-dir", c.checkpoint_dir,
                  "directory of the checkpoints (step_<N>.pt); after a restart (torchpar run "
                  "--nnodes MIN:MAX, torchrun --max-restarts) the job resumes from it")
      ->default_str("<out>/checkpoints");
  cmd->add_option("--keep-checkpoints", c.keep_checkpoints, "the newest checkpoints kept")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--snapshot-every", c.snapshot_every,
                  "copy the state into the memory `torchpar run --nnodes MIN:MAX` keeps for "
                  "each rank every N steps (0: never; without that launcher: nothing)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->capture_default_str();
  cmd->add_option("--resume", c.resume,
                  "continue from the newest complete checkpoint in DIR (a newer in-memory "
                  "snapshot of a rank wins)");
}

}  // namespace

Command add_train(CLI::App& app) {
  auto c = std::make_shared<train::TrainConfig>();
  auto* cmd = app.add_subcommand(
      "train",
      "Train the mnist_hogwild network on Fashion-MNIST (--model mnist): one process "
      "(single), N processes updating shared parameters lock-free (hogwild), N ranks averaging "
      "gradients with all_reduce (ddp), or a parameter server and N-1 trainers pushing "
      "gradients and pulling parameters over RPC (pserver). Or a byte-level GPT on the "
      "fortunes corpus (--model gpt; single or ddp), which also writes model.json and a "
      "sample. Writes metrics.json, curves.png and model.pt to --out. Started by `torchpar "
      "run` or torchrun (RANK and WORLD_SIZE set, on one node or several), ddp runs as one "
      "rank of that job instead of spawning workers: each rank trains its shard, rank 0 "
      "prints and writes the outputs.");
  // In this order in --help.
  ModelOptions o;
  add_model_options(cmd, *c, o);
  add_run_options(cmd, *c);
  add_strategy_options(cmd, *c, o);
  add_gpt_options(cmd, *c, o);
  add_resume_options(cmd, *c);
  cmd->add_option("--timeout", c->timeout,
                  "seconds: collective and RPC timeout, and how long workers may stay silent; "
                  "as one rank of a job also how long to wait for every rank to join")
      ->check(finite_number(0, kMaxTimeoutSeconds, /*lo_open=*/true))
      ->capture_default_str();
  return [c, o] {
    const bool gpt = c->model == "gpt";
    for (const CLI::Option* given : gpt ? o.mnist_only : o.gpt_only) {
      if (given->count() > 0) {
        std::fprintf(stderr, "torchpar train: %s applies to --model %s, not %s\n",
                     given->get_name().c_str(), gpt ? "mnist" : "gpt", c->model.c_str());
        return 2;
      }
    }
    if (gpt && o.batch_size->count() == 0) c->batch_size = train::kGptDefaultBatchSize;
    if (gpt && o.lr->count() == 0) c->lr = train::kGptDefaultLr;
    return train::run_train(*c);
  };
}

}  // namespace torchpar::cli
