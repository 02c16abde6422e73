#pragma once
// What a collective backend is told about its group, in terms that depend on no backend:
// the spec every backend's options share (GroupSpec), the members as the rendezvous found
// them (MemberInfo) and where Gloo binds (GlooDeviceSpec). The rendezvous (rendezvous.h)
// fills the last two; the backends (backend/*/backend.h) include this header, never the
// other way round.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace torchpar::detail {

/// A member of a group as the World knows it: for naming the rank that went away.
struct MemberInfo {
  /// The member's process id in its own pid namespace; 0 when unknown.
  int pid = 0;
  /// The member's host key (host_key(): host name, boot id, pid and network namespace,
  /// /dev/shm); pids are comparable only between members with equal keys.
  std::string host;
};

/// Where Gloo binds: an interface name (GLOO_SOCKET_IFNAME, as torch.distributed), else
/// this address (the one that routes to the master), else the default device.
struct GlooDeviceSpec {
  std::string interface;
  std::string address;
};

/// The group one backend serves, on this rank: what every backend's options struct holds
/// first (its `group`). Every member passes the same `world_ranks`, and its own `rank`.
struct GroupSpec {
  /// The group's store, already prefixed for this backend: the members meet through it
  /// (Gloo's connection addresses, the shm segment's name, the levels of a hierarchical
  /// group and its failure record).
  c10::intrusive_ptr<c10d::Store> store;
  /// This process' rank in the group (0 .. world_ranks.size()-1).
  int rank = 0;
  /// World ranks of the members, in group order (for messages and CollectiveGroup::ranks).
  std::vector<int> world_ranks;
  /// Seconds: the limit for creating the backend (every member connected or attached) and
  /// the default limit of each operation.
  std::chrono::duration<double> timeout = std::chrono::seconds(300);
  /// For messages: "group [0,1] #0 (rank 1 of 2, shm)".
  std::string name;
};

}  // namespace torchpar::detail
