// The shm backend's parts on their own: the reduce kernels against ATen's reductions for
// every op and dtype; the step barrier and its abort through a real ShmRegion, between
// threads and with forked children (every wait has a deadline, every child a watchdog).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <exception>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dist/backend/shm/segment_layout.h"
#include "dist/backend/shm/step_barrier.h"
#include "dist/reduce_kernels.h"
#include "shm/region.h"
#include "support/child.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using tp::ReduceOp;
using tp::detail::deadline_after;
using tp::detail::ShmRegion;
using tp::detail::SteadyClock;
using tp::detail::shm_backend::OpMeta;
using tp::detail::shm_backend::SegmentLayout;
using tp::detail::shm_backend::StepBarrier;
using tp::detail::shm_backend::StepWait;
using namespace std::chrono_literals;

namespace {

// ---- reduce kernels ------------------------------------------------------------------------

constexpr int kRanks = 3;
constexpr int64_t kNumel = 1031;  // odd: vector loops and their scalar epilogue

const std::vector<at::ScalarType> kNumericDtypes = {at::kByte,  at::kChar,   at::kShort,
                                                    at::kInt,   at::kLong,   at::kHalf,
                                                    at::kFloat, at::kDouble, at::kBFloat16};

/// Rank r's operand: small integers (negative too for signed dtypes), so that every sum and
/// product of kRanks operands is exact in every dtype and ATen's result is the only answer.
at::Tensor operand(int r, at::ScalarType dt) {
  auto i = at::arange(kNumel, at::kLong);
  auto v = (i * 7 + r * 5) % 4;         // 0..3
  if (at::isSignedType(dt)) v = v - 1;  // -1..2
  return v.to(dt);
}

/// op over ranks, in rank order, with the kernel: d = x0 op x1, then d = d op xr.
at::Tensor combine_all(ReduceOp op, at::ScalarType dt) {
  auto d = at::empty({kNumel}, dt);
  auto x0 = operand(0, dt), x1 = operand(1, dt);
  tp::detail::reduce_combine(d.data_ptr(), x0.data_ptr(), x1.data_ptr(), kNumel, dt, op);
  for (int r = 2; r < kRanks; ++r) {
    auto x = operand(r, dt);
    tp::detail::reduce_combine(d.data_ptr(), d.data_ptr(), x.data_ptr(), kNumel, dt, op);
  }
  return d;
}

at::Tensor stacked(at::ScalarType dt) {
  std::vector<at::Tensor> v;
  for (int r = 0; r < kRanks; ++r) v.push_back(operand(r, dt));
  return at::stack(v);
}

/// ATen's answer, computed in double (ATen has no prod for Half/BFloat16 on CPU) and cast
/// back: exact, because every intermediate value is a small integer.
at::Tensor reference(ReduceOp op, at::ScalarType dt) {
  const auto s = stacked(dt).to(at::kDouble);
  switch (op) {
    case ReduceOp::kSum:
      return at::sum(s, 0).to(dt);
    case ReduceOp::kProduct:
      return at::prod(s, 0).to(dt);
    case ReduceOp::kMin:
      return at::amin(s, 0).to(dt);
    case ReduceOp::kMax:
      return at::amax(s, 0).to(dt);
    case ReduceOp::kAvg:
      return (at::sum(s, 0) / kRanks).to(dt);
  }
  return {};
}

class ReduceKernels : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(ReduceKernels, EveryOpMatchesATen) {
  const auto dt = GetParam();
  for (auto op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax}) {
    EXPECT_NO_THROW(tp::detail::check_reducible(dt, op, "test"));
    EXPECT_TRUE(at::equal(combine_all(op, dt), reference(op, dt)))
        << tp::to_string(op) << " on " << c10::toString(dt);
  }
  if (at::isFloatingType(dt)) {
    // AVG: the kernel combines like SUM, reduce_divide divides by the group size.
    EXPECT_NO_THROW(tp::detail::check_reducible(dt, ReduceOp::kAvg, "test"));
    auto d = combine_all(ReduceOp::kAvg, dt);
    EXPECT_TRUE(at::equal(d, reference(ReduceOp::kSum, dt))) << "AVG combines like SUM";
    tp::detail::reduce_divide(d.data_ptr(), kNumel, dt, kRanks);
    const double tol = (dt == at::kHalf || dt == at::kBFloat16) ? 1e-2 : 1e-6;
    EXPECT_TRUE(
        at::allclose(d.to(at::kDouble), reference(ReduceOp::kAvg, dt).to(at::kDouble), tol, tol))
        << "AVG on " << c10::toString(dt);
  } else {
    EXPECT_THROW(tp::detail::check_reducible(dt, ReduceOp::kAvg, "test"), tp::Error)
        << "AVG on " << c10::toString(dt);
  }
}

