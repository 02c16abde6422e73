// torchpar._distributed: the c10d process group "torchpar" (torchpar/distributed/__init__.py
// registers it with torch.distributed). It runs torch.distributed's collectives on torchpar's
// CollectiveGroup: shared memory among the ranks of one host, hierarchical (shm inside each
// host, Gloo between host leaders) across hosts, as Backend::kAuto decides. The group meets
// on the PrefixStore torch.distributed hands the creator (detail::create_collective_group).
//
// Thread model: c10d's Python bindings call the ops below with the GIL released. Every
// collective is queued to the process group's Worker, which runs the calls one at a time in
// issue order as synchronous CollectiveGroup calls (the group's contract: one thread at a
// time) and then completes each call's Work and, when one was asked for, its Future
// (callbacks such as DDP's comm-hook continuations run on the thread that ran the call). A
// call's Work is its queue entry; all_reduce with a SUM/AVG/PRODUCT/MIN/MAX op is a Work of
// its own (no closure), so a synchronous small all_reduce allocates one object here. The op returns
// at once with the Work, as with Gloo. A thread that waits for the call next in line runs it itself
// (no hand-over for a synchronous torch.distributed call); the worker thread takes calls nobody
// waits for (async_op, DDP's buckets through their Futures) at once when kicked, else within about
// a millisecond (Worker). send/recv go straight to the group's point-to-point path (Gloo unbound
// buffers), which never waits for collectives.
//
// Kept to one translation unit: LibTorch's c10d headers are heavy.
#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <Python.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dist/create_group.h"
#include "torchpar/core/error.h"
#include "torchpar/dist/collective_group.h"

namespace py = pybind11;

namespace torchpar::python {
namespace {

using Seconds = std::chrono::duration<double>;
using Tensors = std::vector<at::Tensor>;

constexpr const char* kName = "torchpar";

/// A c10d per-call timeout (kUnsetTimeout: none given) as torchpar's (nullopt: the group's).
Timeout call_timeout(std::chrono::milliseconds t) {
  if (t <= std::chrono::milliseconds(0)) return std::nullopt;
  return std::chrono::duration_cast<Seconds>(t);
}

/// The one tensor of a c10d tensor list (one per device; torchpar runs on one CPU device).
const at::Tensor& single(const Tensors& tensors, const char* op) {
  if (tensors.size() != 1) {
    throw ValueError(
        fmt::format("torchpar process group: {} takes exactly one tensor (one CPU device); got {}",
                    op, tensors.size()));
  }
  return tensors[0];
}

/// torch.distributed's reduction as torchpar's; nullopt for the bitwise ones (BAND, BOR,
/// BXOR), which fold_bitwise computes from gathered tensors.
std::optional<ReduceOp> reduce_op_of(const c10d::ReduceOp& op, const at::Tensor& t,
                                     const char* where) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return ReduceOp::kSum;
    case c10d::ReduceOp::AVG:
      return ReduceOp::kAvg;
    case c10d::ReduceOp::PRODUCT:
      return ReduceOp::kProduct;
    case c10d::ReduceOp::MIN:
      return ReduceOp::kMin;
    case c10d::ReduceOp::MAX:
      return ReduceOp::kMax;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      if (!at::isIntegralType(t.scalar_type(), /*includeBool=*/true)) {
        throw ValueError(fmt::format(
            "torchpar process group: {} with a bitwise ReduceOp (BAND, BOR, BXOR) needs an "
            "integer or bool tensor; got {}",
            where, c10::toString(t.scalar_type())));
      }
      return std::nullopt;
    default:
      throw ValueError(fmt::format(
          "torchpar process group: {} does not support ReduceOp {} (PREMUL_SUM is NCCL's); "
          "use SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR",
          where, static_cast<int>(op.op_)));
  }
}

/// out = op over `parts` (BAND, BOR or BXOR), element-wise.
void fold_bitwise(const at::Tensor& out, const Tensors& parts, c10d::ReduceOp::RedOpType op) {
  at::Tensor acc = parts.at(0).clone();
  for (size_t i = 1; i < parts.size(); ++i) {
    if (op == c10d::ReduceOp::BAND) {
      acc.bitwise_and_(parts[i]);
    } else if (op == c10d::ReduceOp::BOR) {
      acc.bitwise_or_(parts[i]);
    } else {
      acc.bitwise_xor_(parts[i]);
    }
  }
  out.copy_(acc.view(out.sizes()));
}

/// `n` tensors shaped like `t` (for gathering into).
Tensors empties_like(const at::Tensor& t, int n) {
  Tensors out;
  for (int i = 0; i < n; ++i) out.push_back(at::empty_like(t, at::MemoryFormat::Contiguous));
  return out;
}

/// `flat` (contiguous) cut into `n` equal contiguous views of `flat.numel() / n` elements.
Tensors equal_parts(const at::Tensor& flat, int n, const char* op, const char* what) {
  if (n <= 0 || flat.numel() % n != 0) {
    throw ValueError(fmt::format(
        "torchpar process group: {}: {} has {} elements, not a multiple of the group size {}", op,
        what, flat.numel(), n));
  }
  return flat.reshape({-1}).split(flat.numel() / n);
}

/// `e` with the words c10d's timeouts carry ("Timed out"), which callers match (PyTorch's
/// distributed_test.py: " (Timed out|closed|timeout) ").
TimeoutError with_c10d_wording(const TimeoutError& e) {
  return TimeoutError(
      fmt::format("{}; Timed out waiting for the other ranks", e.what_without_backtrace()));
}

class Worker;

/// What a process group's queued calls share: each Work holds it, so the group outlives them.
struct GroupState {
  explicit GroupState(CollectiveGroup g);
  CollectiveGroup group;
  std::shared_ptr<Worker> worker;
};

