#pragma once
// Checks of every collective of a group against results each rank computes locally: small
// integer data, exact in every dtype. Shared by collective_test (ranks on one host) and
// hierarchical_rank (ranks across network namespaces). Failures throw (TORCHPAR_RCHECK).

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <string>
#include <vector>

#include "support/ranks.h"
#include "torchpar/dist/collective_group.h"

namespace torchpar::testing {

namespace tp = torchpar;

/// Rank r's data for a test: small integers, exact in every dtype, different per rank.
inline at::Tensor make(int r, int64_t n, at::ScalarType dtype) {
  auto i = at::arange(n, at::kLong);
  return ((i * 7 + r * 13) % 11 + r + 1).to(dtype);
}

inline void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  TORCHPAR_RCHECK(got.scalar_type() == want.scalar_type(), "{}: dtype {} != {}", what,
                  c10::toString(got.scalar_type()), c10::toString(want.scalar_type()));
  TORCHPAR_RCHECK(got.sizes() == want.sizes(), "{}: shape differs", what);
  TORCHPAR_RCHECK(at::equal(got, want), "{}: values differ (first got {}, want {})", what,
                  got.reshape({-1})[0].item<double>(), want.reshape({-1})[0].item<double>());
}

inline at::Tensor stack_of(int P, int64_t n, at::ScalarType dt, int offset = 0, int mul = 1) {
  std::vector<at::Tensor> v;
  for (int r = 0; r < P; ++r) v.push_back(make(r * mul + offset, n, dt));
  return at::stack(v);
}

