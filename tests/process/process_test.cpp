// Processes: fork and spawn start methods, error propagation through spawn/ProcessContext,
// exit codes and signals, timeouts, the thread budget, and children dying with parents.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <thread>

#include "support/child.h"
#include "support/run_tests.h"
#include "support/start_methods.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

int g_marker = 0;  // set by the parent; a spawned child must not see it

void write_slot(int i, at::Tensor t, std::string tag) {
  if (tag != "tag") throw std::runtime_error("argument did not arrive");
  t[i].fill_(i + 1);
}

void raise_in_one(int i) {
  if (i == 1) throw std::invalid_argument("boom from child 1");
  std::this_thread::sleep_for(30s);
}

void killed_in_zero(int i) {
  if (i == 0) ::raise(SIGKILL);
  std::this_thread::sleep_for(30s);
}

void exit_three(int) { ::_exit(3); }

void sleep_for_seconds(int, double seconds) {
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

void check_clean_state(int, int expected_marker, int expected_threads) {
  if (g_marker != expected_marker)
    throw std::runtime_error("g_marker is " + std::to_string(g_marker));
  if (at::get_num_threads() != expected_threads)
    throw std::runtime_error("intra-op threads " + std::to_string(at::get_num_threads()));
}

void nested_spawn(int, at::Tensor out) {
  tp::SpawnOptions o;
  o.join = false;
  auto ctx = tp::spawn(write_slot, std::make_tuple(out, std::string("tag")), 1, o);
  if (!ctx.join(60s)) throw std::runtime_error("the nested children did not end within 60 s");
}

void throw_for_stderr(int) { throw std::invalid_argument("boom for stderr"); }

// Waits (up to 30 s) until flags[0] is set, then sets flags[1] to 2.
void wait_for_go(at::Tensor flags) {
  auto* f = flags.data_ptr<int32_t>();
  for (int i = 0; i < 30000 && std::atomic_ref<int32_t>(f[0]).load() == 0; ++i)
    std::this_thread::sleep_for(1ms);
  if (std::atomic_ref<int32_t>(f[0]).load() == 0) throw std::runtime_error("no go within 30 s");
  std::atomic_ref<int32_t>(f[1]).store(2);
}

bool pid_gone(int pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

}  // namespace

class StartMethods : public tp::testing::StartMethodTest {};

TEST_P(StartMethods, ChildrenWriteSharedTensor) {
  at::Tensor t = at::zeros({4});
  tp::share_memory_(t);
  auto ctx =
      tp::start_processes(write_slot, std::make_tuple(t, std::string("tag")), 4, opts(false));
  ASSERT_TRUE(ctx.join(60s));
  EXPECT_TRUE(at::equal(t, at::arange(1, 5, at::kFloat)));
  for (int pid : ctx.pids()) {
    int status = 0;
    EXPECT_EQ(::waitpid(pid, &status, WNOHANG), -1) << "child " << pid << " left a zombie";
  }
}

TEST_P(StartMethods, ExceptionInOneChildTerminatesTheOthers) {
  auto o = opts();
  o.join = false;
  auto ctx = tp::start_processes(raise_in_one, std::tuple<>(), 2, o);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    ctx.join(10s);
    FAIL() << "no exception";
  } catch (const tp::ProcessRaisedException& e) {
    EXPECT_EQ(e.error_index(), 1);
    EXPECT_EQ(e.pid(), ctx.pids()[1]);
    EXPECT_NE(e.type().find("invalid_argument"), std::string::npos) << e.type();
    EXPECT_EQ(e.message(), "boom from child 1");
    EXPECT_NE(std::string(e.what()).find("boom from child 1"), std::string::npos);
  }
  // Child 0 sleeps 30 s: the join must end it, not wait for it (generous on a loaded box).
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  EXPECT_TRUE(pid_gone(ctx.pids()[0])) << "child 0 must be terminated and reaped";
}

TEST_P(StartMethods, SigkillIsReportedByName) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  auto ctx = tp::start_processes(killed_in_zero, std::tuple<>(), 2, opts(false));
  try {
    ctx.join(60s);
    FAIL() << "no exception within 60 s";
  } catch (const tp::ProcessExitedException& e) {
    EXPECT_EQ(e.error_index(), 0);
    EXPECT_EQ(e.exit_code(), -SIGKILL);
    EXPECT_EQ(e.signal_name(), "SIGKILL");
    EXPECT_NE(std::string(e.what()).find("SIGKILL"), std::string::npos) << e.what();
  }
}

