// Parameter servers across real processes (3 members named "0", "1", "2"): machin's
// test_ordered_server / test_param_server cases in C++, the version_depth boundary, racing
// pushes, the gradient server's reductions (mean and sum, numbers worked out below), short
// batches flushed after flush_after, drops from full queues, machin's manage_model error, and
// a server member killed with SIGKILL, and on one host the shared-memory path (pull_view,
// one segment per trainer).

#include <gtest/gtest.h>
#include <signal.h>
#include <torch/nn.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <stdexcept>
#include <thread>

#include "support/ranks.h"
#include "support/rpc.h"
#include "torchpar/dist/world.h"
#include "torchpar/rpc/rpc_group.h"
#include "torchpar/server/ordered_server.h"
#include "torchpar/server/push_pull_grad_server.h"
#include "torchpar/server/push_pull_model_server.h"
#include "torchpar/shm/share.h"

namespace tp = torchpar;
using namespace std::chrono_literals;
using tp::testing::expect_throw;
using tp::testing::free_port;
using tp::testing::run_ranks;
constexpr auto make_world = tp::testing::make_named_world;
constexpr auto expect_ok = tp::testing::expect_ranks_ok;

namespace {

const bool kDie = tp::register_function(
    "die", +[]() -> int {
      ::kill(::getpid(), SIGKILL);
      return 0;
    });

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// machin's test model: three Linear(1, 1) without bias, weights 1, 2, 3; y = w3 * w2 * w1 * x.
struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false)));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false)));
    fc3 = register_module("fc3", torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false)));
    torch::NoGradGuard no_grad;
    fc1->weight.fill_(1);
    fc2->weight.fill_(2);
    fc3->weight.fill_(3);
  }
  at::Tensor forward(const at::Tensor& x) { return fc3(fc2(fc1(x))); }
  std::vector<double> weights() const {
    return {fc1->weight.item<double>(), fc2->weight.item<double>(), fc3->weight.item<double>()};
  }
  void add(double v) {
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.add_(v);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

bool weights_are(const ChainImpl& m, std::vector<double> want) {
  const auto w = m.weights();
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::abs(w[i] - want[i]) > 1e-4) return false;
  }
  return true;
}

std::string show(const ChainImpl& m) { return fmt::format("{}", fmt::join(m.weights(), ", ")); }

void backward_once(ChainImpl& m) { m.forward(at::ones({1, 1})).sum().backward(); }

// The primary steps a fresh chain with SGD, lr 1: p -= grad.
void manage_chain(tp::PushPullGradServerImpl& impl) {
  auto managed = std::make_shared<ChainImpl>();
  impl.manage_model(managed, std::make_shared<torch::optim::SGD>(managed->parameters(),
                                                                 torch::optim::SGDOptions(1.0)));
}

// Pulls until the module reaches `version` (the reducers run asynchronously).
void pull_until(tp::PushPullGradServer& server, tp::VersionedModule& vm, int64_t version) {
  const auto t0 = std::chrono::steady_clock::now();
  while (vm.pp_version().value_or(-1) < version) {
    TORCHPAR_RCHECK(seconds_since(t0) < 30, "version {} not published within 30 s (at {})", version,
                    vm.pp_version().value_or(-1));
    std::this_thread::sleep_for(20ms);
    server.pull(vm);
  }
}

// ---- OrderedServer ---------------------------------------------------------------------------

// machin's test_ordered_server sequence. machin's server keeps version_depth + 1 versions, so
// its default depth 1 is depth 2 here: versions 2 and -1 stay, 1 is evicted.
void machin_sequence(tp::OrderedServerBase<std::string>& s, const std::string& key) {
  TORCHPAR_RCHECK(s.push(key, "value", 1, std::nullopt), "{}: a new key always succeeds", key);
  TORCHPAR_RCHECK(!s.push(key, "value2", 2, 0), "{}: prev_version 0 is not the newest (1)", key);
  TORCHPAR_RCHECK(s.push(key, "value2", 2, 1), "{}: push on top of 1", key);
  TORCHPAR_RCHECK(s.push(key, "value3", -1, 2), "{}: versions need not increase", key);
  auto newest = s.pull(key);
  TORCHPAR_RCHECK(newest && newest->first == "value3" && newest->second == -1, "{}: pull newest",
                  key);
  auto v2 = s.pull(key, 2);
  TORCHPAR_RCHECK(v2 && v2->first == "value2" && v2->second == 2, "{}: pull version 2", key);
  TORCHPAR_RCHECK(!s.pull(key, 1), "{}: version 1 should be evicted", key);
  TORCHPAR_RCHECK(!s.pull(key, 7), "{}: unknown version", key);
  TORCHPAR_RCHECK(!s.pull(key + "_unknown"), "{}: unknown key", key);
}

