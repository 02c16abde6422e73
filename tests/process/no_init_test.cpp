// A program that does not call torchpar::init: spawn and forkserver must refuse with a
// clear error instead of re-running main in the child; fork still works.
#include <gtest/gtest.h>

#include "torchpar/torchpar.h"

namespace {
void noop(int) {}
}  // namespace

TEST(NoInit, SpawnAndForkserverExplainWhatIsMissing) {
  for (auto method : {torchpar::StartMethod::kSpawn, torchpar::StartMethod::kForkserver}) {
    torchpar::SpawnOptions o;
    o.start_method = method;
    try {
      torchpar::start_processes(noop, std::tuple<>(), 1, o);
      FAIL() << "no exception";
    } catch (const torchpar::Error& e) {
      EXPECT_NE(std::string(e.what()).find("torchpar::init(argc, argv)"), std::string::npos)
          << e.what();
    }
  }
  torchpar::SpawnOptions o;
  o.start_method = torchpar::StartMethod::kFork;
  o.join = false;
  auto ctx = torchpar::start_processes(noop, std::tuple<>(), 2, o);
  EXPECT_EQ(ctx.pids().size(), 2u);
  EXPECT_TRUE(ctx.join(std::chrono::seconds(60)));
}
