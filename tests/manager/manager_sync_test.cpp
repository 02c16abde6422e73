// The manager's Queue and synchronization primitives (CPython's _test_multiprocessing
// manager cases that apply): semantics in the owner, each type across real processes
// (fork and spawn), blocking calls that hold up no other thread, and clients SIGKILLed
// while blocked in the server (they take nothing; the server goes on serving others).
#include <gtest/gtest.h>
#include <signal.h>

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <latch>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/child.h"
#include "support/manager.h"
#include "support/start_methods.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

using tp::testing::child_options;
using tp::testing::eventually;
using tp::testing::exit_code;
using tp::testing::manager_options;
using tp::testing::require;
using tp::testing::seconds_since;

using Clock = std::chrono::steady_clock;
using Dict = tp::DictProxy<std::string, int64_t>;
using IntQueue = tp::QueueProxy<int64_t>;

/// Runs `f`, which must throw RemoteError of `type`; returns its message.
template <class F>
std::string remote_error(F&& f, const std::string& type) {
  try {
    f();
  } catch (const tp::RemoteError& e) {
    EXPECT_EQ(e.type(), type) << e.what();
    return e.message();
  }
  ADD_FAILURE() << "no RemoteError " << type;
  return {};
}

// A queue proxy that can also call the served queue's debugging method.
struct RawQueue : IntQueue {
  explicit RawQueue(const IntQueue& q) : IntQueue(q) {}
  int64_t n_getters() const { return decode<int64_t>(call_method("_n_getters", {})); }
};

// ---- children (free functions: every start method can run them) ------------------------

/// Puts 0..n-1, then -1.
void produce(IntQueue q, int64_t n) {
  for (int64_t i = 0; i < n; ++i) q.put(i, true, 30s);
  q.put(-1, true, 30s);
}

/// Takes the lock, says so, holds it until told to release it.
void hold_lock(tp::LockProxy lock, tp::EventProxy held, tp::EventProxy release_it) {
  require(lock.acquire(true, 30s), "acquire");
  held.set();
  require(release_it.wait(30s), "the parent's go");
  lock.release();
}

/// The parent holds `rlock`: this process (another owner) cannot take or release it.
void rlock_is_not_mine(tp::RLockProxy rlock) {
  require(!rlock.acquire(false), "acquired a lock the parent holds");
  try {
    rlock.release();
  } catch (const tp::RemoteError& e) {
    require(e.type() == "RuntimeError", e.what());
    return;
  }
  throw std::runtime_error("released a lock the parent holds");
}

/// Waits for `go`, then sets `done` and gives a semaphore unit.
void set_when_told(tp::EventProxy go, tp::EventProxy done, tp::SemaphoreProxy sem) {
  require(go.wait(30s), "go");
  done.set();
  sem.release();
}

/// Takes the condition's lock (free once the parent waits), writes "done", notifies.
void notify_done(tp::ConditionProxy cond, Dict box) {
  require(cond.acquire(true, 30s), "acquire");
  box.set("done", 1);
  cond.notify();
  cond.release();
}

/// Two rounds of the barrier; the arrival indices go to `out`.
void two_rounds(tp::BarrierProxy barrier, IntQueue out) {
  for (int round = 0; round < 2; ++round) out.put(barrier.wait(30s));
}

/// Blocks in get until killed.
void blocked_get(IntQueue q) { q.get(true, 120s); }

/// Waits in the condition (holding nothing) until killed; `waiting` says it is inside.
void blocked_in_condition(tp::ConditionProxy cond, tp::EventProxy waiting) {
  require(cond.acquire(true, 30s), "acquire");
  waiting.set();
  cond.wait(120s);
}

/// One party of a barrier, until killed.
void blocked_in_barrier(tp::BarrierProxy barrier) { barrier.wait(120s); }

// ---- in the owner ------------------------------------------------------------------------

