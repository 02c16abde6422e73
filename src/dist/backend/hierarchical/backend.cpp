#include "dist/backend/hierarchical/backend.h"

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <optional>
#include <thread>

#include "core/futex.h"
#include "dist/backend/shm/backend_impl.h"
#include "dist/store.h"
#include "torchpar/core/error.h"

namespace torchpar::detail {

std::vector<std::vector<int>> hosts_of(const std::vector<MemberInfo>& members) {
  std::vector<std::vector<int>> hosts;
  std::vector<std::string> keys;
  for (size_t q = 0; q < members.size(); ++q) {
    const auto it = std::find(keys.begin(), keys.end(), members[q].host);
    if (it == keys.end()) {
      keys.push_back(members[q].host);
      hosts.push_back({static_cast<int>(q)});
    } else {
      hosts[static_cast<size_t>(it - keys.begin())].push_back(static_cast<int>(q));
    }
  }
  return hosts;
}

namespace {

/// The failure record: "<group rank or -1>|<kind: L, T or E>|<message>", set once per group.
constexpr const char* kAbortKey = "hier/abort";
/// Counts the members that tried to set the record: the first one sets it.
constexpr const char* kAbortCount = "hier/abort/count";
/// How long a member whose failure came from elsewhere waits for the record (the member
/// that saw the loss writes it within its liveness check, every 50 ms).
constexpr std::chrono::milliseconds kRecordGrace{2000};

enum class Level { kLocal, kLeaders };

using shm_backend::AbortKind;

/// What failed, in group ranks, and so what every member raises: RankLostError (kLost),
/// TimeoutError (kTimeout: a member is alive but did not come) or torchpar::Error (kError).
struct Failure {
  int lost = -1;  // group rank, -1 unknown
  AbortKind kind = AbortKind::kLost;
  std::string message;
};

char kind_letter(AbortKind k) {
  return k == AbortKind::kTimeout ? 'T' : k == AbortKind::kError ? 'E' : 'L';
}

std::string join(const std::vector<int>& v) { return fmt::format("{}", fmt::join(v, ",")); }

at::Tensor as_1d(const at::Tensor& t) { return t.view({-1}); }

class HierarchicalBackend final : public GroupBackend {
 public:
  explicit HierarchicalBackend(const HierarchicalBackendOptions& options)
      : GroupBackend(options.gloo.group.rank, options.gloo.group.world_ranks,
                     options.gloo.group.timeout, options.gloo.group.name),
        store_(options.gloo.group.store),
        members_(options.gloo.members),
        flat_(options.flat) {
    const GlooBackendOptions& o = options.gloo;
    if (!flat_) throw Error(fmt::format("{}: the hierarchical backend needs a flat group", name()));
    if (members_.size() != world_ranks().size()) {
      throw Error(fmt::format("{}: {} members for {} ranks", name(), members_.size(),
                              world_ranks().size()));
    }
    hosts_ = hosts_of(members_);
    host_of_.resize(members_.size());
    local_of_.resize(members_.size());
    for (size_t h = 0; h < hosts_.size(); ++h) {
      rows_ = std::max(rows_, static_cast<int64_t>(hosts_[h].size()));
      for (size_t i = 0; i < hosts_[h].size(); ++i) {
        host_of_[static_cast<size_t>(hosts_[h][i])] = static_cast<int>(h);
        local_of_[static_cast<size_t>(hosts_[h][i])] = static_cast<int>(i);
      }
    }
    my_host_ = host_of_[static_cast<size_t>(rank())];
    const auto& mine = hosts_[static_cast<size_t>(my_host_)];
    const int me = local_of_[static_cast<size_t>(rank())];
    if (mine.size() > 1) {
      std::vector<int> wr;
      for (int q : mine) wr.push_back(world_ranks()[static_cast<size_t>(q)]);
      local_ = std::make_shared<shm_backend::ShmBackend>(ShmBackendOptions{
          .group = {.store = c10::make_intrusive<c10d::PrefixStore>(
                        fmt::format("hier/local/{}", my_host_), store_),
                    .rank = me,
                    .world_ranks = wr,
                    .timeout = o.group.timeout,
                    .name = fmt::format("{} host {} (shm, world ranks [{}], local rank {})", name(),
                                        my_host_, join(wr), me)},
          .p2p = nullptr});
    }
    if (me == 0 && hosts_.size() > 1) {
      std::vector<int> wr;
      std::vector<MemberInfo> info;
      for (const auto& h : hosts_) {
        wr.push_back(world_ranks()[static_cast<size_t>(h[0])]);
        info.push_back(members_[static_cast<size_t>(h[0])]);
      }
      leaders_ = create_gloo_backend(
          {.group = {.store = c10::make_intrusive<c10d::PrefixStore>("hier/leaders", store_),
                     .rank = my_host_,
                     .world_ranks = wr,
                     .timeout = o.group.timeout,
                     .name = fmt::format("{} host leaders (gloo, world ranks [{}], leader {})",
                                         name(), join(wr), my_host_)},
           .device = o.device,
           .members = info,
           .my_host = o.my_host});
    }
  }

