// DistributedDataParallel with 2 real ranks (forked processes) on shm and gloo: ranks that
// initialise their models differently start from rank 0's parameters and buffers; after
// backward and synchronize_gradients every rank holds the average of the ranks' gradients,
// checked against one backward over the concatenated data, with one bucket per dtype and with
// several; frozen and unused parameters; with overlap_with_backward, buckets started by
// backward's hooks, no_sync() and a refused second backward; the replicas stay equal over optimizer
// steps; models that differ are refused on every rank; a rank that dies makes the other raise
// RankLostError.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "support/ranks.h"
#include "support/run_tests.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using tp::testing::free_port;
using tp::testing::run_ranks;
using namespace std::chrono_literals;

namespace {

constexpr int kWorld = 2;
constexpr int64_t kBatch = 8;

tp::World make_world(int rank, int port, double timeout = 60) {
  tp::WorldOptions o;
  o.rank = rank;
  o.world_size = kWorld;
  o.master_addr = "127.0.0.1";
  o.master_port = port;
  o.timeout = std::chrono::duration<double>(timeout);
  return tp::World(o);
}

/// One of each case: two Linear layers (float32), a float64 scale (a second dtype, so a second
/// bucket), a frozen parameter, one that only rank 0 uses, one that nobody uses, and two
/// buffers (float32, int64).
struct TestNetImpl : torch::nn::Module {
  TestNetImpl()
      : lin1(register_module("lin1", torch::nn::Linear(6, 16))),
        lin2(register_module("lin2", torch::nn::Linear(16, 4))),
        scale(register_parameter("scale", torch::randn({4}, torch::kDouble))),
        frozen(register_parameter("frozen", torch::randn({4}), /*requires_grad=*/false)),
        rare(register_parameter("rare", torch::randn({4}))),
        never(register_parameter("never", torch::randn({3}))),
        stat(register_buffer("stat", torch::randn({5}))),
        count(register_buffer("count", torch::randint(1000, {2}, torch::kLong))) {}

  /// x [B, 6] -> [B, 4]. `rare` is added to the rows where rare_mask [B] is 1; an undefined
  /// rare_mask leaves it out of the graph (its gradient stays undefined).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& rare_mask) {
    auto h = lin2->forward(torch::tanh(lin1->forward(x))) * scale.to(torch::kFloat) + frozen;
    if (rare_mask.defined()) h = h + rare_mask.unsqueeze(1) * rare;
    return h;
  }

  torch::nn::Linear lin1;
  torch::nn::Linear lin2;
  at::Tensor scale, frozen, rare, never, stat, count;
};
TORCH_MODULE(TestNet);

/// The parameters an optimizer updates and DDP averages (all but `frozen`).
const std::vector<std::string> kTrained = {"lin1.weight", "lin1.bias", "lin2.weight",
                                           "lin2.bias",   "scale",     "rare"};

struct Batch {
  at::Tensor x, y;
};

/// Rank r's batch of a step: the same on every rank that builds it.
Batch batch_of(int step, int rank) {
  torch::manual_seed(1000 + step * kWorld + rank);
  Batch b;
  b.x = torch::randn({kBatch, 6});
  b.y = torch::randn({kBatch, 4});
  return b;
}

/// Every rank of a run_ranks run exited with 0 (else its error).
void expect_every_rank_ok(const std::vector<tp::testing::RankResult>& res) {
  for (size_t r = 0; r < res.size(); ++r) {
    EXPECT_EQ(res[r].exitcode, 0) << "rank " << r << ": " << res[r].error;
  }
}

void expect_same_state(TestNet& got, TestNet& want, const std::string& what) {
  auto want_params = want->named_parameters();
  for (const auto& item : got->named_parameters()) {
    TORCHPAR_RCHECK(at::equal(item.value(), want_params[item.key()]), "{}: parameter {} differs",
                    what, item.key());
  }
  auto want_buffers = want->named_buffers();
  for (const auto& item : got->named_buffers()) {
    TORCHPAR_RCHECK(at::equal(item.value(), want_buffers[item.key()]), "{}: buffer {} differs",
                    what, item.key());
  }
}

