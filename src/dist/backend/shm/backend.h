#pragma once
// The shared-memory collective backend: every rank of the group maps one segment.
//
// Layout: a header page, one 256-byte control block per rank (arrival counter, pid, the
// metadata of its current operation, double-buffered), then 2 x size() data slots of
// slot_bytes each (slot (set, rank)). An operation is a sequence of steps; in step k a
// rank writes only its own slot of set k%2, then arrives (bumps its counter to k) and
// waits for every rank's counter to reach k, then reads any slot of set k%2. Arriving at
// k+1 means having finished reading set k%2... so set k%2 is free again at step k+2: one
// barrier per step, no second "done reading" barrier.
//
// all_reduce: small messages in one step (each rank reduces all slots, in rank order so every
// rank gets the same bits); large ones per chunk in two steps: reduce-scatter (rank r
// reduces its 1/P of the chunk into its slot of the other set) then all-gather.
//
// Failure: waits spin, then yield, then futex-sleep in slices of 100 ms, checking the
// deadline and that the awaited rank's pid lives. The first rank to see a failure marks
// the segment aborted with a message; every rank then throws RankLostError / TimeoutError.
// Point-to-point operations go through a Gloo group made beside the segment.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "dist/backend/backend.h"

namespace torchpar::detail {

/// Bytes of one data slot (per rank and set); TORCHPAR_SHM_SLOT_BYTES overrides.
size_t shm_slot_bytes();

/// Everything a shm group needs; every member passes the same `world_ranks`, and its own
/// `rank`. Every member must be on this host (same /dev/shm and pid namespace).
struct ShmBackendOptions {
  /// The group's store, already prefixed for this group: rank 0 publishes the segment's
  /// name there and every rank counts itself attached.
  c10::intrusive_ptr<c10d::Store> store;
  /// This process' rank in the group (0 .. world_ranks.size()-1).
  int rank = 0;
  /// World ranks of the members, in group order (for messages and CollectiveGroup::ranks).
  std::vector<int> world_ranks;
  /// Seconds: the limit for the rendezvous (every rank attached) and the default limit of
  /// each operation.
  std::chrono::duration<double> timeout = std::chrono::seconds(300);
  /// For messages: "group [0,1] #0 (rank 1 of 2, shm)".
  std::string name;
  /// Carries send/recv (isend/irecv): a gloo group of the same members. The shm backend
  /// owns it from here on (destroy() destroys it).
  std::shared_ptr<GroupBackend> p2p;
};

/// Creates the shm backend for a group; collective over its members.
/// Errors: TimeoutError when rank 0 does not publish the segment or a rank does not attach
/// within the timeout; ShmError when /dev/shm cannot hold the segment; torchpar::Error when
/// the segment cannot be opened (ranks on different hosts) or has another geometry.
std::shared_ptr<GroupBackend> create_shm_backend(const ShmBackendOptions& options);

}  // namespace torchpar::detail
