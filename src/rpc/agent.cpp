// The RPC agent (agent.h): its construction, the process's function table, call futures,
// the group and service tables, address lookup and sending, the deadline timer and shutdown.
// Calls and replies: agent_calls.cpp; the RRef protocol: agent_rref.cpp.
//
// Threads that run agent code (docs/thread_model.md, "RPC agent"):
//   - user threads: RpcGroup calls (call, fetch, release), group creation and destruction;
//     they send on the calling thread (a first contact connects, bounded by the deadline).
//   - the transport's receive threads (a TCP connection's reader, TensorPipe's loop):
//     on_message and on_peer_lost. A reply completes its future there, RRef bookkeeping
//     (created, deleted) happens there, so it follows arrival order per peer; fetches go to
//     the pool; calls go to the pool from TensorPipe's loop (which must never block) and run
//     on a TCP reader itself (no hand-off; the transport starts another reader for the
//     connection when the call runs past kReaderRescueAfter or waits in RpcFutureState::wait).
//   - the pool (ThreadPoolCore, RpcAgentOptions::num_threads): execute (the user's function
//     or service) of calls that came through TensorPipe or from this process, and
//     serve_fetch; each sends its reply itself.
//   - the timer thread (timer_loop): sleeps until the earliest deadline of pending_ and fails
//     the calls whose deadline passed with TimeoutError.
// mu_ guards every table of the agent; nothing blocking (a send, user code, a store request)
// runs under it.

#include "rpc/agent.h"

#include <c10/util/Type.h>
#include <fmt/format.h>

#include <algorithm>
#include <shared_mutex>
#include <unordered_map>

#include "core/waiter.h"
#include "dist/store.h"

namespace torchpar::detail {

namespace {

// ---- the process's functions registered by name (register_function) -----------------------

std::shared_mutex& functions_mu() {
  static std::shared_mutex mu;
  return mu;
}

std::unordered_map<std::string, std::shared_ptr<RpcHandler>>& functions() {
  static std::unordered_map<std::string, std::shared_ptr<RpcHandler>> table;
  return table;
}

}  // namespace

std::shared_ptr<RpcHandler> find_rpc_function(const std::string& name) {
  std::shared_lock<std::shared_mutex> g(functions_mu());
  auto it = functions().find(name);
  return it == functions().end() ? nullptr : it->second;
}

void register_rpc_function(const std::string& name, RpcHandler fn) {
  if (name.empty()) throw ValueError("register_function: the name is empty");
  std::unique_lock<std::shared_mutex> g(functions_mu());
  functions()[name] = std::make_shared<RpcHandler>(std::move(fn));
}

// ---- helpers shared by agent*.cpp -------------------------------------------------------------

std::chrono::steady_clock::time_point rpc_deadline(Timeout timeout) {
  if (!timeout) return std::chrono::steady_clock::time_point::max();
  const auto t = std::max(0.0, timeout->count());
  if (t > 1e9) return std::chrono::steady_clock::time_point::max();
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(t));
}

std::exception_ptr rpc_status_error(uint8_t status, const std::string& type, const std::string& msg,
                                    const std::string& peer, const std::string& key) {
  switch (status) {
    case kRpcRemote:
      return std::make_exception_ptr(RpcRemoteError(type, msg, peer));
    case kRpcNotFound:
      return std::make_exception_ptr(RpcKeyNotFoundError(key, msg));
    case kRpcGone:
      return std::make_exception_ptr(RpcPeerLostError(peer, msg));
    default:
      return std::make_exception_ptr(ProtocolError(
          fmt::format("rpc: member '{}' replied with unknown status {}", peer, status)));
  }
}

/// The message of a call to `peer` that ended with its connection: names the member and says
/// it is gone, however the transport noticed (`why`).
std::string rpc_gone_message(const std::string& what, const std::string& peer,
                             const std::string& why) {
  return fmt::format("rpc {} to member '{}' failed: member '{}' is gone ({})", what, peer, peer,
                     why);
}

RpcHeader decode_rpc_header(std::string bytes) {
  return loads<RpcHeader>(Payload{std::move(bytes), {}});
}

std::string encode_rpc_header(const RpcHeader& h) { return dumps(h).bytes; }

// ---- futures ----------------------------------------------------------------------------------

void RpcFutureState::complete(RpcValue v, std::exception_ptr e) {
  std::vector<std::function<void()>> cbs;
  {
    std::lock_guard<std::mutex> g(mu);
    if (done) return;  // a late reply after a timeout is dropped
    done = true;
    value = std::move(v);
    error = std::move(e);
    atomic_word(ready).store(1, std::memory_order_release);
    cbs.swap(callbacks);
  }
  cv.notify_all();
  for (auto& cb : cbs) cb();
}

