#include "torchpar/server/push_pull_grad_server.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <set>
#include <thread>

#include "core/message_of.h"
#include "server/flat_buffer.h"
#include "server/paired.h"

namespace torchpar {

namespace {

using Clock = std::chrono::steady_clock;

using detail::kPrimaryLevel;
using detail::kSecondaryLevel;
using detail::message_of;
// Drops are logged on the first and then once per this many.
constexpr int64_t kDropLogEvery = 1000;

Clock::duration to_clock(std::chrono::duration<double> d) {
  return std::chrono::duration_cast<Clock::duration>(d);
}

}  // namespace

namespace detail {
std::string grad_push_service(const std::string& server_name, const std::string& member) {
  return server_name + "/" + member + "/_push_service";
}
}  // namespace detail

// ---- the reducer ---------------------------------------------------------------------------

struct PushPullGradServerImpl::State {
  std::string name;
  RpcGroup* group = nullptr;
  PushPullGradServerOptions opts;
  std::string me, primary;
  bool is_primary = false, is_secondary = false, mean = false;
  std::string o_name;
  std::unique_ptr<OrderedServerSimpleImpl<StateDict>> o_impl;
  std::shared_ptr<OrderedServerBase<StateDict>> o_server;
  bool service = false, paired = false;

  // Set by manage_model before start(), then used by the reducer thread only.
  std::shared_ptr<torch::nn::Module> model;
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  std::shared_ptr<torch::optim::LRScheduler> lr_scheduler;
  int64_t version = 0;

  struct Entry {
    StateDict grads;
    Clock::time_point arrived;
  };
  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<Entry> queues[2];  // by level
  bool started = false, stopping = false;
  std::exception_ptr error;
  GradServerStats stats;
  std::thread thread;

  std::string subject() const { return fmt::format("PushPullGradServer '{}'", name); }

  // The service: queue a push (clients: secondary level; secondaries: primary level).
  void accept(StateDict grads, int32_t level) {
    if (level != kPrimaryLevel && level != kSecondaryLevel)
      throw ValueError(fmt::format("{}: unknown reduction level {}", subject(), level));
    if (level == kPrimaryLevel && !is_primary) {
      throw ValueError(
          fmt::format("{}: member '{}' is not the primary reducer ('{}')", subject(), me, primary));
    }
    if (level == kSecondaryLevel && !is_secondary) {
      throw ValueError(fmt::format("{}: member '{}' is not a secondary reducer", subject(), me));
    }
    if (grads.empty()) throw ValueError(fmt::format("{}: an empty gradient dict", subject()));
    if (try_add_now(grads, level)) return;
    // This push decided to queue (try_add_now counted it in queuing): until it is queued, later
    // pushes queue too, so that they are added after it.
    struct Queuing {
      State* s;
      int32_t level;
      bool counted = true;
      ~Queuing() {  // the copy-out below threw
        if (!counted) return;
        std::lock_guard<std::mutex> g(s->mu);
        --s->queuing[level];
      }
    } queuing_guard{this, level};
    // Tensors in shared memory (a trainer's or a secondary's segment, sent as a handle) are
    // copied out before the reply, so the sender gets its segment back as soon as the push
    // returns and reuses it for the next one: each sender maps (and this member faults in)
    // one segment for good, whatever the queue holds.
    bool any_shared = false;
    for (const auto& [k, t] : grads) any_shared = any_shared || (t.defined() && is_shared(t));
    if (any_shared) {
      auto own = [](const at::Tensor& t) { return t.scalar_type(); };
      grads =
          detail::copy_into_flat(entry_buffers.take(detail::flat_bytes(grads, own)), grads, own);
    }
    std::lock_guard<std::mutex> g(mu);
    --queuing[level];
    queuing_guard.counted = false;
    if (error) {
      throw Error(fmt::format("{}: the reducer on member '{}' stopped: {}", subject(), me,
                              message_of(error)));
    }
    if (stopping) throw ClosedError(fmt::format("{}: stopped on member '{}'", subject(), me));
    enqueue_locked(std::move(grads), level);
  }

  void enqueue_locked(StateDict grads, int32_t level) {
    auto& q = queues[level];
    if (static_cast<int64_t>(q.size()) >= opts.max_queue_size) {
      q.pop_front();
      if (++stats.dropped % kDropLogEvery == 1) {
        fmt::print(stderr,
                   "torchpar: {} on '{}': the {} queue is full (max_queue_size {}), dropped its "
                   "oldest entry; {} dropped so far (the reducers are slower than the pushes)\n",
                   subject(), me, level == kPrimaryLevel ? "primary" : "secondary",
                   opts.max_queue_size, stats.dropped);
      }
    }
    q.push_back(Entry{std::move(grads), Clock::now()});
    ++stats.received;
    cv.notify_all();
  }