inline void check_ops(tp::CollectiveGroup& g, at::ScalarType dt, int64_t n, bool full) {
  const int P = g.size();
  const int me = g.rank();
  const std::string tag = fmt::format("[{} n={} P={} rank {}]", c10::toString(dt), n, P, me);
  const auto all = stack_of(P, n, dt);

  // all_reduce: every op, contiguous
  {
    auto t = make(me, n, dt);
    g.all_reduce(t, {.op = tp::ReduceOp::kSum});
    expect_equal(t, all.sum(0, false, dt), "all_reduce SUM " + tag);
  }
  {
    auto t = make(me, n, dt);
    g.all_reduce(t, {.op = tp::ReduceOp::kMax});
    expect_equal(t, std::get<0>(all.max(0)), "all_reduce MAX " + tag);
    t = make(me, n, dt);
    g.all_reduce(t, {.op = tp::ReduceOp::kMin});
    expect_equal(t, std::get<0>(all.min(0)), "all_reduce MIN " + tag);
  }
  if (full && dt != at::kHalf && dt != at::kBFloat16) {  // no local prod for these
    auto t = make(me, n, dt);
    g.all_reduce(t, {.op = tp::ReduceOp::kProduct});
    expect_equal(t, all.prod(0, false, dt), "all_reduce PRODUCT " + tag);
  }
  if (at::isFloatingType(dt)) {
    auto t = make(me, n, dt);
    g.all_reduce(t, {.op = tp::ReduceOp::kAvg});
    auto want = all.sum(0, false, dt) / P;
    TORCHPAR_RCHECK(at::allclose(t, want), "all_reduce AVG {}", tag);
  }
  // non-contiguous (every other element of a [n, 2] tensor); the other column is untouched
  {
    auto base = at::full({n, 2}, -1, dt);
    auto t = base.select(1, 0);
    t.copy_(make(me, n, dt));
    g.all_reduce(t, {.op = tp::ReduceOp::kSum});
    expect_equal(base.select(1, 0), all.sum(0, false, dt), "strided all_reduce " + tag);
    expect_equal(base.select(1, 1), at::full({n}, -1, dt), "strided neighbours " + tag);
  }
  // broadcast from the last rank
  {
    auto t = make(me, n, dt);
    g.broadcast(t, P - 1);
    expect_equal(t, make(P - 1, n, dt), "broadcast " + tag);
  }
  // all_gather
  {
    std::vector<at::Tensor> out;
    for (int q = 0; q < P; ++q) out.push_back(at::zeros({n}, dt));
    g.all_gather(out, make(me, n, dt));
    for (int q = 0; q < P; ++q) expect_equal(out[q], make(q, n, dt), "all_gather " + tag);
  }
  if (!full) return;
  // reduce to rank 1 % P: the others keep their input
  {
    const int dst = 1 % P;
    auto t = make(me, n, dt);
    g.reduce(t, dst, {.op = tp::ReduceOp::kSum});
    expect_equal(t, me == dst ? all.sum(0, false, dt) : make(me, n, dt), "reduce " + tag);
  }
  // gather to rank 0
  {
    std::vector<at::Tensor> out;
    if (me == 0) {
      for (int q = 0; q < P; ++q) out.push_back(at::zeros({n}, dt));
    }
    g.gather(make(me, n, dt), out, 0);
    for (int q = 0; q < static_cast<int>(out.size()); ++q) {
      expect_equal(out[q], make(q, n, dt), "gather " + tag);
    }
  }
  // scatter from rank 0: piece q is make(100 + q)
  {
    std::vector<at::Tensor> in;
    if (me == 0) {
      for (int q = 0; q < P; ++q) in.push_back(make(100 + q, n, dt));
    }
    auto t = at::zeros({n}, dt);
    g.scatter(t, in, 0);
    expect_equal(t, make(100 + me, n, dt), "scatter " + tag);
  }
  // reduce_scatter: rank r's piece q is make(r*P + q); I get the sum over r of make(r*P + me)
  {
    std::vector<at::Tensor> in;
    for (int q = 0; q < P; ++q) in.push_back(make(me * P + q, n, dt));
    auto t = at::zeros({n}, dt);
    g.reduce_scatter(t, in, {.op = tp::ReduceOp::kSum});
    expect_equal(t, stack_of(P, n, dt, me, P).sum(0, false, dt), "reduce_scatter " + tag);
  }
  // all_to_all: out[q] = rank q's piece for me = make(q*P + me)
  {
    std::vector<at::Tensor> in, out;
    for (int q = 0; q < P; ++q) {
      in.push_back(make(me * P + q, n, dt));
      out.push_back(at::zeros({n}, dt));
    }
    g.all_to_all(out, in);
    for (int q = 0; q < P; ++q) expect_equal(out[q], make(q * P + me, n, dt), "all_to_all " + tag);
  }
  // non-contiguous lists (columns of [n, 2] tensors), the call owning them: results reach
  // the caller's columns and the other columns stay untouched (small sizes only: the
  // copy-back does not depend on the size, and 4 oversubscribed ranks pay per call)
  if (n <= 1000) {
    std::vector<at::Tensor> bases, out, in;
    for (int q = 0; q < P; ++q) {
      bases.push_back(at::full({n, 2}, -1, dt));
      out.push_back(bases.back().select(1, 0));
      in.push_back(at::stack({make(me * P + q, n, dt), make(me * P + q, n, dt)}, 1).select(1, 1));
    }
    auto in0 = at::stack({make(me, n, dt), make(me, n, dt)}, 1).select(1, 0);
    g.all_gather(out, in0);
    for (int q = 0; q < P; ++q) {
      expect_equal(bases[q].select(1, 0), make(q, n, dt), "strided all_gather " + tag);
      expect_equal(bases[q].select(1, 1), at::full({n}, -1, dt),
                   "strided all_gather neighbours " + tag);
    }
    g.all_to_all(out, in);
    for (int q = 0; q < P; ++q) {
      expect_equal(bases[q].select(1, 0), make(q * P + me, n, dt), "strided all_to_all " + tag);
      expect_equal(bases[q].select(1, 1), at::full({n}, -1, dt),
                   "strided all_to_all neighbours " + tag);
    }
  }
}

}  // namespace torchpar::testing
