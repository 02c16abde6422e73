#pragma once
// Raw shared memory: the one place that creates and maps it (memfd_create, shm_open).
//
// Every shared mapping of the library comes from here: tensor blocks (shm/segment.h, private
// to shm/, builds on it), queue rings and spill files, sync pages (Lock, Value, ...), child
// error slots and launch records, the shm backend's group segment, the Manager's call
// channels. This is the header other layers include.

#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>

#include "torchpar/core/fd.h"
#include "torchpar/shm/sharing_strategy.h"

namespace torchpar::detail {

/// The page regions and segments are laid out in (headers take whole pages).
inline constexpr size_t kPageSize = 4096;

/// Raw shared memory: one memfd or named POSIX shm object, reserved and mapped once.
///
/// Guarantees: the bytes are reserved with posix_fallocate before mapping, so a full
/// /dev/shm (or memory) is a ShmError naming the bytes asked and free, never a SIGBUS later.
/// memfds are sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): no holder of the fd can
/// truncate them under the others; open_fd refuses fds without those seals, and any object
/// smaller than asked. Named objects are mode 0600 (they cannot be sealed), are created only
/// under this process's cleaner (create_owned: the name goes with the process, even on
/// SIGKILL), and open_named maps only objects of this process's effective user.
/// Safety: a ShmRegion is not shared between threads while moved; data() is.
class ShmRegion {
 public:
  /// Makes a fresh name for create_owned (a different one at each call).
  using NameMaker = std::function<std::string()>;

  ShmRegion() = default;
  ~ShmRegion();
  ShmRegion(ShmRegion&& o) noexcept { *this = std::move(o); }
  ShmRegion& operator=(ShmRegion&& o) noexcept;
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  /// A new zero-filled, sealed memfd of `bytes` (> 0), mapped read-write. `what` names it
  /// in errors and in /proc/<pid>/fd. Errors: ShmError (out of memory: asked and free;
  /// EMFILE: too many open files).
  static ShmRegion create_memfd(uint64_t bytes, const char* what);
  /// A new zero-filled named object of `bytes` (> 0), mapped read-write, owned by this
  /// process's cleaner: starts the cleaner (shm/cleaner.h) first, so the name is unlinked
  /// when this process exits, however it exits. The name comes from `make_name` (default:
  /// make_segment_name(), "/torchpar_<pid>_<ns>_<counter>"; a maker must stay under this
  /// process's segment_prefix for the cleaner to find it); a name that exists (a leftover
  /// of a dead process with our pid, a collision) is retried with the maker's next one.
  /// The caller unlinks the name (name()) when it is no longer needed. Errors: ShmError
  /// (out of /dev/shm space: asked and free; EEXIST after 100 names that all existed).
  static ShmRegion create_owned(uint64_t bytes, const NameMaker& make_name = {});
  /// Maps a memfd received from a peer. Errors: ShmError (EINVAL) when it is not a regular
  /// file, lacks the seals, or is smaller than `min_bytes`.
  static ShmRegion open_fd(UniqueFd fd, uint64_t min_bytes, const char* what);
  /// Maps the named object `name` (read-only unless `writable`), whole. Errors: ShmError
  /// (EINVAL when `name` is no torchpar name, "/torchpar_..." without another '/', or the
  /// object is smaller than `min_bytes`; ENOENT when gone; EPERM when another user owns it,
  /// who could truncate it under the mapping).
  static ShmRegion open_named(const std::string& name, bool writable, uint64_t min_bytes = 1);

  char* data() const { return base_; }
  uint64_t size() const { return size_; }
  /// The object's name ("" for a memfd).
  const std::string& name() const { return name_; }
  /// The memfd (-1 for named objects: no fd is kept for them).
  int fd() const { return fd_.get(); }
  /// Gives up the fd, keeping the mapping.
  UniqueFd release_fd() { return std::move(fd_); }
  /// The object's device and inode (fstat): its identity in /proc/<pid>/maps.
  uint64_t dev() const { return dev_; }
  uint64_t ino() const { return ino_; }

  /// The region's bytes from `offset` on, viewed as a T (a header or control block laid out
  /// in shared memory). Errors: ValueError naming the sizes when sizeof(T) bytes from
  /// `offset` do not fit the mapping or `offset` is not aligned for T.
  /// Safety: T must be trivially copyable (bytes another process wrote are a valid T); a
  /// read-only region's view must not be written.
  template <class T>
  T& as(uint64_t offset = 0) const {
    static_assert(std::is_trivially_copyable_v<T>,
                  "a shared-memory view needs a trivially copyable type");
    check_view(offset, sizeof(T), 1, alignof(T));
    return *reinterpret_cast<T*>(base_ + offset);
  }
  /// `count` consecutive T from `offset` on (a counter array); checked as as<T>().
  template <class T>
  T* as_array(uint64_t offset, uint64_t count) const {
    static_assert(std::is_trivially_copyable_v<T>,
                  "a shared-memory view needs a trivially copyable type");
    check_view(offset, sizeof(T), count, alignof(T));
    return reinterpret_cast<T*>(base_ + offset);
  }

 private:
  // create_owned's step for one name (O_EXCL: ShmError with errno EEXIST when it exists).
  static ShmRegion create_named(const std::string& name, uint64_t bytes);
  void map(int fd, uint64_t size, bool writable, const std::string& what);
  void identify(int fd, const std::string& what);
  void check_view(uint64_t offset, uint64_t elem_bytes, uint64_t count, uint64_t align) const;
  UniqueFd fd_;
  std::string name_;
  char* base_ = nullptr;
  uint64_t size_ = 0;
  uint64_t dev_ = 0;
  uint64_t ino_ = 0;
};

/// True when `name` is a torchpar shared-memory name: "/torchpar_..." without another '/',
/// at most 200 characters (what open_named accepts).
bool is_torchpar_shm_name(const std::string& name);

/// The ShmError for shared memory exhausted at `strategy`'s place: `asked` bytes, and those
/// free (with advice for /dev/shm). `err` is posix_fallocate's errno (ENOSPC before asking).
[[noreturn]] void throw_shm_exhausted(SharingStrategy strategy, int err, uint64_t asked);

/// Maps `bytes` of the shared object behind `fd` read-write (MAP_SHARED), for a forked child
/// before it runs anything else (spawn and forkserver children map their error slot with
/// it). No allocation, no exception, no lock: safe between fork and exec in a process whose
/// other threads are gone. Returns nullptr when mmap fails (the caller _exit()s with its own
/// code); the mapping lives until the process exits. Use ShmRegion everywhere else.
void* map_shared_fd_noexcept(int fd, size_t bytes) noexcept;

/// Bytes free where a new object of `strategy` would go (/dev/shm, or MemAvailable for
/// memfd). Used for the ShmError message and the pre-check.
uint64_t shm_bytes_free(SharingStrategy strategy);

}  // namespace torchpar::detail
