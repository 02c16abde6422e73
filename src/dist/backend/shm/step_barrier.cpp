#include "dist/backend/shm/step_barrier.h"

#include <fmt/format.h>
#include <linux/membarrier.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstdio>

#include "core/cpu_relax.h"
#include "core/liveness.h"
#include "torchpar/core/error.h"

namespace torchpar::detail::shm_backend {
namespace {

bool reached(uint32_t seq, uint32_t target) { return static_cast<int32_t>(seq - target) >= 0; }

uint32_t* futex_word(std::atomic<uint32_t>& a) { return reinterpret_cast<uint32_t*>(&a); }

/// Registers this process as a target of MEMBARRIER_CMD_GLOBAL_EXPEDITED (idempotent; asked
/// again by every barrier, so a forked child that lost it registers too). False where the
/// kernel or a seccomp filter offers no such command: arrivals then keep their fence.
bool register_for_membarrier() {
  const long cmds = ::syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
  if (cmds < 0 || (cmds & MEMBARRIER_CMD_GLOBAL_EXPEDITED) == 0) return false;
  return ::syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0) == 0;
}

}  // namespace

StepBarrier::StepBarrier(Header* header, RankCtl* ctl, int rank, int size, std::string name,
                         bool spin)
    : header_(header),
      ctl_(ctl),
      rank_(rank),
      size_(size),
      name_(std::move(name)),
      spin_(spin),
      asymmetric_(register_for_membarrier()) {}

void StepBarrier::arrive(uint32_t step) {
  // sched_getcpu reads the kernel's rseq area (glibc 2.35+): no system call.
  ctl_[rank_].cpu.store(::sched_getcpu(), std::memory_order_relaxed);
  if (asymmetric_) {
    // A plain store: a fence here (a locked exchange) drained the store buffer, so every
    // arrival waited for its pending stores' cache lines, such as a broadcast root's ring
    // entry that a reader still held (issue 19: 1 locked instruction ~20 ns, 5 ~50 ns on
    // a 4-byte publish between two processes). The processor may now read `waiters` before
    // the store is visible; a rank about to sleep issues a membarrier between counting
    // itself and reading our counter (wait_for), which rules out that both miss.
    ctl_[rank_].seq.store(step, std::memory_order_release);
    std::atomic_signal_fence(std::memory_order_seq_cst);  // the compiler keeps the order
  } else {
    ctl_[rank_].seq.store(step, std::memory_order_seq_cst);
  }
  if (header_->waiters.load(std::memory_order_seq_cst) != 0) {
    futex_wake_n(futex_word(ctl_[rank_].seq), INT_MAX);
  }
}

