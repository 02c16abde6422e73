#pragma once
/// CollectiveGroup and Work: collective communication among ranks of a World
/// (torch.distributed's collectives, as machin.parallel.distributed.CollectiveGroup).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torchpar/core/timeout.h"

namespace torchpar {

/// Element-wise reductions (torch.distributed.ReduceOp: SUM, PRODUCT, MIN, MAX, AVG).
/// kAvg is kSum divided by the group size and needs a floating dtype. On bool tensors
/// (shm backend) kSum and kMax mean OR, kProduct and kMin mean AND.
enum class ReduceOp { kSum, kProduct, kMin, kMax, kAvg };

/// Where a group's collectives run. A "host" is a host key of the rendezvous: host name,
/// boot id, pid and network namespace and the device of /dev/shm (what TensorPipe's shm
/// domain compares), never user input alone.
///   kGloo: LibTorch's c10d ProcessGroupGloo over TCP among all ranks (flat); works across
///          hosts.
///   kShm:  torchpar's shared-memory backend; every rank of the group on one host.
///   kHierarchical: shared memory inside each host, Gloo between one leader per host (the
///          host's lowest group rank), as NCCL's and MPI's hierarchical collectives:
///          all_reduce = shm reduce to the leader, Gloo all_reduce among the leaders, shm
///          broadcast from the leader; the other collectives are composed the same way
///          (all_to_all and send/recv go over a flat Gloo group). Works on one host too.
///   kAuto: kShm when all ranks of the group are on one host, else kHierarchical when some
///          host has more than one of them, else kGloo.
enum class Backend { kAuto, kGloo, kShm, kHierarchical };

/// "auto", "gloo", "shm", "hierarchical".
std::string to_string(Backend backend);
/// "SUM", "PRODUCT", "MIN", "MAX", "AVG" (torch.distributed's names).
std::string to_string(ReduceOp op);
/// Parses "auto" | "gloo" | "shm" | "hierarchical"; throws torchpar::Error naming the bad
/// value.
Backend backend_from_string(const std::string& name);

/// Options of all_reduce, reduce and reduce_scatter (as gloo's AllreduceOptions):
/// `g.all_reduce(t, {.op = ReduceOp::kAvg, .async_op = true})`.
struct ReduceOptions {
  /// The element-wise operation.
  ReduceOp op = ReduceOp::kSum;
  /// This call's limit on this rank, in seconds; nullopt: the group's timeout (given to
  /// World::create_collective_group). It overrides the group's, shorter or longer.
  Timeout timeout = std::nullopt;
  /// false: the call returns once the operation finished (the returned Work is completed).
  /// true: it returns at once; the tensors must not be touched until Work::wait returned.
  bool async_op = false;
};

/// Options of the collectives that do not reduce: `g.broadcast(t, 0, {.async_op = true})`.
struct CollectiveOptions {
  /// This call's limit on this rank, in seconds; nullopt: the group's timeout.
  Timeout timeout = std::nullopt;
  /// false: returns once finished; true: returns at once with a pending Work.
  bool async_op = false;
};

/// Handle of a collective or point-to-point operation (torch.distributed Work / request).
///
/// Results are in the tensors once wait() returned. Safety: one Work may be waited on from
/// several threads; it is not shared across processes. Lifetime: a pending Work owns what
/// its operation needs (the group's backend too): the group may be destroyed first.
class Work {
 public:
  struct Impl;

  Work() = default;
  explicit Work(std::shared_ptr<Impl> impl);

  /// Blocks until the operation finished. Returns the (group-relative) rank a recv/irecv
  /// got its tensor from, -1 for every other operation.
  /// Units:  `timeout` in seconds; nullopt waits for as long as the operation may take
  ///         (its own timeout ends it).
  /// Errors: TimeoutError when `timeout` passes first (the operation goes on; wait again);
  ///         the operation's error otherwise: TimeoutError naming the rank and the call's
  ///         timeout, RankLostError when a rank died, torchpar::Error.
  int wait(Timeout timeout = std::nullopt);
  /// True once the operation finished (successfully or not).
  bool is_completed() const;

