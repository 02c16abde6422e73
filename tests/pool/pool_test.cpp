// Process Pool: results and order, chunksize, async callbacks, task errors, timeouts,
// close/join, terminate, maxtasksperchild, initializer, tensors shared vs copied, and a
// worker killed mid-map (WorkerLostError for its chunk, then the pool goes on).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <map>
#include <set>
#include <thread>

#include "support/child.h"
#include "support/run_tests.h"
#include "support/start_methods.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

int square(int x) { return x * x; }
int my_pid(int) { return static_cast<int>(::getpid()); }
int add(int a, int b) { return a + b; }
int fail_on_three(int x) {
  if (x == 3) throw std::domain_error("three is not allowed");
  return x;
}
int sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
// Marks started[0] (a shared tensor), then sleeps `ms`: the parent sees the task running.
int mark_then_sleep(at::Tensor started, int ms) {
  std::atomic_ref<int32_t>(*started.data_ptr<int32_t>()).store(1);
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
int die_on_five(int x) {
  if (x == 5) ::raise(SIGKILL);
  return x;
}
int write_tensor(at::Tensor t) {
  t.fill_(9);
  return static_cast<int>(t.numel());
}
struct WorkerCtx {
  std::string name;
  int64_t calls = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, calls);
  }
};
std::string ctx_name(WorkerCtx& c, int) {
  ++c.calls;  // state stays with the worker between tasks
  return c.name + ":" + std::to_string(c.calls);
}

std::string ctx_sum(WorkerCtx& c, int a, int b) { return c.name + ":" + std::to_string(a + b); }
size_t string_size(std::string s) { return s.size(); }
int ctx_plus(int& ctx, int x) { return ctx * 100 + x; }

bool pid_running(int pid) {
  const char state = tp::testing::proc_state(pid);
  return state != '?' && state != 'Z' && state != 'X';
}

template <class T>
T await(std::future<T>& f) {
  EXPECT_EQ(f.wait_for(std::chrono::seconds(30)), std::future_status::ready) << "no callback";
  return f.get();
}

void failing_init(int) { throw std::runtime_error("initializer failed"); }

void count_init(at::Tensor counter) {
  std::atomic_ref<int64_t>(*counter.data_ptr<int64_t>()).fetch_add(1);
}

}  // namespace

class PoolTest : public tp::testing::StartMethodTest {};

TEST_P(PoolTest, MapImapStarmapApply) {
  tp::Pool pool(options());
  std::vector<int> items(50);
  for (int i = 0; i < 50; ++i) items[i] = i;
  for (size_t chunk : {size_t{0}, size_t{1}, size_t{1000}}) {
    auto out = pool.map(square, items, chunk);
    ASSERT_EQ(out.size(), 50u);
    for (int i = 0; i < 50; ++i) EXPECT_EQ(out[i], i * i);
  }
  auto it = pool.imap(square, items, 3);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(it.next(30s), i * i);
  EXPECT_FALSE(it.next(5s).has_value());
  std::set<int> un;
  auto u = pool.imap_unordered(square, items, 2);
  while (auto v = u.next(30s)) un.insert(*v);
  EXPECT_EQ(un.size(), 50u);
  EXPECT_EQ(pool.starmap(add, std::vector<std::tuple<int, int>>{{1, 2}, {3, 4}}),
            (std::vector<int>{3, 7}));
  EXPECT_EQ(pool.apply(add, std::make_tuple(20, 22)), 42);
  EXPECT_EQ(pool.apply([](int x) { return x + 1; }, std::make_tuple(1)), 2) << "captureless lambda";
  EXPECT_TRUE(pool.map(square, std::vector<int>{}).empty());
}

// A chunk travels as one payload and comes back as one: an error in the middle of a chunk
// fails that chunk with the task's own exception, the other chunks still arrive, results can
// be got twice, void functions and tensors shared within one chunk work.
TEST_P(PoolTest, ChunksTravelWhole) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  tp::Pool pool(options());
  std::vector<int> items(12);
  for (int i = 0; i < 12; ++i) items[i] = i;
  auto it = pool.imap(fail_on_three, items, 5);  // chunks {0..4} {5..9} {10, 11}
  try {
    (void)it.next(30s);
    FAIL() << "the chunk holding 3 did not fail";
  } catch (const tp::TaskError& e) {
    EXPECT_NE(e.type().find("domain_error"), std::string::npos) << e.type();
    EXPECT_EQ(e.message(), "three is not allowed");
  }
  for (int i = 5; i < 12; ++i) EXPECT_EQ(it.next(30s), i);
  EXPECT_FALSE(it.next(5s).has_value());

  auto r = pool.map_async(square, items, 4);
  const auto first = r.get(30s);
  EXPECT_EQ(first, r.get(30s)) << "a result can be got twice";
  EXPECT_EQ(first[11], 121);

  auto v = pool.map([](int) {}, items, 5);
  EXPECT_EQ(v, std::vector<bool>(12, true));

  auto t = at::zeros({8});
  EXPECT_EQ(pool.map(write_tensor, std::vector<at::Tensor>{t, t, t}, 3),
            (std::vector<int>{8, 8, 8}));
  EXPECT_TRUE(at::equal(t, at::full({8}, 9.0))) << "shared tensor written by the worker";
}

