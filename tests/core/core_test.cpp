// The core primitives on their own: deadlines, futex wait/wake and the waiter built on
// them (spin, sleeper mark, slices, liveness, deadline), the robust
// process-shared mutex (timed lock, owner-death recovery), pid_alive, the
// SIGPIPE disposition the library sets, and /proc/meminfo parsing.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/futex.h"
#include "core/host_identity.h"
#include "core/liveness.h"
#include "core/meminfo.h"
#include "core/robust_mutex.h"
#include "core/signals.h"
#include "core/waiter.h"
#include "support/child.h"
#include "torchpar/core/env.h"
#include "torchpar/pool/pool.h"
#include "torchpar/process/spawn.h"

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

TEST(Deadline, NeverAndFinite) {
  const Deadline never;
  EXPECT_FALSE(never.finite());
  EXPECT_FALSE(never.expired());
  EXPECT_FALSE(never.remaining());
  EXPECT_EQ(never.at(), SteadyClock::time_point::max());
  const auto slice = never.futex_slice(250ms);  // never: the whole slice
  ASSERT_TRUE(slice);
  EXPECT_EQ(slice->tv_sec, 0);
  EXPECT_EQ(slice->tv_nsec, 250'000'000);

  const Deadline soon = Deadline::after(60s);
  ASSERT_TRUE(soon.finite());
  EXPECT_GT(*soon.remaining(), 59s);
  EXPECT_LE(*soon.remaining(), 60s);
  EXPECT_EQ(soon.futex_slice(10ms)->tv_nsec, 10'000'000);  // the slice, not the minute
  const Deadline near = Deadline::after(0.02s);
  const auto s2 = near.futex_slice(1s);  // the time left, not the second
  ASSERT_TRUE(s2);
  EXPECT_EQ(s2->tv_sec, 0);
  EXPECT_LE(s2->tv_nsec, 20'000'000);

  const Deadline gone = Deadline::after(-1s);  // negative: now, passed at the first look
  EXPECT_TRUE(gone.expired());
  EXPECT_EQ(gone.remaining()->count(), 0.0);
  EXPECT_FALSE(gone.futex_slice(1s));  // passed: no sleep
  EXPECT_TRUE(Deadline::after(std::chrono::duration<double>(NAN)).expired());
  // Beyond the clock's range in nanoseconds: no limit, not a wrapped point in the past.
  EXPECT_FALSE(Deadline::after(std::chrono::duration<double>(1e12)).finite());
  EXPECT_FALSE(Deadline::after(std::chrono::duration<double>(INFINITY)).finite());
  EXPECT_TRUE(Deadline::after(std::chrono::duration<double>(1e8)).finite());
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

// One waiter's word and sleeper mark, as a peer process maps them.
struct WaitWords {
  uint32_t word = 0;
  uint32_t sleeping = 0;
};

// The waker's side of a sleeper flag: change the word, then wake only if someone sleeps.
void publish(WaitWords& w, uint32_t v) {
  atomic_word(w.word).store(v, std::memory_order_seq_cst);
  if (atomic_word(w.sleeping).load(std::memory_order_seq_cst) != 0) futex_wake_n(&w.word, 1);
}

// Until the waiter marked itself asleep (its spin is over); false after 10 s.
bool wait_until_asleep(WaitWords& w) {
  const auto give_up = SteadyClock::now() + 10s;
  while (atomic_word(w.sleeping).load() == 0) {
    if (SteadyClock::now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

TEST(Waiter, ValueAlreadySetReturnsFromTheSpinWithoutSleeping) {
  WaitWords w;
  w.word = 3;
  int alive_calls = 0;
  const WaitOptions o{.spin = {.looks = 100}, .sleeper = SleeperMark::flag(&w.sleeping)};
  const auto t0 = SteadyClock::now();
  EXPECT_EQ(wait_until(
                &w.word, [](uint32_t v) { return v == 3; }, Deadline::after(10s), o,
                [&] {
                  ++alive_calls;
                  return true;
                }),
            WaitStatus::kReady);
  EXPECT_LT(SteadyClock::now() - t0, 50ms);
  EXPECT_EQ(alive_calls, 0);  // no slice slept
  EXPECT_EQ(w.sleeping, 0u);  // never marked

  int looks = 0;
  EXPECT_TRUE(spin_until(
      &w.word, [](uint32_t v) { return v == 3; }, SpinPolicy{.looks = 100}, &looks));
  EXPECT_EQ(looks, 1);
  looks = 0;  // a condition that never holds: the whole budget, then false
  EXPECT_FALSE(spin_until(
      &w.word, [](uint32_t v) { return v == 4; }, SpinPolicy{.looks = 100, .yields = 2}, &looks));
  EXPECT_EQ(looks, 100);
}

TEST(Waiter, AnotherThreadWakesTheSleeper) {
  WaitWords w;
  WaitStatus st = WaitStatus::kGone;
  std::thread waiter([&] {
    const WaitOptions o{.spin = {.looks = 1000},
                        .sleep = {.slice = 10s},  // only the wake can end it in time
                        .sleeper = SleeperMark::count(&w.sleeping)};
    st = wait_until(
        &w.word, [](uint32_t v) { return v == 1; }, Deadline::after(30s), o);
  });
  ASSERT_TRUE(wait_until_asleep(w));
  const auto t0 = SteadyClock::now();
  publish(w, 1);
  waiter.join();
  EXPECT_EQ(st, WaitStatus::kReady);
  EXPECT_LT(SteadyClock::now() - t0, 5s);  // woken, not the end of its slice
  EXPECT_EQ(w.sleeping, 0u);               // unmarked
}

TEST(Waiter, AnotherProcessWakesTheSleeperOverSharedMemory) {
  auto* w = shared_object<WaitWords>();
  auto c = tp::testing::fork_child([w](int) {
    const WaitOptions o{.spin = {.looks = 1000, .budget = 30us},
                        .sleep = {.slice = 10s},  // only the wake can end it in time
                        .sleeper = SleeperMark::flag(&w->sleeping)};
    const auto st = wait_until(
        &w->word, [](uint32_t v) { return v == 7; }, Deadline::after(30s), o);
    return st == WaitStatus::kReady ? 0 : 1;
  });
  ASSERT_TRUE(wait_until_asleep(*w));
  publish(*w, 7);
  EXPECT_EQ(tp::testing::wait_child(c, 30s), 0);
  EXPECT_EQ(w->sleeping, 0u);
}

TEST(Waiter, DeadlineEndsTheWaitWithTimeoutErrorNamingWhatWasAwaited) {
  uint32_t word = 0;
  const auto never = [](uint32_t v) { return v != 0; };
  auto t0 = SteadyClock::now();
  try {
    wait_until(&word, never, Deadline::after(0.1s), WaitOptions{.what = "test word"});
    FAIL() << "no TimeoutError";
  } catch (const tp::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("no test word before the deadline"), std::string::npos)
        << e.what();
  }
  auto took = SteadyClock::now() - t0;
  EXPECT_GE(took, 95ms);
  EXPECT_LT(took, 400ms);

  t0 = SteadyClock::now();  // without `what`: a status, for callers that return false
  EXPECT_EQ(wait_until(&word, never, Deadline::after(0.05s)), WaitStatus::kTimedOut);
  took = SteadyClock::now() - t0;
  EXPECT_GE(took, 45ms);
  EXPECT_LT(took, 350ms);
  // A passed deadline: one look, no sleep.
  t0 = SteadyClock::now();
  EXPECT_EQ(wait_until(&word, never, Deadline::after(0s)), WaitStatus::kTimedOut);
  EXPECT_LT(SteadyClock::now() - t0, 50ms);
}

TEST(Waiter, LivenessFalseEndsTheWaitWithTheCallersError) {
  uint32_t word = 0;
  const auto never = [](uint32_t v) { return v != 0; };
  int calls = 0;
  const auto peer_alive = [&] { return ++calls < 3; };  // gone at the third look
  const WaitOptions o{.sleep = {.slice = 10ms}};
  const auto t0 = SteadyClock::now();
  const auto caller = [&] {
    // Without a deadline only liveness can end it; the caller picks its own error.
    if (wait_until(&word, never, Deadline(), o, peer_alive) == WaitStatus::kGone)
      throw tp::ClosedError("the peer went away");
  };
  EXPECT_THROW(caller(), tp::ClosedError);
  EXPECT_EQ(calls, 3);
  EXPECT_LT(SteadyClock::now() - t0, 500ms);

  // Asked at most every check_every; the condition set when the peer went wins.
  calls = 0;
  word = 1;
  EXPECT_EQ(wait_until(
                &word, [](uint32_t v) { return v == 2; }, Deadline(),
                WaitOptions{.sleep = {.slice = 5ms, .check_every = 30ms}},
                [&] {
                  ++calls;
                  atomic_word(word).store(2);  // the peer's last store before it left
                  return false;
                }),
            WaitStatus::kReady);
  EXPECT_EQ(calls, 1);
}

TEST(Waiter, MaxSlicesHandsBackToTheCaller) {
  uint32_t word = 0;
  const auto t0 = SteadyClock::now();
  EXPECT_EQ(wait_until(
                &word, [](uint32_t v) { return v != 0; }, Deadline::after(30s),
                WaitOptions{.sleep = {.slice = 20ms}, .max_slices = 2}),
            WaitStatus::kSlept);
  const auto took = SteadyClock::now() - t0;
  EXPECT_GE(took, 35ms);
  EXPECT_LT(took, 500ms);
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

// ---- The environment table and its accessors (torchpar/core/env.h) --------------------------

/// Sets (or with nullptr unsets) an environment variable for a scope; restores it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

/// The message of the ValueError `f` throws ("" when it throws none).
template <class F>
std::string value_error_of(F&& f) {
  try {
    f();
  } catch (const tp::ValueError& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(Env, UnsetOrEmptyGivesTheDefault) {
  for (const char* v : {static_cast<const char*>(nullptr), ""}) {
    ScopedEnv a("TORCHPAR_RPC_SHM", v), b("TORCHPAR_SHM_SLOT_BYTES", v), c("RANK", v),
        d("TORCHPAR_RPC_ADDR", v);
    EXPECT_FALSE(tp::env_flag("TORCHPAR_RPC_SHM", false));
    EXPECT_TRUE(tp::env_flag("TORCHPAR_RPC_SHM", true));
    EXPECT_EQ(tp::env_unsigned("TORCHPAR_SHM_SLOT_BYTES", 262144), 262144U);
    EXPECT_EQ(tp::env_int("RANK"), std::nullopt);
    EXPECT_EQ(tp::env_text("TORCHPAR_RPC_ADDR"), std::nullopt);
    // env_value tells set-but-empty from unset (TORCHPAR_AUTHKEY="" is an error, unset not).
    EXPECT_EQ(tp::env_value("TORCHPAR_RPC_ADDR"),
              v ? std::optional<std::string>("") : std::nullopt);
  }
}

TEST(Env, ValidValuesAreRead) {
  ScopedEnv a("TORCHPAR_RPC_SHM", "1"), b("TORCHPAR_MANAGER_SHM", "0"),
      c("TORCHPAR_SHM_CACHE_BYTES", "18446744073709551615"), d("MASTER_PORT", "29500"),
      e("RANK", "-3"), f("TORCHPAR_GLOO_ADDR", "10.0.0.2"), g("TORCHPAR_TOOLS_DIR", "/x y");
  EXPECT_TRUE(tp::env_flag("TORCHPAR_RPC_SHM", false));
  EXPECT_FALSE(tp::env_flag("TORCHPAR_MANAGER_SHM", true));
  EXPECT_EQ(tp::env_unsigned("TORCHPAR_SHM_CACHE_BYTES", 1), UINT64_MAX);
  EXPECT_EQ(tp::env_int("MASTER_PORT"), 29500);
  EXPECT_EQ(tp::env_int("RANK"), -3);  // the range is the caller's to check
  EXPECT_EQ(tp::env_text("TORCHPAR_GLOO_ADDR"), "10.0.0.2");
  EXPECT_EQ(tp::env_value("TORCHPAR_TOOLS_DIR"), "/x y");
}

TEST(Env, InvalidValuesThrowValueErrorNamingTheVariableAndValue) {
  {
    ScopedEnv a("TORCHPAR_RPC_SHM", "yes");
    const std::string m = value_error_of([] { tp::env_flag("TORCHPAR_RPC_SHM", false); });
    EXPECT_NE(m.find("TORCHPAR_RPC_SHM must be 0 or 1"), std::string::npos) << m;
    EXPECT_NE(m.find("'yes'"), std::string::npos) << m;
  }
  for (const char* bad : {"12abc", "-1", " 5", "+5", "0x10", "18446744073709551616"}) {
    ScopedEnv a("TORCHPAR_SHM_CACHE_BYTES", bad);
    const std::string m = value_error_of([] { tp::env_unsigned("TORCHPAR_SHM_CACHE_BYTES", 1); });
    EXPECT_NE(m.find("TORCHPAR_SHM_CACHE_BYTES"), std::string::npos) << bad << ": " << m;
    EXPECT_NE(m.find(bad), std::string::npos) << bad << ": " << m;
  }
  {
    ScopedEnv a("TORCHPAR_SHM_SLOT_BYTES", "100");  // below the caller's minimum
    EXPECT_NE(value_error_of([] {
                tp::env_unsigned("TORCHPAR_SHM_SLOT_BYTES", 1, 4096);
              }).find("TORCHPAR_SHM_SLOT_BYTES must be a whole decimal number in [4096, "),
              std::string::npos);
  }
  for (const char* bad : {"zero", "1.5", "2147483648", "3 "}) {
    ScopedEnv a("WORLD_SIZE", bad);
    const std::string m = value_error_of([] { tp::env_int("WORLD_SIZE"); });
    EXPECT_NE(m.find("WORLD_SIZE must be a whole number"), std::string::npos) << bad << ": " << m;
  }
}

TEST(Env, ANameOutsideTheTableOrTheWrongAccessorIsRefused) {
  EXPECT_NE(value_error_of([] {
              tp::env_flag("TORCHPAR_NO_SUCH_KNOB", false);
            }).find("TORCHPAR_NO_SUCH_KNOB is not in torchpar's table"),
            std::string::npos);
  EXPECT_NE(value_error_of([] {
              tp::env_flag("TORCHPAR_SHM_CACHE_BYTES", false);
            }).find("TORCHPAR_SHM_CACHE_BYTES is an unsigned number, not a flag"),
            std::string::npos);
  EXPECT_THROW(tp::environment_variable("PATH"), tp::ValueError);
}

// docs/environment.md lists the table's variables, and the table every TORCHPAR_* variable the
// page names (but the tests' own); read from the source tree beside this file.
TEST(Env, TheTableAndDocsEnvironmentMdNameTheSameVariables) {
  const std::string doc_path =
      std::string(__FILE__).substr(0, std::string(__FILE__).rfind("/tests/")) +
      "/docs/environment.md";
  std::ifstream f(doc_path);
  if (!f) GTEST_SKIP() << "no source tree at " << doc_path;
  const std::string doc((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::set<std::string> names;
  for (const auto& v : tp::environment_variables()) {
    EXPECT_TRUE(names.insert(std::string(v.name)).second) << v.name << " twice";
    EXPECT_NE(doc.find("`" + std::string(v.name) + "`"), std::string::npos)
        << v.name << " is in the table but not in docs/environment.md";
    EXPECT_EQ(v.ours, v.name.rfind("TORCHPAR_", 0) == 0) << v.name;
  }
  for (size_t at = doc.find("`TORCHPAR_"); at != std::string::npos;
       at = doc.find("`TORCHPAR_", at + 1)) {
    const std::string name = doc.substr(at + 1, doc.find('`', at + 1) - at - 1);
    if (name.rfind("TORCHPAR_TEST_", 0) == 0) continue;  // read by tests/support only
    if (name.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") != std::string::npos) {
      continue;  // "TORCHPAR_*", a pattern
    }
    EXPECT_TRUE(names.count(name)) << name << " is in docs/environment.md but not in the table";
  }
}

// ---- error families (core/error.h) -----------------------------------------------------------

namespace {

int raise_domain_error(int) { throw std::domain_error("no such domain"); }
int kill_self(int) {
  ::raise(SIGKILL);
  return 0;
}
void child_raises(int) { throw std::invalid_argument("child says no"); }
void child_exits(int) { ::_exit(3); }

tp::SpawnOptions fork_children() {
  tp::SpawnOptions o;
  o.start_method = tp::StartMethod::kFork;
  o.join = false;
  return o;
}

tp::PoolOptions one_forked_worker() {
  tp::PoolOptions o;
  o.processes = 1;
  o.start_method = tp::StartMethod::kFork;
  return o;
}

}  // namespace

// "A peer is gone" and "the remote side raised": every class of each family derives from its
// base, and both bases are torchpar::Error.
static_assert(std::is_base_of_v<tp::Error, tp::PeerLostError>);
static_assert(std::is_base_of_v<tp::PeerLostError, tp::WorkerLostError>);
static_assert(std::is_base_of_v<tp::PeerLostError, tp::RankLostError>);
static_assert(std::is_base_of_v<tp::PeerLostError, tp::RpcPeerLostError>);
static_assert(std::is_base_of_v<tp::PeerLostError, tp::ProcessExitedException>);
static_assert(std::is_base_of_v<tp::PeerLostError, tp::WorkerError>);
static_assert(std::is_base_of_v<tp::Error, tp::RemoteRaisedError>);
static_assert(std::is_base_of_v<tp::RemoteRaisedError, tp::TaskError>);
static_assert(std::is_base_of_v<tp::RemoteRaisedError, tp::RemoteError>);
static_assert(std::is_base_of_v<tp::RemoteRaisedError, tp::RpcRemoteError>);
static_assert(std::is_base_of_v<tp::RemoteRaisedError, tp::ProcessRaisedException>);
static_assert(!std::is_base_of_v<tp::PeerLostError, tp::RemoteRaisedError> &&
              !std::is_base_of_v<tp::RemoteRaisedError, tp::PeerLostError>);

// The classes no cheap component here throws: caught through their base, with their fields.
TEST(ErrorFamilies, EachClassIsCaughtThroughItsBase) {
  const auto peer_lost = [](auto&& thrower) -> std::string {
    try {
      thrower();
    } catch (const tp::PeerLostError& e) {
      return e.what();
    }
    return "not caught";
  };
  EXPECT_EQ(peer_lost([] { throw tp::RankLostError(2, "rank 2 is gone"); }), "rank 2 is gone");
  EXPECT_EQ(peer_lost([] { throw tp::RpcPeerLostError("w1", "member 'w1' is gone"); }),
            "member 'w1' is gone");
  EXPECT_NE(
      peer_lost([] { throw tp::WorkerError("TensorParallel.forward", 1, 42, -9); }).find("SIGKILL"),
      std::string::npos);
  try {
    throw tp::RpcRemoteError("std::runtime_error", "bad input", "w1");
  } catch (const tp::RemoteRaisedError& e) {
    EXPECT_EQ(e.type(), "std::runtime_error");
    EXPECT_EQ(e.message(), "bad input");
    EXPECT_NE(std::string(e.what()).find("member 'w1'"), std::string::npos) << e.what();
  }
  try {
    throw tp::RemoteError("KeyError", "'x'");
  } catch (const tp::RemoteRaisedError& e) {
    EXPECT_EQ(e.type(), "KeyError");
    EXPECT_NE(std::string(e.what()).find("the manager's server process"), std::string::npos);
  }
}

TEST(ErrorFamilies, APoolTaskThatRaisesIsARemoteRaisedError) {
  tp::Pool pool(one_forked_worker());
  try {
    pool.apply(raise_domain_error, std::make_tuple(1));
    ADD_FAILURE() << "the task's exception did not arrive";
  } catch (const tp::RemoteRaisedError& e) {
    EXPECT_NE(dynamic_cast<const tp::TaskError*>(&e), nullptr) << e.what();
    EXPECT_NE(e.type().find("domain_error"), std::string::npos) << e.type();
    EXPECT_EQ(e.message(), "no such domain");
  }
}

TEST(ErrorFamilies, APoolWorkerKilledMidTaskIsAPeerLostError) {
  tp::Pool pool(one_forked_worker());
  try {
    pool.apply(kill_self, std::make_tuple(1));
    ADD_FAILURE() << "a killed worker's task returned";
  } catch (const tp::PeerLostError& e) {
    const auto* lost = dynamic_cast<const tp::WorkerLostError*>(&e);
    ASSERT_NE(lost, nullptr) << e.what();
    EXPECT_EQ(lost->exit_code(), -SIGKILL);
  }
}

TEST(ErrorFamilies, AChildThatRaisesOrExitsIsRemoteRaisedOrPeerLost) {
  auto raising = tp::start_processes(child_raises, std::tuple<>(), 1, fork_children());
  try {
    raising.join(std::chrono::seconds(60));
    ADD_FAILURE() << "no exception from the raising child";
  } catch (const tp::RemoteRaisedError& e) {
    EXPECT_NE(dynamic_cast<const tp::ProcessRaisedException*>(&e), nullptr) << e.what();
    EXPECT_NE(e.type().find("invalid_argument"), std::string::npos) << e.type();
    EXPECT_EQ(e.message(), "child says no");
  }
  auto exiting = tp::start_processes(child_exits, std::tuple<>(), 1, fork_children());
  try {
    exiting.join(std::chrono::seconds(60));
    ADD_FAILURE() << "no exception from the exiting child";
  } catch (const tp::PeerLostError& e) {
    const auto* exited = dynamic_cast<const tp::ProcessExitedException*>(&e);
    ASSERT_NE(exited, nullptr) << e.what();
    EXPECT_EQ(exited->exit_code(), 3);
  }
}

// ---- host identity (core/host_identity.h) ----------------------------------------------------

TEST(HostIdentity, KeyAndTokenNameThisHostAndChangeWithEveryField) {
  const HostIdentity me = this_host();
  EXPECT_EQ(me.key(), host_key());
  EXPECT_EQ(me.key(), this_host().key()) << "stable between calls";
  ASSERT_FALSE(me.boot_id.empty()) << "no boot id here";
  const std::string token = me.token();
  ASSERT_FALSE(token.empty());
  EXPECT_TRUE(is_host_token(token)) << token;
  EXPECT_EQ(token.rfind(me.boot_id + "_", 0), 0u) << token;
  EXPECT_EQ(std::count(token.begin(), token.end(), '_'), 1) << token;
  EXPECT_NE(me.key().find(me.boot_id), std::string::npos) << me.key();
  // Any field that differs makes another host, for the rendezvous and the transport alike.
  const std::vector<std::function<void(HostIdentity&)>> changes = {
      [](HostIdentity& h) { h.host_name += "x"; }, [](HostIdentity& h) { h.pid_ns += 1; },
      [](HostIdentity& h) { h.net_ns += 1; }, [](HostIdentity& h) { h.shm_dev += 1; },
      [](HostIdentity& h) { h.boot_id[0] = h.boot_id[0] == '0' ? '1' : '0'; }};
  for (const auto& change : changes) {
    HostIdentity other = me;
    change(other);
    EXPECT_NE(other.key(), me.key());
    EXPECT_NE(other.token(), token) << other.key();
  }
  HostIdentity unreadable = me;
  unreadable.net_ns = 0;
  EXPECT_EQ(unreadable.token(), "") << "no network namespace: never the same host over RPC";
  unreadable = me;
  unreadable.boot_id.clear();
  EXPECT_EQ(unreadable.token(), "");
  EXPECT_FALSE(is_host_token(""));
  EXPECT_FALSE(is_host_token("XYZ!"));
  EXPECT_FALSE(is_host_token(std::string(kMaxHostToken + 1, 'a')));
}

TEST(HostIdentity, AForkedChildIsOnTheSameHost) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const std::string key = host_key() + "\n" + this_host().token();
    const bool ok = ::write(fds[1], key.data(), key.size()) == static_cast<ssize_t>(key.size());
    ::_exit(ok ? 0 : 1);
  }
  ::close(fds[1]);
  std::string got;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;)
    got.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(got, host_key() + "\n" + this_host().token());
}
