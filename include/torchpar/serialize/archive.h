#pragma once
/// torchpar's cereal archives: a binary format with out-of-band tensor storage.
///
/// Wire format: docs/wire_format.md. Loading is hostile-input safe: container sizes are
/// checked against the bytes left (arithmetic vectors and strings by bytes; other vectors,
/// deques and lists grow one loaded element at a time), nesting is limited to 512 levels,
/// shared_ptr ids are type-checked, bools are range-checked, and every failure is a
/// SerializationError. User enums are loaded as their underlying integer, unchecked.

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <cereal/cereal.hpp>
#include <cereal/details/helpers.hpp>
#include <cereal/types/memory.hpp>
#include <cereal/types/string.hpp>

#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <type_traits>
#include <typeindex>
#include <unordered_map>
#include <vector>

#include "torchpar/core/error.h"
#include "torchpar/serialize/detail/context.h"
#include "torchpar/serialize/payload.h"

namespace c10 {
struct IValue;  // <ATen/core/ivalue.h>: archived by value only where it is complete
}  // namespace c10

namespace torchpar {

/// Options of `dumps`.
struct DumpsOptions {
  /// true: tensor bytes travel inside the payload (machin's copy_tensor=True).
  /// false: only shared-memory handles travel; a tensor not yet shared is moved to shared
  /// memory first (in place, as torch.multiprocessing's queues do) and the receiver
  /// aliases the sender's memory.
  /// Default true, as machin.parallel.pickle.dumps(copy_tensor=True): a payload is
  /// self-contained unless asked otherwise. The channels default to false instead, as
  /// torch.multiprocessing shares tensors: QueueOptions, Connection::send (SendOptions),
  /// PoolOptions and Process arguments (always shared).
  bool copy_tensor = true;
};

namespace detail {

class OutputArchive : public cereal::OutputArchive<OutputArchive, cereal::AllowEmptyClassElision> {
 public:
  OutputArchive(Payload& out, DumpsContext opts);
  /// With borrow_fds, when an exception unwinds the dumps: releases the borrowed fds.
  ~OutputArchive();
  OutputArchive(const OutputArchive&) = delete;
  OutputArchive& operator=(const OutputArchive&) = delete;
  void saveBinary(const void* data, size_t size) {
    out_.bytes.append(static_cast<const char*>(data), size);
  }
  const DumpsContext& options() const { return opts_; }
  /// Bytes written so far.
  size_t size() const { return out_.bytes.size(); }
  /// Room for `n` more bytes in one allocation (no doubling copies); a large reservation is
  /// also backed by memory ready for writing (transparent huge pages where the kernel allows).
  void reserve_more(size_t n);
  /// Storage identity: returns {id, true} the first time a storage is seen.
  std::pair<uint32_t, bool> storage_id(const c10::StorageImpl* impl);
  /// Index of a borrowed fd in the payload's fd list (dup'ed the first time).
  uint32_t fd_index(int fd);