TEST_P(StartMethods, NonZeroExitCode) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  auto ctx = tp::start_processes(exit_three, std::tuple<>(), 1, opts(false));
  try {
    ctx.join(60s);
    FAIL() << "no exception within 60 s";
  } catch (const tp::ProcessExitedException& e) {
    EXPECT_EQ(e.exit_code(), 3);
    EXPECT_EQ(e.signal_name(), "");
  }
}

TEST_P(StartMethods, JoinTimeoutWhileRunning) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  auto o = opts();
  o.join = false;
  auto ctx = tp::start_processes(sleep_for_seconds, std::make_tuple(0.7), 2, o);
  EXPECT_FALSE(ctx.join(0.05s));
  EXPECT_TRUE(ctx.join(20s));
}

TEST_P(StartMethods, EightProcessesOnTwoCores) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  at::Tensor t = at::zeros({8});
  tp::share_memory_(t);
  auto ctx =
      tp::start_processes(write_slot, std::make_tuple(t, std::string("tag")), 8, opts(false));
  ASSERT_TRUE(ctx.join(120s));
  EXPECT_EQ(t.sum().item<float>(), 36.0f);
}

TEST_P(StartMethods, ChildStateAndThreadBudget) {
  g_marker = 42;
  const int expected_marker = GetParam() == "fork" ? 42 : 0;  // forkserver: a clean exec too
  auto ctx =
      tp::start_processes(check_clean_state, std::make_tuple(expected_marker, 1), 1, opts(false));
  EXPECT_TRUE(ctx.join(60s));
  g_marker = 0;
}

TEST_P(StartMethods, ProcessLifecycle) {
  tp::ProcessOptions po;
  po.start_method = tp::start_method_from_string(GetParam());
  po.name = "sleeper";
  tp::Process p(po, sleep_for_seconds, 0, 30.0);
  EXPECT_FALSE(p.exitcode().has_value());
  p.start();
  EXPECT_GT(p.pid(), 0);
  EXPECT_TRUE(p.is_alive());
  EXPECT_EQ(p.name(), "sleeper");
  EXPECT_FALSE(p.join(0.05s));
  EXPECT_THROW(p.start(), tp::Error);
  p.terminate();
  EXPECT_TRUE(p.join(10s));
  EXPECT_EQ(p.exitcode(), -SIGTERM);
  EXPECT_FALSE(p.is_alive());
}

TEST_P(StartMethods, NestedSpawn) {
  at::Tensor t = at::zeros({1});
  tp::share_memory_(t);
  auto ctx = tp::start_processes(nested_spawn, std::make_tuple(t), 1, opts(false));
  ASSERT_TRUE(ctx.join(120s));
  EXPECT_EQ(t[0].item<float>(), 1.0f);
}

// A child started from a thread that then ends lives on and finishes normally (before,
// PR_SET_PDEATHSIG killed fork and spawn children when the starting thread exited).
TEST_P(StartMethods, ChildOutlivesTheThreadThatStartedIt) {
  TORCHPAR_SKIP_UNDER_SPAWN();
  at::Tensor flags = at::zeros({2}, at::kInt);
  tp::share_memory_(flags);
  tp::ProcessOptions po;
  po.start_method = tp::start_method_from_string(GetParam());
  tp::Process p(po, wait_for_go, flags);
  std::thread([&] { p.start(); }).join();
  std::atomic_ref<int32_t>(flags.data_ptr<int32_t>()[0]).store(1);
  ASSERT_TRUE(p.join(60s));
  EXPECT_EQ(p.exitcode(), 0);
  EXPECT_EQ(flags[1].item<int32_t>(), 2);
}

// A child whose target throws prints its name, the exception type and message on its
// stderr, as Python prints the traceback (before: nothing). The forkserver's children
// write to the server's stderr, fixed when it started, so that method is not captured here.
TEST_P(StartMethods, ChildExceptionIsPrintedOnItsStderr) {
  if (GetParam() == "forkserver") GTEST_SKIP() << "stderr is the forkserver's";
  char path[] = "/tmp/torchpar_stderr_XXXXXX";
  const int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ::unlink(path);
  tp::ProcessOptions po;
  po.start_method = tp::start_method_from_string(GetParam());
  po.name = "Thrower";
  tp::Process p(po, throw_for_stderr, 0);
  std::fflush(stderr);
  const int saved = ::dup(2);
  ::dup2(fd, 2);
  p.start();
  ::dup2(saved, 2);
  ::close(saved);
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 1);
  std::string text(4096, '\0');
  const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
  ::close(fd);
  text.resize(n > 0 ? static_cast<size_t>(n) : 0);
  EXPECT_NE(text.find("Process Thrower:"), std::string::npos) << text;
  EXPECT_NE(text.find("invalid_argument: boom for stderr"), std::string::npos) << text;
  ASSERT_TRUE(p.error().has_value()) << "still recorded in the error slot";
  EXPECT_EQ(p.error()->second, "boom for stderr");
}

