#pragma once
// The interface every collective backend implements (gloo's transport/ layout: this header
// at the family's root, one folder per backend with the same file names, backend/gloo/ and
// backend/shm/, each exposing an options struct and a create_*_backend factory).
// CollectiveGroup validates arguments (ranks in range, list lengths, CPU tensors) and hands
// contiguous tensors to it.

#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torchpar/dist/collective_group.h"

namespace torchpar::detail {

/// The message of any exception, without LibTorch's backtrace.
inline const char* message_of(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

/// A member of a group as the World knows it: for naming the rank that went away.
struct MemberInfo {
  /// The member's process id in its own pid namespace; 0 when unknown.
  int pid = 0;
  /// The member's host key (World's host_key(): host name, boot id, pid namespace, /dev/shm);
  /// pids are comparable only between members with equal keys.
  std::string host;
};

class GroupBackend {
 public:
  GroupBackend(int rank, std::vector<int> world_ranks, std::chrono::duration<double> timeout,
               std::string name)
      : rank_(rank),
        world_ranks_(std::move(world_ranks)),
        timeout_(timeout),
        name_(std::move(name)) {}
  virtual ~GroupBackend() = default;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(world_ranks_.size()); }
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  std::chrono::duration<double> timeout() const { return timeout_; }
  /// For messages: "group 'torchpar/group/0,1/0' (rank 1 of 2, shm)".
  const std::string& name() const { return name_; }
  virtual Backend kind() const = 0;

  // Every tensor is CPU and contiguous; lists have size() entries where the op needs them.
  virtual Work all_reduce(at::Tensor t, ReduceOp op, bool async_op) = 0;
  virtual Work all_gather(std::vector<at::Tensor> out, at::Tensor in, bool async_op) = 0;
  virtual Work broadcast(at::Tensor t, int src, bool async_op) = 0;
  virtual Work reduce(at::Tensor t, int dst, ReduceOp op, bool async_op) = 0;
  virtual Work gather(at::Tensor in, std::vector<at::Tensor> out, int dst, bool async_op) = 0;
  virtual Work scatter(at::Tensor out, std::vector<at::Tensor> in, int src, bool async_op) = 0;
  virtual Work reduce_scatter(at::Tensor out, std::vector<at::Tensor> in, ReduceOp op,
                              bool async_op) = 0;
  virtual Work all_to_all(std::vector<at::Tensor> out, std::vector<at::Tensor> in,
                          bool async_op) = 0;
  virtual Work barrier(bool async_op) = 0;
  virtual Work isend(at::Tensor t, int dst, int tag) = 0;
  virtual Work irecv(at::Tensor t, std::optional<int> src, int tag) = 0;
  virtual void destroy() = 0;

 private:
  int rank_;
  std::vector<int> world_ranks_;
  std::chrono::duration<double> timeout_;
  std::string name_;
};

}  // namespace torchpar::detail