/// Work of a collective and its queue entry at once: queued on the process group's Worker
/// and run once, by the worker thread or by the thread that waits for it. Completed (with
/// its outputs or an error) by the thread that ran it. Its Future, which holds the outputs as
/// a List[Tensor] (what DDP's reducer reads), is made only when asked for (getFuture), so a
/// synchronous call costs one allocation here: this object.
class CollectiveWork : public c10d::Work {
 public:
  CollectiveWork(int rank, c10d::OpType type, std::shared_ptr<GroupState> state,
                 Seconds group_timeout)
      : Work(rank, type), state_(std::move(state)), group_timeout_(group_timeout) {}

  /// Blocks until done; `timeout` 0 (kNoTimeout) waits as long as the operation may take
  /// (it ends at the group's timeout on its own). When the operation is next in line and
  /// nothing runs, this thread runs it (Worker::run_or_kick), to its end whatever `timeout`.
  /// Errors: the operation's; TimeoutError when `timeout` passes first (the operation goes
  /// on).
  bool wait(std::chrono::milliseconds timeout) override;

  std::vector<at::Tensor> result() override { return outputs(); }
  /// The Future completes on its own: the worker takes the operation at once.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  bool isCompleted() override;

  /// Runs the operation and completes the Work (then its Future, whose callbacks run here).
  /// Called once, by the Worker, on the thread it chose. The operation's errors go to the
  /// Work; a Future callback that throws (then() callbacks do not: their errors go to the
  /// next Future) ends the process, as on any thread of c10d's backends.
  void execute() noexcept;

 protected:
  /// The operation itself (synchronous CollectiveGroup calls).
  virtual void body(CollectiveGroup& g) = 0;
  /// The tensors the operation writes (result(), the Future's value).
  virtual Tensors outputs() const = 0;

 private:
  friend class Worker;

  /// Completes `future` with this Work's outcome.
  void complete_future(const c10::intrusive_ptr<c10::ivalue::Future>& future,
                       const std::exception_ptr& error);

  std::shared_ptr<GroupState> state_;
  Seconds group_timeout_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // under mutex_; made by getFuture
  // Under Worker::mu_:
  std::chrono::steady_clock::time_point submitted_{};
  bool queued_ = false;  // in the Worker's queue, not yet taken
  bool kicked_ = false;  // someone needs it run without waiting for it
};

using WorkPtr = c10::intrusive_ptr<CollectiveWork>;

/// The process group's worker thread: runs queued calls one at a time, in issue order.
///
/// Who runs a call: torch.distributed's synchronous calls are the op then Work.wait at once;
/// a thread that waits for a call which is next in line while nothing runs takes it and runs
/// it itself (run_or_kick), which saves the two thread hand-overs that are most of a small
/// collective's time (4 B all_reduce from Python, 2 ranks on 2 cores: ~4 us run by the
/// waiter, 20-50 us handed to a woken worker and back). The worker takes a call
///   - at once when it is kicked: its Future was asked for (DDP's reducer does so at once),
///     is_completed was asked, or a thread waits for a later call or a send/recv of the group;
///   - else kClaimDelay after it was queued, noticed by the worker's polling (every kPoll
///     while the group was used in the last kIdleAfter; a submit wakes a worker that sleeps
///     longer). So a call nobody waits for (async_op) starts within about kPoll, and a group
///     in steady use costs no wake-up per call.
/// Lifetime: stop() lets the queued calls finish (and one a waiting thread runs), then joins
/// the thread (or detaches it when called from the thread itself: a Future callback dropping
/// the last reference). Safety: thread-safe.
class Worker : public std::enable_shared_from_this<Worker> {
 public:
  static constexpr std::chrono::microseconds kClaimDelay{200};
  static constexpr std::chrono::milliseconds kPoll{1};
  static constexpr std::chrono::seconds kIdleAfter{1};

  /// Runs after the thread let go of the Worker (it holds it while it runs).
  ~Worker() {
    if (!thread_.joinable()) return;
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // the thread's last act: dropping its reference
    } else {
      thread_.join();
    }
  }

  /// Queues `work`. Errors: ClosedError after stop().
  void submit(WorkPtr work) {
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> g(mu_);
    if (stopped_) throw ClosedError("torchpar process group: used after it was destroyed");
    work->submitted_ = now;
    work->queued_ = true;
    queue_.push_back(std::move(work));
    last_used_ = now;
    if (!thread_.joinable()) {
      // The thread holds the Worker: it may outlive every other owner (stop() called from a
      // Future callback on this very thread detaches it, and it drains the queue alone).
      thread_ = std::thread([self = shared_from_this()] { self->loop(); });
    } else if (asleep_) {
      cv_.notify_all();
    }
  }

  /// For a thread about to wait for `work`: runs it here when it is queued, next in line and
  /// no call runs; else, when it is still queued, lets the worker take every queued call at
  /// once (`work` and the ones before it). Returns whether this thread ran it.
  bool run_or_kick(CollectiveWork* work) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!work->queued_) return false;  // taken (by the worker or a waiter), maybe done
    if (!running_ && queue_.front().get() == work) {
      WorkPtr taken = take_front();
      run(lk, std::move(taken));
      return true;
    }
    kick_locked();
    return false;
  }

  /// Lets the worker take every queued call at once.
  void kick() {
    std::lock_guard<std::mutex> g(mu_);
    kick_locked();
  }

  void stop() noexcept {
    std::unique_lock<std::mutex> lk(mu_);
    if (stopped_) return;
    stopped_ = true;
    cv_.notify_all();
    if (thread_.joinable()) {
      lk.unlock();
      if (thread_.get_id() == std::this_thread::get_id()) {
        thread_.detach();
        return;
      }
      thread_.join();
      lk.lock();
    }
    cv_.wait(lk, [&] { return !running_ && queue_.empty(); });
  }

 private:
  void kick_locked() {
    bool any = false;
    for (auto& w : queue_) any = !std::exchange(w->kicked_, true) || any;
    if (any) cv_.notify_all();
  }

  WorkPtr take_front() {
    WorkPtr w = std::move(queue_.front());
    queue_.pop_front();
    w->queued_ = false;
    return w;
  }

  /// Runs `work` with mu_ released; returns with it held. The reference to `work` is dropped
  /// before mu_ is taken again (it may be the last one, and the Work holds the group).
  void run(std::unique_lock<std::mutex>& lk, WorkPtr work) {
    running_ = true;
    lk.unlock();
    work->execute();  // never throws: the body's errors go to its Work
    work.reset();
    lk.lock();
    running_ = false;
    // last_used_ stays the last submit's: a call that ran past kIdleAfter lets the worker
    // sleep, and the next submit wakes it (no clock read per call here).
    // Wake only who needs it: the worker for queued calls, stop() at the end.
    if (!queue_.empty() || stopped_) cv_.notify_all();
  }

  void loop() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      if (!running_ && !queue_.empty()) {
        const CollectiveWork& front = *queue_.front();
        const auto claim_at = front.kicked_ || stopped_ ? now : front.submitted_ + kClaimDelay;
        if (now >= claim_at) {
          run(lk, take_front());
        } else {
          cv_.wait_until(lk, claim_at);
        }
        continue;
      }
      if (stopped_ && queue_.empty()) return;
      if (now - last_used_ < kIdleAfter) {
        cv_.wait_for(lk, kPoll);
      } else {
        asleep_ = true;
        cv_.wait(lk);
        asleep_ = false;
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<WorkPtr> queue_;
  std::chrono::steady_clock::time_point last_used_{};
  bool running_ = false;
  bool asleep_ = false;  // the worker waits without a limit: a submit must wake it
  bool stopped_ = false;
  std::thread thread_;
};

