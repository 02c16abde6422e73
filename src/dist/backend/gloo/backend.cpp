#include "dist/backend/gloo/backend.h"

#include <fmt/format.h>
#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "core/liveness.h"
#include "dist/work.h"
#include "torchpar/core/error.h"

namespace torchpar::detail {
namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kProduct:
      return c10d::ReduceOp::PRODUCT;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
  }
  return c10d::ReduceOp::SUM;
}

using C10dWorkPtr = c10::intrusive_ptr<c10d::Work>;

class GlooBackend;

/// A pending isend/irecv; errors are re-thrown as torchpar errors naming the group and, when
/// it can tell, the rank that went away. It owns its backend: the group may be destroyed
/// while the work is pending, and the error path still reads the backend's members.
class C10dWork : public Work::Impl {
 public:
  C10dWork(C10dWorkPtr w, std::shared_ptr<const GlooBackend> group, std::string what, bool recv)
      : w_(std::move(w)), group_(std::move(group)), what_(std::move(what)), recv_(recv) {}
  bool wait_until(const Deadline& deadline) override;
  bool done() override { return w_->isCompleted(); }
  int source() override { return recv_ ? w_->sourceRank() : -1; }

 private:
  C10dWorkPtr w_;
  std::shared_ptr<const GlooBackend> group_;
  std::string what_;
  bool recv_;
};