TEST_P(PoolTest, ErrorsTimeoutsAndCallbacks) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  tp::Pool pool(options());
  try {
    pool.map(fail_on_three, std::vector<int>{1, 2, 3, 4}, 1);
    FAIL();
  } catch (const tp::TaskError& e) {
    EXPECT_NE(e.type().find("domain_error"), std::string::npos) << e.type();
    EXPECT_EQ(e.message(), "three is not allowed");
  }
  std::atomic<int> got{0};
  std::atomic<bool> errored{false};
  auto r = pool.apply_async(square, std::make_tuple(7), [&](const int& v) { got = v; });
  auto bad = pool.apply_async(fail_on_three, std::make_tuple(3), {},
                              [&](std::exception_ptr) { errored = true; });
  EXPECT_EQ(r.get(30s), 49);
  EXPECT_THROW(bad.get(30s), tp::TaskError);
  // The callbacks run on the manager thread, maybe just after get() returned: up to 30 s.
  for (int i = 0; i < 6000 && (got == 0 || !errored); ++i) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(got, 49);
  EXPECT_TRUE(errored);
  auto slow = pool.apply_async(sleep_ms, std::make_tuple(500));
  EXPECT_THROW(slow.get(0.05s), tp::TimeoutError);
  EXPECT_EQ(slow.get(30s), 500);
}

// A function whose module the workers do not have (dlopen()ed by the parent once they
// ran): resolving it fails in the worker, and that fails the tasks with TaskError naming
// the module, not the worker; the pool goes on.
TEST_P(PoolTest, FunctionFromAModuleTheWorkersLackFailsItsTasks) {
  tp::Pool pool(options());
  EXPECT_EQ(pool.map(square, std::vector<int>{1, 2, 3, 4}, 1)[3], 16);  // workers are up
  const auto pids = pool.pids();
  void* module = ::dlopen(TORCHPAR_LATE_MODULE, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(module, nullptr) << ::dlerror();
  auto* late_triple = reinterpret_cast<int (*)(int)>(::dlsym(module, "late_triple"));
  ASSERT_NE(late_triple, nullptr) << ::dlerror();
  try {
    pool.map(late_triple, std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8}, 1);
    ADD_FAILURE() << "a function the workers cannot resolve returned";
  } catch (const tp::TaskError& e) {
    EXPECT_NE(e.message().find("late_module"), std::string::npos) << e.message();
  }
  EXPECT_THROW(pool.apply(late_triple, std::make_tuple(2)), tp::TaskError);
  EXPECT_EQ(pool.map(square, std::vector<int>{5, 6}, 1)[1], 36) << "the pool goes on";
  EXPECT_EQ(pool.pids(), pids) << "no worker died";
}

TEST_P(PoolTest, WorkerKilledMidMapFailsItsChunkThenPoolGoesOn) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  tp::Pool pool(options());
  std::vector<int> items(10);
  for (int i = 0; i < 10; ++i) items[i] = i;
  try {
    pool.map(die_on_five, items, 1);
    FAIL();
  } catch (const tp::WorkerLostError& e) {
    EXPECT_EQ(e.exit_code(), -SIGKILL);
    EXPECT_NE(std::string(e.what()).find("SIGKILL"), std::string::npos) << e.what();
  }
  auto out = pool.map(square, items, 2);  // a fresh map on the repaired pool
  EXPECT_EQ(out[9], 81);
  for (int pid : pool.pids()) EXPECT_GT(pid, 0);
}

TEST_P(PoolTest, MaxTasksPerChildReplacesWorkers) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  auto o = options(1);
  o.maxtasksperchild = 2;
  tp::Pool pool(o);
  auto pids = pool.map(my_pid, std::vector<int>(6, 0), 1);
  EXPECT_EQ(std::set<int>(pids.begin(), pids.end()).size(), 3u) << "one worker per two tasks";
}

