// Shared-memory tensors: strategies, share_memory_, handles across real processes,
// cleanup after SIGKILL, fd economy, exhaustion errors, the segment cache and fork; the
// private buffer share_memory_ replaces, freed by a background thread.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <signal.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "shm/deferred_release.h"
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

std::vector<at::ScalarType> all_dtypes() {
  return {at::kByte,  at::kChar,   at::kShort,        at::kInt,           at::kLong, at::kHalf,
          at::kFloat, at::kDouble, at::kComplexFloat, at::kComplexDouble, at::kBool, at::kBFloat16};
}

at::Tensor sample(at::ScalarType dt, at::IntArrayRef sizes) {
  auto t = at::arange(1, 1 + c10::multiply_integers(sizes), at::kDouble).reshape(sizes);
  if (dt == at::kBool) return (t.remainder(3) == 0);
  if (at::isComplexType(dt)) return at::complex(t.to(at::kDouble), -t.to(at::kDouble)).to(dt);
  return t.remainder(100).to(dt);
}

}  // namespace

TEST(SharingStrategy, NamesAndValidation) {
  auto all = tp::get_all_sharing_strategies();
  EXPECT_EQ(all, (std::vector<std::string>{"file_descriptor", "file_system"}));
  EXPECT_EQ(tp::get_sharing_strategy(), "file_descriptor");
  {
    StrategyGuard g("file_system");
    EXPECT_EQ(tp::get_sharing_strategy(), "file_system");
  }
  try {
    tp::set_sharing_strategy("posix");
    FAIL() << "no exception";
  } catch (const tp::ValueError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("posix"), std::string::npos) << msg;
    EXPECT_NE(msg.find("file_descriptor"), std::string::npos) << msg;
    EXPECT_NE(msg.find("file_system"), std::string::npos) << msg;
  }
  EXPECT_EQ(tp::get_sharing_strategy(), "file_descriptor");
}

class ShmTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { guard_ = std::make_unique<StrategyGuard>(GetParam()); }
  void TearDown() override { guard_.reset(); }
  std::unique_ptr<StrategyGuard> guard_;
};

TEST_P(ShmTest, ShareMemoryInPlaceKeepsDataAndViews) {
  at::Tensor t = at::arange(0, 1000, at::kFloat);
  at::Tensor view = t.narrow(0, 10, 5);
  at::Tensor expect = t.clone();
  EXPECT_FALSE(tp::is_shared(t));
  at::Tensor& r = tp::share_memory_(t);
  EXPECT_EQ(&r, &t);
  EXPECT_TRUE(tp::is_shared(t));
  EXPECT_TRUE(tp::is_shared(view)) << "views of the storage become shared";
  EXPECT_TRUE(at::equal(t, expect));
  view.fill_(-1);
  EXPECT_EQ(t[12].item<float>(), -1.0f);
  const void* p = t.data_ptr();
  tp::share_memory_(t);  // no-op
  EXPECT_EQ(t.data_ptr(), p);
  EXPECT_FALSE(t.storage().resizable());
}

TEST_P(ShmTest, EmptyAndScalarAndAllDtypes) {
  for (auto dt : all_dtypes()) {
    for (auto sizes : std::vector<std::vector<int64_t>>{{}, {0}, {3, 0, 2}, {7}, {4, 5}}) {
      at::Tensor t = sample(dt, sizes);
      at::Tensor expect = t.clone();
      tp::share_memory_(t);
      ASSERT_TRUE(tp::is_shared(t)) << dt;
      ASSERT_TRUE(at::equal(t, expect)) << dt;
      // Handle round trip inside the process aliases the same memory.
      auto h = tp::export_tensor(t);
      at::Tensor u = tp::import_tensor(
          h, h.storage.fd >= 0 ? tp::UniqueFd(::dup(h.storage.fd)) : tp::UniqueFd());
      ASSERT_EQ(u.scalar_type(), dt);
      ASSERT_EQ(u.sizes(), t.sizes());
      ASSERT_TRUE(at::equal(u, expect)) << dt;
      if (t.numel() > 0) {
        ASSERT_EQ(u.data_ptr(), t.data_ptr());
      }
    }
  }
}

