#pragma once
// The hierarchical collective backend: shared memory inside each host, Gloo between one
// leader per host (NCCL's and MPI's two-level collectives).
//
// A host is a host key of the rendezvous (MemberInfo::host: host name, boot id, pid and
// network namespace, /dev/shm). Hosts are numbered by their lowest group rank; a host's
// members are its "local" ranks, in group order, and the first of them is its leader.
// Per host, the local ranks form a shm group (none when a host holds one rank); the leaders
// form a gloo group (none on one host); a flat gloo group of every member carries
// all_to_all and send/recv.
//
//   all_reduce     shm reduce to the leader -> gloo all_reduce among leaders -> shm broadcast
//   broadcast      shm broadcast on the root's host -> gloo broadcast -> shm broadcast
//   reduce         shm reduce -> gloo reduce to the root's leader -> shm broadcast there
//   all_gather     shm gather -> gloo all_gather of host blocks -> shm broadcast of them all
//   gather         shm gather -> gloo gather of host blocks -> to the root
//   scatter        to the root's leader -> gloo scatter of host blocks -> shm scatter
//   reduce_scatter shm reduce of all blocks -> gloo reduce_scatter of host blocks -> scatter
//   barrier        shm barrier -> gloo barrier -> shm barrier
// Host blocks have max(local ranks) rows, so hosts may hold different numbers of ranks.
// Network bytes per all_reduce of S bytes: each leader sends 2(H-1)/H x S over the
// network (Gloo's ring among H leaders), where a flat ring of P = H x L ranks ordered by
// host sends 2(P-1)/P x S from each host; the gain is fewer network steps (2(H-1) instead
// of 2(P-1)) and no loopback TCP inside a host (docs/distributed.md, "Across hosts").
//
// Failure: the first member that sees a failure publishes "<group rank>|<kind>|<message>"
// under the group's store key "hier/abort" (kind: a rank lost, a timeout, or the members
// disagree), then breaks the levels it belongs to (aborts its host's shm segment with the
// same kind; a leader destroys its leaders' gloo group, so the other leaders' gloo
// operations fail at once instead of at their timeout). A member failing for that reason
// reads the record and raises its error on every host: RankLostError naming the lost rank
// by its group rank, TimeoutError for a member that is alive but did not come (stopped),
// torchpar::Error for a disagreement. The store is rank 0's: every store call of this path
// ends within min(the operation's timeout, 2 s) (StoreDeadline), so a stopped rank 0 delays
// the others' error by at most that. A backend that failed stays broken: later calls raise
// the same error.

#include <memory>
#include <string>
#include <vector>

#include "dist/backend/backend.h"
#include "dist/backend/gloo/backend.h"
#include "dist/group_spec.h"

namespace torchpar::detail {

/// Everything a hierarchical group needs; every member passes the same
/// `gloo.group.world_ranks` and `gloo.members`, and its own `gloo.group.rank`.
struct HierarchicalBackendOptions {
  /// The group as a whole, in a flat Gloo group's terms: `group.store` is the group's
  /// store, already prefixed for this group (the levels' groups meet under "hier/..." in
  /// it, and the failure record is kept there); `group.timeout` limits creating each level
  /// and is the default limit of each operation; `device` is where the leaders' Gloo group
  /// binds; every member's host key in `members` decides the levels, its pid names a lost
  /// rank.
  GlooBackendOptions gloo;
  /// A gloo group of every member (made by the caller): it carries all_to_all and
  /// send/recv. The hierarchical backend owns it from here on.
  std::shared_ptr<GroupBackend> flat;
};

/// Creates the hierarchical backend of a group; collective over its members (each creates
/// its host's shm group, then the leaders their gloo group).
/// Errors: those of create_shm_backend and create_gloo_backend (TimeoutError, ShmError,
/// torchpar::Error naming the level's group); torchpar::Error when `gloo.members` and
/// `gloo.group.world_ranks` differ in length or `flat` is missing.
std::shared_ptr<GroupBackend> create_hierarchical_backend(
    const HierarchicalBackendOptions& options);

/// The hosts of a group, as the hierarchical backend numbers them: hosts by their lowest
/// group rank, each host's group ranks ascending. For `torchpar info` and the tests.
std::vector<std::vector<int>> hosts_of(const std::vector<MemberInfo>& members);

}  // namespace torchpar::detail
