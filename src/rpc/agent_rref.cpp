// The RPC agent's RRef protocol (agent.h; RRef in torchpar/rpc/rpc_group.h).
//
// An RRef's value lives on its owner, in owned_ under the RRef's id ("<creator>#<n>"):
//   - remote(): the caller picks the id and sends a kRpcCall carrying it; the owner files an
//     unready OwnedValue with one reference (the creator's) on its receive thread, in arrival
//     order, runs the function on its pool and stores the result (or the error) there, then
//     runs the waiters queued meanwhile. No reply is sent.
//   - to_here(): a kRpcFetch with the id; the owner replies (kRpcReply) with a copy of the
//     value once it is ready (queued as a waiter until then), kRpcNotFound when it is gone.
//     On the owner itself fetch() reads owned_ directly.
//   - the last RRefState in a process is destroyed: a kRpcDelete with the id; the owner drops
//     one reference and frees the value at zero. Copies of an RRef inside one process share one
//     RRefState, so each process holds at most one reference. RRefs cannot travel in arguments
//     yet, so only the creator ever holds a reference.
//   - the creator's connection is lost: the owner frees every unpinned value it created
//     (drop_values_of), as nobody else can reach them.
//   - pair(): the owner pins a value (add_pinned: never counted, lives until unpair); fetches
//     encode a fresh copy of the paired object each time.

#include <c10/util/Type.h>
#include <fmt/format.h>

#include "rpc/agent.h"

namespace torchpar::detail {

RRefState::~RRefState() {
  if (counted && agent) agent->release(*this);
}

const std::string& rref_owner(const RRefState& state) { return state.owner; }

bool rref_is_owner(const RRefState& state) {
  return state.agent && state.owner == state.agent->name();
}

RpcValue rref_fetch(const RRefState& state, Timeout timeout) {
  if (!state.agent) throw ValueError("RRef: refers to no RPC agent");
  return state.agent->fetch(state, timeout);
}

// ---- owned values -------------------------------------------------------------------------------

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

void RpcAgent::rref_created(const std::string& peer, const std::string& id) {
  auto v = std::make_shared<OwnedValue>();
  v->creator = peer;
  v->refs = 1;  // the creator's reference, which it drops with a delete message
  std::lock_guard<std::mutex> g(mu_);
  owned_[id] = std::move(v);
}

void RpcAgent::rref_deleted(const std::string& id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = owned_.find(id);
  if (it != owned_.end() && !it->second->pinned && --it->second->refs <= 0) owned_.erase(it);
}

void RpcAgent::drop_values_of(const std::string& peer) {
  std::vector<std::shared_ptr<OwnedValue>> gone;  // destroyed unlocked: they may hold RRefs
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

// ---- fetch and release --------------------------------------------------------------------------

RpcValue RpcAgent::fetch(const RRefState& rref, Timeout timeout) {
  if (rref.owner == opts_.name) {
    auto v = find_owned(rref.id);
    if (!v)
      throw RpcKeyNotFoundError(
          rref.id, fmt::format("RRef {} is unknown to its owner '{}'", rref.id, rref.owner));
    std::shared_ptr<RpcFutureState> state = std::make_shared<RpcFutureState>();
    auto complete = [state, v, this] {
      if (v->error_status != kRpcOk) {
        state->complete(
            {}, rpc_status_error(v->error_status, v->error_type, v->error, opts_.name, v->error));
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
  h.kind = kRpcFetch;
  h.rref = rref.id;
  auto state = track(rref.owner, "", "fetching RRef " + rref.id, timeout, &h.id);
  try {
    send(rref.owner, h, {}, rpc_deadline(timeout));
  } catch (const ClosedError& c) {
    {
      std::lock_guard<std::mutex> g(mu_);
      pending_.erase(h.id);
    }
    throw RpcPeerLostError(rref.owner, rpc_gone_message("fetching RRef " + rref.id, rref.owner,
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
    h.kind = kRpcDelete;
    h.rref = rref.id;
    send(rref.owner, h, {}, Clock::now() + std::chrono::seconds(5));
  } catch (...) {  // the owner is gone: its values are gone with it
  }
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
        peer, h.id, kRpcNotFound, "",
        fmt::format("RRef {} is unknown to its owner '{}' (freed or unpaired)", h.rref, opts_.name),
        {});
  }
  reply_owned(peer, h.id, *v);
}

void RpcAgent::reply_owned(const std::string& peer, uint64_t id, const OwnedValue& v) {
  if (v.error_status != kRpcOk) return reply(peer, id, v.error_status, v.error_type, v.error, {});
  if (v.encode) {
    RpcValue val;
    try {
      val = v.encode(same_host(peer));
    } catch (const std::exception& e) {
      return reply(peer, id, kRpcRemote, c10::demangle(typeid(e).name()), e.what(), {});
    }
    return reply(peer, id, kRpcOk, "", "", std::move(val));
  }
  reply(peer, id, kRpcOk, "", "", v.value);
}

}  // namespace torchpar::detail
