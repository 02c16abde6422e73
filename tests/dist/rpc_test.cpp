// RpcGroup across real processes: machin's test_world.py cases in C++ (3 members named
// "0", "1", "2"), tensors by value and by shared-memory handle, remote errors, timeouts,
// RRef reference counting, a member killed mid-call, calls to a dead member, a stopped
// (SIGSTOP) callee that blocks no caller, a group destroyed with calls in flight, and the
// job's key (none, malformed, one member without it, another key).

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/ranks.h"
#include "support/rpc.h"
#include "torchpar/dist/world.h"
#include "torchpar/rpc/rpc_group.h"
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
// "held": a call that runs until its process's test releases it (30 s at most); the test sees
// it start and end (rpc_test's destroy case: a call in flight on the callee, no sleep as a
// barrier).
struct Held {
  std::mutex mu;
  std::condition_variable cv;
  bool started = false, released = false, ended = false;
  /// Waits up to 30 s for `flag`; false when it did not come.
  bool wait_for(bool Held::*flag) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(30), [&] { return this->*flag; });
  }
  void set(bool Held::*flag) {
    std::lock_guard<std::mutex> lock(mu);
    this->*flag = true;
    cv.notify_all();
  }
};
Held& held() {
  static Held h;
  return h;
}
const bool kHeld = tp::register_function(
    "held", +[]() {
      held().set(&Held::started);
      const bool released = held().wait_for(&Held::released);
      held().set(&Held::ended);
      return released ? 1 : 0;
    });
const bool kDie = tp::register_function(
    "die", +[]() -> int {
      ::kill(::getpid(), SIGKILL);
      return 0;
    });
const bool kPid = tp::register_function(
    "pid", +[]() { return static_cast<int>(::getpid()); });

// ---- machin's test_world.py --------------------------------------------------------------

void machin_rank(int rank, int port) {
  ::setenv("TORCHPAR_RPC_SHM", "1", 1);  // the default transports (main turns shm off)
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
  // The arguments one by one, as machin's args=(1, 2), and none (before: only one std::tuple).
  TORCHPAR_RCHECK(g.rpc_sync<int>(next, "add", 1, 2) == 3, "variadic rpc_sync");
  TORCHPAR_RCHECK(g.rpc_async<int>(next, "add", 2, 3).wait() == 5, "variadic rpc_async");
  TORCHPAR_RCHECK(g.remote<int>(next, "add", 3, 4).to_here() == 7, "variadic remote");
  TORCHPAR_RCHECK(g.rpc_sync<int>(next, "pid") > 0, "rpc_sync without arguments");
  TORCHPAR_RCHECK(g.rpc_async<int>(next, "pid").wait() == g.remote<int>(next, "pid").to_here(),
                  "rpc_async and remote without arguments");
  expect_throw<tp::RpcRemoteError>([&] { g.rpc_sync<int>(next, "throw", "a literal"); },
                                   "a string literal argument reaches a std::string parameter");

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
    TORCHPAR_RCHECK(g.registered_sync<int>("counter") == 24, "registered_sync, no arguments");
    TORCHPAR_RCHECK(g.registered_async<int>("counter").wait() == 25, "registered_async, none");
    TORCHPAR_RCHECK(g.registered_remote<int>("counter").to_here() == 26, "registered_remote");
  }
  g.barrier();
  if (rank == 0) {
    std::lock_guard<std::mutex> lk(mu);
    TORCHPAR_RCHECK(counter == 26, "the owner sees {} after six calls, want 26", counter);
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

// TORCHPAR_RPC_SHM=0: members of one host talk over the TCP transport only; a value other
// than 0 or 1 is a ValueError naming the variable.
void no_shm_rank(int rank, int port) {
  ::setenv("TORCHPAR_RPC_SHM", "x", 1);
  auto w = make_world(rank, 2, port);
  auto e = expect_throw<tp::ValueError>(
      [&] {
        w.create_rpc_group("bad", {"0", "1"});
      },
      "TORCHPAR_RPC_SHM=x");
  TORCHPAR_RCHECK(std::string(e.what()).find("TORCHPAR_RPC_SHM") != std::string::npos,
                  "the error names TORCHPAR_RPC_SHM: {}", e.what());
  ::setenv("TORCHPAR_RPC_SHM", "0", 1);
  auto g = w.create_rpc_group("bad", {"0", "1"});  // the refused name is free again
  const std::string other = rank == 0 ? "1" : "0";
  for (int i = 0; i < 20; ++i) {
    TORCHPAR_RCHECK(g.rpc_sync<int>(other, "add", std::tuple{i, 1}) == i + 1, "rpc_sync {}", i);
  }
  g.barrier();
  g.destroy();
}

TEST(RpcGroup, ShmCanBeTurnedOff) { expect_ok(run_ranks(2, 120, &no_shm_rank, free_port())); }

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

// ---- calls that wait on the callee ---------------------------------------------------------

// A call that waits for a later call of the same caller ("gate_wait" until "gate_open"), and
// one that calls its caller back ("call_back"): over TCP a call runs on its connection's
// reader, which must then hand the connection to another reader (after 10 ms, or at once
// when the call waits on an RPC future) so the later call and the nested reply are read.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
};
Gate& gate() {
  static Gate g;
  return g;
}
const bool kGateWait = tp::register_function(
    "gate_wait", +[]() {
      std::unique_lock<std::mutex> lock(gate().mu);
      return gate().cv.wait_for(lock, std::chrono::seconds(30), [] { return gate().open; }) ? 1 : 0;
    });
