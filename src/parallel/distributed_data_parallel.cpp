#include "torchpar/parallel/distributed_data_parallel.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <numeric>
#include <utility>

#include "torchpar/core/error.h"

namespace torchpar {
namespace {

// ---- every call into CollectiveGroup ---------------------------------------------------------
// Kept together so that a change of the group's signatures touches these lines only.

Work start_average(CollectiveGroup& group, const at::Tensor& flat, bool async_op) {
  return group.all_reduce(flat, {.op = ReduceOp::kAvg, .async_op = async_op});
}

Work start_broadcast_from_rank0(CollectiveGroup& group, const at::Tensor& flat, bool async_op) {
  return group.broadcast(flat, /*src=*/0, {.async_op = async_op});
}

void all_gather(CollectiveGroup& group, std::vector<at::Tensor> out, const at::Tensor& in) {
  group.all_gather(std::move(out), in);
}

// ----------------------------------------------------------------------------------------------

/// torch's default broadcast_bucket_size: rank 0's state goes out in buckets of this size.
constexpr int64_t kBroadcastBucketBytes = int64_t{250} << 20;
/// torch's _DEFAULT_FIRST_BUCKET_BYTES: with overlap, the first gradients of a backward go
/// out in a bucket of at most this size.
constexpr int64_t kFirstBucketBytes = int64_t{1} << 20;

/// Starts op k for every k, then waits for each in order and runs done(k) after it, so that
/// done(k) overlaps the transfer of the later ones. start(k, async_op): async only when there
/// are two ops or more. With one there is nothing to overlap, and an async op travels to the
/// group's executor thread and back: two futex wake-ups of a sleeping thread, which cost
/// `torchpar train --strategy ddp --workers 1` ~8% of its samples/s against single (2910
/// context switches an epoch against 465). After a failure it still waits for every
/// started op (they write into buffers the next call reuses; after a collective's failure the
/// group is broken and they fail at once) and rethrows the first error.
template <class Start, class Done>
void run_pipelined(std::size_t n, Start&& start, Done&& done) {
  std::vector<Work> works;
  works.reserve(n);
  std::exception_ptr error;
  try {
    for (std::size_t k = 0; k < n; ++k) works.push_back(start(k, /*async_op=*/n > 1));
    for (std::size_t k = 0; k < n; ++k) {
      works[k].wait();
      done(k);
    }
  } catch (...) {
    error = std::current_exception();
  }
  if (!error) return;
  for (auto& w : works) {
    try {
      if (!w.is_completed()) w.wait();
    } catch (...) {  // the first error is the one to report
    }
  }
  std::rethrow_exception(error);
}

/// Splits tensors[indices] into buckets of one dtype each, in order; a bucket is closed once
/// it holds cap_bytes or more, the first one closed at first_cap_bytes
/// (torch's _compute_bucket_assignment_by_size). Deterministic, so every rank with the same
/// model gets the same buckets.
std::vector<std::vector<std::size_t>> assign_buckets(const std::vector<at::Tensor>& tensors,
                                                     const std::vector<std::size_t>& indices,
                                                     int64_t cap_bytes,
                                                     int64_t first_cap_bytes = INT64_MAX) {
  struct Open {
    std::vector<std::size_t> members;
    int64_t bytes = 0;
  };
  std::map<at::ScalarType, Open> open;
  std::vector<std::vector<std::size_t>> out;
  for (std::size_t i : indices) {
    Open& b = open[tensors[i].scalar_type()];
    b.members.push_back(i);
    b.bytes += static_cast<int64_t>(tensors[i].nbytes());
    if (b.bytes >= (out.empty() ? std::min(cap_bytes, first_cap_bytes) : cap_bytes)) {
      out.push_back(std::move(b.members));
      b = Open{};
    }
  }
  for (auto& [dtype, b] : open) {
    if (!b.members.empty()) out.push_back(std::move(b.members));
  }
  return out;
}

/// Copies rank 0's `tensors` into every rank's, in place: one broadcast per bucket, all
/// started before the first wait.
void broadcast_from_rank0(CollectiveGroup& group, const std::vector<at::Tensor>& tensors) {
  std::vector<std::size_t> all(tensors.size());
  std::iota(all.begin(), all.end(), std::size_t{0});
  std::vector<std::vector<std::size_t>> buckets;
  for (auto& b : assign_buckets(tensors, all, kBroadcastBucketBytes)) {
    int64_t numel = 0;
    for (std::size_t i : b) numel += tensors[i].numel();
    if (numel > 0) buckets.push_back(std::move(b));  // nothing to send for empty tensors
  }
  // Parameters are leaves that require grad: in-place copies into them must not be recorded.
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> flats(buckets.size());
  const bool receiver = group.rank() != 0;
  run_pipelined(
      buckets.size(),
      [&](std::size_t k, bool async_op) {
        std::vector<at::Tensor> parts;
        for (std::size_t i : buckets[k]) parts.push_back(tensors[i].reshape({-1}));
        flats[k] = at::cat(parts);
        return start_broadcast_from_rank0(group, flats[k], async_op);
      },
      [&](std::size_t k) {
        if (!receiver) return;
        int64_t off = 0;
        for (std::size_t i : buckets[k]) {
          const at::Tensor& t = tensors[i];
          t.copy_(flats[k].narrow(0, off, t.numel()).view(t.sizes()));
          off += t.numel();
        }
        flats[k] = at::Tensor();
      });
}

/// 64-bit FNV-1a over a sequence of integers.
struct Fnv {
  uint64_t h = 14695981039346656037ULL;
  void add(int64_t v) {
    auto u = static_cast<uint64_t>(v);
    for (int byte = 0; byte < 8; ++byte) {
      h ^= (u >> (8 * byte)) & 0xff;
      h *= 1099511628211ULL;
    }
  }
};

/// Count, elements and a hash of (dtype, requires_grad, shape) of each tensor, in order.
std::array<int64_t, 3> describe(const std::vector<at::Tensor>& tensors) {
  Fnv fnv;
  int64_t numel = 0;
  for (const auto& t : tensors) {
    fnv.add(static_cast<int64_t>(t.scalar_type()));
    fnv.add(t.requires_grad() ? 1 : 0);
    fnv.add(t.dim());
    for (int64_t s : t.sizes()) fnv.add(s);
    numel += t.numel();
  }
  return {static_cast<int64_t>(tensors.size()), numel, static_cast<int64_t>(fnv.h)};
}

/// Throws ValueError on every rank when some rank's parameters or buffers differ from rank
/// 0's: a mismatch would otherwise surface as a size error of a collective (or, with Gloo, a
/// timeout), or go unnoticed when only shapes differ.
void check_same_model(CollectiveGroup& group, const std::vector<at::Tensor>& params,
                      const std::vector<at::Tensor>& buffers) {
  const auto p = describe(params);
  const auto b = describe(buffers);
  at::Tensor mine = at::tensor(std::vector<int64_t>{p[0], p[1], p[2], b[0], b[1], b[2]});
  std::vector<at::Tensor> all;
  for (int r = 0; r < group.size(); ++r) all.push_back(at::empty_like(mine));
  all_gather(group, all, mine);
  for (int r = 1; r < group.size(); ++r) {
    if (at::equal(all[r], all[0])) continue;
    auto v = [&](int rank, int i) { return all[rank][i].item<int64_t>(); };
    throw ValueError(fmt::format(
        "DistributedDataParallel: the ranks build different models: rank {} has {} parameters "
        "of {} elements and {} buffers of {} elements, rank 0 {} of {} and {} of {} (or the "
        "same counts with other shapes, dtypes or requires_grad)",
        r, v(r, 0), v(r, 1), v(r, 3), v(r, 4), v(0, 0), v(0, 1), v(0, 3), v(0, 4)));
  }
}

void check_tensor(const at::Tensor& t, const char* what, std::size_t i) {
  if (!t.defined()) {
    throw ValueError(fmt::format("DistributedDataParallel: {} {} is undefined", what, i));
  }
  if (!t.device().is_cpu() || t.layout() != at::kStrided) {
    throw ValueError(fmt::format(
        "DistributedDataParallel: {} {} is a {} tensor on {}; only strided CPU tensors are "
        "supported",
        what, i, c10::str(t.layout()), t.device().str()));
  }
}

}  // namespace

// ---- Impl --------------------------------------------------------------------------------------

/// One all_reduce's worth of gradients: flat = [grad of members[0] | grad of members[1] | ...
/// | one flag per member]. A flag is 1 where the rank has the gradient, 0 where it counts as
/// zeros; after the average it is > 0 iff some rank had it, which decides whether an
/// undefined gradient becomes defined (torch's find_unused_parameters, without its extra
/// all_reduce of a usage bitmap).
struct Bucket {
  std::vector<std::size_t> members;  // indices into Impl::params
  std::vector<int64_t> offsets;      // element offset of each member's gradient in flat
  int64_t grad_numel = 0;            // where the flags start
  at::Tensor flat;
  // This round (backward .. synchronize_gradients), with overlap_with_backward:
  std::vector<char> ready;  // member j's gradient accumulated by this round's backward
  std::size_t ready_count = 0;
  bool started = false;  // its all_reduce is under way: `work`
  Work work;
};

struct DistributedDataParallel::Impl {
  CollectiveGroup group;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> buffers;
  std::vector<Bucket> buckets;
  DistributedDataParallelStats stats;

