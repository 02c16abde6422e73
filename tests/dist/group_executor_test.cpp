// GroupExecutor (src/dist/group_executor.h), with a backend whose calls are the test's own
// functions: calls never overlap, synchronous calls run on the caller's thread when nothing
// is queued or running, a synchronous call after asynchronous ones from the same thread runs
// after them, threads taking turns keep their order, two threads at once get an error,
// errors reach the caller or the Work, and stop() lets queued calls finish.
#include "dist/group_executor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

/// A backend that is never called: every op of these tests is a function of the test.
class NoBackend : public tp::detail::GroupBackend {
 public:
  NoBackend() : GroupBackend(0, {0}, std::chrono::seconds(10), "test group") {}
  tp::Backend kind() const override { return tp::Backend::kShm; }
  void all_reduce(const at::Tensor&, const tp::detail::ReduceCallOptions&) override { no(); }
  void all_gather(const std::vector<at::Tensor>&, const at::Tensor&,
                  const tp::detail::CallOptions&) override {
    no();
  }
  void broadcast(const at::Tensor&, int, const tp::detail::CallOptions&) override { no(); }
  void reduce(const at::Tensor&, int, const tp::detail::ReduceCallOptions&) override { no(); }
  void gather(const at::Tensor&, const std::vector<at::Tensor>&, int,
              const tp::detail::CallOptions&) override {
    no();
  }
  void scatter(const at::Tensor&, const std::vector<at::Tensor>&, int,
               const tp::detail::CallOptions&) override {
    no();
  }
  void reduce_scatter(const at::Tensor&, const std::vector<at::Tensor>&,
                      const tp::detail::ReduceCallOptions&) override {
    no();
  }
  void all_to_all(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                  const tp::detail::CallOptions&) override {
    no();
  }
  void barrier(const tp::detail::CallOptions&) override { no(); }
  tp::Work isend(const at::Tensor&, int, int) override { no(); }
  tp::Work irecv(const at::Tensor&, std::optional<int>, int) override { no(); }
  void destroy() override {}

 private:
  [[noreturn]] static void no() { throw std::logic_error("NoBackend: not a collective test"); }
};

/// Counts the calls inside at once; records the order they ran in.
struct Recorder {
  std::atomic<int> inside{0};
  std::atomic<int> most_inside{0};
  std::mutex mu;
  std::vector<int> order;
  void run(int id, std::chrono::microseconds busy = 0us) {
    const int now = ++inside;
    int seen = most_inside.load();
    while (now > seen && !most_inside.compare_exchange_weak(seen, now)) {
    }
    if (busy.count() > 0) std::this_thread::sleep_for(busy);
    {
      std::lock_guard<std::mutex> g(mu);
      order.push_back(id);
    }
    --inside;
  }
};

TEST(GroupExecutor, ASynchronousCallRunsInlineOnTheCallersThread) {
  tp::detail::GroupExecutor ex(std::make_shared<NoBackend>());
  std::thread::id ran_on;
  EXPECT_TRUE(
      ex.try_run_inline([&](tp::detail::GroupBackend&) { ran_on = std::this_thread::get_id(); }));
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  // Its error reaches the caller as it is, and the executor goes on.
  EXPECT_THROW(ex.try_run_inline([](tp::detail::GroupBackend&) { throw std::runtime_error("x"); }),
               std::runtime_error);
  EXPECT_TRUE(ex.try_run_inline([](tp::detail::GroupBackend&) {}));
}

