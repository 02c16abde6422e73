// shm's raw segment type (ShmRegion) on its own: create, open, seals, refusals, and
// out-of-space as an error rather than a SIGBUS; map_shared_fd_noexcept in a forked child.
// The named creator owned by the cleaner (name retry, attach from a child, nothing left in
// /dev/shm after a SIGKILL), typed views, and the allocator's Segment built on a region.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "shm/cleaner.h"
#include "shm/segment.h"
#include "support/child.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using tp::detail::Segment;
using tp::detail::ShmRegion;

namespace {
int dup_fd(int fd) { return ::fcntl(fd, F_DUPFD_CLOEXEC, 0); }
std::string test_name(const char* tag) {
  return "/torchpar_" + std::to_string(::getpid()) + "_segtest_" + tag;
}
}  // namespace

TEST(ShmRegion, MemfdIsZeroedSealedAndSharedThroughItsFd) {
  ShmRegion r = ShmRegion::create_memfd(10000, "torchpar-test");
  ASSERT_EQ(r.size(), 10000u);
  for (uint64_t i = 0; i < r.size(); ++i) ASSERT_EQ(r.data()[i], 0);
  const int seals = ::fcntl(r.fd(), F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  EXPECT_EQ(::ftruncate(r.fd(), 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::ftruncate(r.fd(), 1 << 20), -1);
  EXPECT_EQ(errno, EPERM);
  ShmRegion other = ShmRegion::open_fd(tp::UniqueFd(dup_fd(r.fd())), 10000, "test");
  std::strcpy(r.data() + 100, "hello");
  EXPECT_STREQ(other.data() + 100, "hello");
  EXPECT_THROW(ShmRegion::create_memfd(0, "empty"), tp::ShmError);
}

TEST(ShmRegion, OpenRefusesUnsealedAndTooSmallFds) {
  const int raw = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(raw, 0);
  ASSERT_EQ(::ftruncate(raw, 1 << 16), 0);
  try {
    ShmRegion::open_fd(tp::UniqueFd(raw), 4096, "unsealed");
    FAIL() << "an unsealed fd was mapped";
  } catch (const tp::ShmError& e) {
    EXPECT_EQ(e.error_code(), EINVAL);
    EXPECT_NE(std::string(e.what()).find("sealed"), std::string::npos) << e.what();
  }
  ShmRegion small = ShmRegion::create_memfd(4096, "small");
  try {
    ShmRegion::open_fd(tp::UniqueFd(dup_fd(small.fd())), 8192, "small");
    FAIL() << "a too-small fd was mapped";
  } catch (const tp::ShmError& e) {
    EXPECT_EQ(e.error_code(), EINVAL);
  }
  const int pipe_fds[2] = {-1, -1};
  ASSERT_EQ(::pipe(const_cast<int*>(pipe_fds)), 0);
  ::close(pipe_fds[1]);
  EXPECT_THROW(ShmRegion::open_fd(tp::UniqueFd(pipe_fds[0]), 1, "pipe"), tp::ShmError);
}

TEST(ShmRegion, NamedCreateOpenExclusiveAndGone) {
  const std::string name = test_name("named");
  ::shm_unlink(name.c_str());
  {
    ShmRegion w = ShmRegion::create_owned(5000, [&] { return name; });
    EXPECT_EQ(w.fd(), -1) << "named regions keep no fd";
    EXPECT_EQ(w.name(), name);
    std::memset(w.data(), 'x', 5000);
    try {
      ShmRegion::create_owned(10, [&] { return name; });  // every name it is given exists
      FAIL() << "created twice";
    } catch (const tp::ShmError& e) {
      EXPECT_EQ(e.error_code(), EEXIST);
    }
    ShmRegion r = ShmRegion::open_named(name, /*writable=*/false);
    ASSERT_EQ(r.size(), 5000u);
    EXPECT_EQ(r.data()[4999], 'x');
    EXPECT_THROW(ShmRegion::open_named(name, false, 6000), tp::ShmError);
  }
  ASSERT_EQ(::shm_unlink(name.c_str()), 0);
  try {
    ShmRegion::open_named(name, false);
    FAIL();
  } catch (const tp::ShmError& e) {
    EXPECT_EQ(e.error_code(), ENOENT);
  }
  EXPECT_THROW(ShmRegion::open_named("/etc_passwd", false), tp::ShmError);
}

// A named object of another user is refused (EPERM, naming it and its owner): that user
// could truncate it under our mapping (a SIGBUS at the next access).
TEST(ShmRegion, OpenNamedRefusesAnotherUsersObject) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give an object to another user";
  const std::string name = test_name("foreign");
  ::shm_unlink(name.c_str());
  ShmRegion w = ShmRegion::create_owned(8192, [&] { return name; });
  ASSERT_EQ(::chown(("/dev/shm" + name).c_str(), 65534, 65534), 0);
  try {
    ShmRegion::open_named(name, /*writable=*/false);
    ADD_FAILURE() << "another user's object was mapped";
  } catch (const tp::ShmError& e) {
    EXPECT_EQ(e.error_code(), EPERM);
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("owned by uid 65534"), std::string::npos) << e.what();
  }
  ASSERT_EQ(::chown(("/dev/shm" + name).c_str(), ::geteuid(), ::getegid()), 0);
  EXPECT_EQ(ShmRegion::open_named(name, /*writable=*/false).size(), 8192u);
  ::shm_unlink(name.c_str());
}