TEST(ManagerQueue, BehavesAsPythonsQueue) {
  tp::Manager m(manager_options());
  auto q = m.Queue<int64_t>();
  EXPECT_EQ(q.type_id(), "Queue");
  EXPECT_TRUE(q.empty());
  EXPECT_FALSE(q.full());  // unbounded
  for (int64_t i = 0; i < 5; ++i) q.put(i);
  EXPECT_EQ(q.qsize(), 5u);
  EXPECT_FALSE(q.empty());
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(q.get(), i);  // FIFO
  EXPECT_THROW(q.get_nowait(), tp::Empty);
  EXPECT_THROW(q.get(false), tp::Empty);

  // task_done / join: join waits for a task_done of every item put.
  EXPECT_FALSE(q.join(0.1s));
  for (int i = 0; i < 5; ++i) q.task_done();
  EXPECT_TRUE(q.join(1s));
  remote_error([&] { q.task_done(); }, "ValueError");
}

TEST(ManagerQueue, GetWithTimeoutRaisesEmptyInAboutThatTime) {
  tp::Manager m(manager_options());
  auto q = m.Queue<int64_t>();
  const auto t0 = Clock::now();
  EXPECT_THROW(q.get(true, 0.5s), tp::Empty);
  const double took = seconds_since(t0);
  EXPECT_GE(took, 0.45);
  EXPECT_LT(took, 5.0);
  q.put(1);  // the queue goes on
  EXPECT_EQ(q.get(true, 0.5s), 1);
}

TEST(ManagerQueue, PutOnAFullBoundedQueueRaisesFull) {
  tp::Manager m(manager_options());
  auto q = m.Queue<int64_t>(2);
  q.put(1);
  q.put_nowait(2);
  EXPECT_TRUE(q.full());
  EXPECT_THROW(q.put_nowait(3), tp::Full);
  const auto t0 = Clock::now();
  EXPECT_THROW(q.put(3, true, 0.3s), tp::Full);
  EXPECT_GE(seconds_since(t0), 0.25);
  EXPECT_EQ(q.qsize(), 2u);  // nothing was added
  // A blocked put goes in once a get makes room.
  auto putter = std::async(std::launch::async, [&] { q.put(3, true, 30s); });
  EXPECT_EQ(q.get(), 1);
  ASSERT_EQ(putter.wait_for(30s), std::future_status::ready);
  putter.get();
  EXPECT_EQ(q.get(), 2);
  EXPECT_EQ(q.get(), 3);
}

TEST(ManagerQueue, TensorItemsAreCopies) {
  tp::Manager m(manager_options());
  auto q = m.Queue<at::Tensor>();
  at::Tensor t = at::arange(4096, at::kFloat);
  q.put(t);
  t.zero_();
  EXPECT_TRUE(at::equal(q.get(true, 10s), at::arange(4096, at::kFloat)));
}

TEST(ManagerLock, AcquireReleaseAndTimeouts) {
  tp::Manager m(manager_options());
  auto lock = m.Lock();
  EXPECT_FALSE(lock.locked());
  EXPECT_TRUE(lock.acquire());
  EXPECT_TRUE(lock.locked());
  EXPECT_FALSE(lock.acquire(false));  // not recursive
  const auto t0 = Clock::now();
  EXPECT_FALSE(lock.acquire(true, 0.3s));
  EXPECT_GE(seconds_since(t0), 0.25);
  // As Python's Lock, any thread may release it.
  std::thread([&] { lock.release(); }).join();
  EXPECT_FALSE(lock.locked());
  EXPECT_NE(remote_error([&] { lock.release(); }, "RuntimeError").find("release unlocked lock"),
            std::string::npos);
  {
    std::lock_guard<tp::LockProxy> hold(lock);
    EXPECT_TRUE(lock.locked());
  }
  EXPECT_FALSE(lock.locked());
}

