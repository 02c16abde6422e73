#pragma once
// The gloo backend: LibTorch's c10d ProcessGroupGloo behind GroupBackend.

#include <memory>
#include <string>
#include <vector>

#include "dist/backend/backend.h"
#include "dist/group_spec.h"

namespace torchpar::detail {

/// Everything a gloo group needs.
struct GlooBackendOptions {
  /// The group: ProcessGroupGloo exchanges its connection addresses through `group.store`;
  /// `group.timeout` limits connecting and is Gloo's own limit for each operation.
  GroupSpec group;
  /// The interface or address Gloo binds to.
  GlooDeviceSpec device;
  /// Every member (by group rank), to name a rank whose process is gone when Gloo fails.
  std::vector<MemberInfo> members;
  /// This process' host key: only members with the same key have their pids checked.
  std::string my_host;
};

/// Connects the members through `options.group.store`. Collective over the members.
/// Errors: torchpar::Error naming the group when Gloo cannot connect within the timeout.
std::shared_ptr<GroupBackend> create_gloo_backend(const GlooBackendOptions& options);

/// torch.distributed's sequence number of a new group (Python ranks wait for rank 0's);
/// `backend` must come from create_gloo_backend. Collective. The group then skips the
/// exchange of the ranks' calls before each collective, which Python ranks do not make.
void set_gloo_sequence_number(GroupBackend& backend);

}  // namespace torchpar::detail
