#include "torchpar/ipc/synchronize.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include <fmt/format.h>

#include "core/robust_mutex.h"
#include "core/waiter.h"
#include "ipc/condition_word.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"
#include "torchpar/serialize/archive.h"

namespace torchpar {
namespace detail {
namespace {

constexpr uint32_t kMagic = 0x434e5953;  // "SYNC"

struct MutexState {
  uint32_t magic;
  pthread_mutex_t mu;
  uint32_t depth;  // recursion depth of the holder; written only by the holder
};

struct SemState {
  uint32_t magic;
  uint32_t value;  // futex word
  uint32_t bound;  // 0: unbounded
};

struct EventState {
  uint32_t magic;
  uint32_t flag;  // futex word
};

// A Condition's waiters, one slot each: a waiter claims a free slot while it holds the
// lock (with the next sequence number and its pid) and sleeps on the slot's own word;
// notify(n) marks the n oldest waiting slots notified and wakes each. A notify thus wakes
// only waiters enrolled before it (a later waiter cannot take the wake-up meant for an
// earlier one), in FIFO order, exactly min(n, waiting); a slot whose process died is freed
// instead of being notified. A waiter that times out frees its slot, unless a notify marked
// it first (then its wait was notified).
constexpr uint32_t kCondSlots = 1000;
enum CondSlotState : uint32_t { kSlotFree = 0, kSlotClaimed, kSlotWaiting, kSlotNotified };
struct CondSlot {
  uint32_t state;  // futex word, CondSlotState
  uint32_t seq;    // enrollment order (compared with wrap-around)
  int32_t pid;     // the waiter's process
};
struct CondState {
  uint32_t magic;
  uint32_t next_seq;
  CondSlot slots[kCondSlots];
};

struct BarrierState {
  uint32_t magic;
  pthread_mutex_t mu;
  uint32_t generation;  // futex word, bumped when the barrier trips, resets or breaks
  uint32_t parties;
  uint32_t count;
  uint32_t broken;
  uint32_t broken_rounds[16];  // generation + 1 of recently broken rounds (ring by generation)
};

template <class S>
S* state(const std::shared_ptr<SharedPage>& p) {
  return static_cast<S*>(p->data());
}

// Returns {acquired, owner_died}.
std::pair<bool, bool> lock_mutex(pthread_mutex_t* m, Timeout timeout) {
  const LockStatus st = lock_robust(m, Deadline::after(timeout));
  return {st != LockStatus::kTimedOut, st == LockStatus::kOwnerDied};
}

template <class S>
std::shared_ptr<SharedPage> load_page(InputArchive& ar) {
  auto page = SharedPage::load(ar, sizeof(S));
  if (state<S>(page)->magic != kMagic)
    throw SerializationError("not a torchpar synchronization object");
  return page;
}

}  // namespace
}  // namespace detail

using detail::atomic_word;
using detail::state;

// ---- Lock / RLock -----------------------------------------------------------------

Lock::Lock() : Lock(false) {}
Lock::Lock(bool recursive)
    : page_(detail::SharedPage::create(sizeof(detail::MutexState), "torchpar-lock")) {
  auto* s = state<detail::MutexState>(page_);
  detail::init_robust_mutex(&s->mu, recursive);
  s->magic = detail::kMagic;
}
RLock::RLock() : Lock(true) {}

bool Lock::acquire(Timeout timeout) {
  auto* s = state<detail::MutexState>(page_);
  auto [ok, died] = detail::lock_mutex(&s->mu, timeout);
  if (ok) {
    owner_died_ = died;
    s->depth = died ? 1 : s->depth + 1;
  }
  return ok;
}

void Lock::release() {
  auto* s = state<detail::MutexState>(page_);
  const uint32_t depth = s->depth;
  if (depth > 0) s->depth = depth - 1;
  const int r = ::pthread_mutex_unlock(&s->mu);
  if (r != 0) {
    s->depth = depth;
    throw Error(fmt::format("release of a lock this thread does not hold ({})", std::strerror(r)));
  }
}

uint32_t Lock::release_all() {
  const uint32_t depth = state<detail::MutexState>(page_)->depth;
  for (uint32_t i = 0; i < depth; ++i) release();
  return depth;
}

void Lock::acquire_n(uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) acquire();
}

void Lock::save(detail::OutputArchive& ar) const { detail::SharedPage::save(ar, page_); }
void Lock::load(detail::InputArchive& ar) { page_ = detail::load_page<detail::MutexState>(ar); }

