#include "region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>

#include "cleaner.h"
#include "core/meminfo.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {
namespace {

// What every memfd is sealed with; open_fd asks for the first two (segments of an older
// library lacked F_SEAL_SEAL).
constexpr unsigned kRegionSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
constexpr unsigned kRequiredSeals = F_SEAL_SHRINK | F_SEAL_GROW;

// Names create_owned tries before it gives up: each is a fresh 64-bit counter value.
constexpr int kNameAttempts = 100;

[[noreturn]] void throw_shm(const char* syscall, int err, const std::string& what,
                            std::string detail = {}) {
  throw ShmError(syscall, err, what, std::move(detail));
}

const char* place(SharingStrategy s) {
  return s == SharingStrategy::kFileSystem ? "/dev/shm" : "memfd (anonymous shared memory)";
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

// The size of an opened shared object, refused below `min_bytes` (and when empty).
uint64_t checked_size(const struct stat& st, uint64_t min_bytes, const std::string& what) {
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < std::max<uint64_t>(min_bytes, 1))
    throw_shm("fstat", EINVAL, what,
              fmt::format("shared object of {} bytes, expected at least {}", size, min_bytes));
  return size;
}

}  // namespace

uint64_t shm_bytes_free(SharingStrategy strategy) {
  if (strategy == SharingStrategy::kFileDescriptor) {
    const auto info = read_meminfo();
    return info ? info->available_bytes : UINT64_MAX;
  }
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) != 0) return 0;
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

void throw_shm_exhausted(SharingStrategy s, int err, uint64_t asked) {
  throw ShmError("posix_fallocate", err, place(s),
                 fmt::format("shared memory exhausted: asked {}, free {}{}", format_bytes(asked),
                             format_bytes(shm_bytes_free(s)),
                             s == SharingStrategy::kFileSystem
                                 ? " (enlarge /dev/shm, e.g. docker --shm-size, or use the "
                                   "file_descriptor strategy)"
                                 : ""));
}

bool is_torchpar_shm_name(const std::string& name) {
  return name.rfind("/torchpar_", 0) == 0 && name.find('/', 1) == std::string::npos &&
         name.size() <= 200;
}

void* map_shared_fd_noexcept(int fd, size_t bytes) noexcept {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

ShmRegion::~ShmRegion() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

ShmRegion& ShmRegion::operator=(ShmRegion&& o) noexcept {
  if (this != &o) {
    if (base_ != nullptr) ::munmap(base_, size_);
    fd_ = std::move(o.fd_);
    name_ = std::move(o.name_);
    base_ = std::exchange(o.base_, nullptr);
    size_ = std::exchange(o.size_, 0);
    dev_ = std::exchange(o.dev_, 0);
    ino_ = std::exchange(o.ino_, 0);
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

void ShmRegion::identify(int fd, const std::string& what) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_shm("fstat", errno, what);
  dev_ = st.st_dev;
  ino_ = st.st_ino;
}

void ShmRegion::check_view(uint64_t offset, uint64_t elem_bytes, uint64_t count,
                           uint64_t align) const {
  const bool fits = offset <= size_ && (elem_bytes == 0 || count <= (size_ - offset) / elem_bytes);
  if (fits && offset % align == 0) return;
  throw ValueError(fmt::format(
      "shared-memory region {}of {} bytes: a view of {} x {} bytes (alignment {}) at offset {} "
      "{}",
      name_.empty() ? "" : name_ + " ", size_, count, elem_bytes, align, offset,
      fits ? "is misaligned" : "does not fit"));
}

// ---- creators: the only memfd_create and shm_open(O_CREAT) of the library ---------------

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
    throw_shm_exhausted(SharingStrategy::kFileDescriptor, err, bytes);
  if (err != 0) throw_shm("posix_fallocate", err, what);
  if (::fcntl(fd.get(), F_ADD_SEALS, kRegionSeals) != 0)
    throw_shm("fcntl(F_ADD_SEALS)", errno, what);
  ShmRegion r;
  r.identify(fd.get(), what);
  r.map(fd.get(), bytes, true, what);
  r.fd_ = std::move(fd);
  return r;
}

ShmRegion ShmRegion::create_named(const std::string& name, uint64_t bytes) {
  if (bytes == 0) throw_shm("shm_open", EINVAL, name, "a region of 0 bytes");
  if (!is_torchpar_shm_name(name))
    throw_shm("shm_open", EINVAL, name, "not a torchpar shared-memory name");
  const int raw = retry_eintr(
      [&] { return ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600); });
  if (raw < 0) throw_shm("shm_open", errno, name);
  UniqueFd fd(raw);
  ShmRegion r;
  try {
    const int err = reserve(fd.get(), bytes);
    if (err == ENOSPC || err == ENOMEM || err == EFBIG)
      throw_shm_exhausted(SharingStrategy::kFileSystem, err, bytes);
    if (err != 0) throw_shm("posix_fallocate", err, name);
    r.identify(fd.get(), name);
    r.map(fd.get(), bytes, true, name);
  } catch (...) {
    ::shm_unlink(name.c_str());
    throw;
  }
  r.name_ = name;
  return r;  // the name travels, not the fd
}

ShmRegion ShmRegion::create_owned(uint64_t bytes, const NameMaker& make_name) {
  ensure_cleaner();  // before the name exists: it goes with this process, even on SIGKILL
  for (int attempt = 1;; ++attempt) {
    const std::string name = make_name ? make_name() : make_segment_name();
    try {
      return create_named(name, bytes);
    } catch (const ShmError& e) {
      // A leftover of a dead process with our pid, or a collision: take the next name.
      if (e.syscall() != "shm_open" || e.error_code() != EEXIST || attempt >= kNameAttempts) throw;
    }
  }
}

// ---- openers ---------------------------------------------------------------------------

ShmRegion ShmRegion::open_fd(UniqueFd fd, uint64_t min_bytes, const char* what) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_shm("fstat", errno, what);
  if (!S_ISREG(st.st_mode)) throw_shm("fstat", EINVAL, what, "not a shared-memory file");
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0 || (static_cast<unsigned>(seals) & kRequiredSeals) != kRequiredSeals)
    throw_shm("fcntl(F_GET_SEALS)", EINVAL, what,
              "not a sealed torchpar memfd (it could be truncated under us)");
  const uint64_t size = checked_size(st, min_bytes, what);
  ShmRegion r;
  r.map(fd.get(), size, true, what);
  r.fd_ = std::move(fd);
  r.dev_ = st.st_dev;
  r.ino_ = st.st_ino;
  return r;
}

ShmRegion ShmRegion::open_named(const std::string& name, bool writable, uint64_t min_bytes) {
  if (!is_torchpar_shm_name(name))
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
  r.name_ = name;
  r.dev_ = st.st_dev;
  r.ino_ = st.st_ino;
  return r;
}

}  // namespace torchpar::detail