void copy_parameters(TestNet& from, TestNet& to) {
  torch::NoGradGuard no_grad;
  auto src = from->named_parameters();
  for (auto& item : to->named_parameters()) item.value().copy_(src[item.key()]);
}

void average_rank(int rank, int port, std::string backend, double cap_mb, int want_buckets,
                  bool overlap) {
  auto world = make_world(rank, port);
  auto group = world.create_collective_group({}, tp::backend_from_string(backend));
  torch::manual_seed(100);
  TestNet rank0_init;  // what rank 0 builds, built again here
  torch::manual_seed(100 + rank);
  TestNet net;
  TORCHPAR_RCHECK(rank == 0 || !at::equal(net->lin1->weight, rank0_init->lin1->weight),
                  "the ranks should start from different parameters");

  tp::DistributedDataParallel ddp(*net, group,
                                  {.bucket_cap_mb = cap_mb, .overlap_with_backward = overlap});
  expect_same_state(net, rank0_init, "after construction");
  for (const auto& name : kTrained) {
    TORCHPAR_RCHECK(net->named_parameters()[name].requires_grad(), "{} lost requires_grad", name);
  }
  TORCHPAR_RCHECK(static_cast<int>(ddp.num_buckets()) == want_buckets, "{} buckets, want {}",
                  ddp.num_buckets(), want_buckets);

  std::vector<at::Tensor> trained;
  for (const auto& name : kTrained) trained.push_back(net->named_parameters()[name]);
  torch::optim::SGD opt(trained, torch::optim::SGDOptions(0.1).momentum(0.5));
  for (int step = 0; step < 3; ++step) {
    std::vector<Batch> batches;
    for (int r = 0; r < kWorld; ++r) batches.push_back(batch_of(step, r));
    for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
    net->frozen.mutable_grad() = at::full({4}, rank + 1.0);  // not DDP's: must stay as it is
    const at::Tensor mask = rank == 0 ? torch::ones({kBatch}) : at::Tensor();
    torch::mse_loss(net->forward(batches[rank].x, mask), batches[rank].y).backward();
    TORCHPAR_RCHECK(net->rare.grad().defined() == (rank == 0), "rare is used on rank 0 only");

    ddp.synchronize_gradients();

    // One process, one backward over every rank's data, from the same parameters.
    TestNet ref;
    copy_parameters(net, ref);
    std::vector<at::Tensor> xs, ys, masks;
    for (int r = 0; r < kWorld; ++r) {
      xs.push_back(batches[r].x);
      ys.push_back(batches[r].y);
      masks.push_back(r == 0 ? torch::ones({kBatch}) : torch::zeros({kBatch}));
    }
    torch::mse_loss(ref->forward(torch::cat(xs), torch::cat(masks)), torch::cat(ys)).backward();
    auto ref_params = ref->named_parameters();
    for (const auto& name : kTrained) {
      const at::Tensor got = net->named_parameters()[name].grad();
      const at::Tensor want = ref_params[name].grad();
      TORCHPAR_RCHECK(got.defined(), "step {}: {} has no gradient", step, name);
      TORCHPAR_RCHECK(at::allclose(got, want, 1e-4, 1e-6),
                      "step {}: gradient of {} is not the average (max difference {})", step, name,
                      (got - want).abs().max().item<double>());
    }
    TORCHPAR_RCHECK(!net->never.grad().defined(), "a parameter no rank used got a gradient");
    TORCHPAR_RCHECK(at::equal(net->frozen.grad(), at::full({4}, rank + 1.0)),
                    "the frozen parameter's gradient was touched");
    opt.step();
  }

  // Equal gradients and the same optimizer keep the replicas equal, bit for bit.
  std::vector<at::Tensor> flat;
  for (auto& p : net->parameters()) flat.push_back(p.detach().to(at::kDouble).reshape({-1}));
  const at::Tensor mine = torch::cat(flat);
  at::Tensor from0 = mine.clone();
  group.broadcast(from0, 0);
  TORCHPAR_RCHECK(at::equal(mine, from0), "the replicas drifted apart");
}

struct Case {
  std::string backend;
  double cap_mb;
  int buckets;
  std::string name;
  bool overlap = false;
};

class DdpAverage : public ::testing::TestWithParam<Case> {};