// ---- Semaphore ----------------------------------------------------------------------

Semaphore::Semaphore(uint32_t value) : Semaphore(value, false) {}
Semaphore::Semaphore(uint32_t value, bool bounded)
    : page_(detail::SharedPage::create(sizeof(detail::SemState), "torchpar-semaphore")) {
  auto* s = state<detail::SemState>(page_);
  s->value = value;
  s->bound = bounded ? value : 0;
  s->magic = detail::kMagic;
}
BoundedSemaphore::BoundedSemaphore(uint32_t value) : Semaphore(value, true) {}

bool Semaphore::acquire(Timeout timeout) {
  auto* s = state<detail::SemState>(page_);
  const auto deadline = detail::Deadline::after(timeout);
  const auto nonzero = [](uint32_t v) { return v != 0; };
  for (;;) {
    uint32_t v = atomic_word(s->value).load();
    while (v > 0) {
      if (atomic_word(s->value).compare_exchange_weak(v, v - 1)) return true;
    }
    // Timeout zero or negative: the deadline has passed, the wait looks once.
    if (detail::wait_until(&s->value, nonzero, deadline) != detail::WaitStatus::kReady)
      return false;
  }
}

void Semaphore::release() {
  auto* s = state<detail::SemState>(page_);
  uint32_t v = atomic_word(s->value).load();
  do {
    if (s->bound != 0 && v >= s->bound)
      throw Error(fmt::format("BoundedSemaphore released too many times (bound {})", s->bound));
  } while (!atomic_word(s->value).compare_exchange_weak(v, v + 1));
  detail::futex_wake_n(&s->value, 1);
}

uint32_t Semaphore::get_value() const {
  return atomic_word(state<detail::SemState>(page_)->value).load();
}
void Semaphore::save(detail::OutputArchive& ar) const { detail::SharedPage::save(ar, page_); }
void Semaphore::load(detail::InputArchive& ar) { page_ = detail::load_page<detail::SemState>(ar); }

// ---- Event --------------------------------------------------------------------------

Event::Event() : page_(detail::SharedPage::create(sizeof(detail::EventState), "torchpar-event")) {
  state<detail::EventState>(page_)->magic = detail::kMagic;
}

void Event::set() {
  auto* s = state<detail::EventState>(page_);
  atomic_word(s->flag).store(1);
  detail::futex_wake_n(&s->flag, INT32_MAX);
}

void Event::clear() { atomic_word(state<detail::EventState>(page_)->flag).store(0); }
bool Event::is_set() const {
  return atomic_word(state<detail::EventState>(page_)->flag).load() != 0;
}

bool Event::wait(Timeout timeout) {
  auto* s = state<detail::EventState>(page_);
  const auto set = [](uint32_t flag) { return flag != 0; };
  if (set(atomic_word(s->flag).load())) return true;
  const auto st = detail::wait_until(&s->flag, set, detail::Deadline::after(timeout));
  return st == detail::WaitStatus::kReady;
}

void Event::save(detail::OutputArchive& ar) const { detail::SharedPage::save(ar, page_); }
void Event::load(detail::InputArchive& ar) { page_ = detail::load_page<detail::EventState>(ar); }

// ---- Condition ------------------------------------------------------------------------

