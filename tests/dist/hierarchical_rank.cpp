// One rank of the hierarchical backend's tests across hosts (tests/integration/
// hierarchical_test.sh starts it in two network namespaces, by `torchpar run` or with RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by hand).
//
//   hierarchical_rank check                every collective on Backend::kAuto (which must
//                                          resolve to hierarchical) against locally computed
//                                          results, then every dtype and op of all_reduce,
//                                          reduce and reduce_scatter against the flat Gloo
//                                          backend; prints "rank R: hierarchical check
//                                          passed (N comparisons)".
//   hierarchical_rank kill VICTIM          all_reduce in a loop; group rank VICTIM SIGKILLs
//                                          itself mid-loop; every other rank must raise
//                                          RankLostError naming VICTIM within the group
//                                          timeout (10 s); prints "rank R: lost VICTIM after
//                                          S s: <message>", then "rank R: left the world in
//                                          S s" once World::destroy returns.
// Exit 0 when the rank's expectations hold, 1 otherwise (the reason on stderr).
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "support/collective_checks.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using tp::testing::check_ops;

namespace {

using Clock = std::chrono::steady_clock;

/// Rank r's data for comparisons: small values, positive (PRODUCT stays finite), exact.
at::Tensor data(int r, int64_t n, at::ScalarType dt, int salt) {
  auto i = at::arange(n, at::kLong);
  return ((i * 5 + r * 3 + salt) % 3 + 1).to(dt);
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  return at::isFloatingType(a.scalar_type()) ? at::allclose(a, b, 1e-6, 1e-6) : at::equal(a, b);
}

/// all_reduce, reduce (to the last rank) and reduce_scatter of every dtype and op on `hier`
/// and `flat`: the results must agree. Returns the number of comparisons.
int compare_with_flat(tp::CollectiveGroup& hier, tp::CollectiveGroup& flat) {
  const int P = hier.size(), me = hier.rank();
  int checks = 0;
  const std::vector<at::ScalarType> dtypes{at::kFloat, at::kDouble, at::kInt,
                                           at::kLong,  at::kChar,   at::kByte};
  const std::vector<tp::ReduceOp> ops{tp::ReduceOp::kSum, tp::ReduceOp::kProduct,
                                      tp::ReduceOp::kMin, tp::ReduceOp::kMax, tp::ReduceOp::kAvg};
  for (auto dt : dtypes) {
    for (auto op : ops) {
      if (op == tp::ReduceOp::kAvg && !at::isFloatingType(dt)) continue;
      for (int64_t n : {int64_t{3}, int64_t{50000}}) {
        const std::string what =
            fmt::format("{} {} n={} rank {}", c10::toString(dt), tp::to_string(op), n, me);
        auto a = data(me, n, dt, 1), b = a.clone();
        hier.all_reduce(a, {.op = op});
        flat.all_reduce(b, {.op = op});
        TORCHPAR_RCHECK(same(a, b), "all_reduce {}: hierarchical and flat gloo differ", what);
        auto c = data(me, n, dt, 2), d = c.clone();
        hier.reduce(c, P - 1, {.op = op});
        flat.reduce(d, P - 1, {.op = op});
        if (me == P - 1) TORCHPAR_RCHECK(same(c, d), "reduce {}: results differ", what);
        std::vector<at::Tensor> in;
        for (int q = 0; q < P; ++q) in.push_back(data(me * P + q, n, dt, 3));
        auto e = at::zeros({n}, dt), f = at::zeros({n}, dt);
        hier.reduce_scatter(e, in, {.op = op});
        flat.reduce_scatter(f, in, {.op = op});
        TORCHPAR_RCHECK(same(e, f), "reduce_scatter {}: results differ", what);
        checks += 3;
      }
    }
  }
  // Every root, for the rooted collectives: a root on every host, leader or not.
  for (int root = 0; root < P; ++root) {
    auto a = data(me, 1000, at::kFloat, root), b = a.clone();
    hier.broadcast(a, root);
    flat.broadcast(b, root);
    TORCHPAR_RCHECK(at::equal(a, b), "broadcast from {}: results differ (rank {})", root, me);
    auto c = data(me, 1000, at::kLong, root), d = c.clone();
    hier.reduce(c, root, {.op = tp::ReduceOp::kSum});
    flat.reduce(d, root, {.op = tp::ReduceOp::kSum});
    if (me == root) TORCHPAR_RCHECK(at::equal(c, d), "reduce to {}: results differ", root);
    std::vector<at::Tensor> go, fo, in;
    if (me == root) {
      for (int q = 0; q < P; ++q) {
        go.push_back(at::zeros({77}, at::kInt));
        fo.push_back(at::zeros({77}, at::kInt));
        in.push_back(data(q + 10 * root, 77, at::kInt, 4));
      }
    }
    hier.gather(data(me, 77, at::kInt, root), go, root);
    flat.gather(data(me, 77, at::kInt, root), fo, root);
    for (size_t q = 0; q < go.size(); ++q)
      TORCHPAR_RCHECK(at::equal(go[q], fo[q]), "gather to {}: piece {} differs", root, q);
    auto s1 = at::zeros({77}, at::kInt), s2 = at::zeros({77}, at::kInt);
    hier.scatter(s1, in, root);
    flat.scatter(s2, in, root);
    TORCHPAR_RCHECK(at::equal(s1, s2), "scatter from {}: results differ (rank {})", root, me);
    checks += 4;
  }
  return checks;
}

int check(tp::World& world) {
  auto hier = world.create_collective_group();
  TORCHPAR_RCHECK(hier.backend() == tp::Backend::kHierarchical,
                  "Backend::kAuto across hosts resolved to {}, want hierarchical",
                  tp::to_string(hier.backend()));
  auto flat = world.create_collective_group({}, tp::Backend::kGloo);
  for (auto dt : {at::kFloat, at::kDouble, at::kInt, at::kLong}) {
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{70000}}) check_ops(hier, dt, n, true);
  }
  check_ops(hier, at::kFloat, 1 << 20, false);  // 4 MiB: the shm level's chunked paths
  int checks = compare_with_flat(hier, flat);
  // all_to_all and send/recv go over the flat group inside the hierarchical backend
  const int P = hier.size(), me = hier.rank();
  std::vector<at::Tensor> in, out;
  for (int q = 0; q < P; ++q) {
    in.push_back(at::full({5}, me * 100 + q, at::kLong));
    out.push_back(at::zeros({5}, at::kLong));
  }
  hier.all_to_all(out, in);
  for (int q = 0; q < P; ++q)
    TORCHPAR_RCHECK(at::equal(out[q], at::full({5}, q * 100 + me, at::kLong)), "all_to_all");
  auto s = hier.isend(at::full({4}, double(me)), (me + 1) % P, 3);
  auto r = at::zeros({4});
  TORCHPAR_RCHECK(
      hier.irecv(r, std::nullopt, 3).wait(std::chrono::duration<double>(30)) == (me + P - 1) % P,
      "irecv sender");
  s.wait(std::chrono::duration<double>(30));
  TORCHPAR_RCHECK(at::equal(r, at::full({4}, double((me + P - 1) % P))), "irecv value");
  hier.barrier();
  std::printf("rank %d: hierarchical check passed (%d comparisons with flat gloo)\n",
              world.get_rank(), checks);
  return 0;
}

