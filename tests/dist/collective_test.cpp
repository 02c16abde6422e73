// CollectiveGroup on gloo and shm with 2, 3 and 4 ranks: every operation, several dtypes and
// sizes (1 element to 16 MiB), contiguous and strided tensors, async handles, point-to-point
// with any-source receives; ranks that disagree (shm and gloo), a rank SIGKILLed before an
// all_reduce, shm's single copies turned off on one rank, a rank SIGKILLed or SIGSTOPped in the
// middle of large single-copy operations, a rank SIGSTOPped (shm, gloo, and hierarchical across two
// "hosts" made with a private /dev/shm), a per-call timeout shorter than the group's, bad World
// configurations. Each rank checks its results against values it computes locally.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <typeinfo>

#include "support/collective_checks.h"
#include "support/ranks.h"
#include "support/run_tests.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using tp::testing::check_ops;
using tp::testing::expect_equal;
using tp::testing::free_port;
using tp::testing::make;
using tp::testing::run_ranks;
using tp::testing::stack_of;
using namespace std::chrono_literals;

namespace {

tp::World make_world(int rank, int world, int port, double timeout = 60) {
  return tp::World(tp::WorldOptions{.rank = rank,
                                    .world_size = world,
                                    .master_addr = "127.0.0.1",
                                    .master_port = port,
                                    .timeout = std::chrono::duration<double>(timeout)});
}

void ops_rank(int rank, int world, int port, std::string backend) {
  auto w = make_world(rank, world, port);
  auto g = w.create_collective_group({}, tp::backend_from_string(backend));
  // One host: auto is shm; hierarchical has one host and so only its shm level.
  const auto want = backend == "gloo"           ? tp::Backend::kGloo
                    : backend == "hierarchical" ? tp::Backend::kHierarchical
                                                : tp::Backend::kShm;
  TORCHPAR_RCHECK(g.backend() == want, "backend {} resolved to {}", backend,
                  tp::to_string(g.backend()));
  TORCHPAR_RCHECK(g.rank() == rank && g.size() == world, "group rank/size");
  // Two ranks run every dtype and size; more ranks (oversubscribed on a 2-core machine, the
  // slow part of this suite) one floating and one integer dtype, a tiny and a multi-slot size.
  const auto dtypes =
      world == 2 ? std::vector<at::ScalarType>{at::kFloat, at::kDouble, at::kInt, at::kLong}
                 : std::vector<at::ScalarType>{at::kFloat, at::kLong};
  // 1 and 4 elements travel inline on shm (up to 16 bytes: 4 floats, 2 doubles), the rest
  // through the data slots.
  const auto sizes =
      world == 2 ? std::vector<int64_t>{1, 4, 1000, 70000} : std::vector<int64_t>{1, 70000};
  for (auto dt : dtypes) {
    for (int64_t n : sizes) check_ops(g, dt, n, true);
  }
  // 4 MiB of float32: 16 slots of the shm backend (256 KiB each), the chunked paths
  check_ops(g, at::kFloat, 1 << 20, false);
  if (want == tp::Backend::kShm) {
    for (auto dt : {at::kHalf, at::kBFloat16, at::kShort, at::kChar}) {
      check_ops(g, dt, 3, true);  // inline
      check_ops(g, dt, 333, true);
    }
    // bool: SUM is OR, PRODUCT is AND
    auto t = at::full({5}, rank == 0, at::kBool);
    g.all_reduce(t, {.op = tp::ReduceOp::kSum});
    TORCHPAR_RCHECK(t.all().item<bool>(), "bool OR");
    t = at::full({5}, rank == 0, at::kBool);
    g.all_reduce(t, {.op = tp::ReduceOp::kProduct});
    TORCHPAR_RCHECK(!t.any().item<bool>() || world == 1, "bool AND");
  }
  // async handles
  {
    auto t = at::ones({1000});
    auto b = at::full({10}, rank, at::kLong);
    auto w1 = g.all_reduce(t, {.op = tp::ReduceOp::kSum, .async_op = true});
    auto w2 = g.broadcast(b, 0, {.async_op = true});
    auto w3 = g.barrier({.async_op = true});
    TORCHPAR_RCHECK(w1.wait(30.0s) == -1, "async all_reduce source");
    w2.wait();
    w3.wait();
    TORCHPAR_RCHECK(w1.is_completed() && w2.is_completed() && w3.is_completed(), "async completed");
    TORCHPAR_RCHECK(at::equal(t, at::full({1000}, world)), "async all_reduce value");
    TORCHPAR_RCHECK(at::equal(b, at::zeros({10}, at::kLong)), "async broadcast value");
    // A synchronous call behind pending asynchronous ones queues after them (it does not take
    // the inline path) and returns once they all ran, in issue order.
    auto t2 = at::ones({1000});
    auto w4 = g.all_reduce(t2, {.async_op = true});
    auto w5 = g.broadcast(b, world - 1, {.async_op = true});
    auto s = at::full({2}, rank + 1.0);
    g.all_reduce(s);
    TORCHPAR_RCHECK(w4.is_completed() && w5.is_completed(),
                    "a synchronous call returned before the asynchronous calls issued before it");
    TORCHPAR_RCHECK(at::equal(s, at::full({2}, world * (world + 1) / 2.0)), "sync value");
    TORCHPAR_RCHECK(at::equal(t2, at::full({1000}, world)), "queued async all_reduce value");
  }
  // point to point around the ring; receive from any source and learn the sender
  {
    const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
    auto out = make(rank, 100, at::kFloat);
    auto in = at::zeros({100});
    auto s = g.isend(out, next, 7);
    auto r = g.irecv(in, std::nullopt, 7);
    const int sender = r.wait(30.0s);
    s.wait(30.0s);
    TORCHPAR_RCHECK(sender == prev, "irecv from any source: sender {} want {}", sender, prev);
    expect_equal(in, make(prev, 100, at::kFloat), "irecv any source");
    // named source, blocking
    if (rank == 0) {
      g.send(at::full({3}, 42.0), world - 1);
    } else if (rank == world - 1) {
      auto x = at::zeros({3});
      TORCHPAR_RCHECK(g.recv(x, 0) == 0, "recv sender");
      TORCHPAR_RCHECK(at::equal(x, at::full({3}, 42.0)), "recv value");
    }
  }
  g.barrier();
}

struct Case {
  std::string backend;
  int ranks;
};

class CollectiveOps : public ::testing::TestWithParam<Case> {};

TEST_P(CollectiveOps, EveryOpMatchesLocalResults) {
  const auto c = GetParam();
  auto res = run_ranks(c.ranks, 240, &ops_rank, c.ranks, free_port(), c.backend);
  for (int r = 0; r < c.ranks; ++r) {
    EXPECT_EQ(res[r].exitcode, 0) << "rank " << r << ": " << res[r].error;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, CollectiveOps,
                         ::testing::Values(Case{"shm", 2}, Case{"shm", 3}, Case{"auto", 4},
                                           Case{"gloo", 2}, Case{"gloo", 3},
                                           Case{"hierarchical", 3}),
                         [](const auto& param_info) {
                           return param_info.param.backend + std::to_string(param_info.param.ranks);
                         });

// ---- shm and gloo agree bit for bit on integer sums, within tolerance on floats ---------------

void agree_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port);
  auto shm = w.create_collective_group({}, tp::Backend::kShm);
  auto gloo = w.create_collective_group({}, tp::Backend::kGloo);
  at::manual_seed(1234 + rank);
  auto ints = at::randint(-1000000, 1000000, {300000}, at::kLong);
  auto floats = at::randn({300000});
  auto a = ints.clone(), b = ints.clone(), c = floats.clone(), d = floats.clone();
  shm.all_reduce(a);
  gloo.all_reduce(b);
  shm.all_reduce(c);
  gloo.all_reduce(d);
  TORCHPAR_RCHECK(at::equal(a, b), "integer sums differ between shm and gloo");
  TORCHPAR_RCHECK(at::allclose(c, d, 1e-5, 1e-5), "float sums differ beyond tolerance");
  // every rank holds the same bits after a float all_reduce (shm)
  std::vector<at::Tensor> copies;
  for (int q = 0; q < world; ++q) copies.push_back(at::empty_like(c));
  shm.all_gather(copies, c);
  for (auto& x : copies) TORCHPAR_RCHECK(at::equal(x, c), "ranks hold different float results");
}

