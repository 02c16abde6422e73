#pragma once
/// dumps / loads: the "pickle" of torchpar.
///
/// Any cereal-serializable type works: arithmetic types, enums, std::string, vector,
/// array, map, unordered_map, set, tuple, pair, optional, variant, unique_ptr/shared_ptr,
/// user types with `template <class Archive> void serialize(Archive&)` (or save/load),
/// plus at::Tensor and c10::IValue (None, bool, int, double, complex, string, tensor,
/// list, dict, tuple). Tensors that share a storage inside one value still share it after
/// loads.

#include <cereal/types/array.hpp>
#include <cereal/types/map.hpp>
#include <cereal/types/memory.hpp>
#include <cereal/types/optional.hpp>
#include <cereal/types/set.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/tuple.hpp>
#include <cereal/types/unordered_map.hpp>
#include <cereal/types/utility.hpp>
#include <cereal/types/variant.hpp>
#include <cereal/types/vector.hpp>

#include "torchpar/serialize/archive.h"

namespace torchpar {

/// Serializes `value` into a Payload.
///
/// Units:   tensor bytes travel in the payload (copy_tensor=true, the default, as machin's
///          dumps) or stay in shared memory (false: the payload holds one fd per distinct
///          segment, or segment names). Queue, Connection::send and Pool default to false
///          (torch.multiprocessing); see DumpsOptions::copy_tensor.
/// Errors:  ShmError when a tensor must be moved to shared memory and cannot;
///          c10::Error for a non-CPU or non-strided tensor.
/// Safety:  thread-safe for distinct values.
/// Source:  machin.parallel.pickle.dumps(obj, copy_tensor) / ForkingPickler.
template <class T>
Payload dumps(const T& value, DumpsOptions options = {}) {
  Payload payload;
  detail::OutputArchive ar(payload, options);
  ar(value);
  return payload;
}

/// Rebuilds a `T` (default-constructible) from a payload made by `dumps<T>`.
/// Shared-mode tensors alias the sender's memory; each such payload is meant to be loaded
/// once (every load adopts one reference the dumps took), unless
/// `options.adopt_shared` is false (see LoadsOptions).
///
/// Errors:  SerializationError for truncated, corrupted or foreign bytes, a different
///          type, trailing bytes, or shared memory that cannot be opened; never crashes,
///          never allocates more than the payload's size justifies.
/// Safety:  thread-safe. Source: machin.parallel.pickle.loads.
template <class T>
T loads(const Payload& payload, LoadsOptions options = {}) {
  T value{};
  detail::load_payload(
      payload, [&](detail::InputArchive& ar) { ar(value); }, options);
  return value;
}

}  // namespace torchpar
