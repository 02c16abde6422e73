#pragma once
/// Handles: what travels between processes so that a receiver aliases shared memory.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <string>
#include <vector>

#include "torchpar/core/fd.h"
#include "torchpar/shm/sharing_strategy.h"

namespace torchpar {

/// Names one shared storage: its segment (an fd or a name), which block of it and how
/// many bytes. Units: bytes.
struct StorageHandle {
  SharingStrategy strategy = SharingStrategy::kFileDescriptor;
  int fd = -1;                 ///< file_descriptor: an fd valid in the process holding the handle
  std::string name;            ///< file_system: POSIX shm name ("/torchpar_<pid>_<n>")
  uint64_t segment_bytes = 0;  ///< size of the whole segment
  uint32_t block = 0;          ///< block index inside the segment
  uint64_t nbytes = 0;         ///< bytes of the storage
  /// file_descriptor: the exporting process, its fd number for the segment and the
  /// segment's identity. A receiver that got no fd (the handle crossed shared memory, not a
  /// socket) opens /proc/<pid>/fd/<fd_number> while the exporter lives, and checks it.
  int pid = 0;
  int fd_number = -1;
  uint64_t dev = 0;
  uint64_t ino = 0;
};

/// A storage handle plus the view of it: what rebuilds an aliasing tensor elsewhere.
struct TensorHandle {
  StorageHandle storage;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset = 0;
  bool requires_grad = false;
};

/// Exports the storage of `tensor` (moving it to shared memory first when needed). The
/// returned fd is borrowed from the segment: send it (SCM_RIGHTS) or dup it while the
/// tensor lives. Each export holds one cross-process reference on the block until the
/// handle is imported once; an export that is never imported only keeps the block from
/// being reused (the memory is still freed when every process is done).
/// Errors: as share_memory_.  Safety: thread-safe.
TensorHandle export_tensor(at::Tensor& tensor);

/// Rebuilds a tensor aliasing the exported memory, adopting the reference the export
/// took. For file_descriptor, `fd` is the received fd (taken; an fd already mapped in this
/// process is closed and the mapping reused). Import each exported handle once.
/// Errors: ShmError when the segment cannot be opened or is not a torchpar segment;
///         SerializationError when the handle does not fit the segment (block, bytes,
///         sizes/strides out of range).
at::Tensor import_tensor(const TensorHandle& handle, UniqueFd fd = UniqueFd());

namespace detail {
/// Storage-level halves of the above (the serializer keeps storage identity with them).
/// `adopt` false: the import takes a reference of its own instead of adopting the
/// export's, which then pins the block for good (LoadsContext::adopt_shared); it needs an
/// unclaimed export of the block (SerializationError otherwise). `pin`: the export pins
/// the block for borrowers instead of waiting in flight for one adopter
/// (DumpsContext::pin_shared).
StorageHandle export_storage(const c10::Storage& storage, bool pin = false);
c10::Storage import_storage(const StorageHandle& handle, UniqueFd fd, bool adopt = true);
/// Validates that sizes/strides/offset of `dtype` fit in `storage_nbytes`; throws
/// SerializationError naming the problem.
void check_view_fits(at::ScalarType dtype, const std::vector<int64_t>& sizes,
                     const std::vector<int64_t>& strides, int64_t storage_offset,
                     uint64_t storage_nbytes);
}  // namespace detail

}  // namespace torchpar
