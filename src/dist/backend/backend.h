#pragma once
// The interface every collective backend implements (gloo's transport/ layout: this header
// at the family's root, one folder per backend with the same file names, backend/gloo/ and
// backend/shm/, each exposing an options struct and a create_*_backend factory).
// CollectiveGroup validates arguments (ranks in range, list lengths, CPU tensors) and hands
// contiguous tensors to it. Every options struct holds the group's GroupSpec first
// (dist/group_spec.h).

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/message_of.h"
#include "dist/group_spec.h"
#include "dist/lost_ranks.h"
#include "torchpar/core/error.h"
#include "torchpar/dist/collective_group.h"

namespace torchpar::detail {

/// Options of one call, resolved by CollectiveGroup (the per-call timeout, else the group's).
struct CallOptions {
  /// Seconds the call may take on this rank before it throws TimeoutError.
  std::chrono::duration<double> timeout{0};
};

/// Options of one reducing call (all_reduce, reduce, reduce_scatter).
struct ReduceCallOptions {
  /// The element-wise operation. The backend combines kAvg like kSum: CollectiveGroup divides
  /// by the group size afterwards, once for every backend.
  ReduceOp op = ReduceOp::kSum;
  /// Seconds the call may take on this rank before it throws TimeoutError.
  std::chrono::duration<double> timeout{0};
};

/// A collective backend of one group on this rank.
///
/// Thread model: collectives are synchronous. Each returns once the operation finished on
/// this rank (results are in the tensors) or throws: TimeoutError after options.timeout,
/// RankLostError when a member is gone, torchpar::Error otherwise. Sync or async is decided
/// once, by CollectiveGroup's executor, which calls a backend from one thread at a time in
/// issue order. Point-to-point is the exception: isend/irecv return at once with a Work
/// (gloo's unbound buffers complete on their own threads), so a posted receive never holds
/// up the group's collectives; that Work owns what it needs, the backend included.
/// Lifetime: destroy() releases connections and shared memory; later calls throw
/// ClosedError. CollectiveGroup drains its executor before it calls destroy().
class GroupBackend {
 public:
  GroupBackend(int rank, std::vector<int> world_ranks, std::chrono::duration<double> timeout,
               std::string name)
      : rank_(rank),
        world_ranks_(std::move(world_ranks)),
        timeout_(timeout),
        name_(std::move(name)) {}
  virtual ~GroupBackend() = default;
  GroupBackend(const GroupBackend&) = delete;
  GroupBackend& operator=(const GroupBackend&) = delete;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(world_ranks_.size()); }
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  /// The group's timeout: the default of every call.
  std::chrono::duration<double> timeout() const { return timeout_; }
  /// For messages: "group [0,1] #0 (rank 1 of 2, shm)".
  const std::string& name() const { return name_; }
  virtual Backend kind() const = 0;

  // Every tensor is CPU and contiguous; lists have size() entries where the op needs them
  // (gather's `out` only on dst, scatter's `in` only on src). Synchronous.
  virtual void all_reduce(const at::Tensor& t, const ReduceCallOptions& o) = 0;
  virtual void all_gather(const std::vector<at::Tensor>& out, const at::Tensor& in,
                          const CallOptions& o) = 0;
  virtual void broadcast(const at::Tensor& t, int src, const CallOptions& o) = 0;
  /// Only dst's `t` must hold the result; the others' may be overwritten (CollectiveGroup
  /// passes a copy there).
  virtual void reduce(const at::Tensor& t, int dst, const ReduceCallOptions& o) = 0;
  virtual void gather(const at::Tensor& in, const std::vector<at::Tensor>& out, int dst,
                      const CallOptions& o) = 0;
  virtual void scatter(const at::Tensor& out, const std::vector<at::Tensor>& in, int src,
                       const CallOptions& o) = 0;
  virtual void reduce_scatter(const at::Tensor& out, const std::vector<at::Tensor>& in,
                              const ReduceCallOptions& o) = 0;
  virtual void all_to_all(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& in,
                          const CallOptions& o) = 0;
  virtual void barrier(const CallOptions& o) = 0;

  /// Asynchronous (see the class comment); Work::wait returns the sender for irecv.
  virtual Work isend(const at::Tensor& t, int dst, int tag) = 0;
  virtual Work irecv(const at::Tensor& t, std::optional<int> src, int tag) = 0;
  /// Synchronous forms: isend/irecv waited on for at most o.timeout (TimeoutError naming
  /// the group after it). recv returns the sender's group rank.
  void send(const at::Tensor& t, int dst, int tag, const CallOptions& o);
  int recv(const at::Tensor& t, std::optional<int> src, int tag, const CallOptions& o);

  virtual void destroy() = 0;

  /// The World's record of lost ranks, which note_lost fills (World sets it at creation;
  /// unset, note_lost does nothing).
  void set_lost_ranks(std::shared_ptr<LostRanks> lost) { lost_ = std::move(lost); }
  /// Records group rank `q` (a RankLostError's rank) as lost, by its world rank.
  /// Safety: thread-safe.
  void note_lost(int q) const noexcept {
    if (lost_ && q >= 0 && q < size()) lost_->mark(world_ranks_[static_cast<size_t>(q)]);
  }

 private:
  int rank_;
  std::vector<int> world_ranks_;
  std::chrono::duration<double> timeout_;
  std::string name_;
  std::shared_ptr<LostRanks> lost_;
};

inline void GroupBackend::send(const at::Tensor& t, int dst, int tag, const CallOptions& o) {
  Work w = isend(t, dst, tag);
  try {
    w.wait(o.timeout);
  } catch (const TimeoutError&) {
    throw TimeoutError(fmt::format("{}: send to rank {} (tag {}) did not finish within {:.1f} s",
                                   name(), dst, tag, o.timeout.count()));
  }
}

inline int GroupBackend::recv(const at::Tensor& t, std::optional<int> src, int tag,
                              const CallOptions& o) {
  Work w = irecv(t, src, tag);
  try {
    return w.wait(o.timeout);
  } catch (const TimeoutError&) {
    throw TimeoutError(fmt::format("{}: recv from {} (tag {}) did not finish within {:.1f} s",
                                   name(), src ? "rank " + std::to_string(*src) : "any rank", tag,
                                   o.timeout.count()));
  }
}

}  // namespace torchpar::detail