 private:
  friend class CollectiveGroup;
  std::shared_ptr<Impl> impl_;
};

namespace detail {
class GroupBackend;
}

/// A set of ranks that run collectives together (machin's CollectiveGroup, the
/// torch.distributed functions on a ProcessGroup).
///
/// Ranks: every `src`, `dst` and list index is a rank *relative to the group* (0 ..
/// size()-1, in the order of the ranks given to World::create_collective_group).
/// Shapes: CPU at::Tensor of any shape; contiguous or not (non-contiguous ones go through
/// a contiguous copy). Every rank passes the same dtype and number of elements (per list
/// element) for an operation; a mismatch across ranks raises torchpar::Error on every rank
/// (the shm backend checks it; Gloo may report it as a size error). Tensors and lists are
/// taken by reference and written in place: a synchronous call copies neither the tensors
/// nor their handles; an asynchronous one keeps handles to them (sharing their storage)
/// until it ran.
/// Dtypes: gloo supports float16/32/64, int8, uint8, int32, int64 (and bool for
/// broadcast/all_gather); shm supports every real dtype, bool and bfloat16. Reductions
/// refuse complex dtypes, and kAvg integer dtypes (torchpar::Error, before anything runs).
/// Options: every collective takes ReduceOptions or CollectiveOptions: `async_op` (default
/// false: returns a completed Work; true: returns at once, the tensors must not be touched
/// until Work::wait returned) and `timeout` (default: the group's).
/// Units: timeouts in seconds (std::chrono durations convert).
/// Errors: a rank that dies or stops calling raises RankLostError / TimeoutError on the
/// others within the call's timeout, naming the rank (and the timeout) — never a hang.
/// Synchronous calls throw; asynchronous ones hand the error to Work::wait. After a
/// failure the group is broken: later calls throw at once. docs/errors.md has the states.
/// Safety: a group is used by one thread at a time (hand it over under a mutex); operations
/// run in the order they are issued (one executor per group: a synchronous call runs on the
/// caller's thread when nothing is pending, asynchronous ones on the group's thread). A call
/// made while another thread's call runs on the caller's thread raises torchpar::Error
/// naming the group (a best-effort check, not a lock: do not rely on it).
/// Lifetime: copies share the group; the last copy (or destroy()) lets pending
/// asynchronous operations finish and releases connections and shared memory.
/// Source: torch.distributed.{all_reduce, ...}, machin.parallel.distributed.CollectiveGroup.
class CollectiveGroup {
 public:
  CollectiveGroup() = default;
  explicit CollectiveGroup(std::shared_ptr<detail::GroupBackend> backend);

  /// This process' rank in the group.
  int rank() const;
  int size() const;
  /// World ranks of the members, in group order.
  const std::vector<int>& ranks() const;
  /// The backend in use (never kAuto).
  Backend backend() const;