const bool kGateOpen = tp::register_function(
    "gate_open", +[]() {
      std::lock_guard<std::mutex> lock(gate().mu);
      gate().open = true;
      gate().cv.notify_all();
      return 1;
    });
tp::RpcGroup* g_back = nullptr;  // the callee's group, for call_back
const bool kCallBack = tp::register_function(
    "call_back", +[](int a, int b) {
      return g_back->rpc_sync<int>("0", "add", std::tuple{a, b});
    });

void waiting_calls_rank(int rank, int port) {
  auto w = make_world(rank, 2, port);
  auto g = w.create_rpc_group("waiting", {"0", "1"});
  g_back = &g;
  g.barrier();
  if (rank == 0) {
    using Clock = std::chrono::steady_clock;
    const auto t0 = Clock::now();
    auto blocked = g.rpc_async<int>("1", "gate_wait", std::tuple{}, 30s);
    TORCHPAR_RCHECK(g.rpc_sync<int>("1", "gate_open", std::tuple{}, 30s) == 1, "gate_open");
    TORCHPAR_RCHECK(blocked.wait() == 1, "gate_wait was not released");
    const double gated = std::chrono::duration<double>(Clock::now() - t0).count();
    TORCHPAR_RCHECK(gated < 5, "a call behind a waiting one took {} s", gated);
    const auto t1 = Clock::now();
    for (int i = 0; i < 20; ++i) {
      TORCHPAR_RCHECK(g.rpc_sync<int>("1", "call_back", std::tuple{i, 1}, 30s) == i + 1,
                      "call_back {}", i);
    }
    const double nested = std::chrono::duration<double>(Clock::now() - t1).count();
    TORCHPAR_RCHECK(nested < 5, "20 nested calls took {} s", nested);
  }
  g.barrier();
  g.destroy();
}