TEST(ManagerRLock, ReentrantForOneThreadOnly) {
  tp::Manager m(manager_options());
  auto rlock = m.RLock();
  EXPECT_TRUE(rlock.acquire());
  EXPECT_TRUE(rlock.acquire(false));  // the same thread again
  std::thread([&] {
    EXPECT_FALSE(rlock.acquire(false));  // another thread is another owner
    EXPECT_NE(remote_error([&] { rlock.release(); }, "RuntimeError")
                  .find("cannot release un-acquired lock"),
              std::string::npos);
  }).join();
  rlock.release();
  std::thread([&] { EXPECT_FALSE(rlock.acquire(false)); }).join();  // one level still held
  rlock.release();
  remote_error([&] { rlock.release(); }, "RuntimeError");
  std::thread([&] {
    EXPECT_TRUE(rlock.acquire(false));  // free now
    rlock.release();
  }).join();
}

TEST(ManagerSemaphore, CountsAndBounds) {
  tp::Manager m(manager_options());
  auto sem = m.Semaphore(2);
  EXPECT_TRUE(sem.acquire());
  EXPECT_TRUE(sem.acquire(false));
  EXPECT_FALSE(sem.acquire(false));
  EXPECT_FALSE(sem.acquire(true, 0.1s));
  sem.release(2);
  EXPECT_EQ(sem.get_value(), 2);
  sem.release();  // a plain Semaphore may go above its initial value
  EXPECT_EQ(sem.get_value(), 3);
  remote_error([&] { sem.release(0); }, "ValueError");

  auto bounded = m.BoundedSemaphore(1);
  EXPECT_EQ(bounded.type_id(), "BoundedSemaphore");
  EXPECT_NE(remote_error([&] { bounded.release(); }, "ValueError")
                .find("Semaphore released too many times"),
            std::string::npos);
  EXPECT_TRUE(bounded.acquire(false));
  {
    // std::lock_guard through AcquirerProxy::release() (one unit).
    bounded.release();
    std::lock_guard<tp::SemaphoreProxy> hold(bounded);
    EXPECT_EQ(bounded.get_value(), 0);
  }
  EXPECT_EQ(bounded.get_value(), 1);
  remote_error([&] { m.Semaphore(-1); }, "ValueError");
}

TEST(ManagerEvent, SetClearWait) {
  tp::Manager m(manager_options());
  auto e = m.Event();
  EXPECT_FALSE(e.is_set());
  const auto t0 = Clock::now();
  EXPECT_FALSE(e.wait(0.3s));
  EXPECT_GE(seconds_since(t0), 0.25);
  auto waiter = std::async(std::launch::async, [&] { return e.wait(30s); });
  e.set();
  ASSERT_EQ(waiter.wait_for(30s), std::future_status::ready);
  EXPECT_TRUE(waiter.get());
  EXPECT_TRUE(e.is_set());
  EXPECT_TRUE(e.wait(0s));
  e.clear();
  EXPECT_FALSE(e.is_set());
}

TEST(ManagerCondition, WaitAndNotifyNeedTheLock) {
  tp::Manager m(manager_options());
  auto cond = m.Condition();
  EXPECT_NE(remote_error([&] { cond.wait(0.1s); }, "RuntimeError").find("un-acquired"),
            std::string::npos);
  remote_error([&] { cond.notify(); }, "RuntimeError");
  remote_error([&] { cond.notify_all(); }, "RuntimeError");
  remote_error([&] { cond.release(); }, "RuntimeError");
  // wait releases every level and takes them all back.
  EXPECT_TRUE(cond.acquire());
  EXPECT_TRUE(cond.acquire());
  EXPECT_FALSE(cond.wait(0.2s));  // nobody notifies
  std::thread([&] { EXPECT_FALSE(cond.acquire(false)); }).join();
  cond.release();
  cond.release();
  remote_error([&] { cond.release(); }, "RuntimeError");
}

