#include <c10/util/MaybeOwned.h>
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

using CopyBackList = std::vector<std::pair<at::Tensor, at::Tensor>>;  // (caller's, stand-in)

/// `t` itself (borrowed: no reference count traffic, each one an atomic increment and
/// decrement on the caller's path) when contiguous; else a contiguous copy, noted in `back`
/// (when given) to be copied back into `t` after the call.
c10::MaybeOwned<at::Tensor> contig(const at::Tensor& t, CopyBackList* back) {
  if (t.is_contiguous()) return c10::MaybeOwned<at::Tensor>::borrowed(t);
  at::Tensor c = t.contiguous();
  if (back) back->emplace_back(t, c);
  return c10::MaybeOwned<at::Tensor>::owned(std::move(c));
}

/// `list` itself when every tensor is contiguous (no new vector, no reference counts); else
/// `storage`, filled with the tensors or their contiguous stand-ins (noted in `back`).
const std::vector<at::Tensor>& contig_list(const std::vector<at::Tensor>& list, CopyBackList* back,
                                           std::vector<at::Tensor>& storage) {
  bool all = true;
  for (const auto& t : list) all = all && t.is_contiguous();
  if (all) return list;
  storage.reserve(list.size());
  for (const auto& t : list) storage.push_back(*contig(t, back));
  return storage;
}

/// The Work of every call that ran inline. A copy touches no reference count (its handle
/// has no control block) and calls nothing; building it per call from completed_work()'s
/// returned handle cost a store-forwarding stall (the callee stored the handle as two
/// 8-byte words, the caller loaded it as one 16-byte word), ~5 ns of a 4-byte collective.
const Work& completed_inline() {
  static const Work done(detail::completed_work());
  return done;
}

