#pragma once
/// DistributedDataParallel: data-parallel training over a CollectiveGroup
/// (torch.nn.parallel.DistributedDataParallel, with an explicit gradient synchronization).

#include <cstddef>
#include <memory>
#include <vector>

#include "torchpar/dist/collective_group.h"

namespace torch::nn {
class Module;
}

namespace torchpar {

/// Options of DistributedDataParallel (the keyword arguments of torch's DDP we need).
struct DistributedDataParallelOptions {
  /// Gradients are averaged in buckets of about this many MiB (2^20 bytes, what torch calls
  /// MB), one all_reduce per bucket. A bucket holds gradients of one dtype and is closed once
  /// it reaches the cap, so a parameter larger than the cap gets a bucket of its own. Must be
  /// > 0 (torchpar::ValueError otherwise). Source: DDP's bucket_cap_mb (default 25).
  double bucket_cap_mb = 25.0;
};

/// Keeps the replicas of a model on the ranks of a group equal while each rank trains on its
/// own data: the constructor copies rank 0's parameters and buffers to every rank, and
/// synchronize_gradients(), called after the rank's backward, replaces every gradient with
/// its average over the ranks. With the same optimizer on every rank the parameters stay
/// equal, step after step.
///
/// ```cpp
/// auto group = world.create_collective_group();
/// torchpar::DistributedDataParallel ddp(*net, group);  // collective: every rank calls it
/// for (auto& [x, y] : my_shard) {
///   opt.zero_grad();
///   torch::nll_loss(net->forward(x), y).backward();
///   ddp.synchronize_gradients();                        // collective
///   opt.step();
/// }
/// ```
///
/// Unlike torch's DDP it does not wrap forward(): call the module itself. What torch does
/// inside backward (its Reducer's autograd hooks) is the explicit synchronize_gradients(), so
/// torch's no_sync() (gradient accumulation) is simply not calling it for a few steps.
///
/// Parameters: the set is fixed at construction, in module.parameters() order. Those with
/// requires_grad = false are broadcast at construction and never take part in a
/// synchronization (their .grad() is not touched). A parameter that requires grad but has
/// no gradient on some ranks (not used in their forward) counts as zeros there, as torch's
/// find_unused_parameters = true does, with no extra collective: if some rank has a gradient,
/// every rank ends with the average (sum / world size); if no rank has one, it stays
/// undefined on every rank. Buffers (BatchNorm's running statistics) are broadcast at
/// construction and by sync_buffers(); torch's broadcast_buffers = true does it before every
/// forward.
///
/// Shapes:  every rank builds the same model: the same parameters and buffers (count, order,
///          shapes, dtypes, requires_grad); the constructor checks it (one all_gather).
/// Dtypes:  parameters that require grad are floating (float16/32/64, bfloat16 on shm);
///          buffers any dtype the group's broadcast takes. CPU, strided; dense gradients.
/// Units:   bucket_cap_mb in MiB; time limits are the group's (World / create_collective_group
///          timeout).
/// Errors:  torchpar::ValueError for bad options, a parameter that is not a floating CPU
///          tensor, a sparse gradient, or ranks whose models differ (on every rank, naming the
///          first rank that differs from rank 0). From the group: RankLostError when a rank
///          dies during the constructor, synchronize_gradients or sync_buffers (naming it),
///          TimeoutError when one stops calling; the group is broken after either (every
///          later call throws at once), so restart the job (`torchpar run --max-restarts`).
///          After a failed synchronize_gradients the gradients are partly averaged.
/// Safety:  not thread-safe: one thread at a time, the group not used meanwhile by another
///          thread. Every rank calls the constructor and each method the same number of times,
///          in the same order relative to its other collectives on the group.
/// Lifetime: holds the parameter and buffer tensors (not the module) and a copy of the group
///          handle, which shares the backend; in-place changes of the module's tensors (an
///          optimizer's step, set_data) are seen, a tensor replaced by a new one is not.
///          Flat bucket buffers (one copy of the gradients) are kept between calls.
/// Source:  torch.nn.parallel.DistributedDataParallel (its Reducer's bucketing, and
///          _sync_module_states at construction).
class DistributedDataParallel {
 public:
  /// Wraps every parameter and buffer of `module` (recursively). Collective: broadcasts them
  /// from the group's rank 0 (in place, without recording autograd history).
  DistributedDataParallel(torch::nn::Module& module, CollectiveGroup group,
                          DistributedDataParallelOptions options = {});
  /// The same for tensors that are not in a module (`parameters` as module.parameters()).
  DistributedDataParallel(std::vector<at::Tensor> parameters, std::vector<at::Tensor> buffers,
                          CollectiveGroup group, DistributedDataParallelOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(DistributedDataParallel&&) noexcept;
  DistributedDataParallel& operator=(DistributedDataParallel&&) noexcept;
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Averages the gradients of the parameters that require grad over the ranks, in place:
  /// afterwards every rank holds the same .grad() tensors. Call after backward, before the
  /// optimizer's step. Packs each bucket and starts its all_reduce (async) before packing
  /// the next one, then waits for them in order and copies each result back. A model with
  /// one bucket is reduced on the calling thread instead (nothing to overlap).
  ///
  /// Shapes:  each .grad() as its parameter (any strides); an undefined one counts as zeros
  ///          (see the class comment).
  /// Errors:  see the class comment; ValueError for a sparse gradient (before any collective).
  /// Safety:  collective; not thread-safe.
  /// Source:  the all_reduce torch's DDP Reducer runs during backward.
  ///
  /// ```cpp
  /// loss.backward();
  /// ddp.synchronize_gradients();
  /// opt.step();
  /// ```
  void synchronize_gradients();

  /// Copies rank 0's buffers to every rank (in place). Collective; not thread-safe.
  /// Source: DDP's buffer broadcast before each forward (broadcast_buffers = true).
  void sync_buffers();

  /// Number of gradient buckets (one all_reduce each per synchronize_gradients call).
  std::size_t num_buckets() const;
  /// The group the replicas synchronize over. Source: DDP's process_group.
  const CollectiveGroup& process_group() const;

 private:
  struct Impl;
  Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace torchpar