std::string dtype_name(const ::testing::TestParamInfo<at::ScalarType>& param) {
  return c10::toString(param.param);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ReduceKernels, ::testing::ValuesIn(kNumericDtypes), dtype_name);

// Every vector loop this CPU runs gives the baseline loop's bits, NaN, signed zeros and
// infinities included (MIN/MAX pick an operand by `<`: a vector min/max instruction with its
// operands swapped would return the other NaN or zero), and the reference's on exact data.
// The dispatcher only ever runs the widest, so without this the others go untested here.
class CombineLoops : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(CombineLoops, EveryLoopGivesTheBaselineBits) {
  using tp::detail::CombineLoop;
  const auto dt = GetParam();
  auto specials = [&](int r) {
    auto v = operand(r, dt);
    const double nan = std::nan(""), inf = std::numeric_limits<double>::infinity();
    const std::vector<double> odd = {nan, -0.0, 0.0, inf, -inf, 1e-300, -nan};
    for (int64_t i = r; i < kNumel; i += 5) v[i] = odd[(i / 5 + r) % odd.size()];
    return v;
  };
  // Views of the result as integers: at::equal(NaN, NaN) is false.
  auto bits = [](const at::Tensor& t) {
    return t.view(t.scalar_type() == at::kFloat ? at::kInt : at::kLong);
  };
  int loops = 0;
  for (auto loop : {CombineLoop::kBaseline, CombineLoop::kAvx2, CombineLoop::kAvx512}) {
    if (!tp::detail::combine_loop_supported(loop)) {
      EXPECT_THROW(
          tp::detail::reduce_combine_with(loop, nullptr, nullptr, nullptr, 0, dt, ReduceOp::kSum),
          tp::Error);
      continue;
    }
    ++loops;
    for (auto op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax}) {
      const auto x0 = specials(0), x1 = specials(1);
      auto got = at::empty({kNumel}, dt), want = at::empty({kNumel}, dt);
      tp::detail::reduce_combine_with(loop, got.data_ptr(), x0.data_ptr(), x1.data_ptr(), kNumel,
                                      dt, op);
      tp::detail::reduce_combine_with(CombineLoop::kBaseline, want.data_ptr(), x0.data_ptr(),
                                      x1.data_ptr(), kNumel, dt, op);
      EXPECT_TRUE(at::equal(bits(got), bits(want)))
          << "loop " << static_cast<int>(loop) << ", " << tp::to_string(op) << " on "
          << c10::toString(dt);
      // Exact data: the loop against ATen (every loop, not only the one picked).
      const auto e0 = operand(0, dt), e1 = operand(1, dt);
      tp::detail::reduce_combine_with(loop, got.data_ptr(), e0.data_ptr(), e1.data_ptr(), kNumel,
                                      dt, op);
      const auto s = at::stack({e0, e1}).to(at::kDouble);
      const at::Tensor ref = op == ReduceOp::kSum       ? at::sum(s, 0)
                             : op == ReduceOp::kProduct ? at::prod(s, 0)
                             : op == ReduceOp::kMin     ? at::amin(s, 0)
                                                        : at::amax(s, 0);
      EXPECT_TRUE(at::equal(got, ref.to(dt))) << "loop " << static_cast<int>(loop) << ", "
                                              << tp::to_string(op) << " on " << c10::toString(dt);
    }
  }
  EXPECT_GE(loops, 1);
  EXPECT_THROW(tp::detail::reduce_combine_with(CombineLoop::kBaseline, nullptr, nullptr, nullptr, 0,
                                               at::kInt, ReduceOp::kSum),
               tp::Error);
}

