#include "torchpar/ipc/detail/shm_queue.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "core/robust_mutex.h"
#include "core/waiter.h"
#include "ipc/shm_queue_test_access.h"
#include "shm/cleaner.h"
#include "shm/region.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"
#include "torchpar/serialize/serialize.h"
#include "torchpar/shm/share.h"

namespace torchpar::detail {

constexpr uint64_t kQueueMagic = 0x3145554555515054ULL;  // "TPQUEUE1"

// Fields are grouped by who writes them, one group per cache line: a waiting getter spins on
// seq_put and closed, and when those shared a line with the mutex and the ring positions, its
// polling pulled that line back between each of the putter's stores under the lock (perf:
// two thirds of put's own time on the stores and the lock add into the polled lines).
struct QueueControl {
  // Taken and written by whoever holds the lock, once per put or get.
  alignas(64) pthread_mutex_t mu;  // robust, process-shared
  uint64_t head;                   // byte position of the oldest message (monotonic)
  uint64_t tail;                   // byte position after the newest message
  uint64_t count;                  // messages in the ring
  // Written once, at creation.
  alignas(64) uint64_t magic;
  uint64_t capacity;    // ring bytes
  uint64_t maxsize;     // 0: unbounded
  int32_t creator_pid;  // large messages are named under its prefix
  // Written under the lock by put and task_done, and by a side about to sleep.
  alignas(64) int64_t unfinished;  // put minus task_done
  uint32_t seq_done;               // futex word: bumped when unfinished reaches 0
  uint32_t sleeping_getters;
  uint32_t sleeping_putters;
  // What a waiting getter polls: bumped once by every put.
  alignas(64) uint32_t seq_put;  // futex word (getters sleep on it)
  uint32_t closed;
  // What a waiting putter polls: bumped once by every get.
  alignas(64) uint32_t seq_get;  // futex word (putters sleep on it)
};
static_assert(sizeof(QueueControl) <= 4096, "the control block fits the header page");

namespace {

constexpr uint64_t kHeaderBytes = 4096;
constexpr uint8_t kInline = 0, kSpilled = 1;
constexpr int kSpinIterations = 2000;  // ~ tens of microseconds before sleeping
constexpr size_t kStackBytes = 1024;   // get copies messages up to this size to the stack

std::atomic_ref<uint64_t> word64(uint64_t& w) { return std::atomic_ref<uint64_t>(w); }

// How long a non-blocking call (timeout 0: get_nowait, put_nowait) waits for the queue's
// internal lock, which a running peer holds for a memcpy at most. A stopped or hung holder
// makes the call raise Empty/Full after this instead of blocking.
constexpr auto kNowaitLockWait = std::chrono::milliseconds(10);

// One step of put's or get's wait, which then looks again under the lock: until `seq` leaves
// `seen` or the queue closes, spinning while this call's `spins` are under kSpinIterations,
// else for one futex slice, counted in `sleepers` (the other side bumps `seq`, then wakes
// only when that count is non-zero, both seq_cst: either it sees the count or this the bump).
void wait_for_change(QueueControl* c, uint32_t* seq, uint32_t seen, uint32_t* sleepers,
                     const Deadline& deadline, int& spins) {
  const auto changed = [c, seen](uint32_t v) {
    return v != seen || atomic_word(c->closed).load() != 0;
  };
  if (spins < kSpinIterations) {
    spin_until(seq, changed, SpinPolicy{.looks = kSpinIterations - spins, .yield_every = 100},
               &spins);
    return;
  }
  wait_until(seq, changed, deadline,
             WaitOptions{.sleeper = SleeperMark::count(sleepers), .max_slices = 1});
}

// The deadline for the internal lock: the call's own, or kNowaitLockWait for timeout 0.
Deadline lock_deadline_of(const Timeout& t, const Deadline& deadline) {
  if (t && t->count() <= 0) return SteadyClock::now() + kNowaitLockWait;
  return deadline;
}

void ring_write(char* ring, uint64_t cap, uint64_t pos, const void* src, uint64_t n) {
  const uint64_t off = pos % cap;
  const uint64_t first = std::min(n, cap - off);
  std::memcpy(ring + off, src, first);
  if (first < n) std::memcpy(ring, static_cast<const char*>(src) + first, n - first);
}

void ring_read(const char* ring, uint64_t cap, uint64_t pos, void* dst, uint64_t n) {
  const uint64_t off = pos % cap;
  const uint64_t first = std::min(n, cap - off);
  std::memcpy(dst, ring + off, first);
  if (first < n) std::memcpy(static_cast<char*>(dst) + first, ring, n - first);
}

// Recounts the messages between head and tail (the commit points of put and get). A
// process that died between storing tail/head and count left count off by one.
void repair(QueueControl* c, const char* ring) {
  uint64_t n = 0;
  for (uint64_t pos = c->head; pos < c->tail;) {
    uint64_t len = 0;
    ring_read(ring, c->capacity, pos, &len, 8);
    if (c->tail - pos < 9 || len == 0 || len > c->tail - pos - 8) {  // unreadable: drop the rest
      c->tail = pos;
      break;
    }
    pos += 8 + len;
    ++n;
  }
  c->count = n;
}

// The queue's internal robust mutex, taken until `deadline`. A process that died holding
// it: data is copied before the tail/head store that commits it, so recount the committed
// messages before the mutex is marked usable again.
class Lock : public RobustLock {
 public:
  Lock(QueueControl* c, const Deadline& deadline)
      : RobustLock(&c->mu, deadline,
                   [c] { repair(c, reinterpret_cast<const char*>(c) + kHeaderBytes); }) {}
  explicit Lock(QueueControl* c) : Lock(c, std::nullopt) {}
};

const char* const kLockHeld =
    "its internal lock is held by a process that did not release it in time (stopped?)";

// A spill file's name under `owner`'s prefix, unique per process: the sender's pid and a
// process-wide counter (a per-queue counter collided between two queues of one process).
// While its put runs the owner is the sender, whose cleaner unlinks it if the sender dies
// before the message is in the ring; put renames it under the creator's prefix as it
// commits the message, and the creator's cleaner unlinks messages nobody got.
std::string spill_name(int owner) {
  static std::atomic<uint64_t> counter{0};
  return fmt::format("/{}q{:x}_{:x}", segment_prefix(owner), ::getpid(),
                     counter.fetch_add(1, std::memory_order_relaxed));
}

// Renames the spill file `from` to `to`, never over an existing name; returns the errno
// (0: renamed).
int rename_spill(const std::string& from, const std::string& to) {
  const std::string a = "/dev/shm" + from, b = "/dev/shm" + to;
  return ::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_NOREPLACE) == 0 ? 0 : errno;
}

// Writes `bytes` to a new named segment under this process's prefix (its cleaner unlinks the
// file if we die before the put commits it); returns its name.
std::string write_spill(const std::string& bytes) {
  ShmRegion r = ShmRegion::create_owned(bytes.size(), [] { return spill_name(::getpid()); });
  std::memcpy(r.data(), bytes.data(), bytes.size());
  return r.name();
}

std::string read_spill(const std::string& name) {
  ShmRegion r;
  try {
    r = ShmRegion::open_named(name, /*writable=*/false);
  } catch (const ShmError& e) {
    if (e.error_code() != ENOENT) throw;
    throw ShmError("shm_open", ENOENT, name,
                   "a large queue message is gone (was the queue's creating process killed?)");
  }
  ::shm_unlink(name.c_str());  // one getter per message: the name is no longer needed
  return std::string(r.data(), r.size());
}

}  // namespace

