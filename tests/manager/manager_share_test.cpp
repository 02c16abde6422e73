// ManagerOptions::share_tensors: tensor values through a Manager as shared-memory handles. A
// child (fork and spawn, each sharing strategy) puts a tensor in a dict; the parent's tensor
// read from the dict aliases the child's memory while the child keeps it, can be read again,
// and stays valid after the child exits. Without the option the parent gets a copy. Also
// the serializer's borrowing loads (LoadsContext::adopt_shared = false) that make repeated
// reads possible.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <tuple>

#include "support/manager.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

using tp::testing::child_options;
using tp::testing::exit_code;
using tp::testing::require;

using TensorDict = tp::DictProxy<std::string, at::Tensor>;
constexpr int64_t kNumel = 1024;

tp::ManagerOptions manager_options(bool share) {
  tp::ManagerOptions o = tp::testing::manager_options();
  o.share_tensors = share;
  return o;
}

/// The child: puts a zero tensor in the dict, waits until the parent has read it, writes
/// 42 into its own tensor, and keeps it until the parent says it is done.
void put_then_write(TensorDict d, tp::Connection ctl, std::string strategy) {
  tp::set_sharing_strategy(strategy);
  at::Tensor t = at::zeros({kNumel});
  d.set("t", t);
  require(tp::is_shared(t) == d.share_tensors(), "shared in place exactly when asked");
  ctl.send(std::string("set"));
  require(ctl.recv<std::string>(30s) == "read", "the parent's read");
  t.fill_(42);
  ctl.send(std::string("written"));
  require(ctl.recv<std::string>(30s) == "done", "the parent's done");
}

bool all_equal(const at::Tensor& t, float v) { return at::equal(t, at::full({kNumel}, v)); }

/// A client that never mapped the value: reading it after its sender exited raises
/// SerializationError naming the sender's exit.
void read_after_the_sender(TensorDict d) {
  try {
    (void)d.get("t");
  } catch (const tp::SerializationError& e) {
    require(std::string(e.what()).find("exited") != std::string::npos,
            std::string("the error names the sender's exit: ") + e.what());
    return;
  }
  throw std::runtime_error("a shared value was read after its sender exited");
}

/// How many torchpar-shm-cleaner processes watch `pid` (their argv: the program, the pid,
/// the name prefix). A process that exits while its cmdline is read (the read fails with
/// ESRCH, which istreambuf_iterator rethrows) is not counted.
int cleaners_of(pid_t pid) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    std::string cmdline;
    try {
      std::ifstream f(e.path() / "cmdline", std::ios::binary);
      cmdline.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    } catch (const std::ios_base::failure&) {
      continue;
    }
    if (cmdline.find("torchpar-shm-cleaner") != std::string::npos &&
        cmdline.find('\0' + std::to_string(pid) + '\0') != std::string::npos)
      ++n;
  }
  return n;
}

std::string method_and_strategy(
    const ::testing::TestParamInfo<std::tuple<std::string, std::string>>& param) {
  return std::get<0>(param.param) + "_" + std::get<1>(param.param);
}
std::string method_name(const ::testing::TestParamInfo<std::string>& param) { return param.param; }

// ---- with share_tensors ------------------------------------------------------------------

class ManagerShareTensors : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
};

TEST_P(ManagerShareTensors, ParentAliasesTheChildsTensor) {
  const auto& [method, strategy] = GetParam();
  tp::Manager m(manager_options(true));
  auto d = m.dict<std::string, at::Tensor>();
  EXPECT_TRUE(d.share_tensors());
  auto [mine, theirs] = tp::Pipe();
  tp::Process p(child_options(method), put_then_write, d, theirs, strategy);
  p.start();
  ASSERT_EQ(mine.recv<std::string>(60s), "set");
  at::Tensor a = *d.get("t");
  EXPECT_TRUE(tp::is_shared(a));
  EXPECT_TRUE(all_equal(a, 0));
  mine.send(std::string("read"));
  ASSERT_EQ(mine.recv<std::string>(30s), "written");
  EXPECT_TRUE(all_equal(a, 42)) << "the child's write is not seen: the parent got a copy";
  // A stored value can be read again (a borrowed handle, not adopted once), and both reads
  // alias the same memory.
  at::Tensor b = *d.get("t");
  EXPECT_TRUE(all_equal(b, 42));
  b.fill_(7);
  EXPECT_TRUE(all_equal(a, 7));
  mine.send(std::string("done"));
  EXPECT_EQ(exit_code(p), 0);
  // What was read stays mapped after the sender exited.
  EXPECT_TRUE(all_equal(a, 7));
  a.add_(1);
  EXPECT_TRUE(all_equal(b, 8));
  // The stored value pins its block for borrowers, which is no handle in flight: the
  // sender's cleaner unlinks the sender's names when it exits and ends (it kept them, and
  // lived, an hour), while this process's mapping stays valid.
  if (strategy == "file_system") {
    const std::string prefix = "torchpar_" + std::to_string(p.pid()) + "_";
    EXPECT_TRUE(
        tp::testing::eventually([&] { return tp::testing::shm_entries(prefix).empty(); }, 10s))
        << "the sender's /dev/shm names outlive it";
    EXPECT_TRUE(tp::testing::eventually([&] { return cleaners_of(p.pid()) == 0; }, 10s))
        << "the sender's torchpar-shm-cleaner is still running";
    EXPECT_TRUE(all_equal(a, 8));
  }
  // Elsewhere (a forkserver child: it inherits no mapping of ours) the value is gone with
  // its sender, with either strategy, and the read says so.
  tp::Process late(child_options("forkserver"), read_after_the_sender, d);
  late.start();
  const auto error = late.error();
  EXPECT_EQ(exit_code(late), 0) << (error ? error->first + ": " + error->second : "");
}