TEST_P(DdpAverage, EveryRankGetsTheAverageGradient) {
  const auto c = GetParam();
  auto res =
      run_ranks(kWorld, 120, &average_rank, free_port(), c.backend, c.cap_mb, c.buckets, c.overlap);
  expect_every_rank_ok(res);
}

// 25 MiB: a float32 and a float64 bucket. 1e-4 MiB (104 bytes): the float32 parameters
// (rare 16 B, never 12 B, lin1.weight 384 B | lin1.bias 64 B, lin2.weight 256 B | lin2.bias
// 16 B) fill 3 buckets. 1e-6 MiB (1 byte): a bucket per parameter that requires grad.
// Overlapped, in reverse (lin2.bias, lin2.weight 272 B | lin1.bias, lin1.weight | never,
// rare): 3 float32 buckets at 1e-4 MiB and scale's; backward starts the first two, the one
// holding `never` (no rank uses it) waits for synchronize_gradients.
INSTANTIATE_TEST_SUITE_P(
    Buckets, DdpAverage,
    ::testing::Values(Case{"shm", 25, 2, "shm_default"}, Case{"shm", 1e-4, 4, "shm_small"},
                      Case{"shm", 1e-6, 7, "shm_per_parameter"},
                      Case{"gloo", 25, 2, "gloo_default"}, Case{"gloo", 1e-4, 4, "gloo_small"},
                      Case{"gloo", 1e-6, 7, "gloo_per_parameter"},
                      Case{"shm", 1e-4, 4, "shm_small_overlap", true},
                      Case{"shm", 1e-6, 7, "shm_per_parameter_overlap", true},
                      Case{"gloo", 1e-6, 7, "gloo_per_parameter_overlap", true}),
    [](const auto& test) { return test.param.name; });

// ---- overlap with backward ---------------------------------------------------------------------

/// Three Linear layers, every parameter used on every rank: x [B, 6] -> [B, 2].
torch::nn::Sequential overlap_net() {
  return torch::nn::Sequential(torch::nn::Linear(6, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 2));
}

/// The sum over ranks r of rank r's mean loss on batch_of(step, r) (and, with `twice`, also
/// on batch_of(step + 100, r)), divided by the ranks: what every rank's gradient should be.
std::vector<at::Tensor> reference_gradients(torch::nn::Sequential& net, int step, bool twice) {
  torch::nn::Sequential ref = overlap_net();
  {
    torch::NoGradGuard no_grad;
    auto src = net->parameters();
    auto dst = ref->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  for (int r = 0; r < kWorld; ++r) {
    for (int s : twice ? std::vector<int>{step, step + 100} : std::vector<int>{step}) {
      const Batch b = batch_of(s, r);
      (torch::mse_loss(ref->forward(b.x).narrow(1, 0, 2), b.y.narrow(1, 0, 2)) / kWorld).backward();
    }
  }
  std::vector<at::Tensor> out;
  for (auto& p : ref->parameters()) out.push_back(p.grad().clone());
  return out;
}

void expect_gradients(torch::nn::Sequential& net, const std::vector<at::Tensor>& want,
                      const std::string& what) {
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& got = params[i].grad();
    TORCHPAR_RCHECK(got.defined() && at::allclose(got, want[i], 1e-4, 1e-6),
                    "{}: gradient of parameter {} is not the average", what, i);
  }
}

