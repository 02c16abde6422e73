#include "torchpar/dist/world.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/socket.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>

#include "core/deadline.h"
#include "dist/backend/gloo/backend.h"
#include "dist/create_group.h"
#include "dist/rendezvous.h"
#include "dist/store.h"
#include "rpc/create.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"

namespace torchpar {
namespace {

using Seconds = std::chrono::duration<double>;

std::string join(const std::vector<int>& v) { return fmt::format("{}", fmt::join(v, ",")); }

}  // namespace

/// The rendezvous (rendezvous.h) and the groups made on it.
struct World::Impl {
  explicit Impl(WorldOptions options) : rdv(std::move(options)) {}

  detail::Rendezvous rdv;
  std::mutex mu;
  std::map<std::vector<int>, int> created;  // groups made per rank set
  std::optional<CollectiveGroup> default_group;
  bool destroyed = false;
  detail::RpcRuntime rpc;  // the process's RPC agent and groups (src/rpc/create.h)

  CollectiveGroup make_group(std::vector<int> ranks, Backend backend,
                             std::optional<Seconds> timeout) {
    std::lock_guard<std::mutex> g(mu);
    if (destroyed) throw ClosedError("World: destroyed");
    if (ranks.empty()) {
      for (int r = 0; r < rdv.world_size; ++r) ranks.push_back(r);
    }
    std::set<int> uniq;
    for (int r : ranks) {
      if (r < 0 || r >= rdv.world_size) {
        throw Error(
            fmt::format("World::create_collective_group: rank {} is out of range for "
                        "world size {}",
                        r, rdv.world_size));
      }
      if (!uniq.insert(r).second) {
        throw Error(fmt::format("World::create_collective_group: rank {} is listed twice", r));
      }
    }
    const auto it = std::find(ranks.begin(), ranks.end(), rdv.rank);
    if (it == ranks.end()) {
      throw Error(
          fmt::format("World::create_collective_group: this rank ({}) is not in the "
                      "group [{}]; only members create a group",
                      rdv.rank, join(ranks)));
    }
    const int rel = static_cast<int>(it - ranks.begin());
    const int n = created[ranks]++;
    const std::string key = fmt::format("torchpar/group/{}/{}/", join(ranks), n);
    std::vector<detail::MemberInfo> info;
    for (int r : ranks) info.push_back(rdv.members[static_cast<size_t>(r)]);
    return detail::create_collective_group(
        {.store = c10::make_intrusive<c10d::PrefixStore>(key, rdv.store),
         .rank = rel,
         .world_ranks = ranks,
         .timeout = timeout.value_or(rdv.opts.timeout),
         .backend = backend,
         .label = fmt::format("group [{}] #{}", join(ranks), n),
         .device = rdv.device,
         .members = std::move(info),
         .lost = rdv.lost});
  }

  CollectiveGroup& get_default_group() {
    {
      std::lock_guard<std::mutex> g(mu);
      if (default_group) return *default_group;
      if (destroyed) throw ClosedError("World: destroyed");
    }
    if (!rdv.opts.python_compatible) {
      auto grp = make_group({}, Backend::kGloo, std::nullopt);
      std::lock_guard<std::mutex> g(mu);
      default_group = std::move(grp);
      return *default_group;
    }
    // The key layout of torch.distributed.init_process_group (LibTorch 1.13): the default
    // group's store is PrefixStore("default_pg"), the gloo group's PrefixStore("0") inside it,
    // then a store-based barrier on "store_based_barrier_key:1".
    auto pg_store = c10::make_intrusive<c10d::PrefixStore>("default_pg", rdv.store);
    std::vector<int> all;
    for (int r = 0; r < rdv.world_size; ++r) all.push_back(r);
    auto gloo = detail::create_gloo_backend(
        {.group = {.store = c10::make_intrusive<c10d::PrefixStore>("0", pg_store),
                   .rank = rdv.rank,
                   .world_ranks = all,
                   .timeout = rdv.opts.timeout,
                   .name = fmt::format("default group (rank {} of {}, gloo)", rdv.rank,
                                       rdv.world_size)},
         .device = rdv.device,
         .members = rdv.members,
         .my_host = rdv.host});
    if (!detail::store_barrier(*pg_store, "store_based_barrier_key:1", rdv.world_size,
                               detail::Deadline::after(rdv.opts.timeout).at())) {
      throw TimeoutError("World: not every rank created the default group in time");
    }
    detail::set_gloo_sequence_number(*gloo);
    gloo->set_lost_ranks(rdv.lost);
    std::lock_guard<std::mutex> g(mu);
    default_group = CollectiveGroup(gloo);
    return *default_group;
  }

  /// Destroys the default group, then leaves the rendezvous.
  void leave() noexcept {
    if (destroyed) return;
    destroyed = true;
    rpc.close();
    try {
      if (default_group) default_group->destroy();
    } catch (...) {  // the store may be gone already
    }
    rpc.shutdown();
    rdv.leave();
  }
};

World::World(WorldOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

World::~World() {
  if (impl_) impl_->leave();
}
World::World(World&&) noexcept = default;
World& World::operator=(World&&) noexcept = default;

int World::get_rank() const { return impl_->rdv.rank; }
int World::get_world_size() const { return impl_->rdv.world_size; }
const std::string& World::get_name() const { return impl_->rdv.name; }
int World::get_local_rank() const { return impl_->rdv.local_rank; }
int World::get_local_world_size() const { return impl_->rdv.local_world_size; }
std::vector<std::string> World::get_names() const { return impl_->rdv.names; }

namespace {
/// A count of the launcher's (>= 0): `fallback` when unset or empty.
int launcher_count(const char* name, int fallback) {
  const std::optional<int> v = env_int(name);
  if (!v) return fallback;
  if (*v < 0) throw ValueError(fmt::format("{}={}: a count must not be negative", name, *v));
  return *v;
}
}  // namespace

int World::restart_count() const { return launcher_count("TORCHELASTIC_RESTART_COUNT", 0); }

int World::rendezvous_round() const {
  return launcher_count("TORCHPAR_RDZV_ROUND", restart_count());
}

CollectiveGroup World::create_collective_group(
    std::vector<int> ranks, Backend backend, std::optional<std::chrono::duration<double>> timeout) {
  return impl_->make_group(std::move(ranks), backend, timeout);
}

CollectiveGroup& World::default_group() { return impl_->get_default_group(); }

void World::destroy() { impl_->leave(); }

RpcGroup World::create_rpc_group(const std::string& group_name, std::vector<std::string> members) {
  return create_rpc_group(group_name, std::move(members), RpcGroupOptions{});
}

RpcGroup World::create_rpc_group(const std::string& group_name, std::vector<std::string> members,
                                 const RpcGroupOptions& options) {
  return impl_->rpc.create_group(impl_->rdv, group_name, std::move(members), options);
}

int find_free_port(bool loopback_only) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) detail::throw_system_error("socket", errno, "find_free_port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(loopback_only ? INADDR_LOOPBACK : INADDR_ANY);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    detail::throw_system_error("bind", errno, "find_free_port: port 0");
  }
  socklen_t len = sizeof(a);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    detail::throw_system_error("getsockname", errno, "find_free_port");
  }
  return ntohs(a.sin_port);
}

}  // namespace torchpar
