#pragma once
// Flat buffers: a whole gradient or state dict as views of one byte buffer (one allocation,
// one shared-memory handle, one mapping for a receiver), and a pool that hands a buffer out
// again once nothing references it, so that a steady server allocates and faults in nothing.

#include <ATen/ATen.h>
#include <sys/mman.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "core/prefault.h"
#include "torchpar/server/ordered_server.h"

namespace torchpar::detail {

/// Alignment of every view in a flat buffer (bytes): a cache line, a multiple of every
/// element size.
constexpr int64_t kFlatAlign = 64;

inline int64_t flat_round(int64_t nbytes) {
  return (nbytes + kFlatAlign - 1) / kFlatAlign * kFlatAlign;
}

/// Bytes of the flat layout of `tensors` (defined ones, in map order), each stored as
/// `type_of(tensor)`. At least kFlatAlign.
template <class TypeOf>
int64_t flat_bytes(const StateDict& tensors, TypeOf type_of) {
  int64_t total = 0;
  for (const auto& [k, t] : tensors) {
    if (t.defined())
      total += flat_round(t.numel() * static_cast<int64_t>(c10::elementSize(type_of(t))));
  }
  return std::max(total, kFlatAlign);
}

/// Copies of `tensors` as contiguous views of `flat` (a byte tensor of at least flat_bytes),
/// each of type `type_of(tensor)`; undefined entries stay undefined.
template <class TypeOf>
StateDict copy_into_flat(const at::Tensor& flat, const StateDict& tensors, TypeOf type_of) {
  StateDict out;
  int64_t offset = 0;
  for (const auto& [k, t] : tensors) {
    if (!t.defined()) {
      out.emplace(k, t);
      continue;
    }
    const auto type = type_of(t);
    const auto elem = static_cast<int64_t>(c10::elementSize(type));
    at::Tensor view = at::empty({0}, at::TensorOptions().dtype(type))
                          .set_(flat.storage(), (flat.storage_offset() + offset) / elem, t.sizes());
    view.copy_(t.detach());
    out.emplace(k, std::move(view));
    offset += flat_round(t.numel() * elem);
  }
  return out;
}

/// `nbytes` of private memory in transparent huge pages where the kernel allows, populated
/// at once: fresh 4 KiB pages cost ~25 us a fault on the pvm VMs we measure on (16 MiB:
/// ~100 ms), huge pages ~1 ms. Unmapped when the last view of it goes. Below one huge page,
/// and when mmap fails: at::empty.
inline at::Tensor huge_page_bytes(int64_t nbytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  if (static_cast<size_t>(nbytes) < kHuge) return at::empty({nbytes}, at::kByte);
  const size_t want = (static_cast<size_t>(nbytes) + kHuge - 1) / kHuge * kHuge;
  const size_t len = want + kHuge;  // room to align the start to a huge page
  void* base = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return at::empty({nbytes}, at::kByte);
  void* data = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) &
                                       ~(uintptr_t{kHuge} - 1));
  ::madvise(data, want, MADV_HUGEPAGE);  // best effort
  prefault_for_write(data, static_cast<size_t>(nbytes));
  return at::from_blob(
      data, {nbytes}, [base, len](void*) { ::munmap(base, len); },
      at::TensorOptions().dtype(at::kByte));
}

/// Flat byte buffers made by `make`, kept (at most `capacity`) and handed out again once
/// free: a buffer is free when only the pool references its storage (every user holds
/// views of it, which do). Safety: thread-safe.
class FlatBufferPool {
 public:
  FlatBufferPool(size_t capacity, std::function<at::Tensor(int64_t)> make)
      : capacity_(capacity), make_(std::move(make)) {}

  /// A buffer of at least `nbytes` (a byte tensor of its own over a free pooled buffer, or
  /// a new one): busy until it and the views made of it are gone.
  at::Tensor take(int64_t nbytes) {
    {
      std::lock_guard<std::mutex> g(mu_);
      for (const auto& buf : buffers_) {
        if (buf.numel() >= nbytes && buf.storage().use_count() == 1) return claim(buf);
      }
    }
    at::Tensor fresh = make_(nbytes);
    std::lock_guard<std::mutex> g(mu_);
    if (buffers_.size() >= capacity_) return fresh;
    buffers_.push_back(fresh);
    return claim(fresh);
  }

 private:
  // A second tensor over the buffer's storage: its use count now says busy.
  static at::Tensor claim(const at::Tensor& buf) {
    return at::empty({0}, at::kByte).set_(buf.storage(), 0, {buf.numel()});
  }

  std::mutex mu_;
  std::vector<at::Tensor> buffers_;
  size_t capacity_;
  std::function<at::Tensor(int64_t)> make_;
};

}  // namespace torchpar::detail