ShmQueue::ShmQueue(uint64_t maxsize, uint64_t capacity_bytes) {
  if (capacity_bytes < 4096)
    throw ValueError(
        fmt::format("queue capacity must be at least 4096 bytes, not {}", capacity_bytes));
  region_ = std::make_unique<ShmRegion>(
      ShmRegion::create_memfd(kHeaderBytes + capacity_bytes, "torchpar-queue"));
  ctl_ = &region_->as<QueueControl>();
  ring_ = region_->data() + kHeaderBytes;
  std::memset(ctl_, 0, sizeof(QueueControl));
  init_robust_mutex(&ctl_->mu);
  ctl_->capacity = capacity_bytes;
  ctl_->maxsize = maxsize;
  ctl_->creator_pid = static_cast<int32_t>(::getpid());
  ensure_cleaner();  // large messages live under our prefix until gotten, or until we exit
  ctl_->magic = kQueueMagic;
}

ShmQueue::ShmQueue(UniqueFd fd) {
  try {
    region_ = std::make_unique<ShmRegion>(
        ShmRegion::open_fd(std::move(fd), kHeaderBytes + 4096, "torchpar-queue"));
  } catch (const ShmError& e) {
    if (e.error_code() != EINVAL) throw;
    throw SerializationError(e.what_without_backtrace());  // a payload carrying a bad fd
  }
  ctl_ = &region_->as<QueueControl>();
  ring_ = region_->data() + kHeaderBytes;
  if (ctl_->magic != kQueueMagic || ctl_->capacity != region_->size() - kHeaderBytes)
    throw SerializationError("not a torchpar queue segment");
}