TEST(Collective, ShmAndGlooAgree) {
  auto res = run_ranks(3, 120, &agree_rank, 3, free_port());
  for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << r.error;
}

// ---- ranks that disagree -------------------------------------------------------------------

void mismatch_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port, 20);
  auto g = w.create_collective_group({}, tp::Backend::kShm);
  auto t = rank == 0 ? at::ones({10}, at::kFloat) : at::ones({10}, at::kDouble);
  try {
    g.all_reduce(t);
  } catch (const tp::Error& e) {
    TORCHPAR_RCHECK(std::string(e.what()).find("disagree") != std::string::npos, "message: {}",
                    e.what());
    // the group is broken for good: the next call fails at once
    try {
      g.barrier();
    } catch (const tp::Error&) {
      return;
    }
    throw std::runtime_error("barrier after a broken all_reduce did not throw");
  }
  throw std::runtime_error("mismatched dtypes did not throw");
}

TEST(Collective, MismatchedDtypesRaiseOnEveryRank) {
  auto res = run_ranks(2, 60, &mismatch_rank, 2, free_port());
  for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << r.error;
}

/// Runs `call`, which must throw tp::Error saying the ranks disagree and naming both sides.
template <class F>
void expect_disagree(F&& call, const std::string& mine, const std::string& theirs) {
  try {
    call();
  } catch (const tp::Error& e) {
    const std::string what = e.what();
    TORCHPAR_RCHECK(what.find("disagree") != std::string::npos &&
                        what.find(mine) != std::string::npos &&
                        what.find(theirs) != std::string::npos,
                    "message names {} and {}: {}", mine, theirs, what);
    return;
  }
  throw std::runtime_error(fmt::format("{} against {} did not throw", mine, theirs));
}

/// Rank 0 calls all_reduce(t) while the others call broadcast(t, 0): every rank must raise.
template <class Group>
void expect_all_reduce_against_broadcast(Group& g, int rank, at::Tensor& t) {
  expect_disagree(
      [&] {
        if (rank == 0) {
          g.all_reduce(t);
        } else {
          g.broadcast(t, 0);
        }
      },
      "all_reduce(", "broadcast(");
}

void mismatch_inline_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port, 20);
  {  // an inline all_reduce (1 float) against one through the slots (10,000 floats)
    auto g = w.create_collective_group({}, tp::Backend::kShm);
    auto t = at::ones({rank == 0 ? 1 : 10000});
    expect_disagree([&] { g.all_reduce(t); }, "numel 1,", "numel 10000,");
  }
  {  // two inline operations that differ: all_reduce against broadcast of 1 float
    auto g = w.create_collective_group({}, tp::Backend::kShm);
    auto t = at::ones({1});
    expect_all_reduce_against_broadcast(g, rank, t);
  }
}

