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
  /// Starts a bucket's all_reduce during backward, as soon as autograd has accumulated the
  /// gradients of all its parameters (a post hook on each parameter's gradient accumulator),
  /// so that the transfer overlaps the rest of backward, as torch's DDP Reducer does.
  /// synchronize_gradients() then starts the buckets still waiting (those with a parameter
  /// whose gradient this backward did not produce, and the last bucket, whose gradients are
  /// the last of the backward), waits for all and copies the averages back. Buckets follow
  /// the reverse of module.parameters() (the order backward produces gradients) and the first
  /// is capped at 1 MiB (torch's first_bucket_bytes_cap), so it goes out early.
  ///
  /// The gradients a started bucket averages are the ones its backward left: run exactly one
  /// backward per synchronize_gradients() on every rank, and wrap the other backwards of
  /// gradient accumulation in no_sync(). A bucket started during backward carries the
  /// gradients as backward left them, so changes made to .grad() before
  /// synchronize_gradients() are lost for it: clip or scale gradients after that call
  /// (torch's DDP has averaged them by the time backward returns). Default false:
  /// gradients are read when synchronize_gradients() is called, any number of backwards
  /// before it. The hooks run on the thread that calls backward, which takes turns with
  /// the one calling synchronize_gradients() (the group's one-thread rule); a hook's error
  /// (a broken group) is thrown by the next synchronize_gradients(). Source: DDP's overlap
  /// of backward and communication, always on there.
  bool overlap_with_backward = false;
};

/// What DistributedDataParallel did so far, for profiles (torch's DDP logging data:
/// avg_backward_comm_time and the like). Counts are since construction.
struct DistributedDataParallelStats {
  /// synchronize_gradients() calls that returned normally.
  int64_t synchronizations = 0;
  /// Wall time inside those calls, seconds: what a step waits for its gradients' averages
  /// after backward, which includes waiting for the slowest rank to arrive.
  double synchronize_seconds = 0;
  /// Bucket all_reduces started by autograd hooks during backward (overlap_with_backward).
  int64_t buckets_started_in_backward = 0;
  /// Bucket all_reduces started by synchronize_gradients() itself.
  int64_t buckets_started_in_synchronize = 0;
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
/// torch's no_sync() (gradient accumulation) is simply not calling it for a few steps. With
/// options.overlap_with_backward the buckets' all_reduces start during backward, as torch's
/// do; then one backward per synchronize_gradients(), the others under no_sync().
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
///          After a failed synchronize_gradients the gradients are partly averaged. With
///          overlap_with_backward, ValueError from synchronize_gradients when a second
///          backward reached a bucket already started (use no_sync()); the call first
///          completes its all_reduces, so the ranks stay in step, and that bucket holds the
///          average of the first backward's gradients.
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
  struct Impl;

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
  /// one bucket is reduced on the calling thread instead (nothing to overlap). With
  /// overlap_with_backward, the buckets backward started are only waited for.
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

  /// While alive, backward starts no bucket (overlap_with_backward): the gradients of the
  /// backwards run meanwhile accumulate in .grad() and are averaged with those of the next
  /// backward outside it, or by synchronize_gradients(). Without overlap_with_backward it
  /// changes nothing. Guards nest; each restores what it found. Not thread-safe; does not
  /// block. Errors: torchpar::Error on a moved-from DistributedDataParallel.
  /// Source: DDP.no_sync().
  ///
  /// ```cpp
  /// { auto guard = ddp.no_sync(); loss(batch1).backward(); }   // accumulates locally
  /// loss(batch2).backward();                                    // starts the buckets
  /// ddp.synchronize_gradients();                                // averages both batches' sum
  /// ```
  class NoSync {
   public:
    ~NoSync();
    NoSync(NoSync&& other) noexcept;
    NoSync& operator=(NoSync&&) = delete;
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    friend class DistributedDataParallel;
    NoSync(Impl* impl, bool previous) : impl_(impl), previous_(previous) {}
    Impl* impl_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync();

  /// Counters and time spent so far (see DistributedDataParallelStats; seconds). A copy;
  /// not thread-safe against a running synchronize_gradients() or backward; does not block.
  /// Errors: torchpar::Error on a moved-from object. Source: DDP's _get_ddp_logging_data().
  DistributedDataParallelStats stats() const;

  /// Number of gradient buckets (one all_reduce each per synchronize_gradients call).
  std::size_t num_buckets() const;
  /// The group the replicas synchronize over. Source: DDP's process_group.
  const CollectiveGroup& process_group() const;

 private:
  Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace torchpar