// Chunks reach a worker in batches, yet never past its budget: each process runs at most
// maxtasksperchild chunks of a long map at chunksize 1.
TEST_P(PoolTest, MaxTasksPerChildHoldsWithBatches) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  auto o = options(2);
  o.maxtasksperchild = 25;
  tp::Pool pool(o);
  const auto pids = pool.map(my_pid, std::vector<int>(100, 0), 1);
  ASSERT_EQ(pids.size(), 100u);
  std::map<int, int> runs;
  for (int pid : pids) ++runs[pid];
  for (auto [pid, n] : runs) EXPECT_LE(n, 25) << "worker " << pid;
  EXPECT_GE(runs.size(), 4u);
}

TEST_P(PoolTest, InitializerRunsOncePerWorker) {
  at::Tensor counter = at::zeros({1}, at::kLong);
  tp::share_memory_(counter);
  auto o = options(2);
  o.init = tp::initializer(count_init, counter);
  tp::Pool pool(o);
  EXPECT_EQ(pool.map(square, std::vector<int>{1, 2, 3}).size(), 3u);
  pool.close();
  EXPECT_TRUE(pool.join(30s));
  EXPECT_EQ(counter.item<int64_t>(), 2);
}

TEST_P(PoolTest, TensorsSharedByDefaultCopiedOnRequest) {
  for (bool copy : {false, true}) {
    auto o = options(1);
    o.copy_tensor = copy;
    tp::Pool pool(o);
    at::Tensor t = at::zeros({4});
    EXPECT_EQ(pool.apply(write_tensor, std::make_tuple(t)), 4);
    EXPECT_EQ(t.sum().item<float>(), copy ? 0.0f : 36.0f) << "copy=" << copy;
  }
}

TEST_P(PoolTest, CloseJoinAndTerminate) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  tp::Pool pool(options());
  auto r = pool.map_async(square, std::vector<int>{1, 2, 3});
  pool.close();
  EXPECT_THROW(pool.apply(square, std::make_tuple(1)), tp::ClosedError);
  EXPECT_TRUE(pool.join(30s));
  EXPECT_EQ(r.get(1s), (std::vector<int>{1, 4, 9}));

  tp::Pool busy(options(1));
  at::Tensor started = at::zeros({1}, at::kInt);
  tp::share_memory_(started);
  auto running = busy.apply_async(mark_then_sleep, std::make_tuple(started, 30000));
  auto queued = busy.map_async(sleep_ms, std::vector<int>{2000, 2000}, 1);
  for (int i = 0; i < 60000 && started.item<int32_t>() == 0; ++i) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(started.item<int32_t>(), 1) << "the task did not start within 60 s";
  const auto t0 = std::chrono::steady_clock::now();
  busy.terminate();
  // Kills the busy worker instead of waiting for its 30 s task (generous on a loaded box).
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  EXPECT_THROW(running.get(5s), tp::ClosedError);
  EXPECT_THROW(queued.get(5s), tp::ClosedError);
}

TEST_P(PoolTest, CtxPoolContextsAreDistinctPerWorker) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  auto o = options(2);
  tp::CtxPool<WorkerCtx> pool({WorkerCtx{"a"}, WorkerCtx{"b"}}, o);
  auto out = pool.map(ctx_name, std::vector<int>(20, 0), 1);
  std::set<std::string> names;
  int64_t max_calls = 0;
  for (auto& s : out) {
    names.insert(s.substr(0, 1));
    max_calls = std::max<int64_t>(max_calls, std::stoll(s.substr(2)));
  }
  EXPECT_EQ(names, (std::set<std::string>{"a", "b"}));
  EXPECT_GE(max_calls, 10) << "a context keeps its state across that worker's tasks";
  EXPECT_EQ(pool.apply(ctx_name, std::make_tuple(0)).size() > 2, true);
}