TEST(ShmRegion, OutOfSpaceIsAnErrorNotASigbus) {
  auto c = tp::testing::fork_child([](int) -> int {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl {
      1 << 16, 1 << 16
    };
    if (::setrlimit(RLIMIT_FSIZE, &rl) != 0) return 3;
    try {
      ShmRegion::create_memfd(8 << 20, "too-big");
      return 1;  // reserved past the limit: a later write could SIGBUS
    } catch (const tp::ShmError& e) {
      return std::string(e.what()).find("asked") != std::string::npos ? 0 : 2;
    }
  });
  EXPECT_EQ(tp::testing::wait_child(c, std::chrono::seconds(30)), 0);
}

// What a spawn or forkserver child does with its error slot fd before anything else: map it
// without allocating or throwing. Failure is a nullptr, not an exception.
TEST(MapSharedFdNoexcept, MapsInAForkedChildAndFailsWithNullptr) {
  ShmRegion r = ShmRegion::create_memfd(4096, "torchpar-test-slot");
  const int fd = r.fd();
  auto c = tp::testing::fork_child([fd](int) -> int {
    void* p = tp::detail::map_shared_fd_noexcept(fd, 4096);
    if (p == nullptr) return 1;
    std::strcpy(static_cast<char*>(p), "from the child");
    return 0;
  });
  ASSERT_EQ(tp::testing::wait_child(c, std::chrono::seconds(30)), 0);
  EXPECT_STREQ(r.data(), "from the child");
  EXPECT_EQ(tp::detail::map_shared_fd_noexcept(-1, 4096), nullptr);
  EXPECT_EQ(tp::detail::map_shared_fd_noexcept(fd, 0), nullptr);
}

// The one named creator: a name that exists is retried with the maker's next one; the default
// maker names the object under this process's prefix, which its cleaner unlinks at exit.
TEST(ShmRegion, CreateOwnedRetriesAnExistingNameUnderThisProcessPrefix) {
  const std::string taken = test_name("taken"), fresh = test_name("fresh");
  ::shm_unlink(taken.c_str());
  ::shm_unlink(fresh.c_str());
  ShmRegion first = ShmRegion::create_owned(4096, [&] { return taken; });
  int calls = 0;
  ShmRegion second = ShmRegion::create_owned(4096, [&] { return ++calls == 1 ? taken : fresh; });
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(second.name(), fresh);
  ::shm_unlink(taken.c_str());
  ::shm_unlink(fresh.c_str());

  ShmRegion own = ShmRegion::create_owned(4096);
  EXPECT_EQ(own.name().rfind("/" + tp::detail::segment_prefix(::getpid()), 0), 0u) << own.name();
  EXPECT_EQ(tp::testing::shm_entries(own.name().substr(1)).size(), 1u);
  ::shm_unlink(own.name().c_str());
  EXPECT_TRUE(tp::testing::shm_entries(own.name().substr(1)).empty());
}