TEST_P(ShmTest, NonContiguousAndOffsetViewsAcrossProcesses) {
  // The child exists before the tensors do: the memory reaches it only through handles.
  Child c = fork_child([](int sock) {
    auto p1 = tp::recv_payload(sock, std::chrono::seconds(30));
    auto views = tp::loads<std::vector<at::Tensor>>(p1);
    if (views.size() != 3) return 2;
    if (!views[0].is_contiguous() && views[0].sizes() == at::IntArrayRef({4, 3}) &&
        views[1].storage_offset() == 5 && tp::is_shared(views[2])) {
      // Check values, then write through each view.
      auto base = at::arange(0, 12, at::kDouble).reshape({3, 4});
      if (!at::equal(views[0], base.t())) return 3;
      if (!at::equal(views[1], at::arange(5, 9, at::kDouble))) return 4;
      views[0].mul_(2);   // base becomes 2x
      views[2].fill_(7);  // an int tensor
      send_line(sock, "written");
      return 0;
    }
    return 5;
  });
  at::Tensor base = at::arange(0, 12, at::kDouble).reshape({3, 4});
  at::Tensor flat = base.view({12});
  at::Tensor ints = at::zeros({5}, at::kInt);
  std::vector<at::Tensor> views{base.t(), flat.narrow(0, 5, 4), ints};
  tp::send_payload(c.sock, tp::dumps(views, {.copy_tensor = false}));
  EXPECT_TRUE(tp::is_shared(base)) << "dumps in shared mode moves the storage to shm in place";
  EXPECT_EQ(recv_line(c.sock), "written");
  EXPECT_TRUE(at::equal(base, at::arange(0, 24, 2, at::kDouble).reshape({3, 4})));
  EXPECT_TRUE(at::equal(ints, at::full({5}, 7, at::kInt)));
  EXPECT_EQ(wait_child(c), 0);
}

TEST_P(ShmTest, AliasingBothWays) {
  Child c = fork_child([](int sock) {
    auto t = tp::loads<at::Tensor>(tp::recv_payload(sock, std::chrono::seconds(30)));
    if (t.sum().item<double>() != 0.0) return 2;
    t.fill_(3);  // child -> parent
    send_line(sock, "child wrote");
    if (recv_line(sock) != "parent wrote") return 3;
    return t.sum().item<double>() == 5.0 * 64 ? 0 : 4;  // parent -> child
  });
  at::Tensor t = at::zeros({64}, at::kDouble);
  tp::send_payload(c.sock, tp::dumps(t, {.copy_tensor = false}));
  ASSERT_EQ(recv_line(c.sock), "child wrote");
  EXPECT_EQ(t.sum().item<double>(), 3.0 * 64);
  t.fill_(5);
  send_line(c.sock, "parent wrote");
  EXPECT_EQ(wait_child(c), 0);
}

TEST_P(ShmTest, CopyModeDoesNotAlias) {
  Child c = fork_child([](int sock) {
    auto t = tp::loads<at::Tensor>(tp::recv_payload(sock, std::chrono::seconds(30)));
    if (tp::is_shared(t) || t.sum().item<double>() != 64.0) return 2;
    t.fill_(9);
    send_line(sock, "done");
    return 0;
  });
  at::Tensor t = at::ones({64}, at::kDouble);
  tp::send_payload(c.sock, tp::dumps(t, {.copy_tensor = true}));
  EXPECT_FALSE(tp::is_shared(t));
  ASSERT_EQ(recv_line(c.sock), "done");
  EXPECT_EQ(t.sum().item<double>(), 64.0);
  EXPECT_EQ(wait_child(c), 0);
}

