// Other programs by argv: exec failures are errors in the parent, arguments arrive as they
// are (no shell), run_program's timeout kills and reaps, JobGroup ends a whole tree.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

std::string read_all(int fd) {
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  return out;
}

}  // namespace

TEST(Exec, MissingProgramIsAnErrorNamingIt) {
  try {
    tp::exec_program({"/nonexistent/torchpar-test-program"});
    FAIL() << "no exception";
  } catch (const tp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/torchpar-test-program"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tp::exec_program({}), tp::Error);
}

TEST(Exec, ArgumentsReachTheProgramVerbatim) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  const std::string weird = "x'; touch INJECTED; echo '$(id) `id` \"q\" *";
  tp::ExecOptions o;
  o.stdout_fd = p[1];
  o.env = {"TORCHPAR_EXEC_TEST=v a l"};
  const pid_t pid = tp::exec_program({"/usr/bin/printenv", "TORCHPAR_EXEC_TEST"}, o);
  const pid_t pid2 = tp::exec_program({"/bin/echo", weird}, o);
  ::close(p[1]);
  const std::string out = read_all(p[0]);
  ::close(p[0]);
  auto s1 = tp::wait_program(pid, 30s), s2 = tp::wait_program(pid2, 30s);
  ASSERT_TRUE(s1 && s2);
  EXPECT_EQ(tp::exit_code_of(*s1), 0);
  EXPECT_EQ(tp::exit_code_of(*s2), 0);
  EXPECT_NE(out.find("v a l\n"), std::string::npos) << out;
  EXPECT_NE(out.find(weird + "\n"), std::string::npos) << out;
}

TEST(Exec, RunProgramTimesOutKillsAndReaps) {
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(tp::run_program({"sleep", "30"}, {}, 0.3s), tp::TimeoutError);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);  // not the 30 s of the sleep
  EXPECT_EQ(tp::run_program({"/bin/false"}, {}, 30s), 1);
  EXPECT_EQ(tp::run_program({"/bin/sh", "-c", "kill -9 $$"}, {}, 30s), 128 + SIGKILL);
  const pid_t left = tp::exec_program({"sleep", "30"});
  EXPECT_EQ(tp::wait_program(left, 0.05s), std::nullopt);  // timed out, still running
  ::kill(left, SIGKILL);
  EXPECT_TRUE(tp::wait_program(left, 30s).has_value());
}

TEST(Exec, JobGroupEndsWhatItsProgramsStarted) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  tp::ExecOptions o;
  o.stdout_fd = p[1];
  pid_t grandchild = -1;
  {
    tp::JobGroup group(1s);
    const pid_t pid = group.start({"/bin/sh", "-c", "sleep 30 & echo $!; wait"}, o);
    ::close(p[1]);
    char buf[64] = {};
    ASSERT_GT(::read(p[0], buf, sizeof buf - 1), 0);
    grandchild = std::stoi(buf);
    EXPECT_EQ(::kill(grandchild, 0), 0);
    group.signal(SIGTERM);
    auto st = tp::wait_program(pid, 30s);
    ASSERT_TRUE(st);
  }  // the destructor SIGKILLs what is left of the group
  ::close(p[0]);
  bool gone = false;
  // The grandchild is init's now: wait until reaped (up to 30 s: a loaded machine reaps late).
  for (int i = 0; i < 3000 && !gone; ++i) {
    gone = ::kill(grandchild, 0) != 0;
    if (!gone) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(gone) << "the program's own child " << grandchild << " outlived the group";
}