// machin's own CtxPool test writes `CtxPool(worker_contexts=[0, 1], ...)`: in C++ `{0, 1}` with
// options in braces (before: ambiguous with a private constructor taking a shared_ptr, whose
// (nullptr_t, deleter) form `{0, 1}` also matched; it did not compile).
TEST_P(PoolTest, CtxPoolOfIntsFromABracedList) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  tp::CtxPool<int> pool({0, 1}, {.processes = 2, .start_method = options().start_method});
  std::set<int> contexts;
  for (int r : pool.map(ctx_plus, std::vector<int>(16, 7), 1)) {
    EXPECT_EQ(r % 100, 7);
    contexts.insert(r / 100);
  }
  EXPECT_TRUE(contexts.count(0) || contexts.count(1));
  for (int c : contexts) EXPECT_TRUE(c == 0 || c == 1) << c;
  pool.close();
  EXPECT_TRUE(pool.join(30s));
}

// Issue 37: a bad argument is a torchpar::ValueError everywhere (before, these were LibTorch's
// TORCH_CHECK c10::Error, which `catch (const tp::ValueError&)` missed).
TEST(ArgumentErrors, AreValueErrors) {
  EXPECT_THROW(tp::CtxPool<int>(std::vector<int>{}, {.processes = 1}), tp::ValueError);
  EXPECT_THROW(tp::CtxPool<int>({0, 1}, {.processes = 3}), tp::ValueError);
  EXPECT_THROW(tp::start_processes(
                   +[](int) {}, std::tuple<>{}, 0),
               tp::ValueError);
  EXPECT_THROW(tp::Barrier(0), tp::ValueError);
  EXPECT_THROW(tp::Queue<int>(0, {.capacity_bytes = 100}), tp::ValueError);
  tp::ListenerOptions no_backlog;
  no_backlog.backlog = 0;
  EXPECT_THROW(tp::Listener("", no_backlog), tp::ValueError);
}

// CtxPool has every Pool call, each passing the worker's context (before: imap, starmap and
// their relatives were Pool's, calling fn without the context; they did not compile).
TEST_P(PoolTest, CtxPoolHasThePoolSurfaceWithItsContext) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  tp::CtxPool<WorkerCtx> pool({WorkerCtx{"a"}, WorkerCtx{"b"}}, options(2));
  const std::vector<int> items(6, 0);
  auto starts_with_context = [](const std::string& s) {
    return s.rfind("a:", 0) == 0 || s.rfind("b:", 0) == 0;
  };
  auto it = pool.imap(ctx_name, items, 2);
  for (size_t i = 0; i < items.size(); ++i) EXPECT_TRUE(starts_with_context(*it.next(30s)));
  EXPECT_FALSE(it.next(5s).has_value());
  auto un = pool.imap_unordered(ctx_name, items);
  for (size_t i = 0; i < items.size(); ++i) EXPECT_TRUE(starts_with_context(*un.next(30s)));
  const std::vector<std::tuple<int, int>> pairs{{1, 2}, {3, 4}};
  for (auto& s : pool.starmap(ctx_sum, pairs)) EXPECT_TRUE(starts_with_context(s)) << s;
  EXPECT_EQ(pool.starmap(ctx_sum, pairs)[1].substr(2), "7");

  std::promise<std::vector<std::string>> star_got, map_got;
  std::promise<std::string> apply_got;
  auto sr = pool.starmap_async(ctx_sum, pairs, 1,
                               [&](const std::vector<std::string>& v) { star_got.set_value(v); });
  auto mr = pool.map_async(ctx_name, items, 0,
                           [&](const std::vector<std::string>& v) { map_got.set_value(v); });
  auto ar = pool.apply_async(ctx_sum, std::make_tuple(20, 22),
                             [&](const std::string& v) { apply_got.set_value(v); });
  auto star_f = star_got.get_future();
  auto map_f = map_got.get_future();
  auto apply_f = apply_got.get_future();
  EXPECT_EQ(await(star_f).size(), 2u);
  EXPECT_EQ(await(map_f).size(), items.size());
  EXPECT_EQ(await(apply_f).substr(2), "42");
  EXPECT_EQ(sr.get(30s).size(), 2u);
  EXPECT_EQ(mr.get(30s).size(), items.size());
  EXPECT_TRUE(starts_with_context(ar.get(30s)));
  EXPECT_EQ(pool.size(), 2u);
  pool.close();
  EXPECT_TRUE(pool.join(30s));
}