TEST(ManagerCondition, NotifyWakesAsManyWaitersAsAsked) {
  tp::Manager m(manager_options());
  auto cond = m.Condition();
  constexpr int kWaiters = 3;
  std::latch inside(kWaiters);
  std::mutex mu;
  std::condition_variable woke_cv;
  int woke = 0;
  int notified = 0;
  std::vector<std::thread> waiters;
  for (int i = 0; i < kWaiters; ++i) {
    waiters.emplace_back([&] {
      bool counted = false;
      try {  // an error fails the test (not std::terminate) and says what it was
        const bool acquired = cond.acquire(true, 30s);
        EXPECT_TRUE(acquired);
        inside.count_down();  // with the lock held: it is released only by the wait below
        counted = true;
        if (!acquired) return;
        const bool got = cond.wait(30s);
        cond.release();
        std::lock_guard<std::mutex> g(mu);
        ++woke;
        notified += got ? 1 : 0;
        woke_cv.notify_all();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "a waiter raised: " << e.what();
        if (!counted) inside.count_down();
      }
    });
  }
  struct JoinAll {  // an ASSERT's early return joins the waiters (never std::terminate)
    std::vector<std::thread>& threads;
    ~JoinAll() {
      for (auto& t : threads)
        if (t.joinable()) t.join();
    }
  } join_all{waiters};
  inside.wait();
  ASSERT_TRUE(cond.acquire(true, 30s));  // every waiter is in wait() now
  cond.notify(2);
  cond.release();
  {
    std::unique_lock<std::mutex> g(mu);
    ASSERT_TRUE(woke_cv.wait_for(g, 30s, [&] { return woke == 2; }));
    // The third stays asleep (a notify is not remembered for it).
    EXPECT_FALSE(woke_cv.wait_for(g, 300ms, [&] { return woke > 2; }));
  }
  ASSERT_TRUE(cond.acquire(true, 30s));
  cond.notify_all();
  cond.release();
  for (auto& t : waiters) t.join();
  EXPECT_EQ(woke, 3);
  EXPECT_EQ(notified, 3);
}

