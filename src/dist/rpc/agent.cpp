#include "dist/rpc/agent.h"

#include <c10/util/Type.h>
#include <fmt/format.h>

#include <algorithm>
#include <shared_mutex>
#include <unordered_map>

#include "dist/store.h"

namespace torchpar::detail {

namespace {

constexpr uint8_t kCall = kRpcCall, kReply = kRpcReply, kFetch = kRpcFetch, kDelete = kRpcDelete;
constexpr uint8_t kOk = kRpcOk, kRemote = kRpcRemote, kNotFound = kRpcNotFound, kGone = kRpcGone;

using Clock = std::chrono::steady_clock;

// ---- the process's functions registered by name ------------------------------------------

std::shared_mutex& functions_mu() {
  static std::shared_mutex mu;
  return mu;
}
std::unordered_map<std::string, std::shared_ptr<RpcHandler>>& functions() {
  static std::unordered_map<std::string, std::shared_ptr<RpcHandler>> table;
  return table;
}
std::shared_ptr<RpcHandler> find_function(const std::string& name) {
  std::shared_lock<std::shared_mutex> g(functions_mu());
  auto it = functions().find(name);
  return it == functions().end() ? nullptr : it->second;
}

Clock::time_point deadline_of(Timeout timeout) {
  if (!timeout) return Clock::time_point::max();
  const auto t = std::max(0.0, timeout->count());
  if (t > 1e9) return Clock::time_point::max();
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(t));
}

std::exception_ptr status_error(uint8_t status, const std::string& type, const std::string& msg,
                                const std::string& peer, const std::string& key) {
  switch (status) {
    case kRemote:
      return std::make_exception_ptr(RpcRemoteError(type, msg, peer));
    case kNotFound:
      return std::make_exception_ptr(RpcKeyNotFoundError(key, msg));
    case kGone:
      return std::make_exception_ptr(RpcPeerLostError(peer, msg));
    default:
      return std::make_exception_ptr(ProtocolError(
          fmt::format("rpc: member '{}' replied with unknown status {}", peer, status)));
  }
}

/// The message of a call to `peer` that ended with its connection: names the member and says
/// it is gone, however the transport noticed (`why`).
std::string gone_message(const std::string& what, const std::string& peer, const std::string& why) {
  return fmt::format("rpc {} to member '{}' failed: member '{}' is gone ({})", what, peer, peer,
                     why);
}

}  // namespace

RpcHeader decode_rpc_header(std::string bytes) {
  return loads<RpcHeader>(Payload{std::move(bytes), {}});
}
std::string encode_rpc_header(const RpcHeader& h) { return dumps(h).bytes; }

// ---- futures and RRef states --------------------------------------------------------------

void RpcFutureState::complete(RpcValue v, std::exception_ptr e) {
  std::vector<std::function<void()>> cbs;
  {
    std::lock_guard<std::mutex> g(mu);
    if (done) return;  // a late reply after a timeout is dropped
    done = true;
    value = std::move(v);
    error = std::move(e);
    cbs.swap(callbacks);
  }
  cv.notify_all();
  for (auto& cb : cbs) cb();
}

bool RpcFutureState::wait(Timeout timeout) {
  std::unique_lock<std::mutex> lk(mu);
  if (!timeout) {
    cv.wait(lk, [&] { return done; });
    return true;
  }
  return cv.wait_until(lk, deadline_of(timeout), [&] { return done; });
}

RRefState::~RRefState() {
  if (counted && agent) agent->release(*this);
}

bool rref_is_owner(const RRefState& state) {
  return state.agent && state.owner == state.agent->name();
}

RpcValue rref_fetch(const RRefState& state, Timeout timeout) {
  if (!state.agent) throw ValueError("RRef: refers to no RPC agent");
  return state.agent->fetch(state, timeout);
}

void register_rpc_function(const std::string& name, RpcHandler fn) {
  if (name.empty()) throw ValueError("register_function: the name is empty");
  std::unique_lock<std::shared_mutex> g(functions_mu());
  functions()[name] = std::make_shared<RpcHandler>(std::move(fn));
}

// ---- the agent ----------------------------------------------------------------------------

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

std::string RpcAgent::new_rref_id() {
  std::lock_guard<std::mutex> g(mu_);
  return fmt::format("{}#{}", opts_.name, next_rref_++);
}

void RpcAgent::add_pinned(const std::string& id, std::shared_ptr<OwnedValue> value) {
  value->pinned = true;
  value->ready = true;
  std::lock_guard<std::mutex> g(mu_);
  owned_[id] = std::move(value);
}

