#include "dist/backend/gloo/backend.h"

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <thread>

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

/// The collectives, as a rank announces them to the others before Gloo moves any data.
enum class Op : int64_t {
  kAllReduce,
  kAllGather,
  kBroadcast,
  kReduce,
  kGather,
  kScatter,
  kReduceScatter,
  kAllToAll,
  kBarrier
};

const char* op_name(int64_t op) {
  static constexpr const char* kNames[] = {"all_reduce",     "all_gather", "broadcast",
                                           "reduce",         "gather",     "scatter",
                                           "reduce_scatter", "all_to_all", "barrier"};
  return op >= 0 && op < 9 ? kNames[op] : "?";
}

/// What one rank calls: every rank must call the same for Gloo to run it (Gloo's transport
/// thread terminates the process on a message of another size than the one it expects).
struct Signature {
  Op op = Op::kBarrier;
  at::ScalarType dtype = at::kByte;
  int64_t numel = 0;  // per tensor (per list element for list operations)
  int root = -1;      // src/dst, -1 when none
  ReduceOp reduce = ReduceOp::kSum;
};

/// The signature's row in the exchange: op, dtype, numel, root, reduce op, call number.
constexpr int64_t kSigFields = 6;

std::string describe(const int64_t* row) {
  if (row[0] == static_cast<int64_t>(Op::kBarrier)) return "barrier()";
  return fmt::format("{}(dtype {}, numel {}, root {}, op {})", op_name(row[0]),
                     c10::toString(static_cast<at::ScalarType>(row[1])), row[2], row[3],
                     to_string(static_cast<ReduceOp>(row[4])));
}