ShmQueue::~ShmQueue() = default;

int ShmQueue::fd() const { return region_->fd(); }

void ShmQueue::put(const std::string& bytes, Timeout timeout) {
  // A message too large for the ring travels in a named shared-memory file and the ring
  // carries the name. The file is written under the sender's prefix and renamed under the
  // queue creator's as the message is committed (under the lock): a sender killed inside
  // put leaves it to its own cleaner, and a committed message outlives its sender (put,
  // then exit, is common) until the getter unlinks it, or the creator's cleaner if nobody
  // gets it.
  std::string spilled;    // the file's current name
  std::string committed;  // its name in the ring
  const std::string* msg = &bytes;
  uint8_t kind = kInline;
  const int creator = ctl_->creator_pid;
  if (bytes.size() + 9 > ctl_->capacity / 4) {
    spilled = write_spill(bytes);
    committed = creator == ::getpid() ? spilled : spill_name(creator);
    msg = &committed;
    kind = kSpilled;
  }
  uint64_t need = 8 + 1 + msg->size();
  const Deadline deadline = deadline_after(timeout);
  const Deadline lock_deadline = lock_deadline_of(timeout, deadline);
  // If the put fails, nobody will read the spill file: remove it.
  struct SpillGuard {
    const std::string* spilled;
    bool done = false;
    ~SpillGuard() {
      if (!done && !spilled->empty()) ::shm_unlink(spilled->c_str());
    }
  } guard{&spilled};
  int spins = 0;
  // Wake a sleeping getter after the lock is released: a futex call takes microseconds here,
  // and under the lock the other side would wait out that call too.
  bool wake = false;
  for (;;) {
    uint32_t seen;
    {
      Lock lock(ctl_, lock_deadline);
      if (!lock.locked()) throw Full(fmt::format("queue full: {}", kLockHeld));
      if (ctl_->closed) throw ClosedError("put on a closed queue");
      const bool full_items = ctl_->maxsize != 0 && ctl_->count >= ctl_->maxsize;
      const bool full_bytes = ctl_->capacity - (ctl_->tail - ctl_->head) < need;
      if (!full_items && !full_bytes) {
        if (committed != spilled) {
          const int err = rename_spill(spilled, committed);
          if (err == EEXIST) {  // a leftover of a dead process with our pid: another name
            committed = spill_name(creator);
            need = 8 + 1 + committed.size();
            continue;
          }
          if (err != 0) throw ShmError("rename", err, spilled, "moving a large queue message");
          spilled = committed;
        }
        const uint64_t len = msg->size() + 1;
        ring_write(ring_, ctl_->capacity, ctl_->tail, &len, 8);
        ring_write(ring_, ctl_->capacity, ctl_->tail + 8, &kind, 1);
        ring_write(ring_, ctl_->capacity, ctl_->tail + 9, msg->data(), msg->size());
        // Release, not seq_cst: the lock orders these for every reader but qsize(). A seq_cst
        // store is a full fence on x86, which waited here for the ring's lines (last read by
        // the getter) to come back before the seq_put bump below could start.
        word64(ctl_->tail).store(ctl_->tail + need, std::memory_order_release);  // commit
        word64(ctl_->count).store(ctl_->count + 1, std::memory_order_release);
        ++ctl_->unfinished;
        atomic_word(ctl_->seq_put).fetch_add(1);
        wake = atomic_word(ctl_->sleeping_getters).load() != 0;
        guard.done = true;
        break;
      }
      if (deadline.expired())  // timeout 0 included: its deadline is the call's start
        throw Full(ctl_->maxsize != 0 && full_items
                       ? fmt::format("queue full ({} items)", ctl_->maxsize)
                       : fmt::format("queue full ({} of its {} bytes in use)",
                                     ctl_->tail - ctl_->head, ctl_->capacity));
      seen = atomic_word(ctl_->seq_get).load();
    }
    // Room may have come: look again under the lock after the spin, and after each slice.
    wait_for_change(ctl_, &ctl_->seq_get, seen, &ctl_->sleeping_putters, deadline, spins);
  }
  if (wake) futex_wake_n(&ctl_->seq_put, 1);
}