void ordered_machin_rank(int rank, int port) {
  auto w = make_world(rank, 3, port);
  auto g = w.create_rpc_group("group", {"0", "1", "2"});
  {
    std::optional<tp::OrderedServerSimpleImpl<std::string>> impl;
    std::optional<tp::OrderedServerSimpleImpl<tp::StateDict>> sd_impl;
    if (rank == 0) {
      impl.emplace("server", g, 2);
      sd_impl.emplace("sd_server", g);
      expect_throw<tp::RpcKeyTakenError>(
          [&] { tp::OrderedServerSimpleImpl<std::string> again("server", g); }, "a second server");
      expect_throw<tp::ValueError>([&] { tp::OrderedServerSimpleImpl<int> bad("bad", g, 0); },
                                   "version_depth 0");
    }
    g.barrier();
    tp::OrderedServerSimple<std::string> server("server", g);
    // Locally on the host, and through RPC from another member.
    if (rank == 0) machin_sequence(server, "a");
    if (rank == 1) machin_sequence(server, "b");
    if (rank == 2) {
      tp::OrderedServerSimple<int> wrong("server", g);
      auto e = expect_throw<tp::ValueError>([&] { wrong.pull("a"); }, "another value type");
      TORCHPAR_RCHECK(std::string(e.what()).find("'0'") != std::string::npos, "names the host: {}",
                      e.what());
      expect_throw<tp::RpcKeyNotFoundError>(
          [&] { tp::OrderedServerSimple<std::string>("no_server", g).pull("a"); }, "no server");
    }
    // State dicts: the server keeps copies, also of shared-memory tensors and on the host.
    if (rank == 0 || rank == 2) {
      tp::OrderedServerSimple<tp::StateDict> sds("sd_server", g);
      const std::string key = "m" + std::to_string(rank);
      auto t = at::arange(4, at::kFloat);
      auto shared = at::ones({3});
      tp::share_memory_(shared);
      TORCHPAR_RCHECK(sds.push(key, {{"w", t}, {"s", shared}}, 1, std::nullopt), "sd push");
      t.fill_(-1);
      shared.fill_(-1);
      auto got = sds.pull(key);
      TORCHPAR_RCHECK(got && got->second == 1, "sd pull");
      TORCHPAR_RCHECK(at::equal(got->first.at("w"), at::arange(4, at::kFloat)),
                      "the stored tensor changed with the caller's");
      TORCHPAR_RCHECK(at::equal(got->first.at("s"), at::ones({3})),
                      "the stored shared-memory tensor aliases the caller's");
      got->first.at("w").fill_(7);
      TORCHPAR_RCHECK(at::equal(sds.pull(key)->first.at("w"), at::arange(4, at::kFloat)),
                      "a pulled value aliases the stored one");
    }
    g.barrier();
  }
  g.barrier();
  g.destroy();
}

TEST(OrderedServer, MachinSequenceLocallyAndRemotely) {
  expect_ok(run_ranks(3, 180, &ordered_machin_rank, free_port()));
}

void depth_rank(int rank, int port) {
  auto w = make_world(rank, 2, port);
  auto g = w.create_rpc_group("group", {"0", "1"});
  {
    std::optional<tp::OrderedServerSimpleImpl<std::string>> d1, d3;
    if (rank == 0) {
      d1.emplace("d1", g, 1);
      d3.emplace("d3", g, 3);
    }
    g.barrier();
    if (rank == 1) {
      tp::OrderedServerSimple<std::string> s1("d1", g), s3("d3", g);
      // depth 1: only the newest version (machin's doc; machin itself would keep two).
      TORCHPAR_RCHECK(s1.push("k", "1", 1, std::nullopt) && s1.push("k", "2", 2, 1), "d1 pushes");
      TORCHPAR_RCHECK(!s1.pull("k", 1), "depth 1 keeps version 1 next to 2");
      TORCHPAR_RCHECK(s1.pull("k", 2) && s1.pull("k")->second == 2, "depth 1 newest");
      // depth 3: versions 2, 3, 4 of 1..4; then 3, 4, 5.
      TORCHPAR_RCHECK(s3.push("k", "1", 1, std::nullopt), "d3 push 1");
      for (int v = 2; v <= 4; ++v)
        TORCHPAR_RCHECK(s3.push("k", std::to_string(v), v, v - 1), "d3 push {}", v);
      TORCHPAR_RCHECK(!s3.pull("k", 1), "depth 3 keeps 4 versions");
      for (int v = 2; v <= 4; ++v) {
        auto got = s3.pull("k", v);
        TORCHPAR_RCHECK(got && got->first == std::to_string(v), "depth 3 lost version {}", v);
      }
      TORCHPAR_RCHECK(s3.push("k", "5", 5, 4) && !s3.pull("k", 2) && s3.pull("k", 3),
                      "depth 3 after a fifth push");
      // A version still stored is replaced and becomes the newest.
      TORCHPAR_RCHECK(s3.push("k", "4b", 4, 5), "re-push of version 4");
      auto newest = s3.pull("k");
      TORCHPAR_RCHECK(newest && newest->first == "4b" && newest->second == 4, "re-pushed newest");
      TORCHPAR_RCHECK(s3.pull("k", 5) && s3.pull("k", 3), "3 and 5 stay");
    }
    g.barrier();
  }
  g.barrier();
  g.destroy();
}