INSTANTIATE_TEST_SUITE_P(MethodsAndStrategies, ManagerShareTensors,
                         ::testing::Combine(::testing::Values("fork", "spawn"),
                                            ::testing::Values("file_descriptor", "file_system")),
                         method_and_strategy);

// ---- without it --------------------------------------------------------------------------

class ManagerCopiesTensors : public ::testing::TestWithParam<std::string> {};

TEST_P(ManagerCopiesTensors, ParentGetsACopy) {
  tp::Manager m(manager_options(false));
  auto d = m.dict<std::string, at::Tensor>();
  EXPECT_FALSE(d.share_tensors());
  auto [mine, theirs] = tp::Pipe();
  tp::Process p(child_options(GetParam()), put_then_write, d, theirs, std::string("file_system"));
  p.start();
  ASSERT_EQ(mine.recv<std::string>(60s), "set");
  at::Tensor a = *d.get("t");
  EXPECT_FALSE(tp::is_shared(a));
  mine.send(std::string("read"));
  ASSERT_EQ(mine.recv<std::string>(30s), "written");
  EXPECT_TRUE(all_equal(a, 0)) << "the child's write reached a copy";
  EXPECT_TRUE(all_equal(*d.get("t"), 0));  // the server's copy too
  mine.send(std::string("done"));
  EXPECT_EQ(exit_code(p), 0);
}

INSTANTIATE_TEST_SUITE_P(Methods, ManagerCopiesTensors, ::testing::Values("fork", "spawn"),
                         method_name);

// ---- the serializer's borrowing loads ----------------------------------------------------

TEST(LoadsContext, BorrowedHandlesLoadAnyNumberOfTimes) {
  at::Tensor t = at::zeros({16});
  const tp::Payload p = tp::detail::dumps_with(t, {.copy_tensor = false, .pass_fds = false});
  EXPECT_TRUE(tp::is_shared(t));  // moved to shared memory in place by dumps
  at::Tensor x = tp::detail::loads_with<at::Tensor>(p, {.adopt_shared = false});
  at::Tensor y = tp::detail::loads_with<at::Tensor>(p, {.adopt_shared = false});
  t.fill_(3);
  EXPECT_TRUE(at::equal(x, at::full({16}, 3.0f)));
  EXPECT_TRUE(at::equal(y, at::full({16}, 3.0f)));
  // An adopting load claims the payload's one export; borrowing needs it, so it is refused
  // afterwards rather than risking a block that may be reused.
  at::Tensor z = tp::loads<at::Tensor>(p);
  EXPECT_TRUE(at::equal(z, at::full({16}, 3.0f)));
  EXPECT_THROW(tp::detail::loads_with<at::Tensor>(p, {.adopt_shared = false}),
               tp::SerializationError);
  EXPECT_THROW(tp::loads<at::Tensor>(p), tp::SerializationError);  // loaded once, as before
}

TEST(LoadsContext, PinnedHandlesAreBorrowedNeverAdopted) {
  // DumpsContext::pin_shared, as a share_tensors proxy stores its values: borrowing loads
  // any number of times, before and after another pinning dumps of the same storage; an
  // adopting load is refused and leaves the pin in place.
  at::Tensor t = at::zeros({16});
  const tp::Payload p =
      tp::detail::dumps_with(t, {.copy_tensor = false, .pass_fds = false, .pin_shared = true});
  const tp::Payload again =
      tp::detail::dumps_with(t, {.copy_tensor = false, .pass_fds = false, .pin_shared = true});
  try {
    (void)tp::loads<at::Tensor>(p);
    ADD_FAILURE() << "an adopting load of a pinned handle succeeded";
  } catch (const tp::SerializationError& e) {
    EXPECT_NE(std::string(e.what()).find("adopt_shared=false"), std::string::npos) << e.what();
  }
  at::Tensor x = tp::detail::loads_with<at::Tensor>(p, {.adopt_shared = false});
  at::Tensor y = tp::detail::loads_with<at::Tensor>(again, {.adopt_shared = false});
  at::Tensor z = tp::detail::loads_with<at::Tensor>(p, {.adopt_shared = false});
  t.fill_(5);
  for (const auto& u : {x, y, z}) EXPECT_TRUE(at::equal(u, at::full({16}, 5.0f)));
  // An ordinary export of the same block is still one to claim, once.
  const tp::Payload once = tp::detail::dumps_with(t, {.copy_tensor = false, .pass_fds = false});
  EXPECT_TRUE(at::equal(tp::loads<at::Tensor>(once), at::full({16}, 5.0f)));
  EXPECT_THROW(tp::loads<at::Tensor>(once), tp::SerializationError);
  EXPECT_TRUE(at::equal(tp::detail::loads_with<at::Tensor>(p, {.adopt_shared = false}), t));
}

}  // namespace

int main(int argc, char** argv) { return tp::testing::manager_test_main(argc, argv); }
