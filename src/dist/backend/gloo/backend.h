#pragma once
// The gloo backend: LibTorch's c10d ProcessGroupGloo behind GroupBackend.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "dist/backend/backend.h"

namespace torchpar::detail {

/// Where Gloo binds: an interface name (GLOO_SOCKET_IFNAME, as torch.distributed), else
/// this address (the one that routes to the master), else the default device.
struct GlooDeviceSpec {
  std::string interface;
  std::string address;
};

/// Everything a gloo group needs; every member passes the same `world_ranks`, and its own
/// `rank`.
struct GlooBackendOptions {
  /// The group's store, already prefixed for this group: ProcessGroupGloo exchanges its
  /// connection addresses through it.
  c10::intrusive_ptr<c10d::Store> store;
  /// This process' rank in the group (0 .. world_ranks.size()-1).
  int rank = 0;
  /// World ranks of the members, in group order (for messages and CollectiveGroup::ranks).
  std::vector<int> world_ranks;
  /// Seconds: the limit for connecting, and Gloo's own limit for each operation.
  std::chrono::duration<double> timeout = std::chrono::seconds(300);
  /// For messages: "group [0,1] #0 (rank 1 of 2, gloo)".
  std::string name;
  /// The interface or address Gloo binds to.
  GlooDeviceSpec device;
  /// Every member (by group rank), to name a rank whose process is gone when Gloo fails.
  std::vector<MemberInfo> members;
  /// This process' host key: only members with the same key have their pids checked.
  std::string my_host;
};

/// Connects the members through `options.store`. Collective over the members.
/// Errors: torchpar::Error naming the group when Gloo cannot connect within the timeout.
std::shared_ptr<GroupBackend> create_gloo_backend(const GlooBackendOptions& options);

/// torch.distributed's sequence number of a new group (Python ranks wait for rank 0's);
/// `backend` must come from create_gloo_backend. Collective. The group then skips the
/// exchange of the ranks' calls before each collective, which Python ranks do not make.
void set_gloo_sequence_number(GroupBackend& backend);

}  // namespace torchpar::detail