namespace detail {
ConditionWord::ConditionWord()
    : page_(SharedPage::create(sizeof(CondState), "torchpar-condition")) {
  state<CondState>(page_)->magic = kMagic;
}
ConditionWord::ConditionWord(std::shared_ptr<SharedPage> page) : page_(std::move(page)) {
  if (page_->size() < sizeof(CondState) || state<CondState>(page_)->magic != kMagic)
    throw SerializationError("not a torchpar condition");
}

uint32_t ConditionWord::enroll() {
  auto* s = state<CondState>(page_);
  for (uint32_t i = 0; i < kCondSlots; ++i) {
    CondSlot& slot = s->slots[i];
    uint32_t expected = kSlotFree;
    if (!atomic_word(slot.state).compare_exchange_strong(expected, kSlotClaimed)) continue;
    slot.seq = atomic_word(s->next_seq).fetch_add(1);
    slot.pid = static_cast<int32_t>(::getpid());
    atomic_word(slot.state).store(kSlotWaiting);
    return i;
  }
  throw Error(fmt::format("Condition: more than {} waiters at once", kCondSlots));
}

namespace {
CondSlot& slot_of(CondState* s, uint32_t slot) {
  if (slot >= kCondSlots) throw ValueError(fmt::format("Condition: no waiter slot {}", slot));
  return s->slots[slot];
}
}  // namespace

bool ConditionWord::wait_ticket(uint32_t slot, const Deadline& deadline) {
  CondSlot& c = slot_of(state<CondState>(page_), slot);
  const auto notified = [](uint32_t v) { return v != kSlotWaiting; };
  if (wait_until(&c.state, notified, deadline) != WaitStatus::kReady) return false;
  atomic_word(c.state).store(kSlotFree);
  return true;
}

bool ConditionWord::leave(uint32_t slot) {
  CondSlot& c = slot_of(state<CondState>(page_), slot);
  uint32_t expected = kSlotWaiting;
  if (atomic_word(c.state).compare_exchange_strong(expected, kSlotFree)) return false;
  atomic_word(c.state).store(kSlotFree);  // a notify marked it first: the wait was notified
  return true;
}

void ConditionWord::notify(uint32_t n) {
  auto* s = state<CondState>(page_);
  while (n > 0) {
    CondSlot* oldest = nullptr;
    for (auto& c : s->slots) {
      if (atomic_word(c.state).load() != kSlotWaiting) continue;
      if (oldest == nullptr || static_cast<int32_t>(c.seq - oldest->seq) < 0) oldest = &c;
    }
    if (oldest == nullptr) return;  // nobody waits: a notify is not remembered (as in Python)
    uint32_t expected = kSlotWaiting;
    if (::kill(oldest->pid, 0) != 0 && errno == ESRCH) {
      atomic_word(oldest->state).compare_exchange_strong(expected, kSlotFree);  // it died
      continue;
    }
    if (!atomic_word(oldest->state).compare_exchange_strong(expected, kSlotNotified))
      continue;  // it left (timed out) meanwhile
    futex_wake_n(&oldest->state, 1);
    --n;
  }
}

uint32_t ConditionWord::waiting() const {
  uint32_t k = 0;
  for (auto& c : state<CondState>(page_)->slots) k += atomic_word(c.state).load() == kSlotWaiting;
  return k;
}
uint32_t ConditionWord::tickets() const {
  uint32_t k = 0;
  for (auto& c : state<CondState>(page_)->slots) k += atomic_word(c.state).load() == kSlotNotified;
  return k;
}
}  // namespace detail

Condition::Condition() : Condition(RLock()) {}
Condition::Condition(Lock lock) : lock_(std::move(lock)), page_(detail::ConditionWord().page()) {}

bool Condition::wait(Timeout timeout) {
  detail::ConditionWord word(page_);
  const auto deadline = detail::Deadline::after(timeout);
  // Enrolled while the lock is held: a notify after our caller's check sees us.
  const uint32_t slot = word.enroll();
  const uint32_t depth = lock_.release_all();  // an RLock held recursively is fully released
  const bool notified = word.wait_ticket(slot, deadline) || word.leave(slot);
  lock_.acquire_n(depth);
  return notified;
}

bool Condition::wait_for(const std::function<bool()>& pred, Timeout timeout) {
  const auto deadline = detail::Deadline::after(timeout);
  bool result = pred();
  while (!result) {
    const Timeout left = deadline.remaining();
    if (left && left->count() <= 0) break;
    wait(left);
    result = pred();
  }
  return result;
}

void Condition::notify(int n) {
  if (n > 0) detail::ConditionWord(page_).notify(static_cast<uint32_t>(n));
}

void Condition::notify_all() { notify(INT32_MAX); }

void Condition::save(detail::OutputArchive& ar) const {
  ar(lock_);
  detail::SharedPage::save(ar, page_);
}
void Condition::load(detail::InputArchive& ar) {
  ar(lock_);
  page_ = detail::load_page<detail::CondState>(ar);
}

// ---- Barrier --------------------------------------------------------------------------

Barrier::Barrier(uint32_t parties, std::function<void()> action, Timeout timeout)
    : page_(detail::SharedPage::create(sizeof(detail::BarrierState), "torchpar-barrier")),
      action_(std::move(action)),
      default_timeout_(timeout) {
  if (parties < 1)
    throw ValueError(fmt::format("Barrier needs at least one party, not {}", parties));
  auto* s = state<detail::BarrierState>(page_);
  detail::init_robust_mutex(&s->mu, false);
  s->parties = parties;
  s->magic = detail::kMagic;
}

