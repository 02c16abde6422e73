#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>

#include <pthread.h>

#include <fmt/format.h>

#include "cleaner.h"
#include "core/meminfo.h"
#include "core/prefault.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {
namespace {

constexpr unsigned kSeals = F_SEAL_SHRINK | F_SEAL_GROW;
constexpr unsigned kRegionSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

uint64_t round_up(uint64_t v, uint64_t m) { return (v + m - 1) / m * m; }

uint64_t mem_available() {
  const auto info = read_meminfo();
  return info ? info->available_bytes : UINT64_MAX;
}

// mem_available for a request of `asked` bytes: a reading of the last 100 ms serves a
// request of at most 1/16 of it; other requests read /proc/meminfo again. A reading costs
// about five system calls (~10 us here), which a small cold segment (a 64 KiB slab) paid on
// every creation. Safety: any thread (a racing reader only reads again).
uint64_t mem_available_for(uint64_t asked) {
  static std::atomic<uint64_t> last_bytes{0};
  static std::atomic<int64_t> last_ns{0};
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  const uint64_t cached = last_bytes.load(std::memory_order_relaxed);
  if (cached != 0 && asked <= cached / 16 &&
      now - last_ns.load(std::memory_order_relaxed) < int64_t{100'000'000})
    return cached;
  const uint64_t fresh = mem_available();
  last_bytes.store(fresh, std::memory_order_relaxed);
  last_ns.store(now, std::memory_order_relaxed);
  return fresh;
}

const char* place(SharingStrategy s) {
  return s == SharingStrategy::kFileSystem ? "/dev/shm" : "memfd (anonymous shared memory)";
}

[[noreturn]] void throw_no_space(SharingStrategy s, int err, uint64_t asked) {
  throw ShmError("posix_fallocate", err, place(s),
                 fmt::format("shared memory exhausted: asked {}, free {}{}", format_bytes(asked),
                             format_bytes(shm_bytes_free(s)),
                             s == SharingStrategy::kFileSystem
                                 ? " (enlarge /dev/shm, e.g. docker --shm-size, or use the "
                                   "file_descriptor strategy)"
                                 : ""));
}

[[noreturn]] void throw_shm(const char* syscall, int err, const std::string& what,
                            std::string detail = {}) {
  throw ShmError(syscall, err, what, std::move(detail));
}

// Every large segment keeps one fd (file_descriptor strategy): lift the soft fd limit to
// the hard one, once, so that a thousand large shared tensors do not hit EMFILE.
void raise_nofile_limit() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct rlimit rl {};
    if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &rl);
    }
  });
}

// A named object must belong to this process's user: its owner could truncate it under our
// mapping, and the next access there would be a SIGBUS (a memfd is sealed instead).
void check_owner(const struct stat& st, const std::string& name) {
  const uid_t self = ::geteuid();
  if (st.st_uid != self)
    throw_shm("fstat", EPERM, name,
              fmt::format("owned by uid {}, not by this process's user (uid {}): refused, as its "
                          "owner could truncate it under the mapping",
                          st.st_uid, self));
}

// posix_fallocate, retried on EINTR; returns its error (0: reserved).
int reserve(int fd, uint64_t bytes) {
  int e;
  do {
    e = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (e == EINTR);
  return e;
}

}  // namespace

uint64_t shm_bytes_free(SharingStrategy strategy) {
  if (strategy == SharingStrategy::kFileDescriptor) return mem_available();
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) != 0) return 0;
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

