#include "mnist_workers.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <chrono>
#include <thread>

#include "torchpar/server/push_pull_grad_server.h"

namespace torchpar::train {
namespace {

torch::optim::SGDOptions sgd_options(const TrainConfig& c) {
  return torch::optim::SGDOptions(effective_lr(c)).momentum(c.momentum);
}

/// A worker after its setup: reports ready, then trains one epoch of its shard per `go`
/// message until kStop, reporting progress; update() applies each batch's gradients (see
/// train_epoch). after_epoch() runs before the epoch is reported done and returns the
/// seconds and steps the worker spent synchronizing gradients during it (ddp; else zeros),
/// which the kEpochDone message carries.
template <class Update, class AfterEpoch>
void serve_epochs(int index, const TrainConfig& cfg, Net& net, const Split& data, Queue<Msg>& msgs,
                  Queue<int>& go, Update&& update, AfterEpoch&& after_epoch) {
  msgs.put({kReady, index, 0, 0, 0.0, 0});
  for (int epoch = 1;; ++epoch) {
    if (go.get(Seconds(24 * 3600)) == kStop) return;
    const auto idx = shard(data.size(), cfg.seed, epoch, index - first_trainer(cfg), trainers(cfg));
    train_epoch(
        net, data, idx, cfg.batch_size,
        [&](int64_t s, double l, int64_t b) {
          msgs.put({kProgress, index, epoch, s, l, b});
        },
        update);
    const SyncTime sync = after_epoch();
    msgs.put({kEpochDone, index, epoch, 0, sync.seconds, sync.steps});
  }
}

// pserver: rank 0 hosts the gradient server `kGradServer` in the RPC group of every rank.
constexpr const char* kGradServer = "grad";
constexpr const char* kServerMember = "server";

RpcGroup join_rpc_group(World& world, const TrainConfig& cfg) {
  return world.create_rpc_group("train", world.get_names(),
                                RpcGroupOptions{.timeout = Seconds(cfg.timeout)});
}

/// The server is the primary and only secondary reducer: trainers push to it and it steps.
/// Means at both levels. The reducer never waits for a batch to fill (flush_after 0): a step
/// averages the pushes that arrived while the previous one ran, at most reduce_batch_size a
/// level, so while the server keeps up every push is one step (as single and hogwild step
/// once per batch) and the same --lr learns as much per epoch. machin's default, waiting for
/// full batches, would average up to reduce_batch_size^2 pushes a step: that many times
/// fewer steps per epoch.
PushPullGradServerOptions grad_server_options(const TrainConfig& cfg) {
  PushPullGradServerOptions o;
  o.primary_reducer = kServerMember;
  o.secondary_reducers = {kServerMember};
  o.reduce_method = "mean";
  o.reduce_batch_size = cfg.reduce_batch_size;
  o.max_queue_size = cfg.max_queue_size;
  o.flush_after = Seconds(0);
  o.timeout = Seconds(cfg.timeout);
  return o;
}

/// Waits until the reducer has applied the pushes it holds: its counters stay still for three
/// 10 ms polls (every trainer's last push has returned, so nothing new arrives). The server
/// has no "drained" query; its reducer works as pushes arrive, so this takes tens of ms.
void wait_until_drained(const PushPullGradServerImpl& server, Seconds limit) {
  const auto deadline = Clock::now() + limit;
  auto last = server.stats();
  for (int still = 0; still < 3 && Clock::now() < deadline;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    server.watch();
    const auto now = server.stats();
    const bool same = now.received == last.received && now.reductions == last.reductions &&
                      now.steps == last.steps;
    still = same ? still + 1 : 0;
    last = now;
  }
}

}  // namespace

at::Tensor shard(int64_t n, int64_t seed, int epoch, int part, int parts, int64_t offset) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed + epoch));
  at::Tensor perm = at::randperm(n, gen, at::kLong).slice(0, std::clamp<int64_t>(offset, 0, n));
  const int64_t per = perm.numel() / parts;
  return perm.slice(0, part, part + per * parts, parts);
}

Eval evaluate(Net& net, const Split& test) {
  torch::NoGradGuard no_grad;
  net->eval();
  double loss = 0;
  int64_t correct = 0;
  for (int64_t first = 0; first < test.size(); first += 1000) {
    const int64_t last = std::min(test.size(), first + 1000);
    const auto x = normalize(test.images.slice(0, first, last));
    const auto y = test.labels.slice(0, first, last);
    const auto out = net->forward(x);
    loss += torch::nll_loss(out, y, {}, at::Reduction::Sum).item<double>();
    correct += out.argmax(1).eq(y).sum().item<int64_t>();
  }
  return {loss / static_cast<double>(test.size()),
          100.0 * static_cast<double>(correct) / static_cast<double>(test.size())};
}

double effective_lr(const TrainConfig& c) {
  return c.strategy == "ddp" && c.lr_scaling == "linear" ? c.lr * c.workers : c.lr;
}

