#pragma once
// Making a CollectiveGroup on a store the members already share: the one place that picks the
// backend (auto: shm on one host, hierarchical across hosts with several ranks on some host,
// else gloo) and assembles it. World::create_collective_group uses it on the rendezvous's
// store; the c10d process group of the Python package (python/src/distributed.cpp) uses it
// on the PrefixStore that torch.distributed hands a backend's creator.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "dist/group_spec.h"
#include "dist/lost_ranks.h"
#include "torchpar/dist/collective_group.h"

namespace torchpar::detail {

/// One member's view of the group to make.
struct GroupSetup {
  /// The group's own store: every member passes one with the same keys (a PrefixStore
  /// unique to this group); the backends meet under it ("member/<rank>", "gloo", "shm",
  /// "hier").
  c10::intrusive_ptr<c10d::Store> store{};
  /// This process' rank in the group (0 .. world_ranks.size()-1).
  int rank = 0;
  /// World ranks of the members, in group order (its size is the group's size); they
  /// appear in messages and CollectiveGroup::ranks().
  std::vector<int> world_ranks{};
  /// Seconds: the limit for creating the group (every member joined) and the default limit
  /// of each operation.
  std::chrono::duration<double> timeout = std::chrono::seconds(300);
  Backend backend = Backend::kAuto;
  /// For messages: "group [0,1] #0"; the backend's name adds "(rank r of n, shm)".
  std::string label{};
  /// Where Gloo binds (gloo_device_for(...)).
  GlooDeviceSpec device{};
  /// Every member's pid and host key by group rank, when the caller knows them (the World's
  /// rendezvous); empty: every member publishes its own under `store`. They are exchanged
  /// anyway unless `backend` is kGloo.
  std::vector<MemberInfo> members{};
  /// Where lost members are recorded (World: rank 0's leave skips them); may be null.
  std::shared_ptr<LostRanks> lost{};
};

/// Creates the group's backend on every member. Collective over the members: each calls
/// it with the same world_ranks, backend and an equivalent store.
///
/// Units:   setup.timeout in seconds.
/// Errors:  TimeoutError naming the first member that did not publish itself within
///          setup.timeout; torchpar::Error when `backend` is kShm and the members span hosts,
///          when rank is out of range, or a member publishes a malformed record; the
///          backends' errors (create_gloo_backend, create_shm_backend,
///          create_hierarchical_backend).
/// Safety:  thread-safe (nothing shared but the store).
CollectiveGroup create_collective_group(const GroupSetup& setup);

/// Where Gloo binds for a group met on `store`: GLOO_SOCKET_IFNAME (an interface, as
/// torch.distributed), else TORCHPAR_GLOO_ADDR, else the local address that routes to
/// `master_addr`:`master_port` when given, else to the TCPStore under `store` (through
/// PrefixStores), else Gloo's default device (the address the host name resolves to).
/// Never throws.
GlooDeviceSpec gloo_device_for(const c10::intrusive_ptr<c10d::Store>& store,
                               const std::string& master_addr = "", int master_port = 0);

}  // namespace torchpar::detail