bool RpcFutureState::wait(Timeout timeout) {
  std::unique_lock<std::mutex> lk(mu);
  if (done) return true;
  // A call run inline on a transport's reader that waits here (a nested call, to_here) must
  // not hold up the messages behind it, its own reply among them: hand the reading over.
  lk.unlock();
  rpc::release_reader_thread();
  // Spin before sleeping, while the reply is likely to be close (`spin`: a futex wake-up
  // costs ~13 us on these VMs), yielding every ~2 us of pauses so that a reader or a peer
  // sharing this core runs. Never past the timeout. After a small request the TCP reader
  // spins for the reply's frame itself: a caller spinning too made three spinners on two
  // cores (tiny rpc_sync, interleaved on the 2-core VM: 30-33 us spinning, 16-17 sleeping).
  // After a large one the caller spins (fresh 1 MiB: ~180 us spinning, 205-290 sleeping).
  SpinPolicy policy;
  policy.looks = 1 << 20;
  policy.pauses = 4;
  policy.budget = spin;
  if (timeout)
    policy.budget = std::min<std::chrono::nanoseconds>(
        policy.budget, std::chrono::duration_cast<std::chrono::nanoseconds>(*timeout));
  policy.yield_every = 40;
  const auto is_ready = [](uint32_t r) { return r != 0; };
  if (policy.budget.count() > 0 && spin_until(&ready, is_ready, policy)) {
    lk.lock();  // complete() may still hold it: its callbacks' swap comes first
    return true;
  }
  lk.lock();
  if (!timeout) {
    cv.wait(lk, [&] { return done; });
    return true;
  }
  return cv.wait_until(lk, rpc_deadline(timeout), [&] { return done; });
}

bool rpc_future_done(const RpcFutureState& state) {
  std::lock_guard<std::mutex> g(state.mu);
  return state.done;
}

const RpcValue& rpc_future_value(RpcFutureState& state, Timeout timeout) {
  if (!state.wait(timeout)) throw TimeoutError("RpcFuture::wait: the call did not end in time");
  if (state.error) std::rethrow_exception(state.error);
  return state.value;
}

// ---- the agent --------------------------------------------------------------------------------

std::shared_ptr<RpcAgent> RpcAgent::create(RpcAgentOptions options) {
  std::shared_ptr<RpcAgent> agent(new RpcAgent(std::move(options)));
  std::weak_ptr<RpcAgent> weak = agent;
  rpc::TransportOptions topts;
  topts.name = agent->opts_.name;
  topts.bind_host = agent->opts_.bind_host;
  topts.authkey = agent->opts_.authkey;
  topts.shm = agent->opts_.shm;
  topts.inline_handlers = true;  // on_message only queues work and completes futures
  rpc::TransportHandlers handlers;
  // The handlers hold the agent weakly: the agent owns the transport.
  handlers.on_message = [weak](const std::string& peer, rpc::Message msg) {
    if (auto a = weak.lock()) a->on_message(peer, std::move(msg));
  };
  handlers.on_peer_lost = [weak](const std::string& peer, const std::string& why) {
    if (auto a = weak.lock()) a->on_peer_lost(peer, why);
  };
  // Our TCP transport to every member, TensorPipe's shm to members of this host.
  agent->transport_ = rpc::create_transport(std::move(topts), std::move(handlers));
  agent->address_ = agent->transport_->address();
  const std::string addr = agent->address_;
  agent->with_store([&](c10d::Store& s) {
    s.set("torchpar/rpc/addr/" + agent->opts_.name, std::vector<uint8_t>(addr.begin(), addr.end()));
  });
  agent->timer_ = std::thread([a = agent.get()] { a->timer_loop(); });
  return agent;
}

RpcAgent::RpcAgent(RpcAgentOptions options)
    : opts_(std::move(options)),
      pool_(std::make_unique<ThreadPoolCore>(std::max<size_t>(1, opts_.num_threads))) {}

RpcAgent::~RpcAgent() { shutdown(); }

bool RpcAgent::is_member(const std::string& member) const {
  return std::find(opts_.names.begin(), opts_.names.end(), member) != opts_.names.end();
}

bool RpcAgent::same_host(const std::string& member) const {
  const auto it = std::find(opts_.names.begin(), opts_.names.end(), member);
  if (it == opts_.names.end())
    throw ValueError(fmt::format("rpc: '{}' is not a member of the World", member));
  const auto me = std::find(opts_.names.begin(), opts_.names.end(), opts_.name);
  const auto i = static_cast<size_t>(it - opts_.names.begin());
  const auto j = static_cast<size_t>(me - opts_.names.begin());
  return i < opts_.hosts.size() && j < opts_.hosts.size() && opts_.hosts[i] == opts_.hosts[j];
}

void RpcAgent::open_group(const std::string& group) {
  std::lock_guard<std::mutex> g(mu_);
  open_groups_.insert(group);
}

