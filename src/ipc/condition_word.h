#pragma once
// ConditionWord: the wait/notify half of torchpar::Condition, without its lock, for a
// condition variable whose lock is something else (the Python package's Condition over its
// own Lock / RLock). A waiter enrolls while it holds the lock (so a notify made after its
// caller's check counts it) and gets a slot of its own, releases the lock however that lock
// is released, waits on its slot, and on a deadline leaves (or finds that a notify marked
// it meanwhile). notify(n) wakes exactly min(n, enrolled) waiters, the oldest first, and
// only waiters enrolled before it. At most 1000 waiters at once; a waiter's slot is freed
// by the next notify that finds its process dead. Internal: not public API.

#include <cstdint>
#include <memory>

#include "core/deadline.h"

namespace torchpar::detail {

class SharedPage;

class ConditionWord {
 public:
  /// A new word in its own shared page (zero: nobody waits).
  ConditionWord();
  /// The word at the start of `page` (a Condition's page, or one from a payload).
  explicit ConditionWord(std::shared_ptr<SharedPage> page);

  /// Enrolls the caller as a waiter; returns its slot. Errors: torchpar::Error past 1000
  /// waiters at once.
  uint32_t enroll();
  /// After enroll(): true once a notify marked the slot (the slot is free again); false when
  /// `deadline` passed first (still enrolled: wait again, or leave()).
  bool wait_ticket(uint32_t slot, const Deadline& deadline);
  /// Stops waiting after enroll(): false when the caller left, true when a notify had
  /// marked it first (the wait was notified). Frees the slot either way.
  bool leave(uint32_t slot);
  /// Wakes min(n, enrolled) waiters, oldest first; a notify with no waiter is not
  /// remembered.
  void notify(uint32_t n);
  /// Waiters enrolled and not yet notified; waiters notified that did not wake yet.
  uint32_t waiting() const;
  uint32_t tickets() const;

  const std::shared_ptr<SharedPage>& page() const { return page_; }

 private:
  std::shared_ptr<SharedPage> page_;
};

}  // namespace torchpar::detail
