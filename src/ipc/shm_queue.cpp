#include "torchpar/ipc/shm_queue.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "../shm/cleaner.h"
#include "../shm/segment.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"
#include "torchpar/serialize/serialize.h"
#include "torchpar/shm/share.h"

namespace torchpar::detail {

constexpr uint64_t kQueueMagic = 0x3145554555515054ULL;  // "TPQUEUE1"

struct QueueControl {
  uint64_t magic;
  pthread_mutex_t mu;  // robust, process-shared
  uint32_t seq_put;    // futex word: bumped by every put (getters sleep on it)
  uint32_t seq_get;    // futex word: bumped by every get (putters sleep on it)
  uint32_t seq_done;   // futex word: bumped when unfinished reaches 0
  uint32_t sleeping_getters;
  uint32_t sleeping_putters;
  uint32_t closed;
  uint64_t capacity;    // ring bytes
  uint64_t head;        // byte position of the oldest message (monotonic)
  uint64_t tail;        // byte position after the newest message
  uint64_t count;       // messages in the ring
  uint64_t maxsize;     // 0: unbounded
  int64_t unfinished;   // put minus task_done
  int32_t creator_pid;  // large messages are named under its prefix
  uint64_t spill_counter;
};

namespace {

constexpr uint64_t kHeaderBytes = 4096;
constexpr uint8_t kInline = 0, kSpilled = 1;
constexpr int kSpinIterations = 2000;  // ~ tens of microseconds before sleeping

using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::atomic_ref<uint32_t> word(uint32_t& w) { return std::atomic_ref<uint32_t>(w); }
std::atomic_ref<uint64_t> word64(uint64_t& w) { return std::atomic_ref<uint64_t>(w); }

// Waits while *addr == expected, at most until `deadline` (none: forever).
void futex_wait(uint32_t* addr, uint32_t expected,
                const std::optional<Clock::time_point>& deadline) {
  struct timespec ts {};
  struct timespec* tsp = nullptr;
  if (deadline) {
    auto left = *deadline - Clock::now();
    if (left <= Clock::duration::zero()) return;
    // Cap each sleep so a lost wake-up (a peer killed between bump and wake) costs at most 100 ms.
    left = std::min<Clock::duration>(left, std::chrono::milliseconds(100));
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    ts.tv_sec = ns / 1000000000;
    ts.tv_nsec = ns % 1000000000;
    tsp = &ts;
  } else {
    ts.tv_nsec = 100 * 1000 * 1000;
    tsp = &ts;
  }
  ::syscall(SYS_futex, addr, FUTEX_WAIT, expected, tsp, nullptr, 0);
}

void futex_wake(uint32_t* addr, int n) {
  ::syscall(SYS_futex, addr, FUTEX_WAKE, n, nullptr, nullptr, 0);
}

std::optional<Clock::time_point> deadline_of(const ShmQueue::Timeout& t) {
  if (!t) return std::nullopt;
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::max(*t, std::chrono::duration<double>(0)));
}

bool expired(const std::optional<Clock::time_point>& d) { return d && Clock::now() >= *d; }

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

class Lock {
 public:
  explicit Lock(QueueControl* c) : c_(c) {
    const int r = ::pthread_mutex_lock(&c_->mu);
    if (r == EOWNERDEAD) {
      // A process died holding the lock. Data is copied before the tail/head store that
      // commits it; recount the committed messages, then mark the mutex usable.
      repair(c_, reinterpret_cast<const char*>(c_) + kHeaderBytes);
      ::pthread_mutex_consistent(&c_->mu);
    } else if (r != 0) {
      throw_system_error("pthread_mutex_lock", r, "queue");
    }
  }
  ~Lock() { ::pthread_mutex_unlock(&c_->mu); }
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;

 private:
  QueueControl* c_;
};

std::string spill_name(int creator, uint64_t n) {
  return fmt::format("/{}q{:x}", segment_prefix(creator), n);
}

void write_spill(const std::string& name, const std::string& bytes) {
  const int fd = retry_eintr(
      [&] { return ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600); });
  if (fd < 0) throw ShmError("shm_open", errno, name, "queue message spill");
  UniqueFd owner(fd);
  const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(std::max<size_t>(bytes.size(), 1)));
  if (err != 0) {
    ::shm_unlink(name.c_str());
    throw ShmError(
        "posix_fallocate", err, "/dev/shm",
        fmt::format("queue message of {} does not fit (free {})", format_bytes(bytes.size()),
                    format_bytes(shm_bytes_free(SharingStrategy::kFileSystem))));
  }
  if (!bytes.empty()) {
    void* p = ::mmap(nullptr, bytes.size(), PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::shm_unlink(name.c_str());
      throw ShmError("mmap", errno, name);
    }
    std::memcpy(p, bytes.data(), bytes.size());
    ::munmap(p, bytes.size());
  }
}