TEST(OrderedServer, VersionDepthKeepsExactlyThatManyVersions) {
  expect_ok(run_ranks(2, 120, &depth_rank, free_port()));
}

// Members 1 and 2 race with two threads each: per round, every contender pushes on top of the
// same newest version; exactly one of the four may win.
void race_rank(int rank, int port) {
  constexpr int kRounds = 40;
  auto w = make_world(rank, 3, port);
  auto g = w.create_rpc_group("group", {"0", "1", "2"});
  {
    std::optional<tp::OrderedServerSimpleImpl<std::string>> impl;
    std::optional<tp::OrderedServerSimpleImpl<int64_t>> wins_impl;
    if (rank == 0) {
      impl.emplace("race", g);
      wins_impl.emplace("wins", g);
    }
    g.barrier();
    tp::OrderedServerSimple<std::string> s("race", g);
    tp::OrderedServerSimple<int64_t> wins("wins", g);
    if (rank != 0) {
      int64_t mine = 0;
      for (int round = 0; round < kRounds; ++round) {
        g.barrier(30s);
        const std::optional<int64_t> prev =
            round == 0 ? std::nullopt : std::optional<int64_t>(round);
        bool won[2] = {false, false};
        std::exception_ptr thread_error;
        std::thread t([&] {
          try {
            won[1] = s.push("k", fmt::format("{}:1", rank), round + 1, prev);
          } catch (...) {
            thread_error = std::current_exception();
          }
        });
        won[0] = s.push("k", fmt::format("{}:0", rank), round + 1, prev);
        t.join();
        if (thread_error) std::rethrow_exception(thread_error);
        g.barrier(30s);
        auto newest = s.pull("k");
        TORCHPAR_RCHECK(newest && newest->second == round + 1, "round {}: newest version", round);
        for (int i = 0; i < 2; ++i) {
          const bool is_winner = newest->first == fmt::format("{}:{}", rank, i);
          TORCHPAR_RCHECK(won[i] == is_winner, "round {}: thread {} {} but the newest is {}", round,
                          i, won[i] ? "won" : "lost", newest->first);
          mine += won[i];
        }
      }
      TORCHPAR_RCHECK(wins.push("wins" + std::to_string(rank), mine, 0, std::nullopt), "wins");
    } else {
      for (int round = 0; round < kRounds; ++round) {
        g.barrier(30s);
        g.barrier(30s);
      }
    }
    g.barrier();
    if (rank == 0) {
      const int64_t total = wins.pull("wins1")->first + wins.pull("wins2")->first;
      TORCHPAR_RCHECK(total == kRounds, "{} pushes won in {} rounds", total, kRounds);
    }
    g.barrier();
  }
  g.barrier();
  g.destroy();
}

TEST(OrderedServer, RacingPushesExactlyOneWins) {
  expect_ok(run_ranks(3, 300, &race_rank, free_port()));
}

// ---- PushPullModelServer -----------------------------------------------------------------------

// Two trainers add 1 to every weight and push until version 10: each successful push is the
// newest model + 1, so version 10 holds 1 + 10, 2 + 10, 3 + 10.
void model_rank(int rank, int port) {
  auto w = make_world(rank, 3, port);
  auto g = w.create_rpc_group("group", {"0", "1", "2"});
  {
    std::optional<tp::PushPullModelServerImpl> impl;
    if (rank == 0) impl.emplace("server", g);
    g.barrier();
    auto server = tp::PushPullModelServer::connect(g, "server");
    if (rank != 0) {
      auto net = std::make_shared<ChainImpl>();
      tp::VersionedModule vm(net);
      int successes = 0;
      while (vm.pp_version().value_or(0) < 10) {
        net->add(1);
        if (server.push(vm)) {
          ++successes;
          const double v = static_cast<double>(*vm.pp_version());
          TORCHPAR_RCHECK(weights_are(*net, {1 + v, 2 + v, 3 + v}), "pushed version {}: {}", v,
                          show(*net));
        } else {
          const double v = static_cast<double>(*vm.pp_version());
          TORCHPAR_RCHECK(weights_are(*net, {1 + v, 2 + v, 3 + v}),
                          "after a failed push the module holds version {}: {}", v, show(*net));
        }
      }
      // The other trainer may win every race: only the upper bound is certain here (the
      // pull below checks that exactly ten pushes were made in all).
      TORCHPAR_RCHECK(successes <= 10, "{} successful pushes", successes);
    }
    g.barrier();
    // Every member (the host locally) pulls version 10 into a fresh model.
    auto fresh = std::make_shared<ChainImpl>();
    tp::VersionedModule vf(fresh);
    TORCHPAR_RCHECK(server.pull(vf), "pull");
    TORCHPAR_RCHECK(vf.pp_version() == 10 && weights_are(*fresh, {11, 12, 13}),
                    "pulled version {}: {}", vf.pp_version().value_or(-1), show(*fresh));
    // Nothing newer: the return says the module did not change (before: true, as machin's).
    TORCHPAR_RCHECK(!server.pull(vf) && vf.pp_version() == 10, "a pull with nothing new");
    // A stale module without pull_on_fail: the push fails and the module stays as it was.
    tp::VersionedModule stale(std::make_shared<ChainImpl>(), 3);
    TORCHPAR_RCHECK(!server.push(stale, {.pull_on_fail = false}), "a stale push succeeded");
    TORCHPAR_RCHECK(
        stale.pp_version() == 3 && weights_are(static_cast<ChainImpl&>(stale.module()), {1, 2, 3}),
        "a failed push without pull_on_fail changed the module");
    g.barrier();
  }
  g.barrier();
  g.destroy();
}