void RpcAgent::remove_pinned(const std::string& id) {
  std::shared_ptr<OwnedValue> gone;  // destroyed unlocked: it may hold RRefs
  std::lock_guard<std::mutex> g(mu_);
  auto it = owned_.find(id);
  if (it == owned_.end()) return;
  gone = std::move(it->second);
  owned_.erase(it);
}

std::shared_ptr<OwnedValue> RpcAgent::find_owned(const std::string& id) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = owned_.find(id);
  return it == owned_.end() ? nullptr : it->second;
}

size_t RpcAgent::owned_rrefs() const {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<size_t>(std::count_if(owned_.begin(), owned_.end(),
                                           [](const auto& kv) { return !kv.second->pinned; }));
}

size_t RpcAgent::pending_calls() const {
  std::lock_guard<std::mutex> g(mu_);
  return pending_.size();
}

std::string RpcAgent::address_of(const std::string& member) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = addresses_.find(member);
    if (it != addresses_.end()) return it->second;
  }
  const std::string key = "torchpar/rpc/addr/" + member;
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(opts_.store_timeout);
  if (poll_keys({key}, deadline) != -1) {
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

int RpcAgent::poll_keys(const std::vector<std::string>& keys, Clock::time_point deadline) {
  for (size_t i = 0; i < keys.size(); ++i) {
    while (!opts_.store->check({keys[i]})) {
      if (Clock::now() > deadline) return static_cast<int>(i);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  return -1;
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

std::shared_ptr<RpcFutureState> RpcAgent::track(const std::string& to, const std::string& group,
                                                const std::string& what, Timeout timeout,
                                                uint64_t* id) {
  auto state = std::make_shared<RpcFutureState>();
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) throw ClosedError("rpc: the RPC agent of '" + opts_.name + "' is shut down");
  *id = next_call_++;
  Pending p{to, group, what, state, deadline_of(timeout), timeout ? timeout->count() : 0.0};
  const bool earliest = pending_.empty() || p.deadline < pending_.begin()->second.deadline;
  pending_.emplace(*id, std::move(p));
  if (earliest) timer_cv_.notify_all();
  return state;
}

std::shared_ptr<RpcFutureState> RpcAgent::call(const std::string& to, Target target,
                                               const std::string& group, const std::string& name,
                                               RpcValue args, Timeout timeout,
                                               const std::string& rref_id) {
  if (!is_member(to)) throw ValueError(fmt::format("rpc: '{}' is not a member of the World", to));
  Header h;
  h.kind = kCall;
  h.target = static_cast<uint8_t>(target);
  h.group = group;
  h.name = name;
  h.rref = rref_id;
  const std::string what =
      target == Target::kService ? "of service '" + name + "'" : "of function '" + name + "'";
  std::shared_ptr<RpcFutureState> state;
  if (rref_id.empty()) state = track(to, group, what, timeout, &h.id);
  try {
    send(to, h, std::move(args), deadline_of(timeout));
  } catch (...) {
    std::exception_ptr e = std::current_exception();
    try {
      throw;
    } catch (const ClosedError& c) {  // the member is gone (or this agent is shut down)
      bool shut_down = false;
      {
        std::lock_guard<std::mutex> g(mu_);
        shut_down = closed_;
      }
      e = std::make_exception_ptr(RpcPeerLostError(
          to, shut_down ? fmt::format("rpc {} to member '{}': the RPC agent of '{}' shut down",
                                      what, to, opts_.name)
                        : gone_message(what, to, c.what_without_backtrace())));
    } catch (...) {
    }
    if (!state) std::rethrow_exception(e);
    {
      std::lock_guard<std::mutex> g(mu_);
      pending_.erase(h.id);
    }
    state->complete({}, e);
  }
  return state;
}

RpcValue RpcAgent::fetch(const RRefState& rref, Timeout timeout) {
  if (rref.owner == opts_.name) {
    auto v = find_owned(rref.id);
    if (!v)
      throw RpcKeyNotFoundError(
          rref.id, fmt::format("RRef {} is unknown to its owner '{}'", rref.id, rref.owner));
    std::shared_ptr<RpcFutureState> state = std::make_shared<RpcFutureState>();
    auto complete = [state, v, this] {
      if (v->error_status != kOk) {
        state->complete(
            {}, status_error(v->error_status, v->error_type, v->error, opts_.name, v->error));
      } else if (v->encode) {
        try {
          state->complete(v->encode(true), nullptr);
        } catch (...) {
          state->complete({}, std::current_exception());
        }
      } else {
        state->complete(v->value, nullptr);
      }
    };
    {
      std::unique_lock<std::mutex> g(mu_);
      if (!v->ready) {
        v->waiters.push_back(complete);
      } else {
        g.unlock();
        complete();
      }
    }
    if (!state->wait(timeout))
      throw TimeoutError(
          fmt::format("RRef {}: the value was not ready within {} s", rref.id, timeout->count()));
    if (state->error) std::rethrow_exception(state->error);
    return state->value;
  }
  Header h;
  h.kind = kFetch;
  h.rref = rref.id;
  auto state = track(rref.owner, "", "fetching RRef " + rref.id, timeout, &h.id);
  try {
    send(rref.owner, h, {}, deadline_of(timeout));
  } catch (const ClosedError& c) {
    {
      std::lock_guard<std::mutex> g(mu_);
      pending_.erase(h.id);
    }
    throw RpcPeerLostError(rref.owner, gone_message("fetching RRef " + rref.id, rref.owner,
                                                    c.what_without_backtrace()));
  } catch (...) {
    std::lock_guard<std::mutex> g(mu_);
    pending_.erase(h.id);
    throw;
  }
  state->wait(std::nullopt);  // the timer fails it at its deadline
  if (state->error) std::rethrow_exception(state->error);
  return state->value;
}

void RpcAgent::release(const RRefState& rref) noexcept {
  try {
    if (rref.owner == opts_.name) {
      std::lock_guard<std::mutex> g(mu_);
      auto it = owned_.find(rref.id);
      if (it != owned_.end() && !it->second->pinned && --it->second->refs <= 0) owned_.erase(it);
      return;
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      if (closed_) return;
    }
    Header h;
    h.kind = kDelete;
    h.rref = rref.id;
    send(rref.owner, h, {}, Clock::now() + std::chrono::seconds(5));
  } catch (...) {  // the owner is gone: its values are gone with it
  }
}

// ---- receiving ------------------------------------------------------------------------------

void RpcAgent::on_message(const std::string& peer, rpc::Message msg) {
  Header h;
  try {
    h = decode_rpc_header(std::move(msg.header));
  } catch (const std::exception& e) {
    fmt::print(stderr, "torchpar rpc: '{}' dropped a malformed message from '{}': {}\n", opts_.name,
               peer, e.what());
    return;
  }
  RpcValue body{std::move(msg.body), std::move(msg.storages)};
  switch (h.kind) {
    case kReply: {
      Pending p;
      {
        std::lock_guard<std::mutex> g(mu_);
        auto it = pending_.find(h.id);
        if (it == pending_.end() || it->second.to != peer) return;  // late or foreign: dropped
        p = std::move(it->second);
        pending_.erase(it);
      }
      if (h.status == kOk) {
        p.state->complete(std::move(body), nullptr);
      } else {
        p.state->complete({}, status_error(h.status, h.error_type, h.error, peer, h.name));
      }
      return;
    }
    case kCall: {
      if (!h.rref.empty()) {  // the RRef exists from now on, in arrival order
        auto v = std::make_shared<OwnedValue>();
        v->creator = peer;
        v->refs = 1;
        std::lock_guard<std::mutex> g(mu_);
        owned_[h.rref] = std::move(v);
      }
      auto self = shared_from_this();
      try {
        pool_->submit(
            [self, peer, h, body = std::move(body)]() mutable {
              self->execute(peer, std::move(h), std::move(body));
            },
            nullptr);
      } catch (...) {  // shutting down
      }
      return;
    }
    case kFetch: {
      auto self = shared_from_this();
      try {
        pool_->submit([self, peer, h]() mutable { self->serve_fetch(peer, std::move(h)); },
                      nullptr);
      } catch (...) {
      }
      return;
    }
    case kDelete: {
      std::lock_guard<std::mutex> g(mu_);
      auto it = owned_.find(h.rref);
      if (it != owned_.end() && !it->second->pinned && --it->second->refs <= 0) owned_.erase(it);
      return;
    }
    default:
      fmt::print(stderr, "torchpar rpc: '{}' dropped a message of unknown kind {} from '{}'\n",
                 opts_.name, h.kind, peer);
  }
}

void RpcAgent::execute(const std::string& peer, Header h, RpcValue args) {
  uint8_t status = kOk;
  std::string type, error;
  RpcValue result;
  std::shared_ptr<RpcHandler> fn;
  bool group_open = true;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (h.target == static_cast<uint8_t>(Target::kService)) {
      group_open = open_groups_.count(h.group) > 0;
      auto it = services_.find({h.group, h.name});
      if (it != services_.end()) fn = it->second;
    }
  }
  if (h.target == static_cast<uint8_t>(Target::kFunction)) fn = find_function(h.name);
  if (!group_open) {
    status = kGone;
    error = fmt::format("member '{}' is not in group '{}' (destroyed?)", opts_.name, h.group);
  } else if (!fn) {
    status = kNotFound;
    error = h.target == static_cast<uint8_t>(Target::kService)
                ? fmt::format("Service {} not found on Group {} (member '{}')", h.name, h.group,
                              opts_.name)
                : fmt::format("function '{}' is not registered on member '{}'", h.name, opts_.name);
  } else {
    try {
      // A result kept as an RRef may be fetched many times: no one-shot handles in it.
      result = (*fn)(args, h.rref.empty() && same_host(peer));
    } catch (const c10::Error& e) {
      status = kRemote;
      type = c10::demangle(typeid(e).name());
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      status = kRemote;
      type = c10::demangle(typeid(e).name());
      error = e.what();
    } catch (...) {
      status = kRemote;
      type = "unknown";
      error = "a non-std::exception was thrown";
    }
  }
  if (h.rref.empty()) {
    reply(peer, h.id, status, type, error, std::move(result));
    return;
  }
  std::vector<std::function<void()>> waiters;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = owned_.find(h.rref);
    if (it == owned_.end()) return;  // every reference is gone already
    auto& v = *it->second;
    v.ready = true;
    v.value = std::move(result);
    v.error_status = status;
    v.error_type = type;
    v.error = error;
    waiters.swap(v.waiters);
  }
  for (auto& w : waiters) w();
}

void RpcAgent::reply(const std::string& peer, uint64_t id, uint8_t status, const std::string& type,
                     const std::string& error, RpcValue body) {
  Header r;
  r.kind = kReply;
  r.id = id;
  r.status = status;
  r.error_type = type;
  r.error = error;
  try {
    send(peer, r, std::move(body), Clock::now() + std::chrono::seconds(30));
  } catch (const std::exception& e) {  // the caller is gone: nobody waits
    (void)e;
  }
}

void RpcAgent::reply_owned(const std::string& peer, uint64_t id, const OwnedValue& v) {
  if (v.error_status != kOk) return reply(peer, id, v.error_status, v.error_type, v.error, {});
  if (v.encode) {
    RpcValue val;
    try {
      val = v.encode(same_host(peer));
    } catch (const std::exception& e) {
      return reply(peer, id, kRemote, c10::demangle(typeid(e).name()), e.what(), {});
    }
    return reply(peer, id, kOk, "", "", std::move(val));
  }
  reply(peer, id, kOk, "", "", v.value);
}

void RpcAgent::serve_fetch(const std::string& peer, Header h) {
  std::shared_ptr<OwnedValue> v;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = owned_.find(h.rref);
    if (it != owned_.end()) {
      v = it->second;
      if (!v->ready) {
        // Weak: the waiter lives in owned_, which the agent owns.
        std::weak_ptr<RpcAgent> weak = weak_from_this();
        const uint64_t id = h.id;
        std::weak_ptr<OwnedValue> wv = v;
        v->waiters.push_back([weak, peer, id, wv] {
          auto self = weak.lock();
          auto value = wv.lock();
          if (self && value) self->reply_owned(peer, id, *value);
        });
        return;
      }
    }
  }
  if (!v) {
    return reply(
        peer, h.id, kNotFound, "",
        fmt::format("RRef {} is unknown to its owner '{}' (freed or unpaired)", h.rref, opts_.name),
        {});
  }
  reply_owned(peer, h.id, *v);
}

void RpcAgent::on_peer_lost(const std::string& peer, const std::string& why) {
  std::vector<std::shared_ptr<OwnedValue>> gone;  // destroyed unlocked
  {
    // remote() results only `peer` referenced: nobody can fetch or release them now.
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = owned_.begin(); it != owned_.end();) {
      if (!it->second->pinned && it->second->creator == peer) {
        gone.push_back(std::move(it->second));
        it = owned_.erase(it);
      } else {
        ++it;
      }
    }
  }
  fail_pending(
      [&](const Pending& p) { return p.to == peer; },
      [&](const Pending& p) {
        return std::make_exception_ptr(RpcPeerLostError(peer, gone_message(p.what, peer, why)));
      });
}

void RpcAgent::fail_pending(const std::function<bool(const Pending&)>& which,
                            const std::function<std::exception_ptr(const Pending&)>& error) {
  std::vector<Pending> failed;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (which(it->second)) {
        failed.push_back(std::move(it->second));
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& p : failed) p.state->complete({}, error(p));
}

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
    if (next == Clock::time_point::max()) {
      timer_cv_.wait(lk);
    } else {
      timer_cv_.wait_until(lk, next);
    }
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
