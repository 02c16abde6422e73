#pragma once
// The gloo backend: LibTorch's c10d ProcessGroupGloo behind GroupBackend.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>

#include "backend.h"

namespace torchpar::detail {

/// Where Gloo binds: an interface name (GLOO_SOCKET_IFNAME, as torch.distributed), else
/// this address (the one that routes to the master), else the default device.
struct GlooDeviceSpec {
  std::string interface;
  std::string address;
};

/// A member of a group as the World knows it: for naming the rank that went away.
struct MemberInfo {
  int pid = 0;
  std::string host;
};

/// Collective over the members: connects them through `store` (prefixed for the group).
std::shared_ptr<GroupBackend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                int rank, std::vector<int> world_ranks,
                                                std::chrono::duration<double> timeout,
                                                std::string name, const GlooDeviceSpec& device,
                                                std::vector<MemberInfo> members,
                                                std::string my_host);

/// torch.distributed's sequence number of a new group (Python ranks wait for rank 0's);
/// `backend` must come from make_gloo_backend. Collective.
void set_gloo_sequence_number(GroupBackend& backend);

}  // namespace torchpar::detail
