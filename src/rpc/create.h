#pragma once
// A World's RPC side: the process's RPC agent (started by its first group) and the groups made
// on it. World::create_rpc_group forwards here; the World owns one RpcRuntime.

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "torchpar/rpc/rpc_group.h"

namespace torchpar::detail {

class Rendezvous;
class RpcAgent;

/// Safety: thread-safe. Lifetime: shutdown() (World::destroy) stops the agent; groups made
/// earlier then fail their calls with RpcPeerLostError.
class RpcRuntime {
 public:
  /// World::create_rpc_group (torchpar/dist/world.h documents it): checks the name and
  /// members, starts the agent on the first call (key policy and environment: create.cpp),
  /// then joins the members collectively in the World's store.
  RpcGroup create_group(const Rendezvous& rdv, const std::string& group_name,
                        std::vector<std::string> members, const RpcGroupOptions& options);
  /// Refuses new groups from now on (ClosedError "World: destroyed"). Never throws.
  void close() noexcept;
  /// close(), then stops the agent (fails its calls in flight, joins its threads).
  void shutdown() noexcept;

 private:
  /// The agent, started under mu_ if this is the process's first group; records the name.
  /// nullptr when this member has no usable key (`*refused` holds the ValueError then).
  std::shared_ptr<RpcAgent> agent_for(const Rendezvous& rdv, const std::string& group_name,
                                      std::exception_ptr* refused);

  std::mutex mu_;
  bool closed_ = false;
  std::shared_ptr<RpcAgent> agent_;  // made by the first create_group
  std::set<std::string> groups_;     // names created in this process
};

}  // namespace torchpar::detail