// The shm backend compares the ranks' operation signatures (in the counters' cache lines) and
// reads the full metadata only when they differ: inline and slot-sized calls are compared too.
TEST(Collective, MismatchedInlineOperationsRaiseOnEveryRank) {
  auto res = run_ranks(2, 60, &mismatch_inline_rank, 2, free_port());
  for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << r.error;
}

// ---- ranks that disagree, on gloo -----------------------------------------------------------

void gloo_mismatch_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port, 20);
  auto g = w.create_collective_group({}, tp::Backend::kGloo, 10.0s);
  {  // different sizes: Gloo's transport thread ended the process (gloo::EnforceNotMet)
    auto t = at::ones({rank == 0 ? 10 : 20});
    expect_disagree([&] { g.all_reduce(t); }, "numel 10,", "numel 20,");
  }
  {  // different dtypes, the same number of elements
    auto t = at::ones({10}, rank == 0 ? at::kFloat : at::kDouble);
    expect_disagree([&] { g.all_reduce(t); }, "dtype Float", "dtype Double");
  }
  {  // different operations
    auto t = at::ones({4});
    expect_all_reduce_against_broadcast(g, rank, t);
  }
  // Nothing was sent: the group goes on.
  auto t = at::ones({8});
  g.all_reduce(t);
  TORCHPAR_RCHECK(at::equal(t, at::full({8}, world)), "all_reduce after the disagreements");
}

// Every gloo collective first compares the ranks' calls (a fixed-size all_gather): a
// mismatch is an Error on every rank instead of std::terminate on Gloo's transport thread.
TEST(Collective, GlooMismatchedSizesAndDtypesRaiseOnEveryRank) {
  auto res = run_ranks(2, 60, &gloo_mismatch_rank, 2, free_port());
  for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << r.error;
}

// ---- a broadcast's root runs ahead (shm)
// ---------------------------------------------------------

void root_ahead_rank(int rank, int world, int port, int root) {
  auto w = make_world(rank, world, port, 30);
  auto signal = w.create_collective_group({}, tp::Backend::kGloo, 20.0s);
  auto g = w.create_collective_group({}, tp::Backend::kShm, 20.0s);
  // The root returns from an inline broadcast and from one through a slot before any other
  // rank calls broadcast: it reaches the gloo barrier that the others pass first. (A larger
  // broadcast's root returns once the others read all but its last chunk.)
  for (int64_t n : {int64_t{2}, int64_t{1000}}) {  // inline; 4000 bytes: one slot
    auto t = rank == root ? at::arange(n, at::kInt) : at::full({n}, -1, at::kInt);
    if (rank == root) {
      g.broadcast(t, root);
      signal.barrier();
    } else {
      signal.barrier();
      g.broadcast(t, root);
    }
    TORCHPAR_RCHECK(at::equal(t, at::arange(n, at::kInt)), "broadcast of {} ints (rank {})", n,
                    rank);
  }
  // Many calls in a row, the others late now and then: the root is as far ahead as it may be,
  // and every value still arrives (no set reused before everyone read it).
  for (int i = 0; i < 300; ++i) {
    const int64_t n = i % 30 == 29 ? 150000 : 3;  // inline, and 3 slots now and then
    auto t = rank == root ? at::full({n}, i, at::kInt) : at::full({n}, -1, at::kInt);
    if (rank != root && i % 40 == 7) std::this_thread::sleep_for(5ms);
    g.broadcast(t, root);
    TORCHPAR_RCHECK(at::equal(t, at::full({n}, i, at::kInt)), "call {} of {} ints (rank {})", i, n,
                    rank);
  }
  auto s = at::ones({1});
  g.all_reduce(s);
  TORCHPAR_RCHECK(s.item<float>() == world, "all_reduce after the broadcasts: {}", s.item<float>());
}

TEST(Collective, ShmBroadcastRootReturnsOnceItsDataIsPublished) {
  auto two = run_ranks(2, 60, &root_ahead_rank, 2, free_port(), 0);
  for (auto& r : two) EXPECT_EQ(r.exitcode, 0) << r.error;
  auto three = run_ranks(3, 60, &root_ahead_rank, 3, free_port(), 2);
  for (auto& r : three) EXPECT_EQ(r.exitcode, 0) << r.error;
}

/// The root of a broadcast does not wait for the others, so it learns that they called
/// something else at its next call on the group; the others learn it at once.
void root_disagree_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port, 20);
  {  // both ranks think they are the root: both learn it at their next call
    auto g = w.create_collective_group({}, tp::Backend::kShm);
    auto t = at::ones({1});
    g.broadcast(t, rank);
    expect_disagree([&] { g.barrier(); },
                    fmt::format("broadcast(dtype Float, numel 1, root {}", rank),
                    fmt::format("broadcast(dtype Float, numel 1, root {}", 1 - rank));
  }
  {  // a root against an all_reduce through the slots: the root's next call throws
    auto g = w.create_collective_group({}, tp::Backend::kShm);
    auto t = at::ones({1000});
    if (rank == 0) {
      g.broadcast(t, 0);
      try {
        g.barrier();
      } catch (const tp::Error&) {
        return;
      }
      throw std::runtime_error("the root's next call after a disagreement did not throw");
    }
    expect_disagree([&] { g.all_reduce(t); }, "all_reduce(", "broadcast(");
  }
}