INSTANTIATE_TEST_SUITE_P(FloatAndDouble, CombineLoops, ::testing::Values(at::kFloat, at::kDouble),
                         dtype_name);

TEST(ReduceKernels, BoolIsOrForSumMaxAndForProductMin) {
  std::vector<at::Tensor> v;
  for (int r = 0; r < kRanks; ++r) {
    v.push_back((at::arange(kNumel, at::kLong) * (r + 1) % 3).eq(0));  // mixed true/false
  }
  const auto s = at::stack(v);
  const auto any = s.any(0), all = s.all(0);
  auto run = [&](ReduceOp op) {
    auto d = at::empty({kNumel}, at::kBool);
    tp::detail::reduce_combine(d.data_ptr(), v[0].data_ptr(), v[1].data_ptr(), kNumel, at::kBool,
                               op);
    for (int r = 2; r < kRanks; ++r) {
      tp::detail::reduce_combine(d.data_ptr(), d.data_ptr(), v[r].data_ptr(), kNumel, at::kBool,
                                 op);
    }
    return d;
  };
  EXPECT_TRUE(at::equal(run(ReduceOp::kSum), any));
  EXPECT_TRUE(at::equal(run(ReduceOp::kMax), any));
  EXPECT_TRUE(at::equal(run(ReduceOp::kProduct), all));
  EXPECT_TRUE(at::equal(run(ReduceOp::kMin), all));
  EXPECT_FALSE(at::equal(any, all));  // the data tells the two apart
  EXPECT_THROW(tp::detail::check_reducible(at::kBool, ReduceOp::kAvg, "test"), tp::Error);
}

TEST(ReduceKernels, ComplexIsRefused) {
  try {
    tp::detail::check_reducible(at::kComplexFloat, ReduceOp::kSum, "CollectiveGroup::all_reduce");
    FAIL() << "complex accepted";
  } catch (const tp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("complex"), std::string::npos) << e.what();
  }
}

// ---- step barrier --------------------------------------------------------------------------

/// A group's segment in a sealed memfd: geometry written, every rank's pid this process'.
/// Forked children inherit the mapping.
struct Segment {
  explicit Segment(int nranks)
      : layout(SegmentLayout::of(nranks, 4096)),
        region(ShmRegion::create_memfd(layout.total_bytes, "shm_backend_test")) {
    layout.init_header(region.data());
    for (int r = 0; r < nranks; ++r) ctl()[r].pid = static_cast<int32_t>(::getpid());
  }
  tp::detail::shm_backend::Header* header() const { return SegmentLayout::header(region.data()); }
  tp::detail::shm_backend::RankCtl* ctl() const { return SegmentLayout::ctl(region.data()); }
  StepBarrier barrier(int rank) const {
    return StepBarrier(header(), ctl(), rank, layout.nranks, "test group", /*spin=*/false);
  }
  /// Rank r's word in the data slots for `step` (its slot of set step % 2).
  std::atomic_ref<uint64_t> word(uint32_t step, int r) const {
    char* p = layout.data(region.data()) +
              (static_cast<size_t>(step & 1) * layout.nranks + r) * layout.slot_bytes;
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(p));
  }

  SegmentLayout layout;
  ShmRegion region;
};

StepWait limit(std::chrono::duration<double> timeout) {
  return StepWait{
      .deadline = *deadline_after(timeout), .timeout = timeout, .op = "test_op", .call = 1};
}

uint64_t value(uint32_t step, int r) { return uint64_t{step} * 100 + static_cast<uint64_t>(r); }

