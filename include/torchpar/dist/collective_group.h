#pragma once
/// CollectiveGroup and Work: collective communication among ranks of a World
/// (torch.distributed's collectives, as machin.parallel.distributed.CollectiveGroup).

#include <ATen/ATen.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torchpar/core/timeout.h"

namespace torchpar {

/// Element-wise reductions (torch.distributed.ReduceOp). AVG needs a floating dtype.
enum class ReduceOp { SUM, PRODUCT, MIN, MAX, AVG };

/// Where a group's collectives run.
///   Gloo: LibTorch's c10d ProcessGroupGloo over TCP; works across hosts.
///   Shm:  torchpar's shared-memory backend; every rank of the group on one host.
///   Auto: Shm when all ranks of the group are on one host, else Gloo.
enum class Backend { Auto, Gloo, Shm };

/// "auto", "gloo", "shm".
std::string to_string(Backend backend);
std::string to_string(ReduceOp op);
/// Parses "auto" | "gloo" | "shm"; throws torchpar::Error naming the bad value.
Backend backend_from_string(const std::string& name);

/// Handle of a collective or point-to-point operation (torch.distributed Work / request).
///
/// Results are in the tensors once wait() returned. Safety: one Work may be waited on from
/// several threads; it is not shared across processes.
class Work {
 public:
  struct Impl;

  Work() = default;
  explicit Work(std::shared_ptr<Impl> impl);

  /// Blocks until the operation finished. Returns the (group-relative) rank a recv/irecv
  /// got its tensor from, -1 for every other operation.
  /// Throws TimeoutError when `timeout` (seconds) passes first (the operation goes on);
  /// torchpar::Error (RankLostError when a rank died) when the operation failed.
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
/// Tensors: CPU at::Tensor of any shape; contiguous or not (non-contiguous ones go through
/// a contiguous copy). Every rank passes the same dtype and number of elements (per list
/// element) for an operation; a mismatch across ranks raises torchpar::Error on every rank
/// (the shm backend checks it; Gloo may report it as a size error).
/// Dtypes: gloo supports float16/32/64, int8, uint8, int32, int64 (and bool for
/// broadcast/all_gather); shm supports every real dtype, bool and bfloat16. PRODUCT/MIN/MAX
/// on bool mean AND/AND/OR. AVG throws for integer dtypes.
/// async_op: false (default) returns a completed Work; true returns at once, the tensors
/// must not be touched until Work::wait returned.
/// Safety: a group is used by one thread at a time; operations are ordered as issued.
/// Errors: a rank that dies or stops calling raises RankLostError / TimeoutError on the
/// others within the group timeout, naming the rank — never a hang. After a failure the
/// group is broken: later calls throw at once.
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
  /// The backend in use (never Auto).
  Backend backend() const;

  /// tensor = op(tensor of every rank), in place on every rank.
  Work all_reduce(at::Tensor tensor, ReduceOp op = ReduceOp::SUM, bool async_op = false);
  /// tensor_list[r] = tensor of rank r; tensor_list has size() tensors like `tensor`.
  Work all_gather(std::vector<at::Tensor> tensor_list, at::Tensor tensor, bool async_op = false);
  /// tensor = tensor of rank `src`.
  Work broadcast(at::Tensor tensor, int src, bool async_op = false);
  /// On `dst`: tensor = op(tensor of every rank); other ranks' tensors are left unchanged.
  Work reduce(at::Tensor tensor, int dst, ReduceOp op = ReduceOp::SUM, bool async_op = false);
  /// On `dst`: gather_list[r] = tensor of rank r (gather_list is empty on other ranks).
  Work gather(at::Tensor tensor, std::vector<at::Tensor> gather_list, int dst,
              bool async_op = false);
  /// tensor = scatter_list[this rank] of rank `src` (scatter_list empty on other ranks).
  Work scatter(at::Tensor tensor, std::vector<at::Tensor> scatter_list, int src,
               bool async_op = false);
  /// output = op over ranks r of input_list[this rank] of rank r.
  Work reduce_scatter(at::Tensor output, std::vector<at::Tensor> input_list,
                      ReduceOp op = ReduceOp::SUM, bool async_op = false);
  /// output_list[r] = input_list[this rank] of rank r.
  Work all_to_all(std::vector<at::Tensor> output_list, std::vector<at::Tensor> input_list,
                  bool async_op = false);
  /// Returns once every rank of the group entered barrier.
  Work barrier(bool async_op = false);

  /// Sends `tensor` to rank `dst`; blocks until it was taken (or buffered by Gloo).
  void send(at::Tensor tensor, int dst, int tag = 0);
  /// Receives into `tensor` (same dtype and numel as sent) from `src`, or from any rank when
  /// `src` is nullopt; returns the sender's rank.
  int recv(at::Tensor tensor, std::optional<int> src = std::nullopt, int tag = 0);
  Work isend(at::Tensor tensor, int dst, int tag = 0);
  /// Work::wait returns the sender (machin: irecv from any source).
  Work irecv(at::Tensor tensor, std::optional<int> src = std::nullopt, int tag = 0);

  /// Lets the group's pending asynchronous operations finish, then releases its connections
  /// and shared memory; later calls throw ClosedError.
  void destroy();
  bool valid() const { return static_cast<bool>(impl_); }

  struct Impl;

 private:
  using CopyBacks = std::vector<std::pair<at::Tensor, at::Tensor>>;  // (caller's, stand-in)
  /// Hands `op` to the group's executor: inline when synchronous and nothing is pending.
  Work run(bool async_op, CopyBacks back, std::function<void(detail::GroupBackend&)> op);
  std::chrono::duration<double> call_timeout(Timeout timeout) const;
  detail::GroupBackend& be() const;
  std::shared_ptr<Impl> impl_;
};

}  // namespace torchpar