 private:
  Payload& out_;
  DumpsContext opts_;
  std::unordered_map<const c10::StorageImpl*, uint32_t> storages_;
  std::vector<c10::Storage> kept_;  // keeps numbered storages alive: no address reuse
  std::unordered_map<int, uint32_t> fds_;
  int uncaught_;  // std::uncaught_exceptions() at construction
};

struct SharedBuffer;  // serialize/payload_buffers.h

class InputArchive : public cereal::InputArchive<InputArchive, cereal::AllowEmptyClassElision> {
 public:
  /// Reads `in`. With `consumable` (in.bytes, of a payload given to loads by rvalue), large
  /// copied storages may alias those bytes instead of being copied: the archive then takes
  /// them over (see consumable_buffer).
  explicit InputArchive(const Payload& in, LoadsContext opts = {},
                        std::string* consumable = nullptr);
  ~InputArchive();
  InputArchive(const InputArchive&) = delete;
  InputArchive& operator=(const InputArchive&) = delete;
  void loadBinary(void* data, size_t size) {
    if (size > remaining())
      throw SerializationError("payload truncated: needed " + std::to_string(size) +
                               " more bytes, " + std::to_string(remaining()) + " left");
    if (size != 0) std::memcpy(data, data_ + pos_, size);
    pos_ += size;
  }
  size_t remaining() const { return size_ - pos_; }
  /// Bytes of the whole payload.
  size_t size() const { return size_; }
  /// Pointer to the next `size` bytes, consumed (bounds checked).
  const char* take(size_t size) {
    if (size > remaining()) loadBinary(nullptr, size);  // throws
    const char* p = data_ + pos_;
    pos_ += size;
    return p;
  }
  /// The payload's fds (its bytes may have moved to consumable_buffer).
  const Payload& payload() const { return in_; }
  const LoadsContext& options() const { return opts_; }
  /// For a consumable payload: its bytes, moved (at the same address) into a buffer that
  /// storages can alias (storage_over); nullptr otherwise. The archive holds one reference.
  SharedBuffer* consumable_buffer();
  /// A duplicate of the payload's fd #index (for types that carry an fd, like queues).
  UniqueFd take_fd(uint32_t index) const;
  std::vector<c10::Storage>& storages() { return storages_; }
  /// Nesting of cereal's process() calls (prologue/epilogue): throws past 512 levels.
  void enter() {
    if (++nesting_ > 512) throw SerializationError("value nested deeper than 512 levels");
  }
  void leave() { --nesting_; }
  /// shared_ptr identity, type-checked (cereal's own table is untyped).
  void register_shared(uint32_t id, std::type_index type, std::shared_ptr<void> p);
  std::shared_ptr<void> get_shared(uint32_t id, std::type_index type) const;
  /// Nesting guard for recursive values (IValue): throws past 256 levels.
  struct DepthGuard {
    explicit DepthGuard(InputArchive& ar);
    ~DepthGuard() { --ar_.depth_; }
    InputArchive& ar_;
  };

 private:
  const Payload& in_;
  LoadsContext opts_;
  const char* data_;
  size_t size_;
  std::string* consumable_;
  SharedBuffer* shared_ = nullptr;
  size_t pos_ = 0;
  int depth_ = 0;
  int nesting_ = 0;
  std::vector<c10::Storage> storages_;
  std::unordered_map<uint32_t, std::pair<std::type_index, std::shared_ptr<void>>> shared_ptrs_;
};

template <class T>
void prologue(InputArchive& ar, const T&) {
  ar.enter();
}
template <class T>
void epilogue(InputArchive& ar, const T&) {
  ar.leave();
}

// ---- cereal hooks for the archives -------------------------------------------------

template <class T>
std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const T& t) {
  ar.saveBinary(std::addressof(t), sizeof(t));
}

template <class T>
std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, T& t) {
  if constexpr (std::is_same_v<T, bool>) {
    uint8_t b = 0;
    ar.loadBinary(&b, 1);
    if (b > 1) throw SerializationError("invalid bool byte " + std::to_string(b));
    t = b != 0;
  } else {
    ar.loadBinary(std::addressof(t), sizeof(t));
  }
}

template <class T>
void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const cereal::BinaryData<T>& bd) {
  ar.saveBinary(bd.data, static_cast<size_t>(bd.size));
}

template <class T>
void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, cereal::BinaryData<T>& bd) {
  ar.loadBinary(bd.data, static_cast<size_t>(bd.size));
}

template <class Archive, class T>
CEREAL_ARCHIVE_RESTRICT(InputArchive, OutputArchive)
CEREAL_SERIALIZE_FUNCTION_NAME(Archive& ar, cereal::NameValuePair<T>& t) {
  ar(t.value);
}

template <class T>
void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const cereal::SizeTag<T>& t) {
  const uint64_t n = static_cast<uint64_t>(t.size);
  ar.saveBinary(&n, sizeof n);
}

template <class T>
void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, cereal::SizeTag<T>& t) {
  uint64_t n = 0;
  ar.loadBinary(&n, sizeof n);
  // Every element of a container takes at least one byte on the wire.
  if (n > ar.remaining())
    throw SerializationError("container size " + std::to_string(n) + " exceeds the " +
                             std::to_string(ar.remaining()) + " bytes left in the payload");
  t.size = static_cast<std::remove_reference_t<T>>(n);
}

