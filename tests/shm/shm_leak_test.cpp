// Shared memory is given back: blocks whose importer was SIGKILLed are reused, fully free
// slabs go with empty_shm_cache(), and a file_system tensor sent by a child that then exits
// can still be loaded by its receiver (the name is kept for it, then unlinked); a queue
// producer SIGKILLed inside put leaves no spill file.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <cstdio>
#include <optional>
#include <string>
#include <thread>

#include "support/child.h"
#include "support/strategy_guard.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using tp::testing::Child;
using tp::testing::fork_child;
using tp::testing::recv_line;
using tp::testing::send_line;
using tp::testing::StrategyGuard;
using tp::testing::wait_child;

namespace {

class ShmLeakTest : public ::testing::TestWithParam<std::string> {};

}  // namespace

// Before: every round's 8 MiB block stayed counted for the dead importer, so each round
// created a new segment (segments_created grew by 1 a round).
TEST_P(ShmLeakTest, BlocksOfAKilledImporterAreReused) {
  StrategyGuard g(GetParam());
  tp::empty_shm_cache();
  uint64_t created_after_first = 0;
  for (int round = 0; round < 5; ++round) {
    // Fork first, so the child inherits no reference on the tensor made below.
    Child c = fork_child([](int sock) {
      // By now this child's fork handlers dropped its copies of the parent's free and
      // pending segments: a child still in fork() maps them and would keep them in use.
      send_line(sock, "started");
      auto t = tp::loads<at::Tensor>(tp::recv_payload(sock, std::chrono::seconds(30)));
      send_line(sock, t.sum().item<double>() == 2.0 * (2 << 20) ? "holding" : "wrong");
      ::pause();  // killed while it holds the block
      return 0;
    });
    ASSERT_EQ(recv_line(c.sock), "started");
    {
      at::Tensor t = tp::empty_shared({2 << 20}, at::kFloat);  // 8 MiB: its own segment
      t.fill_(2.0f);
      tp::send_payload(c.sock, tp::dumps(t, {.copy_tensor = false}));
      ASSERT_EQ(recv_line(c.sock), "holding");
      ::kill(c.pid, SIGKILL);
      ASSERT_EQ(wait_child(c), -SIGKILL);
    }  // our storage dies after its only other holder
    if (round == 0) created_after_first = tp::shm_stats().segments_created;
  }
  // The next allocation of that size finds the block whose holders are all dead.
  at::Tensor again = tp::empty_shared({2 << 20}, at::kFloat);
  EXPECT_LE(tp::shm_stats().segments_created, created_after_first + 1)
      << "blocks held only by killed processes were not reused";
}

// Before: slab segments stayed mapped (and, for file_system, named) for the process's life.
TEST_P(ShmLeakTest, EmptyShmCacheReleasesFreeSlabs) {
  StrategyGuard g(GetParam());
  tp::empty_shm_cache();
  const std::string prefix = "torchpar_" + std::to_string(::getpid()) + "_";
  const auto names_before = tp::testing::shm_entries(prefix).size();
  {
    std::vector<at::Tensor> small;
    for (int i = 0; i < 300; ++i) small.push_back(tp::empty_shared({64 + i}, at::kFloat));
    EXPECT_GT(tp::shm_stats().segments, 0u);
  }
  tp::empty_shm_cache();
  EXPECT_EQ(tp::shm_stats().segments, 0u) << "free slab segments are still mapped";
  EXPECT_EQ(tp::shm_stats().live_blocks, 0u);
  if (GetParam() == "file_system") {
    EXPECT_LE(tp::testing::shm_entries(prefix).size(), names_before)
        << "free slab segments are still named in /dev/shm";
  }
  // Still usable afterwards.
  at::Tensor t = tp::empty_shared({16}, at::kFloat);
  t.fill_(1.0f);
  EXPECT_EQ(t.sum().item<float>(), 16.0f);
}

INSTANTIATE_TEST_SUITE_P(Strategies, ShmLeakTest,
                         ::testing::Values("file_descriptor", "file_system"),
                         [](const auto& param_info) { return param_info.param; });

