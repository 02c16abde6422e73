// Fault injection on the ipc layer: a peer stopped with SIGSTOP while it holds a queue's
// internal lock must make the others' calls time out (Empty / Full / false), never hang,
// and a peer killed there must hand the lock over (robust mutex).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <future>
#include <string>

#include "ipc/shm_queue_test_access.h"  // src/: the queue's test hooks
#include "support/child.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using tp::detail::ShmQueue;
using namespace std::chrono_literals;

namespace {

// What a call did and how long it took.
struct Outcome {
  std::string what;  // "Empty", "Full", "returned:<value>", or another error's what()
  std::chrono::duration<double> took{};
};

// Runs `fn` on a thread; gives up waiting after `limit` (the call hangs: returns nullopt
// and leaves the thread to finish once the holder is killed).
template <class F>
std::optional<Outcome> run_with_limit(std::future<Outcome>& fut, F fn,
                                      std::chrono::seconds limit = 10s) {
  fut = std::async(std::launch::async, [fn] {
    const auto t0 = std::chrono::steady_clock::now();
    Outcome o;
    try {
      o.what = "returned:" + fn();
    } catch (const tp::Empty&) {
      o.what = "Empty";
    } catch (const tp::Full&) {
      o.what = "Full";
    } catch (const std::exception& e) {
      o.what = e.what();
    }
    o.took = std::chrono::steady_clock::now() - t0;
    return o;
  });
  if (fut.wait_for(limit) != std::future_status::ready) return std::nullopt;
  return fut.get();
}

}  // namespace

// Regression (issue 13): get(timeout) / get_nowait / put blocked until the stopped holder
// continued, because the internal lock was taken without a deadline.
TEST(QueueFault, StoppedLockHolderMakesCallsTimeOutNotHang) {
  ShmQueue q(0, 1 << 16);
  q.put("first", std::nullopt);
  auto holder = tp::testing::fork_child([&q](int sock) {
    tp::detail::ShmQueueTestAccess::hold_lock(q, [&] {
      tp::testing::send_line(sock, "held");
      for (;;) ::pause();
    });
    return 0;
  });
  ASSERT_EQ(tp::testing::recv_line(holder.sock, 30s), "held");
  ASSERT_EQ(::kill(holder.pid, SIGSTOP), 0);

  std::future<Outcome> f1, f2, f3, f4, f5;
  auto get_half = run_with_limit(f1, [&] { return q.get(0.5s); });
  auto get_nowait = run_with_limit(f2, [&] { return q.get(0s); });
  auto put_half = run_with_limit(f3, [&] {
    q.put("x", 0.5s);
    return std::string("put");
  });
  auto put_nowait = run_with_limit(f4, [&] {
    q.put("x", 0s);
    return std::string("put");
  });
  auto join_half = run_with_limit(f5, [&] { return std::string(q.join(0.5s) ? "t" : "f"); });

  // Kill the holder: a hung call (old code) then returns, so the test fails, not hangs.
  ::kill(holder.pid, SIGKILL);
  EXPECT_EQ(tp::testing::wait_child(holder, 30s), -SIGKILL);

  ASSERT_TRUE(get_half) << "get(0.5 s) hung behind a stopped lock holder";
  EXPECT_EQ(get_half->what, "Empty");
  EXPECT_GE(get_half->took, 0.45s);
  EXPECT_LT(get_half->took, 5.5s);
  ASSERT_TRUE(get_nowait) << "get_nowait hung behind a stopped lock holder";
  EXPECT_EQ(get_nowait->what, "Empty");
  EXPECT_LT(get_nowait->took, 5s);
  ASSERT_TRUE(put_half) << "put(0.5 s) hung behind a stopped lock holder";
  EXPECT_EQ(put_half->what, "Full");
  EXPECT_LT(put_half->took, 5.5s);
  ASSERT_TRUE(put_nowait) << "put_nowait hung behind a stopped lock holder";
  EXPECT_EQ(put_nowait->what, "Full");
  ASSERT_TRUE(join_half) << "join(0.5 s) hung behind a stopped lock holder";
  EXPECT_EQ(join_half->what, "returned:f");

  // The holder died holding the lock: the next caller recovers it and the queue works.
  for (auto* f : {&f1, &f2, &f3, &f4, &f5})
    if (f->valid()) f->wait();
  EXPECT_EQ(q.get(5s), "first");
  q.put("again", 5s);
  EXPECT_EQ(q.get(5s), "again");
}