// map_async and starmap_async take callback and error_callback, as apply_async does.
TEST_P(PoolTest, MapAsyncAndStarmapAsyncCallbacks) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  tp::Pool pool(options());
  std::promise<std::vector<int>> mapped, starred;
  std::promise<std::string> map_error, star_error;
  auto m = pool.map_async(square, std::vector<int>{1, 2, 3}, 0,
                          [&](const std::vector<int>& v) { mapped.set_value(v); });
  auto s = pool.starmap_async(add, std::vector<std::tuple<int, int>>{{1, 2}, {3, 4}}, 1,
                              [&](const std::vector<int>& v) { starred.set_value(v); });
  auto error_text = [](std::exception_ptr e) {
    try {
      std::rethrow_exception(e);
    } catch (const tp::TaskError& t) {
      return t.message();
    } catch (...) {
      return std::string("not a TaskError");
    }
  };
  auto bad = pool.map_async(
      fail_on_three, std::vector<int>{1, 2, 3}, 1, [&](const std::vector<int>&) {},
      [&](std::exception_ptr e) { map_error.set_value(error_text(e)); });
  auto bad_star = pool.starmap_async(
      [](int a, int) { return fail_on_three(a); }, std::vector<std::tuple<int, int>>{{3, 0}}, 0, {},
      [&](std::exception_ptr e) { star_error.set_value(error_text(e)); });
  auto mf = mapped.get_future();
  auto sf = starred.get_future();
  auto mef = map_error.get_future();
  auto sef = star_error.get_future();
  EXPECT_EQ(await(mf), (std::vector<int>{1, 4, 9}));
  EXPECT_EQ(await(sf), (std::vector<int>{3, 7}));
  EXPECT_EQ(await(mef), "three is not allowed");
  EXPECT_EQ(await(sef), "three is not allowed");
  EXPECT_EQ(m.get(30s).size(), 3u);
  EXPECT_EQ(s.get(30s).size(), 2u);
  EXPECT_THROW(bad.get(30s), tp::TaskError);
  EXPECT_THROW(bad_star.get(30s), tp::TaskError);
}

// 8 items of 300 KiB with 2 workers: each task travels outside the queue rings (spilled).
// Before, a failing dispatch put left the chunk outstanding and the manager thread ended in
// std::terminate (the test binary aborted). Now the map either works or get() raises the
// put's error, and the pool stays usable.
TEST_P(PoolTest, LargeTasksNeverWedgeThePool) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  tp::Pool pool(options(2));
  const std::vector<std::string> items(8, std::string(300 << 10, 'a'));
  for (int round = 0; round < 6; ++round) {  // the old code aborted within a few rounds
    // Large tasks wait for room in a worker's inbox; with unique spill names they succeed.
    try {
      EXPECT_EQ(pool.map_async(string_size, items).get(60s),
                std::vector<size_t>(8, size_t{300} << 10));
    } catch (const tp::TimeoutError&) {
      FAIL() << "the pool wedged";
    } catch (const tp::Error& e) {
      ADD_FAILURE() << "a large map failed: " << e.what();
    }
    EXPECT_EQ(pool.map_async(square, std::vector<int>{1, 2, 3}).get(60s),
              (std::vector<int>{1, 4, 9}))
        << "the pool goes on after a failed dispatch";
  }
}

// Workers started by a thread that then ends stay alive (PR_SET_PDEATHSIG follows the
// forking thread; before, they were killed when it ended and replaced).
TEST_P(PoolTest, PoolMadeInAThreadThatEndsKeepsItsWorkers) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  std::unique_ptr<tp::Pool> pool;
  std::thread([&] { pool = std::make_unique<tp::Pool>(options(2)); }).join();
  const auto before = pool->pids();
  EXPECT_EQ(pool->map(square, std::vector<int>{1, 2, 3, 4}, 1), (std::vector<int>{1, 4, 9, 16}));
  for (int pid : before) EXPECT_TRUE(pid_running(pid)) << "worker " << pid << " was killed";
  EXPECT_EQ(pool->pids(), before);
}

TEST_P(PoolTest, FailingInitializerFailsTasksInsteadOfHanging) {
  auto o = options(1);
  o.init = tp::initializer(failing_init, 0);
  tp::Pool pool(o);
  auto r = pool.apply_async(square, std::make_tuple(2));
  EXPECT_THROW(r.get(60s), tp::WorkerLostError);
}

TEST_P(PoolTest, P2PPoolGivesPoolResults) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  std::vector<int> items{3, 1, 4, 1, 5, 9, 2, 6};
  tp::P2PPool p2p(options());
  tp::Pool pool(options());
  EXPECT_EQ(p2p.map(square, items, 1), pool.map(square, items, 3));
}

TORCHPAR_INSTANTIATE_FOR_START_METHODS(PoolTest);

int main(int argc, char** argv) {
  torchpar::init(argc, argv);
  return torchpar::testing::run_tests(argc, argv);
}
