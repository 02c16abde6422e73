#pragma once
// Reading the description a server pairs under its name, on any member.

#include <fmt/format.h>

#include <memory>
#include <string>

#include "torchpar/rpc/rpc_group.h"
#include "torchpar/server/ordered_server.h"

namespace torchpar::detail {

/// A copy of the value paired under `key`: the owner's own object on the owner (no RPC),
/// else fetched. Errors: RpcKeyNotFoundError; RRef::to_here's errors within `timeout`.
template <class T>
T fetch_paired(RpcGroup& group, const std::string& key, Timeout timeout) {
  auto ref = group.get_paired<T>(key);
  if (ref.is_owner()) return *group.local_paired<T>(key);
  return ref.to_here(timeout);
}

/// The ordered server a client of server `server_name` uses: `given`, else an accessor of
/// the default one the impl hosts (`o_server_name`). Errors: ValueError when the impl was
/// given a custom ordered server (`o_server_name` empty) and the client passes none.
inline std::shared_ptr<OrderedServerBase<StateDict>> client_o_server(
    RpcGroup& group, const char* who, const std::string& server_name,
    const std::string& o_server_name, std::shared_ptr<OrderedServerBase<StateDict>> given) {
  if (given) return given;
  if (o_server_name.empty()) {
    throw ValueError(
        fmt::format("{}::connect: server '{}' uses a custom ordered server; pass "
                    "its accessor as o_server",
                    who, server_name));
  }
  return std::make_shared<OrderedServerSimple<StateDict>>(o_server_name, group);
}

}  // namespace torchpar::detail