  ~HierarchicalBackend() override { destroy(); }

  Backend kind() const override { return Backend::kHierarchical; }

  void destroy() override {
    if (local_) local_->destroy();
    if (leaders_) leaders_->destroy();
    if (flat_) flat_->destroy();
    local_.reset();
    leaders_.reset();
    flat_.reset();
  }

  void all_reduce(const at::Tensor& t, const ReduceCallOptions& o) override {
    run("all_reduce", o.timeout, [&] {
      if (local_) loc().reduce(t, 0, left(o.op));
      if (leaders_) ldr().all_reduce(t, left(o.op));
      if (local_) loc().broadcast(t, 0, left());
    });
  }

  void broadcast(const at::Tensor& t, int src, const CallOptions& o) override {
    run("broadcast", o.timeout, [&] {
      const int root_host = host_of(src);
      if (my_host_ == root_host && local_) loc().broadcast(t, local_of(src), left());
      if (leaders_) ldr().broadcast(t, root_host, left());
      if (my_host_ != root_host && local_) loc().broadcast(t, 0, left());
    });
  }

  void reduce(const at::Tensor& t, int dst, const ReduceCallOptions& o) override {
    run("reduce", o.timeout, [&] {
      const int root_host = host_of(dst);
      if (local_) loc().reduce(t, 0, left(o.op));
      if (leaders_) ldr().reduce(t, root_host, left(o.op));
      // The result is on dst's leader; moving it to dst overwrites the other local ranks'
      // tensors, which reduce allows.
      if (my_host_ == root_host && local_of(dst) != 0 && local_) loc().broadcast(t, 0, left());
    });
  }

  void all_gather(const std::vector<at::Tensor>& out, const at::Tensor& in,
                  const CallOptions& o) override {
    run("all_gather", o.timeout, [&] {
      at::Tensor all = at::empty({host_count() * rows_, in.numel()}, in.options());
      at::Tensor mine = block(all, my_host_);
      gather_to_leader(in, mine);
      if (leaders_) ldr().all_gather(blocks(all), mine, left());
      if (local_) loc().broadcast(all, 0, left());
      unpack(all, out);
    });
  }

  void gather(const at::Tensor& in, const std::vector<at::Tensor>& out, int dst,
              const CallOptions& o) override {
    run("gather", o.timeout, [&] {
      const int root_host = host_of(dst);
      const bool on_root_host = my_host_ == root_host;
      at::Tensor all =
          at::empty({(on_root_host ? host_count() : 1) * rows_, in.numel()}, in.options());
      at::Tensor mine = block(all, on_root_host ? my_host_ : 0);
      gather_to_leader(in, mine);
      if (leaders_)
        ldr().gather(mine, on_root_host ? blocks(all) : std::vector<at::Tensor>{}, root_host,
                     left());
      if (!on_root_host) return;
      if (local_of(dst) != 0 && local_) loc().broadcast(all, 0, left());
      if (rank() == dst) unpack(all, out);
    });
  }