TEST(PushPullModelServer, TenPushesOfPlusOneGiveElevenTwelveThirteen) {
  expect_ok(run_ranks(3, 180, &model_rank, free_port()));
}

// ---- PushPullGradServer -------------------------------------------------------------------------

// machin's test: primary "0", secondary ["0"], reduce_batch_size 2, SGD lr 1, two trainers
// pushing twice each on the chain at weights (1, 2, 3) with x = 1. Each gradient is
// (dy/dw1, dy/dw2, dy/dw3) = (w2 w3, w1 w3, w1 w2) = (6, 3, 2) (push then pulls and zeroes
// the gradients, and no step happens before all four pushes). The secondary reduces the four
// in two batches of two, the primary the two results in one batch, so one step:
//   mean: (6, 3, 2) at both levels -> (1 - 6, 2 - 3, 3 - 2) = (-5, -1, 1);
//   sum:  2 * 2 * (6, 3, 2) = (24, 12, 8) -> (1 - 24, 2 - 12, 3 - 8) = (-23, -10, -5).
void grad_rank(int rank, int port, bool mean) {
  auto w = make_world(rank, 3, port);
  auto g = w.create_rpc_group("group", {"0", "1", "2"});
  {
    std::optional<tp::PushPullGradServerImpl> impl;
    if (rank == 0) {
      impl.emplace("server", g,
                   tp::PushPullGradServerOptions{.primary_reducer = "0",
                                                 .secondary_reducers = {"0"},
                                                 .reduce_method = mean ? "mean" : "sum",
                                                 .reduce_batch_size = 2,
                                                 .flush_after = 60s});  // whole batches only
      manage_chain(*impl);
      impl->start();
    }
    g.barrier();
    if (rank != 0) {
      auto server = tp::PushPullGradServer::connect(g, "server");
      TORCHPAR_RCHECK(server.secondary_reducers() == std::vector<std::string>{"0"}, "secondaries");
      auto net = std::make_shared<ChainImpl>();
      tp::VersionedModule vm(net);
      for (int i = 0; i < 2; ++i) {
        backward_once(*net);
        server.push(vm);
        TORCHPAR_RCHECK(net->fc1->weight.grad().sum().item<double>() == 0, "push then zeroes");
      }
      pull_until(server, vm, 1);
      const std::vector<double> want =
          mean ? std::vector<double>{-5, -1, 1} : std::vector<double>{-23, -10, -5};
      TORCHPAR_RCHECK(weights_are(*net, want), "{}: got {}, want {}", mean ? "mean" : "sum",
                      show(*net), fmt::join(want, ", "));
    }
    g.barrier();
    if (rank == 0) {
      impl->watch();
      const auto st = impl->stats();
      TORCHPAR_RCHECK(st.steps == 1 && st.reductions == 2 && st.dropped == 0 && st.flushes == 0,
                      "stats: steps {} reductions {} dropped {} flushes {}", st.steps,
                      st.reductions, st.dropped, st.flushes);
      impl->stop();
    }
    g.barrier();
  }
  g.barrier();
  g.destroy();
}

TEST(PushPullGradServer, MachinMean) {
  expect_ok(run_ranks(3, 180, &grad_rank, free_port(), true));
}
TEST(PushPullGradServer, MachinSum) {
  expect_ok(run_ranks(3, 180, &grad_rank, free_port(), false));
}

