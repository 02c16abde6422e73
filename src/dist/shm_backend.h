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

#include <memory>

#include "backend.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace torchpar::detail {

/// Bytes of one data slot (per rank and set); TORCHPAR_SHM_SLOT_BYTES overrides.
size_t shm_slot_bytes();

/// Creates the shm backend for a group; collective over its members. `store` is the
/// group's (prefixed) store; `p2p` carries send/recv.
std::shared_ptr<GroupBackend> make_shm_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, std::vector<int> world_ranks,
                                               std::chrono::duration<double> timeout,
                                               std::string name, std::shared_ptr<GroupBackend> p2p);

}  // namespace torchpar::detail