int kill_test(tp::World& world, int victim) {
  const double timeout = 10;
  auto g =
      world.create_collective_group({}, tp::Backend::kAuto, std::chrono::duration<double>(timeout));
  TORCHPAR_RCHECK(g.backend() == tp::Backend::kHierarchical, "resolved to {}",
                  tp::to_string(g.backend()));
  auto t = at::ones({1 << 18});
  g.all_reduce(t);  // every rank is in
  Clock::time_point died_at{};
  for (int i = 0; i < 100000; ++i) {
    if (i == 30 && g.rank() == victim) ::kill(::getpid(), SIGKILL);
    if (i == 30) died_at = Clock::now();
    try {
      g.all_reduce(t);
    } catch (const tp::RankLostError& e) {
      const double s = std::chrono::duration<double>(Clock::now() - died_at).count();
      std::printf("rank %d: lost %d after %.2f s: %s\n", g.rank(), e.rank(), s,
                  e.what_without_backtrace());
      std::fflush(stdout);
      TORCHPAR_RCHECK(e.rank() == victim, "the error names group rank {}, want {}", e.rank(),
                      victim);
      TORCHPAR_RCHECK(s < timeout + 2, "raised after {:.2f} s, over the {} s timeout", s, timeout);
      // The group stays broken: the next call raises at once, naming the same rank.
      try {
        g.barrier();
      } catch (const tp::RankLostError& again) {
        TORCHPAR_RCHECK(again.rank() == victim, "a later call names {}", again.rank());
        return 0;
      }
      TORCHPAR_RCHECK(false, "a call after the loss succeeded");
    }
    t.fill_(1);
  }
  TORCHPAR_RCHECK(false, "rank {}: no error after the victim died", g.rank());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  tp::init(argc, argv);
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    tp::World world(tp::WorldOptions{.timeout = std::chrono::seconds(60)});
    if (mode == "check") return check(world);
    if (mode == "kill" && argc > 2) {
      const int rc = kill_test(world, std::stoi(argv[2]));
      // Leaving: rank 0, which serves the store, must not wait for the rank its group found
      // lost (it never leaves; before, rank 0 waited out 10 s here).
      const int me = world.get_rank();
      const auto t0 = Clock::now();
      world.destroy();
      std::printf("rank %d: left the world in %.2f s\n", me,
                  std::chrono::duration<double>(Clock::now() - t0).count());
      return rc;
    }
    std::fprintf(stderr, "usage: hierarchical_rank check | kill VICTIM\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %s: %s\n", std::getenv("RANK") ? std::getenv("RANK") : "?",
                 e.what());
    return 1;
  }
}