// A header laid out in the region, written by its creator and read (and answered) by another
// process that attaches by name.
TEST(ShmRegion, AChildProcessAttachesByName) {
  struct Header {
    uint64_t magic;
    uint32_t from_child;
  };
  ShmRegion r = ShmRegion::create_owned(8192);
  r.as<Header>().magic = 0x5052;
  const std::string name = r.name();
  auto c = tp::testing::fork_child([name](int) -> int {
    ShmRegion mine = ShmRegion::open_named(name, /*writable=*/true, 8192);
    if (mine.as<Header>().magic != 0x5052) return 1;
    mine.as<Header>().from_child = 7;
    return 0;
  });
  EXPECT_EQ(tp::testing::wait_child(c, std::chrono::seconds(30)), 0);
  EXPECT_EQ(r.as<Header>().from_child, 7u);
  ::shm_unlink(name.c_str());
}

// as<T>() and as_array<T>() check the view against the mapping: an error naming the sizes,
// never a pointer past the end.
TEST(ShmRegion, TypedViewsCheckSizeAndAlignment) {
  struct Big {
    char bytes[8192];
  };
  ShmRegion r = ShmRegion::create_memfd(4096, "torchpar-test-view");
  try {
    (void)r.as<Big>();
    FAIL() << "an 8192-byte view of a 4096-byte region";
  } catch (const tp::ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("8192"), std::string::npos) << what;
    EXPECT_NE(what.find("4096"), std::string::npos) << what;
  }
  EXPECT_EQ(&r.as<uint64_t>(4088), reinterpret_cast<uint64_t*>(r.data() + 4088));
  EXPECT_THROW((void)r.as<uint64_t>(4090), tp::ValueError);  // past the end
  EXPECT_THROW((void)r.as<uint64_t>(4), tp::ValueError);     // misaligned
  EXPECT_THROW((void)r.as<uint64_t>(UINT64_MAX - 3), tp::ValueError);
  EXPECT_EQ(r.as_array<uint32_t>(0, 1024), reinterpret_cast<uint32_t*>(r.data()));
  EXPECT_THROW((void)r.as_array<uint32_t>(0, 1025), tp::ValueError);
  EXPECT_THROW((void)r.as_array<uint32_t>(4, UINT64_MAX / 2), tp::ValueError);  // overflow
  ShmRegion empty;
  EXPECT_THROW((void)empty.as<char>(), tp::ValueError);
}

// Only torchpar names are created or opened: no path elsewhere in /dev/shm, no '/' inside.
TEST(ShmRegion, NamesOutsideTorchparAreRefused) {
  const std::vector<std::string> names = {"/etc_passwd", "/torchpar_x/../y", "torchpar_x",
                                          "/torchpar_" + std::string(300, 'a')};
  for (const std::string& bad : names) {
    try {
      ShmRegion::create_owned(4096, [&] { return bad; });
      ADD_FAILURE() << "created " << bad;
    } catch (const tp::ShmError& e) {
      EXPECT_EQ(e.error_code(), EINVAL) << bad;
      EXPECT_NE(std::string(e.what()).find("torchpar"), std::string::npos) << e.what();
    }
    try {
      ShmRegion::open_named(bad, /*writable=*/false);
      ADD_FAILURE() << "opened " << bad;
    } catch (const tp::ShmError& e) {
      EXPECT_EQ(e.error_code(), EINVAL) << bad;
    }
  }
}