// A bucket per parameter (6): backward starts the first 5 (the last is reduced by
// synchronize_gradients on the calling thread) and the averages are right; under no_sync()
// two batches accumulate and one synchronization averages their sum; a second backward
// outside no_sync() is refused after the round completes, and the group goes on working; so
// does a sparse gradient.
void overlap_rank(int rank, int port, std::string backend) {
  auto world = make_world(rank, port);
  auto group = world.create_collective_group({}, tp::backend_from_string(backend));
  torch::manual_seed(100 + rank);
  torch::nn::Sequential net = overlap_net();
  tp::DistributedDataParallel ddp(*net, group,
                                  {.bucket_cap_mb = 1e-6, .overlap_with_backward = true});
  TORCHPAR_RCHECK(ddp.num_buckets() == 6, "{} buckets, want 6", ddp.num_buckets());
  auto loss = [&](int step) {
    const Batch b = batch_of(step, rank);
    return torch::mse_loss(net->forward(b.x), b.y.narrow(1, 0, 2));
  };
  for (int step = 0; step < 3; ++step) {
    net->zero_grad();
    const auto before = ddp.stats();
    loss(step).backward();
    const auto in_backward = ddp.stats().buckets_started_in_backward;
    TORCHPAR_RCHECK(in_backward - before.buckets_started_in_backward == 5,
                    "step {}: backward started {} buckets, want 5", step,
                    in_backward - before.buckets_started_in_backward);
    const auto want = reference_gradients(net, step, false);
    ddp.synchronize_gradients();
    expect_gradients(net, want, fmt::format("step {}", step));
    const auto after = ddp.stats();
    TORCHPAR_RCHECK(
        after.buckets_started_in_synchronize - before.buckets_started_in_synchronize == 1 &&
            after.synchronizations == before.synchronizations + 1 &&
            after.synchronize_seconds > before.synchronize_seconds,
        "step {}: stats did not count the synchronization", step);
  }

  // Gradient accumulation: the first batch under no_sync(), the second starts the buckets.
  net->zero_grad();
  const auto before = ddp.stats().buckets_started_in_backward;
  {
    auto guard = ddp.no_sync();
    loss(10).backward();
  }
  TORCHPAR_RCHECK(ddp.stats().buckets_started_in_backward == before,
                  "a backward under no_sync() started buckets");
  loss(110).backward();
  const auto want = reference_gradients(net, 10, true);
  ddp.synchronize_gradients();
  expect_gradients(net, want, "accumulated under no_sync()");

  // synchronize_gradients throws ValueError naming `needle`; then a round is right again.
  auto refused_then_right = [&](const std::string& what, const std::string& needle, int step) {
    try {
      ddp.synchronize_gradients();
      throw std::runtime_error(what + " was not refused");
    } catch (const tp::ValueError& e) {
      TORCHPAR_RCHECK(std::string(e.what()).find(needle) != std::string::npos, "{}: unclear: {}",
                      what, e.what());
    }
    net->zero_grad();
    loss(step).backward();
    const auto right = reference_gradients(net, step, false);
    ddp.synchronize_gradients();
    expect_gradients(net, right, "after " + what);
  };

  // Two backwards without no_sync(): refused, after the round's all_reduces.
  net->zero_grad();
  loss(20).backward();
  loss(120).backward();
  refused_then_right("a second backward outside no_sync()", "no_sync()", 30);

  // A sparse gradient is refused on every rank after backward started 5 buckets: they are
  // waited for (they write into the flat buffers) and the next round starts afresh.
  net->zero_grad();
  loss(40).backward();
  at::Tensor first = net->parameters()[0];
  first.mutable_grad() = first.grad().to_sparse();
  refused_then_right("a sparse gradient", "only dense gradients", 50);
}

class DdpOverlap : public ::testing::TestWithParam<std::string> {};

TEST_P(DdpOverlap, BackwardStartsBucketsAndNoSyncAccumulates) {
  auto res = run_ranks(kWorld, 120, &overlap_rank, free_port(), GetParam());
  expect_every_rank_ok(res);
}

INSTANTIATE_TEST_SUITE_P(Backends, DdpOverlap, ::testing::Values("shm", "gloo"));

// One dtype, one bucket: synchronize_gradients reduces on the calling thread (no executor hop).
// Linear(3, 2) on a batch of 4 rows all equal to rank + 1: d(sum of outputs)/dW[i][j] is
// 4 * (rank + 1), so the average over ranks 0 and 1 is 6; the bias gradient is 4 on both.
void one_bucket_rank(int rank, int port, std::string backend) {
  auto world = make_world(rank, port);
  auto group = world.create_collective_group({}, tp::backend_from_string(backend));
  torch::manual_seed(7 + rank);
  torch::nn::Linear lin(3, 2);
  tp::DistributedDataParallel ddp(*lin, group);
  TORCHPAR_RCHECK(ddp.num_buckets() == 1, "{} buckets, want 1", ddp.num_buckets());
  for (int step = 0; step < 3; ++step) {  // the same bucket buffer again and again
    lin->zero_grad();
    lin->forward(torch::full({4, 3}, static_cast<double>(rank + 1))).sum().backward();
    ddp.synchronize_gradients();
    TORCHPAR_RCHECK(at::allclose(lin->weight.grad(), torch::full({2, 3}, 6.0)),
                    "step {}: weight gradient {} is not the average 6", step,
                    lin->weight.grad().flatten()[0].item<double>());
    TORCHPAR_RCHECK(at::allclose(lin->bias.grad(), torch::full({2}, 4.0)),
                    "step {}: bias gradient is not 4", step);
  }
}

