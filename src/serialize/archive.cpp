#include "torchpar/serialize/archive.h"

#include <fcntl.h>

#include <c10/util/StringUtil.h>

#include <exception>

#include <fmt/format.h>

#include "core/prefault.h"
#include "serialize/fd_elision.h"
#include "serialize/payload_buffers.h"
#include "shm/allocator.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"

#include "torchpar/shm/handle.h"
#include "torchpar/shm/share.h"

namespace torchpar::detail {
namespace {

constexpr char kMagic[4] = {'T', 'P', 'A', 'R'};
constexpr uint8_t kFormatVersion = 1;

enum class StorageMode : uint8_t { kCopy = 0, kFd = 1, kName = 2, kTable = 3, kCopyAligned = 4 };
// Storages of at least this many bytes are copied aligned (mode 4): their data starts at a
// multiple of kCopyAlignment from the payload's start, so a load may alias it in place.
constexpr size_t kAlignedCopyBytes = size_t{64} << 10;
constexpr size_t kCopyAlignment = 64;
// A load aliases a copied storage in a consumable payload (loads of an rvalue) when it has
// at least this many bytes and is at least 1/kAliasFraction of the payload, which bounds
// the bytes a kept tensor holds alive to kAliasFraction times its own.
constexpr size_t kAliasMinBytes = size_t{1} << 20;
constexpr size_t kAliasFraction = 8;
constexpr uint32_t kNoFd = 0xFFFFFFFFu;  // the fd did not travel with the payload

bool supported_dtype(int8_t v) {
  switch (static_cast<at::ScalarType>(v)) {
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
    case at::kHalf:
    case at::kFloat:
    case at::kDouble:
    case at::kComplexHalf:
    case at::kComplexFloat:
    case at::kComplexDouble:
    case at::kBool:
    case at::kBFloat16:
      return true;
    default:
      return false;
  }
}

template <class T>
T read(InputArchive& ar) {
  T v{};
  ar.loadBinary(&v, sizeof v);
  return v;
}

template <class T>
void write(OutputArchive& ar, T v) {
  ar.saveBinary(&v, sizeof v);
}

}  // namespace

OutputArchive::OutputArchive(Payload& out, DumpsContext opts)
    : cereal::OutputArchive<OutputArchive, cereal::AllowEmptyClassElision>(this),
      out_(out),
      opts_(opts),
      uncaught_(std::uncaught_exceptions()) {
  saveBinary(kMagic, sizeof kMagic);
  saveBinary(&kFormatVersion, 1);
}

OutputArchive::~OutputArchive() {
  // Unwinding out of dumps: the payload is about to be destroyed, and borrowed fds must not
  // be closed with it.
  if (opts_.borrow_fds && std::uncaught_exceptions() > uncaught_) {
    for (auto& fd : out_.fds) (void)fd.release();
  }
}

void OutputArchive::reserve_more(size_t n) {
  std::string& bytes = out_.bytes;
  if (bytes.capacity() - bytes.size() >= n) return;
  const size_t want = bytes.size() + n + 256;
  if (n < kCachedBufferBytes) {
    bytes.reserve(want);
    return;
  }
  // A buffer a loaded tensor gave back (payload_buffers.h): its pages are warm.
  std::string cached = take_payload_buffer(want);
  if (cached.capacity() >= want) {
    cached.append(bytes);
    bytes.swap(cached);
    return;
  }
  bytes.reserve(payload_buffer_capacity(want));
  // The block is fresh (mmapped by malloc at this size): fault it in at once, in huge pages
  // where the kernel allows, before the append writes it (prefault.h has the figures).
  prefault_private_for_write(bytes.data() + bytes.size(), n);
}

std::pair<uint32_t, bool> OutputArchive::storage_id(const c10::StorageImpl* impl) {
  auto [it, inserted] = storages_.emplace(impl, static_cast<uint32_t>(storages_.size()));
  if (inserted) {
    // Hold the storage until dumps returns: a temporary (resolve_conj) freed early could
    // hand its address to the next one, which would then alias the wrong id.
    kept_.emplace_back(
        c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(const_cast<c10::StorageImpl*>(impl)));
  }
  return {it->second, inserted};
}

UniqueFd InputArchive::take_fd(uint32_t index) const {
  if (index >= in_.fds.size() || !in_.fds[index].valid())
    throw SerializationError(
        fmt::format("value refers to fd #{} but the payload has {}", index, in_.fds.size()));
  return in_.fds[index].dup();
}

void InputArchive::register_shared(uint32_t id, std::type_index type, std::shared_ptr<void> p) {
  if (!shared_ptrs_.emplace(id, std::make_pair(type, std::move(p))).second)
    throw SerializationError(fmt::format("shared_ptr id {} defined twice", id));
}

std::shared_ptr<void> InputArchive::get_shared(uint32_t id, std::type_index type) const {
  auto it = shared_ptrs_.find(id);
  if (it == shared_ptrs_.end())
    throw SerializationError(fmt::format("shared_ptr id {} used before it was defined", id));
  if (it->second.first != type)
    throw SerializationError(
        fmt::format("shared_ptr id {} refers to an object of another type", id));
  return it->second.second;
}

uint32_t OutputArchive::fd_index(int fd) {
  auto it = fds_.find(fd);
  if (it != fds_.end()) return it->second;
  const auto idx = static_cast<uint32_t>(out_.fds.size());
  if (opts_.borrow_fds) {
    out_.fds.emplace_back(fd);  // borrow_fds: the caller releases it after sending
  } else {
    out_.fds.emplace_back(check_syscall("fcntl(F_DUPFD_CLOEXEC)", fmt::format("segment fd {}", fd),
                                        [&] { return ::fcntl(fd, F_DUPFD_CLOEXEC, 0); }));
  }
  fds_.emplace(fd, idx);
  return idx;
}

InputArchive::InputArchive(const Payload& in, LoadsContext opts, std::string* consumable)
    : cereal::InputArchive<InputArchive, cereal::AllowEmptyClassElision>(this),
      in_(in),
      opts_(opts),
      data_(in.bytes.data()),
      size_(in.bytes.size()),
      consumable_(consumable == &in.bytes ? consumable : nullptr) {}

InputArchive::~InputArchive() {
  if (shared_ != nullptr) release_shared_buffer(shared_);
}

SharedBuffer* InputArchive::consumable_buffer() {
  if (shared_ == nullptr && consumable_ != nullptr) {
    // Moving a heap-allocated string keeps its block, so data_ stays valid. A short string
    // (in-object, at most 15 bytes) never holds a storage worth aliasing.
    if (consumable_->data() != data_ || size_ < kAliasMinBytes) return nullptr;
    shared_ = new SharedBuffer(std::move(*consumable_));
    consumable_ = nullptr;
  }
  return shared_;
}

InputArchive::DepthGuard::DepthGuard(InputArchive& ar) : ar_(ar) {
  if (++ar_.depth_ > 256) {
    --ar_.depth_;
    throw SerializationError("value nested deeper than 256 levels");
  }
}

void save_tensor(OutputArchive& ar, const at::Tensor& tensor) {
  write<uint8_t>(ar, tensor.defined() ? 1 : 0);
  if (!tensor.defined()) return;
  if (!tensor.device().is_cpu())
    throw ValueError(c10::str("dumps: only CPU tensors can be serialized, got ", tensor.device()));
  if (tensor.layout() != at::kStrided || !tensor.has_storage() || tensor.is_quantized())
    throw ValueError("dumps: only strided, non-quantized tensors can be serialized");
  at::Tensor t = tensor;  // metadata and storage only: no detach (a dispatcher call)
  if (t.is_conj() || t.is_neg()) t = t.resolve_conj().resolve_neg();
  if (!supported_dtype(static_cast<int8_t>(t.scalar_type())))
    throw ValueError(c10::str("dumps: unsupported dtype ", t.scalar_type()));
  write<int8_t>(ar, static_cast<int8_t>(t.scalar_type()));
  write<uint8_t>(ar, static_cast<uint8_t>(t.dim()));
  for (auto s : t.sizes()) write<int64_t>(ar, s);
  for (auto s : t.strides()) write<int64_t>(ar, s);
  write<int64_t>(ar, t.storage_offset());
  write<uint8_t>(ar, tensor.requires_grad() ? 1 : 0);

  if (!ar.options().copy_tensor) share_memory_(t);  // in place: the caller's tensor too
  auto [id, first] = ar.storage_id(t.storage().unsafeGetStorageImpl());
  write<uint32_t>(ar, id);
  if (!first) return;
  const c10::Storage& storage = t.storage();
  auto* table = ar.options().copy_tensor ? ar.options().storages : nullptr;
  const bool as_handle = table != nullptr && ar.options().shared_as_handles && is_shared(t);
  if (table != nullptr && !as_handle) {
    write<uint8_t>(ar, static_cast<uint8_t>(StorageMode::kTable));
    write<uint64_t>(ar, storage.nbytes());
    write<uint32_t>(ar, static_cast<uint32_t>(table->size()));
    table->push_back(storage);
    return;
  }
  if (ar.options().copy_tensor && !as_handle) {
    const size_t nbytes = storage.nbytes();
    if (nbytes < kAlignedCopyBytes) {
      write<uint8_t>(ar, static_cast<uint8_t>(StorageMode::kCopy));
      write<uint64_t>(ar, nbytes);
      ar.saveBinary(storage.data(), nbytes);
      return;
    }
    write<uint8_t>(ar, static_cast<uint8_t>(StorageMode::kCopyAligned));
    write<uint64_t>(ar, nbytes);
    ar.reserve_more(nbytes + kCopyAlignment);  // one allocation, no doubling copies
    const size_t pad = (kCopyAlignment - (ar.size() + 1) % kCopyAlignment) % kCopyAlignment;
    write<uint8_t>(ar, static_cast<uint8_t>(pad));
    static constexpr char kZeros[kCopyAlignment] = {};
    ar.saveBinary(kZeros, pad);
    ar.saveBinary(storage.data(), nbytes);
    return;
  }
  StorageHandle h = export_storage(storage, ar.options().pin_shared);
  if (h.strategy == SharingStrategy::kFileDescriptor) {
    write<uint8_t>(ar, static_cast<uint8_t>(StorageMode::kFd));
    write<uint64_t>(ar, h.nbytes);
    FdElision* elision = ar.options().fd_elision;
    const bool pass = ar.options().pass_fds && !as_handle &&
                      !(elision != nullptr && elision->elide(h.dev, h.ino, h.segment_bytes));
    write<uint32_t>(ar, pass ? ar.fd_index(h.fd) : kNoFd);
    write<int32_t>(ar, h.pid);
    write<int32_t>(ar, h.fd_number);
    write<uint64_t>(ar, h.dev);
    write<uint64_t>(ar, h.ino);
  } else {
    write<uint8_t>(ar, static_cast<uint8_t>(StorageMode::kName));
    write<uint64_t>(ar, h.nbytes);
    ar(h.name);
  }
  write<uint64_t>(ar, h.segment_bytes);
  write<uint32_t>(ar, h.block);
}

namespace {

// The storage of a copied tensor whose bytes are at `src` inside the payload.
c10::Storage load_copied_storage(InputArchive& ar, const char* src, size_t nbytes) {
  // 16: the largest alignment of an element (complex<double>); the payload's block from
  // malloc is 16-aligned and mode 4 puts the data at a multiple of 64 from its start.
  if (nbytes >= kAliasMinBytes && nbytes >= ar.size() / kAliasFraction &&
      reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    if (SharedBuffer* buffer = ar.consumable_buffer()) return storage_over(buffer, src, nbytes);
  }
  if (nbytes >= kCachedBufferBytes) {
    // Large: a buffer a tensor gave back, or a fresh one faulted in at once (in huge pages
    // where the kernel allows); it returns to the cache when the tensor lets it go.
    std::string bytes = take_payload_buffer(nbytes);
    if (bytes.capacity() < nbytes) {
      bytes.reserve(payload_buffer_capacity(nbytes));
      prefault_private_for_write(bytes.data(), nbytes);
    }
    bytes.append(src, nbytes);
    auto* buffer = new SharedBuffer(std::move(bytes));
    c10::Storage st = storage_over(buffer, buffer->bytes.data(), nbytes);
    release_shared_buffer(buffer);
    return st;
  }
  c10::Storage st(c10::Storage::use_byte_size_t(), nbytes, at::getCPUAllocator(),
                  /*resizable=*/true);
  if (nbytes > 0) std::memcpy(st.data(), src, nbytes);
  return st;
}

}  // namespace

void load_tensor(InputArchive& ar, at::Tensor& tensor) {
  const auto defined = read<uint8_t>(ar);
  if (defined > 1) throw SerializationError("invalid tensor tag");
  if (defined == 0) {
    tensor = at::Tensor();
    return;
  }
  const auto dtype_raw = read<int8_t>(ar);
  if (!supported_dtype(dtype_raw))
    throw SerializationError(fmt::format("invalid tensor dtype code {}", dtype_raw));
  const auto dtype = static_cast<at::ScalarType>(dtype_raw);
  const auto ndim = read<uint8_t>(ar);
  if (ndim > 64) throw SerializationError(fmt::format("tensor has {} dims (max 64)", ndim));
  std::vector<int64_t> sizes(ndim), strides(ndim);
  for (auto& s : sizes) s = read<int64_t>(ar);
  for (auto& s : strides) s = read<int64_t>(ar);
  const auto offset = read<int64_t>(ar);
  const auto requires_grad = read<uint8_t>(ar);
  if (requires_grad > 1) throw SerializationError("invalid requires_grad flag");
  const auto id = read<uint32_t>(ar);
  auto& storages = ar.storages();
  if (id > storages.size())
    throw SerializationError(fmt::format("tensor refers to storage {} before it was defined", id));
  if (id == storages.size()) {
    const auto mode = read<uint8_t>(ar);
    const auto nbytes = read<uint64_t>(ar);
    if (mode == static_cast<uint8_t>(StorageMode::kCopy) ||
        mode == static_cast<uint8_t>(StorageMode::kCopyAligned)) {
      if (mode == static_cast<uint8_t>(StorageMode::kCopyAligned)) {
        const auto pad = read<uint8_t>(ar);
        if (pad >= kCopyAlignment)
          throw SerializationError(fmt::format("invalid storage padding {}", pad));
        (void)ar.take(pad);
      }
      if (nbytes > ar.remaining())
        throw SerializationError(fmt::format("tensor storage of {} bytes exceeds the {} bytes left",
                                             nbytes, ar.remaining()));
      storages.push_back(load_copied_storage(ar, ar.take(nbytes), nbytes));
    } else if (mode == static_cast<uint8_t>(StorageMode::kTable)) {
      const auto index = read<uint32_t>(ar);
      const auto* table = ar.options().storages;
      if (table == nullptr || index >= table->size())
        throw SerializationError(
            fmt::format("tensor refers to out-of-band storage #{} but the payload came with {}",
                        index, table == nullptr ? 0 : table->size()));
      if ((*table)[index].nbytes() != nbytes)
        throw SerializationError(
            fmt::format("out-of-band storage #{} has {} bytes, the payload says {}", index,
                        (*table)[index].nbytes(), nbytes));
      storages.push_back((*table)[index]);
    } else if (mode == static_cast<uint8_t>(StorageMode::kFd) ||
               mode == static_cast<uint8_t>(StorageMode::kName)) {
      StorageHandle h;
      h.nbytes = nbytes;
      uint32_t fd_idx = kNoFd;
      if (mode == static_cast<uint8_t>(StorageMode::kFd)) {
        h.strategy = SharingStrategy::kFileDescriptor;
        const auto idx = read<uint32_t>(ar);
        fd_idx = idx;
        h.pid = read<int32_t>(ar);
        h.fd_number = read<int32_t>(ar);
        h.dev = read<uint64_t>(ar);
        h.ino = read<uint64_t>(ar);
        if (idx != kNoFd) {
          if (idx >= ar.payload().fds.size())
            throw SerializationError(fmt::format("tensor refers to fd #{} but the payload has {}",
                                                 idx, ar.payload().fds.size()));
          if (!ar.payload().fds[idx].valid())
            throw SerializationError(fmt::format("fd #{} of the payload is not open", idx));
        }
      } else {
        h.strategy = SharingStrategy::kFileSystem;
        ar(h.name);
      }
      h.segment_bytes = read<uint64_t>(ar);
      h.block = read<uint32_t>(ar);
      // The payload's fd is borrowed: a segment mapped here already needs no dup of it.
      const int fd = fd_idx != kNoFd ? ar.payload().fds[fd_idx].get() : -1;
      storages.emplace_back(c10::Storage::use_byte_size_t(), h.nbytes,
                            shm_import_borrowed(h, fd, ar.options().adopt_shared), shm_allocator(),
                            /*resizable=*/false);
      if (fd >= 0 && ar.options().fd_elision != nullptr)
        ar.options().fd_elision->pin(h.pid, h.dev, h.ino, h.segment_bytes);
    } else {
      throw SerializationError(fmt::format("invalid tensor storage mode {}", mode));
    }
  }
  const c10::Storage& storage = storages[id];
  check_view_fits(dtype, sizes, strides, offset, storage.nbytes());
  // The tensor built directly (as at::empty_cpu does) rather than by empty + set_: two
  // dispatcher calls less on every message of a queue or pipe.
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage),
                                                   c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                   caffe2::TypeMeta::fromScalarType(dtype));
  impl->set_sizes_and_strides(sizes, strides, offset);
  tensor = at::Tensor(std::move(impl));
  if (requires_grad != 0 && (at::isFloatingType(dtype) || at::isComplexType(dtype)))
    tensor.requires_grad_(true);
}

void load_payload(const Payload& payload, const std::function<void(InputArchive&)>& body,
                  LoadsContext options, std::string* consumable) {
  try {
    InputArchive ar(payload, options, consumable);
    char magic[4];
    uint8_t version = 0;
    if (payload.bytes.size() < 5)
      throw SerializationError(
          fmt::format("payload of {} bytes is too short", payload.bytes.size()));
    ar.loadBinary(magic, 4);
    ar.loadBinary(&version, 1);
    if (std::memcmp(magic, kMagic, 4) != 0)
      throw SerializationError("not a torchpar payload (bad magic)");
    if (version != kFormatVersion)
      throw SerializationError(fmt::format("unsupported payload format version {}", version));
    body(ar);
    if (ar.remaining() != 0)
      throw SerializationError(
          fmt::format("{} trailing bytes after the value (wrong type?)", ar.remaining()));
  } catch (const SerializationError&) {
    throw;
  } catch (const std::exception& e) {
    throw SerializationError(std::string("loads: ") + e.what());
  }
}

}  // namespace torchpar::detail