namespace {
// Under the barrier's mutex: fails the current round for every waiter.
void break_round(detail::BarrierState* s) {
  s->broken_rounds[s->generation % 16] = s->generation + 1;
  atomic_word(s->generation).fetch_add(1);
  detail::futex_wake_n(&s->generation, INT32_MAX);
}

// The barrier's mutex, until `deadline`: a party stopped while holding it makes a waiter
// with a timeout raise BrokenBarrierError instead of hanging.
struct MutexLock {
  MutexLock(pthread_mutex_t* m, const detail::Deadline& deadline) : lock_(m, deadline) {
    if (!lock_.locked())
      throw BrokenBarrierError(
          "barrier wait timed out: its lock is held by a process that did not release it "
          "(stopped?)");
  }
  explicit MutexLock(pthread_mutex_t* m) : MutexLock(m, std::nullopt) {}
  detail::RobustLock lock_;
};

// `d`, but at least 100 ms from now: for the short critical sections a waiter needs after
// its round ended or its deadline passed.
detail::Deadline with_grace(const detail::Deadline& d) {
  if (!d.finite()) return d;
  return std::max(*d, detail::SteadyClock::now() + std::chrono::milliseconds(100));
}
}  // namespace

uint32_t Barrier::wait(Timeout timeout) {
  if (!timeout) timeout = default_timeout_;
  auto* s = state<detail::BarrierState>(page_);
  const auto deadline = detail::Deadline::after(timeout);
  uint32_t gen, index;
  {
    MutexLock lock(&s->mu, deadline);
    if (s->broken) throw BrokenBarrierError("the barrier is broken");
    gen = s->generation;
    index = s->count++;
    if (s->count == s->parties) {
      if (action_) {
        try {
          action_();
        } catch (...) {
          s->broken = 1;
          s->count = 0;
          break_round(s);
          throw;
        }
      }
      s->count = 0;
      atomic_word(s->generation).fetch_add(1);
      detail::futex_wake_n(&s->generation, INT32_MAX);
      return index;
    }
  }
  const auto tripped = [gen](uint32_t g) { return g != gen; };
  for (;;) {
    if (detail::wait_until(&s->generation, tripped, deadline) == detail::WaitStatus::kReady) {
      MutexLock lock(&s->mu, with_grace(deadline));
      // Judge our own round only: later rounds may break (or not) on their own.
      if (s->broken_rounds[gen % 16] == gen + 1)
        throw BrokenBarrierError("the barrier was broken while waiting");
      return index;
    }
    MutexLock lock(&s->mu, with_grace(deadline));  // the deadline passed; breaking needs it
    if (s->generation != gen) continue;
    s->broken = 1;  // a timeout breaks the barrier for everyone, as in Python
    s->count = 0;
    break_round(s);
    throw BrokenBarrierError("barrier wait timed out");
  }
}

void Barrier::abort() {
  auto* s = state<detail::BarrierState>(page_);
  MutexLock lock(&s->mu);
  s->broken = 1;
  s->count = 0;
  break_round(s);
}

void Barrier::reset() {
  auto* s = state<detail::BarrierState>(page_);
  MutexLock lock(&s->mu);
  // Waiters of the current round get BrokenBarrierError; the barrier is usable again.
  if (s->count > 0) break_round(s);
  s->count = 0;
  s->broken = 0;
}

uint32_t Barrier::parties() const { return state<detail::BarrierState>(page_)->parties; }
uint32_t Barrier::n_waiting() const {
  return atomic_word(state<detail::BarrierState>(page_)->count).load();
}
bool Barrier::broken() const {
  return atomic_word(state<detail::BarrierState>(page_)->broken).load() != 0;
}

void Barrier::save(detail::OutputArchive& ar) const {
  detail::SharedPage::save(ar, page_);
  const double t = default_timeout_ ? default_timeout_->count() : -1.0;
  ar(t);
}
void Barrier::load(detail::InputArchive& ar) {
  page_ = detail::load_page<detail::BarrierState>(ar);
  double t = -1;
  ar(t);
  if (t >= 0) default_timeout_ = std::chrono::duration<double>(t);
  action_ = nullptr;  // actions do not cross processes: the parent's copy runs its own
}

}  // namespace torchpar
