#include "torchpar/rpc/rpc_group.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>

#include "dist/store.h"
#include "rpc/agent.h"
#include "rpc/rpc_group_impl.h"

namespace torchpar {

std::string RpcGroup::Impl::store_key(const std::string& group, const char* kind,
                                      const std::string& k) {
  return fmt::format("torchpar/rpc/group/{}/{}/{}", group, kind, k);
}

std::string RpcGroup::Impl::key(const char* kind, const std::string& k) const {
  return store_key(group, kind, k);
}

std::optional<std::string> RpcGroup::Impl::store_get(const std::string& k) const {
  return agent->with_store([&](c10d::Store& s) -> std::optional<std::string> {
    if (!s.check({k})) return std::nullopt;
    return detail::store_string(s.get(k));
  });
}

void RpcGroup::Impl::check_open() const {
  if (destroyed)
    throw ClosedError(fmt::format("RpcGroup '{}': destroyed on member '{}'", group, agent->name()));
}

RpcGroup::RpcGroup() = default;
RpcGroup::RpcGroup(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
RpcGroup::~RpcGroup() = default;
RpcGroup::RpcGroup(const RpcGroup&) = default;
RpcGroup& RpcGroup::operator=(const RpcGroup&) = default;
RpcGroup::RpcGroup(RpcGroup&&) noexcept = default;
RpcGroup& RpcGroup::operator=(RpcGroup&&) noexcept = default;

namespace {
RpcGroup::Impl& get(const std::shared_ptr<RpcGroup::Impl>& impl) {
  if (!impl) throw ValueError("RpcGroup: default-constructed group (use World::create_rpc_group)");
  return *impl;
}
}  // namespace

std::vector<std::string> RpcGroup::get_group_members() const { return get(impl_).members; }
const std::string& RpcGroup::get_cur_name() const { return get(impl_).agent->name(); }
const std::string& RpcGroup::get_group_name() const { return get(impl_).group; }

bool RpcGroup::is_member(const std::string& name) const {
  const auto& m = get(impl_).members;
  return std::binary_search(m.begin(), m.end(), name);
}

bool RpcGroup::same_host(const std::string& member) const {
  return get(impl_).agent->same_host(member);
}

void RpcGroup::barrier(Timeout timeout) {
  auto& g = get(impl_);
  g.check_open();
  int n = 0;
  {
    std::lock_guard<std::mutex> lk(g.mu);
    n = ++g.barriers;
  }
  const auto t = timeout ? std::max(0.0, timeout->count()) : 1e9;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(std::min(t, 1e9)));
  const std::string k = g.key("barrier", std::to_string(n));
  const bool ok = g.agent->with_store([&](c10d::Store& s) {
    return detail::store_barrier(s, k, static_cast<int64_t>(g.members.size()), deadline);
  });
  if (!ok) {
    throw TimeoutError(fmt::format("RpcGroup '{}': barrier #{} on '{}' timed out after {} s",
                                   g.group, n, g.agent->name(), t));
  }
}

void RpcGroup::destroy(Timeout /*timeout*/) {
  if (!impl_) return;
  auto& g = *impl_;
  std::set<std::string> services;
  std::map<std::string, std::string> pairs;
  {
    std::lock_guard<std::mutex> lk(g.mu);
    if (g.destroyed) return;
    g.destroyed = true;
    services.swap(g.my_services);
    pairs.swap(g.my_pairs);
  }
  try {
    g.agent->with_store([&](c10d::Store& s) {
      for (const auto& k : services) s.deleteKey(g.key("service", k));
      for (const auto& [k, id] : pairs) s.deleteKey(g.key("pair", k));
    });
  } catch (...) {  // the store is gone with rank 0: nobody can look the keys up anyway
  }
  for (const auto& [k, id] : pairs) g.agent->remove_pinned(id);
  g.agent->close_group(g.group);
}

// ---- services ----------------------------------------------------------------------------

void RpcGroup::register_handler(const std::string& key, detail::RpcHandler fn) {
  auto& g = get(impl_);
  g.check_open();
  const std::string& me = g.agent->name();
  {
    std::lock_guard<std::mutex> lk(g.mu);
    if (g.my_services.count(key)) {
      throw RpcKeyTakenError(key, me,
                             fmt::format("Service {} has already been registered to Group {} (by "
                                         "member '{}', this one)",
                                         key, g.group, me));
    }
  }
  g.agent->add_service(g.group, key, std::move(fn));  // before anyone can find it
  const std::string owner = g.agent->with_store([&](c10d::Store& s) {
    return detail::store_string(s.compareSet(g.key("service", key), {}, detail::store_bytes(me)));
  });
  if (owner != me) {
    g.agent->remove_service(g.group, key);
    throw RpcKeyTakenError(key, owner,
                           fmt::format("Service {} has already been registered to Group {} (by "
                                       "member '{}')",
                                       key, g.group, owner));
  }
  std::lock_guard<std::mutex> lk(g.mu);
  g.my_services.insert(key);
}

void RpcGroup::deregister_service(const std::string& key) {
  auto& g = get(impl_);
  g.check_open();
  const std::string& me = g.agent->name();
  const auto owner = g.store_get(g.key("service", key));
  if (!owner || *owner != me) {
    throw RpcKeyNotOwnedError(
        key, owner.value_or(""),
        owner ? fmt::format("Service {} is not registered to member '{}' of Group {} (its owner "
                            "is '{}')",
                            key, me, g.group, *owner)
              : fmt::format("Service {} is not registered to Group {}", key, g.group));
  }
  g.agent->with_store([&](c10d::Store& s) { s.deleteKey(g.key("service", key)); });
  g.agent->remove_service(g.group, key);
  std::lock_guard<std::mutex> lk(g.mu);
  g.my_services.erase(key);
  g.owner_cache.erase(key);
}

bool RpcGroup::is_registered(const std::string& key) const {
  auto& g = get(impl_);
  return g.store_get(g.key("service", key)).has_value();
}

std::string RpcGroup::service_owner(const std::string& key) const {
  auto& g = get(impl_);
  g.check_open();
  {
    std::lock_guard<std::mutex> lk(g.mu);
    auto it = g.owner_cache.find(key);
    if (it != g.owner_cache.end()) return it->second;
  }
  const auto owner = g.store_get(g.key("service", key));
  if (!owner) {
    throw RpcKeyNotFoundError(key, fmt::format("Service {} not found on Group {}", key, g.group));
  }
  std::lock_guard<std::mutex> lk(g.mu);
  g.owner_cache[key] = *owner;
  return *owner;
}

std::shared_ptr<detail::RpcFutureState> RpcGroup::call_service(const std::string& key,
                                                               const std::string& owner,
                                                               detail::RpcValue args,
                                                               Timeout timeout) {
  auto& g = get(impl_);
  auto state = g.agent->call(owner, detail::RpcAgent::Target::kService, g.group, key,
                             std::move(args), timeout);
  // A stale owner (the service moved or is gone): the next call looks it up again.
  std::weak_ptr<Impl> weak = impl_;
  std::unique_lock<std::mutex> lk(state->mu);
  auto forget = [weak, key] {
    if (auto i = weak.lock()) {
      std::lock_guard<std::mutex> l(i->mu);
      i->owner_cache.erase(key);
    }
  };
  if (state->done) {
    const bool failed = static_cast<bool>(state->error);
    lk.unlock();
    if (failed) forget();
  } else {
    state->callbacks.push_back([state = state.get(), forget] {
      if (state->error) forget();
    });
  }
  return state;
}

std::shared_ptr<detail::RRefState> RpcGroup::remote_service(const std::string& key,
                                                            const std::string& owner,
                                                            detail::RpcValue args,
                                                            Timeout timeout) {
  auto& g = get(impl_);
  auto state = std::make_shared<detail::RRefState>();
  state->owner = owner;
  state->id = g.agent->new_rref_id();
  g.agent->call(owner, detail::RpcAgent::Target::kService, g.group, key, std::move(args), timeout,
                state->id);
  state->agent = g.agent;  // counted from here: the owner has the value's entry
  return state;
}

// ---- functions by name ---------------------------------------------------------------------

std::shared_ptr<detail::RpcFutureState> RpcGroup::call_function(const std::string& to,
                                                                const std::string& fn,
                                                                detail::RpcValue args,
                                                                Timeout timeout) {
  auto& g = get(impl_);
  g.check_open();
  return g.agent->call(to, detail::RpcAgent::Target::kFunction, g.group, fn, std::move(args),
                       timeout);
}

std::shared_ptr<detail::RRefState> RpcGroup::remote_function(const std::string& to,
                                                             const std::string& fn,
                                                             detail::RpcValue args,
                                                             Timeout timeout) {
  auto& g = get(impl_);
  g.check_open();
  auto state = std::make_shared<detail::RRefState>();
  state->owner = to;
  state->id = g.agent->new_rref_id();
  g.agent->call(to, detail::RpcAgent::Target::kFunction, g.group, fn, std::move(args), timeout,
                state->id);
  state->agent = g.agent;
  return state;
}

// ---- pairs -----------------------------------------------------------------------------------

void RpcGroup::pair_value(const std::string& key, std::type_index type,
                          std::shared_ptr<void> object,
                          std::function<detail::RpcValue(bool)> encode) {
  auto& g = get(impl_);
  g.check_open();
  const std::string& me = g.agent->name();
  {
    std::lock_guard<std::mutex> lk(g.mu);
    if (g.my_pairs.count(key)) {
      throw RpcKeyTakenError(key, me,
                             fmt::format("Value {} has already been paired to Group {} (by "
                                         "member '{}', this one)",
                                         key, g.group, me));
    }
  }
  auto v = std::make_shared<detail::OwnedValue>();
  v->creator = me;
  v->object = std::move(object);
  v->type = type;
  v->encode = std::move(encode);
  const std::string id = g.agent->new_rref_id();
  g.agent->add_pinned(id, std::move(v));
  const std::string mine = me + "\n" + id;
  const std::string got = g.agent->with_store([&](c10d::Store& s) {
    return detail::store_string(s.compareSet(g.key("pair", key), {}, detail::store_bytes(mine)));
  });
  if (got != mine) {
    g.agent->remove_pinned(id);
    const std::string owner = got.substr(0, got.find('\n'));
    throw RpcKeyTakenError(key, owner,
                           fmt::format("Value {} has already been paired to Group {} (by member "
                                       "'{}')",
                                       key, g.group, owner));
  }
  std::lock_guard<std::mutex> lk(g.mu);
  g.my_pairs[key] = id;
}

void RpcGroup::unpair(const std::string& key) {
  auto& g = get(impl_);
  g.check_open();
  const std::string& me = g.agent->name();
  std::string id;
  {
    std::lock_guard<std::mutex> lk(g.mu);
    auto it = g.my_pairs.find(key);
    if (it != g.my_pairs.end()) id = it->second;
  }
  if (id.empty()) {
    const auto got = g.store_get(g.key("pair", key));
    const std::string owner = got ? got->substr(0, got->find('\n')) : "";
    throw RpcKeyNotOwnedError(
        key, owner,
        got ? fmt::format("Value {} is not paired to member '{}' of Group {} (its owner is '{}')",
                          key, me, g.group, owner)
            : fmt::format("Value {} is not paired to Group {}", key, g.group));
  }
  g.agent->with_store([&](c10d::Store& s) { s.deleteKey(g.key("pair", key)); });
  g.agent->remove_pinned(id);
  std::lock_guard<std::mutex> lk(g.mu);
  g.my_pairs.erase(key);
}

bool RpcGroup::is_paired(const std::string& key) const {
  auto& g = get(impl_);
  return g.store_get(g.key("pair", key)).has_value();
}

std::shared_ptr<detail::RRefState> RpcGroup::paired_state(const std::string& key) const {
  auto& g = get(impl_);
  g.check_open();
  const auto got = g.store_get(g.key("pair", key));
  if (!got)
    throw RpcKeyNotFoundError(key, fmt::format("Value {} not found on Group {}", key, g.group));
  const auto nl = got->find('\n');
  if (nl == std::string::npos)
    throw ProtocolError(fmt::format("RpcGroup '{}': malformed pair record for {}", g.group, key));
  auto state = std::make_shared<detail::RRefState>();
  state->agent = g.agent;
  state->owner = got->substr(0, nl);
  state->id = got->substr(nl + 1);
  state->counted = false;
  return state;
}

std::shared_ptr<void> RpcGroup::local_paired_object(const std::string& key,
                                                    std::type_index type) const {
  auto& g = get(impl_);
  std::string id;
  {
    std::lock_guard<std::mutex> lk(g.mu);
    auto it = g.my_pairs.find(key);
    if (it != g.my_pairs.end()) id = it->second;
  }
  auto v = id.empty() ? nullptr : g.agent->find_owned(id);
  if (!v) {
    throw RpcKeyNotOwnedError(key, "",
                              fmt::format("Value {} is not paired to member '{}' of Group {}", key,
                                          g.agent->name(), g.group));
  }
  if (v->type != type) {
    throw ValueError(fmt::format("RpcGroup::local_paired: value {} is a {}, not a {}", key,
                                 c10::demangle(v->type.name()), c10::demangle(type.name())));
  }
  return v->object;
}

RpcGroup::DebugInfo RpcGroup::debug_info() const {
  auto& g = get(impl_);
  DebugInfo d;
  d.owned_rrefs = g.agent->owned_rrefs();
  d.pending_calls = g.agent->pending_calls();
  std::lock_guard<std::mutex> lk(g.mu);
  d.services = g.my_services.size();
  d.pairs = g.my_pairs.size();
  return d;
}

}  // namespace torchpar