/// A rank SIGKILLed in a run of tiny broadcasts: the root, which runs ahead, names it when
/// its ring wraps (it waits for the dead rank there); a reader names a dead root at once.
void broadcast_killed_rank(int rank, int world, int port, int victim) {
  auto w = make_world(rank, world, port, 30);
  auto g = w.create_collective_group({}, tp::Backend::kShm, 8.0s);
  auto t = at::zeros({1}, at::kInt);
  // Everyone is past the group's creation (the root would otherwise run its 10 broadcasts
  // and die while the other still talks to the store it hosts).
  g.all_reduce(t);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    for (int i = 0; i < 1000; ++i) {
      if (rank == victim && i == 10) ::raise(SIGKILL);
      g.broadcast(t, 0);
    }
  } catch (const tp::RankLostError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    TORCHPAR_RCHECK(s < 8.5, "raised after {:.1f} s, beyond the 8 s timeout", s);
    TORCHPAR_RCHECK(e.rank() == victim, "the error names rank {}, not {}: {}", e.rank(), victim,
                    e.what());
    return;
  }
  throw std::runtime_error("1000 broadcasts with a dead rank did not throw");
}

TEST(Collective, ShmBroadcastWithAKilledRankRaisesNamingIt) {
  for (int victim : {1, 0}) {  // a reader, then the root
    auto res = run_ranks(2, 60, &broadcast_killed_rank, 2, free_port(), victim);
    EXPECT_EQ(res[victim].exitcode, -SIGKILL) << "victim " << victim;
    EXPECT_EQ(res[1 - victim].exitcode, 0) << "victim " << victim << ": " << res[1 - victim].error;
  }
}

/// A reader SIGSTOPped in a run of tiny broadcasts (alive, never arriving): the root, running
/// ahead, times out when its ring is full, within the group's 2 s, naming the reader.
void broadcast_stopped_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port, 30);
  auto g = w.create_collective_group({}, tp::Backend::kShm, 2.0s);
  auto pid = at::full({1}, rank == 1 ? static_cast<int64_t>(::getpid()) : 0, at::kLong);
  g.all_reduce(pid);  // rank 0 learns rank 1's pid; both are past the group's creation
  auto t = at::zeros({1}, at::kInt);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    for (int i = 0; i < 1000; ++i) {
      if (rank == 1 && i == 10) ::raise(SIGSTOP);  // rank 0 kills it below
      g.broadcast(t, 0);
    }
  } catch (const tp::TimeoutError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ::kill(static_cast<pid_t>(pid.item<int64_t>()), SIGKILL);
    TORCHPAR_RCHECK(rank == 0, "rank {} timed out: {}", rank, e.what());
    TORCHPAR_RCHECK(s < 10, "timed out after {:.1f} s (group timeout 2 s)", s);
    const std::string msg = e.what();
    TORCHPAR_RCHECK(
        msg.find("rank 1") != std::string::npos && msg.find("within 2.0 s") != std::string::npos,
        "the error names neither rank 1 nor 2 s: {}", msg);
    return;
  }
  if (rank == 0) ::kill(static_cast<pid_t>(pid.item<int64_t>()), SIGKILL);
  throw std::runtime_error("1000 broadcasts with a stopped rank did not time out");
}

TEST(Collective, ShmBroadcastWithAStoppedRankTimesOut) {
  auto res = run_ranks(2, 60, &broadcast_stopped_rank, 2, free_port());
  EXPECT_EQ(res[0].exitcode, 0) << res[0].error;
  EXPECT_EQ(res[1].exitcode, -SIGKILL);
}

TEST(Collective, ShmBroadcastRootLearnsOfADisagreementAtItsNextCall) {
  auto res = run_ranks(2, 60, &root_disagree_rank, 2, free_port());
  for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << r.error;
}

// ---- single copies (process_vm_readv / process_vm_writev between the ranks' tensors) -----------

/// Rank `off` (-1: none) turns single copies off before the group is made: the whole group then
/// goes through its slots, and every large operation still matches (a rank copying straight
/// while another waits for its slot would hang or read garbage).
void single_copy_mixed_rank(int rank, int world, int port, int off) {
  if (rank == off) ::setenv("TORCHPAR_SHM_SINGLE_COPY", "0", 1);
  auto w = make_world(rank, world, port);
  auto g = w.create_collective_group({}, tp::Backend::kShm);
  check_ops(g, at::kFloat, 70000, false);
  check_ops(g, at::kFloat, 1 << 20, false);
  check_ops(g, at::kLong, 100003, false);
}

TEST(Collective, ShmSingleCopyOffOnOneRankTurnsItOffForTheGroup) {
  for (int off : {-1, 1}) {
    auto res = run_ranks(2, 120, &single_copy_mixed_rank, 2, free_port(), off);
    for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << "rank " << off << " off: " << r.error;
  }
}

/// Outputs over inputs, in single copies (400 KB tensors): an in-place all_to_all (one list for
/// both), an all_gather whose input is the list's element of the next rank, a reduce_scatter into
/// the piece this rank sends the next one, and the common in-place forms (all_gather's input as
/// its own element, reduce_scatter into its own piece). A rank writing an output the others
/// still read would corrupt their results; every rank checks all of its own.
void single_copy_aliasing_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port);
  auto g = w.create_collective_group({}, tp::Backend::kShm);
  const int64_t n = 100000;
  const int next = (rank + 1) % world;
  for (int round = 0; round < 3; ++round) {
    std::vector<at::Tensor> list;
    for (int q = 0; q < world; ++q) list.push_back(make(rank * world + q, n, at::kFloat));
    g.all_to_all(list, list);
    for (int q = 0; q < world; ++q) {
      expect_equal(list[q], make(q * world + rank, n, at::kFloat), "in-place all_to_all");
    }
    std::vector<at::Tensor> out;
    for (int q = 0; q < world; ++q) out.push_back(at::zeros({n}));
    out[next].copy_(make(rank, n, at::kFloat));
    g.all_gather(out, out[next]);
    for (int q = 0; q < world; ++q) {
      expect_equal(out[q], make(q, n, at::kFloat), "all_gather of another rank's element");
    }
    out[rank].copy_(make(rank, n, at::kFloat));
    g.all_gather(out, out[rank]);
    for (int q = 0; q < world; ++q) {
      expect_equal(out[q], make(q, n, at::kFloat), "all_gather of its own element");
    }
    const auto want = stack_of(world, n, at::kFloat, rank, world).sum(0, false, at::kFloat);
    for (int target : {next, rank}) {
      std::vector<at::Tensor> in;
      for (int q = 0; q < world; ++q) in.push_back(make(rank * world + q, n, at::kFloat));
      g.reduce_scatter(in[target], in);
      expect_equal(
          in[target], want,
          target == rank ? "reduce_scatter in place" : "reduce_scatter into the next rank's piece");
    }
  }
}