  // overlap_with_backward: the hooks on the gradient accumulators (kept alive here, as the
  // parameters only hold them weakly) and where each parameter sits.
  /// Runs after autograd accumulated a parameter's gradient of this backward (a post hook
  /// on its AccumulateGrad node, as torch's Reducer registers); on the backward's thread.
  class GradientReadyHook final : public torch::autograd::FunctionPostHook {
   public:
    GradientReadyHook(Impl* impl, std::size_t param) : impl_(impl), param_(param) {}
    torch::autograd::variable_list operator()(
        const torch::autograd::variable_list& outputs,
        const torch::autograd::variable_list& /*inputs*/) override {
      impl_->on_gradient_ready(param_);
      return outputs;
    }

   private:
    Impl* impl_;
    std::size_t param_;
  };
  struct Hooked {
    std::shared_ptr<torch::autograd::Node> accumulator;
    uintptr_t key;
  };
  std::vector<Hooked> hooks;
  std::vector<std::pair<std::size_t, std::size_t>> slot_of;  // param -> (bucket, member)
  std::size_t next_start = 0;  // buckets start in index order, on every rank the same
  bool require_sync = true;    // false under no_sync()
  bool stale = false;          // a backward reached a started bucket
  std::exception_ptr hook_error;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl();

  void pack(Bucket& b) const;
  void unpack(Bucket& b) const;
  void start(std::size_t k, bool async_op);
  void install_hooks();
  void on_gradient_ready(std::size_t param) noexcept;
  void finish_round();
  void reset_round();
  void wait_started() noexcept;
  /// After an error before the round's end: waits for what backward started, then resets.
  void abandon_round() noexcept;
};

void DistributedDataParallel::Impl::pack(Bucket& b) const {
  std::vector<float> flags(b.members.size());
  for (std::size_t j = 0; j < b.members.size(); ++j) {
    const at::Tensor& p = params[b.members[j]];
    at::Tensor slot = b.flat.narrow(0, b.offsets[j], p.numel());
    const at::Tensor& g = p.grad();
    if (g.defined()) {
      slot.view(g.sizes()).copy_(g);
      flags[j] = 1;
    } else {
      slot.zero_();
    }
  }
  b.flat.narrow(0, b.grad_numel, static_cast<int64_t>(flags.size()))
      .copy_(at::from_blob(flags.data(), {static_cast<int64_t>(flags.size())}, at::kFloat));
}

void DistributedDataParallel::Impl::unpack(Bucket& b) const {
  const at::Tensor used =
      b.flat.narrow(0, b.grad_numel, static_cast<int64_t>(b.members.size())).to(at::kFloat);
  const float* used_by = used.data_ptr<float>();
  for (std::size_t j = 0; j < b.members.size(); ++j) {
    const at::Tensor& p = params[b.members[j]];
    const at::Tensor slot = b.flat.narrow(0, b.offsets[j], p.numel()).view(p.sizes());
    at::Tensor& g = p.mutable_grad();
    if (g.defined()) {
      g.copy_(slot);
    } else if (used_by[j] > 0) {  // some other rank used the parameter
      g = at::empty_like(p.detach());
      g.copy_(slot);
    }  // else no rank has it: it stays undefined everywhere
  }
}

DistributedDataParallel::Impl::~Impl() {
  for (auto& h : hooks) h.accumulator->del_post_hook(h.key);
  wait_started();  // in flight: they write into the flat buffers
}

void DistributedDataParallel::Impl::start(std::size_t k, bool async_op) {
  Bucket& b = buckets[k];
  pack(b);
  b.work = start_average(group, b.flat, async_op);
  b.started = true;
}

void DistributedDataParallel::Impl::install_hooks() {
  slot_of.assign(params.size(), {SIZE_MAX, 0});
  for (std::size_t k = 0; k < buckets.size(); ++k) {
    Bucket& b = buckets[k];
    b.ready.assign(b.members.size(), 0);
    for (std::size_t j = 0; j < b.members.size(); ++j) {
      const std::size_t i = b.members[j];
      slot_of[i] = {k, j};
      auto acc = torch::autograd::impl::grad_accumulator(params[i]);
      if (!acc) {
        throw ValueError(fmt::format(
            "DistributedDataParallel: parameter {} has no gradient accumulator (not a leaf "
            "that requires grad), which overlap_with_backward hooks",
            i));
      }
      const uintptr_t key = acc->add_post_hook(std::make_unique<GradientReadyHook>(this, i));
      hooks.push_back({std::move(acc), key});
    }
  }
}

void DistributedDataParallel::Impl::on_gradient_ready(std::size_t param) noexcept {
  try {
    const auto [k, j] = slot_of[param];
    Bucket& b = buckets[k];
    if (b.started) {  // a second backward: this bucket averages the first one's gradients
      stale = true;
      return;
    }
    if (!require_sync || b.ready[j]) return;
    b.ready[j] = 1;
    if (++b.ready_count < b.members.size()) return;
    // Start every complete bucket from next_start on, in order, except the last: its
    // gradients are the last of the backward, so nothing is left to overlap its transfer and
    // synchronize_gradients() reduces it on the calling thread (no executor hop).
    c10::NoGradGuard no_grad;
    while (next_start + 1 < buckets.size() &&
           buckets[next_start].ready_count == buckets[next_start].members.size()) {
      start(next_start++, /*async_op=*/true);
      ++stats.buckets_started_in_backward;
    }
  } catch (...) {  // thrown out of backward it would leave the round half done: kept for later
    if (!hook_error) hook_error = std::current_exception();
  }
}

/// Starts the buckets not started yet (async while more than one is left to start, as
/// run_pipelined), waits for every one in order and copies the averages back. After a
/// failure it still waits for every started one and rethrows the first error.
void DistributedDataParallel::Impl::finish_round() {
  const std::size_t n = buckets.size();
  const std::size_t to_start = n - next_start;
  std::exception_ptr error = hook_error;
  hook_error = nullptr;
  if (!error) {
    try {
      for (std::size_t k = next_start; k < n; ++k) {
        start(k, /*async_op=*/to_start > 1);
        ++stats.buckets_started_in_synchronize;
      }
      next_start = n;
      for (std::size_t k = 0; k < n; ++k) {
        buckets[k].work.wait();
        unpack(buckets[k]);
      }
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (!error) return;
  wait_started();
  std::rethrow_exception(error);
}

void DistributedDataParallel::Impl::wait_started() noexcept {
  for (auto& b : buckets) {
    try {
      if (b.started && !b.work.is_completed()) b.work.wait();
    } catch (...) {  // the first error is the one to report
    }
  }
}

void DistributedDataParallel::Impl::abandon_round() noexcept {
  wait_started();
  hook_error = nullptr;
  reset_round();
}

void DistributedDataParallel::Impl::reset_round() {
  for (auto& b : buckets) {
    std::fill(b.ready.begin(), b.ready.end(), 0);
    b.ready_count = 0;
    b.started = false;
    b.work = Work();
  }
  next_start = 0;
  stale = false;
}

// ---- DistributedDataParallel
// ---------------------------------------------------------------------

DistributedDataParallel::DistributedDataParallel(torch::nn::Module& module, CollectiveGroup group,
                                                 DistributedDataParallelOptions options)
    : DistributedDataParallel(module.parameters(/*recurse=*/true), module.buffers(/*recurse=*/true),
                              std::move(group), options) {}

DistributedDataParallel::DistributedDataParallel(std::vector<at::Tensor> parameters,
                                                 std::vector<at::Tensor> buffers,
                                                 CollectiveGroup group,
                                                 DistributedDataParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (!(options.bucket_cap_mb > 0)) {
    throw ValueError(fmt::format("DistributedDataParallel: bucket_cap_mb must be > 0, got {}",
                                 options.bucket_cap_mb));
  }
  std::vector<std::size_t> reduced;  // the parameters whose gradients are averaged
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const at::Tensor& p = parameters[i];
    check_tensor(p, "parameter", i);
    if (!p.requires_grad()) continue;
    if (!at::isFloatingType(p.scalar_type())) {
      throw ValueError(fmt::format(
          "DistributedDataParallel: parameter {} requires grad but has dtype {}; gradients are "
          "averaged, which needs a floating dtype",
          i, c10::toString(p.scalar_type())));
    }
    reduced.push_back(i);
  }
  for (std::size_t i = 0; i < buffers.size(); ++i) check_tensor(buffers[i], "buffer", i);

  Impl& m = *impl_;
  m.group = std::move(group);
  m.params = std::move(parameters);
  m.buffers = std::move(buffers);
  check_same_model(m.group, m.params, m.buffers);
  std::vector<at::Tensor> state = m.params;
  state.insert(state.end(), m.buffers.begin(), m.buffers.end());
  broadcast_from_rank0(m.group, state);

  // Beyond 2^62 bytes every dtype's gradients fit in one bucket anyway.
  const double cap = std::min(options.bucket_cap_mb * double(1 << 20), 0x1p62);
  // With overlap, buckets follow the order backward produces gradients: the reverse of the
  // parameters' (torch's Reducer), the first one small so it goes out early.
  if (options.overlap_with_backward) std::reverse(reduced.begin(), reduced.end());
  for (auto& members :
       assign_buckets(m.params, reduced, static_cast<int64_t>(cap),
                      options.overlap_with_backward ? kFirstBucketBytes : INT64_MAX)) {
    Bucket b;
    b.members = std::move(members);
    for (std::size_t i : b.members) {
      b.offsets.push_back(b.grad_numel);
      b.grad_numel += m.params[i].numel();
    }
    b.flat = at::empty({b.grad_numel + static_cast<int64_t>(b.members.size())},
                       m.params[b.members[0]].options().requires_grad(false));
    m.buckets.push_back(std::move(b));
  }
  if (options.overlap_with_backward) m.install_hooks();
}

DistributedDataParallel::~DistributedDataParallel() = default;
DistributedDataParallel::DistributedDataParallel(DistributedDataParallel&&) noexcept = default;
DistributedDataParallel& DistributedDataParallel::operator=(DistributedDataParallel&&) noexcept =
    default;

DistributedDataParallel::Impl& DistributedDataParallel::impl() const {
  if (!impl_) throw Error("DistributedDataParallel: used after it was moved from");
  return *impl_;
}

void DistributedDataParallel::synchronize_gradients() {
  Impl& m = impl();
  for (const auto& b : m.buckets) {
    for (std::size_t i : b.members) {
      const at::Tensor& g = m.params[i].grad();
      if (g.defined() && g.layout() != at::kStrided) {
        // Buckets backward started are waited for: they write into the flat buffers.
        if (!m.hooks.empty()) m.abandon_round();
        throw ValueError(fmt::format(
            "DistributedDataParallel: parameter {} has a {} gradient; only dense gradients are "
            "averaged",
            i, c10::str(g.layout())));
      }
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  c10::NoGradGuard no_grad;  // a gradient built with create_graph must not grow a graph here
  if (m.hooks.empty()) {
    run_pipelined(
        m.buckets.size(),
        [&](std::size_t k, bool async_op) {
          m.pack(m.buckets[k]);
          return start_average(m.group, m.buckets[k].flat, async_op);
        },
        [&](std::size_t k) { m.unpack(m.buckets[k]); });
    m.stats.buckets_started_in_synchronize += static_cast<int64_t>(m.buckets.size());
  } else {
    const bool stale = m.stale;
    try {
      m.finish_round();
    } catch (...) {
      m.reset_round();
      throw;
    }
    m.reset_round();
    if (stale) {
      throw ValueError(
          "DistributedDataParallel: a second backward ran before synchronize_gradients and "
          "reached buckets whose all_reduce had started (overlap_with_backward): those hold "
          "the first backward's average; run the other backwards of gradient accumulation "
          "under no_sync()");
    }
  }
  ++m.stats.synchronizations;
  m.stats.synchronize_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

DistributedDataParallel::NoSync::~NoSync() {
  if (impl_ != nullptr) impl_->require_sync = previous_;
}

DistributedDataParallel::NoSync::NoSync(NoSync&& other) noexcept
    : impl_(std::exchange(other.impl_, nullptr)), previous_(other.previous_) {}

DistributedDataParallel::NoSync DistributedDataParallel::no_sync() {
  Impl& m = impl();
  return NoSync(&m, std::exchange(m.require_sync, false));
}

DistributedDataParallelStats DistributedDataParallel::stats() const { return impl().stats; }

void DistributedDataParallel::sync_buffers() {
  Impl& m = impl();
  broadcast_from_rank0(m.group, m.buffers);
}

std::size_t DistributedDataParallel::num_buckets() const { return impl().buckets.size(); }

const CollectiveGroup& DistributedDataParallel::process_group() const { return impl().group; }

}  // namespace torchpar