namespace {
// Waits for the child to exit without closing its socket (wait_child closes it).
int exit_status_keeping_socket(pid_t pid) {
  for (int i = 0; i < 3000; ++i) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid, SIGKILL);
  return -1000;
}
}  // namespace

// Before: the child's exit unlinked its names at once and the parent's load failed with
// ShmError (ENOENT). PyTorch keeps such a segment for its receiver; so do we, and the name
// goes once the receiver has mapped it.
TEST(ShmFileSystemHandoff, TensorSentByAnExitedChildCanBeLoaded) {
  StrategyGuard g("file_system");
  for (int64_t n : {int64_t{100}, int64_t{3} << 20}) {  // a slab block and a large segment
    Child c = fork_child([n](int sock) {
      at::Tensor t = at::arange(n, at::kFloat);
      tp::share_memory_(t);
      tp::send_payload(sock, tp::dumps(t, {.copy_tensor = false}));
      std::exit(0);  // a normal exit: atexit handlers unlink this process's names
      return 0;
    });
    ASSERT_EQ(exit_status_keeping_socket(c.pid), 0);
    const std::string prefix = "torchpar_" + std::to_string(c.pid) + "_";
    {
      at::Tensor t = tp::loads<at::Tensor>(tp::recv_payload(c.sock, std::chrono::seconds(10)));
      EXPECT_TRUE(at::equal(t, at::arange(n, at::kFloat))) << n;
      EXPECT_TRUE(tp::is_shared(t));
    }
    ::close(c.sock);
    tp::empty_shm_cache();
    // The child's cleaner unlinks the name once we have mapped it.
    for (int i = 0; i < 3000 && !tp::testing::shm_entries(prefix).empty(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_TRUE(tp::testing::shm_entries(prefix).empty())
        << tp::testing::shm_entries(prefix).size() << " names of the exited child left";
  }
}

// Before: a producer SIGKILLed inside put, after writing a large message's spill file and
// before the message was in the ring (here: waiting for room), left the file under the
// queue creator's prefix until the creator exited. Now the file is under the producer's
// own prefix until put commits it, and the producer's cleaner unlinks it once it is gone.
TEST(ShmQueueSpill, AProducerKilledInsidePutLeavesNoSpillFile) {
  tp::detail::ShmQueue q(/*maxsize=*/1, /*capacity_bytes=*/4096);
  q.put("first", std::nullopt);  // full in items: the next put waits for room
  Child c = fork_child([&q](int sock) {
    send_line(sock, "putting");
    q.put(std::string(50000, 'x'), std::nullopt);  // spilled, then waits: killed there
    return 0;
  });
  ASSERT_EQ(recv_line(c.sock), "putting");
  // The child's spill file: under its own prefix (now) or under ours with its pid (before).
  char sender[32];
  std::snprintf(sender, sizeof sender, "_q%x_", static_cast<unsigned>(c.pid));
  auto child_spills = [&] {
    auto names = tp::testing::shm_entries("torchpar_" + std::to_string(c.pid) + "_");
    for (auto& n : tp::testing::shm_entries("torchpar_" + std::to_string(::getpid()) + "_"))
      if (n.find(sender) != std::string::npos) names.push_back(n);
    return names;
  };
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (child_spills().empty() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(child_spills().size(), 1u) << "the producer wrote no spill file";
  ::kill(c.pid, SIGKILL);
  ASSERT_EQ(wait_child(c), -SIGKILL);
  // Its cleaner sees the death at once; 30 s allows for a loaded machine.
  const auto gone_by = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  auto left = child_spills();
  for (; !left.empty() && std::chrono::steady_clock::now() < gone_by; left = child_spills())
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(left.empty()) << left.size() << " spill file(s) left, e.g. " << left[0];
  // The queue goes on: the dead producer's message never was in it.
  EXPECT_EQ(q.get(std::chrono::seconds(1)), "first");
  EXPECT_EQ(q.qsize(), 0u);
  q.put(std::string(60000, 'y'), std::nullopt);
  EXPECT_EQ(q.get(std::chrono::seconds(1)), std::string(60000, 'y'));
}