TEST(ManagerBarrier, BreaksOnTimeoutAbortAndReset) {
  tp::Manager m(manager_options());
  auto b = m.Barrier(2);
  EXPECT_EQ(b.parties(), 2);
  EXPECT_FALSE(b.broken());
  const auto t0 = Clock::now();
  EXPECT_THROW(b.wait(0.3s), tp::BrokenBarrierError);  // the timeout breaks it
  EXPECT_GE(seconds_since(t0), 0.25);
  EXPECT_TRUE(b.broken());
  EXPECT_THROW(b.wait(30s), tp::BrokenBarrierError);  // at once: it stays broken
  b.reset();
  EXPECT_FALSE(b.broken());

  // A round of two threads, then abort while one waits.
  auto other = std::async(std::launch::async, [&] { return b.wait(30s); });
  const int64_t mine = b.wait(30s);
  ASSERT_EQ(other.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(mine + other.get(), 1);  // indices 0 and 1
  auto waiter = std::async(std::launch::async, [&] { b.wait(30s); });
  ASSERT_TRUE(eventually([&] { return b.n_waiting() == 1; }));
  b.abort();
  ASSERT_EQ(waiter.wait_for(30s), std::future_status::ready);
  EXPECT_THROW(waiter.get(), tp::BrokenBarrierError);
  b.reset();

  // reset while one waits breaks that round; the barrier is usable afterwards.
  auto reset_waiter = std::async(std::launch::async, [&] { b.wait(30s); });
  ASSERT_TRUE(eventually([&] { return b.n_waiting() == 1; }));
  b.reset();
  ASSERT_EQ(reset_waiter.wait_for(30s), std::future_status::ready);
  EXPECT_THROW(reset_waiter.get(), tp::BrokenBarrierError);
  EXPECT_FALSE(b.broken());

  // The barrier's own timeout is the default of wait().
  auto timed = m.Barrier(2, 0.2s);
  EXPECT_THROW(timed.wait(), tp::BrokenBarrierError);
  remote_error([&] { m.Barrier(0); }, "ValueError");
}

TEST(ManagerQueue, BlockingGetHoldsUpNoOtherThread) {
  tp::Manager m(manager_options());
  auto q = m.Queue<int64_t>();
  auto d = m.dict<std::string, int64_t>();
  RawQueue raw(q);
  auto getter = std::async(std::launch::async, [&] { return q.get(true, 60s); });
  ASSERT_TRUE(eventually([&] { return raw.n_getters() == 1; }));
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < 20; ++i) {
    d.set("k", i);
    EXPECT_EQ(d.get("k"), std::optional<int64_t>(i));
    EXPECT_TRUE(q.empty());
  }
  EXPECT_LT(seconds_since(t0), 10.0);
  EXPECT_EQ(getter.wait_for(0s), std::future_status::timeout);  // still blocked
  q.put(42);
  ASSERT_EQ(getter.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(getter.get(), 42);
}

// ---- across processes --------------------------------------------------------------------

class ManagerSyncAcrossProcesses : public ::testing::TestWithParam<std::string> {};

TEST_P(ManagerSyncAcrossProcesses, QueueFromAProducerChild) {
  tp::ManagerOptions o = manager_options();
  o.start_method = tp::start_method_from_string(GetParam());  // the server's start too
  tp::Manager m(o);
  auto q = m.Queue<int64_t>(4);  // bounded: the producer blocks while the parent is behind
  tp::Process p(child_options(GetParam()), produce, q, int64_t{50});
  p.start();
  for (int64_t i = 0; i < 50; ++i) ASSERT_EQ(q.get(true, 30s), i);
  EXPECT_EQ(q.get(true, 30s), -1);
  EXPECT_EQ(exit_code(p), 0);
  EXPECT_TRUE(q.empty());
}

TEST_P(ManagerSyncAcrossProcesses, LockHeldByAChild) {
  tp::Manager m(manager_options());
  auto lock = m.Lock();
  auto held = m.Event();
  auto release_it = m.Event();
  tp::Process p(child_options(GetParam()), hold_lock, lock, held, release_it);
  p.start();
  ASSERT_TRUE(held.wait(30s));
  EXPECT_TRUE(lock.locked());
  EXPECT_FALSE(lock.acquire(false));
  EXPECT_FALSE(lock.acquire(true, 0.2s));
  release_it.set();
  EXPECT_TRUE(lock.acquire(true, 30s));  // once the child releases it
  lock.release();
  EXPECT_EQ(exit_code(p), 0);
}

TEST_P(ManagerSyncAcrossProcesses, RLockOwnedByTheParentOnly) {
  tp::Manager m(manager_options());
  auto rlock = m.RLock();
  ASSERT_TRUE(rlock.acquire());
  ASSERT_TRUE(rlock.acquire());
  tp::Process p(child_options(GetParam()), rlock_is_not_mine, rlock);
  p.start();
  EXPECT_EQ(exit_code(p), 0);
  rlock.release();
  rlock.release();
}

TEST_P(ManagerSyncAcrossProcesses, EventSetByAChildWakesTheParent) {
  tp::Manager m(manager_options());
  auto go = m.Event();
  auto done = m.Event();
  auto sem = m.Semaphore(0);
  tp::Process p(child_options(GetParam()), set_when_told, go, done, sem);
  p.start();
  EXPECT_FALSE(done.wait(0.2s));
  go.set();
  EXPECT_TRUE(done.wait(30s));
  EXPECT_TRUE(sem.acquire(true, 30s));  // the child's release
  EXPECT_EQ(exit_code(p), 0);
}

TEST_P(ManagerSyncAcrossProcesses, ConditionNotifiedByAChild) {
  tp::Manager m(manager_options());
  auto cond = m.Condition();
  auto box = m.dict<std::string, int64_t>();
  ASSERT_TRUE(cond.acquire());
  tp::Process p(child_options(GetParam()), notify_done, cond, box);
  p.start();
  // The child can take the lock only while this wait has released it.
  EXPECT_TRUE(cond.wait_for([&] { return box.contains("done"); }, 30s));
  std::thread([&] { EXPECT_FALSE(cond.acquire(false)); }).join();  // held again
  cond.release();
  EXPECT_EQ(exit_code(p), 0);
}

TEST_P(ManagerSyncAcrossProcesses, BarrierOfThreeWithTwoChildren) {
  tp::Manager m(manager_options());
  auto barrier = m.Barrier(3);
  auto out = m.Queue<int64_t>();
  tp::Process p1(child_options(GetParam()), two_rounds, barrier, out);
  tp::Process p2(child_options(GetParam()), two_rounds, barrier, out);
  p1.start();
  p2.start();
  std::map<int64_t, int> indices;
  for (int round = 0; round < 2; ++round) ++indices[barrier.wait(30s)];
  for (int i = 0; i < 4; ++i) ++indices[out.get(true, 30s)];
  EXPECT_EQ(indices, (std::map<int64_t, int>{{0, 2}, {1, 2}, {2, 2}}));
  EXPECT_EQ(exit_code(p1), 0);
  EXPECT_EQ(exit_code(p2), 0);
  EXPECT_FALSE(barrier.broken());
  EXPECT_EQ(barrier.n_waiting(), 0);
}

// ---- clients killed while blocked ---------------------------------------------------------

TEST_P(ManagerSyncAcrossProcesses, KilledGetterTakesNoItem) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  tp::Manager m(manager_options());
  auto q = m.Queue<int64_t>();
  RawQueue raw(q);
  tp::Process p(child_options(GetParam()), blocked_get, q);
  p.start();
  ASSERT_TRUE(eventually([&] { return raw.n_getters() == 1; }));
  auto consumer = std::async(std::launch::async, [&] { return q.get(true, 30s); });
  ASSERT_TRUE(eventually([&] { return raw.n_getters() == 2; }));
  p.kill();
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), -SIGKILL);
  q.put(7);  // the dead getter is still waiting in the server, or gone: it must not take it
  ASSERT_EQ(consumer.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(consumer.get(), 7);
  EXPECT_TRUE(eventually([&] { return raw.n_getters() == 0; }));
  q.put(8);
  EXPECT_EQ(q.qsize(), 1u);
  EXPECT_EQ(q.get_nowait(), 8);
}