GroupState::GroupState(CollectiveGroup g)
    : group(std::move(g)), worker(std::make_shared<Worker>()) {}

bool CollectiveWork::wait(std::chrono::milliseconds timeout) {
  if (state_->worker->run_or_kick(this)) {
    // Ran on this thread, which wrote the outcome; nobody writes it any more (no lock).
    if (exception_) std::rethrow_exception(exception_);
    return true;
  }
  std::unique_lock<std::mutex> lk(mutex_);
  if (timeout == kNoTimeout) {
    cv_.wait(lk, [&] { return completed_; });
  } else if (!cv_.wait_for(lk, timeout, [&] { return completed_; })) {
    throw TimeoutError(
        fmt::format("torchpar process group: {} not finished within {:.3f} s of Work.wait (the "
                    "operation goes on; the group's own limit is {:.1f} s)",
                    c10d::opTypeToString(opType_), std::chrono::duration<double>(timeout).count(),
                    group_timeout_.count()));
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> CollectiveWork::getFuture() {
  static const c10::TypePtr kListOfTensors = c10::ListType::create(c10::TensorType::get());
  c10::intrusive_ptr<c10::ivalue::Future> future;
  bool done = false;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> g(mutex_);
    if (future_) return future_;  // the first call completes it or kicked the worker
    future_ = c10::make_intrusive<c10::ivalue::Future>(kListOfTensors);
    future = future_;
    done = completed_;
    error = exception_;
  }
  if (done) {
    complete_future(future, error);  // execute() found no Future to complete
  } else {
    state_->worker->kick();
  }
  return future;
}

bool CollectiveWork::isCompleted() {
  {
    std::lock_guard<std::mutex> g(mutex_);
    if (completed_) return true;
  }
  state_->worker->kick();  // polling for it: it must be under way
  return false;
}

void CollectiveWork::execute() noexcept {
  std::exception_ptr error;
  try {
    body(state_->group);
  } catch (const TimeoutError& e) {
    error = std::make_exception_ptr(with_c10d_wording(e));
  } catch (...) {
    error = std::current_exception();
  }
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::function<void()> end_record;
  {
    std::lock_guard<std::mutex> g(mutex_);
    completed_ = true;
    exception_ = error;
    future = future_;
    end_record = std::exchange(recordFunctionEndCallback_, nullptr);
  }
  cv_.notify_all();
  if (end_record) end_record();
  if (future) complete_future(future, error);
}

void CollectiveWork::complete_future(const c10::intrusive_ptr<c10::ivalue::Future>& future,
                                     const std::exception_ptr& error) {
  if (error) {
    future->setError(error);
  } else {
    future->markCompleted(c10::IValue(outputs()));
  }
}

/// all_reduce of one tensor with a reduction CollectiveGroup has (every ReduceOp but the
/// bitwise ones): no closure, the options converted once at the call.
class AllReduceWork final : public CollectiveWork {
 public:
  AllReduceWork(int rank, std::shared_ptr<GroupState> state, Seconds group_timeout,
                at::Tensor tensor, const ReduceOptions& options)
      : CollectiveWork(rank, c10d::OpType::ALLREDUCE, std::move(state), group_timeout),
        tensor_(std::move(tensor)),
        options_(options) {}

 protected:
  void body(CollectiveGroup& g) override { g.all_reduce(tensor_, options_); }
  Tensors outputs() const override { return {tensor_}; }

 private:
  at::Tensor tensor_;
  ReduceOptions options_;
};

/// Any other collective: its body a closure, dropped once it ran (with the inputs it holds).
class ClosureWork final : public CollectiveWork {
 public:
  using Body = std::function<void(CollectiveGroup&)>;

  ClosureWork(int rank, c10d::OpType type, std::shared_ptr<GroupState> state, Seconds group_timeout,
              Tensors outputs, Body body)
      : CollectiveWork(rank, type, std::move(state), group_timeout),
        outputs_(std::move(outputs)),
        body_(std::move(body)) {}

 protected:
  void body(CollectiveGroup& g) override {
    const Body run = std::move(body_);
    body_ = nullptr;
    run(g);
  }
  Tensors outputs() const override { return outputs_; }

 private:
  Tensors outputs_;
  Body body_;
};

/// Work of send / recv / recvAnysource: torchpar's point-to-point Work (Gloo's unbound
/// buffers complete on their own threads). wait(kNoTimeout) waits at most the group's
/// timeout, as Gloo's own send/recv do.
class PointToPointWork final : public c10d::Work {
 public:
  PointToPointWork(int rank, c10d::OpType type, torchpar::Work work, Tensors tensors,
                   Seconds group_timeout, std::string what, std::shared_ptr<Worker> worker)
      : Work(rank, type),
        worker_(std::move(worker)),
        work_(std::move(work)),
        tensors_(std::move(tensors)),
        group_timeout_(group_timeout),
        what_(std::move(what)) {}

  bool isCompleted() override { return work_.is_completed(); }
  bool isSuccess() const override {
    std::lock_guard<std::mutex> g(mutex_);
    return !exception_;
  }

  bool wait(std::chrono::milliseconds timeout) override {
    const Seconds limit =
        timeout == kNoTimeout ? group_timeout_ : std::chrono::duration_cast<Seconds>(timeout);
    // The peer may need a collective this rank queued first (posted, not yet waited for).
    worker_->kick();
    int source = -1;
    try {
      source = work_.wait(limit);
    } catch (const TimeoutError&) {
      throw TimeoutError(
          fmt::format("torchpar process group: {} did not finish within {:.3f} s; Timed out "
                      "waiting for the peer",
                      what_, limit.count()));
    } catch (...) {
      std::lock_guard<std::mutex> g(mutex_);
      exception_ = std::current_exception();
      completed_ = true;
      throw;
    }
    std::lock_guard<std::mutex> g(mutex_);
    source_ = source;
    completed_ = true;
    return true;
  }

  int sourceRank() const override {
    std::lock_guard<std::mutex> g(mutex_);
    return source_;
  }
  std::vector<at::Tensor> result() override { return tensors_; }

 private:
  std::shared_ptr<Worker> worker_;
  torchpar::Work work_;
  Tensors tensors_;
  Seconds group_timeout_;
  std::string what_;
  int source_ = -1;
};

/// The c10d process group "torchpar" over a CollectiveGroup.
///
/// Ranks are the group's (c10d's group ranks); tensors are CPU, one per call; non-contiguous
/// ones go through contiguous copies (CollectiveGroup). Dtypes: every real dtype, bool and
/// bfloat16 on shm (gloo: float16/32/64, int8, uint8, int32, int64). Errors reach the Work
/// (and its Future): RankLostError naming the rank that died, TimeoutError for a rank that
/// stopped, within the group's timeout; after one, the group is broken (later calls raise).
/// Argument errors (ValueError) raise at the call.
/// Lifetime: the destructor lets queued work finish, then destroys the group (connections,
/// shared memory).
class ProcessGroupTorchpar final : public c10d::ProcessGroup {
 public:
  ProcessGroupTorchpar(CollectiveGroup group, Seconds timeout)
      : ProcessGroup(group.rank(), group.size()),
        state_(std::make_shared<GroupState>(std::move(group))),
        timeout_(timeout) {
    init();
  }

  ~ProcessGroupTorchpar() override {
    // Python drops the last reference with the GIL held; Future callbacks of queued work may
    // need it.
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      shutdown();
    } else {
      shutdown();
    }
  }

  const std::string getBackendName() const override { return kName; }
  Backend collective_backend() const { return state_->group.backend(); }

  c10::intrusive_ptr<c10d::Work> broadcast(Tensors& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const at::Tensor t = single(tensors, "broadcast");
    const int root = static_cast<int>(opts.rootRank);
    const CollectiveOptions o{.timeout = call_timeout(opts.timeout)};
    return enqueue(c10d::OpType::BROADCAST, {t},
                   [t, root, o](CollectiveGroup& g) { g.broadcast(t, root, o); });
  }

  c10::intrusive_ptr<c10d::Work> allreduce(Tensors& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const at::Tensor& t = single(tensors, "allreduce");
    if (t.is_sparse()) {
      if (opts.reduceOp.op_ != c10d::ReduceOp::SUM) {
        throw ValueError("torchpar process group: all_reduce of a sparse tensor supports SUM only");
      }
      const Timeout to = call_timeout(opts.timeout);
      const int n = getSize();
      return enqueue(c10d::OpType::ALLREDUCE, {t},
                     [t, n, to](CollectiveGroup& g) { all_reduce_sparse(g, t, n, to); });
    }
    const Timeout to = call_timeout(opts.timeout);
    if (const auto op = reduce_op_of(opts.reduceOp, t, "allreduce")) {
      return submit(c10::make_intrusive<AllReduceWork>(getRank(), state_, timeout_, t,
                                                       ReduceOptions{.op = *op, .timeout = to}));
    }
    auto run = reducer(t, opts.reduceOp, to, "allreduce");
    return enqueue(c10d::OpType::ALLREDUCE, {t}, [t, run](CollectiveGroup& g) { run(g, t); });
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    if (tensors.empty())
      throw ValueError("torchpar process group: allreduce_coalesced of no tensors");
    const auto dtype = tensors[0].scalar_type();
    for (const auto& t : tensors) {
      if (t.scalar_type() != dtype) {
        throw ValueError(fmt::format(
            "torchpar process group: allreduce_coalesced needs one dtype; got {} and {}",
            c10::toString(dtype), c10::toString(t.scalar_type())));
      }
    }
    auto run =
        reducer(tensors[0], opts.reduceOp, call_timeout(opts.timeout), "allreduce_coalesced");
    Tensors ts = tensors;
    return enqueue(c10d::OpType::ALLREDUCE_COALESCED, ts, [ts, run](CollectiveGroup& g) {
      // One flat buffer: one collective for the lot.
      Tensors flat;
      for (const auto& t : ts) flat.push_back(t.reshape({-1}));
      at::Tensor all = at::cat(flat);
      run(g, all);
      int64_t at_elem = 0;
      for (const auto& t : ts) {
        t.copy_(all.narrow(0, at_elem, t.numel()).view(t.sizes()));
        at_elem += t.numel();
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce(Tensors& tensors,
                                        const c10d::ReduceOptions& opts) override {
    const at::Tensor t = single(tensors, "reduce");
    const int root = static_cast<int>(opts.rootRank);
    const Timeout to = call_timeout(opts.timeout);
    const auto op = reduce_op_of(opts.reduceOp, t, "reduce");
    const int n = getSize();
    const bool is_root = getRank() == root;
    const auto bitwise = opts.reduceOp.op_;
    return enqueue(c10d::OpType::REDUCE, {t}, [=](CollectiveGroup& g) {
      if (op) {
        g.reduce(t, root, {.op = *op, .timeout = to});
        return;
      }
      Tensors parts = is_root ? empties_like(t, n) : Tensors{};
      g.gather(t, parts, root, {.timeout = to});
      if (is_root) fold_bitwise(t, parts, bitwise);
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<Tensors>& outputs, Tensors& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    const at::Tensor t = single(inputs, "allgather");
    if (outputs.size() != 1) {
      throw ValueError("torchpar process group: allgather takes one output list (one device)");
    }
    const Tensors out = outputs[0];
    const CollectiveOptions o{.timeout = call_timeout(opts.timeout)};
    return enqueue(c10d::OpType::ALLGATHER, out,
                   [t, out, o](CollectiveGroup& g) { g.all_gather(out, t, o); });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    if (output.numel() != input.numel() * getSize() ||
        output.scalar_type() != input.scalar_type()) {
      throw ValueError(fmt::format(
          "torchpar process group: all_gather_into_tensor: the output must hold group size "
          "({}) x the input's {} elements of {}; got {} elements of {}",
          getSize(), input.numel(), c10::toString(input.scalar_type()), output.numel(),
          c10::toString(output.scalar_type())));
    }
    const at::Tensor out = output;
    const at::Tensor in = input;
    const int n = getSize();
    const CollectiveOptions o{.timeout = call_timeout(opts.timeout)};
    return enqueue(c10d::OpType::_ALLGATHER_BASE, {out}, [out, in, n, o](CollectiveGroup& g) {
      const at::Tensor buf = out.is_contiguous() ? out : out.contiguous();
      g.all_gather(equal_parts(buf, n, "all_gather_into_tensor", "the output"), in, o);
      if (!buf.is_same(out)) out.copy_(buf);
    });
  }

  /// outputs[r][i] = inputs[i] of rank r; one collective when the inputs share a dtype.
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<Tensors>& outputs, Tensors& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    const int n = getSize();
    if (static_cast<int>(outputs.size()) != n) {
      throw ValueError(fmt::format(
          "torchpar process group: all_gather_coalesced needs group size ({}) output lists; "
          "got {}",
          n, outputs.size()));
    }
    bool one_dtype = true;
    for (const auto& list : outputs) {
      if (list.size() != inputs.size()) {
        throw ValueError(fmt::format(
            "torchpar process group: all_gather_coalesced: every output list must have {} "
            "tensors (one per input); got {}",
            inputs.size(), list.size()));
      }
      for (size_t i = 0; i < inputs.size(); ++i) {
        if (list[i].numel() != inputs[i].numel() ||
            list[i].scalar_type() != inputs[i].scalar_type()) {
          throw ValueError(fmt::format(
              "torchpar process group: all_gather_coalesced: output {} must have the {} "
              "elements of {} of input {}",
              i, inputs[i].numel(), c10::toString(inputs[i].scalar_type()), i));
        }
      }
    }
    for (const auto& t : inputs)
      one_dtype = one_dtype && t.scalar_type() == inputs[0].scalar_type();
    Tensors flat_out;
    for (const auto& list : outputs) flat_out.insert(flat_out.end(), list.begin(), list.end());
    const std::vector<Tensors> out = outputs;
    const Tensors in = inputs;
    const CollectiveOptions o{.timeout = call_timeout(opts.timeout)};
    return enqueue(
        c10d::OpType::ALLGATHER_COALESCED, flat_out,
        [out, in, n, one_dtype, o](CollectiveGroup& g) {
          if (in.empty()) return;
          if (!one_dtype) {
            for (size_t i = 0; i < in.size(); ++i) {
              Tensors parts;
              for (const auto& list : out) parts.push_back(list[i]);
              g.all_gather(parts, in[i], o);
            }
            return;
          }
          Tensors flat;
          for (const auto& t : in) flat.push_back(t.reshape({-1}));
          const at::Tensor mine = at::cat(flat);
          Tensors every = empties_like(mine, n);
          g.all_gather(every, mine, o);
          for (int r = 0; r < n; ++r) {
            int64_t at_elem = 0;
            for (size_t i = 0; i < in.size(); ++i) {
              const at::Tensor& dst = out[static_cast<size_t>(r)][i];
              dst.copy_(
                  every[static_cast<size_t>(r)].narrow(0, at_elem, dst.numel()).view(dst.sizes()));
              at_elem += dst.numel();
            }
          }
        });
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<Tensors>& outputs, Tensors& inputs,
                                        const c10d::GatherOptions& opts) override {
    const at::Tensor t = single(inputs, "gather");
    const int root = static_cast<int>(opts.rootRank);
    Tensors out;
    if (getRank() == root) {
      if (outputs.size() != 1) {
        throw ValueError("torchpar process group: gather takes one output list on the root");
      }
      out = outputs[0];
    } else if (!outputs.empty() && !outputs[0].empty()) {
      throw ValueError("torchpar process group: gather: only the root passes a gather_list");
    }
    const CollectiveOptions o{.timeout = call_timeout(opts.timeout)};
    return enqueue(c10d::OpType::GATHER, out,
                   [t, out, root, o](CollectiveGroup& g) { g.gather(t, out, root, o); });
  }

  c10::intrusive_ptr<c10d::Work> scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    const at::Tensor t = single(outputs, "scatter");
    const int root = static_cast<int>(opts.rootRank);
    Tensors in;
    if (getRank() == root) {
      if (inputs.size() != 1) {
        throw ValueError("torchpar process group: scatter takes one input list on the root");
      }
      in = inputs[0];
    } else if (!inputs.empty() && !inputs[0].empty()) {
      throw ValueError("torchpar process group: scatter: only the root passes a scatter_list");
    }
    const CollectiveOptions o{.timeout = call_timeout(opts.timeout)};
    return enqueue(c10d::OpType::SCATTER, {t},
                   [t, in, root, o](CollectiveGroup& g) { g.scatter(t, in, root, o); });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<Tensors>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    const at::Tensor t = single(outputs, "reduce_scatter");
    if (inputs.size() != 1) {
      throw ValueError("torchpar process group: reduce_scatter takes one input list");
    }
    return reduce_scatter_into(c10d::OpType::REDUCE_SCATTER, t, inputs[0], opts);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    if (input.numel() != output.numel() * getSize()) {
      throw ValueError(fmt::format(
          "torchpar process group: reduce_scatter_tensor: the input must hold group size ({}) "
          "x the output's {} elements; got {}",
          getSize(), output.numel(), input.numel()));
    }
    const at::Tensor in = input.contiguous();
    return reduce_scatter_into(c10d::OpType::_REDUCE_SCATTER_BASE, output,
                               equal_parts(in, getSize(), "reduce_scatter_tensor", "the input"),
                               opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override {
    const Tensors out_parts = rows_split(output, output_splits, "output");
    const Tensors in_parts = rows_split(input, input_splits, "input");
    const bool even = output_splits.empty() && input_splits.empty();
    const at::Tensor out = output;
    const Timeout to = call_timeout(opts.timeout);
    return enqueue(c10d::OpType::ALLTOALL_BASE, {out},
                   [out_parts, in_parts, even, to](CollectiveGroup& g) {
                     all_to_all_any(g, out_parts, in_parts, !even, to);
                   });
  }

  c10::intrusive_ptr<c10d::Work> alltoall(Tensors& outputs, Tensors& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    if (static_cast<int>(outputs.size()) != getSize() ||
        static_cast<int>(inputs.size()) != getSize()) {
      throw ValueError(fmt::format(
          "torchpar process group: alltoall needs group size ({}) tensors in each list; got {} "
          "outputs and {} inputs",
          getSize(), outputs.size(), inputs.size()));
    }
    const Tensors out = outputs;
    const Tensors in = inputs;
    const Timeout to = call_timeout(opts.timeout);
    return enqueue(c10d::OpType::ALLTOALL, out, [out, in, to](CollectiveGroup& g) {
      all_to_all_any(g, out, in, /*maybe_uneven=*/true, to);
    });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    const CollectiveOptions o{.timeout = call_timeout(opts.timeout)};
    return enqueue(c10d::OpType::BARRIER, {}, [o](CollectiveGroup& g) { g.barrier(o); });
  }

  /// torch.distributed.monitored_barrier as Gloo's: every rank reports to rank 0, which
  /// names the first rank (every rank, with wait_all_ranks) that did not within the timeout,
  /// then releases the others; they raise when rank 0 does not answer within it. Synchronous,
  /// over point-to-point messages on tags of its own. `opts.timeout` unset: the group's.
  /// Errors (RuntimeError, Gloo's wording): "Rank r failed to pass monitoredBarrier in T ms",
  /// "Ranks r, s failed to ...", "Rank 0 timed out in monitoredBarrier after T ms", "Rank r
  /// successfully reached monitoredBarrier, but received errors while waiting for send/recv
  /// from rank 0".
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    using std::chrono::milliseconds;
    state_->worker->kick();  // collectives queued before it must be under way
    const milliseconds limit = opts.timeout == c10d::kUnsetTimeout
                                   ? std::chrono::duration_cast<milliseconds>(timeout_)
                                   : opts.timeout;
    const int tag = kMonitoredBarrierTag + 2 * static_cast<int>(monitored_calls_++ % 4096);
    const int me = getRank();
    const int n = getSize();
    auto& g = state_->group;
    if (me != 0) {
      try {
        torchpar::Work sent = g.isend(at::ones({1}, at::kByte), 0, tag);
        at::Tensor ack = at::zeros({1}, at::kByte);
        torchpar::Work got = g.irecv(ack, 0, tag + 1);
        sent.wait(Seconds(limit));
        got.wait(Seconds(limit));
      } catch (const std::exception& e) {
        throw Error(fmt::format(
            "Rank {} successfully reached monitoredBarrier, but received errors while waiting "
            "for send/recv from rank 0. Please check rank 0 logs for faulty rank. ({})",
            me, e.what()));
      }
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    // Posted at once, waited in rank order; a rank whose receive cannot even be posted (its
    // Gloo pair closed by an earlier timeout) counts as not arrived.
    std::vector<at::Tensor> tokens;
    std::vector<std::optional<torchpar::Work>> arrivals;
    for (int r = 1; r < n; ++r) {
      tokens.push_back(at::zeros({1}, at::kByte));
      try {
        arrivals.emplace_back(g.irecv(tokens.back(), r, tag));
      } catch (const std::exception&) {
        arrivals.emplace_back(std::nullopt);
      }
    }
    std::vector<int> failed;
    for (int r = 1; r < n; ++r) {
      Seconds left = Seconds(limit);
      if (!wait_all_ranks) {
        left -= std::chrono::steady_clock::now() - start;
        if (left < Seconds(0)) {
          throw Error(
              fmt::format("Rank 0 timed out in monitoredBarrier after {} ms", limit.count()));
        }
      }
      try {
        auto& arrival = arrivals[static_cast<size_t>(r - 1)];
        if (!arrival) throw Error("no receive");
        arrival->wait(left);
      } catch (const std::exception&) {
        if (!wait_all_ranks) {
          throw Error(
              fmt::format("Rank {} failed to pass monitoredBarrier in {} ms", r, limit.count()));
        }
        failed.push_back(r);
      }
    }
    if (!failed.empty()) {
      throw Error(fmt::format("Ranks {} failed to pass monitoredBarrier in {} ms",
                              fmt::join(failed, ", "), limit.count()));
    }
    std::vector<torchpar::Work> acks;
    for (int r = 1; r < n; ++r) acks.push_back(g.isend(at::ones({1}, at::kByte), r, tag + 1));
    for (auto& a : acks) a.wait(Seconds(limit));
  }

  c10::intrusive_ptr<c10d::Work> send(Tensors& tensors, int dst, int tag) override {
    const at::Tensor& t = single(tensors, "send");
    return c10::make_intrusive<PointToPointWork>(
        getRank(), c10d::OpType::SEND, state_->group.isend(t, dst, tag), tensors, timeout_,
        fmt::format("send to rank {} (tag {})", dst, tag), state_->worker);
  }

  c10::intrusive_ptr<c10d::Work> recv(Tensors& tensors, int src, int tag) override {
    const at::Tensor& t = single(tensors, "recv");
    return c10::make_intrusive<PointToPointWork>(
        getRank(), c10d::OpType::RECV, state_->group.irecv(t, src, tag), tensors, timeout_,
        fmt::format("recv from rank {} (tag {})", src, tag), state_->worker);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(Tensors& tensors, int tag) override {
    const at::Tensor& t = single(tensors, "recv");
    return c10::make_intrusive<PointToPointWork>(
        getRank(), c10d::OpType::RECVANYSOURCE, state_->group.irecv(t, std::nullopt, tag), tensors,
        timeout_, fmt::format("recv from any rank (tag {})", tag), state_->worker);
  }

 private:
  using Run = std::function<void(CollectiveGroup&, const at::Tensor&)>;

  /// all_reduce of one tensor with `op` (the bitwise ones through all_gather and a fold).
  Run reducer(const at::Tensor& like, const c10d::ReduceOp& op, Timeout to, const char* where) {
    const auto mapped = reduce_op_of(op, like, where);
    if (mapped) {
      const ReduceOptions o{.op = *mapped, .timeout = to};
      return [o](CollectiveGroup& g, const at::Tensor& t) { g.all_reduce(t, o); };
    }
    const auto bitwise = op.op_;
    const int n = getSize();
    return [bitwise, n, to](CollectiveGroup& g, const at::Tensor& t) {
      Tensors parts = empties_like(t, n);
      g.all_gather(parts, t, {.timeout = to});
      fold_bitwise(t, parts, bitwise);
    };
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_into(c10d::OpType type, const at::Tensor& out,
                                                     const Tensors& in,
                                                     const c10d::ReduceScatterOptions& opts) {
    const Timeout to = call_timeout(opts.timeout);
    const auto op = reduce_op_of(opts.reduceOp, out, "reduce_scatter");
    const auto bitwise = opts.reduceOp.op_;
    const int n = getSize();
    return enqueue(type, {out}, [=](CollectiveGroup& g) {
      if (op) {
        g.reduce_scatter(out, in, {.op = *op, .timeout = to});
        return;
      }
      Tensors parts = empties_like(out, n);  // parts[r] = in[this rank] of rank r
      g.all_to_all(parts, in, {.timeout = to});
      fold_bitwise(out, parts, bitwise);
    });
  }

  /// `t` cut along dim 0 into getSize() parts: `splits` rows each, or equal parts when empty.
  Tensors rows_split(const at::Tensor& t, const std::vector<int64_t>& splits,
                     const char* what) const {
    const int n = getSize();
    if (splits.empty()) {
      if (t.dim() == 0 || t.size(0) % n != 0) {
        throw ValueError(fmt::format(
            "torchpar process group: alltoall_base: the {}'s first dimension ({}) is not a "
            "multiple of the group size {}; pass split sizes",
            what, t.dim() == 0 ? 0 : t.size(0), n));
      }
      return t.split(t.size(0) / n);
    }
    int64_t rows = 0;
    for (auto s : splits) rows += s;
    if (static_cast<int>(splits.size()) != n || t.dim() == 0 || rows != t.size(0)) {
      throw ValueError(fmt::format(
          "torchpar process group: alltoall_base: {} split sizes must be group size ({}) "
          "numbers adding up to the {}'s first dimension ({})",
          what, n, what, t.dim() == 0 ? 0 : t.size(0)));
    }
    return t.split_with_sizes(splits);
  }

  /// SUM of a sparse COO tensor, as Gloo's: every rank's indices and values gathered
  /// (padded to the largest nnz), summed and coalesced; `t` becomes the result.
  static void all_reduce_sparse(CollectiveGroup& g, const at::Tensor& t, int n, Timeout to) {
    const at::Tensor in = t.coalesce();
    const at::Tensor mine = at::tensor({in._nnz()}, at::kLong);
    Tensors counts = empties_like(mine, n);
    g.all_gather(counts, mine, {.timeout = to});
    int64_t most = 0;
    for (const auto& c : counts) most = std::max(most, c.item<int64_t>());
    const at::Tensor idx = in._indices();
    const at::Tensor val = in._values();
    at::Tensor idx_pad = at::zeros({idx.size(0), most}, idx.options());
    idx_pad.narrow(1, 0, idx.size(1)).copy_(idx);
    auto val_shape = val.sizes().vec();
    val_shape[0] = most;
    at::Tensor val_pad = at::zeros(val_shape, val.options());
    val_pad.narrow(0, 0, val.size(0)).copy_(val);
    Tensors idx_all = empties_like(idx_pad, n);
    Tensors val_all = empties_like(val_pad, n);
    g.all_gather(idx_all, idx_pad, {.timeout = to});
    g.all_gather(val_all, val_pad, {.timeout = to});
    Tensors idx_parts, val_parts;
    for (int r = 0; r < n; ++r) {
      const int64_t nnz = counts[static_cast<size_t>(r)].item<int64_t>();
      idx_parts.push_back(idx_all[static_cast<size_t>(r)].narrow(1, 0, nnz));
      val_parts.push_back(val_all[static_cast<size_t>(r)].narrow(0, 0, nnz));
    }
    const at::Tensor sum =
        at::sparse_coo_tensor(at::cat(idx_parts, 1), at::cat(val_parts, 0), in.sizes()).coalesce();
    t.copy_(sum);
  }

  /// all_to_all of parts whose sizes may differ between pairs: the ranks first agree on the
  /// largest part (a 2-element all_reduce MAX), then exchange parts padded to it.
  static void all_to_all_any(CollectiveGroup& g, const Tensors& out, const Tensors& in,
                             bool maybe_uneven, Timeout to) {
    if (!maybe_uneven) {
      g.all_to_all(out, in, {.timeout = to});
      return;
    }
    int64_t most = 0;
    int64_t least = std::numeric_limits<int64_t>::max();
    for (const auto* list : {&out, &in}) {
      for (const auto& t : *list) {
        most = std::max(most, t.numel());
        least = std::min(least, t.numel());
      }
    }
    at::Tensor bounds = at::tensor({most, -least}, at::kLong);
    g.all_reduce(bounds, {.op = ReduceOp::kMax, .timeout = to});
    most = bounds[0].item<int64_t>();
    least = -bounds[1].item<int64_t>();
    if (most == least) {
      g.all_to_all(out, in, {.timeout = to});
      return;
    }
    const auto opts = in.at(0).options();
    Tensors padded_in, padded_out;
    for (const auto& t : in) {
      at::Tensor p = at::zeros({most}, opts);
      p.narrow(0, 0, t.numel()).copy_(t.reshape({-1}));
      padded_in.push_back(p);
    }
    for (size_t i = 0; i < out.size(); ++i) padded_out.push_back(at::empty({most}, opts));
    g.all_to_all(padded_out, padded_in, {.timeout = to});
    for (size_t i = 0; i < out.size(); ++i) {
      out[i].copy_(padded_out[i].narrow(0, 0, out[i].numel()).view(out[i].sizes()));
    }
  }

  /// Queues `work` for the worker; it completes once it ran. The Work holds GroupState: after
  /// stop() from the worker's own thread (a Future callback dropping the process group) the
  /// queued calls still run, on a destroyed group (they raise ClosedError), never on a freed
  /// one.
  c10::intrusive_ptr<c10d::Work> submit(WorkPtr work) {
    state_->worker->submit(work);
    return work;
  }

  /// Queues `body` for the worker; the returned Work completes once it ran.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, Tensors outputs,
                                         ClosureWork::Body body) {
    return submit(c10::make_intrusive<ClosureWork>(getRank(), type, state_, timeout_,
                                                   std::move(outputs), std::move(body)));
  }

  void shutdown() noexcept {
    state_->worker->stop();
    try {
      state_->group.destroy();
    } catch (...) {  // a broken group releases what it can; nothing to report here
    }
  }

  /// Tags of monitoredBarrier's messages (2 a call, 4096 calls round): above what users pass.
  static constexpr int kMonitoredBarrierTag = 1 << 30;

  std::shared_ptr<GroupState> state_;
  Seconds timeout_;
  std::atomic<uint64_t> monitored_calls_{0};
};

/// The creator torchpar/distributed/__init__.py registers (with the GIL released: it is
/// collective and blocks until every member joined).
c10::intrusive_ptr<c10d::ProcessGroup> create_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeout_s,
    std::vector<int> global_ranks, const std::string& group_name, const std::string& backend) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw ValueError(
        fmt::format("torchpar process group: rank {} is out of range for size {}", rank, size));
  }
  if (!(timeout_s > 0)) {
    throw ValueError(
        fmt::format("torchpar process group: timeout must be positive, got {} s", timeout_s));
  }
  if (global_ranks.empty()) {
    for (int r = 0; r < size; ++r) global_ranks.push_back(r);
  }
  if (static_cast<int>(global_ranks.size()) != size) {
    throw ValueError(fmt::format("torchpar process group: {} global ranks given for a group of {}",
                                 global_ranks.size(), size));
  }
  const Seconds timeout(timeout_s);
  auto group = detail::create_collective_group(
      {.store = store,
       .rank = rank,
       .world_ranks = global_ranks,
       .timeout = timeout,
       .backend = backend_from_string(backend),
       .label =
           fmt::format("torchpar process group '{}'", group_name.empty() ? "default" : group_name),
       .device = detail::gloo_device_for(store)});
  return c10::make_intrusive<ProcessGroupTorchpar>(std::move(group), timeout);
}

}  // namespace
}  // namespace torchpar::python

PYBIND11_MODULE(_distributed, m) {
  namespace tpp = torchpar::python;
  m.doc() =
      "The c10d process group 'torchpar' (import torchpar.distributed to register it with "
      "torch.distributed).";
  // The Store and ProcessGroup types, and torchpar's exception translator.
  py::module_::import("torch.distributed");
  py::module_::import("torchpar._C");
  m.def("create_process_group", &tpp::create_process_group, py::arg("store"), py::arg("rank"),
        py::arg("size"), py::arg("timeout"), py::arg("global_ranks"), py::arg("group_name"),
        py::arg("backend") = "auto", py::call_guard<py::gil_scoped_release>(),
        "Creates this rank's member of the process group (collective over its members). "
        "`timeout` in seconds; `global_ranks` the members' world ranks in group order (empty: "
        "0..size-1); `backend` auto | shm | gloo | hierarchical. Errors: ValueError for bad "
        "arguments; torchpar.TimeoutError naming a rank that did not join within `timeout`.");
  m.def(
      "collective_backend",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg) -> std::string {
        auto* t = dynamic_cast<tpp::ProcessGroupTorchpar*>(pg.get());
        if (t == nullptr) throw torchpar::ValueError("not a torchpar process group");
        return torchpar::to_string(t->collective_backend());
      },
      py::arg("pg"),
      "The backend a torchpar process group runs on: 'shm', 'hierarchical' or 'gloo'.");
}