TEST_P(ShmTest, TooLargeRequestThrowsShmErrorAndProcessContinues) {
  const bool fs = GetParam() == "file_system";
  // More than what is free: /dev/shm for file_system, MemAvailable for memfd.
  const int64_t huge = int64_t{64} << 30;  // 64 GiB on a 24 GiB machine
  try {
    tp::empty_shared({huge}, at::kByte);
    FAIL() << "no exception";
  } catch (const tp::ShmError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(fs ? "/dev/shm" : "memfd"), std::string::npos) << msg;
    EXPECT_NE(msg.find("asked 64.0 GiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("free"), std::string::npos) << msg;
  }
  at::Tensor ok = tp::empty_shared({1024}, at::kFloat);
  ok.fill_(1);
  EXPECT_EQ(ok.sum().item<float>(), 1024.0f);
}

TEST_P(ShmTest, TenThousandTensorsWithUlimit1024) {
  Child c = fork_child([](int) {
    struct rlimit rl {
      1024, 1024
    };
    if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) return 2;
    const int before = tp::testing::count_open_fds();
    std::vector<at::Tensor> ts;
    ts.reserve(10000);
    for (int i = 0; i < 10000; ++i) {
      at::Tensor t = at::full({64}, static_cast<float>(i));
      tp::share_memory_(t);
      ts.push_back(t);
    }
    const int during = tp::testing::count_open_fds();
    if (during - before > 64) {
      std::fprintf(stderr, "%d fds open for 10000 tensors\n", during - before);
      return 3;
    }
    // All of them in one payload and back, aliasing.
    auto back = tp::loads<std::vector<at::Tensor>>(tp::dumps(ts, {.copy_tensor = false}));
    for (int i = 0; i < 10000; i += 997) {
      if (back[i][0].item<float>() != static_cast<float>(i)) return 4;
      if (back[i].data_ptr() != ts[i].data_ptr()) return 5;
    }
    return tp::testing::count_open_fds() - before <= 64 ? 0 : 6;
  });
  EXPECT_EQ(wait_child(c, std::chrono::seconds(120)), 0);
}

TEST_P(ShmTest, SegmentCacheReusesLargeSegments) {
  tp::empty_shm_cache();
  auto s0 = tp::shm_stats();
  for (int i = 0; i < 5; ++i) {
    at::Tensor t = at::ones({16 << 20}, at::kFloat);  // 64 MiB
    tp::share_memory_(t);
    EXPECT_EQ(t.sum().item<float>(), static_cast<float>(16 << 20));
  }
  auto s1 = tp::shm_stats();
  EXPECT_EQ(s1.segments_created - s0.segments_created, 1u);
  EXPECT_GE(s1.cache_hits - s0.cache_hits, 4u);
  EXPECT_GT(s1.cached_bytes, 0u);
  tp::empty_shm_cache();
  EXPECT_EQ(tp::shm_stats().cached_bytes, 0u);
}

// A cold small share_memory_ reserves a 64 KiB slab, not 2 MiB (posix_fallocate zeroes every
// page it reserves: a 4 KiB tensor cost 4x PyTorch's exact-size segment); a class that keeps
// growing goes on with 2 MiB slabs, and every block of every slab holds its data.
TEST_P(ShmTest, FirstSlabOfAClassIsSmallAndSlabsGrow) {
  tp::empty_shm_cache();
  ASSERT_EQ(tp::shm_stats().live_blocks, 0u) << "another test left storages alive";
  const auto s0 = tp::shm_stats();
  std::vector<at::Tensor> held;
  held.push_back(at::full({1024}, 0.0f));  // 4 KiB
  tp::share_memory_(held.back());
  const auto s1 = tp::shm_stats();
  EXPECT_EQ(s1.segments_created - s0.segments_created, 1u);
  EXPECT_LE(s1.mapped_bytes - s0.mapped_bytes, uint64_t{68} << 10) << "the first slab is not small";
  // 16 blocks of 4 KiB fill 64 KiB; 1000 of them need slabs of 64, 2048 and 2048 KiB.
  for (int i = 1; i < 1000; ++i) {
    held.push_back(at::full({1024}, static_cast<float>(i)));
    tp::share_memory_(held.back());
  }
  const auto s2 = tp::shm_stats();
  EXPECT_EQ(s2.segments_created - s0.segments_created, 3u) << "later slabs are not full size";
  EXPECT_LE(s2.mapped_bytes - s0.mapped_bytes, uint64_t{5} << 20);
  for (int i = 0; i < 1000; ++i) {
    ASSERT_TRUE(tp::is_shared(held[static_cast<size_t>(i)]));
    ASSERT_EQ(held[static_cast<size_t>(i)][1023].item<float>(), static_cast<float>(i));
  }
  held.clear();
  tp::empty_shm_cache();
  EXPECT_EQ(tp::shm_stats().segments, s0.segments);
}