  // A batch being reduced at one level: the running sum of the entries taken so far. Each
  // entry is added as soon as it is taken and then let go; the sum in order is bit-identical
  // to stack(batch).sum(0).
  struct Batch {
    StateDict sum;
    int64_t count = 0;
    Clock::time_point first;  // arrival of its oldest entry (flush_after counts from it)
  };
  // By level. batch_mu[level] guards batches[level]; it is taken before mu, never the other
  // way round. The reducer thread pops a queue only while holding that level's batch_mu, and
  // the service adds a push itself only when the queue is empty (try_add_now): arrival order
  // is kept.
  std::mutex batch_mu[2];
  Batch batches[2];
  // Under mu: each level's batch's count and first arrival (for the reducer's flush_after
  // clock), and its full batches' results waiting for the reducer thread, oldest first.
  int64_t pending[2] = {0, 0};
  Clock::time_point pending_first[2];
  int64_t queuing[2] = {0, 0};  // pushes between try_add_now's "queue it" and the queue
  std::deque<StateDict> results[2];

  // Under batch_mu[level]: adds `grads` to the level's batch; a full batch is finished and
  // handed to the reducer thread (step or forward).
  // A failure stops the reducer before batch_mu[level] is let go: no push waiting for it
  // adds to a batch the failed one may have left half done (a mean's finish).
  void add_locked(int level, StateDict grads, Clock::time_point arrived) {
    Batch& b = batches[level];
    std::optional<StateDict> full;
    try {
      add_to_batch(b, level, std::move(grads), arrived);
      if (b.count >= opts.reduce_batch_size) full = finish(b);
    } catch (...) {
      b = Batch{};
      std::lock_guard<std::mutex> g(mu);
      set_error_locked(std::current_exception());
      throw;
    }
    std::lock_guard<std::mutex> g(mu);
    pending[level] = b.count;
    pending_first[level] = b.first;
    if (full) results[level].push_back(std::move(*full));
    // The reducer thread has a result to hand on, or a new batch's flush_after to time.
    if (full || b.count == 1) cv.notify_all();
  }

  // The service's fast path: a push that finds its level's queue empty while the reducer
  // runs is added to the batch right here, read straight from the sender's memory (a segment
  // of a trainer on this host), instead of being copied out, queued and added later by the
  // reducer thread: one pass over the gradients' bytes instead of two. Its reply waits for
  // the add and for the adds of pushes taken before it. Returns false (counted in queuing)
  // when the push must queue: before start(), while others queue or the reducer thread has
  // two full batches to hand on, or when reductions run off the CPU. A push that does not
  // fit the batch stops the reducer as in the reducer thread, and its sender gets the error.
  bool try_add_now(const StateDict& grads, int32_t level) {
    if (!opts.reduce_device.is_cpu()) {
      std::lock_guard<std::mutex> g(mu);
      ++queuing[level];
      return false;
    }
    std::unique_lock<std::mutex> bl(batch_mu[level]);
    {
      std::lock_guard<std::mutex> g(mu);
      // The reducer thread behind (entries queued, or more than one full batch waiting for
      // it): queue, so that a full queue drops its oldest entry as machin's does.
      if (!started || stopping || error || !queues[level].empty() || queuing[level] > 0 ||
          results[level].size() > 1) {
        ++queuing[level];  // accept's slow path lets it go when the push is queued or refused
        return false;
      }
      ++stats.received;
    }
    try {
      add_locked(level, grads, Clock::now());
    } catch (...) {
      bl.unlock();
      fail(std::current_exception());
      throw;
    }
    return true;
  }

  // Stops the reducer at its first error: queued entries, batches and results are dropped.
  void fail(std::exception_ptr e) {
    std::scoped_lock both(batch_mu[0], batch_mu[1]);
    std::lock_guard<std::mutex> g(mu);
    set_error_locked(std::move(e));
    clear_locked();
  }

  // Under mu: the first error is kept (and logged); the reducer thread and the service see it.
  void set_error_locked(std::exception_ptr e) {
    if (!error) {
      error = std::move(e);
      fmt::print(stderr, "torchpar: {}: the reducer on '{}' stopped: {}\n", subject(), me,
                 message_of(error));
    }
    cv.notify_all();
  }

