#pragma once
// `torchpar train --model mnist`: the training steps (shards, an epoch, the evaluation, SGD)
// and the spawned workers of hogwild, ddp and pserver (trainer.cpp is the parent).

#include <ATen/core/Tensor.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fashion_mnist.h"
#include "net.h"
#include "torchpar/torchpar.h"
#include "workers.h"

namespace torchpar::train {

constexpr int kReportEveryBatches = 20;  // batches between progress messages

/// The sample indices of `part` of `parts` for `epoch`: a permutation of the n samples seeded
/// by seed+epoch (the same on every worker), without its first `offset` (the samples of the
/// epoch the job consumed already), dealt round-robin, every part the same length. After k
/// steps of batch B the parts consumed exactly the permutation's first k x B x parts samples,
/// so a job that resumes at that offset with another number of parts continues the same order.
at::Tensor shard(int64_t n, int64_t seed, int epoch, int part, int parts, int64_t offset = 0);

/// One pass over `idx`; calls report(samples, loss_sum, batches) every kReportEveryBatches batches
/// and at the end with the increments since the last call. `update()` runs after each
/// backward and applies the gradients: an optimizer step (ddp averages them first; pserver
/// pushes them to the server and pulls its newest parameters).
template <class Report, class Update>
void train_epoch(Net& net, const Split& data, const at::Tensor& idx, int batch_size,
                 Report&& report, Update&& update) {
  net->train();
  int64_t samples = 0, batches = 0;
  double loss_sum = 0;
  const int64_t n = idx.numel();
  for (int64_t first = 0; first < n; first += batch_size) {
    const auto b = idx.slice(0, first, std::min(n, first + batch_size));
    const auto x = normalize(data.images.index_select(0, b));
    const auto y = data.labels.index_select(0, b);
    net->zero_grad();  // in place, as Optimizer::zero_grad
    auto loss = torch::nll_loss(net->forward(x), y);
    loss.backward();
    update();
    samples += b.numel();
    loss_sum += loss.item<double>();
    if (++batches == kReportEveryBatches) {
      report(samples, loss_sum, batches);
      samples = batches = 0;
      loss_sum = 0;
    }
  }
  report(samples, loss_sum, batches);
}

struct Eval {
  double loss = 0;
  double accuracy = 0;
};

/// Mean loss and accuracy (%) of `net` on `test`.
Eval evaluate(Net& net, const Split& test);

/// ddp averages the gradients of `workers` batches per step: with lr_scaling "linear" its
/// learning rate is lr x workers (the linear scaling rule, Goyal et al. 2017), so an epoch
/// of ddp learns as much as an epoch of single with the same --lr. pserver steps once per
/// push while the server keeps up (see grad_server_options): no scaling.
double effective_lr(const TrainConfig& c);
torch::optim::SGD make_sgd(Net& net, const TrainConfig& c);

// ---- workers (spawned by the parent; their arguments travel in the launch record) ---------

/// hogwild: trains its shard on the parameters in shared memory (`shared`), lock-free.
void hogwild_worker(int index, TrainConfig cfg, std::vector<at::Tensor> shared, at::Tensor images,
                    at::Tensor labels, Queue<Msg> msgs, Queue<int> go);
/// ddp rank `rank`: DistributedDataParallel over the World of the run; rank 0 sends its
/// parameters after each epoch.
void ddp_worker(int rank, TrainConfig cfg, int port, AuthKey key, at::Tensor images,
                at::Tensor labels, Queue<Msg> msgs, Queue<int> go,
                Queue<std::vector<at::Tensor>> params_out);
/// pserver's rank 0: the gradient server (see mnist_workers.cpp).
void pserver_server(TrainConfig cfg, int port, AuthKey key, Queue<Msg> msgs, Queue<int> requests,
                    Queue<std::vector<at::Tensor>> params_out);
/// pserver's ranks 1..workers-1: trainers pushing to the server.
void pserver_trainer(int rank, TrainConfig cfg, int port, AuthKey key, at::Tensor images,
                     at::Tensor labels, Queue<Msg> msgs, Queue<int> go);

}  // namespace torchpar::train
