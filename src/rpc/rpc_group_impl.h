#pragma once
// RpcGroup's state (shared by copies of the handle; World::create_rpc_group makes it).

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "rpc/agent.h"
#include "torchpar/rpc/rpc_group.h"

namespace torchpar {

struct RpcGroup::Impl {
  std::shared_ptr<detail::RpcAgent> agent;
  std::string group;
  std::vector<std::string> members;  ///< sorted

  std::mutex mu;
  std::map<std::string, std::string> owner_cache;  ///< service key -> owner
  std::set<std::string> my_services;
  std::map<std::string, std::string> my_pairs;  ///< key -> RRef id
  int barriers = 0;
  bool destroyed = false;

  /// The store key of `k` of `kind` (service, pair, barrier, join) in `group`.
  static std::string store_key(const std::string& group, const char* kind, const std::string& k);
  /// store_key in this group.
  std::string key(const char* kind, const std::string& k) const;
  std::optional<std::string> store_get(const std::string& k) const;
  /// ClosedError after destroy().
  void check_open() const;
};

}  // namespace torchpar