  // Under both batch_mu and mu.
  void clear_locked() {
    for (auto& q : queues) q.clear();
    for (auto& b : batches) b = Batch{};
    for (auto& r : results) r.clear();
    pending[0] = pending[1] = 0;
  }

  // Flat buffers (src/server/flat_buffer.h) reused once free, so that steady reduction
  // allocates and faults in nothing: of queued entries that came in shared memory (see
  // accept), and of the sums of each level (a step's sums stay its model's gradients until
  // the next step; a forwarded one lives until the primary took it). Sums forwarded to a
  // primary elsewhere are in shared memory, so they travel to one on this host as handles.
  // Capacities: the entries a few trainers have in flight while the reducer adds one; a
  // sum being built beside the one still in use (the gradients, the forward) and up to two
  // full ones waiting for the reducer thread (try_add_now).
  detail::FlatBufferPool entry_buffers{4, detail::huge_page_bytes};
  detail::FlatBufferPool sum_buffers[2] = {
      detail::FlatBufferPool{4, detail::huge_page_bytes},
      detail::FlatBufferPool{4, [this](int64_t nbytes) {
                               if (!is_primary) {
                                 try {
                                   return empty_shared({nbytes}, at::kByte);
                                 } catch (const ShmError&) {  // the bytes travel instead
                                 }
                               }
                               return detail::huge_page_bytes(nbytes);
                             }}};

  // The sum's type of a gradient: its own when floating, int64 for integers and bools (as
  // torch.sum).
  static at::ScalarType sum_type(const at::Tensor& t) {
    return at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())
               ? t.scalar_type()
               : at::kLong;
  }

  // Starts batch `b` of `level` with its first entry: its sums are copies of the entry's
  // tensors in their sum types, views of one pooled buffer; on reduce_device when that is
  // not the CPU.
  void start_batch(Batch& b, int level, const StateDict& grads) {
    for (const auto& [key, t] : grads) {
      if (!t.defined())
        throw ValueError(fmt::format("{}: the pushed gradient '{}' is undefined", subject(), key));
    }
    if (!opts.reduce_device.is_cpu()) {
      b.sum.clear();
      for (const auto& [key, t] : grads) {
        b.sum.emplace(key, t.to(opts.reduce_device, sum_type(t), /*non_blocking=*/false,
                                /*copy=*/true));
      }
      return;
    }
    b.sum = detail::copy_into_flat(sum_buffers[level].take(detail::flat_bytes(grads, sum_type)),
                                   grads, sum_type);
  }

  void add_to_batch(Batch& b, int level, StateDict grads, Clock::time_point arrived) {
    if (b.count == 0) {
      b.first = arrived;
      start_batch(b, level, grads);
      b.count = 1;
      return;
    }
    if (grads.size() != b.sum.size()) {
      throw ValueError(fmt::format("{}: gradient dicts of one batch differ: {} and {} entries",
                                   subject(), b.sum.size(), grads.size()));
    }
    // Every entry is checked before the sum changes: a push that does not fit leaves the
    // batch as it was.
    for (const auto& [key, t] : grads) {
      auto it = b.sum.find(key);
      if (it == b.sum.end()) {
        throw ValueError(fmt::format(
            "{}: gradient dicts of one batch differ: '{}' is missing from one", subject(), key));
      }
      if (!t.defined())
        throw ValueError(fmt::format("{}: the pushed gradient '{}' is undefined", subject(), key));
      if (t.sizes() != it->second.sizes()) {
        throw ValueError(
            fmt::format("{}: gradient dicts of one batch differ: '{}' has shape {} "
                        "and {}",
                        subject(), key, c10::str(it->second.sizes()), c10::str(t.sizes())));
      }
    }
    for (const auto& [key, t] : grads) {
      at::Tensor& sum = b.sum.at(key);
      // A wider type promotes the sum from here on (stack would have promoted the batch).
      const auto type = at::result_type(sum, t);
      if (type != sum.scalar_type()) sum = sum.to(type);
      sum.add_(t.to(opts.reduce_device));
    }
    ++b.count;
  }

