// PushPullGradServer, the trainers' accessor of a gradient server (machin
// PushPullGradServer); the reducer is push_pull_grad_server.cpp.
#include <fmt/format.h>

#include <random>
#include <tuple>

#include "server/paired.h"
#include "torchpar/server/push_pull_grad_server.h"

namespace torchpar {

PushPullGradServer::PushPullGradServer(std::string server_name, RpcGroup& group,
                                       std::string model_name,
                                       std::vector<std::string> secondary_reducers,
                                       std::shared_ptr<OrderedServerBase<StateDict>> o_server)
    : server_name_(std::move(server_name)),
      group_(&group),
      model_(std::move(model_name), std::move(o_server)),
      secondaries_(std::move(secondary_reducers)) {
  if (secondaries_.empty()) {
    throw ValueError(fmt::format("PushPullGradServer '{}': no secondary reducers", server_name_));
  }
}

PushPullGradServer PushPullGradServer::connect(
    RpcGroup& group, const std::string& server_name,
    std::shared_ptr<OrderedServerBase<StateDict>> o_server, Timeout timeout) {
  auto info = detail::fetch_paired<detail::GradServerInfo>(group, server_name, timeout);
  o_server = detail::client_o_server(group, "PushPullGradServer", server_name, info.o_server_name,
                                     std::move(o_server));
  return PushPullGradServer(server_name, group, std::move(info.model_name),
                            std::move(info.secondary_reducers), std::move(o_server));
}

bool PushPullGradServer::push(VersionedModule& module, Timeout timeout) {
  StateDict grads;
  for (const auto& p : module.module().named_parameters(/*recurse=*/true)) {
    const auto& g = p.value().grad();
    if (!g.defined()) {
      throw ValueError(
          fmt::format("PushPullGradServer '{}': parameter '{}' has no gradient to push "
                      "(run backward first)",
                      server_name_, p.key()));
    }
    grads.emplace(p.key(), g.detach());
  }
  // A copy (pull() zeroes the module's gradients, and a reducer in this process would
  // otherwise queue the very tensor), in one shared-memory segment: to a reducer on this
  // host it travels as a handle (no bytes through a socket). The reducer copies it out
  // before it replies, so the segment is back in this process's cache when the call returns
  // and the next push reuses it: a steady trainer allocates (and faults in) nothing.
  grads = detail::shared_copy(grads);
  thread_local std::mt19937 rng{std::random_device{}()};
  const auto& member =
      secondaries_[std::uniform_int_distribution<size_t>(0, secondaries_.size() - 1)(rng)];
  try {
    group_->registered_sync<void>(
        detail::grad_push_service(server_name_, member),
        std::tuple<StateDict, int32_t>(std::move(grads), detail::kSecondaryLevel), timeout);
  } catch (...) {
    detail::rethrow_server_call_error("PushPullGradServer '" + server_name_ + "'",
                                      "push to secondary reducer", member);
  }
  return pull(module, timeout);
}

bool PushPullGradServer::pull(VersionedModule& module, Timeout timeout) {
  module.module().zero_grad();
  return model_.pull(module, timeout);
}

}  // namespace torchpar