TEST_P(ManagerSyncAcrossProcesses, KilledWaiterLeavesTheServerServing) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  tp::Manager m(manager_options());
  auto cond = m.Condition();
  auto waiting = m.Event();
  auto d = m.dict<std::string, int64_t>();
  tp::Process p(child_options(GetParam()), blocked_in_condition, cond, waiting);
  p.start();
  ASSERT_TRUE(waiting.wait(30s));
  ASSERT_TRUE(cond.acquire(true, 30s));  // free only once the child waits (holding nothing)
  p.kill();
  ASSERT_TRUE(p.join(30s));
  cond.notify_all();  // the dead waiter must not take the lock back
  cond.release();
  std::thread([&] {
    EXPECT_TRUE(cond.acquire(true, 10s));
    cond.release();
  }).join();
  d.set("after", 1);
  EXPECT_EQ(d.get("after"), std::optional<int64_t>(1));
  auto q = m.Queue<int64_t>();
  q.put(3);
  EXPECT_EQ(q.get(true, 10s), 3);
  EXPECT_NE(tp::testing::proc_state(m.pid()), '?');
}

TEST_P(ManagerSyncAcrossProcesses, KilledPartyBreaksTheBarrier) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  tp::Manager m(manager_options());
  auto barrier = m.Barrier(3);
  tp::Process p(child_options(GetParam()), blocked_in_barrier, barrier);
  p.start();
  ASSERT_TRUE(eventually([&] { return barrier.n_waiting() == 1; }));
  p.kill();
  ASSERT_TRUE(p.join(30s));
  const auto t0 = Clock::now();
  EXPECT_THROW(barrier.wait(30s), tp::BrokenBarrierError);  // not a 30 s timeout
  EXPECT_LT(seconds_since(t0), 10.0);
  EXPECT_TRUE(barrier.broken());
  barrier.reset();
  EXPECT_FALSE(barrier.broken());
}

INSTANTIATE_TEST_SUITE_P(Methods, ManagerSyncAcrossProcesses, ::testing::Values("fork", "spawn"),
                         tp::testing::start_method_name);

}  // namespace

int main(int argc, char** argv) { return tp::testing::manager_test_main(argc, argv); }