TORCHPAR_INSTANTIATE_FOR_START_METHODS(StartMethods);

TEST(Process, CapturingLambdaForksButDoesNotSpawn) {
  at::Tensor t = at::zeros({1});
  tp::share_memory_(t);
  tp::ProcessOptions po;
  po.start_method = tp::StartMethod::kFork;
  tp::Process p(po, [t]() mutable { t.fill_(7); });
  p.start();
  EXPECT_TRUE(p.join(10s));
  EXPECT_EQ(p.exitcode(), 0);
  EXPECT_EQ(t.item<float>(), 7.0f);
  po.start_method = tp::StartMethod::kSpawn;
  tp::Process q(po, [t]() mutable { t.fill_(8); });
  try {
    q.start();
    FAIL();
  } catch (const tp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("captureless"), std::string::npos) << e.what();
  }
}

TEST(Process, ForkAfterIntraOpThreadsRanIsSafe) {
  // The parent runs LibTorch's intra-op pool first; a forked child (1 thread) must not hang.
  at::set_num_threads(2);
  at::Tensor a = at::randn({512, 512});
  (void)at::mm(a, a).sum().item<float>();
  at::set_num_threads(1);
  tp::ProcessOptions po;
  po.start_method = tp::StartMethod::kFork;
  tp::Process p(po, [a]() {
    if (!at::allclose(at::mm(a, a), at::mm(a, a))) throw std::runtime_error("mm differs");
  });
  p.start();
  EXPECT_TRUE(p.join(60s)) << "a forked child hung after the parent used intra-op threads";
  EXPECT_EQ(p.exitcode(), 0);
}

TEST(Process, ForkWithThreadsInThreadedParentIsRefused) {
  std::atomic<bool> stop{false};
  std::thread busy([&] {
    while (!stop) std::this_thread::sleep_for(1ms);
  });
  tp::ProcessOptions po;
  po.start_method = tp::StartMethod::kFork;
  po.threads = 2;
  tp::Process p(po, sleep_for_seconds, 0, 0.0);
  try {
    p.start();
    FAIL();
  } catch (const tp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("spawn"), std::string::npos) << e.what();
  }
  stop = true;
  busy.join();
}

TEST(Process, StartMethodNames) {
  EXPECT_EQ(tp::get_all_start_methods(), (std::vector<std::string>{"fork", "forkserver", "spawn"}));
  EXPECT_EQ(tp::get_start_method(), "spawn");
  try {
    tp::set_start_method("threads");
    FAIL();
  } catch (const tp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("forkserver"), std::string::npos) << e.what();
  }
  tp::set_start_method("fork");
  EXPECT_EQ(tp::get_start_method(), "fork");
  tp::set_start_method("spawn");
}

TEST(Process, ChildrenDieWithTheirParent) {
  // A middle process starts a long-running child, reports its pid and is SIGKILLed.
  auto mid = tp::testing::fork_child([](int sock) {
    tp::ProcessOptions po;
    po.start_method = tp::StartMethod::kSpawn;
    tp::Process p(po, sleep_for_seconds, 0, 60.0);
    p.start();
    tp::testing::send_line(sock, std::to_string(p.pid()));
    std::this_thread::sleep_for(60s);
    return 0;
  });
  const int grandchild = std::stoi(tp::testing::recv_line(mid.sock));
  ::kill(mid.pid, SIGKILL);
  EXPECT_EQ(tp::testing::wait_child(mid), -SIGKILL);
  bool gone = false;
  for (int i = 0; i < 3000 && !gone; ++i) {  // up to 30 s: a loaded machine reaps late
    // The grandchild is reparented (to init or a subreaper) and reaped there.
    gone = pid_gone(grandchild);
    if (!gone) {
      char path[64];
      std::snprintf(path, sizeof path, "/proc/%d/stat", grandchild);
      if (FILE* f = std::fopen(path, "r")) {
        int pid_read = 0;
        char comm[256], state = '?';
        if (std::fscanf(f, "%d %255s %c", &pid_read, comm, &state) == 3 && state == 'Z')
          gone = true;
        std::fclose(f);
      }
    }
    if (!gone) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(gone) << "grandchild " << grandchild << " outlived its parent";
}

int main(int argc, char** argv) {
  torchpar::init(argc, argv);  // a spawned child runs its target here and exits
  return torchpar::testing::run_tests(argc, argv);
}
