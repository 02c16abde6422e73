// The RPC agent's calls (agent.h): sending a call and tracking it until its reply, the
// dispatch of received messages (on_message), running a call on the pool (execute) and
// replying, failing calls whose member is gone. Message layout: docs/wire_format.md, "RPC
// messages" (message.h).
//
// A call's life: call() files a Pending entry (track: id, deadline, future) and sends a
// kRpcCall; the callee's receive thread hands it to its pool, which runs the function or
// service and sends a kRpcReply with a status (ok, remote raised, not found, gone); the caller's
// receive thread completes the future with the value or the status's error. Whichever comes
// first wins: the reply, the timer at the deadline (TimeoutError), the connection's loss
// (RpcPeerLostError), or shutdown; a later reply finds no Pending entry and is dropped.

#include <c10/util/Type.h>
#include <fmt/format.h>

#include "rpc/agent.h"

namespace torchpar::detail {
namespace {

/// A request of at least this many bytes has its caller spin for the reply (RpcFutureState).
constexpr size_t kLargeRequestBytes = size_t{64} << 10;

}  // namespace

std::shared_ptr<RpcFutureState> RpcAgent::track(const std::string& to, const std::string& group,
                                                const std::string& what, Timeout timeout,
                                                uint64_t* id) {
  auto state = std::make_shared<RpcFutureState>();
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) throw ClosedError("rpc: the RPC agent of '" + opts_.name + "' is shut down");
  *id = next_call_++;
  Pending p{to, group, what, state, rpc_deadline(timeout), timeout ? timeout->count() : 0.0};
  // The timer wakes by itself at timer_wake_: only an earlier deadline wakes it (not one per
  // call: a wake-up costs the caller a system call and the host a context switch).
  const bool earliest = p.deadline < timer_wake_;
  if (earliest) timer_wake_ = p.deadline;
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
  h.kind = kRpcCall;
  h.target = static_cast<uint8_t>(target);
  h.group = group;
  h.name = name;
  h.rref = rref_id;
  const std::string what =
      target == Target::kService ? "of service '" + name + "'" : "of function '" + name + "'";
  std::shared_ptr<RpcFutureState> state;
  if (rref_id.empty()) {
    state = track(to, group, what, timeout, &h.id);
    size_t bytes = args.bytes.size();
    for (const auto& s : args.storages) bytes += s.nbytes();
    if (bytes < kLargeRequestBytes && transport_->reader_spins()) {
      state->spin = std::chrono::microseconds(0);
    }
  }
  try {
    send(to, h, std::move(args), rpc_deadline(timeout));
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
                        : rpc_gone_message(what, to, c.what_without_backtrace())));
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

// ---- receiving ----------------------------------------------------------------------------------

void RpcAgent::on_message(const std::string& peer, rpc::Message msg) {
  Header h;
  try {
    h = decode_rpc_header(std::move(msg.header));
  } catch (const std::exception& e) {
    fmt::print(stderr, "torchpar rpc: '{}' dropped a malformed message from '{}': {}\n", opts_.name,
               peer, e.what());
    return;
  }
  const bool may_block = msg.may_block;
  RpcValue body{std::move(msg.body), std::move(msg.storages)};
  switch (h.kind) {
    case kRpcReply: {  // completes the caller's future, here (no pool hop)
      Pending p;
      {
        std::lock_guard<std::mutex> g(mu_);
        auto it = pending_.find(h.id);
        if (it == pending_.end() || it->second.to != peer) return;  // late or foreign: dropped
        p = std::move(it->second);
        pending_.erase(it);
      }
      if (h.status == kRpcOk) {
        p.state->complete(std::move(body), nullptr);
      } else {
        p.state->complete({}, rpc_status_error(h.status, h.error_type, h.error, peer, h.name));
      }
      return;
    }
    case kRpcCall: {  // runs user code: here when this thread may block, else on the pool
      // A remote(): the RRef exists from now on, in arrival order (before any delete of it).
      if (!h.rref.empty()) rref_created(peer, h.rref);
      if (may_block) {
        // A TCP reader: running the call here saves two thread hand-offs (to the pool, and
        // the pool's wake-up) per call; the transport gives the connection another reader
        // when the call runs long or waits (RpcFutureState::wait releases it at once).
        execute(peer, std::move(h), std::move(body));
        return;
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
    case kRpcFetch: {  // may wait for a remote() still running: on the pool
      auto self = shared_from_this();
      try {
        pool_->submit([self, peer, h]() mutable { self->serve_fetch(peer, std::move(h)); },
                      nullptr);
      } catch (...) {
      }
      return;
    }
    case kRpcDelete:
      rref_deleted(h.rref);
      return;
    default:
      fmt::print(stderr, "torchpar rpc: '{}' dropped a message of unknown kind {} from '{}'\n",
                 opts_.name, h.kind, peer);
  }
}

void RpcAgent::execute(const std::string& peer, Header h, RpcValue args) {
  uint8_t status = kRpcOk;
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
  if (h.target == static_cast<uint8_t>(Target::kFunction)) fn = find_rpc_function(h.name);
  if (!group_open) {
    status = kRpcGone;
    error = fmt::format("member '{}' is not in group '{}' (destroyed?)", opts_.name, h.group);
  } else if (!fn) {
    status = kRpcNotFound;
    error = h.target == static_cast<uint8_t>(Target::kService)
                ? fmt::format("Service {} not found on Group {} (member '{}')", h.name, h.group,
                              opts_.name)
                : fmt::format("function '{}' is not registered on member '{}'", h.name, opts_.name);
  } else {
    try {
      // A result kept as an RRef may be fetched many times: no one-shot handles in it.
      result = (*fn)(args, h.rref.empty() && same_host(peer));
    } catch (const c10::Error& e) {
      status = kRpcRemote;
      type = c10::demangle(typeid(e).name());
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      status = kRpcRemote;
      type = c10::demangle(typeid(e).name());
      error = e.what();
    } catch (...) {
      status = kRpcRemote;
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
  r.kind = kRpcReply;
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

void RpcAgent::on_peer_lost(const std::string& peer, const std::string& why) {
  drop_values_of(peer);
  fail_pending(
      [&](const Pending& p) { return p.to == peer; },
      [&](const Pending& p) {
        return std::make_exception_ptr(RpcPeerLostError(peer, rpc_gone_message(p.what, peer, why)));
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

}  // namespace torchpar::detail
