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
#include <random>
#include <set>
#include <thread>

#include "server/paired.h"

namespace torchpar {

namespace {

using Clock = std::chrono::steady_clock;

// machin's PushPullGradServerImpl.REDUCE_MASTER / REDUCE_SLAVE: the queue an entry goes to.
constexpr int32_t kPrimaryLevel = 0;
constexpr int32_t kSecondaryLevel = 1;
// Drops are logged on the first and then once per this many.
constexpr int64_t kDropLogEvery = 1000;

std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "a non-std::exception";
  }
}

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
    std::lock_guard<std::mutex> g(mu);
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

  StateDict reduce(std::vector<StateDict>& batch) const {
    const StateDict& first = batch.front();
    for (const auto& b : batch) {
      if (b.size() != first.size()) {
        throw ValueError(fmt::format("{}: gradient dicts of one batch differ: {} and {} entries",
                                     subject(), first.size(), b.size()));
      }
    }
    StateDict out;
    std::vector<at::Tensor> parts;
    for (const auto& [key, t0] : first) {
      parts.clear();
      for (auto& b : batch) {
        auto it = b.find(key);
        if (it == b.end()) {
          throw ValueError(
              fmt::format("{}: gradient dicts of one batch differ: '{}' is missing "
                          "from one",
                          subject(), key));
        }
        parts.push_back(it->second.to(opts.reduce_device));
      }
      auto stacked = at::stack(parts);
      out.emplace(key, mean ? stacked.mean(0) : stacked.sum(0));
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
    auto newest = o_server->pull(opts.model_name, std::nullopt, opts.timeout);
    const int64_t base = newest ? newest->second : version;
    if (!o_server->push(opts.model_name, sd, base + 1, base, opts.timeout)) {
      throw Error(
          fmt::format("{}: could not publish version {} of '{}': the ordered server keeps "
                      "taking other pushes",
                      subject(), base + 1, opts.model_name));
    }
    version = base + 1;
  }

  void run() {
    std::unique_lock<std::mutex> lk(mu);
    const auto bs = static_cast<size_t>(opts.reduce_batch_size);
    while (!stopping) {
      const auto now = Clock::now();
      int level = -1;
      size_t n = 0;
      bool flushed = false;
      for (int l : {kPrimaryLevel, kSecondaryLevel}) {  // the primary queue first (machin)
        if (queues[l].size() >= bs) {
          level = l;
          n = bs;
          break;
        }
      }
      std::optional<Clock::time_point> wake;
      if (level < 0 && opts.flush_after) {
        for (int l : {kPrimaryLevel, kSecondaryLevel}) {
          if (queues[l].empty()) continue;
          const auto due = queues[l].front().arrived + to_clock(*opts.flush_after);
          if (due <= now) {
            level = l;
            n = queues[l].size();
            flushed = true;
            break;
          }
          wake = wake ? std::min(*wake, due) : due;
        }
      }
      if (level < 0) {
        if (wake) {
          cv.wait_until(lk, *wake);
        } else {
          cv.wait(lk);
        }
        continue;
      }
      std::vector<StateDict> batch;
      batch.reserve(n);
      for (size_t i = 0; i < n; ++i) {
        batch.push_back(std::move(queues[level].front().grads));
        queues[level].pop_front();
      }
      if (flushed) ++stats.flushes;
      lk.unlock();
      try {
        auto reduced = reduce(batch);
        batch.clear();
        if (level == kPrimaryLevel) {
          step(std::move(reduced));
        } else {
          forward(std::move(reduced));
        }
      } catch (...) {
        lk.lock();
        error = std::current_exception();
        fmt::print(stderr, "torchpar: {}: the reducer on '{}' stopped: {}\n", subject(), me,
                   message_of(error));
        for (auto& q : queues) q.clear();
        return;
      }
      lk.lock();
    }
  }

  void stop() noexcept {
    {
      std::lock_guard<std::mutex> g(mu);
      stopping = true;
      for (auto& q : queues) q.clear();
    }
    cv.notify_all();
    if (thread.joinable()) thread.join();
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
    if (auto newest = s.o_server->pull(s.opts.model_name, std::nullopt, s.opts.timeout)) {
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

// ---- the accessor ----------------------------------------------------------------------------

PushPullGradServer::PushPullGradServer(std::string server_name, RpcGroup& group,
                                       std::string model_name,
                                       std::vector<std::string> secondary_reducers,
                                       std::shared_ptr<OrderedServerBase<StateDict>> o_server)
    : server_name_(std::move(server_name)),
      group_(&group),
      model_(std::move(model_name), std::move(o_server)),
      secondaries_(std::move(secondary_reducers)) {
  if (secondaries_.empty()) {
    throw ValueError(fmt::format("PushPullGradServer '{}': no secondary reducers", server_name_));
  }
}

PushPullGradServer PushPullGradServer::connect(
    RpcGroup& group, const std::string& server_name,
    std::shared_ptr<OrderedServerBase<StateDict>> o_server, Timeout timeout) {
  auto info = detail::fetch_paired<detail::GradServerInfo>(group, server_name, timeout);
  o_server = detail::client_o_server(group, "PushPullGradServer", server_name, info.o_server_name,
                                     std::move(o_server));
  return PushPullGradServer(server_name, group, std::move(info.model_name),
                            std::move(info.secondary_reducers), std::move(o_server));
}

bool PushPullGradServer::push(VersionedModule& module, Timeout timeout) {
  StateDict grads;
  for (const auto& p : module.module().named_parameters(/*recurse=*/true)) {
    const auto& g = p.value().grad();
    if (!g.defined()) {
      throw ValueError(
          fmt::format("PushPullGradServer '{}': parameter '{}' has no gradient to push "
                      "(run backward first)",
                      server_name_, p.key()));
    }
    // A copy: pull() zeroes the module's gradients, and a reducer in this process would
    // otherwise queue the very tensor.
    grads.emplace(p.key(), g.device().is_cpu() ? g.detach().clone() : g.detach().to(at::kCPU));
  }
  thread_local std::mt19937 rng{std::random_device{}()};
  const auto& member =
      secondaries_[std::uniform_int_distribution<size_t>(0, secondaries_.size() - 1)(rng)];
  try {
    group_->registered_sync<void>(detail::grad_push_service(server_name_, member),
                                  std::tuple<StateDict, int32_t>(std::move(grads), kSecondaryLevel),
                                  timeout);
  } catch (...) {
    detail::rethrow_server_call_error("PushPullGradServer '" + server_name_ + "'",
                                      "push to secondary reducer", member);
  }
  return pull(module, timeout);
}

bool PushPullGradServer::pull(VersionedModule& module, Timeout timeout) {
  module.module().zero_grad();
  return model_.pull(module, timeout);
}

}  // namespace torchpar