  /// tensor = options.op(tensor of every rank), in place on every rank.
  ///
  /// Shapes:  any; same dtype and numel on every rank.
  /// Errors:  torchpar::Error for a complex dtype or kAvg on an integer dtype.
  /// Source:  torch.distributed.all_reduce.
  ///
  ///   g.all_reduce(grad, {.op = torchpar::ReduceOp::kAvg});
  Work all_reduce(const at::Tensor& tensor, const ReduceOptions& options = {});
  /// tensor_list[r] = tensor of rank r.
  ///
  /// Shapes:  tensor_list has size() tensors of tensor's dtype and numel (any shapes).
  /// Source:  torch.distributed.all_gather.
  Work all_gather(const std::vector<at::Tensor>& tensor_list, const at::Tensor& tensor,
                  const CollectiveOptions& options = {});
  /// tensor = tensor of rank `src`.
  ///
  /// On the shm backend the root returns once its data is published (as MPI_Bcast's root
  /// returns once its data is sent): up to 64 calls of at most 16 bytes, or one 256 KiB
  /// chunk, ahead of the slowest rank; it may then modify `tensor`. A rank that called
  /// something else, or died, is therefore named by a later call of the root on the group
  /// (the next one, or the one that finds its ring full), not by this one; the other ranks
  /// raise at once, as for every collective.
  /// Source:  torch.distributed.broadcast.
  Work broadcast(const at::Tensor& tensor, int src, const CollectiveOptions& options = {});
  /// On `dst`: tensor = options.op(tensor of every rank); other ranks' tensors are left
  /// unchanged.
  ///
  /// Errors:  as all_reduce.
  /// Source:  torch.distributed.reduce.
  Work reduce(const at::Tensor& tensor, int dst, const ReduceOptions& options = {});
  /// On `dst`: gather_list[r] = tensor of rank r.
  ///
  /// Shapes:  gather_list has size() tensors like `tensor` on dst, and is empty elsewhere.
  /// Source:  torch.distributed.gather.
  Work gather(const at::Tensor& tensor, const std::vector<at::Tensor>& gather_list, int dst,
              const CollectiveOptions& options = {});
  /// tensor = scatter_list[this rank] of rank `src`.
  ///
  /// Shapes:  scatter_list has size() tensors like `tensor` on src, and is empty elsewhere.
  /// Source:  torch.distributed.scatter.
  Work scatter(const at::Tensor& tensor, const std::vector<at::Tensor>& scatter_list, int src,
               const CollectiveOptions& options = {});
  /// output = options.op over ranks r of input_list[this rank] of rank r.
  ///
  /// Shapes:  input_list has size() tensors of output's dtype and numel.
  /// Errors:  as all_reduce.
  /// Source:  torch.distributed.reduce_scatter.
  Work reduce_scatter(const at::Tensor& output, const std::vector<at::Tensor>& input_list,
                      const ReduceOptions& options = {});
  /// output_list[r] = input_list[this rank] of rank r.
  ///
  /// Shapes:  both lists have size() tensors of one dtype and numel (shm: equal numel).
  /// Source:  torch.distributed.all_to_all.
  Work all_to_all(const std::vector<at::Tensor>& output_list,
                  const std::vector<at::Tensor>& input_list, const CollectiveOptions& options = {});
  /// Returns once every rank of the group entered barrier.
  ///
  /// Source:  torch.distributed.barrier.
  Work barrier(const CollectiveOptions& options = {});

  /// Sends `tensor` to rank `dst`; blocks until it was taken (or buffered by Gloo), at most
  /// the group's timeout (TimeoutError naming the group after it).
  /// Source:  torch.distributed.send.
  void send(const at::Tensor& tensor, int dst, int tag = 0);
  /// Receives into `tensor` (same dtype and numel as sent) from `src`, or from any rank when
  /// `src` is nullopt; returns the sender's rank. Waits at most the group's timeout.
  /// Source:  torch.distributed.recv.
  int recv(const at::Tensor& tensor, std::optional<int> src = std::nullopt, int tag = 0);
  /// send without waiting: Work::wait waits. Point-to-point never waits for the group's
  /// pending collectives, and they never wait for it.
  Work isend(const at::Tensor& tensor, int dst, int tag = 0);
  /// Work::wait returns the sender (machin: irecv from any source).
  Work irecv(const at::Tensor& tensor, std::optional<int> src = std::nullopt, int tag = 0);

  /// Lets the group's pending asynchronous operations finish, then releases its connections
  /// and shared memory; later calls throw ClosedError.
  void destroy();
  bool valid() const { return static_cast<bool>(impl_); }

  struct Impl;

 private:
  using CopyBacks = std::vector<std::pair<at::Tensor, at::Tensor>>;  // (caller's, stand-in)
  /// Hands `body(backend, args...)` to the group's executor: run on the caller's thread with
  /// `args` as they are (no copy, no Work allocated) when synchronous and nothing is pending;
  /// else queued with copies of `args` (tensor handles and lists of them). Defined (and
  /// instantiated) in collective_group.cpp only.
  template <class Body, class... Args>
  Work run(bool async_op, CopyBacks back, Body body, const Args&... args);
  std::chrono::duration<double> call_timeout(Timeout timeout) const;
  detail::GroupBackend& be() const;
  std::shared_ptr<Impl> impl_;
};

}  // namespace torchpar
