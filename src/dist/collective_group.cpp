#include <fmt/format.h>

#include "dist/backend/backend.h"
#include "dist/group_executor.h"
#include "dist/reduce_kernels.h"
#include "dist/work.h"
#include "torchpar/core/error.h"
#include "torchpar/dist/collective_group.h"

namespace torchpar {

std::string to_string(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kGloo:
      return "gloo";
    case Backend::kShm:
      return "shm";
    case Backend::kHierarchical:
      return "hierarchical";
  }
  return "?";
}

std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "SUM";
    case ReduceOp::kProduct:
      return "PRODUCT";
    case ReduceOp::kMin:
      return "MIN";
    case ReduceOp::kMax:
      return "MAX";
    case ReduceOp::kAvg:
      return "AVG";
  }
  return "?";
}

Backend backend_from_string(const std::string& name) {
  if (name == "auto") return Backend::kAuto;
  if (name == "gloo") return Backend::kGloo;
  if (name == "shm") return Backend::kShm;
  if (name == "hierarchical") return Backend::kHierarchical;
  throw Error(fmt::format(
      "unknown collective backend '{}': expected auto, gloo, shm or hierarchical", name));
}

// ---- Work ------------------------------------------------------------------------------

Work::Work(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

int Work::wait(Timeout timeout) {
  if (!impl_) throw Error("Work::wait: empty Work handle");
  if (!impl_->wait_until(detail::deadline_after(timeout))) {
    throw TimeoutError(
        fmt::format("Work::wait: not finished within {:.3f} s (the operation goes on)",
                    timeout ? timeout->count() : 0.0));
  }
  impl_->run_then_once();
  return impl_->source();
}

bool Work::is_completed() const { return impl_ && impl_->done(); }

// ---- CollectiveGroup -----------------------------------------------------------------------

namespace {

void check_tensor(const at::Tensor& t, const char* where, const char* what) {
  if (!t.defined()) throw Error(fmt::format("CollectiveGroup::{}: {} is undefined", where, what));
  if (!t.device().is_cpu()) {
    throw Error(fmt::format("CollectiveGroup::{}: {} is on {}; only CPU tensors are supported",
                            where, what, t.device().str()));
  }
  if (t.is_sparse()) throw Error(fmt::format("CollectiveGroup::{}: {} is sparse", where, what));
}

/// A contiguous stand-in for `t`, and a note to copy results back when it is a copy.
at::Tensor contig(const at::Tensor& t, std::vector<std::pair<at::Tensor, at::Tensor>>* back) {
  if (t.is_contiguous()) return t;
  at::Tensor c = t.contiguous();
  if (back) back->emplace_back(t, c);
  return c;
}
/// The same for a tensor the call owns: a contiguous one moves through, with no reference
/// count traffic (each copy of a tensor is an atomic increment and decrement, a few percent
/// of a 4-byte all_reduce on shm).
at::Tensor contig(at::Tensor&& t, std::vector<std::pair<at::Tensor, at::Tensor>>* back) {
  if (t.is_contiguous()) return std::move(t);
  at::Tensor c = t.contiguous();
  if (back) back->emplace_back(std::move(t), c);
  return c;
}

/// Contiguous stand-ins for a list the call owns, in the list itself: no new vector and no
/// reference count traffic when every tensor is contiguous already (a 4-byte all_gather on
/// shm paid an allocation and 2P atomic increments and decrements for the copy).
std::vector<at::Tensor> contig_list(std::vector<at::Tensor>&& list,
                                    std::vector<std::pair<at::Tensor, at::Tensor>>* back) {
  for (auto& t : list) {
    if (!t.is_contiguous()) t = contig(std::move(t), back);
  }
  return std::move(list);
}

void check_list(const std::vector<at::Tensor>& list, const at::Tensor& like, int size,
                const char* where, const char* what) {
  if (static_cast<int>(list.size()) != size) {
    throw Error(fmt::format("CollectiveGroup::{}: {} has {} tensors; the group has {} ranks", where,
                            what, list.size(), size));
  }
  for (const auto& t : list) {
    check_tensor(t, where, what);
    if (t.scalar_type() != like.scalar_type() || t.numel() != like.numel()) {
      throw Error(fmt::format(
          "CollectiveGroup::{}: every tensor of {} must have dtype {} and {} elements like the "
          "tensor; got {} with {}",
          where, what, c10::toString(like.scalar_type()), like.numel(),
          c10::toString(t.scalar_type()), t.numel()));
    }
  }
}

void check_rank(int r, int size, const char* where, const char* what) {
  if (r < 0 || r >= size) {
    throw Error(
        fmt::format("CollectiveGroup::{}: {} {} is out of range [0, {})", where, what, r, size));
  }
}

/// AVG's division, for every backend (they combine AVG like SUM): `t` is contiguous.
void divide_for_average(const at::Tensor& t, ReduceOp op, int size) {
  if (op != ReduceOp::kAvg || size == 1) return;
  detail::reduce_divide(t.data_ptr(), static_cast<size_t>(t.numel()), t.scalar_type(), size);
}

void check_send(const at::Tensor& tensor, int dst, int size, int rank) {
  check_tensor(tensor, "send", "tensor");
  check_rank(dst, size, "send", "dst");
  if (dst == rank) throw Error("CollectiveGroup::send: dst is this rank");
}

void check_recv(const at::Tensor& tensor, std::optional<int> src, int size, int rank) {
  check_tensor(tensor, "recv", "tensor");
  if (src) {
    check_rank(*src, size, "recv", "src");
    if (*src == rank) throw Error("CollectiveGroup::recv: src is this rank");
  }
}

}  // namespace

/// The group's state, shared by copies of a CollectiveGroup: its backend and its one
/// executor (which decides sync vs async for every backend).
struct CollectiveGroup::Impl {
  explicit Impl(std::shared_ptr<detail::GroupBackend> b)
      : backend(std::move(b)), executor(backend) {}
  std::shared_ptr<detail::GroupBackend> backend;
  detail::GroupExecutor executor;
};

CollectiveGroup::CollectiveGroup(std::shared_ptr<detail::GroupBackend> backend)
    : impl_(backend ? std::make_shared<Impl>(std::move(backend)) : nullptr) {}

detail::GroupBackend& CollectiveGroup::be() const {
  if (!impl_) throw ClosedError("CollectiveGroup: the group was destroyed or never created");
  return *impl_->backend;
}

int CollectiveGroup::rank() const { return be().rank(); }
int CollectiveGroup::size() const { return be().size(); }
const std::vector<int>& CollectiveGroup::ranks() const { return be().world_ranks(); }
Backend CollectiveGroup::backend() const { return be().kind(); }

std::chrono::duration<double> CollectiveGroup::call_timeout(Timeout timeout) const {
  return timeout.value_or(be().timeout());
}

template <class Op>
Work CollectiveGroup::run(bool async_op, CopyBacks back, Op call) {
  be();  // throws ClosedError once destroyed
  // A rank this call found lost goes into the World's record (rank 0's leave stops waiting
  // for it); the error propagates as it is.
  auto op = [call = std::move(call)](detail::GroupBackend& b) {
    try {
      call(b);
    } catch (const RankLostError& e) {
      b.note_lost(e.rank());
      throw;
    }
  };
  // A synchronous call with nothing pending runs here and now: no Work, no std::function and
  // no promise's mutex per call (a 4-byte all_reduce on shm is well under a microsecond, and
  // those allocations and locks were a tenth of it). Its error propagates as it is.
  if (!async_op && impl_->executor.try_run_inline(op)) {
    for (const auto& [orig, stand_in] : back) orig.copy_(stand_in);
    return Work(detail::completed_work());
  }
  Work w(impl_->executor.submit(std::move(op)));
  if (!back.empty()) {
    w.impl_->add_then([back = std::move(back)] {
      for (const auto& [orig, stand_in] : back) orig.copy_(stand_in);
    });
  }
  if (!async_op) w.wait();
  return w;
}

Work CollectiveGroup::all_reduce(at::Tensor tensor, const ReduceOptions& options) {
  check_tensor(tensor, "all_reduce", "tensor");
  detail::check_reducible(tensor.scalar_type(), options.op, "CollectiveGroup::all_reduce");
  CopyBacks back;
  auto t = contig(std::move(tensor), &back);
  const detail::ReduceCallOptions o{.op = options.op, .timeout = call_timeout(options.timeout)};
  return run(options.async_op, std::move(back), [t = std::move(t), o](detail::GroupBackend& be) {
    be.all_reduce(t, o);
    divide_for_average(t, o.op, be.size());
  });
}

Work CollectiveGroup::all_gather(std::vector<at::Tensor> tensor_list, at::Tensor tensor,
                                 const CollectiveOptions& options) {
  check_tensor(tensor, "all_gather", "tensor");
  check_list(tensor_list, tensor, size(), "all_gather", "tensor_list");
  CopyBacks back;
  auto out = contig_list(std::move(tensor_list), &back);
  const detail::CallOptions o{.timeout = call_timeout(options.timeout)};
  return run(options.async_op, std::move(back),
             [out = std::move(out), in = contig(std::move(tensor), nullptr),
              o](detail::GroupBackend& be) { be.all_gather(out, in, o); });
}

Work CollectiveGroup::broadcast(at::Tensor tensor, int src, const CollectiveOptions& options) {
  check_tensor(tensor, "broadcast", "tensor");
  check_rank(src, size(), "broadcast", "src");
  CopyBacks back;
  auto t = contig(std::move(tensor), &back);
  const detail::CallOptions o{.timeout = call_timeout(options.timeout)};
  return run(options.async_op, std::move(back),
             [t = std::move(t), src, o](detail::GroupBackend& be) { be.broadcast(t, src, o); });
}

Work CollectiveGroup::reduce(at::Tensor tensor, int dst, const ReduceOptions& options) {
  check_tensor(tensor, "reduce", "tensor");
  check_rank(dst, size(), "reduce", "dst");
  detail::check_reducible(tensor.scalar_type(), options.op, "CollectiveGroup::reduce");
  CopyBacks back;
  auto t = contig(std::move(tensor), &back);
  // Only dst's tensor changes; other ranks reduce from a copy so theirs stay as they were.
  if (rank() != dst) t = t.clone();
  const detail::ReduceCallOptions o{.op = options.op, .timeout = call_timeout(options.timeout)};
  return run(options.async_op, std::move(back),
             [t = std::move(t), dst, o](detail::GroupBackend& be) {
               be.reduce(t, dst, o);
               if (be.rank() == dst) divide_for_average(t, o.op, be.size());
             });
}

Work CollectiveGroup::gather(at::Tensor tensor, std::vector<at::Tensor> gather_list, int dst,
                             const CollectiveOptions& options) {
  check_tensor(tensor, "gather", "tensor");
  check_rank(dst, size(), "gather", "dst");
  CopyBacks back;
  std::vector<at::Tensor> out;
  if (rank() == dst) {
    check_list(gather_list, tensor, size(), "gather", "gather_list");
    out = contig_list(std::move(gather_list), &back);
  } else if (!gather_list.empty()) {
    throw Error("CollectiveGroup::gather: gather_list must be empty on ranks other than dst");
  } else {
    out.assign(static_cast<size_t>(size()), at::Tensor());
  }
  const detail::CallOptions o{.timeout = call_timeout(options.timeout)};
  return run(options.async_op, std::move(back),
             [in = contig(std::move(tensor), nullptr), out = std::move(out), dst,
              o](detail::GroupBackend& be) { be.gather(in, out, dst, o); });
}

Work CollectiveGroup::scatter(at::Tensor tensor, std::vector<at::Tensor> scatter_list, int src,
                              const CollectiveOptions& options) {
  check_tensor(tensor, "scatter", "tensor");
  check_rank(src, size(), "scatter", "src");
  std::vector<at::Tensor> in;
  if (rank() == src) {
    check_list(scatter_list, tensor, size(), "scatter", "scatter_list");
    in = contig_list(std::move(scatter_list), nullptr);
  } else if (!scatter_list.empty()) {
    throw Error("CollectiveGroup::scatter: scatter_list must be empty on ranks other than src");
  }
  CopyBacks back;
  auto t = contig(std::move(tensor), &back);
  const detail::CallOptions o{.timeout = call_timeout(options.timeout)};
  return run(options.async_op, std::move(back),
             [t = std::move(t), in = std::move(in), src, o](detail::GroupBackend& be) {
               be.scatter(t, in, src, o);
             });
}

Work CollectiveGroup::reduce_scatter(at::Tensor output, std::vector<at::Tensor> input_list,
                                     const ReduceOptions& options) {
  check_tensor(output, "reduce_scatter", "output");
  check_list(input_list, output, size(), "reduce_scatter", "input_list");
  detail::check_reducible(output.scalar_type(), options.op, "CollectiveGroup::reduce_scatter");
  CopyBacks back;
  auto t = contig(std::move(output), &back);
  const detail::ReduceCallOptions o{.op = options.op, .timeout = call_timeout(options.timeout)};
  return run(options.async_op, std::move(back),
             [t = std::move(t), in = contig_list(std::move(input_list), nullptr),
              o](detail::GroupBackend& be) {
               be.reduce_scatter(t, in, o);
               divide_for_average(t, o.op, be.size());
             });
}

Work CollectiveGroup::all_to_all(std::vector<at::Tensor> output_list,
                                 std::vector<at::Tensor> input_list,
                                 const CollectiveOptions& options) {
  if (input_list.empty()) throw Error("CollectiveGroup::all_to_all: input_list is empty");
  check_tensor(input_list[0], "all_to_all", "input_list");
  check_list(input_list, input_list[0], size(), "all_to_all", "input_list");
  check_list(output_list, input_list[0], size(), "all_to_all", "output_list");
  CopyBacks back;
  auto out = contig_list(std::move(output_list), &back);
  const detail::CallOptions o{.timeout = call_timeout(options.timeout)};
  return run(options.async_op, std::move(back),
             [out = std::move(out), in = contig_list(std::move(input_list), nullptr),
              o](detail::GroupBackend& be) { be.all_to_all(out, in, o); });
}

Work CollectiveGroup::barrier(const CollectiveOptions& options) {
  const detail::CallOptions o{.timeout = call_timeout(options.timeout)};
  return run(options.async_op, {}, [o](detail::GroupBackend& be) { be.barrier(o); });
}

void CollectiveGroup::send(at::Tensor tensor, int dst, int tag) {
  check_send(tensor, dst, size(), rank());
  be().send(contig(tensor, nullptr), dst, tag, {.timeout = call_timeout(std::nullopt)});
}

int CollectiveGroup::recv(at::Tensor tensor, std::optional<int> src, int tag) {
  check_recv(tensor, src, size(), rank());
  CopyBacks back;
  auto t = contig(tensor, &back);
  const int sender = be().recv(t, src, tag, {.timeout = call_timeout(std::nullopt)});
  for (const auto& [orig, stand_in] : back) orig.copy_(stand_in);
  return sender;
}

Work CollectiveGroup::isend(at::Tensor tensor, int dst, int tag) {
  check_send(tensor, dst, size(), rank());
  return be().isend(contig(tensor, nullptr), dst, tag);
}

Work CollectiveGroup::irecv(at::Tensor tensor, std::optional<int> src, int tag) {
  check_recv(tensor, src, size(), rank());
  CopyBacks back;
  auto t = contig(tensor, &back);
  Work w = be().irecv(t, src, tag);
  if (!back.empty()) {
    w.impl_->add_then([back = std::move(back)] {
      for (const auto& [orig, stand_in] : back) orig.copy_(stand_in);
    });
  }
  return w;
}

void CollectiveGroup::destroy() {
  if (impl_) {
    impl_->executor.stop();
    impl_->backend->destroy();
  }
  impl_.reset();
}

}  // namespace torchpar