std::shared_ptr<Segment> Segment::create(SharingStrategy strategy, uint64_t block_size,
                                         uint32_t num_blocks) {
  const uint64_t header = round_up(sizeof(SegmentHeader) + 8ULL * num_blocks, kPageSize);
  const uint64_t total = header + block_size * num_blocks;
  const uint64_t free_bytes = strategy == SharingStrategy::kFileDescriptor
                                  ? mem_available_for(total)
                                  : shm_bytes_free(strategy);
  if (total > free_bytes) throw_no_space(strategy, ENOSPC, total);

  std::shared_ptr<Segment> seg(new Segment());
  seg->strategy_ = strategy;
  int raw = -1;
  if (strategy == SharingStrategy::kFileDescriptor) {
    raise_nofile_limit();
    raw = retry_eintr([&] { return ::memfd_create("torchpar", MFD_CLOEXEC | MFD_ALLOW_SEALING); });
    if (raw < 0) {
      const int err = errno;
      throw_shm("memfd_create", err, "torchpar segment",
                err == EMFILE ? "too many open files (RLIMIT_NOFILE)" : "");
    }
  } else {
    ensure_cleaner();
    for (int attempt = 0; raw < 0; ++attempt) {
      seg->name_ = make_segment_name();
      raw = retry_eintr([&] {
        return ::shm_open(seg->name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      });
      if (raw < 0) {
        const int err = errno;
        if (err != EEXIST || attempt > 100) throw_shm("shm_open", err, seg->name_);
      }
    }
  }
  UniqueFd fd(raw);
  seg->owner_pid_ = cached_pid();  // from here on the dtor unlinks the name
  const std::string what = seg->name_.empty() ? "memfd" : seg->name_;
  const int err = retry_eintr([&] {
    int e = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(total));
    if (e == EINTR) errno = EINTR;
    return e == EINTR ? -1 : e;
  });
  if (err == ENOSPC || err == ENOMEM) throw_no_space(strategy, err, total);
  if (err != 0) throw_shm("posix_fallocate", err, what);
  if (strategy == SharingStrategy::kFileDescriptor && ::fcntl(fd.get(), F_ADD_SEALS, kSeals) != 0) {
    throw_shm("fcntl(F_ADD_SEALS)", errno, what);
  }
  seg->fd_ = std::move(fd);
  seg->map(total, what);
  if (block_size >= (2u << 20)) ::madvise(seg->base_, total, MADV_HUGEPAGE);  // best effort
  // A one-block segment is written whole right away (share_memory_ copies the tensor in).
  if (num_blocks == 1) prefault_for_write(seg->base_, total);

  auto* h = seg->header();
  h->magic = kSegmentMagic;
  h->version = kSegmentVersion;
  h->num_blocks = num_blocks;
  h->block_size = block_size;
  h->data_offset = header;
  h->total_size = total;
  h->creator_pid = static_cast<int32_t>(cached_pid());
  seg->block_size_ = block_size;
  seg->num_blocks_ = num_blocks;
  seg->data_offset_ = header;
  // dev/ino identify the segment in other processes' /proc/<pid>/maps (the allocator's
  // check for blocks whose holders all died), for both strategies.
  struct stat st {};
  if (::fstat(seg->fd_.get(), &st) != 0) throw_shm("fstat", errno, what);
  seg->dev_ = st.st_dev;
  seg->ino_ = st.st_ino;
  if (strategy == SharingStrategy::kFileSystem) {
    seg->key_ = "fs:" + seg->name_;
    seg->fd_.reset();  // the name travels, not the fd: keep no fd per segment
  } else {
    seg->key_ = fmt::format("fd:{}:{}", st.st_dev, st.st_ino);
  }
  return seg;
}

std::shared_ptr<Segment> Segment::open_fd(UniqueFd fd) {
  std::shared_ptr<Segment> seg(new Segment());
  seg->strategy_ = SharingStrategy::kFileDescriptor;
  const std::string what = fmt::format("received fd {}", fd.get());
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_shm("fstat", errno, what);
  if (!S_ISREG(st.st_mode)) throw_shm("fstat", EINVAL, what, "not a shared-memory file");
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0 || (static_cast<unsigned>(seals) & kSeals) != kSeals)
    throw_shm("fcntl(F_GET_SEALS)", EINVAL, what, "not a sealed torchpar memfd");
  seg->key_ = fmt::format("fd:{}:{}", st.st_dev, st.st_ino);
  seg->dev_ = st.st_dev;
  seg->ino_ = st.st_ino;
  seg->fd_ = std::move(fd);
  seg->map(static_cast<uint64_t>(st.st_size), what);
  seg->validate(what);
  return seg;
}