void StepBarrier::wait_for(int q, uint32_t step, const StepWait& limit, int pauses) {
  auto& seq = ctl_[q].seq;
  if (reached(seq.load(std::memory_order_acquire), step)) return;
  if (spin_) {
    // Spin, but give the core away every kYieldEvery pauses: when the awaited rank shares this
    // core (the other cores busy, or an affinity mask), it cannot arrive until this rank
    // stops running, and a pure spin cost each collective the whole budget (~0.7 ms here: the
    // bimodal 4-byte all_reduce of issue 19). sched_yield returns at once when nothing else
    // is runnable on this core, so a peer on another core still sees a pure spin's latency
    // for its first kYieldEvery pauses (a few microseconds).
    // When the awaited rank last arrived on this very core, yield at once instead: it is
    // most likely queued behind us. That is the state of freshly forked ranks, which start
    // on their parent's core until the scheduler's load balancing moves one (a few ms):
    // 128 pauses (~7 us) per hand-off made the 4-byte all_reduce 15-17 us there, against
    // 0.5-1 us on two cores (issue 19's other bimodal row).
    constexpr int kYieldEvery = 128;
    constexpr int kCheckCoreEvery = 8;
    const auto& peer_cpu = ctl_[q].cpu;
    int until_look = pauses;  // a countdown: no division on the spin's hot path
    for (int i = 1; i <= 20000; ++i) {
      cpu_relax();
      if (--until_look > 0) continue;
      until_look = pauses;
      if (reached(seq.load(std::memory_order_acquire), step)) return;
      if (i % kYieldEvery == 0 || (i % kCheckCoreEvery == 0 &&
                                   peer_cpu.load(std::memory_order_relaxed) == ::sched_getcpu())) {
        ::sched_yield();
      }
    }
  }
  for (int i = 0; i < 50; ++i) {
    ::sched_yield();
    if (reached(seq.load(std::memory_order_acquire), step)) return;
  }
  auto last_check = SteadyClock::now();
  for (;;) {
    // Count ourselves as a waiter before the last look: an arriving rank that stores after
    // that look sees the count and wakes us.
    header_->waiters.fetch_add(1, std::memory_order_seq_cst);
    // Arrivals take no fence (asymmetric_): this one, on every CPU running a registered
    // process, either makes q's arrival visible to the look below, or orders q's next read
    // of `waiters` after our count, so that q wakes us. Once per sleep slice (~1 us).
    if (asymmetric_) ::syscall(SYS_membarrier, MEMBARRIER_CMD_GLOBAL_EXPEDITED, 0, 0);
    const uint32_t seen = seq.load(std::memory_order_seq_cst);
    if (!reached(seen, step) && header_->aborted.load() == 0) {
      futex_wait_until(futex_word(seq), seen, limit.deadline_at());
    }
    header_->waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(seq.load(std::memory_order_acquire), step)) return;
    throw_if_aborted();
    const auto now = SteadyClock::now();
    if (now >= limit.deadline_at()) {
      fail(q,
           fmt::format("{}: rank {} (pid {}) did not reach {} call #{} within {:.1f} s", name_, q,
                       ctl_[q].pid, limit.op, limit.call, limit.timeout.count()),
           /*timeout=*/true);
    }
    if (now - last_check > std::chrono::milliseconds(50)) {
      last_check = now;
      if (!pid_alive(ctl_[q].pid)) {
        fail(q,
             fmt::format("{}: rank {} (pid {}) died before finishing {} call #{}", name_, q,
                         ctl_[q].pid, limit.op, limit.call),
             /*timeout=*/false);
      }
    }
  }
}

bool StepBarrier::abort(int failed_rank, const std::string& message, AbortKind kind) noexcept {
  uint32_t expected = 0;
  const bool first = header_->aborted.compare_exchange_strong(expected, 1);
  if (first) {
    header_->failed_rank = failed_rank;
    header_->abort_kind = static_cast<int32_t>(kind);
    std::snprintf(header_->abort_msg, sizeof(header_->abort_msg), "%s", message.c_str());
    header_->aborted.store(2);
  }
  // Whoever sleeps on any counter wakes, sees the abort and throws.
  for (int r = 0; r < size_; ++r) futex_wake_n(futex_word(ctl_[r].seq), INT_MAX);
  return first;
}

void StepBarrier::throw_if_aborted() const {
  if (header_->aborted.load(std::memory_order_acquire) == 0) return;
  // 1: the aborting rank is writing the message; it takes no lock and cannot block.
  while (header_->aborted.load(std::memory_order_acquire) == 1) ::sched_yield();
  const std::string msg = fmt::format("{}: the group is broken: {}", name_, header_->abort_msg);
  switch (static_cast<AbortKind>(header_->abort_kind)) {
    case AbortKind::kTimeout:
      throw TimeoutError(msg);
    case AbortKind::kError:
      throw Error(msg);
    case AbortKind::kLost:
      break;
  }
  throw RankLostError(header_->failed_rank, msg);
}

void StepBarrier::fail(int q, const std::string& msg, bool timeout) {
  abort(q, msg, timeout ? AbortKind::kTimeout : AbortKind::kLost);
  if (timeout) throw TimeoutError(msg);
  throw RankLostError(q, msg);
}

}  // namespace torchpar::detail::shm_backend