  // The batch's sum, or mean; the batch starts over.
  StateDict finish(Batch& b) const {
    StateDict out = std::move(b.sum);
    const int64_t n = std::exchange(b.count, 0);
    b.sum.clear();
    if (mean) {
      for (auto& [key, t] : out) {
        if (!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type())) {
          throw ValueError(
              fmt::format("{}: reduce_method \"mean\" needs floating-point "
                          "gradients; '{}' is {}",
                          subject(), key, c10::toString(t.scalar_type())));
        }
        t.div_(static_cast<double>(n));
      }
    }
    return out;
  }

  // Secondary level: the reduced batch goes to the primary's queue.
  void forward(StateDict reduced) {
    if (is_primary) {
      std::lock_guard<std::mutex> g(mu);
      enqueue_locked(std::move(reduced), kPrimaryLevel);
      ++stats.reductions;
      return;
    }
    for (auto& [k, t] : reduced) t = t.to(at::kCPU);
    auto done = group->registered_async<void>(
        detail::grad_push_service(name, primary),
        std::tuple<StateDict, int32_t>(std::move(reduced), kPrimaryLevel), opts.timeout);
    // Wait in slices so stop() is never held up by a slow primary.
    while (!done.done()) {
      std::unique_lock<std::mutex> lk(mu);
      if (cv.wait_for(lk, std::chrono::milliseconds(20), [&] { return stopping; })) return;
    }
    try {
      done.wait();
    } catch (...) {
      detail::rethrow_server_call_error(subject(), "forwarding to the primary reducer", primary);
    }
    std::lock_guard<std::mutex> g(mu);
    ++stats.reductions;
  }

  // Primary level: the reduced batch becomes the model's gradients; step; publish.
  void step(StateDict reduced) {
    std::set<std::string> seen;
    for (auto& p : model->named_parameters(/*recurse=*/true)) {
      auto it = reduced.find(p.key());
      if (it == reduced.end()) {
        throw ValueError(
            fmt::format("{}: the pushed gradients have no entry for parameter '{}' of "
                        "the managed model",
                        subject(), p.key()));
      }
      if (it->second.sizes() != p.value().sizes()) {
        throw ValueError(fmt::format("{}: gradient of '{}' has shape {}, the parameter {}",
                                     subject(), p.key(), c10::str(it->second.sizes()),
                                     c10::str(p.value().sizes())));
      }
      p.value().mutable_grad() = it->second.to(p.value().device(), p.value().scalar_type());
      seen.insert(p.key());
    }
    for (const auto& [k, v] : reduced) {
      if (!seen.count(k)) {
        throw ValueError(fmt::format("{}: gradient '{}' matches no parameter of the managed model",
                                     subject(), k));
      }
    }
    optimizer->step();
    if (lr_scheduler) lr_scheduler->step();
    publish();
    std::lock_guard<std::mutex> g(mu);
    ++stats.steps;
  }

  // The next version on top of ours; if someone else wrote the key meanwhile, on top of theirs.
  void publish() {
    const auto sd = cpu_state_dict(*model);
    if (o_server->push(opts.model_name, sd, version + 1, version, opts.timeout)) {
      ++version;
      return;
    }
    auto newest = o_server->pull_view(opts.model_name, std::nullopt, opts.timeout);
    const int64_t base = newest ? newest->second : version;
    if (!o_server->push(opts.model_name, sd, base + 1, base, opts.timeout)) {
      throw Error(
          fmt::format("{}: could not publish version {} of '{}': the ordered server keeps "
                      "taking other pushes",
                      subject(), base + 1, opts.model_name));
    }
    version = base + 1;
  }

  // The reducer thread, the primary level first (machin): steps or forwards full batches'
  // results, takes queued entries one at a time into their level's batch, and reduces a batch
  // whose oldest entry waited flush_after short once its queue is empty.
  enum class Job { kReduced, kTake, kFlush };

  void run() {
    std::unique_lock<std::mutex> lk(mu);
    while (!stopping && !error) {
      const auto now = Clock::now();
      int level = -1;
      Job job = Job::kTake;
      std::optional<Clock::time_point> wake;
      for (int l : {kPrimaryLevel, kSecondaryLevel}) {
        if (!results[l].empty()) {
          job = Job::kReduced;
        } else if (!queues[l].empty()) {
          job = Job::kTake;
        } else if (pending[l] > 0 && opts.flush_after) {
          const auto due = pending_first[l] + to_clock(*opts.flush_after);
          if (due > now) {
            wake = wake ? std::min(*wake, due) : due;
            continue;
          }
          job = Job::kFlush;
        } else {
          continue;
        }
        level = l;
        break;
      }
      if (level < 0) {
        if (wake) {
          cv.wait_until(lk, *wake);
        } else {
          cv.wait(lk);
        }
        continue;
      }
      std::optional<StateDict> result;
      if (job == Job::kReduced) {
        result.emplace(std::move(results[level].front()));
        results[level].pop_front();
      }
      lk.unlock();
      try {
        if (result) {
          if (level == kPrimaryLevel) {
            step(std::move(*result));
          } else {
            forward(std::move(*result));
          }
        } else {
          take(level, job == Job::kFlush);
        }
      } catch (...) {
        fail(std::current_exception());
        return;
      }
      lk.lock();
    }
  }

  // The reducer thread: under the level's batch_mu, adds the queue's oldest entry to the
  // batch, or (flush) finishes a batch that is still due.
  void take(int level, bool flush) {
    std::lock_guard<std::mutex> bl(batch_mu[level]);
    std::optional<Entry> entry;
    {
      std::lock_guard<std::mutex> g(mu);
      if (stopping || error) return;
      if (!queues[level].empty()) {
        entry.emplace(std::move(queues[level].front()));
        queues[level].pop_front();
      } else if (!flush || batches[level].count == 0) {
        return;  // nothing left to do here
      }
    }
    if (entry) {
      add_locked(level, std::move(entry->grads), entry->arrived);
      return;  // the sender's memory goes back with `entry`
    }
    Batch& b = batches[level];
    if (Clock::now() < b.first + to_clock(*opts.flush_after)) return;
    StateDict out = finish(b);
    std::lock_guard<std::mutex> g(mu);
    ++stats.flushes;
    pending[level] = 0;
    results[level].push_back(std::move(out));
  }

  void stop() noexcept {
    {
      std::lock_guard<std::mutex> g(mu);
      stopping = true;
      for (auto& q : queues) q.clear();
    }
    cv.notify_all();
    if (thread.joinable()) thread.join();
    // The thread is gone; a service call adding now finishes before the batches go.
    std::scoped_lock both(batch_mu[0], batch_mu[1]);
    std::lock_guard<std::mutex> g(mu);
    clear_locked();
  }

  // Undoes the constructor's registrations; the first error is returned.
  std::exception_ptr unregister() {
    std::exception_ptr first;
    auto attempt = [&](auto fn) {
      try {
        fn();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    };
    if (std::exchange(paired, false)) attempt([&] { group->unpair(name); });
    if (std::exchange(service, false))
      attempt([&] { group->deregister_service(detail::grad_push_service(name, me)); });
    if (o_impl) {
      attempt([&] { o_impl->close(); });
      o_impl.reset();
    }
    return first;
  }
};

