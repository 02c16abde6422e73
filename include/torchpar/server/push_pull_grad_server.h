#pragma once
/// PushPullGradServer: trainers push gradients, reducers reduce them in a two-level tree, the
/// primary reducer steps the optimizer of its copy of the model and publishes the new
/// parameters, trainers pull them (machin.parallel.server.PushPullGradServer /
/// PushPullGradServerImpl). Semantics, the differences from machin, the drop statistic,
/// flush_after and the fault model: docs/servers.md.

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torchpar/server/ordered_server.h"
#include "torchpar/server/push_pull_model_server.h"

namespace torchpar {

/// Options of PushPullGradServerImpl (machin's keyword arguments, plus flush_after and
/// timeout). Every reducer of one server must be given the same options.
struct PushPullGradServerOptions {
  /// Key of the model in the ordered server.
  std::string model_name = "model";
  /// The member that steps the optimizer. Empty: the group's first member (sorted).
  std::string primary_reducer{};
  /// The members trainers push to (chosen at random per push). Empty: every member.
  std::vector<std::string> secondary_reducers{};
  /// The ordered server the primary publishes to. Null: an OrderedServerSimpleImpl named
  /// `<server_name>_o_server`, hosted by the primary.
  std::shared_ptr<OrderedServerBase<StateDict>> o_server{};
  /// "sum" or "mean", at both levels (a mean of means when batches are full).
  std::string reduce_method = "sum";
  /// Where reductions run; the primary moves the result to each parameter's device.
  c10::Device reduce_device{c10::kCPU};
  /// Pushes reduced at once, at each level (>= 1).
  int64_t reduce_batch_size = 4;
  /// Entries each queue holds (>= reduce_batch_size); a push into a full queue drops the
  /// oldest entry and counts it (GradServerStats::dropped; logged every 1,000 drops).
  int64_t max_queue_size = 64;
  /// A queue whose oldest entry waited this long is reduced although it holds fewer than
  /// reduce_batch_size entries, so a slow or lone trainer is never starved (seconds).
  /// nullopt: wait for a full batch forever (machin).
  std::optional<std::chrono::duration<double>> flush_after = std::chrono::seconds(1);
  /// Bound of a secondary's forward to the primary and of the primary's ordered-server calls
  /// (seconds). A forward that fails stops that reducer (see PushPullGradServerImpl::watch).
  std::chrono::duration<double> timeout = kDefaultRpcTimeout;
};

/// Counters of one reducer (PushPullGradServerImpl::stats).
struct GradServerStats {
  int64_t received = 0;    ///< gradient dicts this member's queues took (both levels)
  int64_t dropped = 0;     ///< entries dropped, oldest first, from full queues
  int64_t reductions = 0;  ///< batches reduced at the secondary level and sent on
  int64_t steps = 0;       ///< optimizer steps (primary)
  int64_t flushes = 0;     ///< batches reduced short after flush_after (both levels)
};

/// One reducer of a gradient server: construct it on the primary and on every secondary
/// (with the same name and options); other members use the accessor PushPullGradServer.
///
/// ```cpp
/// // on every reducer
/// torchpar::PushPullGradServerImpl server("grad", group, {.reduce_method = "mean"});
/// if (group.get_cur_name() == group.get_group_members()[0]) {
///   auto net = std::make_shared<Net>();
///   auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), 0.01);
///   server.manage_model(net, opt);
/// }
/// server.start();
/// // ... later: server.watch() rethrows a reducer failure; server.stop().
/// ```
///
/// Reduction: each secondary reduces batches of reduce_batch_size pushes (or fewer after
/// flush_after) and sends the result to the primary; the primary reduces batches of those
/// the same way, sets the result as the managed model's gradients, steps the optimizer (and
/// the lr scheduler), and pushes the new state dict to the ordered server as the next
/// version. Pushes that arrive before start() wait in the queues.
///
/// Threads: one reducer thread per member (start() to stop()) steps and forwards; a push
///          that finds its queue empty while the thread runs is added to the batch by the
///          service before it replies, others are queued (docs/servers.md).
/// Errors:  ValueError for bad options (unknown members, a method other than sum/mean, sizes
///          < 1) or when this member is neither primary nor secondary; RpcKeyTakenError when
///          the server's names are taken. The reducer thread stops at its first error (a
///          forward or publish that failed, gradients that do not match the model); watch()
///          rethrows it and the service then refuses pushes with an error naming this
///          member.
/// Safety:  thread-safe. The managed model belongs to the reducer thread while it runs.
/// Lifetime: `group` must outlive it; the destructor stops the thread, deregisters and
///          unpairs (never throws); queued gradients are dropped. For reuse (no fresh
///          memory per push), it keeps the buffers it reduced in: up to 4 gradient dicts for
///          pushes that came as shared-memory handles and 4 sums per level, freed
///          with the object.
/// Source:  machin PushPullGradServerImpl.
class PushPullGradServerImpl {
 public:
  PushPullGradServerImpl(std::string server_name, RpcGroup& group,
                         PushPullGradServerOptions options = {});
  PushPullGradServerImpl(const PushPullGradServerImpl&) = delete;
  PushPullGradServerImpl& operator=(const PushPullGradServerImpl&) = delete;
  ~PushPullGradServerImpl();

