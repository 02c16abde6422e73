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
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      return c10d::ReduceOp::SUM;
    case ReduceOp::PRODUCT:
      return c10d::ReduceOp::PRODUCT;
    case ReduceOp::MIN:
      return c10d::ReduceOp::MIN;
    case ReduceOp::MAX:
      return c10d::ReduceOp::MAX;
  }
  return c10d::ReduceOp::SUM;
}

using C10dWorkPtr = c10::intrusive_ptr<c10d::Work>;

class GlooBackend;

/// A c10d Work; errors are re-thrown as torchpar errors naming the group and, when it can
/// tell, the rank that went away. It owns its backend: the group may be destroyed while the
/// work is pending, and the error path still reads the backend's members.
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

  Backend kind() const override { return Backend::Gloo; }
  void destroy() override { pg_.reset(); }
  /// As torch.distributed does once a group exists: rank 0 sets, the others read it.
  void set_sequence_number() { pg().setSequenceNumberForGroup(); }

  Work all_reduce(at::Tensor t, ReduceOp op, bool) override {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    auto w = wrap(call("all_reduce", [&] { return pg().allreduce(v, o); }), "all_reduce");
    if (op == ReduceOp::AVG) w->add_then([t, n = size()] { t.div_(n); });
    return Work(w);
  }

  Work all_gather(std::vector<at::Tensor> out, at::Tensor in, bool) override {
    std::vector<std::vector<at::Tensor>> o{std::move(out)};
    std::vector<at::Tensor> i{in};
    return Work(wrap(call("all_gather", [&] { return pg().allgather(o, i); }), "all_gather"));
  }

  Work broadcast(at::Tensor t, int src, bool) override {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = src;
    return Work(wrap(call("broadcast", [&] { return pg().broadcast(v, o); }), "broadcast"));
  }

  Work reduce(at::Tensor t, int dst, ReduceOp op, bool) override {
    std::vector<at::Tensor> v{t};
    c10d::ReduceOptions o;
    o.reduceOp = to_c10d(op);
    o.rootRank = dst;
    auto w = wrap(call("reduce", [&] { return pg().reduce(v, o); }), "reduce");
    if (op == ReduceOp::AVG && rank() == dst) w->add_then([t, n = size()] { t.div_(n); });
    return Work(w);
  }

  Work gather(at::Tensor in, std::vector<at::Tensor> out, int dst, bool) override {
    std::vector<std::vector<at::Tensor>> o;
    if (rank() == dst) o.push_back(std::move(out));
    std::vector<at::Tensor> i{in};
    c10d::GatherOptions opt;
    opt.rootRank = dst;
    return Work(wrap(call("gather", [&] { return pg().gather(o, i, opt); }), "gather"));
  }

  Work scatter(at::Tensor out, std::vector<at::Tensor> in, int src, bool) override {
    std::vector<at::Tensor> o{out};
    std::vector<std::vector<at::Tensor>> i;
    if (rank() == src) i.push_back(std::move(in));
    c10d::ScatterOptions opt;
    opt.rootRank = src;
    return Work(wrap(call("scatter", [&] { return pg().scatter(o, i, opt); }), "scatter"));
  }

  // Gloo (LibTorch 1.13) has no reduce_scatter: all_reduce the concatenation, keep our part.
  Work reduce_scatter(at::Tensor out, std::vector<at::Tensor> in, ReduceOp op, bool) override {
    std::vector<at::Tensor> flat;
    for (auto& t : in) flat.push_back(t.reshape({-1}));
    std::vector<at::Tensor> v{at::cat(flat)};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    auto w = wrap(call("reduce_scatter", [&] { return pg().allreduce(v, o); }), "reduce_scatter");
    const int64_t n = out.numel();
    w->add_then([out, all = v[0], n, r = rank(), avg = op == ReduceOp::AVG, P = size()] {
      out.view({-1}).copy_(all.narrow(0, r * n, n));
      if (avg) out.div_(P);
    });
    return Work(w);
  }

  Work all_to_all(std::vector<at::Tensor> out, std::vector<at::Tensor> in, bool) override {
    std::vector<at::Tensor> flat;
    std::vector<int64_t> in_splits, out_splits;
    for (auto& t : in) {
      flat.push_back(t.reshape({-1}));
      in_splits.push_back(t.numel());
    }
    int64_t total = 0;
    for (auto& t : out) {
      out_splits.push_back(t.numel());
      total += t.numel();
    }
    at::Tensor src = at::cat(flat);
    at::Tensor dst = at::empty({total}, src.options());
    auto w = wrap(
        call("all_to_all", [&] { return pg().alltoall_base(dst, src, out_splits, in_splits); }),
        "all_to_all");
    w->add_then([out, dst, src] {
      int64_t off = 0;
      for (auto& t : out) {
        t.view({-1}).copy_(dst.narrow(0, off, t.numel()));
        off += t.numel();
      }
    });
    return Work(w);
  }

  Work barrier(bool) override {
    return Work(wrap(call("barrier", [&] { return pg().barrier(); }), "barrier"));
  }

  Work isend(at::Tensor t, int dst, int tag) override {
    std::vector<at::Tensor> v{t};
    return Work(wrap(call("send", [&] { return pg().send(v, dst, tag); }), "send"));
  }

  Work irecv(at::Tensor t, std::optional<int> src, int tag) override {
    std::vector<at::Tensor> v{t};
    auto w =
        call("recv", [&] { return src ? pg().recv(v, *src, tag) : pg().recvAnysource(v, tag); });
    return Work(std::make_shared<C10dWork>(std::move(w), shared_from_this(), "recv", true));
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

  std::shared_ptr<C10dWork> wrap(C10dWorkPtr w, const char* what) {
    return std::make_shared<C10dWork>(std::move(w), shared_from_this(), what, false);
  }

  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  std::vector<MemberInfo> members_;
  std::string host_;
};

bool C10dWork::wait_until(const Deadline& deadline) {
  std::chrono::milliseconds ms{0};  // c10d's kNoTimeout
  if (deadline) {
    ms = std::max(
        std::chrono::milliseconds(1),
        std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - SteadyClock::now()));
  }
  try {
    w_->wait(ms);
    return true;
  } catch (const std::exception& e) {
    if (deadline && !w_->isCompleted() && SteadyClock::now() >= *deadline) return false;
    // Give a dying peer's process a moment to be reaped, then name it.
    int first = -1;
    std::string lost = group_->lost_ranks(&first);
    for (int i = 0; i < 10 && lost.empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      lost = group_->lost_ranks(&first);
    }
    throw RankLostError(first, fmt::format("{}: gloo {} failed{}: {}", group_->name(), what_,
                                           lost.empty() ? "" : " (" + lost + ")", message_of(e)));
  }
}

}  // namespace

void set_gloo_sequence_number(GroupBackend& backend) {
  static_cast<GlooBackend&>(backend).set_sequence_number();
}

std::shared_ptr<GroupBackend> create_gloo_backend(const GlooBackendOptions& options) {
  return std::make_shared<GlooBackend>(options);
}

}  // namespace torchpar::detail
