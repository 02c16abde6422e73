// The core primitives on their own: deadlines and futex wait/wake, the robust
// process-shared mutex (timed lock, owner-death recovery), pid_alive, the
// SIGPIPE disposition the library sets, and /proc/meminfo parsing.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "core/futex.h"
#include "core/liveness.h"
#include "core/meminfo.h"
#include "core/robust_mutex.h"
#include "core/signals.h"
#include "support/child.h"

namespace tp = torchpar;
using namespace tp::detail;
using namespace std::chrono_literals;

namespace {

// One page of anonymous shared memory, inherited by forked children.
template <class T>
T* shared_object() {
  void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("mmap");
  return new (p) T();
}

}  // namespace

TEST(Deadline, AfterAndPast) {
  EXPECT_FALSE(deadline_after(std::nullopt));
  EXPECT_FALSE(past(std::nullopt));
  EXPECT_TRUE(past(deadline_after(0s)));
  EXPECT_TRUE(past(deadline_after(std::chrono::duration<double>(-1))));
  EXPECT_FALSE(past(deadline_after(60s)));
}

TEST(Futex, WaitReturnsOnValueChangeWakeAndDeadline) {
  uint32_t w = 0;
  futex_wait_until(&w, 1, deadline_after(10s));  // value differs: returns at once
  const auto t0 = SteadyClock::now();
  futex_wait_until(&w, 0, deadline_after(0.05s));  // nobody wakes: the deadline ends it
  EXPECT_GE(SteadyClock::now() - t0, 45ms);
  futex_wait_until(&w, 0, deadline_after(0s));  // passed deadline: no sleep at all

  std::atomic<bool> done{false};
  std::thread waiter([&] {
    while (std::atomic_ref<uint32_t>(w).load() == 0) futex_wait_until(&w, 0, deadline_after(30s));
    done = true;
  });
  std::atomic_ref<uint32_t>(w).store(1);
  futex_wake_n(&w, 1);
  waiter.join();
  EXPECT_TRUE(done);
}

TEST(Futex, WakeAcrossProcesses) {
  auto* w = shared_object<uint32_t>();
  auto c = tp::testing::fork_child([w](int sock) {
    tp::testing::send_line(sock, "ready");
    while (std::atomic_ref<uint32_t>(*w).load() == 0) futex_wait_until(w, 0, deadline_after(30s));
    return std::atomic_ref<uint32_t>(*w).load() == 7 ? 0 : 1;
  });
  ASSERT_EQ(tp::testing::recv_line(c.sock, 30s), "ready");
  std::atomic_ref<uint32_t>(*w).store(7);
  futex_wake_n(w, INT32_MAX);
  EXPECT_EQ(tp::testing::wait_child(c, 30s), 0);
}

TEST(RobustMutex, TryTimedAndBlockingLock) {
  auto* m = shared_object<pthread_mutex_t>();
  init_robust_mutex(m);
  {
    RobustLock l(m, deadline_after(0s));
    ASSERT_TRUE(l.locked());
    EXPECT_EQ(l.status(), LockStatus::kAcquired);
    std::thread other([&] {
      EXPECT_EQ(lock_robust(m, deadline_after(0s)), LockStatus::kTimedOut);
      const auto t0 = SteadyClock::now();
      EXPECT_EQ(lock_robust(m, deadline_after(0.1s)), LockStatus::kTimedOut);
      EXPECT_GE(SteadyClock::now() - t0, 90ms);
    });
    other.join();
  }
  RobustLock again(m, std::nullopt);
  EXPECT_TRUE(again.locked());
}