/// Runs body(b, args...); a rank this call found lost goes into the World's record (rank
/// 0's leave stops waiting for it); the error propagates as it is.
template <class Body, class... Args>
void call_noting_lost(const Body& body, detail::GroupBackend& b, const Args&... args) {
  try {
    body(b, args...);
  } catch (const RankLostError& e) {
    b.note_lost(e.rank());
    throw;
  }
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

template <class Body, class... Args>
Work CollectiveGroup::run(bool async_op, CopyBacks back, Body body, const Args&... args) {
  be();  // throws ClosedError once destroyed
  // A synchronous call with nothing pending runs here and now, on the caller's tensors: no
  // Work, no std::function, no promise's mutex and no tensor handle copied per call (a 4-byte
  // all_reduce on shm is well under a microsecond, and each of those was a visible part of
  // it). Its error propagates as it is.
  if (!async_op && impl_->executor.try_run_inline(
                       [&](detail::GroupBackend& b) { call_noting_lost(body, b, args...); })) {
    for (const auto& [orig, stand_in] : back) orig.copy_(stand_in);
    return completed_inline();
  }
  // Queued: the call owns copies of the handles (the storage stays shared).
  Work w(impl_->executor.submit([body = std::move(body), args...](detail::GroupBackend& b) {
    call_noting_lost(body, b, args...);
  }));
  if (!back.empty()) {
    w.impl_->add_then([back = std::move(back)] {
      for (const auto& [orig, stand_in] : back) orig.copy_(stand_in);
    });
  }
  if (!async_op) w.wait();
  return w;
}

Work CollectiveGroup::all_reduce(const at::Tensor& tensor, const ReduceOptions& options) {
  check_tensor(tensor, "all_reduce", "tensor");
  detail::check_reducible(tensor.scalar_type(), options.op, "CollectiveGroup::all_reduce");
  CopyBacks back;
  const auto t = contig(tensor, &back);
  const detail::ReduceCallOptions o{.op = options.op, .timeout = call_timeout(options.timeout)};
  return run(
      options.async_op, std::move(back),
      [o](detail::GroupBackend& be, const at::Tensor& x) {
        be.all_reduce(x, o);
        divide_for_average(x, o.op, be.size());
      },
      *t);
}

Work CollectiveGroup::all_gather(const std::vector<at::Tensor>& tensor_list,
                                 const at::Tensor& tensor, const CollectiveOptions& options) {
  check_tensor(tensor, "all_gather", "tensor");
  check_list(tensor_list, tensor, size(), "all_gather", "tensor_list");
  CopyBacks back;
  std::vector<at::Tensor> storage;
  const auto& out = contig_list(tensor_list, &back, storage);
  const auto in = contig(tensor, nullptr);
  const detail::CallOptions o{.timeout = call_timeout(options.timeout)};
  return run(
      options.async_op, std::move(back),
      [o](detail::GroupBackend& be, const std::vector<at::Tensor>& outs, const at::Tensor& x_in) {
        be.all_gather(outs, x_in, o);
      },
      out, *in);
}

Work CollectiveGroup::broadcast(const at::Tensor& tensor, int src,
                                const CollectiveOptions& options) {
  check_tensor(tensor, "broadcast", "tensor");
  check_rank(src, size(), "broadcast", "src");
  CopyBacks back;
  const auto t = contig(tensor, &back);
  const detail::CallOptions o{.timeout = call_timeout(options.timeout)};
  return run(
      options.async_op, std::move(back),
      [src, o](detail::GroupBackend& be, const at::Tensor& x) { be.broadcast(x, src, o); }, *t);
}

Work CollectiveGroup::reduce(const at::Tensor& tensor, int dst, const ReduceOptions& options) {
  check_tensor(tensor, "reduce", "tensor");
  check_rank(dst, size(), "reduce", "dst");
  detail::check_reducible(tensor.scalar_type(), options.op, "CollectiveGroup::reduce");
  CopyBacks back;
  // Only dst's tensor changes; other ranks reduce from a copy so theirs stay as they were.
  const auto t =
      rank() == dst
          ? contig(tensor, &back)
          : c10::MaybeOwned<at::Tensor>::owned(tensor.clone(at::MemoryFormat::Contiguous));
  const detail::ReduceCallOptions o{.op = options.op, .timeout = call_timeout(options.timeout)};
  return run(
      options.async_op, std::move(back),
      [dst, o](detail::GroupBackend& be, const at::Tensor& x) {
        be.reduce(x, dst, o);
        if (be.rank() == dst) divide_for_average(x, o.op, be.size());
      },
      *t);
}

Work CollectiveGroup::gather(const at::Tensor& tensor, const std::vector<at::Tensor>& gather_list,
                             int dst, const CollectiveOptions& options) {
  check_tensor(tensor, "gather", "tensor");
  check_rank(dst, size(), "gather", "dst");
  CopyBacks back;
  std::vector<at::Tensor> storage;
  const std::vector<at::Tensor>* out = &storage;
  if (rank() == dst) {
    check_list(gather_list, tensor, size(), "gather", "gather_list");
    out = &contig_list(gather_list, &back, storage);
  } else if (!gather_list.empty()) {
    throw Error("CollectiveGroup::gather: gather_list must be empty on ranks other than dst");
  } else {
    storage.assign(static_cast<size_t>(size()), at::Tensor());
  }
  const auto in = contig(tensor, nullptr);
  const detail::CallOptions o{.timeout = call_timeout(options.timeout)};
  return run(
      options.async_op, std::move(back),
      [dst, o](detail::GroupBackend& be, const at::Tensor& x_in,
               const std::vector<at::Tensor>& outs) { be.gather(x_in, outs, dst, o); },
      *in, *out);
}

Work CollectiveGroup::scatter(const at::Tensor& tensor, const std::vector<at::Tensor>& scatter_list,
                              int src, const CollectiveOptions& options) {
  check_tensor(tensor, "scatter", "tensor");
  check_rank(src, size(), "scatter", "src");
  std::vector<at::Tensor> storage;
  const std::vector<at::Tensor>* in = &storage;
  if (rank() == src) {
    check_list(scatter_list, tensor, size(), "scatter", "scatter_list");
    in = &contig_list(scatter_list, nullptr, storage);
  } else if (!scatter_list.empty()) {
    throw Error("CollectiveGroup::scatter: scatter_list must be empty on ranks other than src");
  }
  CopyBacks back;
  const auto t = contig(tensor, &back);
  const detail::CallOptions o{.timeout = call_timeout(options.timeout)};
  return run(
      options.async_op, std::move(back),
      [src, o](detail::GroupBackend& be, const at::Tensor& x, const std::vector<at::Tensor>& ins) {
        be.scatter(x, ins, src, o);
      },
      *t, *in);
}

Work CollectiveGroup::reduce_scatter(const at::Tensor& output,
                                     const std::vector<at::Tensor>& input_list,
                                     const ReduceOptions& options) {
  check_tensor(output, "reduce_scatter", "output");
  check_list(input_list, output, size(), "reduce_scatter", "input_list");
  detail::check_reducible(output.scalar_type(), options.op, "CollectiveGroup::reduce_scatter");
  CopyBacks back;
  const auto t = contig(output, &back);
  std::vector<at::Tensor> storage;
  const auto& in = contig_list(input_list, nullptr, storage);
  const detail::ReduceCallOptions o{.op = options.op, .timeout = call_timeout(options.timeout)};
  return run(
      options.async_op, std::move(back),
      [o](detail::GroupBackend& be, const at::Tensor& x, const std::vector<at::Tensor>& ins) {
        be.reduce_scatter(x, ins, o);
        divide_for_average(x, o.op, be.size());
      },
      *t, in);
}

Work CollectiveGroup::all_to_all(const std::vector<at::Tensor>& output_list,
                                 const std::vector<at::Tensor>& input_list,
                                 const CollectiveOptions& options) {
  if (input_list.empty()) throw Error("CollectiveGroup::all_to_all: input_list is empty");
  check_tensor(input_list[0], "all_to_all", "input_list");
  check_list(input_list, input_list[0], size(), "all_to_all", "input_list");
  check_list(output_list, input_list[0], size(), "all_to_all", "output_list");
  CopyBacks back;
  std::vector<at::Tensor> out_storage, in_storage;
  const auto& out = contig_list(output_list, &back, out_storage);
  const auto& in = contig_list(input_list, nullptr, in_storage);
  const detail::CallOptions o{.timeout = call_timeout(options.timeout)};
  return run(
      options.async_op, std::move(back),
      [o](detail::GroupBackend& be, const std::vector<at::Tensor>& outs,
          const std::vector<at::Tensor>& ins) { be.all_to_all(outs, ins, o); },
      out, in);
}

Work CollectiveGroup::barrier(const CollectiveOptions& options) {
  const detail::CallOptions o{.timeout = call_timeout(options.timeout)};
  return run(options.async_op, {}, [o](detail::GroupBackend& be) { be.barrier(o); });
}

void CollectiveGroup::send(const at::Tensor& tensor, int dst, int tag) {
  check_send(tensor, dst, size(), rank());
  be().send(*contig(tensor, nullptr), dst, tag, {.timeout = call_timeout(std::nullopt)});
}

int CollectiveGroup::recv(const at::Tensor& tensor, std::optional<int> src, int tag) {
  check_recv(tensor, src, size(), rank());
  CopyBacks back;
  const auto t = contig(tensor, &back);
  const int sender = be().recv(*t, src, tag, {.timeout = call_timeout(std::nullopt)});
  for (const auto& [orig, stand_in] : back) orig.copy_(stand_in);
  return sender;
}

Work CollectiveGroup::isend(const at::Tensor& tensor, int dst, int tag) {
  check_send(tensor, dst, size(), rank());
  return be().isend(*contig(tensor, nullptr), dst, tag);
}

Work CollectiveGroup::irecv(const at::Tensor& tensor, std::optional<int> src, int tag) {
  check_recv(tensor, src, size(), rank());
  CopyBacks back;
  const auto t = contig(tensor, &back);
  Work w = be().irecv(*t, src, tag);
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