/// Gloo's own timeout error ("Timed out waiting 2000ms for recv operation to complete"), or
/// c10d's ("Operation timed out!").
bool gloo_timed_out(const std::string& msg) {
  return msg.find("Timed out") != std::string::npos || msg.find("timed out") != std::string::npos;
}

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
      : GroupBackend(o.group.rank, o.group.world_ranks, o.group.timeout, o.group.name),
        members_(o.members),
        host_(o.my_host) {
    const auto& device = o.device;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(o.group.timeout);
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
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(o.group.store, o.group.rank, size(), opts);
    } catch (const std::exception& e) {
      throw Error(fmt::format("{}: cannot connect the gloo group within {:.1f} s: {}", name(),
                              o.group.timeout.count(), message_of(e)));
    }
  }

  Backend kind() const override { return Backend::kGloo; }
  void destroy() override { pg_.reset(); }
  /// As torch.distributed does once a group exists: rank 0 sets, the others read it. The
  /// group then talks Gloo's protocol only, as Python ranks do: no exchange of the calls
  /// before each collective (a disagreement is Gloo's to find, as in torch.distributed).
  void set_sequence_number() {
    pg().setSequenceNumberForGroup();
    python_compatible_ = true;
  }

  // Each collective hands the work to ProcessGroupGloo (its own threads run it) and waits
  // for it with the call's timeout. Gloo's own limit (the group's timeout) still applies.

  void all_reduce(const at::Tensor& t, const ReduceCallOptions& o) override {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(o.op);
    run({Op::kAllReduce, t.scalar_type(), t.numel(), -1, o.op}, o.timeout,
        [&] { return pg().allreduce(v, opts); });
  }

  void all_gather(const std::vector<at::Tensor>& out, const at::Tensor& in,
                  const CallOptions& o) override {
    std::vector<std::vector<at::Tensor>> outs{out};
    std::vector<at::Tensor> ins{in};
    run({Op::kAllGather, in.scalar_type(), in.numel()}, o.timeout,
        [&] { return pg().allgather(outs, ins); });
  }

  void broadcast(const at::Tensor& t, int src, const CallOptions& o) override {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    run({Op::kBroadcast, t.scalar_type(), t.numel(), src}, o.timeout,
        [&] { return pg().broadcast(v, opts); });
  }

  void reduce(const at::Tensor& t, int dst, const ReduceCallOptions& o) override {
    std::vector<at::Tensor> v{t};
    c10d::ReduceOptions opts;
    opts.reduceOp = to_c10d(o.op);
    opts.rootRank = dst;
    run({Op::kReduce, t.scalar_type(), t.numel(), dst, o.op}, o.timeout,
        [&] { return pg().reduce(v, opts); });
  }

  void gather(const at::Tensor& in, const std::vector<at::Tensor>& out, int dst,
              const CallOptions& o) override {
    std::vector<std::vector<at::Tensor>> outs;
    if (rank() == dst) outs.push_back(out);
    std::vector<at::Tensor> ins{in};
    c10d::GatherOptions opts;
    opts.rootRank = dst;
    run({Op::kGather, in.scalar_type(), in.numel(), dst}, o.timeout,
        [&] { return pg().gather(outs, ins, opts); });
  }

  void scatter(const at::Tensor& out, const std::vector<at::Tensor>& in, int src,
               const CallOptions& o) override {
    std::vector<at::Tensor> outs{out};
    std::vector<std::vector<at::Tensor>> ins;
    if (rank() == src) ins.push_back(in);
    c10d::ScatterOptions opts;
    opts.rootRank = src;
    run({Op::kScatter, out.scalar_type(), out.numel(), src}, o.timeout,
        [&] { return pg().scatter(outs, ins, opts); });
  }

  // Gloo (LibTorch 1.13) has no reduce_scatter: all_reduce the concatenation, keep our part.
  void reduce_scatter(const at::Tensor& out, const std::vector<at::Tensor>& in,
                      const ReduceCallOptions& o) override {
    std::vector<at::Tensor> flat;
    for (const auto& t : in) flat.push_back(t.reshape({-1}));
    std::vector<at::Tensor> v{at::cat(flat)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(o.op);
    run({Op::kReduceScatter, out.scalar_type(), out.numel(), -1, o.op}, o.timeout,
        [&] { return pg().allreduce(v, opts); });
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
    run({Op::kAllToAll, src.scalar_type(), in.front().numel()}, o.timeout,
        [&] { return pg().alltoall_base(dst, src, out_splits, in_splits); });
    int64_t off = 0;
    for (const auto& t : out) {
      t.view({-1}).copy_(dst.narrow(0, off, t.numel()));
      off += t.numel();
    }
  }

  // The signatures' exchange waits for every rank: it is the barrier.
  void barrier(const CallOptions& o) override {
    const Deadline deadline = deadline_after(o.timeout);
    ++calls_;
    if (!python_compatible_) {
      agree({}, deadline, o.timeout);
      return;
    }
    if (!wait(call("barrier", [&] { return pg().barrier(); }), deadline, "barrier")) {
      timed_out("barrier", o.timeout);
    }
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
      // c10d's own wait ended ("Operation timed out!", which may come a little before our
      // clock says the deadline passed): the work itself has not failed.
      if (deadline && !w->isCompleted()) return false;
      // Give a dying peer's process a moment to be reaped, then name it.
      int first = -1;
      const std::string lost = lost_ranks_after_grace(&first);
      const std::string msg = message_of(e);
      if (!lost.empty()) {
        throw RankLostError(first,
                            fmt::format("{}: gloo {} failed ({}): {}", name(), what, lost, msg));
      }
      // One error per event: a member that is alive but stopped answering makes every other
      // member time out, whether its own Gloo timer fired first or a peer's, which then
      // closed its connections. A closed connection is a lost rank only when its process
      // may be gone (a member on another host: no pid to look at).
      if (gloo_timed_out(msg)) {
        throw TimeoutError(fmt::format("{}: gloo {} timed out: {}", name(), what, msg));
      }
      if (every_member_here()) {
        throw TimeoutError(
            fmt::format("{}: gloo {} failed while every member's process is alive (a member "
                        "timed out or left the group): {}",
                        name(), what, msg));
      }
      throw RankLostError(-1, fmt::format("{}: gloo {} failed: {}", name(), what, msg));
    }
  }

  /// True when every member is on this host with a known pid (lost_ranks sees them all).
  bool every_member_here() const {
    for (const auto& m : members_) {
      if (m.host != host_ || m.pid <= 0) return false;
    }
    return !members_.empty();
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

  /// Runs one collective synchronously: first every rank's signature against the others'
  /// (agree), then the operation; TimeoutError after `timeout` (RankLostError when a member
  /// of this host is gone by then). The timed-out work goes on inside Gloo until Gloo's own
  /// limit; the group is not usable after it.
  template <class F>
  void run(const Signature& sig, std::chrono::duration<double> timeout, F&& f) {
    const Deadline deadline = deadline_after(timeout);
    ++calls_;
    if (!python_compatible_) agree(sig, deadline, timeout);
    const char* what = op_name(static_cast<int64_t>(sig.op));
    if (!wait(call(what, std::forward<F>(f)), deadline, what)) timed_out(what, timeout);
  }

  /// Exchanges this rank's signature with every rank's (a Gloo all_gather of fixed size,
  /// which cannot itself disagree) and throws torchpar::Error naming two ranks' calls when
  /// they differ: every rank sees the same table, so every rank raises, and no data moved
  /// (the group stays usable). Gloo has no such check: a size mismatch ended the process
  /// (gloo::EnforceNotMet on its transport thread).
  void agree(const Signature& sig, const Deadline& deadline,
             std::chrono::duration<double> timeout) {
    const char* what = op_name(static_cast<int64_t>(sig.op));
    at::Tensor mine = at::empty({kSigFields}, at::kLong);
    int64_t* m = mine.data_ptr<int64_t>();
    m[0] = static_cast<int64_t>(sig.op);
    m[1] = static_cast<int64_t>(sig.dtype);
    m[2] = sig.numel;
    m[3] = sig.root;
    m[4] = static_cast<int64_t>(sig.reduce);
    m[5] = calls_;
    at::Tensor all = at::empty({size(), kSigFields}, at::kLong);
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int q = 0; q < size(); ++q) outs[0].push_back(all[q]);
    std::vector<at::Tensor> ins{mine};
    if (!wait(call(what, [&] { return pg().allgather(outs, ins); }), deadline, what)) {
      timed_out(what, timeout);
    }
    const int64_t* rows = all.data_ptr<int64_t>();
    for (int q = 0; q < size(); ++q) {
      const int64_t* r = rows + q * kSigFields;
      if (std::equal(r, r + kSigFields - 1, m)) continue;
      throw Error(fmt::format(
          "{}: ranks disagree on call #{}: rank {} called {}, rank {} called {} (nothing was "
          "sent; the group stays usable)",
          name(), calls_, rank(), describe(m), q, describe(r)));
    }
  }

  /// The error of a call that did not finish by its deadline.
  [[noreturn]] void timed_out(const char* what, std::chrono::duration<double> timeout) const {
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
  int64_t calls_ = 0;  // collectives issued on this group (one thread at a time: the executor)
  bool python_compatible_ = false;  // set_sequence_number: Python ranks in the group
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