std::string read_spill(const std::string& name) {
  if (name.rfind("/torchpar_", 0) != 0 || name.find('/', 1) != std::string::npos)
    throw Error("queue ring corrupted (bad spill name)");
  const int fd = retry_eintr([&] { return ::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0); });
  if (fd < 0)
    throw ShmError("shm_open", errno, name,
                   "a large queue message is gone (was the queue's creating process killed?)");
  UniqueFd owner(fd);
  ::shm_unlink(name.c_str());  // one getter per message: the name is no longer needed
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw ShmError("fstat", errno, name);
  std::string out(static_cast<size_t>(st.st_size), '\0');
  if (!out.empty()) {
    void* p = ::mmap(nullptr, out.size(), PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw ShmError("mmap", errno, name);
    std::memcpy(out.data(), p, out.size());
    ::munmap(p, out.size());
  }
  return out;
}

}  // namespace

ShmQueue::ShmQueue(uint64_t maxsize, uint64_t capacity_bytes) {
  TORCH_CHECK(capacity_bytes >= 4096, "queue capacity must be at least 4096 bytes");
  map_bytes_ = kHeaderBytes + capacity_bytes;
  fd_.reset(check_syscall("memfd_create", "queue",
                          [] { return ::memfd_create("torchpar-queue", MFD_CLOEXEC); }));
  const int err = ::posix_fallocate(fd_.get(), 0, static_cast<off_t>(map_bytes_));
  if (err != 0) throw ShmError("posix_fallocate", err, "queue", format_bytes(map_bytes_));
  void* p = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
  if (p == MAP_FAILED) throw ShmError("mmap", errno, "queue");
  ctl_ = static_cast<QueueControl*>(p);
  ring_ = static_cast<char*>(p) + kHeaderBytes;
  std::memset(ctl_, 0, sizeof(QueueControl));
  pthread_mutexattr_t attr;
  ::pthread_mutexattr_init(&attr);
  ::pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  ::pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  ::pthread_mutex_init(&ctl_->mu, &attr);
  ::pthread_mutexattr_destroy(&attr);
  ctl_->capacity = capacity_bytes;
  ctl_->maxsize = maxsize;
  ctl_->creator_pid = static_cast<int32_t>(::getpid());
  ensure_cleaner();  // large messages live under our prefix until gotten, or until we exit
  ctl_->magic = kQueueMagic;
}

ShmQueue::ShmQueue(UniqueFd fd) : fd_(std::move(fd)) {
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0) throw ShmError("fstat", errno, "queue");
  map_bytes_ = static_cast<uint64_t>(st.st_size);
  if (map_bytes_ < kHeaderBytes + 4096) throw SerializationError("not a torchpar queue segment");
  void* p = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
  if (p == MAP_FAILED) throw ShmError("mmap", errno, "queue");
  ctl_ = static_cast<QueueControl*>(p);
  ring_ = static_cast<char*>(p) + kHeaderBytes;
  if (ctl_->magic != kQueueMagic || ctl_->capacity != map_bytes_ - kHeaderBytes) {
    ::munmap(p, map_bytes_);
    ctl_ = nullptr;
    throw SerializationError("not a torchpar queue segment");
  }
}

ShmQueue::~ShmQueue() {
  if (ctl_ != nullptr) ::munmap(ctl_, map_bytes_);
}

void ShmQueue::put(const std::string& bytes, Timeout timeout) {
  // A message too large for the ring travels in a named shared-memory file and the ring
  // carries the name. The name is under the queue creator's prefix, so the message outlives
  // its sender (put, then exit, is common) and is unlinked by the getter, or by the
  // creator's cleaner if nobody gets it.
  std::string spilled;
  const std::string* msg = &bytes;
  uint8_t kind = kInline;
  if (bytes.size() + 9 > ctl_->capacity / 4) {
    spilled = spill_name(ctl_->creator_pid, word64(ctl_->spill_counter).fetch_add(1));
    write_spill(spilled, bytes);
    msg = &spilled;
    kind = kSpilled;
  }
  const uint64_t need = 8 + 1 + msg->size();
  const auto deadline = deadline_of(timeout);
  // If the put fails, nobody will read the spill file: remove it.
  struct SpillGuard {
    const std::string* spilled;
    bool done = false;
    ~SpillGuard() {
      if (!done && !spilled->empty()) ::shm_unlink(spilled->c_str());
    }
  } guard{&spilled};
  int spins = 0;
  for (;;) {
    uint32_t seen;
    {
      Lock lock(ctl_);
      if (ctl_->closed) throw ClosedError("put on a closed queue");
      const bool full_items = ctl_->maxsize != 0 && ctl_->count >= ctl_->maxsize;
      const bool full_bytes = ctl_->capacity - (ctl_->tail - ctl_->head) < need;
      if (!full_items && !full_bytes) {
        const uint64_t len = msg->size() + 1;
        ring_write(ring_, ctl_->capacity, ctl_->tail, &len, 8);
        ring_write(ring_, ctl_->capacity, ctl_->tail + 8, &kind, 1);
        ring_write(ring_, ctl_->capacity, ctl_->tail + 9, msg->data(), msg->size());
        word64(ctl_->tail).store(ctl_->tail + need);  // commit after the copy
        word64(ctl_->count).store(ctl_->count + 1);
        ++ctl_->unfinished;
        word(ctl_->seq_put).fetch_add(1);
        const bool wake = ctl_->sleeping_getters != 0;
        if (wake) futex_wake(&ctl_->seq_put, 1);
        guard.done = true;
        return;
      }
      if (timeout && (timeout->count() <= 0 || expired(deadline)))
        throw Full(ctl_->maxsize != 0 && full_items
                       ? fmt::format("queue full ({} items)", ctl_->maxsize)
                       : fmt::format("queue full ({} of its {} bytes in use)",
                                     ctl_->tail - ctl_->head, ctl_->capacity));
      seen = word(ctl_->seq_get).load();
      if (spins >= kSpinIterations) ++ctl_->sleeping_putters;
    }
    if (spins < kSpinIterations) {
      while (spins < kSpinIterations && word(ctl_->seq_get).load() == seen &&
             word(ctl_->closed).load() == 0) {
        ++spins;
        cpu_relax();
      }
      continue;
    }
    futex_wait(&ctl_->seq_get, seen, deadline);
    Lock lock(ctl_);
    --ctl_->sleeping_putters;
  }
}

