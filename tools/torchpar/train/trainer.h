#pragma once
// `torchpar train`: Fashion-MNIST with the mnist_hogwild Net, single / hogwild / ddp / pserver.

#include <cstdint>
#include <string>

namespace torchpar::train {

/// Everything a run needs; travels to spawned workers (serializable).
struct TrainConfig {
  std::string strategy = "ddp";  ///< single | hogwild | ddp | pserver
  int workers = 0;               ///< 0: number of cores (pserver: 1 server + workers-1 trainers)
  int epochs = 1;
  int batch_size = 64;
  double lr = 0.01;
  double momentum = 0.5;
  int64_t seed = 1;
  std::string data;                   ///< directory of the idx .gz files
  std::string out;                    ///< output directory ("" : runs/<timestamp>)
  int threads_per_worker = 1;         ///< LibTorch intra-op threads per worker
  std::string backend = "auto";       ///< ddp: auto | shm | gloo
  int64_t limit = 0;                  ///< use the first `limit` training samples (0: all)
  double timeout = 120;               ///< seconds: collectives, worker start, progress silence
  std::string lr_scaling = "linear";  ///< ddp: "linear" (lr x workers) or "none"
  int64_t reduce_batch_size = 4;      ///< pserver: most pushes averaged into one step, per level
  int64_t max_queue_size = 64;        ///< pserver: pushes a reducer queue holds (oldest dropped)

  template <class Archive>
  void serialize(Archive& ar) {
    ar(strategy, workers, epochs, batch_size, lr, momentum, seed, data, out, threads_per_worker,
       backend, limit, timeout, lr_scaling, reduce_batch_size, max_queue_size);
  }
};

/// Runs the training as the CLI does (progress on stdout, files in cfg.out); returns the
/// process exit code: 0 done, 1 failed (a worker's error is printed, naming it), 2 bad
/// input (missing or corrupt data, bad option), 130 interrupted by SIGINT/SIGTERM.
int run_train(TrainConfig cfg);

}  // namespace torchpar::train