  void scatter(const at::Tensor& out, const std::vector<at::Tensor>& in, int src,
               const CallOptions& o) override {
    run("scatter", o.timeout, [&] {
      const int root_host = host_of(src);
      const bool on_root_host = my_host_ == root_host;
      // On the root's host the leader needs every input: src relays them when it is not
      // the leader itself.
      const bool relay = on_root_host && local_of(src) != 0;
      at::Tensor all;
      if (on_root_host && rank() == src)
        all = pack(in);
      else if (relay || (on_root_host && leader()))
        all = at::empty({host_count() * rows_, out.numel()}, out.options());
      if (relay && local_) loc().broadcast(all, local_of(src), left());
      at::Tensor mine =
          all.defined() ? block(all, my_host_) : at::empty({rows_, out.numel()}, out.options());
      if (leaders_)
        ldr().scatter(mine, on_root_host ? blocks(all) : std::vector<at::Tensor>{}, root_host,
                      left());
      scatter_from_leader(out, mine);
    });
  }

  void reduce_scatter(const at::Tensor& out, const std::vector<at::Tensor>& in,
                      const ReduceCallOptions& o) override {
    run("reduce_scatter", o.timeout, [&] {
      at::Tensor all = pack(in);
      if (local_) loc().reduce(all, 0, left(o.op));
      at::Tensor mine = block(all, my_host_);
      if (leaders_) {
        at::Tensor reduced = at::empty_like(mine);
        ldr().reduce_scatter(reduced, blocks(all), left(o.op));
        mine = reduced;
      }
      scatter_from_leader(out, mine);
    });
  }

  void all_to_all(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& in,
                  const CallOptions& o) override {
    throw_if_broken("all_to_all");
    flat().all_to_all(out, in, o);
  }

  void barrier(const CallOptions& o) override {
    run("barrier", o.timeout, [&] {
      if (local_) loc().barrier(left());
      if (leaders_) ldr().barrier(left());
      if (local_) loc().barrier(left());
    });
  }

  Work isend(const at::Tensor& t, int dst, int tag) override { return flat().isend(t, dst, tag); }
  Work irecv(const at::Tensor& t, std::optional<int> src, int tag) override {
    return flat().irecv(t, src, tag);
  }

 private:
  int host_count() const { return static_cast<int>(hosts_.size()); }
  int host_of(int q) const { return host_of_[static_cast<size_t>(q)]; }
  int local_of(int q) const { return local_of_[static_cast<size_t>(q)]; }
  bool leader() const { return local_of(rank()) == 0; }
  int local_size() const { return static_cast<int>(hosts_[static_cast<size_t>(my_host_)].size()); }

  // The levels; each call notes which one runs, for naming a lost rank.
  GroupBackend& loc() {
    level_ = Level::kLocal;
    return *local_;
  }
  GroupBackend& ldr() {
    level_ = Level::kLeaders;
    return *leaders_;
  }
  GroupBackend& flat() const {
    if (!flat_) throw ClosedError(fmt::format("{}: the group was destroyed", name()));
    return *flat_;
  }

  /// Host h's block of `all` (rows_ rows of one input each): a contiguous view.
  at::Tensor block(const at::Tensor& all, int h) const { return all.narrow(0, h * rows_, rows_); }
  std::vector<at::Tensor> blocks(const at::Tensor& all) const {
    std::vector<at::Tensor> v;
    for (int h = 0; h < host_count(); ++h) v.push_back(block(all, h));
    return v;
  }
  /// The rows of `blk` that hold this host's local ranks.
  std::vector<at::Tensor> rows(const at::Tensor& blk) const {
    std::vector<at::Tensor> v;
    for (int i = 0; i < local_size(); ++i) v.push_back(blk.select(0, i));
    return v;
  }
  /// One row per group rank q at (host_of(q), local_of(q)); padding rows are zero.
  at::Tensor pack(const std::vector<at::Tensor>& in) const {
    const int64_t n = in.front().numel();
    const bool padded = host_count() * rows_ != size();
    at::Tensor all = padded ? at::zeros({host_count() * rows_, n}, in.front().options())
                            : at::empty({host_count() * rows_, n}, in.front().options());
    for (int q = 0; q < size(); ++q) all[host_of(q) * rows_ + local_of(q)].copy_(as_1d(in[q]));
    return all;
  }
  void unpack(const at::Tensor& all, const std::vector<at::Tensor>& out) const {
    for (int q = 0; q < size(); ++q) as_1d(out[q]).copy_(all[host_of(q) * rows_ + local_of(q)]);
  }
  /// The host's inputs into the leader's `blk`, row i from local rank i.
  void gather_to_leader(const at::Tensor& in, const at::Tensor& blk) {
    if (local_)
      loc().gather(as_1d(in), leader() ? rows(blk) : std::vector<at::Tensor>{}, 0, left());
    else
      blk[0].copy_(as_1d(in));
  }
  /// Row i of the leader's `blk` to local rank i's `out`.
  void scatter_from_leader(const at::Tensor& out, const at::Tensor& blk) {
    if (local_)
      loc().scatter(as_1d(out), leader() ? rows(blk) : std::vector<at::Tensor>{}, 0, left());
    else
      as_1d(out).copy_(blk[0]);
  }

