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

namespace detail {

/// dumps with torchpar's internal knobs (serialize/detail/context.h): the channels, the
/// RPC agent and the Manager call this; users call dumps. Errors and safety as dumps.
template <class T>
Payload dumps_with(const T& value, const DumpsContext& context) {
  Payload payload;
  OutputArchive ar(payload, context);
  ar(value);
  return payload;
}

/// loads with torchpar's internal knobs (serialize/detail/context.h). Errors and safety as
/// loads.
template <class T>
T loads_with(const Payload& payload, const LoadsContext& context) {
  T value{};
  load_payload(
      payload, [&](InputArchive& ar) { ar(value); }, context);
  return value;
}

/// loads_with of a payload the caller gives up: large copied storages may alias its bytes,
/// as loads(Payload&&) says. Errors and safety as loads.
template <class T>
T loads_with(Payload&& payload, const LoadsContext& context) {
  T value{};
  load_payload(
      payload, [&](InputArchive& ar) { ar(value); }, context, &payload.bytes);
  return value;
}

}  // namespace detail

/// Serializes `value` into a Payload.
///
/// Units:   tensor bytes travel in the payload (copy_tensor=true, the default, as machin's
///          dumps) or stay in shared memory (false: the payload holds one fd per distinct
///          segment, or segment names). Queue, Connection::send and Pool default to false
///          (torch.multiprocessing); see DumpsOptions::copy_tensor.
/// Errors:  ShmError when a tensor must be moved to shared memory and cannot;
///          ValueError for a non-CPU or non-strided tensor.
/// Safety:  thread-safe for distinct values.
/// Source:  machin.parallel.pickle.dumps(obj, copy_tensor) / ForkingPickler.
template <class T>
Payload dumps(const T& value, DumpsOptions options = {}) {
  return detail::dumps_with(value, {.copy_tensor = options.copy_tensor});
}

/// Rebuilds a `T` (default-constructible) from a payload made by `dumps<T>`.
/// Shared-mode tensors alias the sender's memory; each such payload is meant to be loaded
/// once (every load adopts one reference the dumps took: a second load raises
/// SerializationError).
///
/// Errors:  SerializationError for truncated, corrupted or foreign bytes, a different
///          type, trailing bytes, or shared memory that cannot be opened; never crashes,
///          never allocates more than the payload's size justifies.
/// Safety:  thread-safe. Source: machin.parallel.pickle.loads.
template <class T>
T loads(const Payload& payload) {
  return detail::loads_with<T>(payload, {});
}

/// loads of a payload the caller gives up (a temporary, or std::move'd): as above, but a
/// copied tensor storage of at least 1 MiB that makes up at least 1/8 of the payload's bytes
/// is not copied: the tensor aliases the payload's bytes, which it keeps alive (at most 8x
/// its own size) until its storage is freed or resized. Such tensors are resizable like
/// copied ones (a resize moves them to memory of their own). The payload is left in a
/// valid but unspecified state, also when loads throws.
/// Errors, safety and source (machin.parallel.pickle.loads) as above.
template <class T>
T loads(Payload&& payload) {
  return detail::loads_with<T>(std::move(payload), {});
}

/// Frees the large buffers (32 MiB or more; at most 2, 256 MiB in all) that dumps and loads
/// keep for reuse: a tensor loaded from a copied payload gives its buffer back when freed,
/// and the next dumps or loads of that size writes into it instead of faulting in fresh
/// pages. Like empty_shm_cache, for a process that wants its memory back.
/// Errors: none. Safety: thread-safe. Source: torch.cuda.empty_cache, for payload buffers.
void empty_payload_cache();

}  // namespace torchpar