// Containers: never allocate ahead of what the payload holds.
template <class T, class A>
requires(!std::is_same_v<T, bool>) void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar,
                                                                  std::vector<T, A>& v) {
  cereal::size_type n = 0;
  ar(cereal::make_size_tag(n));
  v.clear();
  if constexpr (std::is_arithmetic_v<T>) {
    if (n > ar.remaining() / sizeof(T))
      throw SerializationError("vector of " + std::to_string(n) + " elements exceeds the " +
                               std::to_string(ar.remaining()) + " bytes left");
    v.resize(n);
    ar(cereal::binary_data(v.data(), static_cast<std::size_t>(n) * sizeof(T)));
  } else {
    v.reserve(std::min<cereal::size_type>(n, 1024));
    for (cereal::size_type i = 0; i < n; ++i) ar(v.emplace_back());
  }
}

template <class T, class A>
void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, std::deque<T, A>& d) {
  cereal::size_type n = 0;
  ar(cereal::make_size_tag(n));
  d.clear();
  for (cereal::size_type i = 0; i < n; ++i) ar(d.emplace_back());
}

template <class T, class A>
void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, std::list<T, A>& l) {
  cereal::size_type n = 0;
  ar(cereal::make_size_tag(n));
  l.clear();
  for (cereal::size_type i = 0; i < n; ++i) ar(l.emplace_back());
}

template <class C, class Tr, class A>
void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, std::basic_string<C, Tr, A>& str) {
  cereal::size_type n = 0;
  ar(cereal::make_size_tag(n));
  if (n > ar.remaining() / sizeof(C))
    throw SerializationError("string of " + std::to_string(n) + " characters exceeds the " +
                             std::to_string(ar.remaining()) + " bytes left");
  str.resize(static_cast<std::size_t>(n));
  ar(cereal::binary_data(str.data(), static_cast<std::size_t>(n) * sizeof(C)));
}

// shared_ptr: same wire format as cereal (id, then the value for a first occurrence), but
// an id is only ever resolved to a pointer of the type it was registered with.
template <class T>
void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar,
                               cereal::memory_detail::PtrWrapper<std::shared_ptr<T>&>& wrapper) {
  using NonConstT = std::remove_const_t<T>;
  uint32_t id = 0;
  ar(id);
  if (id == 0) {
    wrapper.ptr.reset();
  } else if ((id & cereal::detail::msb_32bit) != 0) {
    auto ptr = std::make_shared<NonConstT>();
    ar.register_shared(id & ~cereal::detail::msb_32bit, typeid(NonConstT), ptr);
    ar(*ptr);
    wrapper.ptr = std::move(ptr);
  } else {
    wrapper.ptr = std::static_pointer_cast<NonConstT>(ar.get_shared(id, typeid(NonConstT)));
  }
}

// Tensors (archive.cpp) and IValues (ivalue.cpp). The hooks are templates on the exact
// type: c10::IValue converts implicitly from tuples, strings, vectors..., and a plain
// overload would compete with cereal's own functions for those types.
void save_tensor(OutputArchive& ar, const at::Tensor& t);
void load_tensor(InputArchive& ar, at::Tensor& t);
void save_ivalue(OutputArchive& ar, const c10::IValue& v);
void load_ivalue(InputArchive& ar, c10::IValue& v);

template <class T>
requires std::is_same_v<T, at::Tensor>
void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const T& t) { save_tensor(ar, t); }
template <class T>
requires std::is_same_v<T, at::Tensor>
void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, T& t) { load_tensor(ar, t); }
template <class T>
requires std::is_same_v<T, c10::IValue>
void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const T& v) { save_ivalue(ar, v); }
template <class T>
requires std::is_same_v<T, c10::IValue>
void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, T& v) { load_ivalue(ar, v); }

/// Runs `body` on an InputArchive over `payload` (with `options`), checks the header and
/// that every byte was consumed, and turns any failure into SerializationError. With
/// `consumable` (payload.bytes, given by rvalue), large copied storages alias the bytes.
void load_payload(const Payload& payload, const std::function<void(InputArchive&)>& body,
                  LoadsContext options = {}, std::string* consumable = nullptr);

}  // namespace detail
}  // namespace torchpar

CEREAL_REGISTER_ARCHIVE(torchpar::detail::OutputArchive)
CEREAL_REGISTER_ARCHIVE(torchpar::detail::InputArchive)
CEREAL_SETUP_ARCHIVE_TRAITS(torchpar::detail::InputArchive, torchpar::detail::OutputArchive)