torch::optim::SGD make_sgd(Net& net, const TrainConfig& c) {
  return torch::optim::SGD(net->parameters(), sgd_options(c));
}

// ---- workers (spawned) ---------------------------------------------------------------------

void hogwild_worker(int index, TrainConfig cfg, std::vector<at::Tensor> shared, at::Tensor images,
                    at::Tensor labels, Queue<Msg> msgs, Queue<int> go) {
  torch::manual_seed(cfg.seed + index);
  Net net;
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].set_data(shared[i]);  // alias shm
  auto opt = make_sgd(net, cfg);
  serve_epochs(
      index, cfg, net, Split{images, labels}, msgs, go, [&] { opt.step(); },
      [] { return SyncTime{}; });
}

void ddp_worker(int rank, TrainConfig cfg, int port, AuthKey key, at::Tensor images,
                at::Tensor labels, Queue<Msg> msgs, Queue<int> go,
                Queue<std::vector<at::Tensor>> params_out) {
  World world = join_world(rank, cfg, port, std::move(key));
  torch::manual_seed(cfg.seed + rank);
  Net net;
  // Every rank starts from rank 0's parameters; each step averages the gradients, the
  // buckets' all_reduces started during backward (one backward per step).
  DistributedDataParallel ddp(*net,
                              world.create_collective_group({}, backend_from_string(cfg.backend)),
                              {.overlap_with_backward = true});
  auto opt = make_sgd(net, cfg);
  DistributedDataParallelStats last;
  serve_epochs(
      rank, cfg, net, Split{images, labels}, msgs, go,
      [&] {
        ddp.synchronize_gradients();
        opt.step();
      },
      [&] {
        if (rank == 0) params_out.put(clone_parameters(*net));
        const auto now = ddp.stats();
        const SyncTime t{now.synchronize_seconds - last.synchronize_seconds,
                         now.synchronizations - last.synchronizations};
        last = now;
        return t;
      });
}

/// pserver's rank 0: the gradient server, owning the model and its optimizer; its reducer
/// thread does the training work. This thread answers the parent's requests for the newest
/// parameters (after each epoch, once the pushes are applied) until kStop, and fails the
/// process when the reducer stops on an error.
void pserver_server(TrainConfig cfg, int port, AuthKey key, Queue<Msg> msgs, Queue<int> requests,
                    Queue<std::vector<at::Tensor>> params_out) {
  World world = join_world(0, cfg, port, std::move(key));
  RpcGroup group = join_rpc_group(world, cfg);
  torch::manual_seed(cfg.seed);
  Net net;  // the parent's initial model (same seed), published as version 0
  PushPullGradServerImpl server(kGradServer, group, grad_server_options(cfg));
  server.manage_model(net.ptr(),
                      std::make_shared<torch::optim::SGD>(net->parameters(), sgd_options(cfg)));
  server.start();
  group.barrier(Seconds(cfg.timeout));  // trainers connect after it
  // The reducer owns `net` while it runs: the parameters are read back as a trainer would.
  auto client = PushPullGradServer::connect(group, kGradServer, nullptr, Seconds(cfg.timeout));
  Net newest;
  VersionedModule vnewest(newest);
  msgs.put({kReady, 0, 0, 0, 0.0, 0});
  for (;;) {
    int request = 0;
    try {
      request = requests.get(Seconds(0.5));
    } catch (const Empty&) {
      server.watch();
      continue;
    }
    if (request == kStop) break;
    wait_until_drained(server, Seconds(cfg.timeout));
    client.pull(vnewest, Seconds(cfg.timeout));
    params_out.put(clone_parameters(*newest));
  }
  server.close();
  group.destroy();
}

/// pserver's ranks 1..workers-1: train on their shard; each step pushes the gradients to the
/// server and pulls its newest parameters (PushPullGradServer::push does both). A server
/// that is gone fails the push or pull within cfg.timeout, naming member 'server'.
void pserver_trainer(int rank, TrainConfig cfg, int port, AuthKey key, at::Tensor images,
                     at::Tensor labels, Queue<Msg> msgs, Queue<int> go) {
  World world = join_world(rank, cfg, port, std::move(key));
  RpcGroup group = join_rpc_group(world, cfg);
  group.barrier(Seconds(cfg.timeout));  // the server exists after it
  auto server = PushPullGradServer::connect(group, kGradServer, nullptr, Seconds(cfg.timeout));
  torch::manual_seed(cfg.seed + rank);
  Net net;
  VersionedModule vnet(net);
  server.pull(vnet, Seconds(cfg.timeout));  // the server's version 0
  serve_epochs(
      rank, cfg, net, Split{images, labels}, msgs, go,
      [&] { server.push(vnet, Seconds(cfg.timeout)); }, [] { return SyncTime{}; });
  group.destroy();
}

}  // namespace torchpar::train
