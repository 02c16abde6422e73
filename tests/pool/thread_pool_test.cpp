// ThreadPool: results and order, chunksize, async callbacks, errors, timeouts, close/join,
// terminate, empty input, capturing lambdas.
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <map>
#include <set>
#include <thread>

#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

TEST(ThreadPool, MapImapStarmapInOrder) {
  tp::ThreadPool pool(3);
  std::vector<int> items(100);
  for (int i = 0; i < 100; ++i) items[i] = i;
  for (size_t chunk : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}}) {
    auto out = pool.map([](int x) { return x * x; }, items, chunk);
    ASSERT_EQ(out.size(), 100u);
    for (int i = 0; i < 100; ++i) EXPECT_EQ(out[i], i * i);
  }
  auto it = pool.imap([](int x) { return x + 1; }, items, 4);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(it.next(10s), i + 1);
  EXPECT_FALSE(it.next(1s).has_value());
  auto un = pool.imap_unordered([](int x) { return x; }, items, 3);
  std::set<int> seen;
  while (auto v = un.next(10s)) seen.insert(*v);
  EXPECT_EQ(seen.size(), 100u);
  std::vector<std::tuple<int, int>> pairs{{1, 2}, {3, 4}};
  EXPECT_EQ(pool.starmap([](int a, int b) { return a * b; }, pairs), (std::vector<int>{2, 12}));
  EXPECT_TRUE(pool.map([](int x) { return x; }, std::vector<int>{}).empty());
}