// Beyond machin. Before start(), ten pushes into a queue of 4 drop the six oldest. At start
// the four left make one secondary batch, sum (24, 12, 8); alone in the primary queue (batch
// size 4) it is flushed after flush_after: weights (-23, -10, -5). Then one lone push at those
// weights, gradient (w2 w3, w1 w3, w1 w2) = (50, 115, 230), is flushed at both levels:
// (-23 - 50, -10 - 115, -5 - 230) = (-73, -125, -235).
void flush_rank(int rank, int port) {
  auto w = make_world(rank, 2, port);
  auto g = w.create_rpc_group("group", {"0", "1"});
  {
    std::optional<tp::PushPullGradServerImpl> impl;
    if (rank == 0) {
      impl.emplace("server", g,
                   tp::PushPullGradServerOptions{.primary_reducer = "0",
                                                 .secondary_reducers = {"0"},
                                                 .reduce_batch_size = 4,
                                                 .max_queue_size = 4,
                                                 .flush_after = 0.3s});
      manage_chain(*impl);
    }
    g.barrier();
    std::optional<tp::PushPullGradServer> server;
    auto net = std::make_shared<ChainImpl>();
    tp::VersionedModule vm(net);
    if (rank == 1) {
      server.emplace(tp::PushPullGradServer::connect(g, "server"));
      // Version 0 is the primary's initial model (manage_model); nothing newer before start().
      TORCHPAR_RCHECK(server->pull(vm) && vm.pp_version() == 0, "a fresh module's first pull");
      TORCHPAR_RCHECK(!server->pull(vm), "a second pull with nothing new said it loaded");
      for (int i = 0; i < 10; ++i) {
        backward_once(*net);
        server->push(vm);
      }
    }
    g.barrier();
    if (rank == 0) {
      const auto st = impl->stats();
      TORCHPAR_RCHECK(st.received == 10 && st.dropped == 6, "received {} dropped {}", st.received,
                      st.dropped);
      impl->start();
    }
    g.barrier();
    if (rank == 1) {
      pull_until(*server, vm, 1);
      TORCHPAR_RCHECK(weights_are(*net, {-23, -10, -5}), "after the flushed step: {}", show(*net));
      backward_once(*net);
      const auto t0 = std::chrono::steady_clock::now();
      server->push(vm);
      pull_until(*server, vm, 2);
      TORCHPAR_RCHECK(weights_are(*net, {-73, -125, -235}), "after the lone push: {}", show(*net));
      TORCHPAR_RCHECK(seconds_since(t0) < 5, "a lone push took {} s to apply", seconds_since(t0));
    }
    g.barrier();
    if (rank == 0) {
      impl->watch();
      const auto st = impl->stats();
      TORCHPAR_RCHECK(st.steps == 2 && st.reductions == 2 && st.flushes == 3 && st.dropped == 6,
                      "stats: steps {} reductions {} flushes {} dropped {}", st.steps,
                      st.reductions, st.flushes, st.dropped);
    }
    g.barrier();
  }
  g.barrier();
  g.destroy();
}

TEST(PushPullGradServer, ShortBatchesFlushAndFullQueuesDrop) {
  expect_ok(run_ranks(2, 180, &flush_rank, free_port()));
}

// machin's "is the right error" for manage_model off the primary, and the other misuses.
void errors_rank(int rank, int port) {
  auto w = make_world(rank, 3, port);
  auto g = w.create_rpc_group("group", {"0", "1", "2"});
  {
    const tp::PushPullGradServerOptions opts{.primary_reducer = "0",
                                             .secondary_reducers = {"0", "1"}};
    std::optional<tp::PushPullGradServerImpl> impl;
    auto net = std::make_shared<ChainImpl>();
    auto opt =
        std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(1.0));
    if (rank == 0) {
      impl.emplace("server", g, opts);
      expect_throw<tp::Error>([&] { impl->start(); }, "start before manage_model");
      impl->manage_model(net, opt);
      impl->start();
    }
    if (rank == 1) {
      impl.emplace("server", g, opts);
      try {
        impl->manage_model(net, opt);
        throw std::runtime_error("manage_model on a secondary did not throw");
      } catch (const tp::ValueError& e) {
        throw std::runtime_error(
            fmt::format("a ValueError, want machin's RuntimeError: {}", e.what()));
      } catch (const tp::Error& e) {
        TORCHPAR_RCHECK(
            std::string(e.what()).find("is not the primary reducer") != std::string::npos,
            "machin's message: {}", e.what());
      }
      impl->start();
    }
    if (rank == 2) {
      expect_throw<tp::ValueError>([&] { tp::PushPullGradServerImpl("server", g, opts); },
                                   "a reducer on a member that is none");
      expect_throw<tp::ValueError>(
          [&] {
            tp::PushPullGradServerImpl("other", g,
                                       {.secondary_reducers = {"2"}, .reduce_method = "max"});
          },
          "reduce_method max");
    }
    g.barrier();
    if (rank == 2) {
      auto server = tp::PushPullGradServer::connect(g, "server");
      tp::VersionedModule vm(net);
      auto e = expect_throw<tp::ValueError>([&] { server.push(vm); }, "push without gradients");
      TORCHPAR_RCHECK(std::string(e.what()).find("fc1.weight") != std::string::npos,
                      "names the parameter: {}", e.what());
      expect_throw<tp::RpcKeyNotFoundError>([&] { tp::PushPullGradServer::connect(g, "nothing"); },
                                            "connect to no server");
    }
    g.barrier();
  }
  g.barrier();
  g.destroy();
}

TEST(PushPullGradServer, ManageModelOffThePrimaryAndOtherMisuse) {
  expect_ok(run_ranks(3, 120, &errors_rank, free_port()));
}

