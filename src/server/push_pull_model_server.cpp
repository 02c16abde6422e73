#include "torchpar/server/push_pull_model_server.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <set>
#include <vector>

#include "server/paired.h"

namespace torchpar {

VersionedModule::VersionedModule(std::shared_ptr<torch::nn::Module> module,
                                 std::optional<int64_t> pp_version)
    : module_(std::move(module)), pp_version_(pp_version) {
  if (!module_) throw ValueError("VersionedModule: null module");
}

StateDict cpu_state_dict(const torch::nn::Module& module) {
  StateDict out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    out.emplace(p.key(), p.value().detach().to(at::kCPU));
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out.emplace(b.key(), b.value().detach().to(at::kCPU));
  }
  return out;
}

void load_state_dict(torch::nn::Module& module, const StateDict& state) {
  std::vector<std::pair<at::Tensor, const at::Tensor*>> writes;
  std::set<std::string> used;
  auto plan = [&](const std::string& name, const at::Tensor& dst) {
    auto it = state.find(name);
    if (it == state.end()) {
      throw ValueError(
          fmt::format("load_state_dict: the state dict has no entry '{}' for the module", name));
    }
    if (!it->second.defined() || it->second.sizes() != dst.sizes()) {
      throw ValueError(
          fmt::format("load_state_dict: '{}' has shape {} in the state dict, {} in the module",
                      name, it->second.defined() ? c10::str(it->second.sizes()) : "undefined",
                      c10::str(dst.sizes())));
    }
    used.insert(name);
    writes.emplace_back(dst, &it->second);
  };
  for (const auto& p : module.named_parameters(/*recurse=*/true)) plan(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) plan(b.key(), b.value());
  }
  for (const auto& [k, v] : state) {
    if (!used.count(k)) {
      throw ValueError(
          fmt::format("load_state_dict: unexpected entry '{}' (the module has no such "
                      "parameter or buffer)",
                      k));
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& [dst, src] : writes) dst.copy_(*src);
}

// ---- accessor ------------------------------------------------------------------------------

PushPullModelServer::PushPullModelServer(std::string model_name,
                                         std::shared_ptr<OrderedServerBase<StateDict>> o_server)
    : model_name_(std::move(model_name)), o_server_(std::move(o_server)) {
  if (!o_server_)
    throw ValueError("PushPullModelServer: o_server is required (an ordered server accessor)");
}

PushPullModelServer PushPullModelServer::connect(
    RpcGroup& group, const std::string& server_name,
    std::shared_ptr<OrderedServerBase<StateDict>> o_server, Timeout timeout) {
  const auto info = detail::fetch_paired<detail::ModelServerInfo>(group, server_name, timeout);
  o_server = detail::client_o_server(group, "PushPullModelServer", server_name, info.o_server_name,
                                     std::move(o_server));
  return PushPullModelServer(info.model_name, std::move(o_server));
}

bool PushPullModelServer::push(VersionedModule& module, ModelPushOptions options) {
  const int64_t version = module.pp_version().value_or(0);
  if (!module.pp_version()) module.set_pp_version(0);
  if (o_server_->push(model_name_, cpu_state_dict(module.module()), version + 1, version,
                      options.timeout)) {
    module.set_pp_version(version + 1);
    return true;
  }
  if (options.pull_on_fail) {
    if (auto newest = o_server_->pull_view(model_name_, std::nullopt, options.timeout)) {
      load_state_dict(module.module(), newest->first);
      module.set_pp_version(newest->second);
    }
  }
  return false;
}

bool PushPullModelServer::pull(VersionedModule& module, Timeout timeout) {
  auto newest = o_server_->pull_view(model_name_, std::nullopt, timeout);
  if (!newest) return false;
  if (module.pp_version() && *module.pp_version() >= newest->second) return false;
  load_state_dict(module.module(), newest->first);
  module.set_pp_version(newest->second);
  return true;
}

// ---- server --------------------------------------------------------------------------------

PushPullModelServerImpl::PushPullModelServerImpl(
    std::string server_name, RpcGroup& group, std::string model_name,
    std::shared_ptr<OrderedServerBase<StateDict>> o_server)
    : name_(std::move(server_name)),
      group_(&group),
      model_name_(std::move(model_name)),
      o_server_(std::move(o_server)) {
  if (name_.empty()) throw ValueError("PushPullModelServerImpl: empty server name");
  std::string o_name;
  if (!o_server_) {
    o_name = name_ + "_o_server";
    o_impl_ = std::make_unique<OrderedServerSimpleImpl<StateDict>>(o_name, group);
    o_server_ = std::make_shared<OrderedServerSimple<StateDict>>(o_name, group);
  }
  group.pair(name_, detail::ModelServerInfo{model_name_, o_name});  // o_impl_ closes on a throw
  open_ = true;
}

PushPullModelServerImpl::~PushPullModelServerImpl() {
  try {
    close();
  } catch (...) {  // the group is gone: nobody can reach the server anyway
  }
}

void PushPullModelServerImpl::close() {
  std::exception_ptr first;
  if (std::exchange(open_, false)) {
    try {
      group_->unpair(name_);
    } catch (...) {
      first = std::current_exception();
    }
  }
  if (o_impl_) {
    try {
      o_impl_->close();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace torchpar
