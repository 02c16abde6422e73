#pragma once
// The shared-memory collective backend: every rank of the group maps one segment, and
// collectives are copies and reductions through it, with spin-then-futex step barriers that
// watch the deadline and the awaited ranks' liveness. A failure breaks the group for every
// rank with the same error. Point-to-point operations go through a Gloo group made beside
// the segment. The class and its protocol are internal: backend_impl.h.

#include <memory>

#include "dist/backend/backend.h"
#include "dist/group_spec.h"

namespace torchpar::detail {

/// Everything a shm group needs. Every member must be on this host (same /dev/shm and pid
/// namespace).
struct ShmBackendOptions {
  /// The group: rank 0 publishes the segment's name in `group.store` and every rank counts
  /// itself attached there; `group.timeout` limits that rendezvous (every rank attached) and
  /// is the default limit of each operation.
  GroupSpec group;
  /// Carries send/recv (isend/irecv): a gloo group of the same members. The shm backend
  /// owns it from here on (destroy() destroys it).
  std::shared_ptr<GroupBackend> p2p;
};

/// Creates the shm backend for a group; collective over its members.
/// Errors: TimeoutError when rank 0 does not publish the segment or a rank does not attach
/// within the timeout; ShmError when /dev/shm cannot hold the segment; torchpar::Error when
/// the segment cannot be opened (ranks on different hosts) or has another geometry;
/// ValueError when TORCHPAR_SHM_SLOT_BYTES is not a whole decimal number.
std::shared_ptr<GroupBackend> create_shm_backend(const ShmBackendOptions& options);

}  // namespace torchpar::detail
