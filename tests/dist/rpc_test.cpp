// RpcGroup across real processes: machin's test_world.py cases in C++ (3 members named
// "0", "1", "2"), tensors by value and by shared-memory handle, remote errors, timeouts,
// RRef reference counting, a member killed mid-call and a group destroyed with calls in
// flight.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <stdexcept>
#include <thread>

#include "support/ranks.h"
#include "support/rpc.h"
#include "torchpar/dist/rpc_group.h"
#include "torchpar/dist/world.h"
#include "torchpar/shm/share.h"

namespace tp = torchpar;
using namespace std::chrono_literals;
using tp::testing::expect_throw;
using tp::testing::free_port;
using tp::testing::run_ranks;
constexpr auto make_world = tp::testing::make_named_world;
constexpr auto expect_ok = tp::testing::expect_ranks_ok;

namespace {

// Functions by name: registered in every process of the binary (static initializers).
const bool kAdd = tp::register_function(
    "add", +[](int a, int b) { return a + b; });
const bool kScale = tp::register_function(
    "scale", +[](at::Tensor t, double f) { return t * f; });
const bool kFillInPlace = tp::register_function(
    "fill_in_place", +[](at::Tensor t, double v) {
      t.fill_(v);  // the caller sees it only when t arrived as a shared-memory handle
      return t.data_ptr<float>()[0];
    });
const bool kThrow = tp::register_function(
    "throw",
    +[](std::string what) -> int { throw std::invalid_argument("bad argument: " + what); });
const bool kSleep = tp::register_function(
    "sleep", +[](double seconds) {
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      return seconds;
    });
const bool kDie = tp::register_function(
    "die", +[]() -> int {
      ::kill(::getpid(), SIGKILL);
      return 0;
    });

// ---- machin's test_world.py --------------------------------------------------------------

void machin_rank(int rank, int port) {
  auto w = make_world(rank, 3, port);
  auto g = w.create_rpc_group("group", {"0", "1", "2"});
  TORCHPAR_RCHECK(g.get_group_members() == std::vector<std::string>({"0", "1", "2"}), "members");
  TORCHPAR_RCHECK(g.get_cur_name() == std::to_string(rank), "cur name");
  TORCHPAR_RCHECK(g.is_member("2") && !g.is_member("3"), "is_member");
  const std::string next = std::to_string((rank + 1) % 3);

  // test_rpc: a registered add(1, 2) by every form.
  TORCHPAR_RCHECK(g.rpc_sync<int>(next, "add", std::tuple{1, 2}) == 3, "rpc_sync");
  TORCHPAR_RCHECK(g.rpc_async<int>(next, "add", std::tuple{1, 2}).wait() == 3, "rpc_async");
  auto rref = g.remote<int>(next, "add", std::tuple{1, 2});
  TORCHPAR_RCHECK(rref.owner() == next && !rref.is_owner(), "remote owner");
  TORCHPAR_RCHECK(rref.to_here() == 3, "remote to_here");
  auto own = g.remote<int>(g.get_cur_name(), "add", std::tuple{2, 2});
  TORCHPAR_RCHECK(own.is_owner() && own.to_here() == 4, "remote to self");

  // test_pair: each member pairs its own value; ownership errors; get_paired from others.
  g.pair("value_" + std::to_string(rank), std::string("from ") + std::to_string(rank));
  g.barrier();
  expect_throw<tp::RpcKeyTakenError>([&] { g.pair("value_" + next, std::string("x")); },
                                     "pairing a key another member holds");
  auto e = expect_throw<tp::RpcKeyNotOwnedError>([&] { g.unpair("value_" + next); },
                                                 "unpairing a key another member holds");
  TORCHPAR_RCHECK(e.owner() == next, "unpair error names owner '{}', got '{}'", next, e.owner());
  TORCHPAR_RCHECK(g.is_paired("value_" + next), "is_paired");
  TORCHPAR_RCHECK(g.get_paired<std::string>("value_" + next).to_here() == "from " + next,
                  "get_paired to_here");
  TORCHPAR_RCHECK(*g.local_paired<std::string>("value_" + std::to_string(rank)) ==
                      "from " + std::to_string(rank),
                  "local_paired");
  expect_throw<tp::RpcKeyNotFoundError>([&] { g.get_paired<int>("no_such_value"); },
                                        "get_paired of an unknown key");
  g.barrier();
  g.unpair("value_" + std::to_string(rank));
  g.barrier();
  TORCHPAR_RCHECK(!g.is_paired("value_" + next), "is_paired after unpair");

  // test_register: a counter service on "0"; "1" calls it by every form: 21, 22, 23.
  int counter = 20;
  std::mutex mu;
  if (rank == 0) {
    g.register_service("counter", [&] {
      std::lock_guard<std::mutex> lk(mu);
      return ++counter;
    });
  }
  g.barrier();
  TORCHPAR_RCHECK(g.is_registered("counter"), "is_registered");
  if (rank == 2) {
    expect_throw<tp::RpcKeyTakenError>([&] { g.register_service("counter", [] { return 0; }); },
                                       "registering a taken key");
    expect_throw<tp::RpcKeyNotOwnedError>([&] { g.deregister_service("counter"); },
                                          "deregistering another member's service");
  }
  if (rank == 1) {
    TORCHPAR_RCHECK(g.registered_sync<int>("counter", std::tuple{}) == 21, "registered_sync");
    TORCHPAR_RCHECK(g.registered_async<int>("counter", std::tuple{}).wait() == 22,
                    "registered_async");
    TORCHPAR_RCHECK(g.registered_remote<int>("counter", std::tuple{}).to_here() == 23,
                    "registered_remote");
  }
  g.barrier();
  if (rank == 0) {
    std::lock_guard<std::mutex> lk(mu);
    TORCHPAR_RCHECK(counter == 23, "the owner sees {} after three calls, want 23", counter);
    g.deregister_service("counter");
  }
  g.barrier();
  TORCHPAR_RCHECK(!g.is_registered("counter"), "is_registered after deregister");
  expect_throw<tp::RpcKeyNotFoundError>([&] { g.registered_sync<int>("counter", std::tuple{}); },
                                        "calling a deregistered service");
  g.barrier();
  g.destroy();
}

TEST(RpcGroup, MachinWorldCases) { expect_ok(run_ranks(3, 180, &machin_rank, free_port())); }

// ---- values, errors, timeouts, RRef counting -------------------------------------------------

void values_rank(int rank, int port) {
  auto w = make_world(rank, 2, port);
  auto g = w.create_rpc_group("values", {"0", "1"});
  if (rank == 0) {
    // A fresh 1 MiB tensor travels beside the message and comes back scaled.
    auto t = at::arange(262144, at::kFloat);
    auto r = g.rpc_sync<at::Tensor>("1", "scale", std::tuple{t, 2.0});
    TORCHPAR_RCHECK(at::equal(r, t * 2), "scaled tensor");
    // Not shared: the callee's fill does not reach us.
    auto copy = at::zeros({16});
    g.rpc_sync<float>("1", "fill_in_place", std::tuple{copy, 5.0});
    TORCHPAR_RCHECK(copy.sum().item<float>() == 0, "a copied tensor changed in the caller");
    // In shared memory: travels as a handle, the callee writes our memory.
    auto shared = at::zeros({16});
    tp::share_memory_(shared);
    TORCHPAR_RCHECK(g.rpc_sync<float>("1", "fill_in_place", std::tuple{shared, 7.0}) == 7.0f,
                    "fill result");
    TORCHPAR_RCHECK(shared.sum().item<float>() == 7.0f * 16, "shared tensor not written in place");

    // The callee's exception: its type and message.
    auto e = expect_throw<tp::RpcRemoteError>(
        [&] { g.rpc_sync<int>("1", "throw", std::tuple{std::string("x")}); }, "remote throw");
    TORCHPAR_RCHECK(e.type() == "std::invalid_argument", "remote type '{}'", e.type());
    TORCHPAR_RCHECK(e.message() == "bad argument: x", "remote message '{}'", e.message());
    expect_throw<tp::RpcKeyNotFoundError>(
        [&] { g.rpc_sync<int>("1", "no_such_function", std::tuple{}); }, "unknown function");
    expect_throw<tp::ValueError>(
        [&] {
          g.rpc_sync<int>("7", "add", std::tuple{1, 2});
        },
        "unknown member");

    // A timeout fails the call in about its time; the late reply is dropped.
    const auto t0 = std::chrono::steady_clock::now();
    expect_throw<tp::TimeoutError>([&] { g.rpc_sync<double>("1", "sleep", std::tuple{1.5}, 0.2s); },
                                   "timeout");
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    TORCHPAR_RCHECK(took < 1.4, "the timed-out call took {} s", took);
    std::this_thread::sleep_for(1.6s);  // the late reply arrives and is dropped
    TORCHPAR_RCHECK(g.debug_info().pending_calls == 0, "pending calls after the late reply");
    TORCHPAR_RCHECK(g.rpc_sync<int>("1", "add", std::tuple{5, 6}) == 11, "a call after a timeout");

    // 64 calls in flight at once.
    std::vector<tp::RpcFuture<int>> fs;
    for (int i = 0; i < 64; ++i) fs.push_back(g.rpc_async<int>("1", "add", std::tuple{i, 1}));
    for (int i = 0; i < 64; ++i) TORCHPAR_RCHECK(fs[i].wait() == i + 1, "future {}", i);

    // Dropped RRefs free their values on the owner.
    for (int i = 0; i < 100000; ++i) (void)g.remote<int>("1", "add", std::tuple{i, 0});
    auto last = g.remote<int>("1", "add", std::tuple{1, 0});
    TORCHPAR_RCHECK(last.to_here() == 1, "last remote");
  }
  g.barrier();
  if (rank == 1) {
    // Every RRef but `last` is gone: wait (bounded) for the deletes to arrive.
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (g.debug_info().owned_rrefs > 1 && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(10ms);
    TORCHPAR_RCHECK(g.debug_info().owned_rrefs <= 1, "owner still holds {} RRef values",
                    g.debug_info().owned_rrefs);
  }
  g.barrier();
  g.destroy();
}

TEST(RpcGroup, ValuesErrorsTimeoutsAndRRefCounting) {
  expect_ok(run_ranks(2, 180, &values_rank, free_port()));
}

// ---- faults ------------------------------------------------------------------------------------

void killed_rank(int rank, int port) {
  auto w = make_world(rank, 2, port);
  auto g = w.create_rpc_group("faults", {"0", "1"});
  if (rank == 1) {
    std::this_thread::sleep_for(60s);  // killed by the call below long before
    return;
  }
  auto slow = g.rpc_async<double>("1", "sleep", std::tuple{30.0}, 40s);
  const auto t0 = std::chrono::steady_clock::now();
  auto e = expect_throw<tp::RpcPeerLostError>(
      [&] { g.rpc_sync<int>("1", "die", std::tuple{}, 30s); }, "a call to a member that dies");
  TORCHPAR_RCHECK(e.member() == "1", "the error names member '{}'", e.member());
  expect_throw<tp::RpcPeerLostError>([&] { slow.wait(); }, "a pending call to a dead member");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  TORCHPAR_RCHECK(took < 10, "peer death seen after {} s", took);
  ::_exit(0);  // the World's store lives here but its other member is dead: no teardown
}

TEST(RpcGroup, AMemberKilledMidCallFailsItsCallsAtOnce) {
  auto res = run_ranks(2, 120, &killed_rank, free_port());
  EXPECT_EQ(res[0].exitcode, 0) << res[0].error;
  EXPECT_EQ(res[1].exitcode, -SIGKILL) << "rank 1 should have killed itself: " << res[1].error;
}

int thread_count() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

void destroy_rank(int rank, int port) {
  const int threads_before = thread_count();
  auto w = make_world(rank, 2, port);
  auto g = w.create_rpc_group("destroy", {"0", "1"});
  if (rank == 0) {
    auto slow = g.rpc_async<double>("1", "sleep", std::tuple{3.0}, 30s);
    const auto t0 = std::chrono::steady_clock::now();
    g.destroy();
    expect_throw<tp::RpcPeerLostError>([&] { slow.wait(); }, "a call in flight at destroy");
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    TORCHPAR_RCHECK(took < 2, "destroy with a call in flight took {} s", took);
    expect_throw<tp::ClosedError>(
        [&] {
          g.rpc_sync<int>("1", "add", std::tuple{1, 1});
        },
        "a call after destroy");
  }
  // Both wait for rank 1's sleeping call to end before the World goes.
  std::this_thread::sleep_for(rank == 1 ? 3.5s : 0s);
  auto& dg = w.default_group();
  dg.barrier();
  // The World's end stops the RPC agent: its transport, timer and pool threads are joined.
  w.destroy();
  const int threads_after = thread_count();
  TORCHPAR_RCHECK(threads_after <= threads_before, "{} threads before the World, {} after destroy",
                  threads_before, threads_after);
}

TEST(RpcGroup, DestroyFailsCallsInFlight) {
  expect_ok(run_ranks(2, 120, &destroy_rank, free_port()));
}

}  // namespace