TEST(RobustMutex, StoppedHolderTimesOutAndDeadHolderIsRecovered) {
  auto* m = shared_object<pthread_mutex_t>();
  init_robust_mutex(m);
  auto holder = tp::testing::fork_child([m](int sock) {
    if (lock_robust(m, std::nullopt) != LockStatus::kAcquired) return 1;
    tp::testing::send_line(sock, "held");
    for (;;) ::pause();
  });
  ASSERT_EQ(tp::testing::recv_line(holder.sock, 30s), "held");
  ::kill(holder.pid, SIGSTOP);
  const auto t0 = SteadyClock::now();
  EXPECT_EQ(lock_robust(m, deadline_after(0.3s)), LockStatus::kTimedOut);
  EXPECT_LT(SteadyClock::now() - t0, 5s);
  ::kill(holder.pid, SIGKILL);
  EXPECT_EQ(tp::testing::wait_child(holder, 30s), -SIGKILL);
  int recovered = 0;
  {
    RobustLock l(m, deadline_after(10s), [&] { ++recovered; });
    EXPECT_EQ(l.status(), LockStatus::kOwnerDied);
  }
  EXPECT_EQ(recovered, 1);
  RobustLock l(m, deadline_after(10s), [&] { ++recovered; });
  EXPECT_EQ(l.status(), LockStatus::kAcquired) << "consistent again after recovery";
  EXPECT_EQ(recovered, 1);
}

TEST(PidAlive, RunningStoppedExitedAndZombie) {
  EXPECT_TRUE(pid_alive(::getpid()));
  EXPECT_TRUE(pid_alive(0)) << "unknown pid: let the deadline decide";
  auto c = tp::testing::fork_child([](int sock) -> int {
    tp::testing::send_line(sock, "up");
    for (;;) ::pause();
  });
  ASSERT_EQ(tp::testing::recv_line(c.sock, 30s), "up");
  EXPECT_TRUE(pid_alive(c.pid));
  ::kill(c.pid, SIGSTOP);
  EXPECT_TRUE(pid_alive(c.pid)) << "stopped is alive";
  ::kill(c.pid, SIGKILL);
  bool dead = false;  // a zombie until reaped: already not alive
  for (int i = 0; i < 3000 && !dead; ++i) {
    dead = !pid_alive(c.pid);
    if (!dead) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(dead);
  const int pid = c.pid;
  EXPECT_EQ(tp::testing::wait_child(c, 30s), -SIGKILL);
  EXPECT_FALSE(pid_alive(pid));
}

TEST(Signals, SigpipeIsIgnoredOnlyWhenAtItsDefault) {
  // In children: the disposition is process-wide.
  auto at_default = tp::testing::fork_child([](int) {
    ::signal(SIGPIPE, SIG_DFL);
    ignore_sigpipe_if_default();
    struct sigaction now {};
    ::sigaction(SIGPIPE, nullptr, &now);
    return now.sa_handler == SIG_IGN ? 0 : 1;
  });
  EXPECT_EQ(tp::testing::wait_child(at_default, 30s), 0);
  auto chosen = tp::testing::fork_child([](int) {
    struct sigaction mine {};
    mine.sa_handler = [](int) {};
    ::sigaction(SIGPIPE, &mine, nullptr);
    ignore_sigpipe_if_default();
    struct sigaction now {};
    ::sigaction(SIGPIPE, nullptr, &now);
    return now.sa_handler == mine.sa_handler ? 0 : 1;
  });
  EXPECT_EQ(tp::testing::wait_child(chosen, 30s), 0);
}

TEST(MemInfo, ReadsTotalAndAvailable) {
  const auto real = read_meminfo();
  ASSERT_TRUE(real);
  EXPECT_GT(real->available_bytes, 0U);
  EXPECT_LE(real->available_bytes, real->total_bytes);

  char path[] = "/tmp/torchpar_meminfo_XXXXXX";
  const int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ::close(fd);
  std::ofstream(path) << "MemTotal:        2048 kB\nMemFree:          512 kB\n"
                         "MemAvailable:    1024 kB\n";
  const auto fake = read_meminfo(path);
  ASSERT_TRUE(fake);
  EXPECT_EQ(fake->total_bytes, 2048U * 1024);
  EXPECT_EQ(fake->available_bytes, 1024U * 1024);
  // A kernel without MemAvailable (before 3.14), and no file at all.
  std::ofstream(path) << "MemTotal:        2048 kB\nMemFree:          512 kB\n";
  EXPECT_FALSE(read_meminfo(path));
  ::unlink(path);
  EXPECT_FALSE(read_meminfo(path));
}
