#pragma once
// A shared-memory segment: one memfd or named POSIX shm object, mapped once per process.
//
// Layout: a header page (magic, geometry, one 32-bit cross-process reference count per
// block) followed by `num_blocks` blocks of `block_size` bytes. Large allocations get a
// segment with one block; small ones are carved out of slab segments of one size class.
//
// The reference count of a block counts its holders in every process: the creator while
// it has a live storage on the block, one per exported-but-not-yet-imported handle, and
// one per importing storage. Only the creator reuses a block, and only once its count is 0.
// A second per-block counter holds the exports not yet imported: an import must claim one,
// so a handle imported twice (or forged) is refused instead of dropping a reference it
// never held.
//
// Geometry is read from the header once, validated and kept in the Segment: a peer that
// rewrites the shared header later cannot move block pointers out of the mapping. memfd
// segments are sealed against shrinking and growing, so a peer cannot truncate them either.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "torchpar/core/fd.h"
#include "torchpar/shm/sharing_strategy.h"

namespace torchpar::detail {

inline constexpr uint64_t kSegmentMagic = 0x314d485352415054ULL;  // "TPARSHM1"
inline constexpr uint32_t kSegmentVersion = 1;
inline constexpr size_t kPageSize = 4096;
/// The top bit of a block's exports word: the block has an export that pins it for
/// borrowers (DumpsOptions::pin_shared, a manager's stored value) rather than one in flight.
/// It is set, never cleared and never counted: the block is not reused while it is set, and
/// the cleaner does not keep the segment's name for it past its creator's exit. The low 31
/// bits count the exports in flight (each claimed by one adopting import).
inline constexpr uint32_t kPinnedExport = 1u << 31;

struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t num_blocks;
  uint64_t block_size;
  uint64_t data_offset;
  uint64_t total_size;
  int32_t creator_pid;
  uint32_t reserved;
  // followed by uint32_t refs[num_blocks], then uint32_t exports[num_blocks]
};

class Segment {
 public:
  /// Creates, reserves (posix_fallocate) and maps a new segment. Throws ShmError when the
  /// memory is not there (naming the place, bytes asked and free) or a syscall fails.
  static std::shared_ptr<Segment> create(SharingStrategy strategy, uint64_t block_size,
                                         uint32_t num_blocks);
  /// Maps a segment received as an fd (file_descriptor strategy); takes the fd.
  static std::shared_ptr<Segment> open_fd(UniqueFd fd);
  /// Maps a named segment (file_system strategy). Errors: ShmError (EPERM, syscall fstat)
  /// when the object is not owned by this process's effective user: its owner could
  /// truncate it under the mapping (a SIGBUS at the next access).
  static std::shared_ptr<Segment> open_name(const std::string& name);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  SharingStrategy strategy() const { return strategy_; }
  int fd() const { return fd_.get(); }
  const std::string& name() const { return name_; }
  /// Identity usable across processes and strategies ("fd:<dev>:<ino>" or "fs:<name>").
  const std::string& key() const { return key_; }
  uint64_t dev() const { return dev_; }
  uint64_t ino() const { return ino_; }
  uint64_t total_size() const { return size_; }
  uint64_t block_size() const { return block_size_; }
  uint32_t num_blocks() const { return num_blocks_; }
  uint64_t block_offset(uint32_t block) const {
    return data_offset_ + static_cast<uint64_t>(block) * block_size_;
  }
  char* block_ptr(uint32_t block) const { return base_ + block_offset(block); }
  /// Holders of `block` in every process.
  std::atomic_ref<uint32_t> refs(uint32_t block) const {
    auto* arr = reinterpret_cast<uint32_t*>(base_ + sizeof(SegmentHeader));
    return std::atomic_ref<uint32_t>(arr[block]);
  }
  /// Exports of `block` not yet imported (low 31 bits), and kPinnedExport.
  std::atomic_ref<uint32_t> exports(uint32_t block) const {
    auto* arr = reinterpret_cast<uint32_t*>(base_ + sizeof(SegmentHeader)) + num_blocks_;
    return std::atomic_ref<uint32_t>(arr[block]);
  }
  /// True in the process that created the segment (and not in its forked children).
  bool owned_here() const;
  /// Forget ownership (after fork, in the child): never unlink the name.
  void disown() { owner_pid_ = -1; }

