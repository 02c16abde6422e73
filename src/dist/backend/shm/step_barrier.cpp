#include "dist/backend/shm/step_barrier.h"

#include <fmt/format.h>
#include <linux/membarrier.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>

#include "core/liveness.h"
#include "core/waiter.h"
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
  uint32_t* seq = futex_word(ctl_[q].seq);
  const auto arrived = [step](uint32_t v) { return reached(v, step); };
  if (arrived(atomic_word(*seq).load(std::memory_order_acquire))) return;
  // Spin, but give the core away every 128 pauses: when the awaited rank shares this core
  // (the other cores busy, or an affinity mask), it cannot arrive until this rank stops
  // running, and a pure spin cost each collective the whole budget (~0.7 ms here: the
  // bimodal 4-byte all_reduce of issue 19). sched_yield returns at once when nothing else is
  // runnable on this core, so a peer on another core still sees a pure spin's latency for
  // its first 128 pauses (a few microseconds).
  // When the awaited rank last arrived on this very core (asked every 8 pauses), yield at
  // once instead: it is most likely queued behind us. That is the state of freshly forked
  // ranks, which start on their parent's core until the scheduler's load balancing moves one
  // (a few ms): 128 pauses (~7 us) per hand-off made the 4-byte all_reduce 15-17 us there,
  // against 0.5-1 us on two cores (issue 19's other bimodal row).
  // Then 50 yields, then sleep.
  pauses = std::max(pauses, 1);
  const SpinPolicy spin{.looks = spin_ ? 20000 / pauses : 0,
                        .pauses = pauses,
                        .yield_every = 128,
                        .hint_every = 8,
                        .yields = 50};
  const auto& peer_cpu = ctl_[q].cpu;
  const auto on_my_core = [&peer_cpu] {
    return peer_cpu.load(std::memory_order_relaxed) == ::sched_getcpu();
  };
  if (spin_until(seq, arrived, spin, nullptr, on_my_core)) return;
  // Asleep: counted in header_->waiters, which arrive() looks at; an abort also ends it.
  const auto arrived_or_aborted = [&](uint32_t v) {
    return arrived(v) || header_->aborted.load() != 0;
  };
  const Deadline deadline = limit.deadline_at();
  // Looked at only when the deadline has not passed: a rank gone at the deadline is
  // reported as the timeout, as the deadline comes first.
  const auto alive = [&] { return deadline.expired() || pid_alive(ctl_[q].pid); };
  // Arrivals take no fence (asymmetric_): this one, on every CPU running a registered
  // process, either makes q's arrival visible to the look that decides to sleep, or orders
  // q's next read of `waiters` after our count, so that q wakes us. Once per slice (~1 us).
  const auto membarrier = [this] {
    if (asymmetric_) ::syscall(SYS_membarrier, MEMBARRIER_CMD_GLOBAL_EXPEDITED, 0, 0);
  };
  const WaitOptions o{.sleep = {.check_every = std::chrono::milliseconds(50)},
                      .sleeper = SleeperMark::count(futex_word(header_->waiters))};
  switch (sleep_until(seq, arrived_or_aborted, deadline, o, alive, membarrier)) {
    case WaitStatus::kReady:
      if (arrived(atomic_word(*seq).load(std::memory_order_acquire))) return;
      throw_if_aborted();
      return;  // unreachable: the abort flag is never cleared
    case WaitStatus::kTimedOut:
      fail(q,
           fmt::format("{}: rank {} (pid {}) did not reach {} call #{} within {:.1f} s", name_, q,
                       ctl_[q].pid, limit.op, limit.call, limit.timeout.count()),
           /*timeout=*/true);
    case WaitStatus::kGone:
    case WaitStatus::kSlept:
      break;
  }
  fail(q,
       fmt::format("{}: rank {} (pid {}) died before finishing {} call #{}", name_, q, ctl_[q].pid,
                   limit.op, limit.call),
       /*timeout=*/false);
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