/// `steps` steps as rank `r`: write my word, arrive and wait, check everyone's word.
/// Returns an empty string on success, else what went wrong.
std::string run_steps(const Segment& seg, int r, uint32_t steps) {
  auto b = seg.barrier(r);
  for (uint32_t k = 1; k <= steps; ++k) {
    seg.word(k, r).store(value(k, r), std::memory_order_relaxed);
    b.arrive_and_wait(k, limit(30s));
    for (int q = 0; q < seg.layout.nranks; ++q) {
      const auto got = seg.word(k, q).load(std::memory_order_relaxed);
      if (got != value(k, q)) {
        return "rank " + std::to_string(r) + " step " + std::to_string(k) + ": rank " +
               std::to_string(q) + "'s word is " + std::to_string(got);
      }
    }
  }
  return {};
}

// ---- segment layout ------------------------------------------------------------------------

// Tiny payloads (broadcast's ring, all_reduce's inline data) are copied by copy_inline: every
// length up to kInlineBytes, at every source and destination offset, copies exactly its bytes.
TEST(SegmentLayout, CopyInlineCopiesEveryLengthExactly) {
  constexpr size_t kMax = tp::detail::shm_backend::kInlineBytes;
  std::array<unsigned char, 3 * kMax> src{};
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 37 + 11);
  for (size_t n = 0; n <= kMax; ++n) {
    for (size_t so = 0; so < 8; ++so) {
      for (size_t dof = 0; dof < 8; ++dof) {
        std::array<unsigned char, 3 * kMax> dst;
        dst.fill(0xEE);
        tp::detail::shm_backend::copy_inline(dst.data() + dof, src.data() + so, n);
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= dof && i < dof + n;
          const unsigned char want = inside ? src[so + i - dof] : 0xEE;
          ASSERT_EQ(dst[i], want) << "n " << n << ", offsets " << so << "/" << dof << ", byte "
                                  << i;
        }
      }
    }
  }
}

// Ranks compare op_signature first and the full metadata only when signatures differ, so every
// field ranks must agree on has to change the signature; the call count must not.
TEST(SegmentLayout, OperationSignatureCoversEveryComparedField) {
  const OpMeta base{.op = 1, .dtype = 6, .numel = 4, .root = -1, .reduce_op = 0, .call = 7};
  const uint64_t sig = tp::detail::shm_backend::op_signature(base);
  OpMeta m = base;
  m.call = 8;
  EXPECT_EQ(tp::detail::shm_backend::op_signature(m), sig) << "the call count is not compared";
  const std::vector<std::pair<const char*, OpMeta>> changed = {
      {"op", OpMeta{2, 6, 4, -1, 0, 7}},
      {"dtype", OpMeta{1, 7, 4, -1, 0, 7}},
      {"numel", OpMeta{1, 6, 5, -1, 0, 7}},
      {"numel high bits", OpMeta{1, 6, 4 + (1LL << 40), -1, 0, 7}},
      {"root", OpMeta{1, 6, 4, 0, 0, 7}},
      {"reduce_op", OpMeta{1, 6, 4, -1, 1, 7}},
  };
  for (const auto& [field, other] : changed) {
    EXPECT_NE(tp::detail::shm_backend::op_signature(other), sig) << field;
  }
  // The counter, the signatures and the inline data share one cache line.
  EXPECT_LE(offsetof(tp::detail::shm_backend::RankCtl, inline_step) +
                sizeof(tp::detail::shm_backend::RankCtl::inline_step),
            64u);
}