class DdpOneBucket : public ::testing::TestWithParam<std::string> {};

TEST_P(DdpOneBucket, AveragesOnTheCallingThread) {
  auto res = run_ranks(kWorld, 120, &one_bucket_rank, free_port(), GetParam());
  expect_every_rank_ok(res);
}

INSTANTIATE_TEST_SUITE_P(Backends, DdpOneBucket, ::testing::Values("shm", "gloo"));

// ---- models that differ ------------------------------------------------------------------------

void different_rank(int rank, int port) {
  auto world = make_world(rank, port, 30);
  auto group = world.create_collective_group();
  // The same number of elements, another shape: only the shape hash tells them apart.
  auto w = torch::randn(rank == 0 ? std::vector<int64_t>{4, 3} : std::vector<int64_t>{3, 4})
               .requires_grad_();
  try {
    tp::DistributedDataParallel ddp({w}, {}, group);
  } catch (const tp::ValueError& e) {
    const std::string msg = e.what();
    TORCHPAR_RCHECK(msg.find("different models") != std::string::npos &&
                        msg.find("rank 1") != std::string::npos,
                    "unclear: {}", msg);
    return;
  }
  throw std::runtime_error("different models were accepted");
}

TEST(DistributedDataParallel, DifferentModelsAreRefusedOnEveryRank) {
  auto res = run_ranks(kWorld, 60, &different_rank, free_port());
  for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << r.error;
}

// ---- a rank that dies
// ----------------------------------------------------------------------------

void dying_rank(int rank, int port, std::string backend) {
  auto world = make_world(rank, port, 60);
  auto group = world.create_collective_group({}, tp::backend_from_string(backend), 20.0s);
  torch::manual_seed(100 + rank);
  TestNet net;
  // A bucket per parameter: several all_reduces in flight when the rank is found dead.
  tp::DistributedDataParallel ddp(*net, group, {.bucket_cap_mb = 1e-6});
  if (rank == 1) ::raise(SIGKILL);
  const Batch b = batch_of(0, rank);
  torch::mse_loss(net->forward(b.x, torch::ones({kBatch})), b.y).backward();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    ddp.synchronize_gradients();
  } catch (const tp::RankLostError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    TORCHPAR_RCHECK(s < 15, "raised after {:.1f} s: the in-flight buckets waited for the timeout",
                    s);
    const std::string msg = e.what();
    TORCHPAR_RCHECK(msg.find("rank 1") != std::string::npos, "the error does not name rank 1: {}",
                    msg);
    try {
      ddp.synchronize_gradients();
    } catch (const tp::Error&) {
      return;  // the group is broken: later calls throw too
    }
    throw std::runtime_error("synchronize_gradients on a broken group did not throw");
  }
  throw std::runtime_error("synchronize_gradients with a dead rank did not throw");
}

TEST(DistributedDataParallel, DeadRankRaisesRankLostError) {
  for (std::string backend : {"shm", "gloo"}) {
    auto res = run_ranks(kWorld, 90, &dying_rank, free_port(), backend);
    EXPECT_EQ(res[0].exitcode, 0) << backend << ": " << res[0].error;
    EXPECT_EQ(res[1].exitcode, -SIGKILL) << backend;
  }
}

// ---- options -----------------------------------------------------------------------------------

TEST(DistributedDataParallel, BucketCapMustBePositive) {
  // Checked before the group is used: an empty group handle is enough.
  for (double cap : {0.0, -1.0, std::nan("")}) {
    EXPECT_THROW(tp::DistributedDataParallel({}, {}, tp::CollectiveGroup(), {.bucket_cap_mb = cap}),
                 tp::ValueError)
        << cap;
  }
}

}  // namespace

int main(int argc, char** argv) {
  tp::init(argc, argv);
  return torchpar::testing::run_tests(argc, argv);
}