std::shared_ptr<Segment> Segment::open_name(const std::string& name) {
  if (name.rfind("/torchpar_", 0) != 0 || name.find('/', 1) != std::string::npos ||
      name.size() > 200)
    throw_shm("shm_open", EINVAL, name, "not a torchpar segment name");
  std::shared_ptr<Segment> seg(new Segment());
  seg->strategy_ = SharingStrategy::kFileSystem;
  seg->name_ = name;
  seg->key_ = "fs:" + name;
  int raw = retry_eintr([&] { return ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600); });
  if (raw < 0) {
    const int err = errno;
    throw_shm("shm_open", err, name,
              err == ENOENT ? "the segment is gone: its creating process exited before the "
                              "handle was opened"
                            : "");
  }
  UniqueFd fd(raw);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_shm("fstat", errno, name);
  check_owner(st, name);
  seg->fd_ = std::move(fd);
  seg->map(static_cast<uint64_t>(st.st_size), name);
  seg->fd_.reset();
  seg->validate(name);
  return seg;
}

void Segment::map(uint64_t size, const std::string& what) {
  if (size < kPageSize)
    throw_shm("mmap", EINVAL, what, fmt::format("segment of {} bytes is too small", size));
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
  if (p == MAP_FAILED) throw_shm("mmap", errno, what, fmt::format("{} bytes", size));
  base_ = static_cast<char*>(p);
  size_ = size;
}

void Segment::validate(const std::string& what) {
  // Copy first, then check the copies: the shared header may change under us.
  SegmentHeader h;
  std::memcpy(&h, base_, sizeof h);
  auto bad = [&](const char* why) {
    throw_shm("mmap", EINVAL, what, fmt::format("not a valid torchpar segment: {}", why));
  };
  if (h.magic != kSegmentMagic) bad("bad magic");
  if (h.version != kSegmentVersion) bad("unsupported version");
  if (h.num_blocks == 0 || h.block_size == 0) bad("empty geometry");
  const uint64_t counters_end = sizeof(SegmentHeader) + 8ULL * h.num_blocks;
  if (h.data_offset < counters_end || h.data_offset > size_) bad("bad data offset");
  if (h.block_size > (size_ - h.data_offset) / h.num_blocks) bad("blocks exceed the mapping");
  block_size_ = h.block_size;
  num_blocks_ = h.num_blocks;
  data_offset_ = h.data_offset;
}

namespace {
std::atomic<int> g_pid{0};
}  // namespace

int cached_pid() {
  int p = g_pid.load(std::memory_order_relaxed);
  if (p == 0) {
    static std::once_flag once;
    std::call_once(once, [] { ::pthread_atfork(nullptr, nullptr, [] { g_pid.store(0); }); });
    p = static_cast<int>(::getpid());
    g_pid.store(p, std::memory_order_relaxed);
  }
  return p;
}

bool Segment::owned_here() const { return owner_pid_ == cached_pid(); }

Segment::~Segment() {
  if (base_ != nullptr) ::munmap(base_, size_);
  if (!name_.empty() && owned_here()) ::shm_unlink(name_.c_str());
}

// ---- ShmRegion ------------------------------------------------------------------------

ShmRegion::~ShmRegion() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