TEST_P(ShmTest, BlockHeldByReceiverIsNotReused) {
  Child c = fork_child([](int sock) {
    auto t = tp::loads<at::Tensor>(tp::recv_payload(sock, std::chrono::seconds(30)));
    send_line(sock, "holding");
    if (recv_line(sock) != "parent reallocated") return 2;
    bool intact = at::equal(t, at::full({4 << 20}, 42.0f));
    t = at::Tensor();  // release: the parent may now reuse the segment
    send_line(sock, "released");
    return intact ? 0 : 3;
  });
  tp::empty_shm_cache();
  {
    at::Tensor t = at::full({4 << 20}, 42.0f);  // 16 MiB: its own segment
    tp::send_payload(c.sock, tp::dumps(t, {.copy_tensor = false}));
    ASSERT_EQ(recv_line(c.sock), "holding");
  }  // the parent's last reference dies while the child still aliases the memory
  at::Tensor u = at::full({4 << 20}, -1.0f);
  tp::share_memory_(u);  // must not land on the child's block
  send_line(c.sock, "parent reallocated");
  ASSERT_EQ(recv_line(c.sock), "released");
  EXPECT_EQ(wait_child(c), 0);
  // Now every holder is gone: two allocations of that size reuse both segments (u's and
  // the one the child released) instead of creating a new one.
  auto before = tp::shm_stats();
  u = at::Tensor();
  at::Tensor w1 = tp::empty_shared({4 << 20}, at::kFloat);
  at::Tensor w2 = tp::empty_shared({4 << 20}, at::kFloat);
  auto after = tp::shm_stats();
  EXPECT_EQ(after.segments_created, before.segments_created);
}

TEST_P(ShmTest, ForkedChildKeepsInheritedStorage) {
  at::Tensor t = at::full({1 << 20}, 5.0f);  // 4 MiB: its own segment
  tp::share_memory_(t);
  at::Tensor small = at::full({16}, 6.0f);
  tp::share_memory_(small);
  Child c = fork_child([t, small](int sock) {
    if (recv_line(sock) != "parent reallocated") return 2;
    if (!at::equal(t, at::full({1 << 20}, 5.0f))) return 3;
    if (!at::equal(small, at::full({16}, 6.0f))) return 4;
    return 0;
  });
  t = at::Tensor();
  small = at::Tensor();
  at::Tensor u = at::full({1 << 20}, -1.0f);
  tp::share_memory_(u);
  at::Tensor v = at::full({16}, -1.0f);
  tp::share_memory_(v);
  send_line(c.sock, "parent reallocated");
  EXPECT_EQ(wait_child(c), 0);
}

INSTANTIATE_TEST_SUITE_P(Strategies, ShmTest, ::testing::Values("file_descriptor", "file_system"),
                         [](const auto& param_info) { return param_info.param; });