TEST(Collective, ShmSingleCopyOutputsOverInputsMatch) {
  for (int ranks : {2, 3}) {
    auto res = run_ranks(ranks, 120, &single_copy_aliasing_rank, ranks, free_port());
    for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << ranks << " ranks: " << r.error;
  }
}

/// Single copies whose parts are big enough for this rank's own part to be copied with
/// non-temporal stores (kStreamOwnPartBytes: 8 MiB), into outputs that start 12
/// bytes past a 16-byte boundary and whose length is no multiple of 64 bytes (the streamed
/// copy's head and tail), and back into aligned ones: every element of every part checked.
void single_copy_streamed_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port);
  auto g = w.create_collective_group({}, tp::Backend::kShm);
  const int64_t n = (5 << 20) / 2 + 7;  // 10 MiB + 28 bytes a part
  for (int64_t offset : {3, 0}) {
    at::Tensor arena = at::zeros({offset + world * n});
    std::vector<at::Tensor> out;
    for (int q = 0; q < world; ++q) out.push_back(arena.narrow(0, offset + q * n, n));
    g.all_gather(out, make(rank, n, at::kFloat));
    for (int q = 0; q < world; ++q) {
      expect_equal(out[q], make(q, n, at::kFloat), "streamed all_gather");
    }
    std::vector<at::Tensor> in;
    for (int q = 0; q < world; ++q) in.push_back(make(rank * world + q, n, at::kFloat));
    arena.zero_();
    g.all_to_all(out, in);
    for (int q = 0; q < world; ++q) {
      expect_equal(out[q], make(q * world + rank, n, at::kFloat), "streamed all_to_all");
    }
  }
}

TEST(Collective, ShmSingleCopyStreamedOwnPartsMatch) {
  auto res = run_ranks(2, 120, &single_copy_streamed_rank, 2, free_port());
  for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << r.error;
}

/// `victim` SIGKILLs itself from a thread 30 ms into a run of 16 MiB broadcasts (root 0) and
/// all_gathers, most of whose time goes to copying straight between the ranks' tensors: the
/// other rank raises RankLostError naming it within the group's 8 s, wherever the kill landed
/// (before, inside or after a process_vm_readv/writev of its memory).
void single_copy_killed_rank(int rank, int world, int port, int victim) {
  auto w = make_world(rank, world, port, 30);
  auto g = w.create_collective_group({}, tp::Backend::kShm, 8.0s);
  auto t = at::ones({4 << 20});
  std::vector<at::Tensor> out{at::empty_like(t), at::empty_like(t)};
  g.barrier();
  std::thread killer;
  if (rank == victim) {
    killer = std::thread([] {
      std::this_thread::sleep_for(30ms);
      ::raise(SIGKILL);
    });
  }
  auto t0 = std::chrono::steady_clock::now();
  try {
    for (int i = 0; i < 100000; ++i) {
      t0 = std::chrono::steady_clock::now();
      g.broadcast(t, 0);
      g.all_gather(out, t);
    }
  } catch (const tp::RankLostError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    TORCHPAR_RCHECK(rank != victim && e.rank() == victim, "rank {}: lost rank {}: {}", rank,
                    e.rank(), e.what());
    TORCHPAR_RCHECK(s < 8.5, "raised after {:.1f} s, beyond the 8 s timeout", s);
    return;
  }
  if (killer.joinable()) killer.join();
  throw std::runtime_error(
      "100000 large broadcasts and all_gathers with a dead rank did not throw");
}

TEST(Collective, ShmSingleCopyWithAKilledRankRaisesNamingIt) {
  for (int victim : {1, 0}) {  // a reader of the broadcasts, then their root
    auto res = run_ranks(2, 60, &single_copy_killed_rank, 2, free_port(), victim);
    EXPECT_EQ(res[victim].exitcode, -SIGKILL) << "victim " << victim << ": " << res[victim].error;
    EXPECT_EQ(res[1 - victim].exitcode, 0) << "victim " << victim << ": " << res[1 - victim].error;
  }
}