TEST(ThreadPool, ApplyAsyncCallbacksAndErrors) {
  tp::ThreadPool pool(2);
  int base = 40;  // a capture: ThreadPool takes any callable
  std::promise<int> called;
  auto r = pool.apply_async([base](int x) { return base + x; }, std::make_tuple(2),
                            [&](const int& v) { called.set_value(v); });
  EXPECT_EQ(r.get(10s), 42);
  EXPECT_TRUE(r.ready());
  EXPECT_TRUE(r.successful());
  // The callback runs on the pool thread, maybe just after get() returned.
  auto called_f = called.get_future();
  ASSERT_EQ(called_f.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(called_f.get(), 42);
  std::promise<void> errored;
  auto bad =
      pool.apply_async([](int) -> int { throw std::out_of_range("no such item"); },
                       std::make_tuple(1), {}, [&](std::exception_ptr) { errored.set_value(); });
  EXPECT_THROW(bad.get(10s), std::out_of_range);
  EXPECT_FALSE(bad.successful());
  EXPECT_EQ(errored.get_future().wait_for(30s), std::future_status::ready);
  // A task held until released: get() and wait() time out while it runs, then succeed.
  std::promise<void> release;
  auto released = release.get_future().share();
  auto slow = pool.apply_async(
      [released](int) { return released.wait_for(30s) == std::future_status::ready ? 0 : 1; },
      std::make_tuple(0));
  EXPECT_THROW(slow.get(0.01s), tp::TimeoutError);
  EXPECT_FALSE(slow.wait(0.01s));
  release.set_value();
  EXPECT_EQ(slow.get(10s), 0);
  // An exception in one chunk of imap surfaces at that item; the rest go on.
  auto it = pool.imap(
      [](int x) {
        if (x == 2) throw std::runtime_error("two");
        return x;
      },
      std::vector<int>{0, 1, 2, 3}, 1);
  EXPECT_EQ(it.next(10s), 0);
  EXPECT_EQ(it.next(10s), 1);
  EXPECT_THROW(it.next(10s), std::runtime_error);
  EXPECT_EQ(it.next(10s), 3);
}

// map_async and starmap_async take callback and error_callback, as Pool's do (before:
// ThreadPool's map_async took none and it had no starmap_async).
TEST(ThreadPool, MapAsyncAndStarmapAsyncCallbacks) {
  tp::ThreadPool pool(2);
  std::promise<std::vector<int>> mapped, starred;
  std::promise<void> failed;
  auto m = pool.map_async([](int x) { return x * x; }, std::vector<int>{1, 2, 3}, 0,
                          [&](const std::vector<int>& v) { mapped.set_value(v); });
  auto s = pool.starmap_async([](int a, int b) { return a + b; },
                              std::vector<std::tuple<int, int>>{{1, 2}, {3, 4}}, 1,
                              [&](const std::vector<int>& v) { starred.set_value(v); });
  auto bad = pool.map_async(
      [](int x) {
        if (x == 2) throw std::runtime_error("two");
        return x;
      },
      std::vector<int>{1, 2}, 1, {}, [&](std::exception_ptr) { failed.set_value(); });
  auto mf = mapped.get_future();
  auto sf = starred.get_future();
  auto ff = failed.get_future();
  ASSERT_EQ(mf.wait_for(30s), std::future_status::ready) << "no map callback";
  ASSERT_EQ(sf.wait_for(30s), std::future_status::ready) << "no starmap callback";
  ASSERT_EQ(ff.wait_for(30s), std::future_status::ready) << "no error callback";
  EXPECT_EQ(mf.get(), (std::vector<int>{1, 4, 9}));
  EXPECT_EQ(sf.get(), (std::vector<int>{3, 7}));
  EXPECT_EQ(m.get(10s).size(), 3u);
  EXPECT_EQ(s.get(10s), (std::vector<int>{3, 7}));
  EXPECT_THROW(bad.get(10s), std::runtime_error);
}

TEST(ThreadPool, VoidCallablesAndRepeatedGet) {
  tp::ThreadPool pool(2);
  std::atomic<int> n{0};
  EXPECT_TRUE(pool.apply([&](int k) { n += k; }, std::make_tuple(3)));
  auto r = pool.map_async([&](int k) { n += k; }, std::vector<int>{1, 1});
  EXPECT_EQ(r.get(10s).size(), 2u);
  EXPECT_EQ(r.get(10s).size(), 2u) << "get() twice gives the same results";
  EXPECT_EQ(n, 5);
}

TEST(ThreadPool, CloseJoinTerminate) {
  tp::ThreadPool pool(2);
  auto r = pool.apply_async([](int x) { return x; }, std::make_tuple(5));
  pool.close();
  EXPECT_THROW(pool.apply_async([](int x) { return x; }, std::make_tuple(1)), tp::ClosedError);
  EXPECT_TRUE(pool.join(10s));
  EXPECT_EQ(r.get(1s), 5);

  // One thread: `running` holds it until released, so `queued` is still queued when
  // terminate() drops it; terminate() then waits for `running`.
  tp::ThreadPool busy(1);
  std::promise<void> started, release;
  auto release_f = release.get_future().share();
  auto running = busy.apply_async(
      [&started, release_f](int) {
        started.set_value();
        return release_f.wait_for(30s) == std::future_status::ready ? 1 : 0;
      },
      std::make_tuple(0));
  auto queued = busy.apply_async([](int x) { return x; }, std::make_tuple(2));
  ASSERT_EQ(started.get_future().wait_for(30s), std::future_status::ready);
  auto terminated = std::async(std::launch::async, [&] { busy.terminate(); });
  EXPECT_THROW(queued.get(10s), tp::ClosedError) << "a dropped task fails instead of hanging";
  release.set_value();
  EXPECT_EQ(terminated.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(running.get(10s), 1) << "terminate() lets a running task finish";
}

// machin's CtxThreadPool: thread i calls fn with worker_contexts[i]; a context keeps its state
// across its thread's tasks and is never touched by another thread.
struct Counter {
  int id = 0;
  int calls = 0;
  std::thread::id owner{};
};

TEST(CtxThreadPool, EachThreadHasItsOwnContext) {
  tp::CtxThreadPool<Counter> pool({Counter{1}, Counter{2}, Counter{3}});
  EXPECT_EQ(pool.size(), 3u);
  auto touch = [](Counter& c, int) {
    if (c.owner == std::thread::id{}) c.owner = std::this_thread::get_id();
    EXPECT_EQ(c.owner, std::this_thread::get_id()) << "a context used by a second thread";
    return std::make_pair(c.id, ++c.calls);
  };
  std::vector<int> items(300, 0);
  auto out = pool.map(touch, items, 1);
  ASSERT_EQ(out.size(), items.size());
  std::map<int, int> last_call;
  for (auto [id, calls] : out) last_call[id] = std::max(last_call[id], calls);
  int total = 0;
  for (auto [id, calls] : last_call) {
    EXPECT_GE(id, 1);
    EXPECT_LE(id, 3);
    total += calls;
  }
  EXPECT_EQ(total, 300) << "every task counted once, in its own thread's context";

  auto sum = [](Counter& c, int a, int b) { return c.id * 1000 + a + b; };
  EXPECT_EQ(pool.apply(sum, std::make_tuple(20, 22)) % 1000, 42);
  auto star = pool.starmap(sum, std::vector<std::tuple<int, int>>{{1, 2}, {3, 4}});
  EXPECT_EQ(star[0] % 1000, 3);
  EXPECT_EQ(star[1] % 1000, 7);
  auto it = pool.imap([](Counter& c, int x) { return c.id > 0 ? x : -1; }, std::vector<int>{5, 6});
  EXPECT_EQ(it.next(10s), 5);
  EXPECT_EQ(it.next(10s), 6);
  std::set<int> seen;
  auto un = pool.imap_unordered([](Counter&, int x) { return x; }, std::vector<int>{7, 8, 9});
  while (auto v = un.next(10s)) seen.insert(*v);
  EXPECT_EQ(seen, (std::set<int>{7, 8, 9}));
  std::promise<int> got;
  auto r = pool.apply_async([](Counter&, int x) { return x; }, std::make_tuple(11),
                            [&](const int& v) { got.set_value(v); });
  EXPECT_EQ(r.get(10s), 11);
  EXPECT_EQ(got.get_future().get(), 11);
  pool.close();
  EXPECT_TRUE(pool.join(10s));
  EXPECT_THROW(tp::CtxThreadPool<Counter>(std::vector<Counter>{}), tp::ValueError);
}
