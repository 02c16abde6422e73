#pragma once
// The shared-memory allocator of this process: slab segments for small storages, one
// segment per large storage with a cache of free ones, a registry of imported segments,
// and fork handling. All state is behind one mutex.

#include <ATen/ATen.h>

#include <memory>

#include "segment.h"
#include "torchpar/shm/handle.h"
#include "torchpar/shm/share.h"

namespace torchpar::detail {

/// DataPtr context of every shared storage.
struct BlockRef {
  std::shared_ptr<Segment> seg;
  uint32_t block = 0;
  uint64_t nbytes = 0;
  bool local_owner = false;  // this process's allocator may reuse the block once free
  bool inherited = false;    // came with fork(): the parent may give its reference back
  BlockRef* prev = nullptr;  // intrusive list of live refs (for fork)
  BlockRef* next = nullptr;
};

void block_deleter(void* ctx);

/// The BlockRef behind `storage`, or nullptr when it is not torchpar shared memory.
BlockRef* block_of(const c10::Storage& storage);

/// Allocates `nbytes` of shared memory in the current sharing strategy.
at::DataPtr shm_allocate(uint64_t nbytes);

/// Maps (or finds already mapped) the segment of a handle and returns a DataPtr for one
/// block, adopting one reference (claiming one export), or with `adopt` false taking a
/// new reference while an unclaimed export pins the block. `fd` is consumed.
at::DataPtr shm_import(const StorageHandle& handle, UniqueFd fd, bool adopt = true);
/// shm_import with the received fd borrowed (-1: none): a segment mapped here already is
/// found by the handle's dev/ino and the fd is not touched; otherwise the mapping keeps a
/// duplicate of it, or `*owned` when that holds the same fd (it is then moved from).
at::DataPtr shm_import_borrowed(const StorageHandle& handle, int fd, bool adopt = true,
                                UniqueFd* owned = nullptr);

/// The segment of the file_descriptor strategy with identity (dev, ino) when this process
/// has it mapped, else nullptr (a connection's FdElision pins it). Safety: any thread.
std::shared_ptr<Segment> mapped_fd_segment(uint64_t dev, uint64_t ino);

/// In the parent right after fork(): the references the fork took on every live storage
/// (for the child) now belong to `pid`.
void claim_fork_refs(int pid);
/// After reaping `pid`: gives those references back, so the blocks can be reused.
void release_fork_refs(int pid);
/// In a child forked by the process layer: the parent gives back the references of the
/// inherited storages when it reaps us, so dropping them here must not.
void parent_releases_fork_refs();

}  // namespace torchpar::detail
