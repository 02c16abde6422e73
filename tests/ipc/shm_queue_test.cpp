// The queue ring on its own (detail::ShmQueue, bytes in and out): spill names, full in
// bytes and items, wrap-around, and spilled messages.
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "support/child.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using tp::detail::ShmQueue;
using namespace std::chrono_literals;

namespace {
std::string own_shm_prefix() { return "torchpar_" + std::to_string(::getpid()) + "_"; }
}  // namespace

// Regression (issue 13): the spill counter started at 0 in every queue, so the second
// queue's first large message collided with the first's ("File exists", ShmError).
TEST(ShmQueue, TwoQueuesEachHoldingALargeMessage) {
  ShmQueue a(0, 4096), b(0, 4096);
  const std::string big_a(5000, 'a'), big_b(6000, 'b');  // over capacity / 4: spilled
  a.put(big_a, std::nullopt);
  b.put(big_b, std::nullopt);
  a.put(big_a, std::nullopt);
  EXPECT_EQ(b.get(1s), big_b);
  EXPECT_EQ(a.get(1s), big_a);
  EXPECT_EQ(a.get(1s), big_a);
  EXPECT_TRUE(tp::testing::shm_entries(own_shm_prefix()).empty()) << "getters unlink spills";
}

// Regression (issue 13): a queue full in bytes raises Full (or waits out its timeout),
// never ShmError, whether the message is inline or spilled, and leaves no spill behind.
TEST(ShmQueue, FullInBytesRaisesFullNeverShmError) {
  ShmQueue q(0, 4096);
  const std::string inline_max(4096 / 4 - 9, 'i');  // the largest message kept in the ring
  int fitted = 0;
  try {
    for (; fitted < 100; ++fitted) q.put(inline_max, std::chrono::duration<double>(0));
  } catch (const tp::Full& e) {
    EXPECT_NE(std::string(e.what()).find("bytes in use"), std::string::npos) << e.what();
  }
  EXPECT_EQ(fitted, 4);
  EXPECT_THROW(q.put(inline_max, 0.1s), tp::Full);
  EXPECT_THROW(q.put(std::string(4096 / 4, 's'), 0s), tp::Full);    // just over: spilled
  EXPECT_THROW(q.put(std::string(64 << 10, 'S'), 0.1s), tp::Full);  // far over capacity
  EXPECT_TRUE(tp::testing::shm_entries(own_shm_prefix()).empty()) << "failed puts unlink";
  for (int i = 0; i < 4; ++i) EXPECT_EQ(q.get(1s), inline_max);

  // Spilled messages only put their name in the ring: many fit, then Full.
  const std::string big(100000, 'b');
  int spilled = 0;
  try {
    for (; spilled < 1000; ++spilled) q.put(big, 0s);
  } catch (const tp::Full&) {
  }
  EXPECT_GT(spilled, 10);
  EXPECT_LT(spilled, 1000);
  EXPECT_EQ(tp::testing::shm_entries(own_shm_prefix()).size(), static_cast<size_t>(spilled));
  for (int i = 0; i < spilled; ++i) EXPECT_EQ(q.get(1s), big);
  EXPECT_THROW(q.get(0s), tp::Empty);
  EXPECT_TRUE(tp::testing::shm_entries(own_shm_prefix()).empty());
}

TEST(ShmQueue, FullInItems) {
  ShmQueue q(2, 4096);
  q.put("a", 0s);
  q.put("b", 0s);
  EXPECT_THROW(q.put("c", 0s), tp::Full);
  EXPECT_THROW(q.put("c", 0.05s), tp::Full);
  EXPECT_EQ(q.qsize(), 2u);
  EXPECT_EQ(q.get(0s), "a");
  q.put("c", 0s);
  EXPECT_EQ(q.get(0s), "b");
  EXPECT_EQ(q.get(0s), "c");
}

// Messages of every size up to the inline limit, through a small ring many times over:
// head and tail wrap around the ring's end at every offset, and FIFO order holds.
TEST(ShmQueue, WrapAroundKeepsOrderAndBytes) {
  ShmQueue q(0, 4096);
  uint64_t seed = 1;
  auto next = [&] { return seed = seed * 6364136223846793005ULL + 1442695040888963407ULL; };
  std::vector<std::string> pending;
  size_t head = 0;
  for (int round = 0; round < 3000; ++round) {
    const size_t len = 1 + (next() >> 33) % (4096 / 4 - 9);
    std::string m(len, '\0');
    for (auto& ch : m) ch = static_cast<char>(next() >> 56);
    try {
      q.put(m, 0s);
      pending.push_back(std::move(m));
    } catch (const tp::Full&) {
      ASSERT_LT(head, pending.size()) << "Full on an empty ring";
      ASSERT_EQ(q.get(0s), pending[head++]);
    }
    if ((next() >> 60) < 6 && head < pending.size()) {
      ASSERT_EQ(q.get(0s), pending[head++]);
    }
  }
  while (head < pending.size()) {
    ASSERT_EQ(q.get(0s), pending[head++]);
  }
  EXPECT_THROW(q.get(0s), tp::Empty);
  EXPECT_EQ(q.qsize(), 0u);
}

// A message spilled by a child that then exits is still there for the parent (named under
// the queue creator's prefix), and the getter unlinks it.
TEST(ShmQueue, SpillOutlivesItsSenderAcrossProcesses) {
  ShmQueue q(0, 4096);
  auto c = tp::testing::fork_child([&q](int) {
    q.put(std::string(50000, 'c'), std::nullopt);
    q.put(std::string(60000, 'd'), std::nullopt);
    return 0;
  });
  EXPECT_EQ(tp::testing::wait_child(c, 30s), 0);
  q.put(std::string(70000, 'p'), std::nullopt);  // the parent's process-wide counter
  EXPECT_EQ(q.get(5s), std::string(50000, 'c'));
  EXPECT_EQ(q.get(5s), std::string(60000, 'd'));
  EXPECT_EQ(q.get(5s), std::string(70000, 'p'));
  EXPECT_TRUE(tp::testing::shm_entries(own_shm_prefix()).empty());
}

// Regression (issues 12, 13): queue rings and sync pages were unsealed memfds, so any
// holder of the fd could truncate them and every user died of SIGBUS. Now sealed.
TEST(ShmQueue, QueueAndLockMemoryCannotBeTruncated) {
  ShmQueue q(0, 4096);
  EXPECT_EQ(::ftruncate(q.fd(), 0), -1) << "a queue ring could be truncated";
  EXPECT_EQ(errno, EPERM);
  tp::Lock lock;
  tp::Payload p = tp::dumps(lock);
  ASSERT_EQ(p.fds.size(), 1u);
  EXPECT_EQ(::ftruncate(p.fds[0].get(), 0), -1) << "a Lock's page could be truncated";
  EXPECT_EQ(errno, EPERM);
  tp::Value<int> v(5);
  tp::Payload pv = tp::dumps(v);
  ASSERT_GE(pv.fds.size(), 1u);
  for (auto& fd : pv.fds) EXPECT_EQ(::ftruncate(fd.get(), 0), -1);
  // Both still work.
  q.put("ok", 0s);
  EXPECT_EQ(q.get(0s), "ok");
  EXPECT_TRUE(lock.acquire(1s));
  lock.release();
  EXPECT_EQ(v.get(), 5);
}