  /// What is left of the current operation's time, as a level's call options.
  CallOptions left() const { return CallOptions{.timeout = remaining()}; }
  ReduceCallOptions left(ReduceOp op) const {
    return ReduceCallOptions{.op = op, .timeout = remaining()};
  }
  std::chrono::duration<double> remaining() const {
    const auto r = std::chrono::duration<double>(deadline_ - SteadyClock::now());
    if (r.count() <= 0) {
      throw TimeoutError(
          fmt::format("{}: {} did not finish within {:.1f} s", name(), op_, op_timeout_.count()));
    }
    return r;
  }

  void throw_if_broken(const char* what) const {
    if (!flat_) throw ClosedError(fmt::format("{}: the group was destroyed", name()));
    if (broken_) {
      const std::string msg =
          fmt::format("{}: {}: the group is broken: {}", name(), what, broken_->message);
      raise(*broken_, msg);
    }
  }

  /// Runs one composed operation; a failure on any level breaks the group (see fail).
  template <class F>
  void run(const char* what, std::chrono::duration<double> timeout, F&& f) {
    throw_if_broken(what);
    op_ = what;
    op_timeout_ = timeout;
    deadline_ = SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(timeout);
    try {
      f();
    } catch (const ClosedError&) {
      throw;
    } catch (const TimeoutError& e) {
      fail(e, AbortKind::kTimeout, -1);
    } catch (const RankLostError& e) {
      fail(e, AbortKind::kLost, e.rank());
    } catch (const Error& e) {
      fail(e, AbortKind::kError, -1);
    } catch (const std::exception& e) {
      fail(Error(message_of(e)), AbortKind::kError, -1);
    }
  }

  /// "group rank 3 (world rank 3, host 1, pid 812)".
  std::string describe(int q) const {
    const auto& m = members_[static_cast<size_t>(q)];
    return fmt::format("group rank {} (world rank {}, host {}, pid {})", q,
                       world_ranks()[static_cast<size_t>(q)], host_of(q), m.pid);
  }

  /// Throws `msg` as the error `f` stands for.
  [[noreturn]] static void raise(const Failure& f, const std::string& msg) {
    if (f.kind == AbortKind::kTimeout) throw TimeoutError(msg);
    if (f.kind == AbortKind::kError) throw Error(msg);
    throw RankLostError(f.lost, msg);
  }