// One host: handles, not bytes. Ordered server: a state dict pushed on the host is stored in
// shared memory; pull gives any caller a private copy, pull_view the stored tensors (on the
// host the very ones, from another process through a handle). Gradient server, 1 MiB model:
// a trainer's pushes all travel in one shared-memory segment (no segment created after its
// first push: the reducer copies each out before it replies), and the pushes are applied:
// constant gradients 1e-3 summed, lr 0.01, however the batches fell.
struct Wide : torch::nn::Module {
  Wide() {
    fc = register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(512, 512).bias(false)));
    torch::NoGradGuard no_grad;
    fc->weight.fill_(1);
  }
  torch::nn::Linear fc{nullptr};
};

void one_host_rank(int rank, int port) {
  auto w = make_world(rank, 2, port);
  auto g = w.create_rpc_group("group", {"0", "1"});
  {
    std::optional<tp::OrderedServerSimpleImpl<tp::StateDict>> sd_impl;
    std::optional<tp::PushPullGradServerImpl> impl;
    tp::OrderedServerSimple<tp::StateDict> sds("sd", g);
    const auto stored = at::arange(1 << 18, at::kFloat);  // 1 MiB
    if (rank == 0) {
      sd_impl.emplace("sd", g);
      TORCHPAR_RCHECK(sds.push("m", {{"w", stored}}, 1, std::nullopt), "sd push on the host");
      auto a = sds.pull_view("m"), b = sds.pull_view("m"), c = sds.pull("m");
      TORCHPAR_RCHECK(a && b && c && at::equal(a->first.at("w"), stored), "host pull_view");
      TORCHPAR_RCHECK(tp::is_shared(a->first.at("w")) &&
                          a->first.at("w").data_ptr() == b->first.at("w").data_ptr(),
                      "pull_view on the host reads the stored (shared) tensor");
      TORCHPAR_RCHECK(!tp::is_shared(c->first.at("w")) &&
                          c->first.at("w").data_ptr() != a->first.at("w").data_ptr() &&
                          at::equal(c->first.at("w"), stored),
                      "pull on the host returns a private copy");
      impl.emplace("server", g,
                   tp::PushPullGradServerOptions{
                       .primary_reducer = "0", .secondary_reducers = {"0"}, .flush_after = 0.1s});
      auto managed = std::make_shared<Wide>();
      impl->manage_model(managed, std::make_shared<torch::optim::SGD>(
                                      managed->parameters(), torch::optim::SGDOptions(0.01)));
      impl->start();
    }
    g.barrier();
    if (rank == 1) {
      auto view = sds.pull_view("m");
      auto copy = sds.pull("m");
      TORCHPAR_RCHECK(
          view && tp::is_shared(view->first.at("w")) && at::equal(view->first.at("w"), stored),
          "pull_view from another process of the host: a handle to the stored tensor");
      TORCHPAR_RCHECK(
          copy && !tp::is_shared(copy->first.at("w")) && at::equal(copy->first.at("w"), stored),
          "pull from another process: a private copy");
      auto server = tp::PushPullGradServer::connect(g, "server");
      auto net = std::make_shared<Wide>();
      tp::VersionedModule vm(net);
      constexpr int kPushes = 12;
      uint64_t created = 0;
      for (int i = 0; i < kPushes; ++i) {
        net->fc->weight.mutable_grad() = at::full({512, 512}, 1e-3F);
        server.push(vm);
        if (i == 0) created = tp::shm_stats().segments_created;
      }
      TORCHPAR_RCHECK(tp::shm_stats().segments_created == created,
                      "{} pushes created {} segments after the first one", kPushes,
                      tp::shm_stats().segments_created - created);
      // Sum of 12 pushes of 1e-3 at lr 0.01: 1 - 1.2e-4, once every push is applied.
      const auto t0 = std::chrono::steady_clock::now();
      while (std::abs(net->fc->weight[0][0].item<double>() - (1 - 1.2e-4)) > 1e-6) {
        TORCHPAR_RCHECK(seconds_since(t0) < 30, "weights at {} after 30 s, want {}",
                        net->fc->weight[0][0].item<double>(), 1 - 1.2e-4);
        std::this_thread::sleep_for(20ms);
        server.pull(vm);
      }
      TORCHPAR_RCHECK(at::allclose(net->fc->weight, at::full({512, 512}, 1 - 1.2e-4F)),
                      "every weight took the 12 pushes");
    }
    g.barrier();
    if (rank == 0) {
      impl->watch();
      TORCHPAR_RCHECK(impl->stats().received >= 12 && impl->stats().dropped == 0,
                      "received {} dropped {}", impl->stats().received, impl->stats().dropped);
    }
    g.barrier();
  }
  g.barrier();
  g.destroy();
}

TEST(PushPullGradServer, OneHostPushesReuseOneSegmentAndPullViewsShare) {
  expect_ok(run_ranks(2, 180, &one_host_rank, free_port()));
}