// A process killed with SIGKILL leaves nothing in /dev/shm: its cleaner unlinks the names
// create_owned made (a raw region and a file_system Segment).
TEST(ShmRegion, OwnedNamesAreGoneAfterTheCreatorIsKilled) {
  auto c = tp::testing::fork_child([](int sock) -> int {
    ShmRegion r = ShmRegion::create_owned(1 << 16);
    auto seg = Segment::create(tp::SharingStrategy::kFileSystem, 4096, 2);
    tp::testing::send_line(sock, r.name() + " " + seg->name());
    tp::testing::recv_line(sock, std::chrono::seconds(60));  // killed before an answer
    return 0;
  });
  const std::string names = tp::testing::recv_line(c.sock);
  const std::string region_name = names.substr(0, names.find(' '));
  const std::string segment_name = names.substr(names.find(' ') + 1);
  const std::string prefix = tp::detail::segment_prefix(c.pid);
  EXPECT_EQ(region_name.rfind("/" + prefix, 0), 0u) << region_name;
  EXPECT_EQ(segment_name.rfind("/" + prefix, 0), 0u) << segment_name;
  EXPECT_EQ(tp::testing::shm_entries(prefix).size(), 2u);
  ::kill(c.pid, SIGKILL);
  EXPECT_EQ(tp::testing::wait_child(c, std::chrono::seconds(30)), -SIGKILL);
  // The cleaner notices the death and unlinks (up to 30 s: a loaded machine runs it late).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!tp::testing::shm_entries(prefix).empty() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_TRUE(tp::testing::shm_entries(prefix).empty());
}

// The allocator's Segment on a region: geometry in the header, counters zeroed, one mapping
// shared through the fd (sealed) or the name; the creator's destructor unlinks the name.
TEST(Segment, BothStrategiesShareBlocksAndCounters) {
  for (auto strategy : {tp::SharingStrategy::kFileDescriptor, tp::SharingStrategy::kFileSystem}) {
    auto seg = Segment::create(strategy, 8192, 3);
    ASSERT_EQ(seg->num_blocks(), 3u);
    EXPECT_EQ(seg->block_size(), 8192u);
    EXPECT_GE(seg->total_size(), 3u * 8192 + 4096);
    EXPECT_EQ(seg->block_ptr(2) - seg->block_ptr(0), 2 * 8192);
    for (uint32_t b = 0; b < 3; ++b) {
      EXPECT_EQ(seg->refs(b).load(), 0u);
      EXPECT_EQ(seg->exports(b).load(), 0u);
    }
    EXPECT_TRUE(seg->owned_here());
    auto peer = strategy == tp::SharingStrategy::kFileDescriptor
                    ? Segment::open_fd(tp::UniqueFd(dup_fd(seg->fd())))
                    : Segment::open_name(seg->name());
    EXPECT_EQ(peer->key(), seg->key());
    EXPECT_EQ(peer->ino(), seg->ino());
    EXPECT_FALSE(peer->owned_here());
    seg->refs(1).store(5);
    seg->exports(2).store(tp::detail::kPinnedExport);
    std::strcpy(seg->block_ptr(1), "block one");
    EXPECT_EQ(peer->refs(1).load(), 5u);
    EXPECT_EQ(peer->exports(2).load(), tp::detail::kPinnedExport);
    EXPECT_STREQ(peer->block_ptr(1), "block one");
    if (strategy == tp::SharingStrategy::kFileSystem) {
      const std::string name = seg->name();
      seg.reset();
      EXPECT_TRUE(tp::testing::shm_entries(name.substr(1)).empty()) << name;
    } else {
      EXPECT_EQ(::ftruncate(seg->fd(), 0), -1) << "a segment's memfd is sealed";
    }
  }
}

// A peer's object that is not a segment (no magic, or an unsealed memfd) is refused.
TEST(Segment, OpenRefusesWhatIsNotASealedSegment) {
  ShmRegion raw = ShmRegion::create_owned(8192);
  try {
    Segment::open_name(raw.name());
    ADD_FAILURE() << "a region without a segment header was opened";
  } catch (const tp::ShmError& e) {
    EXPECT_NE(std::string(e.what()).find("not a valid torchpar segment"), std::string::npos)
        << e.what();
  }
  ::shm_unlink(raw.name().c_str());
  const int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(::ftruncate(unsealed, 1 << 16), 0);
  EXPECT_THROW(Segment::open_fd(tp::UniqueFd(unsealed)), tp::ShmError);
}
