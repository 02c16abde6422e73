// World::create_rpc_group's work (create.h): the RPC key policy, the environment knobs of the
// agent (TORCHPAR_RPC_ADDR, TORCHPAR_RPC_SHM), and the collective join in the World's store.

#include "rpc/create.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string_view>

#include "dist/rendezvous.h"
#include "dist/store.h"
#include "rpc/agent.h"
#include "rpc/rpc_group_impl.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"

namespace torchpar::detail {
namespace {

/// What to do about a missing or bad RPC key (every such error says it).
constexpr const char* kRpcKeyAdvice =
    "set WorldOptions::authkey or TORCHPAR_AUTHKEY (hex), as `torchpar run` does";

/// The value a member that refuses to start RPC writes under its join key instead of
/// joining, so that the others fail at once, naming it, rather than at the group's
/// timeout. Never a secret.
constexpr const char* kRefusedJoin = "refused: no usable job key";

/// The key of this process's RPC agent: WorldOptions::authkey, else TORCHPAR_AUTHKEY. Unlike
/// the store and the Manager, RPC never falls back to the per-user key file: a job's ranks
/// get a fresh key from their launcher, and without one RPC does not start. Every member
/// decides from its own options and environment, so ranks started alike decide alike.
/// Errors: ValueError (no key; TORCHPAR_AUTHKEY set but empty or not hex).
AuthKey rpc_authkey(const AuthKey& given, const std::string& group) {
  if (!given.empty()) return given;
  std::optional<AuthKey> env;
  try {
    env = authkey_from_env();
  } catch (const ValueError& e) {
    throw ValueError(fmt::format("World::create_rpc_group('{}'): {}; {}", group,
                                 e.what_without_backtrace(), kRpcKeyAdvice));
  }
  if (!env) {
    throw ValueError(
        fmt::format("World::create_rpc_group('{}'): RPC needs the job's key and this member "
                    "has none: {} (RPC does not use the per-user key file)",
                    group, kRpcKeyAdvice));
  }
  return *std::move(env);
}

/// Marks `me` as refusing to join `group` (see kRefusedJoin). Best effort: the store may be
/// gone too, and the caller's own error is what this member reports.
void announce_refusal(c10d::Store& store, const std::string& group,
                      const std::string& me) noexcept {
  try {
    store.set(RpcGroup::Impl::store_key(group, "join", me), store_bytes(kRefusedJoin));
  } catch (...) {  // the others then time out, naming this member
  }
}

/// Sorts `members` and checks the group's name and members. Errors: ValueError.
void check_group(const Rendezvous& rdv, const std::string& group_name,
                 std::vector<std::string>& members) {
  if (group_name.empty() || group_name.find('/') != std::string::npos)
    throw ValueError(fmt::format(
        "World::create_rpc_group: invalid group name '{}' (empty or with '/')", group_name));
  std::sort(members.begin(), members.end());
  if (members.empty()) throw ValueError("World::create_rpc_group: no members");
  if (std::adjacent_find(members.begin(), members.end()) != members.end())
    throw ValueError(
        fmt::format("World::create_rpc_group('{}'): a member is listed twice", group_name));
  for (const auto& m : members) {
    if (std::find(rdv.names.begin(), rdv.names.end(), m) == rdv.names.end())
      throw ValueError(
          fmt::format("World::create_rpc_group('{}'): '{}' is not a World member "
                      "(members: {})",
                      group_name, m, fmt::join(rdv.names, ", ")));
  }
  if (!std::binary_search(members.begin(), members.end(), rdv.name))
    throw ValueError(
        fmt::format("World::create_rpc_group('{}'): this member ('{}') is not in the "
                    "group; only members create it",
                    group_name, rdv.name));
}

/// The agent's options from the rendezvous and the environment. Errors: ValueError for a
/// TORCHPAR_RPC_SHM other than 0 or 1.
RpcAgentOptions agent_options(const Rendezvous& rdv, const std::string& group_name, AuthKey key) {
  RpcAgentOptions o;
  o.name = rdv.name;
  o.names = rdv.names;
  for (const auto& m : rdv.members) o.hosts.push_back(m.host);
  o.store = rdv.store;
  o.authkey = std::move(key);
  o.bind_host = env_text("TORCHPAR_RPC_ADDR").value_or("127.0.0.1");
  // TensorPipe's shm transport only with TORCHPAR_RPC_SHM=1: its abstract socket dies on
  // any local user's garbage, its reactor busy-polls (docs/distributed.md); and never
  // above 16 members (pytorch/tensorpipe#397: more than ~18 processes fail on shm).
  bool shm = false;
  try {
    shm = env_flag("TORCHPAR_RPC_SHM", false);
  } catch (const ValueError& e) {
    throw ValueError(
        fmt::format("World::create_rpc_group('{}'): {}", group_name, e.what_without_backtrace()));
  }
  o.shm = rdv.world_size <= 16 && shm;
  o.store_timeout = rdv.opts.timeout;
  return o;
}

/// The collective part: every member announces itself under its join key, then waits for
/// the others'. Errors: TimeoutError naming a member that did not join; ValueError naming
/// one that refused (no key). Either closes the group on this member's agent.
void join_members(RpcAgent& agent, const RpcGroup::Impl& impl, const std::string& me,
                  const RpcGroupOptions& options) {
  const std::string& group_name = impl.group;
  const auto join = [&](const std::string& m) { return impl.key("join", m); };
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(options.timeout);
  std::vector<std::string> keys;
  for (const auto& m : impl.members) keys.push_back(join(m));
  agent.with_store([&](c10d::Store& s) { s.set(join(me), std::vector<uint8_t>{1}); });
  const int missing =
      agent.with_store([&](c10d::Store& s) { return store_poll_keys(s, keys, deadline); });
  if (missing != -1) {
    agent.close_group(group_name);
    throw TimeoutError(fmt::format(
        "World::create_rpc_group('{}'): member '{}' did not join within {} s", group_name,
        impl.members[static_cast<size_t>(missing)], options.timeout.count()));
  }
  // Every key is set (get does not wait); a member without a key set kRefusedJoin instead.
  for (const auto& m : impl.members) {
    if (m == me) continue;
    const std::string v =
        agent.with_store([&](c10d::Store& s) { return store_string(s.get(join(m))); });
    if (v == kRefusedJoin) {
      agent.close_group(group_name);
      throw ValueError(
          fmt::format("World::create_rpc_group('{}'): member '{}' refused to start RPC: it has "
                      "no usable job key; {} on every member",
                      group_name, m, kRpcKeyAdvice));
    }
  }
}

}  // namespace

std::shared_ptr<RpcAgent> RpcRuntime::agent_for(const Rendezvous& rdv,
                                                const std::string& group_name,
                                                std::exception_ptr* refused) {
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) throw ClosedError("World: destroyed");
  if (!groups_.insert(group_name).second)
    throw ValueError(
        fmt::format("World::create_rpc_group: group '{}' exists in this process", group_name));
  if (agent_) return agent_;
  // Before anything listens. Once the agent runs, its key stays (a process may unset
  // TORCHPAR_AUTHKEY after its first group, to keep it from its own children).
  AuthKey key;
  try {
    key = rpc_authkey(rdv.opts.authkey, group_name);
  } catch (const ValueError&) {
    groups_.erase(group_name);
    *refused = std::current_exception();
    return nullptr;
  }
  try {
    agent_ = RpcAgent::create(agent_options(rdv, group_name, std::move(key)));
  } catch (...) {
    groups_.erase(group_name);
    throw;
  }
  return agent_;
}

RpcGroup RpcRuntime::create_group(const Rendezvous& rdv, const std::string& group_name,
                                  std::vector<std::string> members,
                                  const RpcGroupOptions& options) {
  check_group(rdv, group_name, members);
  std::exception_ptr refused;  // no usable key: this member does not start RPC
  std::shared_ptr<RpcAgent> agent = agent_for(rdv, group_name, &refused);
  if (refused) {
    announce_refusal(*rdv.store, group_name, rdv.name);
    std::rethrow_exception(refused);
  }
  auto impl = std::make_shared<RpcGroup::Impl>();
  impl->agent = agent;
  impl->group = group_name;
  impl->members = std::move(members);
  agent->open_group(group_name);
  join_members(*agent, *impl, rdv.name, options);
  return RpcGroup(std::move(impl));
}

void RpcRuntime::close() noexcept {
  std::lock_guard<std::mutex> g(mu_);
  closed_ = true;
}

void RpcRuntime::shutdown() noexcept {
  std::shared_ptr<RpcAgent> agent;
  {
    std::lock_guard<std::mutex> g(mu_);
    closed_ = true;
    agent = agent_;
  }
  if (agent) agent->shutdown();
}

}  // namespace torchpar::detail