  /// The first failure of the group, as some member published it (nullopt: none within
  /// `grace`, or the store did not answer: every store call here is bounded by fail's
  /// StoreDeadline).
  std::optional<Failure> read_record(std::chrono::milliseconds grace) const {
    const auto until = SteadyClock::now() + grace;
    for (;;) {
      try {
        if (store_->check({kAbortKey})) {
          const std::string v = store_string(store_->get(kAbortKey));
          const auto bar = v.find('|');
          if (bar == std::string::npos || bar + 2 >= v.size() || v[bar + 2] != '|') {
            return Failure{-1, AbortKind::kLost, v};
          }
          const char k = v[bar + 1];
          return Failure{std::stoi(v.substr(0, bar)),
                         k == 'T'   ? AbortKind::kTimeout
                         : k == 'E' ? AbortKind::kError
                                    : AbortKind::kLost,
                         v.substr(bar + 3)};
        }
      } catch (...) {  // the store's host may be the rank that was lost, or stopped
        return std::nullopt;
      }
      if (SteadyClock::now() >= until) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  /// Publishes `f` unless another member did first; returns the record that holds.
  Failure publish(const Failure& f) const {
    try {
      if (store_->add(kAbortCount, 1) == 1) {
        store_->set(kAbortKey,
                    store_bytes(fmt::format("{}|{}|{}", f.lost, kind_letter(f.kind), f.message)));
        return f;
      }
    } catch (...) {  // the store is gone or stopped: this member reports what it saw
      return f;
    }
    return read_record(kRecordGrace).value_or(f);
  }

  /// Turns a level's failure into the group's: names the lost rank by its group rank (from
  /// this member's view, or from the record of the member that saw it), breaks the levels
  /// this member belongs to so their other members fail at once, and throws the record's
  /// error: RankLostError, TimeoutError (a member is alive but did not come) or
  /// torchpar::Error (the members disagree). The first failure published holds, so every
  /// member raises the same error for one event.
  /// Bounded: the record lives in rank 0's store, and a stopped rank 0 answers nothing and
  /// closes nothing; every store call here ends within min(the operation's timeout,
  /// kRecordGrace), after which this member reports what it saw itself.
  [[noreturn]] void fail(const Error& e, AbortKind kind, int level_rank) {
    const Level level = level_;
    const std::string inner = e.what_without_backtrace();
    const StoreDeadline bounded(
        SteadyClock::now() +
        std::chrono::duration_cast<SteadyClock::duration>(std::min(
            op_timeout_, std::chrono::duration_cast<std::chrono::duration<double>>(kRecordGrace))));
    int lost = -1;
    if (level_rank >= 0) {
      lost = level == Level::kLocal
                 ? hosts_[static_cast<size_t>(my_host_)][static_cast<size_t>(level_rank)]
                 : hosts_[static_cast<size_t>(level_rank)][0];
    }
    Failure f;
    if (lost >= 0) {
      // This member saw the loss itself.
      f = publish({lost, AbortKind::kLost, fmt::format("{} is lost: {}", describe(lost), inner)});
    } else if (auto r = read_record(kind == AbortKind::kTimeout ? std::chrono::milliseconds(0)
                                                                : kRecordGrace)) {
      // Broken from elsewhere (a local abort, a leader's gloo group closed): its cause.
      f = *r;
    } else {
      f = publish({-1, kind, inner});
    }
    broken_ = f;
    if (local_) local_->abort(-1, f.message, f.kind);
    // A leader's gloo group with no operation pending is closed, so the other leaders' gloo
    // operations fail now (their peer's connections close) rather than at their timeout.
    if (leaders_ && level != Level::kLeaders) leaders_->destroy();
    raise(f, fmt::format("{}: {} failed: {}", name(), op_, f.message));
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::vector<MemberInfo> members_;
  std::vector<std::vector<int>> hosts_;  // group ranks per host; [0] leads
  std::vector<int> host_of_;             // by group rank
  std::vector<int> local_of_;            // by group rank: index in its host
  int64_t rows_ = 1;                     // the most ranks any host holds
  int my_host_ = 0;
  std::shared_ptr<shm_backend::ShmBackend> local_;  // null when this host holds one rank
  std::shared_ptr<GroupBackend> leaders_;           // on leaders of a multi-host group
  std::shared_ptr<GroupBackend> flat_;              // every member: all_to_all, send/recv
  // The current operation (one at a time: CollectiveGroup's executor).
  Level level_ = Level::kLocal;
  const char* op_ = "?";
  std::chrono::duration<double> op_timeout_{0};
  SteadyClock::time_point deadline_{};
  std::optional<Failure> broken_;
};

}  // namespace

std::shared_ptr<GroupBackend> create_hierarchical_backend(
    const HierarchicalBackendOptions& options) {
  return std::make_shared<HierarchicalBackend>(options);
}

}  // namespace torchpar::detail
