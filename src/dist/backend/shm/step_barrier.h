#pragma once
// The shm backend's step barrier and abort, over the control blocks of a mapped segment
// (segment_layout.h): one rank's view.

#include <chrono>
#include <cstdint>
#include <string>

#include "core/futex.h"
#include "dist/backend/shm/segment_layout.h"

namespace torchpar::detail::shm_backend {

/// The limit of one operation's waits, and what to call it in messages.
struct StepWait {
  /// When the operation gives up. Left at its default (the clock's epoch), it is set to
  /// now + timeout by the first wait that does not end within its spin (deadline_at): a call
  /// that never waits long reads no clock (~27 ns here, a seventh of a 4-byte all_reduce),
  /// and the limit then counts from the first long wait, at most a few ms after the call began.
  mutable SteadyClock::time_point deadline{};
  /// The operation's timeout, for messages ("within 8.0 s").
  std::chrono::duration<double> timeout{0};
  /// The operation and its number on the group, for messages ("all_reduce call #3").
  const char* op = "?";
  uint64_t call = 0;

  SteadyClock::time_point deadline_at() const {
    if (deadline == SteadyClock::time_point{}) {
      deadline = SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(timeout);
    }
    return deadline;
  }
};

/// Ranks meet at numbered steps: each arrives (publishes the step in its counter) and
/// waits for the others to reach it. One abort state per segment breaks the group for all.
///
/// Requires: `header` and `ctl` (`size` control blocks) point into a segment mapped by every
/// rank, zero-filled at creation; each rank's pid in its control block once it attached (0:
/// unknown, never declared dead). Steps of one rank increase by one.
/// Guarantees: wait_for returns only once rank q reached the step (acquire: its writes
/// before arriving are visible), or throws within the deadline plus one futex slice
/// (kMaxFutexSleep): TimeoutError at the deadline, RankLostError when q's process is gone
/// (checked every 50 ms) or the segment was aborted. A failure aborts the segment first, so
/// every other rank's wait throws too (and at once: abort wakes every futex waiter).
/// Waits spin (when `spin`), then yield, then sleep on the awaited counter's futex in slices.
/// Arrivals take no fence where the kernel offers membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)
/// (every rank registers at construction): a rank about to sleep issues one instead, which
/// either makes the arrival's store visible before it looks, or the arrival see it waiting.
/// Safety: one StepBarrier per rank and process; not thread-safe (a group runs one operation
/// at a time). abort() and throw_if_aborted() may be called from any rank at any time.
class StepBarrier {
 public:
  StepBarrier() = default;
  /// `name` names the group in messages; `spin`: busy-wait first (ranks <= cores).
  StepBarrier(Header* header, RankCtl* ctl, int rank, int size, std::string name, bool spin);

  /// Publishes that this rank reached `step` and wakes the ranks asleep on its counter.
  void arrive(uint32_t step);
  /// Waits until rank `q` reached `step` (see Guarantees). `pauses`: CPU pauses between two
  /// looks at q's counter while spinning; more than one for a wait expected to span several
  /// of q's arrivals, so that q's stores do not find its counter's line taken away each time.
  void wait_for(int q, uint32_t step, const StepWait& limit, int pauses = 1);
  /// arrive(step), then wait_for every other rank.
  void arrive_and_wait(uint32_t step, const StepWait& limit) {
    arrive(step);
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) wait_for(q, step, limit);
    }
  }

  /// Marks the segment aborted for `kind`, naming `failed_rank` (-1: none) with `message`
  /// (truncated to 511 bytes), and wakes every waiter of every rank. The first abort wins;
  /// returns whether this call was it. Never throws.
  bool abort(int failed_rank, const std::string& message,
             AbortKind kind = AbortKind::kLost) noexcept;
  /// Once the segment is aborted, throws "<name>: the group is broken: <message>" as the
  /// first abort's kind says: RankLostError(failed rank), TimeoutError or torchpar::Error
  /// (so every rank raises the same error for one event); returns otherwise.
  void throw_if_aborted() const;

 private:
  /// Aborts (see abort) and throws TimeoutError (`timeout`) or RankLostError(q) with `msg`.
  [[noreturn]] void fail(int q, const std::string& msg, bool timeout);

  Header* header_ = nullptr;
  RankCtl* ctl_ = nullptr;
  int rank_ = 0;
  int size_ = 0;
  std::string name_;
  bool spin_ = true;
  bool asymmetric_ = false;  // arrivals without a fence; sleepers issue a membarrier
};

}  // namespace torchpar::detail::shm_backend