void RpcAgent::close_group(const std::string& group) {
  {
    std::lock_guard<std::mutex> g(mu_);
    open_groups_.erase(group);
    for (auto it = services_.begin(); it != services_.end();) {
      it = it->first.first == group ? services_.erase(it) : std::next(it);
    }
  }
  fail_pending([&](const Pending& p) { return p.group == group; },
               [&](const Pending& p) {
                 return std::make_exception_ptr(RpcPeerLostError(
                     p.to, fmt::format("rpc {} to '{}': group '{}' was destroyed on '{}'", p.what,
                                       p.to, group, opts_.name)));
               });
}

void RpcAgent::add_service(const std::string& group, const std::string& key, RpcHandler fn) {
  std::lock_guard<std::mutex> g(mu_);
  services_[{group, key}] = std::make_shared<RpcHandler>(std::move(fn));
}

bool RpcAgent::remove_service(const std::string& group, const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  return services_.erase({group, key}) > 0;
}

bool RpcAgent::has_service(const std::string& group, const std::string& key) const {
  std::lock_guard<std::mutex> g(mu_);
  return services_.count({group, key}) > 0;
}

size_t RpcAgent::pending_calls() const {
  std::lock_guard<std::mutex> g(mu_);
  return pending_.size();
}

// ---- sending ------------------------------------------------------------------------------------

std::string RpcAgent::address_of(const std::string& member) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = addresses_.find(member);
    if (it != addresses_.end()) return it->second;
  }
  const std::string key = "torchpar/rpc/addr/" + member;
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(opts_.store_timeout);
  if (store_poll_keys(*opts_.store, {key}, deadline) != -1) {
    throw TimeoutError(fmt::format(
        "rpc: member '{}' published no address within {} s (did it create an RpcGroup?)", member,
        opts_.store_timeout.count()));
  }
  const std::vector<uint8_t> v = opts_.store->get(key);
  std::string addr(v.begin(), v.end());
  std::lock_guard<std::mutex> g(mu_);
  addresses_[member] = addr;
  return addr;
}

void RpcAgent::send(const std::string& to, const Header& h, RpcValue body,
                    std::chrono::steady_clock::time_point deadline) {
  rpc::Message msg;
  msg.header = encode_rpc_header(h);
  msg.body = std::move(body.bytes);
  msg.storages = std::move(body.storages);
  if (to == opts_.name) {  // to this process: no transport
    on_message(to, std::move(msg));
    return;
  }
  // Connecting (first contact) is bounded by the call's deadline and at most 30 s; then the
  // transport queues the message (a stopped peer never blocks the caller), dropping it if its
  // write has not begun by then: the timer fails the call at its own deadline.
  deadline = std::min(deadline, Clock::now() + std::chrono::seconds(30));
  transport_->send(to, address_of(to), std::move(msg), deadline);
}

// ---- deadlines and shutdown -------------------------------------------------------------------

void RpcAgent::timer_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!closed_) {
    auto next = Clock::time_point::max();
    const auto now = Clock::now();
    std::vector<Pending> expired;
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.deadline <= now) {
        expired.push_back(std::move(it->second));
        it = pending_.erase(it);
      } else {
        next = std::min(next, it->second.deadline);
        ++it;
      }
    }
    if (!expired.empty()) {
      lk.unlock();
      for (auto& p : expired) {
        p.state->complete(
            {}, std::make_exception_ptr(TimeoutError(fmt::format(
                    "rpc {} to member '{}' timed out after {} s", p.what, p.to, p.seconds))));
      }
      lk.lock();
      continue;
    }
    timer_wake_ = next;
    if (next == Clock::time_point::max()) {
      timer_cv_.wait(lk);
    } else {
      timer_cv_.wait_until(lk, next);
    }
    timer_wake_ = Clock::time_point::min();
  }
}

void RpcAgent::shutdown() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return;
    closed_ = true;
  }
  timer_cv_.notify_all();
  if (timer_.joinable()) timer_.join();
  if (transport_) transport_->close();
  pool_->close();
  pool_->join(std::chrono::seconds(10));
  fail_pending([](const Pending&) { return true; },
               [&](const Pending& p) {
                 return std::make_exception_ptr(RpcPeerLostError(
                     p.to, fmt::format("rpc {} to member '{}': the RPC agent of '{}' shut down",
                                       p.what, p.to, opts_.name)));
               });
  std::map<std::string, std::shared_ptr<OwnedValue>> owned;  // destroyed unlocked
  std::map<std::pair<std::string, std::string>, std::shared_ptr<RpcHandler>> services;
  std::lock_guard<std::mutex> g(mu_);
  owned.swap(owned_);
  services.swap(services_);
}

}  // namespace torchpar::detail
