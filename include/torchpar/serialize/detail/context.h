#pragma once
/// The serializer's internal knobs: how the channels, the RPC agent and the Manager call
/// dumps / loads (DumpsContext, LoadsContext, dumps_with, loads_with).
///
/// Internal: nothing here is public API (namespace torchpar::detail); it may change without
/// notice. It is an installed header only because the templates of the channels (Queue,
/// Connection::send, Pool), the RPC group and the Manager's proxies instantiate it in the
/// user's translation units. Users call dumps / loads (torchpar/serialize/serialize.h),
/// whose DumpsOptions holds what they choose: copy_tensor.

#include <c10/core/Storage.h>

#include <vector>

namespace torchpar::detail {

class FdElision;

/// How a dumps runs: DumpsOptions (copy_tensor) plus what only torchpar's own callers set.
struct DumpsContext {
  /// As DumpsOptions::copy_tensor.
  bool copy_tensor = true;
  /// Shared mode, file_descriptor strategy: put the segments' fds into the payload (for a
  /// Unix socket). false: the payload is bytes only and the receiver reopens each segment
  /// through /proc/<sender pid>/fd/<n> while the sender lives (for shared-memory queues,
  /// the Pool's chunks, a Manager's stored values).
  bool pass_fds = true;
  /// Out-of-band storages (the RPC layer's side channel): when set, with copy_tensor, each
  /// distinct storage is appended here instead of copied into the bytes, and the payload
  /// refers to it by index (docs/wire_format.md, storage mode 3). The caller sends them
  /// beside the bytes and hands them to loads (LoadsContext::storages). Not owned.
  std::vector<c10::Storage>* storages = nullptr;
  /// With `storages`: a storage already in torchpar shared memory (is_shared) travels as a
  /// handle (no copy) instead, reopened by the receiver through /proc/<pid>/fd while the
  /// sender lives (pass_fds is ignored): only for a receiver on the same host.
  bool shared_as_handles = false;
  /// For a payload sent at once and then dropped (Connection::send): its fds are the
  /// value's own descriptors (a shared tensor's segment, a Queue's), not duplicates, which
  /// saves a dup and a close a message. The caller must release() every one of them
  /// (never close them), and must not let the payload outlive the value. If dumps throws,
  /// they are released for it. Leave false anywhere else.
  bool borrow_fds = false;
  /// Shared mode, for a payload to be loaded any number of times with
  /// LoadsContext::adopt_shared=false (a manager's stored values): each block's export
  /// pins it for borrowers instead of waiting in flight for one adopting load. The sender
  /// never reuses a pinned block, and the block is readable while the sender lives: the
  /// sender's torchpar-shm-cleaner does not keep a pinned segment's name past the sender's
  /// exit (file_system), as the sender's /proc fd goes with it (file_descriptor). An
  /// adopting load of such a payload raises SerializationError. The pin is one atomic bit
  /// in the segment's header: any thread or process may dump the same storage, pinned or
  /// not, at once. No Python original: torch.multiprocessing's handles are loaded once.
  bool pin_shared = false;
  /// With pass_fds, for a payload sent at once over one connection (Connection::send): a
  /// segment whose fd this process passed over that connection lately travels without it
  /// (its receiver pinned the segment then; src/serialize/fd_elision.h). Not owned.
  FdElision* fd_elision = nullptr;
};

/// How a loads runs; the default is what the public loads does.
struct LoadsContext {
  /// How a shared-memory tensor handle (a payload of dumps with copy_tensor=false) is
  /// imported. true: the import adopts the reference its dumps took, so the payload is
  /// meant to be loaded once (a second load raises SerializationError). false: that
  /// reference stays with the payload and every load takes one of its own, so the payload
  /// can be loaded any number of times, by any process of the host (a manager's stored
  /// values). The price: the payload's reference is never given back, so the sender never
  /// reuses the block; it is freed when the sender has exited and the last process mapping
  /// it lets go (file_system strategy: when its name is gone too, which the sender's
  /// cleaner keeps for readers until an hour after the segment was made, or only until
  /// the sender's exit when the payload was made with DumpsContext::pin_shared).
  bool adopt_shared = true;
  /// The out-of-band storages of a payload made with DumpsContext::storages, in order;
  /// loaded tensors alias them (no copy). A payload that refers to one without them, or
  /// past their end, raises SerializationError. Not owned; must outlive the loads call.
  const std::vector<c10::Storage>* storages = nullptr;
  /// For a payload received over one connection (Connection::recv): each segment that
  /// arrived with its fd is pinned there, so that the sender's later handles to it, which
  /// come without (DumpsContext::fd_elision), find it mapped. Not owned.
  FdElision* fd_elision = nullptr;
};

}  // namespace torchpar::detail
