#pragma once
/// Tensors whose storage lives in shared memory (torch.multiprocessing's sharing).

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

namespace torch::nn {
class Module;
}

namespace torchpar {

/// Moves the storage of `tensor` into shared memory in place and returns `tensor`.
/// Every view of that storage becomes shared too; the data is preserved (one memcpy).
/// A no-op when the storage is already shared. The storage becomes non-resizable, as in
/// PyTorch. Segments come from a cache, so in steady state this costs one memcpy. The
/// private buffer the storage leaves, when it is 8 MiB or more and from LibTorch's default
/// CPU allocator, is freed by a background thread of the process (its munmap was 40% of a
/// steady 64 MiB call); other buffers, and those with a deleter of their own (at::from_blob),
/// are freed before the call returns.
///
/// Shapes:  any shape, dtype and layout of a strided CPU tensor (incl. 0-dim and empty).
/// Errors:  ValueError for an undefined, non-CPU or non-strided tensor; ShmError when
///          shared memory is exhausted (naming /dev/shm or memfd, bytes asked and free);
///          the tensor is then unchanged.
/// Safety:  thread-safe against other torchpar calls; do not use the tensor from another
///          thread while it is being moved.
/// Source:  torch.Tensor.share_memory_.
at::Tensor& share_memory_(at::Tensor& tensor);

/// True when the storage of `tensor` lives in torchpar shared memory (made here by
/// share_memory_ / empty_shared, or received from another process).
/// Source: torch.Tensor.is_shared.
bool is_shared(const at::Tensor& tensor);

/// share_memory_ on every parameter and buffer of `module`, recursively.
/// Source: torch.nn.Module.share_memory.
void share_memory(torch::nn::Module& module);

/// A new uninitialized tensor whose storage is in shared memory from the start (saves the
/// copy of share_memory_). `options` must describe a strided CPU tensor.
at::Tensor empty_shared(at::IntArrayRef sizes, at::TensorOptions options = {});

/// The allocator behind shared storages: `at::empty(sizes, opts)` cannot take it, but
/// `at::Storage(at::Storage::use_byte_size_t(), n, shm_allocator())` can.
at::Allocator* shm_allocator();

/// Counters of this process's shared-memory allocator.
struct ShmStats {
  uint64_t segments = 0;          ///< segments mapped now (created or imported)
  uint64_t mapped_bytes = 0;      ///< bytes of those mappings
  uint64_t live_blocks = 0;       ///< storages alive in this process
  uint64_t cached_bytes = 0;      ///< free large segments kept for reuse
  uint64_t segments_created = 0;  ///< lifetime count of created segments
  uint64_t cache_hits = 0;        ///< large allocations served from the cache
};
/// Safety: thread-safe.
ShmStats shm_stats();

/// Releases free cached segments (their memory goes back to the system).
/// Source: torch.cuda.empty_cache, for the shared-memory cache.
void empty_shm_cache();

}  // namespace torchpar