/// Rank 1 SIGSTOPs itself from a thread 30 ms into a run of 16 MiB all_to_alls and
/// reduce_scatters: rank 0 (whose copies from a stopped process still succeed) raises
/// TimeoutError within the group's 2 s and a slack, then SIGKILLs it.
void single_copy_stopped_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port, 30);
  auto g = w.create_collective_group({}, tp::Backend::kShm, 2.0s);
  auto pid = at::full({1}, rank == 1 ? static_cast<int64_t>(::getpid()) : 0, at::kLong);
  g.all_reduce(pid);
  std::vector<at::Tensor> in{at::ones({2 << 20}), at::ones({2 << 20})};
  std::vector<at::Tensor> out{at::empty({2 << 20}), at::empty({2 << 20})};
  auto piece = at::empty({2 << 20});
  std::thread stopper;
  if (rank == 1) {
    stopper = std::thread([] {
      std::this_thread::sleep_for(30ms);
      ::raise(SIGSTOP);  // rank 0 SIGKILLs it
    });
  }
  auto t0 = std::chrono::steady_clock::now();
  try {
    for (int i = 0; i < 100000; ++i) {
      t0 = std::chrono::steady_clock::now();
      g.all_to_all(out, in);
      g.reduce_scatter(piece, in);
    }
  } catch (const tp::TimeoutError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ::kill(static_cast<pid_t>(pid.item<int64_t>()), SIGKILL);
    TORCHPAR_RCHECK(rank == 0, "rank {} timed out: {}", rank, e.what());
    TORCHPAR_RCHECK(s < 6, "timed out after {:.1f} s (group timeout 2 s)", s);
    return;
  }
  if (rank == 0) ::kill(static_cast<pid_t>(pid.item<int64_t>()), SIGKILL);
  if (stopper.joinable()) stopper.join();
  throw std::runtime_error("100000 large all_to_alls with a stopped rank did not time out");
}

TEST(Collective, ShmSingleCopyWithAStoppedRankTimesOut) {
  auto res = run_ranks(2, 60, &single_copy_stopped_rank, 2, free_port());
  EXPECT_EQ(res[0].exitcode, 0) << res[0].error;
  EXPECT_EQ(res[1].exitcode, -SIGKILL);
}

// ---- a rank SIGKILLed before an all_reduce ------------------------------------------------------

void killed_rank(int rank, int world, int port, std::string backend) {
  auto w = make_world(rank, world, port, 60);
  auto g = w.create_collective_group({}, tp::backend_from_string(backend), 8.0s);
  auto t = at::ones({1000});
  g.all_reduce(t);  // everyone is up
  if (rank == 1) ::raise(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    g.all_reduce(t);
  } catch (const tp::Error& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    TORCHPAR_RCHECK(s < 8.5, "raised after {:.1f} s, beyond the 8 s timeout", s);
    const std::string msg = e.what();
    TORCHPAR_RCHECK(msg.find("rank 1") != std::string::npos, "the error does not name rank 1: {}",
                    msg);
    // One error per event: a dead rank is RankLostError naming it on every survivor.
    const auto* lost = dynamic_cast<const tp::RankLostError*>(&e);
    TORCHPAR_RCHECK(lost && lost->rank() == 1, "not RankLostError(rank 1): {}", msg);
    return;
  }
  throw std::runtime_error("all_reduce with a dead rank did not throw");
}

TEST(Collective, KilledRankMakesOthersRaiseNamingIt) {
  for (std::string backend : {"shm", "gloo"}) {
    auto res = run_ranks(3, 60, &killed_rank, 3, free_port(), backend);
    EXPECT_EQ(res[0].exitcode, 0) << backend << ": " << res[0].error;
    EXPECT_EQ(res[1].exitcode, -SIGKILL) << backend;
    EXPECT_EQ(res[2].exitcode, 0) << backend << ": " << res[2].error;
  }
}

// ---- a stopped rank: TimeoutError on every survivor, within the timeout -------------------------

/// The elapsed seconds since `t0`.
double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Learns every rank's pid through `g` (all ranks call it).
std::vector<pid_t> pids_of(tp::CollectiveGroup& g, int rank, int world) {
  auto t = at::zeros({world}, at::kLong);
  t[rank] = static_cast<int64_t>(::getpid());
  g.all_reduce(t);
  std::vector<pid_t> out;
  for (int q = 0; q < world; ++q) out.push_back(static_cast<pid_t>(t[q].item<int64_t>()));
  return out;
}

/// The survivors' side of a stopped `victim`: all_reduce on `g` must raise TimeoutError (a
/// stopped process is alive) within `bound` seconds; then the survivors meet on `survivors`
/// (so that no survivor's exit is what another one sees) and SIGKILL the victim.
void expect_timeout_then_kill(tp::CollectiveGroup& g, tp::CollectiveGroup& survivors, pid_t victim,
                              double bound, const std::string& what) {
  auto t = at::ones({1000});
  const auto t0 = std::chrono::steady_clock::now();
  std::string got;
  double s = 0;
  try {
    g.all_reduce(t);
    got = "no error";
  } catch (const tp::TimeoutError&) {
    s = since(t0);
  } catch (const std::exception& e) {
    got = fmt::format("{} ({})", e.what(), typeid(e).name());
  }
  survivors.barrier();
  ::kill(victim, SIGKILL);
  TORCHPAR_RCHECK(got.empty(), "{}: a stopped rank gave, instead of TimeoutError: {}", what, got);
  TORCHPAR_RCHECK(s < bound, "{}: TimeoutError after {:.1f} s, beyond {:.1f} s", what, s, bound);
}

void stopped_rank(int rank, int world, int port, std::string backend) {
  auto w = make_world(rank, world, port, 30);
  auto g = w.create_collective_group({}, tp::backend_from_string(backend), 2.0s);
  std::optional<tp::CollectiveGroup> survivors;
  if (rank != 1) survivors = w.create_collective_group({0, 2}, tp::Backend::kGloo, 30.0s);
  const auto pids = pids_of(g, rank, world);  // everyone is past the groups' creation
  if (rank == 1) {
    ::raise(SIGSTOP);  // a survivor SIGKILLs it
    return;
  }
  expect_timeout_then_kill(g, *survivors, pids[1], 2.0 + 4.0, backend);
}