TEST(ShmFileSystem, SigkillLeavesNoDevShmEntry) {
  Child c = fork_child([](int sock) {
    tp::set_sharing_strategy("file_system");
    std::vector<at::Tensor> keep;
    for (int64_t n : {16, 100000, 3 << 20}) {
      at::Tensor t = at::ones({n});
      tp::share_memory_(t);
      keep.push_back(t);
    }
    send_line(sock, "ready");
    ::pause();
    return 0;
  });
  ASSERT_EQ(recv_line(c.sock), "ready");
  const std::string prefix = "torchpar_" + std::to_string(c.pid) + "_";
  EXPECT_GE(tp::testing::shm_entries(prefix).size(), 3u);
  ::kill(c.pid, SIGKILL);
  EXPECT_EQ(wait_child(c), -SIGKILL);
  // The child's cleaner notices its death and unlinks the names (up to 30 s: a loaded
  // machine schedules the cleaner late).
  for (int i = 0; i < 3000 && !tp::testing::shm_entries(prefix).empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(tp::testing::shm_entries(prefix).empty())
      << tp::testing::shm_entries(prefix).size() << " entries left";
}

TEST(ShmFileSystem, NormalExitUnlinksNames) {
  Child c = fork_child([](int sock) {
    tp::set_sharing_strategy("file_system");
    at::Tensor t = at::ones({1000});
    tp::share_memory_(t);
    send_line(sock, "ready");
    std::exit(0);  // atexit handlers run
    return 0;
  });
  ASSERT_EQ(recv_line(c.sock), "ready");
  EXPECT_EQ(wait_child(c), 0);
  EXPECT_TRUE(tp::testing::shm_entries("torchpar_" + std::to_string(c.pid) + "_").empty());
}

// Before: a handle naming a file of another user was mapped; when that user truncated the
// file, the next access to the tensor killed the loader with SIGBUS. Now the load is refused
// with a ShmError naming the file and its owner; a file of our own user still loads.
TEST(ShmFileSystem, HandleOfAnotherUsersFileIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user";
  constexpr uid_t kNobody = 65534;
  Child c = fork_child([](int sock) {
    tp::set_sharing_strategy("file_system");
    at::Tensor t = at::arange(1 << 20, at::kFloat);  // 4 MiB: a segment of its own
    tp::send_payload(sock, tp::dumps(t, {.copy_tensor = false}));
    return recv_line(sock) == "done" ? 0 : 1;  // keeps the name until the parent is done
  });
  const tp::Payload payload = tp::recv_payload(c.sock, std::chrono::seconds(30));
  const auto names = tp::testing::shm_entries("torchpar_" + std::to_string(c.pid) + "_");
  ASSERT_EQ(names.size(), 1u);
  const std::string path = "/dev/shm/" + names[0];
  ASSERT_EQ(::chown(path.c_str(), kNobody, kNobody), 0) << std::strerror(errno);
  try {
    (void)tp::loads<at::Tensor>(payload);
    ADD_FAILURE() << "a file owned by uid 65534 was mapped";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(names[0]), std::string::npos) << what;
    EXPECT_NE(what.find("owned by uid 65534"), std::string::npos) << what;
  }
  ASSERT_EQ(::chown(path.c_str(), ::geteuid(), ::getegid()), 0) << std::strerror(errno);
  {
    at::Tensor t = tp::loads<at::Tensor>(payload);
    EXPECT_TRUE(at::equal(t, at::arange(1 << 20, at::kFloat)));
  }
  send_line(c.sock, "done");
  EXPECT_EQ(wait_child(c), 0);
}

TEST(ShmFileDescriptor, SigkillReturnsMemory) {
  Child c = fork_child([](int sock) {
    at::Tensor t = tp::empty_shared({256 << 20}, at::kByte);  // 256 MiB
    t.fill_(1);
    send_line(sock, "ready");
    ::pause();
    return 0;
  });
  const auto base = tp::testing::meminfo_shmem_bytes();
  ASSERT_EQ(recv_line(c.sock), "ready");
  const auto held = tp::testing::meminfo_shmem_bytes();
  EXPECT_GT(held, base + (200ULL << 20)) << "the child's 256 MiB should show as Shmem";
  ::kill(c.pid, SIGKILL);
  EXPECT_EQ(wait_child(c), -SIGKILL);
  unsigned long long after = held;
  for (int i = 0; i < 3000; ++i) {  // up to 30 s
    after = tp::testing::meminfo_shmem_bytes();
    if (after + (200ULL << 20) < held) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_LT(after + (200ULL << 20), held) << "memfd memory was not returned";
}

TEST(ShmErrors, RejectsWhatCannotBeShared) {
  at::Tensor undefined;
  EXPECT_THROW(tp::share_memory_(undefined), tp::ValueError);
  at::Tensor sparse = at::eye(3).to_sparse();
  EXPECT_THROW(tp::share_memory_(sparse), tp::ValueError);
}

// ---- the private buffer share_memory_ replaces ------------------------------------------------

namespace {

/// RssAnon of this process (private resident memory) from /proc/self/status, bytes.
long long rss_anon_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stoll(line.substr(8)) * 1024;  // kB
  }
  return -1;
}

}  // namespace