std::string ShmQueue::get(Timeout timeout) {
  const Deadline deadline = deadline_after(timeout);
  const Deadline lock_deadline = lock_deadline_of(timeout, deadline);
  int spins = 0;
  std::string out;
  // A typical message (a tensor handle, a small value) is copied to the stack under the lock
  // and into `out` after it: a malloc that grows the heap page-faults, ~12 us on these VMs,
  // and under the lock the putter would sleep through it.
  char small[kStackBytes];
  size_t small_len = SIZE_MAX;  // SIZE_MAX: the message went straight into `out`
  uint8_t kind = kInline;
  bool wake = false;  // a sleeping putter, woken after the lock is released (as in put)
  for (;;) {
    uint32_t seen;
    {
      Lock lock(ctl_, lock_deadline);
      if (!lock.locked()) throw Empty(fmt::format("queue empty: {}", kLockHeld));
      if (ctl_->count > 0) {
        uint64_t len = 0;
        ring_read(ring_, ctl_->capacity, ctl_->head, &len, 8);
        if (ctl_->tail - ctl_->head < 9 || len == 0 || len > ctl_->tail - ctl_->head - 8)
          throw Error(fmt::format("queue ring corrupted (message length {})", len));
        ring_read(ring_, ctl_->capacity, ctl_->head + 8, &kind, 1);
        if (len - 1 <= kStackBytes) {
          small_len = len - 1;
          ring_read(ring_, ctl_->capacity, ctl_->head + 9, small, small_len);
        } else {
          out.resize(len - 1);
          ring_read(ring_, ctl_->capacity, ctl_->head + 9, out.data(), len - 1);
        }
        word64(ctl_->head).store(ctl_->head + 8 + len, std::memory_order_release);  // as in put
        word64(ctl_->count).store(ctl_->count - 1, std::memory_order_release);
        atomic_word(ctl_->seq_get).fetch_add(1);
        wake = atomic_word(ctl_->sleeping_putters).load() != 0;
        break;
      }
      if (ctl_->closed) throw ClosedError("get on a closed, empty queue");
      if (deadline.expired()) throw Empty("queue empty");
      seen = atomic_word(ctl_->seq_put).load();
    }
    wait_for_change(ctl_, &ctl_->seq_put, seen, &ctl_->sleeping_getters, deadline, spins);
  }
  if (wake) futex_wake_n(&ctl_->seq_get, 1);
  if (small_len != SIZE_MAX) out.assign(small, small_len);
  if (kind == kSpilled) return read_spill(out);
  return out;
}

uint64_t ShmQueue::qsize() const { return word64(ctl_->count).load(); }
uint64_t ShmQueue::maxsize() const { return ctl_->maxsize; }

void ShmQueue::close() {
  {
    Lock lock(ctl_);
    ctl_->closed = 1;
    atomic_word(ctl_->seq_put).fetch_add(1);
    atomic_word(ctl_->seq_get).fetch_add(1);
    atomic_word(ctl_->seq_done).fetch_add(1);
  }
  futex_wake_n(&ctl_->seq_put, INT32_MAX);
  futex_wake_n(&ctl_->seq_get, INT32_MAX);
  futex_wake_n(&ctl_->seq_done, INT32_MAX);
}

bool ShmQueue::closed() const { return atomic_word(ctl_->closed).load() != 0; }

void ShmQueue::task_done() {
  Lock lock(ctl_);
  if (ctl_->unfinished <= 0) throw Error("task_done() called more times than there were items");
  if (--ctl_->unfinished == 0) {
    atomic_word(ctl_->seq_done).fetch_add(1);
    futex_wake_n(&ctl_->seq_done, INT32_MAX);
  }
}

bool ShmQueue::join(Timeout timeout) {
  const Deadline deadline = deadline_after(timeout);
  for (;;) {
    uint32_t seen;
    {
      Lock lock(ctl_, deadline);
      if (!lock.locked()) return false;
      if (ctl_->unfinished <= 0) return true;  // closing does not end a join: consumers may drain
      if (deadline.expired()) return false;
      seen = atomic_word(ctl_->seq_done).load();
    }
    wait_until(
        &ctl_->seq_done, [seen](uint32_t v) { return v != seen; }, deadline,
        WaitOptions{.max_slices = 1});
  }
}

void ShmQueueTestAccess::hold_lock(ShmQueue& q, const std::function<void()>& while_held) {
  Lock lock(q.ctl_);
  while_held();
}

}  // namespace torchpar::detail
