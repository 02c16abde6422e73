#pragma once
// `torchpar train`: Fashion-MNIST with the mnist_hogwild Net (single / hogwild / ddp / pserver),
// or a byte-level GPT on the fortunes corpus (single / ddp).

#include <cstdint>
#include <string>

namespace torchpar::train {

// Defaults of --model gpt where they differ from mnist's (train_cmd.cpp applies them when the
// option is not given). Sized for the 2-core VM; see docs/training.md, "GPT on fortunes".
inline constexpr double kGptDefaultLr = 1e-3;
inline constexpr int kGptDefaultBatchSize = 8;  ///< windows per step and worker
inline constexpr int64_t kGptDefaultSteps = 300;

/// Everything a run needs; travels to spawned workers (serializable). Fields marked mnist or
/// gpt apply to that --model only.
struct TrainConfig {
  std::string model = "mnist";   ///< mnist (Fashion-MNIST, the mnist_hogwild Net) | gpt (fortunes)
  std::string strategy = "ddp";  ///< single | hogwild | ddp | pserver (gpt: single | ddp)
  int workers = 0;               ///< 0: number of cores (pserver: 1 server + workers-1 trainers)
  int epochs = 1;                ///< mnist
  int batch_size = 64;           ///< samples (mnist) or windows of `context` bytes (gpt) per step
                                 ///< and worker
  double lr = 0.01;              ///< mnist: SGD's; gpt: AdamW's peak (see gpt_trainer.h)
  double momentum = 0.5;         ///< mnist
  int64_t seed = 1;
  std::string data;                   ///< mnist: the idx .gz files; gpt: the fortune files
  std::string out;                    ///< output directory ("" : runs/<timestamp>)
  int threads_per_worker = 1;         ///< LibTorch intra-op threads per worker
  std::string backend = "auto";       ///< ddp: auto | shm | gloo | hierarchical
  int64_t limit = 0;                  ///< mnist: the first `limit` training samples; gpt: the
                                      ///< first `limit` bytes of the corpus (0: all)
  double timeout = 120;               ///< seconds: collectives, worker start, progress silence
  std::string lr_scaling = "linear";  ///< mnist ddp: "linear" (lr x workers) or "none"
  int64_t reduce_batch_size = 4;      ///< pserver: most pushes averaged into one step, per level
  int64_t max_queue_size = 64;        ///< pserver: pushes a reducer queue holds (oldest dropped)
  int64_t layers = 4;                 ///< gpt: transformer blocks (n_layer)
  int64_t width = 256;                ///< gpt: n_embd
  int64_t heads = 4;                  ///< gpt: n_head (divides width)
  int64_t context = 128;              ///< gpt: n_positions, the bytes of a training window
  int64_t steps = 0;                  ///< gpt: optimizer steps (0: kGptDefaultSteps)
  int64_t eval_every = 0;             ///< gpt: steps between evaluations (0: steps / 10)
  bool plot = true;                   ///< draw curves.png (tools/plot_curves.py) after the run
  // Checkpoints, snapshots and resume (resume.h; ddp as the ranks of a job).
  int64_t checkpoint_every = 0;  ///< optimizer steps between checkpoints (0: none)
  std::string checkpoint_dir;    ///< where checkpoints go ("": <out>/checkpoints)
  int keep_checkpoints = 2;      ///< the newest checkpoints kept
  int64_t snapshot_every = 1;    ///< steps between in-memory snapshots (0: none); needs the
                                 ///< launcher's slots (`torchpar run --nnodes MIN:MAX`)
  std::string resume;            ///< a checkpoint directory to continue from ("": none)

  template <class Archive>
  void serialize(Archive& ar) {
    ar(model, strategy, workers, epochs, batch_size, lr, momentum, seed, data, out,
       threads_per_worker, backend, limit, timeout, lr_scaling, reduce_batch_size, max_queue_size,
       layers, width, heads, context, steps, eval_every, plot, checkpoint_every, checkpoint_dir,
       keep_checkpoints, snapshot_every, resume);
  }
};

/// Runs the training as the CLI does (progress on stdout, files in cfg.out); returns the
/// process exit code: 0 done, 1 failed (a worker's error is printed, naming it), 2 bad
/// input (missing or corrupt data, bad option), 130 interrupted by SIGINT/SIGTERM.
/// cfg.model "gpt" runs run_gpt_train (gpt_trainer.h).
/// With RANK and WORLD_SIZE in the environment (torchrun, `torchpar run`) this process is
/// one rank of a ddp job and spawns nothing: it trains its shard, and only rank 0 prints
/// and writes cfg.out; the other ranks print errors only (see rank_from_env in workers.h
/// for what is refused with 2).
int run_train(TrainConfig cfg);

/// `torchpar train --model gpt`: a byte-level Gpt on the fortunes corpus (gpt_trainer.cpp).
/// Exit codes as run_train.
int run_gpt_train(TrainConfig cfg);

}  // namespace torchpar::train
