// detail::create_collective_group on a store the ranks already share (no World): the path of
// the Python package's c10d backend, which gets torch.distributed's PrefixStore over a
// FileStore or TCPStore. Forked ranks on a FileStore make an auto group (shm on one host)
// and a gloo group, all_reduce and send/recv on them; a rank that never joins makes the
// others raise TimeoutError naming it within the group's timeout; gloo_device_for finds the
// loopback address under a PrefixStore over a TCPStore.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <filesystem>
#include <string>

#include "dist/create_group.h"
#include "support/ranks.h"
#include "support/run_tests.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using tp::testing::run_ranks;
using namespace std::chrono_literals;

namespace {

std::string temp_store_path() {
  return (std::filesystem::temp_directory_path() /
          fmt::format("torchpar_create_group_test_{}_{}", ::getpid(),
                      std::chrono::steady_clock::now().time_since_epoch().count()))
      .string();
}

/// One FileStore per process for every group: c10d's FileStore removes its file once `n`
/// instances were destroyed, and a store opened after that point writes to the gone file.
tp::CollectiveGroup make(const c10::intrusive_ptr<c10d::Store>& file, int rank, int n,
                         tp::Backend backend, double timeout, const std::string& prefix) {
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, file);
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(r);
  return tp::detail::create_collective_group({.store = store,
                                              .rank = rank,
                                              .world_ranks = ranks,
                                              .timeout = std::chrono::duration<double>(timeout),
                                              .backend = backend,
                                              .label = "test group",
                                              .device = tp::detail::gloo_device_for(store)});
}

void ops_rank(int rank, int n, std::string path) {
  auto file = c10::make_intrusive<c10d::FileStore>(path, n);
  for (auto [backend, want] : {std::pair{tp::Backend::kAuto, tp::Backend::kShm},
                               std::pair{tp::Backend::kGloo, tp::Backend::kGloo}}) {
    auto g = make(file, rank, n, backend, 30, "g" + tp::to_string(backend));
    TORCHPAR_RCHECK(g.backend() == want, "backend {} resolved to {}", tp::to_string(backend),
                    tp::to_string(g.backend()));
    TORCHPAR_RCHECK(g.rank() == rank && g.size() == n, "rank/size");
    auto t = at::full({5}, static_cast<double>(rank + 1), at::kLong);
    g.all_reduce(t);
    TORCHPAR_RCHECK(t.eq(n * (n + 1) / 2).all().item<bool>(), "all_reduce sum on {}",
                    tp::to_string(want));
    if (rank == 0) {
      g.send(at::full({3}, 7.0f), 1);
    } else if (rank == 1) {
      auto got = at::zeros({3});
      TORCHPAR_RCHECK(g.recv(got, std::nullopt) == 0, "sender");
      TORCHPAR_RCHECK(got.eq(7).all().item<bool>(), "recv");
    }
    g.barrier();
    g.destroy();
  }
}

void lonely_rank(int rank, int n, std::string path) {
  if (rank == n - 1) return;  // never joins
  const auto start = std::chrono::steady_clock::now();
  try {
    make(c10::make_intrusive<c10d::FileStore>(path, n), rank, n, tp::Backend::kAuto, 1.5, "lonely");
  } catch (const tp::TimeoutError& e) {
    const std::string what = e.what_without_backtrace();
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    TORCHPAR_RCHECK(what.find(fmt::format("rank {} did not join", n - 1)) != std::string::npos,
                    "message: {}", what);
    TORCHPAR_RCHECK(took < 10, "took {:.1f} s", took);
    return;
  }
  throw std::runtime_error("no TimeoutError");
}

}  // namespace

TEST(CreateGroupOnStore, OpsOnFileStoreTwoAndThreeRanks) {
  for (int n : {2, 3}) {
    const std::string path = temp_store_path();
    auto res = run_ranks(n, 120, ops_rank, n, path);
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(res[r].exitcode, 0) << "n=" << n << " rank " << r << ": " << res[r].error;
    }
    std::filesystem::remove(path);
  }
}

TEST(CreateGroupOnStore, MissingRankTimesOutNamingIt) {
  const std::string path = temp_store_path();
  auto res = run_ranks(3, 60, lonely_rank, 3, path);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(res[r].exitcode, 0) << "rank " << r << ": " << res[r].error;
  std::filesystem::remove(path);
}

TEST(CreateGroupOnStore, GlooDeviceTowardsTheTcpStore) {
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.numWorkers = 1;
  o.waitWorkers = false;
  auto tcp = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
  auto store =
      c10::make_intrusive<c10d::PrefixStore>("a", c10::make_intrusive<c10d::PrefixStore>("b", tcp));
  ::unsetenv("GLOO_SOCKET_IFNAME");
  ::unsetenv("TORCHPAR_GLOO_ADDR");
  EXPECT_EQ(tp::detail::gloo_device_for(store).address, "127.0.0.1");
  EXPECT_EQ(tp::detail::gloo_device_for(store).interface, "");
}

int main(int argc, char** argv) {
  tp::init(argc, argv);
  return tp::testing::run_tests(argc, argv);
}