std::string ShmQueue::get(Timeout timeout) {
  const auto deadline = deadline_of(timeout);
  int spins = 0;
  std::string out;
  uint8_t kind = kInline;
  for (;;) {
    uint32_t seen;
    {
      Lock lock(ctl_);
      if (ctl_->count > 0) {
        uint64_t len = 0;
        ring_read(ring_, ctl_->capacity, ctl_->head, &len, 8);
        if (ctl_->tail - ctl_->head < 9 || len == 0 || len > ctl_->tail - ctl_->head - 8)
          throw Error(fmt::format("queue ring corrupted (message length {})", len));
        ring_read(ring_, ctl_->capacity, ctl_->head + 8, &kind, 1);
        out.resize(len - 1);
        ring_read(ring_, ctl_->capacity, ctl_->head + 9, out.data(), len - 1);
        word64(ctl_->head).store(ctl_->head + 8 + len);
        word64(ctl_->count).store(ctl_->count - 1);
        word(ctl_->seq_get).fetch_add(1);
        if (ctl_->sleeping_putters != 0) futex_wake(&ctl_->seq_get, 1);
        break;
      }
      if (ctl_->closed) throw ClosedError("get on a closed, empty queue");
      if (timeout && (timeout->count() <= 0 || expired(deadline))) throw Empty("queue empty");
      seen = word(ctl_->seq_put).load();
      if (spins >= kSpinIterations) ++ctl_->sleeping_getters;
    }
    if (spins < kSpinIterations) {
      while (spins < kSpinIterations && word(ctl_->seq_put).load() == seen &&
             word(ctl_->closed).load() == 0) {
        ++spins;
        cpu_relax();
      }
      continue;
    }
    futex_wait(&ctl_->seq_put, seen, deadline);
    Lock lock(ctl_);
    --ctl_->sleeping_getters;
  }
  if (kind == kSpilled) return read_spill(out);
  return out;
}

uint64_t ShmQueue::qsize() const { return word64(ctl_->count).load(); }
uint64_t ShmQueue::maxsize() const { return ctl_->maxsize; }

void ShmQueue::close() {
  {
    Lock lock(ctl_);
    ctl_->closed = 1;
    word(ctl_->seq_put).fetch_add(1);
    word(ctl_->seq_get).fetch_add(1);
    word(ctl_->seq_done).fetch_add(1);
  }
  futex_wake(&ctl_->seq_put, INT32_MAX);
  futex_wake(&ctl_->seq_get, INT32_MAX);
  futex_wake(&ctl_->seq_done, INT32_MAX);
}

bool ShmQueue::closed() const { return word(ctl_->closed).load() != 0; }

void ShmQueue::task_done() {
  Lock lock(ctl_);
  if (ctl_->unfinished <= 0) throw Error("task_done() called more times than there were items");
  if (--ctl_->unfinished == 0) {
    word(ctl_->seq_done).fetch_add(1);
    futex_wake(&ctl_->seq_done, INT32_MAX);
  }
}

bool ShmQueue::join(Timeout timeout) {
  const auto deadline = deadline_of(timeout);
  for (;;) {
    uint32_t seen;
    {
      Lock lock(ctl_);
      if (ctl_->unfinished <= 0) return true;  // closing does not end a join: consumers may drain
      if (expired(deadline)) return false;
      seen = word(ctl_->seq_done).load();
    }
    futex_wait(&ctl_->seq_done, seen, deadline);
  }
}

}  // namespace torchpar::detail