// A small module whose gradients the tests set by hand: fc (4 x 4), weights 0.
struct Small : torch::nn::Module {
  explicit Small(const std::string& name = "fc") {
    fc = register_module(name, torch::nn::Linear(torch::nn::LinearOptions(4, 4).bias(false)));
    torch::NoGradGuard no_grad;
    fc->weight.zero_();
  }
  torch::nn::Linear fc{nullptr};
};

// Pushes from 2 processes x 3 threads at once, added to the batch by the service's threads
// (one at a time) while the reducer thread forwards, adds the forwarded sums and steps: each
// of the 120 pushes of gradient 1 is added exactly once, so with SGD at lr 1 every weight
// ends at exactly -120.
constexpr int kPushThreads = 3, kPushesPerThread = 20;
void concurrent_rank(int rank, int port) {
  auto w = make_world(rank, 3, port);
  auto g = w.create_rpc_group("group", {"0", "1", "2"});
  {
    std::optional<tp::PushPullGradServerImpl> impl;
    if (rank == 0) {
      impl.emplace("server", g,
                   tp::PushPullGradServerOptions{
                       .primary_reducer = "0", .secondary_reducers = {"0"}, .flush_after = 0.1s});
      auto managed = std::make_shared<Small>();
      impl->manage_model(managed, std::make_shared<torch::optim::SGD>(
                                      managed->parameters(), torch::optim::SGDOptions(1.0)));
      impl->start();
    }
    g.barrier();
    if (rank != 0) {
      std::vector<std::thread> threads;
      std::vector<std::string> errors(kPushThreads);
      for (int t = 0; t < kPushThreads; ++t) {
        threads.emplace_back([&, t] {
          try {
            auto server = tp::PushPullGradServer::connect(g, "server");
            auto net = std::make_shared<Small>();
            tp::VersionedModule vm(net);
            for (int i = 0; i < kPushesPerThread; ++i) {
              net->fc->weight.mutable_grad() = at::ones({4, 4});
              server.push(vm);
            }
          } catch (const std::exception& e) {
            errors[t] = e.what();
          }
        });
      }
      for (auto& th : threads) th.join();
      for (const auto& e : errors) TORCHPAR_RCHECK(e.empty(), "a pushing thread: {}", e);
    }
    g.barrier();
    if (rank == 1) {
      constexpr double kWant = -2.0 * kPushThreads * kPushesPerThread;
      auto server = tp::PushPullGradServer::connect(g, "server");
      auto net = std::make_shared<Small>();
      tp::VersionedModule vm(net);
      const auto t0 = std::chrono::steady_clock::now();
      while (!at::equal(net->fc->weight, at::full({4, 4}, kWant))) {
        TORCHPAR_RCHECK(seconds_since(t0) < 30, "weights {} after 30 s, want {}",
                        net->fc->weight[0][0].item<double>(), kWant);
        std::this_thread::sleep_for(20ms);
        server.pull(vm);
      }
    }
    g.barrier();
    if (rank == 0) {
      impl->watch();
      const auto st = impl->stats();
      // The 120 pushes and the secondary sums forwarded to the primary level: 30 full
      // batches, more when flush_after cut some short.
      TORCHPAR_RCHECK(st.received == 120 + st.reductions && st.dropped == 0 && st.reductions >= 30,
                      "received {} dropped {} reductions {}", st.received, st.dropped,
                      st.reductions);
    }
    g.barrier();
  }
  g.barrier();
  g.destroy();
}

TEST(PushPullGradServer, ConcurrentPushesFromTwoProcessesAreEachAddedOnce) {
  expect_ok(run_ranks(3, 180, &concurrent_rank, free_port()));
}

// A push whose gradients do not fit the running batch (another parameter's name), added by
// the service itself (the queue is empty): its sender gets the error, the reducer stops
// (watch() rethrows it) and later pushes are refused naming the member.
void misfit_rank(int rank, int port) {
  auto w = make_world(rank, 2, port);
  auto g = w.create_rpc_group("group", {"0", "1"});
  {
    std::optional<tp::PushPullGradServerImpl> impl;
    if (rank == 0) {
      // No flush_after: the first push's batch waits for the second however slow the machine.
      impl.emplace(
          "server", g,
          tp::PushPullGradServerOptions{
              .primary_reducer = "0", .secondary_reducers = {"0"}, .flush_after = std::nullopt});
      auto managed = std::make_shared<Small>();
      impl->manage_model(managed, std::make_shared<torch::optim::SGD>(
                                      managed->parameters(), torch::optim::SGDOptions(1.0)));
      impl->start();
    }
    g.barrier();
    if (rank == 1) {
      auto server = tp::PushPullGradServer::connect(g, "server");
      auto net = std::make_shared<Small>();
      auto other = std::make_shared<Small>("other");
      tp::VersionedModule vm(net), vo(other);
      net->fc->weight.mutable_grad() = at::ones({4, 4});
      server.push(vm);  // starts a batch
      other->fc->weight.mutable_grad() = at::ones({4, 4});
      auto e = expect_throw<tp::Error>([&] { server.push(vo); }, "a push that does not fit");
      TORCHPAR_RCHECK(std::string(e.what()).find("'other.weight' is missing") != std::string::npos,
                      "the sender's error names the gradient: {}", e.what());
      net->fc->weight.mutable_grad() = at::ones({4, 4});
      e = expect_throw<tp::Error>([&] { server.push(vm); }, "a push after the reducer stopped");
      TORCHPAR_RCHECK(
          std::string(e.what()).find("the reducer on member '0' stopped") != std::string::npos,
          "a later push names the stopped member: {}", e.what());
    }
    g.barrier();
    if (rank == 0) {
      auto e = expect_throw<tp::ValueError>([&] { impl->watch(); }, "watch() after the misfit");
      TORCHPAR_RCHECK(std::string(e.what()).find("other.weight") != std::string::npos,
                      "watch() rethrows the reducer's error: {}", e.what());
    }
    g.barrier();
  }
  g.barrier();
  g.destroy();
}

