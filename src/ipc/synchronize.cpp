#include "torchpar/ipc/synchronize.h"

#include <pthread.h>
#include <time.h>

#include <atomic>
#include <cstring>

#include <fmt/format.h>

#include "futex.h"
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

struct CondState {
  uint32_t magic;
  uint32_t seq;  // futex word, bumped by notify
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

std::atomic_ref<uint32_t> word(uint32_t& w) { return std::atomic_ref<uint32_t>(w); }

template <class S>
S* state(const std::shared_ptr<SharedPage>& p) {
  return static_cast<S*>(p->data());
}

void init_mutex(pthread_mutex_t* m, bool recursive) {
  pthread_mutexattr_t attr;
  ::pthread_mutexattr_init(&attr);
  ::pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  ::pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  if (recursive) ::pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
  ::pthread_mutex_init(m, &attr);
  ::pthread_mutexattr_destroy(&attr);
}

// Returns {acquired, owner_died}.
std::pair<bool, bool> lock_mutex(pthread_mutex_t* m, Timeout timeout) {
  int r;
  if (!timeout) {
    r = ::pthread_mutex_lock(m);
  } else if (timeout->count() <= 0) {
    r = ::pthread_mutex_trylock(m);
  } else {
    struct timespec ts {};
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    const auto ns = static_cast<int64_t>(timeout->count() * 1e9);
    ts.tv_sec += ns / 1000000000;
    ts.tv_nsec += ns % 1000000000;
    if (ts.tv_nsec >= 1000000000) {
      ts.tv_sec += 1;
      ts.tv_nsec -= 1000000000;
    }
    r = ::pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &ts);
  }
  if (r == 0) return {true, false};
  if (r == EOWNERDEAD) {
    ::pthread_mutex_consistent(m);
    return {true, true};
  }
  if (r == EBUSY || r == ETIMEDOUT) return {false, false};
  throw_system_error("pthread_mutex_lock", r, "Lock");
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

using detail::state;
using detail::word;

// ---- Lock / RLock -----------------------------------------------------------------

Lock::Lock() : Lock(false) {}
Lock::Lock(bool recursive)
    : page_(detail::SharedPage::create(sizeof(detail::MutexState), "torchpar-lock")) {
  auto* s = state<detail::MutexState>(page_);
  detail::init_mutex(&s->mu, recursive);
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
  const auto deadline = detail::deadline_after(timeout);
  for (;;) {
    uint32_t v = word(s->value).load();
    while (v > 0) {
      if (word(s->value).compare_exchange_weak(v, v - 1)) return true;
    }
    if (timeout && (timeout->count() <= 0 || detail::past(deadline))) return false;
    detail::futex_wait_until(&s->value, 0, deadline);
  }
}

void Semaphore::release() {
  auto* s = state<detail::SemState>(page_);
  uint32_t v = word(s->value).load();
  do {
    if (s->bound != 0 && v >= s->bound)
      throw Error(fmt::format("BoundedSemaphore released too many times (bound {})", s->bound));
  } while (!word(s->value).compare_exchange_weak(v, v + 1));
  detail::futex_wake_n(&s->value, 1);
}

uint32_t Semaphore::get_value() const { return word(state<detail::SemState>(page_)->value).load(); }
void Semaphore::save(detail::OutputArchive& ar) const { detail::SharedPage::save(ar, page_); }
void Semaphore::load(detail::InputArchive& ar) { page_ = detail::load_page<detail::SemState>(ar); }

// ---- Event --------------------------------------------------------------------------

Event::Event() : page_(detail::SharedPage::create(sizeof(detail::EventState), "torchpar-event")) {
  state<detail::EventState>(page_)->magic = detail::kMagic;
}

void Event::set() {
  auto* s = state<detail::EventState>(page_);
  word(s->flag).store(1);
  detail::futex_wake_n(&s->flag, INT32_MAX);
}

void Event::clear() { word(state<detail::EventState>(page_)->flag).store(0); }
bool Event::is_set() const { return word(state<detail::EventState>(page_)->flag).load() != 0; }

bool Event::wait(Timeout timeout) {
  auto* s = state<detail::EventState>(page_);
  const auto deadline = detail::deadline_after(timeout);
  while (word(s->flag).load() == 0) {
    if (timeout && (timeout->count() <= 0 || detail::past(deadline))) return false;
    detail::futex_wait_until(&s->flag, 0, deadline);
  }
  return true;
}

void Event::save(detail::OutputArchive& ar) const { detail::SharedPage::save(ar, page_); }
void Event::load(detail::InputArchive& ar) { page_ = detail::load_page<detail::EventState>(ar); }

// ---- Condition ------------------------------------------------------------------------

Condition::Condition() : Condition(RLock()) {}
Condition::Condition(Lock lock)
    : lock_(std::move(lock)),
      page_(detail::SharedPage::create(sizeof(detail::CondState), "torchpar-condition")) {
  state<detail::CondState>(page_)->magic = detail::kMagic;
}

bool Condition::wait(Timeout timeout) {
  auto* s = state<detail::CondState>(page_);
  const auto deadline = detail::deadline_after(timeout);
  const uint32_t seen = word(s->seq).load();
  const uint32_t depth = lock_.release_all();  // an RLock held recursively is fully released
  bool notified = false;
  while (!(notified = word(s->seq).load() != seen) && !detail::past(deadline))
    detail::futex_wait_until(&s->seq, seen, deadline);
  lock_.acquire_n(depth);
  return notified;
}

bool Condition::wait_for(const std::function<bool()>& pred, Timeout timeout) {
  const auto deadline = detail::deadline_after(timeout);
  bool result = pred();
  while (!result) {
    std::optional<std::chrono::duration<double>> left;
    if (deadline) {
      left = *deadline - detail::SteadyClock::now();
      if (left->count() <= 0) break;
    }
    wait(left);
    result = pred();
  }
  return result;
}

void Condition::notify(int n) {
  auto* s = state<detail::CondState>(page_);
  word(s->seq).fetch_add(1);
  detail::futex_wake_n(&s->seq, n);
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
  TORCH_CHECK(parties >= 1, "Barrier needs at least one party");
  auto* s = state<detail::BarrierState>(page_);
  detail::init_mutex(&s->mu, false);
  s->parties = parties;
  s->magic = detail::kMagic;
}

namespace {
// Under the barrier's mutex: fails the current round for every waiter.
void break_round(detail::BarrierState* s) {
  s->broken_rounds[s->generation % 16] = s->generation + 1;
  word(s->generation).fetch_add(1);
  detail::futex_wake_n(&s->generation, INT32_MAX);
}

struct MutexLock {
  explicit MutexLock(pthread_mutex_t* m) : m_(m) { detail::lock_mutex(m_, std::nullopt); }
  ~MutexLock() { ::pthread_mutex_unlock(m_); }
  pthread_mutex_t* m_;
};
}  // namespace

uint32_t Barrier::wait(Timeout timeout) {
  if (!timeout) timeout = default_timeout_;
  auto* s = state<detail::BarrierState>(page_);
  const auto deadline = detail::deadline_after(timeout);
  uint32_t gen, index;
  {
    MutexLock lock(&s->mu);
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
      word(s->generation).fetch_add(1);
      detail::futex_wake_n(&s->generation, INT32_MAX);
      return index;
    }
  }
  for (;;) {
    if (word(s->generation).load() != gen) {
      MutexLock lock(&s->mu);
      // Judge our own round only: later rounds may break (or not) on their own.
      if (s->broken_rounds[gen % 16] == gen + 1)
        throw BrokenBarrierError("the barrier was broken while waiting");
      return index;
    }
    if (detail::past(deadline)) {
      MutexLock lock(&s->mu);
      if (s->generation != gen) continue;
      s->broken = 1;  // a timeout breaks the barrier for everyone, as in Python
      s->count = 0;
      break_round(s);
      throw BrokenBarrierError("barrier wait timed out");
    }
    detail::futex_wait_until(&s->generation, gen, deadline);
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
  return word(state<detail::BarrierState>(page_)->count).load();
}
bool Barrier::broken() const {
  return word(state<detail::BarrierState>(page_)->broken).load() != 0;
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