 private:
  Segment() = default;
  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base_); }
  void map(uint64_t size, const std::string& what);
  void validate(const std::string& what);

  SharingStrategy strategy_ = SharingStrategy::kFileDescriptor;
  UniqueFd fd_;
  std::string name_;
  std::string key_;
  char* base_ = nullptr;
  uint64_t size_ = 0;
  uint64_t block_size_ = 0;
  uint64_t data_offset_ = 0;
  uint32_t num_blocks_ = 0;
  uint64_t dev_ = 0;
  uint64_t ino_ = 0;
  int owner_pid_ = -1;
};

/// Raw shared memory: one memfd or named POSIX shm object, reserved and mapped once. The
/// one place that creates and maps the shared memory of queue rings, queue spill files,
/// sync pages (Lock, Value, ...) and child error slots (tensor blocks use Segment).
///
/// Guarantees: the bytes are reserved with posix_fallocate before mapping, so a full
/// /dev/shm (or memory) is a ShmError naming the bytes asked and free, never a SIGBUS later.
/// memfds are sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): no holder of the fd can
/// truncate them under the others; open_fd refuses fds without those seals, and any object
/// smaller than asked. Named objects are mode 0600 (they cannot be sealed), and open_named
/// maps only objects of this process's effective user.
/// Safety: a ShmRegion is not shared between threads while moved; data() is.
class ShmRegion {
 public:
  ShmRegion() = default;
  ~ShmRegion();
  ShmRegion(ShmRegion&& o) noexcept { *this = std::move(o); }
  ShmRegion& operator=(ShmRegion&& o) noexcept;
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  /// A new zero-filled, sealed memfd of `bytes` (> 0), mapped read-write. `what` names it
  /// in errors and in /proc/<pid>/fd. Errors: ShmError (out of memory: asked and free).
  static ShmRegion create_memfd(uint64_t bytes, const char* what);
  /// A new named object `name` ("/torchpar_..."; O_EXCL: ShmError with errno EEXIST when it
  /// exists) of `bytes`, mapped read-write. The caller unlinks the name.
  static ShmRegion create_named(const std::string& name, uint64_t bytes);
  /// Maps a memfd received from a peer. Errors: ShmError (EINVAL) when it is not a regular
  /// file, lacks the seals, or is smaller than `min_bytes`.
  static ShmRegion open_fd(UniqueFd fd, uint64_t min_bytes, const char* what);
  /// Maps the named object `name` (read-only unless `writable`), whole. Errors: ShmError
  /// (ENOENT when gone; EINVAL when smaller than `min_bytes`; EPERM when another user owns
  /// it, who could truncate it under the mapping).
  static ShmRegion open_named(const std::string& name, bool writable, uint64_t min_bytes = 1);

  char* data() const { return base_; }
  uint64_t size() const { return size_; }
  /// The memfd (-1 for named objects: no fd is kept for them).
  int fd() const { return fd_.get(); }
  /// Gives up the fd, keeping the mapping.
  UniqueFd release_fd() { return std::move(fd_); }

 private:
  void map(int fd, uint64_t size, bool writable, const std::string& what);
  UniqueFd fd_;
  char* base_ = nullptr;
  uint64_t size_ = 0;
};

/// Maps `bytes` of the shared object behind `fd` read-write (MAP_SHARED), for a forked child
/// before it runs anything else (spawn and forkserver children map their error slot with
/// it). No allocation, no exception, no lock: safe between fork and exec in a process whose
/// other threads are gone. Returns nullptr when mmap fails (the caller _exit()s with its own
/// code); the mapping lives until the process exits. Use ShmRegion everywhere else.
void* map_shared_fd_noexcept(int fd, size_t bytes) noexcept;

/// Bytes free where a new segment of `strategy` would go (/dev/shm, or MemAvailable for
/// memfd). Used for the ShmError message and the pre-check.
uint64_t shm_bytes_free(SharingStrategy strategy);

/// This process's pid without a system call each time (getpid() is one, and allocation,
/// release and export ask often); a forked child refreshes it (pthread_atfork).
/// Safety: any thread.
int cached_pid();

}  // namespace torchpar::detail
