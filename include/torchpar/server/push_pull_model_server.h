#pragma once
/// PushPullModelServer: parameters synchronized by pushing and pulling whole state dicts
/// through an ordered server, with a strict version chain
/// (machin.parallel.server.PushPullModelServer / PushPullModelServerImpl).
/// Semantics and the differences from machin: docs/servers.md.

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "torchpar/server/ordered_server.h"

namespace torchpar {

/// A module and its parameter-server version: machin sets the attribute `pp_version` on
/// the module itself; a C++ module cannot take new attributes, so this small wrapper carries
/// it (a registered buffer would travel inside every state dict and checkpoint instead).
/// nullopt: never pushed nor pulled (machin: no `pp_version` attribute yet).
///
/// ```cpp
/// auto net = std::make_shared<Net>();
/// torchpar::VersionedModule vnet(net);
/// server.push(vnet);  // vnet.pp_version() is now 1 (or the newest, after a failed push)
/// ```
///
/// Safety: not thread-safe (as the module it wraps); copies share the module but not the
/// version.
class VersionedModule {
 public:
  explicit VersionedModule(std::shared_ptr<torch::nn::Module> module,
                           std::optional<int64_t> pp_version = std::nullopt);
  /// From a module holder (torch::nn::Linear, a TORCH_MODULE type).
  template <class M>
  explicit VersionedModule(const torch::nn::ModuleHolder<M>& holder,
                           std::optional<int64_t> pp_version = std::nullopt)
      : VersionedModule(holder.ptr(), pp_version) {}

  torch::nn::Module& module() const { return *module_; }
  const std::shared_ptr<torch::nn::Module>& ptr() const { return module_; }
  std::optional<int64_t> pp_version() const { return pp_version_; }
  void set_pp_version(std::optional<int64_t> version) { pp_version_ = version; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::optional<int64_t> pp_version_;
};

/// The state dict of `module`: its parameters and buffers (named_parameters, named_buffers,
/// recursive), detached and on the CPU. CPU tensors are not copied (the ordered servers
/// store copies); undefined buffers are left out.
/// Safety: as reading the module's parameters.
StateDict cpu_state_dict(const torch::nn::Module& module);

/// Copies `state` into the parameters and buffers of `module` in place (no autograd; values
/// are moved to each tensor's device and dtype). Strict, as torch's load_state_dict: a
/// missing or unexpected key or a shape mismatch raises ValueError naming it, before any
/// tensor is written. Gradients are not touched. Source: machin prep_load_state_dict.
void load_state_dict(torch::nn::Module& module, const StateDict& state);

/// Options of PushPullModelServer::push.
struct ModelPushOptions {
  /// On failure (someone pushed first), load the newest version into the module.
  bool pull_on_fail = true;
  /// Bound of each ordered-server call (seconds).
  Timeout timeout = kDefaultRpcTimeout;
};

/// The accessor of a model server: usable from any member, by any number of trainers.
///
/// ```cpp
/// auto server = torchpar::PushPullModelServer::connect(group, "ps");
/// torchpar::VersionedModule vnet(net);
/// server.pull(vnet);
/// train_a_bit(*net);
/// if (!server.push(vnet)) { /* someone was first: vnet now holds the newest model */ }
/// ```
///
/// Errors (push, pull): those of the ordered server's push/pull (TimeoutError and
///          RpcPeerLostError naming the member that hosts it); ValueError from
///          load_state_dict when the server's model does not fit the module.
/// Safety:  thread-safe for distinct modules. Source: machin PushPullModelServer.
class PushPullModelServer {
 public:
  /// `o_server` is required (ValueError when null); `model_name` is the key of the model in it.
  PushPullModelServer(std::string model_name,
                      std::shared_ptr<OrderedServerBase<StateDict>> o_server);

  /// The accessor a PushPullModelServerImpl named `server_name` describes in its pair
  /// (machin: group.get_paired(server_name).to_here()). `o_server` is needed only when the
  /// impl was given a custom ordered server (ValueError otherwise).
  /// Errors: RpcKeyNotFoundError when no such server exists (yet); RRef::to_here's errors.
  static PushPullModelServer connect(
      RpcGroup& group, const std::string& server_name,
      std::shared_ptr<OrderedServerBase<StateDict>> o_server = nullptr,
      Timeout timeout = kDefaultRpcTimeout);

  /// Pushes cpu_state_dict(module) as version pp_version + 1 on top of pp_version (0 when
  /// unset). On success sets pp_version + 1 and returns true. On failure returns false and,
  /// with pull_on_fail, loads the newest version and its number into `module` first.
  /// Gradients are not touched.
  bool push(VersionedModule& module, ModelPushOptions options = {});

  /// Loads the newest version into `module` when it is newer than module.pp_version() (or
  /// that is unset). Returns true when it loaded something new; false when the server has
  /// no model yet or the module already holds the newest version (machin returns True in
  /// that second case too: here the return says whether the module changed). Gradients are
  /// not touched.
  bool pull(VersionedModule& module, Timeout timeout = kDefaultRpcTimeout);

  const std::string& model_name() const { return model_name_; }
  const std::shared_ptr<OrderedServerBase<StateDict>>& o_server() const { return o_server_; }

 private:
  std::string model_name_;
  std::shared_ptr<OrderedServerBase<StateDict>> o_server_;
};

/// The server side of PushPullModelServer, on one member: hosts an ordered server (an
/// OrderedServerSimpleImpl named `<server_name>_o_server`, unless `o_server` is given) and
/// pairs a description of the accessor under `server_name`.
///
/// Errors:  RpcKeyTakenError when a name is taken; ValueError for an empty name.
/// Safety:  thread-safe. Only one model per server (machin's limit, though the ordered server
///          takes any number of keys).
/// Lifetime: `group` must outlive it; the destructor (or close()) unpairs and stops the
///          ordered server it hosts; accessors then fail (RpcKeyNotFoundError).
/// Source:  machin PushPullModelServerImpl.
class PushPullModelServerImpl {
 public:
  PushPullModelServerImpl(std::string server_name, RpcGroup& group,
                          std::string model_name = "model",
                          std::shared_ptr<OrderedServerBase<StateDict>> o_server = nullptr);
  PushPullModelServerImpl(const PushPullModelServerImpl&) = delete;
  PushPullModelServerImpl& operator=(const PushPullModelServerImpl&) = delete;
  /// As close(), errors swallowed.
  ~PushPullModelServerImpl();

  /// Unpairs and closes the hosted ordered server. Idempotent. Errors: ClosedError when the
  /// group was destroyed first (everything is closed anyway).
  void close();

  /// An accessor for this member.
  PushPullModelServer accessor() const { return PushPullModelServer(model_name_, o_server_); }

 private:
  std::string name_;
  RpcGroup* group_;
  std::string model_name_;
  std::unique_ptr<OrderedServerSimpleImpl<StateDict>> o_impl_;
  std::shared_ptr<OrderedServerBase<StateDict>> o_server_;
  bool open_ = false;
};

namespace detail {
/// What a PushPullModelServerImpl pairs under its name.
struct ModelServerInfo {
  std::string model_name;
  std::string o_server_name;  ///< empty: a custom ordered server (the client passes its own)

  template <class Archive>
  void serialize(Archive& ar) {
    ar(model_name, o_server_name);
  }
};
}  // namespace detail

}  // namespace torchpar