PushPullGradServerImpl::PushPullGradServerImpl(std::string server_name, RpcGroup& group,
                                               PushPullGradServerOptions options)
    : state_(std::make_shared<State>()) {
  auto& s = *state_;
  s.name = std::move(server_name);
  s.group = &group;
  s.opts = std::move(options);
  s.me = group.get_cur_name();
  const auto members = group.get_group_members();
  const std::string subject = s.subject();
  if (s.name.empty()) throw ValueError("PushPullGradServerImpl: empty server name");
  auto check_member = [&](const std::string& m, const char* role) {
    if (!group.is_member(m)) {
      throw ValueError(fmt::format("{}: {} '{}' is not a member of group '{}' ({})", subject, role,
                                   m, group.get_group_name(), fmt::join(members, ", ")));
    }
  };
  s.primary = s.opts.primary_reducer.empty() ? members.at(0) : s.opts.primary_reducer;
  check_member(s.primary, "primary reducer");
  if (s.opts.secondary_reducers.empty()) s.opts.secondary_reducers = members;
  std::set<std::string> unique;
  for (const auto& m : s.opts.secondary_reducers) {
    check_member(m, "secondary reducer");
    if (!unique.insert(m).second)
      throw ValueError(fmt::format("{}: secondary reducer '{}' is listed twice", subject, m));
  }
  s.is_primary = s.me == s.primary;
  s.is_secondary = unique.count(s.me) != 0;
  if (!s.is_primary && !s.is_secondary) {
    throw ValueError(
        fmt::format("{}: member '{}' is neither the primary reducer ('{}') nor a "
                    "secondary one ({}); trainers use the accessor PushPullGradServer",
                    subject, s.me, s.primary, fmt::join(s.opts.secondary_reducers, ", ")));
  }
  if (s.opts.reduce_method != "sum" && s.opts.reduce_method != "mean") {
    throw ValueError(fmt::format("{}: reduce_method must be \"sum\" or \"mean\", got \"{}\"",
                                 subject, s.opts.reduce_method));
  }
  s.mean = s.opts.reduce_method == "mean";
  if (s.opts.reduce_batch_size < 1 || s.opts.max_queue_size < s.opts.reduce_batch_size) {
    throw ValueError(fmt::format("{}: need 1 <= reduce_batch_size ({}) <= max_queue_size ({})",
                                 subject, s.opts.reduce_batch_size, s.opts.max_queue_size));
  }
  if (s.opts.flush_after && s.opts.flush_after->count() < 0) {
    throw ValueError(fmt::format("{}: flush_after must be >= 0 s, got {}", subject,
                                 s.opts.flush_after->count()));
  }
  try {
    if (s.is_primary) {
      if (s.opts.o_server) {
        s.o_server = s.opts.o_server;
      } else {
        s.o_name = s.name + "_o_server";
        s.o_impl = std::make_unique<OrderedServerSimpleImpl<StateDict>>(s.o_name, group);
        s.o_server = std::make_shared<OrderedServerSimple<StateDict>>(s.o_name, group);
      }
    }
    std::weak_ptr<State> weak = state_;
    group.register_service(detail::grad_push_service(s.name, s.me),
                           [weak](StateDict grads, int32_t level) {
                             auto st = weak.lock();
                             if (!st) throw ClosedError("PushPullGradServer: the reducer is gone");
                             st->accept(std::move(grads), level);
                           });
    s.service = true;
    if (s.is_primary) {
      group.pair(s.name, detail::GradServerInfo{s.opts.model_name, s.primary,
                                                s.opts.secondary_reducers, s.o_name});
      s.paired = true;
    }
  } catch (...) {
    (void)s.unregister();
    throw;
  }
}

