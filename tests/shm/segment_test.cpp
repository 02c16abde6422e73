// shm's raw segment type (ShmRegion) on its own: create, open, seals, refusals, and
// out-of-space as an error rather than a SIGBUS; map_shared_fd_noexcept in a forked child.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>

#include "shm/segment.h"
#include "support/child.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
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
    ShmRegion w = ShmRegion::create_named(name, 5000);
    EXPECT_EQ(w.fd(), -1) << "named regions keep no fd";
    std::memset(w.data(), 'x', 5000);
    try {
      ShmRegion::create_named(name, 10);
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
  ShmRegion w = ShmRegion::create_named(name, 8192);
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
