#pragma once
/// torchpar's cereal archives: a binary format with out-of-band tensor storage.
///
/// Wire format: docs/wire_format.md. Loading is hostile-input safe: every container size
/// is checked against the bytes left before anything is allocated, bools and enums are
/// range-checked, and every failure is a SerializationError.

#include <ATen/ATen.h>
#include <cereal/cereal.hpp>
#include <cereal/types/string.hpp>

#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "torchpar/core/error.h"
#include "torchpar/serialize/payload.h"

namespace torchpar {

/// Options of `dumps`.
struct DumpsOptions {
  /// true: tensor bytes travel inside the payload (machin's copy_tensor=True).
  /// false: only shared-memory handles travel; a tensor not yet shared is moved to shared
  /// memory first (in place, as torch.multiprocessing's queues do) and the receiver
  /// aliases the sender's memory.
  bool copy_tensor = true;
};

namespace detail {

class OutputArchive : public cereal::OutputArchive<OutputArchive, cereal::AllowEmptyClassElision> {
 public:
  OutputArchive(Payload& out, DumpsOptions opts);
  void saveBinary(const void* data, size_t size) {
    out_.bytes.append(static_cast<const char*>(data), size);
  }
  const DumpsOptions& options() const { return opts_; }
  void reserve_more(size_t n) {
    if (out_.bytes.capacity() - out_.bytes.size() < n) out_.bytes.reserve(out_.bytes.size() + n + 256);
  }
  /// Storage identity: returns {id, true} the first time a storage is seen.
  std::pair<uint32_t, bool> storage_id(const c10::StorageImpl* impl);
  /// Index of a borrowed fd in the payload's fd list (dup'ed the first time).
  uint32_t fd_index(int fd);

 private:
  Payload& out_;
  DumpsOptions opts_;
  std::unordered_map<const c10::StorageImpl*, uint32_t> storages_;
  std::unordered_map<int, uint32_t> fds_;
};

class InputArchive : public cereal::InputArchive<InputArchive, cereal::AllowEmptyClassElision> {
 public:
  InputArchive(const Payload& in);
  void loadBinary(void* data, size_t size) {
    if (size > remaining())
      throw SerializationError("payload truncated: needed " + std::to_string(size) +
                               " more bytes, " + std::to_string(remaining()) + " left");
    std::memcpy(data, in_.bytes.data() + pos_, size);
    pos_ += size;
  }
  size_t remaining() const { return in_.bytes.size() - pos_; }
  /// Pointer to the next `size` bytes, consumed (bounds checked).
  const char* take(size_t size) {
    if (size > remaining()) loadBinary(nullptr, size);  // throws
    const char* p = in_.bytes.data() + pos_;
    pos_ += size;
    return p;
  }
  const Payload& payload() const { return in_; }
  std::vector<c10::Storage>& storages() { return storages_; }
  /// Nesting guard for recursive values (IValue): throws past 256 levels.
  struct DepthGuard {
    explicit DepthGuard(InputArchive& ar);
    ~DepthGuard() { --ar_.depth_; }
    InputArchive& ar_;
  };

 private:
  const Payload& in_;
  size_t pos_ = 0;
  int depth_ = 0;
  std::vector<c10::Storage> storages_;
};

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

// Tensors (archive.cpp) and IValues (ivalue.cpp). The hooks are templates on the exact
// type: c10::IValue converts implicitly from tuples, strings, vectors..., and a plain
// overload would compete with cereal's own functions for those types.
void save_tensor(OutputArchive& ar, const at::Tensor& t);
void load_tensor(InputArchive& ar, at::Tensor& t);
void save_ivalue(OutputArchive& ar, const c10::IValue& v);
void load_ivalue(InputArchive& ar, c10::IValue& v);

template <class T>
  requires std::is_same_v<T, at::Tensor>
void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const T& t) {
  save_tensor(ar, t);
}
template <class T>
  requires std::is_same_v<T, at::Tensor>
void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, T& t) {
  load_tensor(ar, t);
}
template <class T>
  requires std::is_same_v<T, c10::IValue>
void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const T& v) {
  save_ivalue(ar, v);
}
template <class T>
  requires std::is_same_v<T, c10::IValue>
void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, T& v) {
  load_ivalue(ar, v);
}

/// Runs `body` on an InputArchive over `payload`, checks the header and that every byte
/// was consumed, and turns any failure into SerializationError.
void load_payload(const Payload& payload, const std::function<void(InputArchive&)>& body);

}  // namespace detail
}  // namespace torchpar

CEREAL_REGISTER_ARCHIVE(torchpar::detail::OutputArchive)
CEREAL_REGISTER_ARCHIVE(torchpar::detail::InputArchive)
CEREAL_SETUP_ARCHIVE_TRAITS(torchpar::detail::InputArchive, torchpar::detail::OutputArchive)