TEST(PushPullGradServer, APushThatDoesNotFitTheBatchFailsItsSenderAndStopsTheReducer) {
  expect_ok(run_ranks(2, 180, &misfit_rank, free_port()));
}

// The member hosting the server (primary, only secondary and ordered server: "1") is
// killed; the trainer's push and pull fail within their timeout, naming it. Member "0" hosts
// the World's store and only waits.
void killed_rank(int rank, int port) {
  auto w = make_world(rank, 3, port);
  auto g = w.create_rpc_group("group", {"0", "1", "2"});
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  if (rank == 0) {
    g.register_service("done", [&] {
      std::lock_guard<std::mutex> lk(mu);
      done = true;
      cv.notify_all();
    });
  }
  std::optional<tp::PushPullGradServerImpl> impl;
  if (rank == 1) {
    impl.emplace(
        "server", g,
        tp::PushPullGradServerOptions{.primary_reducer = "1", .secondary_reducers = {"1"}});
    manage_chain(*impl);
    impl->start();
  }
  g.barrier();
  if (rank == 1) {
    std::this_thread::sleep_for(60s);  // killed long before
    return;
  }
  if (rank == 0) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait_for(lk, 100s, [&] { return done; });
    lk.unlock();
    std::this_thread::sleep_for(500ms);  // the reply to "done" leaves first
    ::_exit(0);                          // the other server member is dead: no teardown
  }
  auto server = tp::PushPullGradServer::connect(g, "server");
  auto net = std::make_shared<ChainImpl>();
  tp::VersionedModule vm(net);
  backward_once(*net);
  TORCHPAR_RCHECK(server.push(vm), "a push while the server lives");
  (void)g.rpc_async<int>("1", "die", std::tuple{}, 5s);
  std::this_thread::sleep_for(200ms);
  auto fails_naming_1 = [&](auto fn, const char* what) {
    constexpr double kTimeout = 10;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      fn(std::chrono::duration<double>(kTimeout));
    } catch (const tp::RpcPeerLostError& e) {
      TORCHPAR_RCHECK(e.member() == "1", "{}: names member '{}'", what, e.member());
    } catch (const tp::TimeoutError& e) {
      TORCHPAR_RCHECK(std::string(e.what()).find("'1'") != std::string::npos, "{}: {}", what,
                      e.what());
    } catch (const std::exception& e) {
      throw std::runtime_error(
          fmt::format("{}: threw {} ({})", what, c10::demangle(typeid(e).name()), e.what()));
    }
    const double took = seconds_since(t0);
    TORCHPAR_RCHECK(took < kTimeout + 2, "{}: failed after {} s", what, took);
  };
  backward_once(*net);
  fails_naming_1([&](tp::Timeout t) { server.push(vm, t); }, "push after the kill");
  fails_naming_1([&](tp::Timeout t) { server.pull(vm, t); }, "pull after the kill");
  try {
    g.registered_sync<void>("done", std::tuple{}, 10s);
  } catch (const tp::RpcPeerLostError&) {  // member 0 may leave before its reply arrives
  }
  ::_exit(0);
}

TEST(PushPullGradServer, AKilledServerMemberFailsPushesInTime) {
  auto res = run_ranks(3, 180, &killed_rank, free_port());
  EXPECT_EQ(res[0].exitcode, 0) << res[0].error;
  EXPECT_EQ(res[1].exitcode, -SIGKILL) << "rank 1 should have been killed: " << res[1].error;
  EXPECT_EQ(res[2].exitcode, 0) << res[2].error;
}

}  // namespace

int main(int argc, char** argv) {
  // The servers' members talk over TCP: TensorPipe's shm transport (rpc_test's
  // MachinWorldCases and rpc_transport_test test it) polls without sleeping, a core per
  // member for as long as it lives (8.1 CPU-s for this binary against 2.7 with TCP).
  ::setenv("TORCHPAR_RPC_SHM", "0", 0);
  return tp::testing::rpc_test_main(argc, argv);
}