TEST(StepBarrier, ThreadsMeetAtEveryStep) {
  constexpr int P = 3;
  Segment seg(P);
  std::vector<std::string> errors(P);
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      try {
        errors[r] = run_steps(seg, r, 500);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < P; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(StepBarrier, ThreadsAndAForkedChildMeetAtEveryStep) {
  constexpr int P = 3;
  Segment seg(P);
  auto child = tp::testing::fork_child([&seg](int) {
    seg.ctl()[2].pid = static_cast<int32_t>(::getpid());
    const std::string err = run_steps(seg, 2, 300);
    if (!err.empty()) throw std::runtime_error(err);
    return 0;
  });
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        errors[r] = run_steps(seg, r, 300);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(tp::testing::wait_child(child, 60s), 0);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(StepBarrier, AbortWakesAWaiterAsleepOnTheFutex) {
  Segment seg(2);
  std::string message;
  bool lost = false;
  auto t0 = SteadyClock::now(), t1 = t0;
  std::thread waiter([&] {
    auto b = seg.barrier(0);
    try {
      b.arrive_and_wait(1, limit(60s));  // rank 1 never arrives
    } catch (const tp::RankLostError& e) {
      lost = e.rank() == 1;
      message = e.what();
    } catch (const std::exception& e) {
      message = e.what();
    }
    t1 = SteadyClock::now();
  });
  // Abort once the waiter sleeps on the futex (it counts itself in `waiters` first).
  const auto until = SteadyClock::now() + 20s;
  while (seg.header()->waiters.load() == 0 && SteadyClock::now() < until) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_GT(seg.header()->waiters.load(), 0u) << "the waiter never slept on the futex";
  t0 = SteadyClock::now();
  EXPECT_TRUE(seg.barrier(1).abort(1, "rank 1 gave up: test abort"));
  EXPECT_FALSE(seg.barrier(1).abort(1, "a second abort")) << "the first abort wins";
  waiter.join();
  EXPECT_TRUE(lost) << message;
  EXPECT_NE(message.find("the group is broken: rank 1 gave up: test abort"), std::string::npos)
      << message;
  // Well before the 60 s deadline (and within one 100 ms futex slice even if the wake were
  // lost; the wake makes it immediate).
  EXPECT_LT(std::chrono::duration<double>(t1 - t0).count(), 10.0);
}

TEST(StepBarrier, AbortInTheParentWakesAWaiterInAForkedChild) {
  Segment seg(2);
  auto child = tp::testing::fork_child([&seg](int sock) {
    seg.ctl()[1].pid = static_cast<int32_t>(::getpid());
    tp::testing::send_line(sock, "ready");
    try {
      seg.barrier(1).arrive_and_wait(1, limit(60s));  // rank 0 never arrives
    } catch (const tp::RankLostError& e) {
      const std::string msg = e.what();
      return msg.find("parent aborts") != std::string::npos && e.rank() == 0 ? 0 : 2;
    }
    return 1;
  });
  EXPECT_EQ(tp::testing::recv_line(child.sock), "ready");
  const auto until = SteadyClock::now() + 20s;
  while (seg.header()->waiters.load() == 0 && SteadyClock::now() < until) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_TRUE(seg.barrier(0).abort(0, "parent aborts"));
  EXPECT_EQ(tp::testing::wait_child(child, 30s), 0);
}

TEST(StepBarrier, PeerThatNeverArrivesTimesOut) {
  Segment seg(2);
  auto b = seg.barrier(0);
  const auto t0 = SteadyClock::now();
  try {
    b.arrive_and_wait(1, limit(0.3s));
    FAIL() << "no timeout";
  } catch (const tp::TimeoutError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("did not reach test_op call #1 within 0.3 s"), std::string::npos) << msg;
  }
  EXPECT_GE(SteadyClock::now() - t0, 300ms);
  EXPECT_LT(SteadyClock::now() - t0, 10s);
  // The timeout broke the group for the others too, as a timeout (one error per event: the
  // late rank may be alive).
  try {
    seg.barrier(1).throw_if_aborted();
    FAIL() << "the segment was not aborted";
  } catch (const tp::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("the group is broken"), std::string::npos) << e.what();
  }
}

TEST(StepBarrier, DeadPeerIsReportedAsLost) {
  Segment seg(2);
  // A pid that existed and is gone: a child that exited and was reaped.
  const pid_t dead = ::fork();
  ASSERT_GE(dead, 0);
  if (dead == 0) ::_exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(dead, &status, 0), dead);
  seg.ctl()[1].pid = static_cast<int32_t>(dead);
  const auto t0 = SteadyClock::now();
  try {
    seg.barrier(0).arrive_and_wait(1, limit(30s));
    FAIL() << "no error";
  } catch (const tp::RankLostError& e) {
    EXPECT_EQ(e.rank(), 1);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 1 (pid " + std::to_string(dead) + ") died before finishing test_op"),
              std::string::npos)
        << msg;
  }
  EXPECT_LT(SteadyClock::now() - t0, 10s);  // found by the liveness check, not the deadline
}

}  // namespace