  /// Gives the primary the model it steps (machin: "make sure the managed model is not the
  /// one your trainers use"), its optimizer (built on model->parameters()) and an optional
  /// lr scheduler (stepped after each optimizer step; it must refer to `optimizer`). Publishes
  /// the model as version 0 so trainers can pull it; if the ordered server already holds the
  /// model (a restarted primary on a shared ordered server), loads that version instead.
  /// Errors:  torchpar::Error "... is not the primary reducer" on another member (machin's
  ///          RuntimeError); Error after start(); ValueError for null arguments; the ordered
  ///          server's errors.
  void manage_model(std::shared_ptr<torch::nn::Module> model,
                    std::shared_ptr<torch::optim::Optimizer> optimizer,
                    std::shared_ptr<torch::optim::LRScheduler> lr_scheduler = nullptr);

  /// Starts the reducer thread. Errors: Error on the primary before manage_model, after
  /// stop(). A second call does nothing.
  void start();
  /// Stops and joins the reducer thread (a forward in flight is abandoned); queued gradients
  /// are dropped and later pushes refused (ClosedError). Idempotent; never throws.
  void stop();
  /// Rethrows the error that stopped the reducer thread, if any. Never blocks.
  void watch() const;
  /// This member's counters.
  GradServerStats stats() const;
  /// stop(), then deregisters the service, unpairs and closes the hosted ordered server.
  /// Idempotent. Errors: ClosedError when the group was destroyed first (closed anyway).
  void close();

  struct State;

 private:
  std::shared_ptr<State> state_;
};

/// The accessor of a gradient server, for trainers on any member.
///
/// ```cpp
/// auto server = torchpar::PushPullGradServer::connect(group, "grad");
/// torchpar::VersionedModule vnet(net);
/// server.pull(vnet);
/// for (auto& batch : data) {
///   loss_of(*net, batch).backward();
///   server.push(vnet);  // gradients out, then pull: zeroed gradients, newest parameters
/// }
/// ```
///
/// Errors (push, pull): RpcPeerLostError / TimeoutError naming the reducer or the member
///          of the ordered server that did not answer within `timeout`; RpcRemoteError when
///          the reducer refused (its thread stopped, or the server is closed); the ordered
///          server's errors.
/// Safety:  thread-safe for distinct modules. Source: machin PushPullGradServer.
class PushPullGradServer {
 public:
  /// machin's accessor arguments. `o_server` is required (ValueError when null).
  PushPullGradServer(std::string server_name, RpcGroup& group, std::string model_name,
                     std::vector<std::string> secondary_reducers,
                     std::shared_ptr<OrderedServerBase<StateDict>> o_server);

  /// The accessor the primary describes in its pair `server_name` (machin:
  /// group.get_paired(server_name).to_here()). `o_server` is needed only when the server
  /// was given a custom ordered server.
  /// Errors: RpcKeyNotFoundError when the primary has not created it (yet); ValueError;
  ///         RRef::to_here's errors within `timeout`.
  static PushPullGradServer connect(
      RpcGroup& group, const std::string& server_name,
      std::shared_ptr<OrderedServerBase<StateDict>> o_server = nullptr,
      Timeout timeout = kDefaultRpcTimeout);

  /// Sends a CPU copy of every parameter's gradient to a random secondary reducer, then
  /// pull(module). Returns pull's result. `timeout` bounds each of the two calls. The copy
  /// is one shared-memory segment, which travels to a reducer on this host as a handle and
  /// is reused by the next push (docs/servers.md, "One host: handles, not bytes").
  /// Errors: ValueError naming the first parameter without a gradient (nothing sent).
  bool push(VersionedModule& module, Timeout timeout = kDefaultRpcTimeout);

  /// Zeroes the module's gradients and loads the newest parameters when they are newer than
  /// module.pp_version() (or that is unset). Returns true when it loaded something new; false
  /// when nothing is published yet or the module already holds the newest version. Version 0
  /// is the primary's initial model, published by manage_model (machin publishes nothing
  /// before the first reduction): a fresh module's first pull returns true with version 0,
  /// so every trainer starts from the primary's weights.
  bool pull(VersionedModule& module, Timeout timeout = kDefaultRpcTimeout);

  const std::string& server_name() const { return server_name_; }
  const std::vector<std::string>& secondary_reducers() const { return secondaries_; }

 private:
  std::string server_name_;
  RpcGroup* group_;
  PushPullModelServer model_;
  std::vector<std::string> secondaries_;
};

namespace detail {
/// What the primary of a PushPullGradServerImpl pairs under the server's name.
struct GradServerInfo {
  std::string model_name;
  std::string primary;
  std::vector<std::string> secondary_reducers;
  std::string o_server_name;  ///< empty: a custom ordered server

  template <class Archive>
  void serialize(Archive& ar) {
    ar(model_name, primary, secondary_reducers, o_server_name);
  }
};
/// machin's PushPullGradServerImpl.REDUCE_MASTER / REDUCE_SLAVE: the queue a push goes to.
constexpr int32_t kPrimaryLevel = 0;
constexpr int32_t kSecondaryLevel = 1;
/// "<server_name>/<member>/_push_service": a reducer's queue.
std::string grad_push_service(const std::string& server_name, const std::string& member);
}  // namespace detail

}  // namespace torchpar