class GlooBackend final : public GroupBackend, public std::enable_shared_from_this<GlooBackend> {
 public:
  explicit GlooBackend(const GlooBackendOptions& o)
      : GroupBackend(o.rank, o.world_ranks, o.timeout, o.name),
        members_(o.members),
        host_(o.my_host) {
    const auto& device = o.device;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(o.timeout);
    auto opts = c10d::ProcessGroupGloo::Options::create(ms);
    try {
      if (!device.interface.empty()) {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(device.interface));
      } else if (!device.address.empty()) {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(device.address));
      } else {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      opts->threads = 2;
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(o.store, o.rank, size(), opts);
    } catch (const std::exception& e) {
      throw Error(fmt::format("{}: cannot connect the gloo group within {:.1f} s: {}", name(),
                              o.timeout.count(), message_of(e)));
    }
  }

  Backend kind() const override { return Backend::kGloo; }
  void destroy() override { pg_.reset(); }
  /// As torch.distributed does once a group exists: rank 0 sets, the others read it.
  void set_sequence_number() { pg().setSequenceNumberForGroup(); }

  // Each collective hands the work to ProcessGroupGloo (its own threads run it) and waits
  // for it with the call's timeout. Gloo's own limit (the group's timeout) still applies.

  void all_reduce(const at::Tensor& t, const ReduceCallOptions& o) override {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(o.op);
    run("all_reduce", o.timeout, [&] { return pg().allreduce(v, opts); });
  }

  void all_gather(const std::vector<at::Tensor>& out, const at::Tensor& in,
                  const CallOptions& o) override {
    std::vector<std::vector<at::Tensor>> outs{out};
    std::vector<at::Tensor> ins{in};
    run("all_gather", o.timeout, [&] { return pg().allgather(outs, ins); });
  }

  void broadcast(const at::Tensor& t, int src, const CallOptions& o) override {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    run("broadcast", o.timeout, [&] { return pg().broadcast(v, opts); });
  }

  void reduce(const at::Tensor& t, int dst, const ReduceCallOptions& o) override {
    std::vector<at::Tensor> v{t};
    c10d::ReduceOptions opts;
    opts.reduceOp = to_c10d(o.op);
    opts.rootRank = dst;
    run("reduce", o.timeout, [&] { return pg().reduce(v, opts); });
  }

  void gather(const at::Tensor& in, const std::vector<at::Tensor>& out, int dst,
              const CallOptions& o) override {
    std::vector<std::vector<at::Tensor>> outs;
    if (rank() == dst) outs.push_back(out);
    std::vector<at::Tensor> ins{in};
    c10d::GatherOptions opts;
    opts.rootRank = dst;
    run("gather", o.timeout, [&] { return pg().gather(outs, ins, opts); });
  }

  void scatter(const at::Tensor& out, const std::vector<at::Tensor>& in, int src,
               const CallOptions& o) override {
    std::vector<at::Tensor> outs{out};
    std::vector<std::vector<at::Tensor>> ins;
    if (rank() == src) ins.push_back(in);
    c10d::ScatterOptions opts;
    opts.rootRank = src;
    run("scatter", o.timeout, [&] { return pg().scatter(outs, ins, opts); });
  }

  // Gloo (LibTorch 1.13) has no reduce_scatter: all_reduce the concatenation, keep our part.
  void reduce_scatter(const at::Tensor& out, const std::vector<at::Tensor>& in,
                      const ReduceCallOptions& o) override {
    std::vector<at::Tensor> flat;
    for (const auto& t : in) flat.push_back(t.reshape({-1}));
    std::vector<at::Tensor> v{at::cat(flat)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(o.op);
    run("reduce_scatter", o.timeout, [&] { return pg().allreduce(v, opts); });
    const int64_t n = out.numel();
    out.view({-1}).copy_(v[0].narrow(0, rank() * n, n));
  }

  void all_to_all(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& in,
                  const CallOptions& o) override {
    std::vector<at::Tensor> flat;
    std::vector<int64_t> in_splits, out_splits;
    for (const auto& t : in) {
      flat.push_back(t.reshape({-1}));
      in_splits.push_back(t.numel());
    }
    int64_t total = 0;
    for (const auto& t : out) {
      out_splits.push_back(t.numel());
      total += t.numel();
    }
    at::Tensor src = at::cat(flat);
    at::Tensor dst = at::empty({total}, src.options());
    run("all_to_all", o.timeout,
        [&] { return pg().alltoall_base(dst, src, out_splits, in_splits); });
    int64_t off = 0;
    for (const auto& t : out) {
      t.view({-1}).copy_(dst.narrow(0, off, t.numel()));
      off += t.numel();
    }
  }

  void barrier(const CallOptions& o) override {
    run("barrier", o.timeout, [&] { return pg().barrier(); });
  }

  Work isend(const at::Tensor& t, int dst, int tag) override {
    std::vector<at::Tensor> v{t};
    auto w = call("send", [&] { return pg().send(v, dst, tag); });
    return Work(std::make_shared<C10dWork>(std::move(w), shared_from_this(), "send", false));
  }

  Work irecv(const at::Tensor& t, std::optional<int> src, int tag) override {
    std::vector<at::Tensor> v{t};
    auto w =
        call("recv", [&] { return src ? pg().recv(v, *src, tag) : pg().recvAnysource(v, tag); });
    return Work(std::make_shared<C10dWork>(std::move(w), shared_from_this(), "recv", true));
  }

  /// Waits for `w` until `deadline`: false when it passed first (the work goes on);
  /// rethrows Gloo's failure as RankLostError naming the group, the operation and, when it
  /// can tell, the member of this host whose process is gone.
  bool wait(const C10dWorkPtr& w, const Deadline& deadline, const std::string& what) const {
    std::chrono::milliseconds ms{0};  // c10d's kNoTimeout
    if (deadline) {
      // Rounded up: a wait that timed out has reached the deadline (checked below).
      ms = std::max(std::chrono::milliseconds(1),
                    std::chrono::ceil<std::chrono::milliseconds>(*deadline - SteadyClock::now()));
    }
    try {
      w->wait(ms);
      return true;
    } catch (const std::exception& e) {
      if (deadline && !w->isCompleted() && SteadyClock::now() >= *deadline) return false;
      // Give a dying peer's process a moment to be reaped, then name it.
      int first = -1;
      std::string lost = lost_ranks_after_grace(&first);
      throw RankLostError(first, fmt::format("{}: gloo {} failed{}: {}", name(), what,
                                             lost.empty() ? "" : " (" + lost + ")", message_of(e)));
    }
  }

  /// "rank 1 (pid 123) is gone" for members on this host whose process ended.
  std::string lost_ranks(int* first) const {
    std::string out;
    for (int q = 0; q < size(); ++q) {
      const auto& m = members_[static_cast<size_t>(q)];
      if (q == rank() || m.host != host_ || m.pid <= 0) continue;
      if (!pid_alive(m.pid)) {
        if (out.empty()) *first = q;
        out += fmt::format("{}rank {} (pid {}) is gone", out.empty() ? "" : ", ", q, m.pid);
      }
    }
    return out;
  }

 private:
  c10d::ProcessGroupGloo& pg() const {
    if (!pg_) throw ClosedError(fmt::format("{}: the group was destroyed", name()));
    return *pg_;
  }

  template <class F>
  C10dWorkPtr call(const char* what, F&& f) {
    try {
      return f();
    } catch (const torchpar::Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(fmt::format("{}: gloo {}: {}", name(), what, message_of(e)));
    }
  }

  /// Runs one collective synchronously: TimeoutError after `timeout` (RankLostError when a
  /// member of this host is gone by then). The timed-out work goes on inside Gloo until
  /// Gloo's own limit; the group is not usable after it.
  template <class F>
  void run(const char* what, std::chrono::duration<double> timeout, F&& f) {
    const Deadline deadline = deadline_after(timeout);
    if (wait(call(what, std::forward<F>(f)), deadline, what)) return;
    int first = -1;
    const std::string lost = lost_ranks(&first);
    if (!lost.empty()) {
      throw RankLostError(first, fmt::format("{}: gloo {} did not finish within {:.1f} s ({})",
                                             name(), what, timeout.count(), lost));
    }
    throw TimeoutError(
        fmt::format("{}: gloo {} did not finish within {:.1f} s", name(), what, timeout.count()));
  }

  /// lost_ranks, asked again for up to 200 ms while it finds nobody.
  std::string lost_ranks_after_grace(int* first) const {
    std::string lost = lost_ranks(first);
    for (int i = 0; i < 10 && lost.empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      lost = lost_ranks(first);
    }
    return lost;
  }

  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  std::vector<MemberInfo> members_;
  std::string host_;
};

bool C10dWork::wait_until(const Deadline& deadline) { return group_->wait(w_, deadline, what_); }

}  // namespace

void set_gloo_sequence_number(GroupBackend& backend) {
  static_cast<GlooBackend&>(backend).set_sequence_number();
}

std::shared_ptr<GroupBackend> create_gloo_backend(const GlooBackendOptions& options) {
  return std::make_shared<GlooBackend>(options);
}

}  // namespace torchpar::detail