TEST(RpcGroup, CallsThatWaitKeepTheirConnectionRead) {
  expect_ok(run_ranks(2, 120, &waiting_calls_rank, free_port()));
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

/// The state letter of process `pid` in /proc/<pid>/stat ('T' stopped, 'Z' a zombie), or 0
/// when it has no entry (reaped).
char process_state(int pid) {
  std::ifstream f(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  if (!std::getline(f, stat)) return 0;
  const auto paren = stat.rfind(") ");
  return paren == std::string::npos || paren + 2 >= stat.size() ? 0 : stat[paren + 2];
}

/// Waits (polling, at most 10 s) until process_state(pid) is one of `states`.
bool wait_state(int pid, std::string_view states) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (states.find(process_state(pid)) == std::string_view::npos) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// Issue 36: the first call to a member that died used to fail with the transport's word alone
// ("... failed: eof" over TensorPipe, "the peer closed the connection" over TCP) while later
// calls named a refused connect: every call names the member and says it is gone.
void dead_member_rank(int rank, int port, bool shm) {
  ::setenv("TORCHPAR_RPC_SHM", shm ? "1" : "0", 1);
  auto w = make_world(rank, 2, port);
  auto g = w.create_rpc_group("dead", {"0", "1"});
  if (rank == 1) {
    std::this_thread::sleep_for(60s);  // killed by rank 0 long before
    return;
  }
  const int pid = g.rpc_sync<int>("1", "pid", std::tuple{});  // connected to it
  TORCHPAR_RCHECK(::kill(pid, SIGKILL) == 0, "kill");
  TORCHPAR_RCHECK(wait_state(pid, std::string_view("Z\0", 2)), "member 1 did not die");
  for (const char* which : {"the first call", "a later call"}) {
    const auto e = expect_throw<tp::RpcPeerLostError>(
        [&] {
          g.rpc_sync<int>("1", "add", std::tuple{1, 2}, 10s);
        },
        which);
    const std::string what = e.what_without_backtrace();
    TORCHPAR_RCHECK(e.member() == "1", "{} names member '{}'", which, e.member());
    TORCHPAR_RCHECK(what.find("to member '1' failed: member '1' is gone (") != std::string::npos,
                    "{}: {}", which, what);
  }
  ::_exit(0);  // the World's store lives here but its other member is dead: no teardown
}

TEST(RpcGroup, CallsToADeadMemberSayItIsGone) {
  for (bool shm : {false, true}) {
    auto res = run_ranks(2, 120, &dead_member_rank, free_port(), shm);
    EXPECT_EQ(res[0].exitcode, 0) << (shm ? "shm: " : "tcp: ") << res[0].error;
    EXPECT_EQ(res[1].exitcode, -SIGKILL) << res[1].error;
  }
}

// Issue 36: with the callee stopped (SIGSTOP), sends used to run on the caller's thread: once
// the socket buffers were full, each rpc_async() blocked until its deadline and each RRef drop
// for 5 s. Now both return at once, the calls fail with TimeoutError at their deadline (not
// RpcPeerLostError: the member is not gone), and once the callee runs again the same
// connection carries the next call and the RRef deletes.
void stopped_callee_rank(int rank, int port) {
  auto w = make_world(rank, 2, port);
  auto g = w.create_rpc_group("stopped", {"0", "1"});
  if (rank == 0) {
    const int pid = g.rpc_sync<int>("1", "pid", std::tuple{});
    std::vector<tp::RRef<int>> rrefs;
    for (int i = 0; i < 8; ++i) rrefs.push_back(g.remote<int>("1", "add", std::tuple{i, 0}));
    for (auto& r : rrefs) (void)r.to_here();  // the owner holds all 8
    {
      struct Resume {  // however this block ends, member 1 runs again
        int pid;
        ~Resume() { ::kill(pid, SIGCONT); }
      } resume{pid};
      TORCHPAR_RCHECK(::kill(pid, SIGSTOP) == 0, "SIGSTOP");
      TORCHPAR_RCHECK(wait_state(pid, "T"), "member 1 did not stop");
      using Clock = std::chrono::steady_clock;
      auto since = [](Clock::time_point t0) {
        return std::chrono::duration<double>(Clock::now() - t0).count();
      };
      // 16 calls with 4 MiB each: the socket buffers (a few MiB) fill after a few.
      const auto arg = at::ones({1 << 20});
      std::vector<std::pair<tp::RpcFuture<at::Tensor>, Clock::time_point>> calls;
      for (int i = 0; i < 16; ++i) {
        const auto t0 = Clock::now();
        calls.emplace_back(g.rpc_async<at::Tensor>("1", "scale", std::tuple{arg, 2.0}, 2s), t0);
        TORCHPAR_RCHECK(since(t0) < 0.5, "rpc_async {} to a stopped member took {} s", i,
                        since(t0));
      }
      for (int i = 0; i < 8; ++i) {
        const auto t0 = Clock::now();
        rrefs.pop_back();  // sends the owner a delete
        TORCHPAR_RCHECK(since(t0) < 0.5, "dropping RRef {} took {} s", i, since(t0));
      }
      for (size_t i = 0; i < calls.size(); ++i) {
        expect_throw<tp::TimeoutError>([&] { (void)calls[i].first.wait(); },
                                       "a call to a stopped member");
        const double took = since(calls[i].second);
        TORCHPAR_RCHECK(took > 1.9 && took < 4, "call {} failed after {} s, its timeout is 2 s", i,
                        took);
      }
    }
    // Running again: the connection was kept, and carries the next call.
    TORCHPAR_RCHECK(g.rpc_sync<int>("1", "add", std::tuple{1, 2}, 30s) == 3,
                    "a call after SIGCONT");
  }
  g.barrier();
  if (rank == 1) {
    // The deletes waited in the queue and arrived once this member ran again.
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (g.debug_info().owned_rrefs > 0 && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(10ms);
    TORCHPAR_RCHECK(g.debug_info().owned_rrefs == 0, "the owner still holds {} RRef values",
                    g.debug_info().owned_rrefs);
  }
  g.barrier();
  g.destroy();
}

TEST(RpcGroup, AStoppedCalleeBlocksNoCaller) {
  expect_ok(run_ranks(2, 120, &stopped_callee_rank, free_port()));
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
  auto& dg = w.default_group();
  if (rank == 0) {
    auto slow = g.rpc_async<int>("1", "held", std::tuple{}, 30s);
    dg.barrier();  // rank 1 runs the call now
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
    dg.barrier();  // rank 0's checks are done: rank 1 may let the call end
  } else {
    TORCHPAR_RCHECK(held().wait_for(&Held::started), "rank 0's call did not start in 30 s");
    dg.barrier();
    dg.barrier();
    held().set(&Held::released);
    TORCHPAR_RCHECK(held().wait_for(&Held::ended), "the held call did not end");
  }
  // Both wait for rank 1's call to end before the World goes.
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

// ---- the job's key -------------------------------------------------------------------------

constexpr const char* kKeyAdvice =
    "set WorldOptions::authkey or TORCHPAR_AUTHKEY (hex), as `torchpar run` does";
/// Far above what refusing takes: a member that waits for it has hung.
constexpr auto kJoinTimeout = 90s;
constexpr double kRefusalBound = 30;  // seconds

/// A FileStore path of its own for one test (run_on_file_store removes it before and after).
std::string store_path(const char* test) {
  return fmt::format("/tmp/torchpar_rpc_{}_{}", test, ::getpid());
}

/// Runs fn(rank, path, args...) as `n` ranks on a fresh FileStore path.
template <class Fn, class... Args>
std::vector<tp::testing::RankResult> run_on_file_store(const char* test, int n, Fn fn,
                                                       Args... args) {
  const std::string path = store_path(test);
  ::unlink(path.c_str());
  auto res = run_ranks(n, 120, fn, path, args...);
  ::unlink(path.c_str());
  return res;
}

/// Rank `rank` of a `world`-rank World on the FileStore `path`: the store needs no key, so
/// each rank's RPC key is whatever `key` and its environment say.
tp::World file_world(int rank, int world, const std::string& path, tp::AuthKey key = {}) {
  return tp::World(tp::WorldOptions{.name = std::to_string(rank),
                                    .rank = rank,
                                    .world_size = world,
                                    .init_method = "file://" + path,
                                    .timeout = 60s,
                                    .authkey = std::move(key)});
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// create_rpc_group(name, members) must throw a ValueError containing `want` well before
/// kJoinTimeout; returns its message.
std::string expect_refused(tp::World& w, const std::string& name,
                           const std::vector<std::string>& members, const std::string& want) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto e = expect_throw<tp::ValueError>(
      [&] { w.create_rpc_group(name, members, tp::RpcGroupOptions{.timeout = kJoinTimeout}); },
      "create_rpc_group");
  const std::string what = e.what();
  TORCHPAR_RCHECK(what.find(want) != std::string::npos, "the error lacks \"{}\": {}", want, what);
  const double took = seconds_since(t0);
  TORCHPAR_RCHECK(took < kRefusalBound, "refusing took {} s (group timeout {} s)", took,
                  kJoinTimeout.count());
  return what;
}

void no_key_rank(int rank, std::string path, std::string key_hex) {
  ::unsetenv("TORCHPAR_AUTHKEY");  // no key from the launcher, none in WorldOptions
  auto w = file_world(rank, 3, path);
  const int threads = thread_count();
  expect_refused(w, "nokey", {"0", "1", "2"}, kKeyAdvice);
  TORCHPAR_RCHECK(thread_count() == threads, "the refused group started threads ({} -> {})",
                  threads, thread_count());
  // Given the key, the same World starts RPC.
  ::setenv("TORCHPAR_AUTHKEY", key_hex.c_str(), 1);
  auto g = w.create_rpc_group("withkey", {"0", "1", "2"});
  TORCHPAR_RCHECK(g.rpc_sync<int>(std::to_string((rank + 1) % 3), "add", std::tuple{1, 2}) == 3,
                  "rpc_sync once the key is set");
  g.barrier();
  g.destroy();
}

TEST(RpcGroupKey, NoKeyIsAValueErrorOnEveryMemberAtOnce) {
  const std::string key = tp::to_hex(tp::random_authkey());
  expect_ok(run_on_file_store("nokey", 3, &no_key_rank, key));
}

void one_without_key_rank(int rank, std::string path, std::string key_hex) {
  ::unsetenv("TORCHPAR_AUTHKEY");
  // Ranks 0 and 1 have the key; rank 2 was started without one.
  auto w = file_world(rank, 3, path, rank == 2 ? tp::AuthKey{} : tp::from_hex(key_hex));
  const std::string what = expect_refused(w, "partial", {"0", "1", "2"}, kKeyAdvice);
  if (rank != 2) {
    TORCHPAR_RCHECK(what.find("member '2'") != std::string::npos,
                    "the error does not name the member without a key: {}", what);
  }
}

TEST(RpcGroupKey, AMemberWithoutTheKeyFailsTheOthersAtOnce) {
  const std::string key = tp::to_hex(tp::random_authkey());
  expect_ok(run_on_file_store("partial", 3, &one_without_key_rank, key));
}

void malformed_key_rank(int rank, std::string path) {
  // Set, but not a key: empty on rank 0, not hex on rank 1. Never the key file instead.
  ::setenv("TORCHPAR_AUTHKEY", rank == 0 ? "" : "00fg", 1);
  auto w = file_world(rank, 2, path);
  const std::string what = expect_refused(w, "malformed", {"0", "1"}, "TORCHPAR_AUTHKEY");
  TORCHPAR_RCHECK(what.find(rank == 0 ? "empty" : "not a hex digit") != std::string::npos,
                  "the error does not say what is wrong: {}", what);
  TORCHPAR_RCHECK(what.find(kKeyAdvice) != std::string::npos, "no advice: {}", what);
}

TEST(RpcGroupKey, MalformedKeyInTheEnvironmentIsAValueError) {
  expect_ok(run_on_file_store("malformed", 2, &malformed_key_rank));
}

void other_key_rank(int rank, std::string path) {
  // Each rank its own key: the group forms (through the FileStore), but no connection does.
  auto w = file_world(rank, 2, path, tp::random_authkey());
  auto g = w.create_rpc_group("otherkey", {"0", "1"});
  const std::string other = rank == 0 ? "1" : "0";
  // "die" SIGKILLs whoever runs it: a rank that executed the other's call exits -9.
  expect_throw<tp::AuthenticationError>([&] { g.rpc_sync<int>(other, "die", std::tuple{}, 20s); },
                                        "a call to a member with another key");
  expect_throw<tp::AuthenticationError>(
      [&] { g.rpc_async<int>(other, "die", std::tuple{}, 20s).wait(); },
      "a second call to a member with another key");
  g.barrier(60s);  // both tried before either leaves
  g.destroy();
}

TEST(RpcGroupKey, AMemberWithAnotherKeyIsRefusedAndNothingItSentRuns) {
  expect_ok(run_on_file_store("otherkey", 2, &other_key_rank));
}

}  // namespace

int main(int argc, char** argv) {
  // TCP between the members of every test but MachinWorldCases, which keeps the default
  // (TensorPipe's shm transport between members of a host; rpc_transport_test tests it on
  // its own): its reactor thread polls without sleeping, about 0.8 of a core per member for
  // as long as a member lives (23 CPU-s for this binary against 5.5 with TCP).
  ::setenv("TORCHPAR_RPC_SHM", "0", 0);
  return tp::testing::rpc_test_main(argc, argv);
}