ShmRegion& ShmRegion::operator=(ShmRegion&& o) noexcept {
  if (this != &o) {
    if (base_ != nullptr) ::munmap(base_, size_);
    fd_ = std::move(o.fd_);
    base_ = std::exchange(o.base_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

void ShmRegion::map(int fd, uint64_t size, bool writable, const std::string& what) {
  const int prot = writable ? PROT_READ | PROT_WRITE : PROT_READ;
  void* p = ::mmap(nullptr, size, prot, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw_shm("mmap", errno, what, fmt::format("{} bytes", size));
  base_ = static_cast<char*>(p);
  size_ = size;
}

void* map_shared_fd_noexcept(int fd, size_t bytes) noexcept {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

ShmRegion ShmRegion::create_memfd(uint64_t bytes, const char* what) {
  if (bytes == 0) throw_shm("memfd_create", EINVAL, what, "a region of 0 bytes");
  const int raw =
      retry_eintr([&] { return ::memfd_create(what, MFD_CLOEXEC | MFD_ALLOW_SEALING); });
  if (raw < 0) {
    const int err = errno;
    throw_shm("memfd_create", err, what,
              err == EMFILE ? "too many open files (RLIMIT_NOFILE)" : "");
  }
  UniqueFd fd(raw);
  const int err = reserve(fd.get(), bytes);
  if (err == ENOSPC || err == ENOMEM || err == EFBIG)
    throw_no_space(SharingStrategy::kFileDescriptor, err, bytes);
  if (err != 0) throw_shm("posix_fallocate", err, what);
  if (::fcntl(fd.get(), F_ADD_SEALS, kRegionSeals) != 0)
    throw_shm("fcntl(F_ADD_SEALS)", errno, what);
  ShmRegion r;
  r.map(fd.get(), bytes, true, what);
  r.fd_ = std::move(fd);
  return r;
}

ShmRegion ShmRegion::create_named(const std::string& name, uint64_t bytes) {
  if (bytes == 0) throw_shm("shm_open", EINVAL, name, "a region of 0 bytes");
  const int raw = retry_eintr(
      [&] { return ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600); });
  if (raw < 0) throw_shm("shm_open", errno, name);
  UniqueFd fd(raw);
  const int err = reserve(fd.get(), bytes);
  if (err != 0) {
    ::shm_unlink(name.c_str());
    if (err == ENOSPC || err == ENOMEM || err == EFBIG)
      throw_no_space(SharingStrategy::kFileSystem, err, bytes);
    throw_shm("posix_fallocate", err, name);
  }
  ShmRegion r;
  try {
    r.map(fd.get(), bytes, true, name);
  } catch (...) {
    ::shm_unlink(name.c_str());
    throw;
  }
  return r;  // the name travels, not the fd
}

namespace {
// The size of an opened shared object, refused below `min_bytes` (and when empty).
uint64_t checked_size(const struct stat& st, uint64_t min_bytes, const std::string& what) {
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < std::max<uint64_t>(min_bytes, 1))
    throw_shm("fstat", EINVAL, what,
              fmt::format("shared object of {} bytes, expected at least {}", size, min_bytes));
  return size;
}
}  // namespace

ShmRegion ShmRegion::open_fd(UniqueFd fd, uint64_t min_bytes, const char* what) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_shm("fstat", errno, what);
  if (!S_ISREG(st.st_mode)) throw_shm("fstat", EINVAL, what, "not a shared-memory file");
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0 || (static_cast<unsigned>(seals) & kSeals) != kSeals)
    throw_shm("fcntl(F_GET_SEALS)", EINVAL, what,
              "not a sealed torchpar memfd (it could be truncated under us)");
  const uint64_t size = checked_size(st, min_bytes, what);
  ShmRegion r;
  r.map(fd.get(), size, true, what);
  r.fd_ = std::move(fd);
  return r;
}

ShmRegion ShmRegion::open_named(const std::string& name, bool writable, uint64_t min_bytes) {
  if (name.rfind("/torchpar_", 0) != 0 || name.find('/', 1) != std::string::npos ||
      name.size() > 200)
    throw_shm("shm_open", EINVAL, name, "not a torchpar segment name");
  const int raw = retry_eintr(
      [&] { return ::shm_open(name.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC, 0); });
  if (raw < 0) throw_shm("shm_open", errno, name);
  UniqueFd fd(raw);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_shm("fstat", errno, name);
  check_owner(st, name);
  const uint64_t size = checked_size(st, min_bytes, name);
  ShmRegion r;
  r.map(fd.get(), size, writable, name);
  return r;
}

}  // namespace torchpar::detail