TEST(GroupExecutor, AfterAsynchronousCallsASynchronousOneWaitsItsTurn) {
  tp::detail::GroupExecutor ex(std::make_shared<NoBackend>());
  Recorder r;
  std::vector<std::shared_ptr<tp::detail::PromiseWork>> works;
  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  works.push_back(ex.submit([&r, gate](tp::detail::GroupBackend&) {
    gate.wait();  // holds the thread until the check below has run
    r.run(0);
  }));
  for (int i = 1; i < 5; ++i) {
    works.push_back(ex.submit([&r, i](tp::detail::GroupBackend&) { r.run(i, 2ms); }));
  }
  // Queued or running calls: the fast path declines, so the caller submits and waits.
  EXPECT_FALSE(ex.try_run_inline([&](tp::detail::GroupBackend&) { r.run(99); }));
  go.set_value();
  auto last = ex.submit([&r](tp::detail::GroupBackend&) { r.run(5); });
  ASSERT_TRUE(last->wait_until(tp::detail::SteadyClock::now() + 10s));
  for (auto& w : works) EXPECT_TRUE(w->done());
  EXPECT_EQ(r.order, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  // An error travels in its Work: waiting on it raises it.
  auto bad = ex.submit([](tp::detail::GroupBackend&) { throw std::runtime_error("in the work"); });
  EXPECT_THROW(bad->wait_until(tp::detail::SteadyClock::now() + 10s), std::runtime_error);
  EXPECT_TRUE(bad->done());
  // Idle again once the thread has let go of its last call (just after completing its
  // Work): inline.
  bool inline_ran = false;
  const auto until = tp::detail::SteadyClock::now() + 10s;
  while (!inline_ran && tp::detail::SteadyClock::now() < until) {
    inline_ran = ex.try_run_inline([&](tp::detail::GroupBackend&) { r.run(6); });
    if (!inline_ran) std::this_thread::sleep_for(1ms);
  }
  EXPECT_TRUE(inline_ran);
}

TEST(GroupExecutor, ThreadsTakingTurnsNeverOverlapTheExecutorsThreadAndKeepTheirOrder) {
  // The group's contract: one thread at a time, hand-overs under a mutex. Asynchronous calls
  // left running on the executor's thread must finish before any thread's next inline call.
  tp::detail::GroupExecutor ex(std::make_shared<NoBackend>());
  Recorder r;
  std::mutex turn;
  constexpr int kThreads = 4, kCalls = 2000;
  std::atomic<int> inline_runs{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        const int id = t * kCalls + i;
        std::lock_guard<std::mutex> g(turn);
        if (i % 7 == 3) {  // now and then an asynchronous call, not waited for
          (void)ex.submit([&r, id](tp::detail::GroupBackend&) { r.run(id, 20us); });
          continue;
        }
        if (ex.try_run_inline([&](tp::detail::GroupBackend&) { r.run(id); })) {
          ++inline_runs;
        } else {
          auto w = ex.submit([&r, id](tp::detail::GroupBackend&) { r.run(id); });
          ASSERT_TRUE(w->wait_until(tp::detail::SteadyClock::now() + 30s));
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  ex.stop();  // lets the last asynchronous calls finish
  EXPECT_EQ(r.most_inside.load(), 1) << "two calls ran at once";
  EXPECT_GT(inline_runs.load(), 0) << "the fast path never ran: the test shows nothing";
  ASSERT_EQ(r.order.size(), static_cast<size_t>(kThreads * kCalls));
  std::vector<int> next(kThreads, 0);
  for (int id : r.order) {
    const int t = id / kCalls;
    EXPECT_EQ(id % kCalls, next[t]) << "thread " << t << "'s calls ran out of order";
    next[t] = id % kCalls + 1;
  }
}

TEST(GroupExecutor, ASecondThreadCallingDuringAnInlineCallGetsAnErrorNamingTheContract) {
  tp::detail::GroupExecutor ex(std::make_shared<NoBackend>());
  std::promise<void> entered, release;
  std::shared_future<void> gate = release.get_future().share();
  std::thread first([&] {
    EXPECT_TRUE(ex.try_run_inline([&](tp::detail::GroupBackend&) {
      entered.set_value();
      gate.wait();
    }));
  });
  entered.get_future().wait();
  auto expect_contract_error = [](auto&& call) {
    try {
      call();
      ADD_FAILURE() << "no error while another thread's call ran";
    } catch (const tp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("two threads at once"), std::string::npos) << e.what();
    }
  };
  expect_contract_error([&] { (void)ex.try_run_inline([](tp::detail::GroupBackend&) {}); });
  expect_contract_error([&] { (void)ex.submit([](tp::detail::GroupBackend&) {}); });
  release.set_value();
  first.join();
  // Handed over properly (the join), the second thread's calls run.
  std::thread second([&] { EXPECT_TRUE(ex.try_run_inline([](tp::detail::GroupBackend&) {})); });
  second.join();
}

TEST(GroupExecutor, StopLetsQueuedCallsFinishThenRefusesNewOnes) {
  tp::detail::GroupExecutor ex(std::make_shared<NoBackend>());
  Recorder r;
  std::vector<std::shared_ptr<tp::detail::PromiseWork>> works;
  for (int i = 0; i < 4; ++i) {
    works.push_back(ex.submit([&r, i](tp::detail::GroupBackend&) { r.run(i, 5ms); }));
  }
  ex.stop();
  for (auto& w : works) EXPECT_TRUE(w->done());
  EXPECT_EQ(r.order, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_THROW(ex.submit([](tp::detail::GroupBackend&) {}), tp::ClosedError);
  EXPECT_THROW(ex.try_run_inline([](tp::detail::GroupBackend&) {}), tp::ClosedError);
}

}  // namespace