// 64 MiB from LibTorch's allocator: the data are in shared memory at once, and the private
// buffer they left is freed by the background thread (RssAnon drops by its size).
TEST(ShareMemoryRelease, LargePrivateBufferIsFreedInTheBackground) {
  constexpr int64_t kFloats = 16 << 20;  // 64 MiB
  at::Tensor t = at::arange(0, kFloats, at::kFloat);
  const uint64_t freed_before = tp::detail::drain_released();
  const long long before = rss_anon_bytes();
  ASSERT_GT(before, 64LL << 20);
  tp::share_memory_(t);
  ASSERT_TRUE(tp::is_shared(t));
  EXPECT_EQ(t[kFloats - 1].item<float>(), static_cast<float>(kFloats - 1));
  EXPECT_EQ(tp::detail::drain_released(), freed_before + 1)
      << "the background thread should have freed exactly this buffer";
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  // (ASan keeps freed memory in quarantine; TSan's shadow of the new segment grows RssAnon.)
  const long long after = rss_anon_bytes();
  EXPECT_LT(after, before - (60LL << 20))
      << "RssAnon " << before << " -> " << after << ": the private 64 MiB were not freed";
#endif
  EXPECT_TRUE(at::equal(t, at::arange(0, kFloats, at::kFloat)));
}

// drain_released's timeout: four 64 MiB buffers take the thread milliseconds to free, so a
// zero timeout right after queuing them throws TimeoutError; a real one then sees them freed.
// The thread may win the race when this one is descheduled between the last share_memory_ and
// the drain (seen once under load in CI's clone): up to 20 tries, each queuing four more.
TEST(ShareMemoryRelease, DrainTimesOut) {
  const uint64_t before = tp::detail::drain_released();
  bool timed_out = false;
  int tries = 0;
  while (!timed_out && tries < 20) {
    ++tries;
    for (int i = 0; i < 4; ++i) {
      at::Tensor t = at::ones({16 << 20}, at::kFloat);
      tp::share_memory_(t);
    }
    try {
      tp::detail::drain_released(0.0);
    } catch (const tp::TimeoutError&) {
      timed_out = true;
    }
  }
  EXPECT_TRUE(timed_out) << "drain_released(0.0) never timed out in " << tries << " tries";
  EXPECT_EQ(tp::detail::drain_released(), before + 4 * static_cast<uint64_t>(tries));
}

// A buffer with a deleter of its own (at::from_blob's) is freed by the caller, at once: the
// deleter may expect the caller's thread.
TEST(ShareMemoryRelease, ForeignDeleterRunsOnTheCallingThread) {
  constexpr int64_t kFloats = 3 << 20;  // 12 MiB: above the background thread's minimum
  static_assert(kFloats * 4 >= static_cast<int64_t>(tp::detail::kDeferredReleaseMinBytes));
  auto* buf = new std::vector<float>(kFloats, 1.5f);
  std::thread::id deleted_on;
  at::Tensor t = at::from_blob(
      buf->data(), {kFloats},
      [&deleted_on, buf](void*) {
        deleted_on = std::this_thread::get_id();
        delete buf;
      },
      at::kFloat);
  tp::share_memory_(t);
  EXPECT_EQ(deleted_on, std::this_thread::get_id());
  EXPECT_EQ(t[kFloats - 1].item<float>(), 1.5f);
}

// A child forked while the parent's thread exists has no such thread: it starts its own at
// its first large share_memory_ (else its drain would wait for ever), counting from zero.
TEST(ShareMemoryRelease, ForkedChildStartsItsOwnThread) {
  {
    at::Tensor t = at::ones({3 << 20}, at::kFloat);
    tp::share_memory_(t);
  }
  ASSERT_GE(tp::detail::drain_released(), 1u);
  Child c = fork_child([](int) {
    at::Tensor t = at::ones({3 << 20}, at::kFloat);
    tp::share_memory_(t);
    const uint64_t freed = tp::detail::drain_released();
    if (freed != 1) {
      std::fprintf(stderr, "child: %llu buffers freed, want 1\n",
                   static_cast<unsigned long long>(freed));
      return 1;
    }
    return t[7].item<float>() == 1.0f ? 0 : 2;
  });
  EXPECT_EQ(wait_child(c, std::chrono::seconds(30)), 0);
}

// exit() right after large share_memory_ calls: the atexit handler lets the thread finish its
// buffer and frees the queued ones before LibTorch's statics go; the process exits cleanly.
TEST(ShareMemoryRelease, ExitWithBuffersQueuedIsClean) {
  Child c = fork_child([](int) -> int {
    for (int i = 0; i < 4; ++i) {
      at::Tensor t = at::ones({4 << 20}, at::kFloat);  // 16 MiB each
      tp::share_memory_(t);
    }
    std::exit(0);
  });
  EXPECT_EQ(wait_child(c, std::chrono::seconds(30)), 0);
}