PushPullGradServerImpl::~PushPullGradServerImpl() {
  try {
    close();
  } catch (...) {  // the group was destroyed first: nobody can reach the server anyway
  }
}

void PushPullGradServerImpl::manage_model(std::shared_ptr<torch::nn::Module> model,
                                          std::shared_ptr<torch::optim::Optimizer> optimizer,
                                          std::shared_ptr<torch::optim::LRScheduler> lr_scheduler) {
  auto& s = *state_;
  if (!s.is_primary) {
    throw Error(
        fmt::format("{}: manage_model: current member '{}' is not the primary reducer ('{}')",
                    s.subject(), s.me, s.primary));
  }
  if (!model || !optimizer) {
    throw ValueError(fmt::format("{}: manage_model needs a model and an optimizer", s.subject()));
  }
  {
    std::lock_guard<std::mutex> g(s.mu);
    if (s.started) throw Error(fmt::format("{}: manage_model after start()", s.subject()));
  }
  int64_t version = 0;
  if (!s.o_server->push(s.opts.model_name, cpu_state_dict(*model), 0, std::nullopt,
                        s.opts.timeout)) {
    // The ordered server already holds this model (a restarted primary): continue from it.
    if (auto newest = s.o_server->pull_view(s.opts.model_name, std::nullopt, s.opts.timeout)) {
      load_state_dict(*model, newest->first);
      version = newest->second;
    }
  }
  s.model = std::move(model);
  s.optimizer = std::move(optimizer);
  s.lr_scheduler = std::move(lr_scheduler);
  s.version = version;
}

void PushPullGradServerImpl::start() {
  auto& s = *state_;
  std::lock_guard<std::mutex> g(s.mu);
  if (s.started) return;
  if (s.stopping) throw Error(fmt::format("{}: start() after stop()", s.subject()));
  if (s.is_primary && !s.model) {
    throw Error(
        fmt::format("{}: call manage_model on the primary reducer before start()", s.subject()));
  }
  s.started = true;
  s.thread = std::thread([st = state_.get()] { st->run(); });
}

void PushPullGradServerImpl::stop() { state_->stop(); }

void PushPullGradServerImpl::watch() const {
  std::lock_guard<std::mutex> g(state_->mu);
  if (state_->error) std::rethrow_exception(state_->error);
}

GradServerStats PushPullGradServerImpl::stats() const {
  std::lock_guard<std::mutex> g(state_->mu);
  return state_->stats;
}

void PushPullGradServerImpl::close() {
  state_->stop();
  if (auto e = state_->unregister()) std::rethrow_exception(e);
}

}  // namespace torchpar