// One paused rank is one event: TimeoutError on every survivor (shm: the first survivor's
// timeout aborts the segment as a timeout; gloo: a survivor whose peer timed out and closed
// its connections first, every member's process alive, times out too).
TEST(Collective, StoppedRankIsATimeoutOnEverySurvivor) {
  for (std::string backend : {"shm", "gloo"}) {
    auto res = run_ranks(3, 60, &stopped_rank, 3, free_port(), backend);
    EXPECT_EQ(res[0].exitcode, 0) << backend << ": " << res[0].error;
    EXPECT_EQ(res[1].exitcode, -SIGKILL) << backend;
    EXPECT_EQ(res[2].exitcode, 0) << backend << ": " << res[2].error;
  }
}

// ---- hierarchical across two "hosts" of one machine, a stopped rank
// ------------------------------

/// Makes this process a host of its own for the rendezvous, whose host key includes
/// /dev/shm's device: a private mount namespace with a fresh tmpfs on /dev/shm. False
/// without the rights (CAP_SYS_ADMIN).
bool become_another_host() {
  if (::unshare(CLONE_NEWNS) != 0) return false;
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return false;
  return ::mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777") == 0;
}

bool can_become_another_host() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(become_another_host() ? 0 : 1);
  int status = 0;
  return pid > 0 && ::waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
         WEXITSTATUS(status) == 0;
}

/// Hosts A = {0, 1} (0 leads; 0 also hosts the store) and B = {2}; `victim` stops itself
/// before an all_reduce on a hierarchical group with a 2 s timeout.
void hier_stopped_rank(int rank, int world, int port, int victim) {
  if (rank == 2 && !become_another_host()) throw std::runtime_error("cannot make host B");
  auto w = make_world(rank, world, port, 30);  // the store's own timeout: 30 s
  auto g = w.create_collective_group({}, tp::Backend::kHierarchical, 2.0s);
  std::vector<int> others;
  for (int q = 0; q < world; ++q) {
    if (q != victim) others.push_back(q);
  }
  std::optional<tp::CollectiveGroup> survivors;
  if (rank != victim) survivors = w.create_collective_group(others, tp::Backend::kGloo, 30.0s);
  const auto pids = pids_of(g, rank, world);
  if (rank == victim) {
    ::raise(SIGSTOP);  // a survivor SIGKILLs it
    return;
  }
  // The member that timed out reads and writes the group's failure record in rank 0's
  // store, each call bounded by min(timeout, 2 s): 2 x 2 s, and slack for a loaded machine.
  expect_timeout_then_kill(g, *survivors, pids[static_cast<size_t>(victim)], 2 * 2.0 + 3.0,
                           fmt::format("hierarchical, rank {} stopped", victim));
}

// The store's host (rank 0) SIGSTOPped: the survivors raised after 17-47 s against a 2 s
// timeout (the store's 30 s here), waiting on rank 0's store for the failure record. A stopped
// non-leader (rank 1): its leader times out, the other host's leader sees its gloo group
// close, and both raise TimeoutError (the record says timeout).
TEST(Collective, HierarchicalStoppedRankIsATimeoutWithinTheGroupTimeout) {
  if (!can_become_another_host()) GTEST_SKIP() << "needs CAP_SYS_ADMIN for a private /dev/shm";
  for (int victim : {0, 1}) {
    auto res = run_ranks(3, 60, &hier_stopped_rank, 3, free_port(), victim);
    for (int r = 0; r < 3; ++r) {
      if (r == victim) {
        EXPECT_EQ(res[r].exitcode, -SIGKILL) << "victim " << victim;
      } else {
        EXPECT_EQ(res[r].exitcode, 0)
            << "victim " << victim << ", rank " << r << ": " << res[r].error;
      }
    }
  }
}

// ---- a per-call timeout shorter than the group's ----------------------------------------------

void per_call_timeout_rank(int rank, int world, int port, std::string backend) {
  auto w = make_world(rank, world, port, 60);
  auto signal = w.create_collective_group({}, tp::Backend::kGloo, 30.0s);
  auto g = w.create_collective_group({}, tp::backend_from_string(backend), 30.0s);
  if (rank == 0) {  // rank 1 never calls all_reduce
    auto t = at::ones({16});
    const auto t0 = std::chrono::steady_clock::now();
    try {
      g.all_reduce(t, {.timeout = 0.5s});
      throw std::runtime_error("all_reduce without its peer did not time out");
    } catch (const tp::TimeoutError& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const std::string msg = e.what();
      TORCHPAR_RCHECK(s < 10, "the 0.5 s call timeout fired after {:.1f} s (group timeout 30 s)",
                      s);
      TORCHPAR_RCHECK(msg.find("within 0.5 s") != std::string::npos,
                      "the error does not name 0.5 s: {}", msg);
    }
  }
  signal.barrier();  // rank 1 waits here while rank 0 times out
}

TEST(Collective, PerCallTimeoutOverridesTheGroupTimeout) {
  for (std::string backend : {"shm", "gloo"}) {
    auto res = run_ranks(2, 90, &per_call_timeout_rank, 2, free_port(), backend);
    for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << backend << ": " << r.error;
  }
}

// ---- a group destroyed while its work is pending ----------------------------------------------

/// Frees and reuses heap chunks of many sizes, filled with 0xff: memory of a destroyed object
/// that something still reads becomes garbage pointers (a crash) instead of stale values.
void scribble_heap() {
  std::vector<std::unique_ptr<char[]>> keep;
  for (size_t n = 16; n <= 1024; n += 8) {
    for (int i = 0; i < 8; ++i) {
      keep.emplace_back(new char[n]);
      std::memset(keep.back().get(), 0xff, n);
    }
  }
}

