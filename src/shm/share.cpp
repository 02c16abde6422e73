#include "torchpar/shm/share.h"

#include <unistd.h>

#include <c10/util/StringUtil.h>

#include <cstring>

#include <fmt/format.h>

#include "allocator.h"
#include "deferred_release.h"
#include "torchpar/core/error.h"
#include "torchpar/shm/handle.h"

namespace torchpar {
namespace detail {
namespace {

class ShmAllocator final : public at::Allocator {
 public:
  at::DataPtr allocate(size_t n) const override { return shm_allocate(n); }
  // The context of our DataPtrs is a BlockRef, not the data pointer, so raw_deallocate
  // cannot work: say so (nullptr) as the at::Allocator contract asks.
  at::DeleterFnPtr raw_deleter() const override { return nullptr; }
};

ShmAllocator g_allocator;

void check_shareable(const at::Tensor& t, const char* what) {
  if (!t.defined()) throw ValueError(c10::str(what, ": the tensor is undefined"));
  if (!t.device().is_cpu())
    throw ValueError(c10::str(what, ": only CPU tensors can be shared, got ", t.device()));
  if (t.layout() != at::kStrided)
    throw ValueError(c10::str(what, ": only strided tensors can be shared, got ", t.layout()));
}

}  // namespace

StorageHandle export_storage(const c10::Storage& storage, bool pin) {
  BlockRef* ref = block_of(storage);
  if (ref == nullptr) throw ValueError("export_storage: the storage is not in shared memory");
  StorageHandle h;
  h.strategy = ref->seg->strategy();
  h.fd = ref->seg->fd();
  h.name = ref->seg->name();
  h.segment_bytes = ref->seg->total_size();
  h.block = ref->block;
  h.nbytes = storage.nbytes();
  if (h.strategy == SharingStrategy::kFileDescriptor) {
    h.pid = cached_pid();
    h.fd_number = h.fd;
    h.dev = ref->seg->dev();
    h.ino = ref->seg->ino();
  }
  if (pin) {
    // One reference for every borrower to come, held for good (as an export nobody claims);
    // the bit is set once, so pinning again adds nothing.
    if ((ref->seg->exports(ref->block).fetch_or(kPinnedExport) & kPinnedExport) == 0)
      ref->seg->refs(ref->block).fetch_add(1);
    return h;
  }
  ref->seg->refs(ref->block).fetch_add(1);  // held for the importer, which adopts it
  ref->seg->exports(ref->block).fetch_add(1);
  return h;
}

c10::Storage import_storage(const StorageHandle& h, UniqueFd fd, bool adopt) {
  at::DataPtr dp = shm_import(h, std::move(fd), adopt);
  c10::Storage storage(c10::Storage::use_byte_size_t(), h.nbytes, std::move(dp), &g_allocator,
                       /*resizable=*/false);
  return storage;
}

void check_view_fits(at::ScalarType dtype, const std::vector<int64_t>& sizes,
                     const std::vector<int64_t>& strides, int64_t storage_offset,
                     uint64_t storage_nbytes) {
  if (sizes.size() != strides.size())
    throw SerializationError(
        fmt::format("tensor has {} sizes but {} strides", sizes.size(), strides.size()));
  if (sizes.size() > 64)
    throw SerializationError(fmt::format("tensor has {} dims (max 64)", sizes.size()));
  if (storage_offset < 0) throw SerializationError("tensor has a negative storage offset");
  const uint64_t item = c10::elementSize(dtype);
  // Highest element index touched; an empty tensor touches nothing. Every term is below
  // 2^62 * 2^63, so 128 bits cannot wrap before the comparison below.
  unsigned __int128 last = static_cast<uint64_t>(storage_offset);
  bool empty = false;
  unsigned __int128 numel = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0 || strides[i] < 0)
      throw SerializationError(fmt::format("tensor has a negative size or stride in dim {}", i));
    if (sizes[i] == 0) empty = true;
    numel *= static_cast<uint64_t>(sizes[i]);
    if (numel > (static_cast<unsigned __int128>(1) << 62))
      throw SerializationError("tensor has too many elements");
    if (sizes[i] > 0)
      last += static_cast<unsigned __int128>(sizes[i] - 1) * static_cast<uint64_t>(strides[i]);
    if ((last >> 64) != 0) throw SerializationError("tensor view exceeds addressable memory");
  }
  if (empty) return;
  if (last >= storage_nbytes / item)
    throw SerializationError(fmt::format(
        "tensor view (offset {}, sizes {}, strides {}) needs more "
        "than the {} bytes of its storage",
        storage_offset, fmt::join(sizes, "x"), fmt::join(strides, ","), storage_nbytes));
}

}  // namespace detail

at::Allocator* shm_allocator() { return &detail::g_allocator; }

bool is_shared(const at::Tensor& tensor) {
  return tensor.defined() && tensor.has_storage() && detail::block_of(tensor.storage()) != nullptr;
}

at::Tensor& share_memory_(at::Tensor& tensor) {
  detail::check_shareable(tensor, "share_memory_");
  if (is_shared(tensor)) return tensor;
  c10::StorageImpl* impl = tensor.storage().unsafeGetStorageImpl();
  const size_t nbytes = impl->nbytes();
  at::DataPtr dp = detail::shm_allocate(nbytes);
  if (nbytes > 0) std::memcpy(dp.get(), impl->data(), nbytes);
  at::DataPtr old = impl->set_data_ptr(std::move(dp));  // every view now sees shm
  impl->set_allocator(&detail::g_allocator);
  impl->set_resizable(false);
  detail::release_later(std::move(old), nbytes);  // a large private buffer: in the background
  return tensor;
}

at::Tensor empty_shared(at::IntArrayRef sizes, at::TensorOptions options) {
  if (!options.device().is_cpu() || options.layout() != at::kStrided)
    throw ValueError("empty_shared: only strided CPU tensors can be shared");
  auto dtype = c10::typeMetaToScalarType(options.dtype());
  int64_t numel = 1;
  for (auto s : sizes) {
    if (s < 0) throw ValueError(c10::str("empty_shared: negative size ", s));
    numel *= s;
  }
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, detail::shm_allocate(nbytes),
                       &detail::g_allocator, /*resizable=*/false);
  return at::empty({0}, options).set_(storage, 0, sizes);
}

TensorHandle export_tensor(at::Tensor& tensor) {
  detail::check_shareable(tensor, "export_tensor");
  share_memory_(tensor);
  TensorHandle h;
  h.storage = detail::export_storage(tensor.storage());
  h.dtype = tensor.scalar_type();
  h.sizes = tensor.sizes().vec();
  h.strides = tensor.strides().vec();
  h.storage_offset = tensor.storage_offset();
  h.requires_grad = tensor.requires_grad();
  return h;
}

at::Tensor import_tensor(const TensorHandle& h, UniqueFd fd) {
  detail::check_view_fits(h.dtype, h.sizes, h.strides, h.storage_offset, h.storage.nbytes);
  c10::Storage storage = detail::import_storage(h.storage, std::move(fd));
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(h.dtype))
                     .set_(storage, h.storage_offset, h.sizes, h.strides);
  if (h.requires_grad && (at::isFloatingType(h.dtype) || at::isComplexType(h.dtype)))
    t.requires_grad_(true);
  return t;
}

}  // namespace torchpar
