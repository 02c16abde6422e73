#pragma once
// A segment of tensor blocks (the allocator's layout): one ShmRegion, mapped once per
// process. Private to shm/ (other layers include shm/region.h).
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

#include "region.h"
#include "torchpar/core/fd.h"
#include "torchpar/shm/sharing_strategy.h"

namespace torchpar::detail {

inline constexpr uint64_t kSegmentMagic = 0x314d485352415054ULL;  // "TPARSHM1"
inline constexpr uint32_t kSegmentVersion = 1;
/// The top bit of a block's exports word: the block has an export that pins it for
/// borrowers (DumpsContext::pin_shared, a manager's stored value) rather than one in flight.
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

/// A segment of tensor blocks, built on a ShmRegion (region.h): a memfd (file_descriptor
/// strategy) or a named object owned by this process's cleaner (file_system strategy).
/// Private to shm/: other layers use ShmRegion.
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
  int fd() const { return region_.fd(); }
  const std::string& name() const { return region_.name(); }
  /// Identity usable across processes and strategies ("fd:<dev>:<ino>" or "fs:<name>").
  const std::string& key() const { return key_; }
  uint64_t dev() const { return region_.dev(); }
  uint64_t ino() const { return region_.ino(); }
  uint64_t total_size() const { return region_.size(); }
  uint64_t block_size() const { return block_size_; }
  uint32_t num_blocks() const { return num_blocks_; }
  uint64_t block_offset(uint32_t block) const {
    return data_offset_ + static_cast<uint64_t>(block) * block_size_;
  }
  char* block_ptr(uint32_t block) const { return region_.data() + block_offset(block); }
  /// Holders of `block` in every process.
  std::atomic_ref<uint32_t> refs(uint32_t block) const {
    return std::atomic_ref<uint32_t>(counters_[block]);
  }
  /// Exports of `block` not yet imported (low 31 bits), and kPinnedExport.
  std::atomic_ref<uint32_t> exports(uint32_t block) const {
    return std::atomic_ref<uint32_t>(counters_[num_blocks_ + block]);
  }
  /// True in the process that created the segment (and not in its forked children).
  bool owned_here() const;
  /// Forget ownership (after fork, in the child): never unlink the name.
  void disown() { owner_pid_ = -1; }

 private:
  Segment() = default;
  void set_geometry(uint64_t block_size, uint32_t num_blocks, uint64_t data_offset);
  void validate(const std::string& what);

  SharingStrategy strategy_ = SharingStrategy::kFileDescriptor;
  ShmRegion region_;
  std::string key_;
  uint32_t* counters_ = nullptr;  // refs[num_blocks], then exports[num_blocks]
  uint64_t block_size_ = 0;
  uint64_t data_offset_ = 0;
  uint32_t num_blocks_ = 0;
  int owner_pid_ = -1;
};

/// This process's pid without a system call each time (getpid() is one, and allocation,
/// release and export ask often); a forked child refreshes it (pthread_atfork).
/// Safety: any thread.
int cached_pid();

}  // namespace torchpar::detail