void pending_work_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port, 30);
  auto signal = w.create_collective_group({}, tp::Backend::kGloo, 20.0s);
  auto g = w.create_collective_group({}, tp::Backend::kGloo, 20.0s);
  if (rank == 0) {
    signal.barrier();  // rank 1 destroyed its group with a recv pending
    ::raise(SIGKILL);  // which makes that recv fail
  }
  tp::Work pending;
  {
    auto t = at::zeros({16});
    pending = g.irecv(t, 0, /*tag=*/7);  // rank 0 never sends it
    g.destroy();
    g = tp::CollectiveGroup();
  }  // the group object is gone; the Work must keep its backend alive
  scribble_heap();
  signal.barrier();
  try {
    pending.wait(20.0s);
  } catch (const tp::Error& e) {
    const std::string msg = e.what();
    TORCHPAR_RCHECK(msg.find("recv") != std::string::npos, "unexpected error: {}", msg);
    return;
  }
  throw std::runtime_error("a recv from a dead rank succeeded");
}

TEST(Collective, GroupDestroyedWithPendingWorkIsSafe) {
  auto res = run_ranks(2, 60, &pending_work_rank, 2, free_port());
  EXPECT_EQ(res[0].exitcode, -SIGKILL);
  EXPECT_EQ(res[1].exitcode, 0) << res[1].error;
}

// ---- sub-groups --------------------------------------------------------------------------------

void subgroup_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port);
  // ranks {2, 0} in that order: world rank 2 is group rank 0
  if (rank == 0 || rank == 2) {
    auto g = w.create_collective_group({2, 0}, tp::Backend::kAuto);
    TORCHPAR_RCHECK(g.rank() == (rank == 2 ? 0 : 1), "group-relative rank");
    auto t = at::full({4}, rank, at::kInt);
    g.broadcast(t, 0);
    TORCHPAR_RCHECK(at::equal(t, at::full({4}, 2, at::kInt)), "broadcast from group rank 0");
  } else {
    try {
      w.create_collective_group({2, 0});
      throw std::runtime_error("a non-member created a group");
    } catch (const tp::Error& e) {
      TORCHPAR_RCHECK(std::string(e.what()).find("not in the group") != std::string::npos, "{}",
                      e.what());
    }
  }
  TORCHPAR_RCHECK(w.get_names()[1] == "rank1", "names");
}

TEST(World, SubgroupsUseRelativeRanks) {
  auto res = run_ranks(3, 60, &subgroup_rank, 3, free_port());
  for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << r.error;
}

// ---- bad World configurations
// ---------------------------------------------------------------------

TEST(World, RankOutOfRangeIsRefused) {
  try {
    make_world(3, 2, free_port(), 5);
    FAIL() << "no error";
  } catch (const tp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of range"), std::string::npos) << e.what();
  }
}

TEST(World, MissingEnvironmentIsNamed) {
  ::unsetenv("RANK");
  try {
    tp::World w;
    FAIL() << "no error";
  } catch (const tp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK"), std::string::npos) << e.what();
  }
}

TEST(World, UnreachableMasterFailsWithinTimeout) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    make_world(1, 2, free_port(), 2);
    FAIL() << "no error";
  } catch (const tp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot reach the master"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10);
}

void sized_rank(int rank, int port, int world) {
  try {
    auto w = make_world(rank, world, port, 4);
  } catch (const tp::Error& e) {
    const std::string msg = e.what();
    // rank 0 refuses the world and leaves; the other rank hears it one way or another
    TORCHPAR_RCHECK(msg.find("world size") != std::string::npos ||
                        msg.find("did not join") != std::string::npos ||
                        msg.find("lost the connection to the store") != std::string::npos,
                    "unclear: {}", msg);
    return;
  }
  throw std::runtime_error("mismatched world sizes were accepted");
}

TEST(World, MismatchedWorldSizesAreRefused) {
  const int port = free_port();
  tp::Process a(tp::ProcessOptions{.start_method = tp::StartMethod::kFork}, &sized_rank, 0, port,
                2);
  tp::Process b(tp::ProcessOptions{.start_method = tp::StartMethod::kFork}, &sized_rank, 1, port,
                3);
  a.start();
  b.start();
  ASSERT_TRUE(a.join(30.0s));
  ASSERT_TRUE(b.join(30.0s));
  EXPECT_EQ(a.exitcode(), 0) << (a.error() ? a.error()->second : "");
  EXPECT_EQ(b.exitcode(), 0) << (b.error() ? b.error()->second : "");
}

void file_rank(int rank, int world, std::string path) {
  tp::World w(tp::WorldOptions{
      .rank = rank, .world_size = world, .init_method = "file://" + path, .timeout = 30.0s});
  auto g = w.create_collective_group();
  auto t = at::full({8}, rank + 1, at::kLong);
  g.all_reduce(t);
  TORCHPAR_RCHECK(at::equal(t, at::full({8}, world * (world + 1) / 2, at::kLong)),
                  "file store sum");
}

TEST(World, FileStoreRendezvous) {
  const std::string path = fmt::format("/tmp/torchpar_filestore_{}", ::getpid());
  ::unlink(path.c_str());
  auto res = run_ranks(2, 60, &file_rank, 2, path);
  ::unlink(path.c_str());
  for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << r.error;
}

}  // namespace

int main(int argc, char** argv) {
  tp::init(argc, argv);
  return torchpar::testing::run_tests(argc, argv);
}
