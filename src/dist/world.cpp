#include "torchpar/dist/world.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "core/liveness.h"
#include "dist/backend/gloo/backend.h"
#include "dist/backend/shm/backend.h"
#include "dist/store.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"

namespace torchpar {
namespace {

using Seconds = std::chrono::duration<double>;

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

int env_int(const char* name, int fallback, bool required, const char* what) {
  auto v = env(name);
  if (!v) {
    if (required) {
      throw Error(fmt::format(
          "World: {} is not given: set WorldOptions::{} or the environment variable {} (as "
          "torchrun and `torchpar run` do)",
          what, what, name));
    }
    return fallback;
  }
  try {
    size_t pos = 0;
    const int x = std::stoi(*v, &pos);
    if (pos != v->size()) throw std::invalid_argument(*v);
    return x;
  } catch (const std::exception&) {
    throw Error(fmt::format("World: environment variable {}='{}' is not an integer", name, *v));
  }
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string string_of(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

/// Ranks with equal keys share /dev/shm and a pid namespace: the shm backend works among them.
std::string host_key() {
  struct stat ns {};
  struct stat shm {};
  ::stat("/proc/self/ns/pid", &ns);
  ::stat("/dev/shm", &shm);
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  return fmt::format("{}/{}/{:x}/{:x}", host, read_first_line("/proc/sys/kernel/random/boot_id"),
                     static_cast<uint64_t>(ns.st_ino), static_cast<uint64_t>(shm.st_dev));
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

/// The local address that routes to addr:port (a UDP connect sends nothing).
std::string local_address_towards(const std::string& addr, int port) {
  if (is_loopback(addr)) return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) {
    return "";
  }
  std::string out;
  UniqueFd fd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (fd && ::connect(fd.get(), res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in me{};
    socklen_t len = sizeof(me);
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&me), &len) == 0) {
      char buf[INET_ADDRSTRLEN] = {0};
      ::inet_ntop(AF_INET, &me.sin_addr, buf, sizeof(buf));
      out = buf;
    }
  }
  ::freeaddrinfo(res);
  return out;
}

std::chrono::steady_clock::time_point deadline_after(Seconds s) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(s);
}

std::string join(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

}  // namespace

struct World::Impl {
  WorldOptions opts;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string name;
  std::vector<std::string> names;
  std::vector<detail::MemberInfo> members;  // by world rank (pid, host)
  std::string host;
  std::string master_addr;
  int master_port = 0;
  detail::GlooDeviceSpec device;
  std::unique_ptr<detail::StoreServer> server;  // rank 0, unless python_compatible / file://
  c10::intrusive_ptr<c10d::Store> store;
  std::mutex mu;
  std::map<std::vector<int>, int> created;  // groups made per rank set
  std::optional<CollectiveGroup> default_group;
  bool destroyed = false;

  std::chrono::milliseconds ms(Seconds s) const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(s);
  }

  void resolve() {
    rank = opts.rank >= 0 ? opts.rank : env_int("RANK", -1, true, "rank");
    world_size =
        opts.world_size >= 0 ? opts.world_size : env_int("WORLD_SIZE", -1, true, "world_size");
    if (world_size < 1) {
      throw Error(fmt::format("World: world size must be at least 1, got {}", world_size));
    }
    if (rank < 0 || rank >= world_size) {
      throw Error(
          fmt::format("World: rank {} is out of range for world size {} (ranks are 0 .. "
                      "{})",
                      rank, world_size, world_size - 1));
    }
    local_rank = env_int("LOCAL_RANK", rank, false, "local_rank");
    local_world_size = env_int("LOCAL_WORLD_SIZE", world_size, false, "local_world_size");
    name = opts.name.empty() ? fmt::format("rank{}", rank) : opts.name;
    host = host_key();
    if (opts.timeout.count() <= 0) throw Error("World: timeout must be positive");
  }

  void connect() {
    std::string init = opts.init_method.empty() ? "env://" : opts.init_method;
    if (init.rfind("file://", 0) == 0) {
      const std::string path = init.substr(7);
      if (path.empty()) throw Error("World: init_method file:// needs a path");
      try {
        store = c10::make_intrusive<c10d::FileStore>(path, world_size);
      } catch (const std::exception& e) {
        throw Error(
            fmt::format("World: cannot open the FileStore {}: {}", path, detail::message_of(e)));
      }
      store->setTimeout(ms(opts.timeout));
      return;
    }
    if (init.rfind("tcp://", 0) == 0) {
      const std::string hp = init.substr(6);
      const auto colon = hp.rfind(':');
      if (colon == std::string::npos) {
        throw Error(fmt::format("World: init_method '{}' must be tcp://host:port", init));
      }
      master_addr = hp.substr(0, colon);
      try {
        master_port = std::stoi(hp.substr(colon + 1));
      } catch (const std::exception&) {
        throw Error(fmt::format("World: init_method '{}' has a bad port", init));
      }
    } else if (init == "env://") {
      if (!opts.master_addr.empty()) {
        master_addr = opts.master_addr;
      } else if (auto a = env("MASTER_ADDR")) {
        master_addr = *a;
      } else {
        throw Error(
            "World: the master address is not given: set WorldOptions::master_addr or "
            "MASTER_ADDR (as torchrun and `torchpar run` do)");
      }
      master_port = opts.master_port >= 0 ? opts.master_port
                                          : env_int("MASTER_PORT", -1, true, "master_port");
    } else {
      throw Error(fmt::format(
          "World: unknown init_method '{}': expected env://, tcp://host:port or file:///path",
          init));
    }
    if (master_port <= 0 || master_port > 65535) {
      throw Error(fmt::format("World: master port {} is out of range 1..65535", master_port));
    }
    if (opts.python_compatible) {
      connect_tcp_store();
    } else {
      connect_our_store();
    }
    if (auto ifname = env("GLOO_SOCKET_IFNAME")) {
      device.interface = *ifname;
    } else if (auto a = env("TORCHPAR_GLOO_ADDR")) {
      device.address = *a;
    } else {
      device.address = local_address_towards(master_addr, master_port);
    }
  }

  /// c10d's TCPStore, as Python ranks expect it (unauthenticated; listens on every
  /// interface: LibTorch 1.13 has no bind address). Only for python_compatible.
  void connect_tcp_store() {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(master_port);
    o.isServer = rank == 0;
    o.numWorkers = world_size;
    // Python ranks count arrivals on the store's init key: take part when mixing with them.
    o.waitWorkers = true;
    o.timeout = ms(opts.timeout);
    try {
      store = c10::make_intrusive<c10d::TCPStore>(master_addr, o);
    } catch (const std::exception& e) {
      const char* why = detail::message_of(e);
      if (rank == 0) {
        throw Error(fmt::format("World: rank 0 cannot serve the store on {}:{}: {}", master_addr,
                                master_port, why));
      }
      throw TimeoutError(
          fmt::format("World: rank {} cannot reach the master {}:{} within {:.1f} s: {}", rank,
                      master_addr, master_port, opts.timeout.count(), why));
    }
  }

  /// torchpar's store: rank 0 serves it on the master address (or store_bind_addr), every
  /// rank (rank 0 too) connects and proves the job's key.
  void connect_our_store() {
    const AuthKey key = opts.authkey.empty() ? default_authkey() : opts.authkey;
    if (rank == 0) {
      std::string bind = opts.store_bind_addr;
      if (bind.empty()) bind = env("TORCHPAR_STORE_BIND_ADDR").value_or(master_addr);
      server = std::make_unique<detail::StoreServer>(bind, master_port, key, ms(opts.timeout));
    }
    try {
      store =
          c10::make_intrusive<detail::StoreClient>(master_addr, master_port, key, ms(opts.timeout));
    } catch (const AuthenticationError& e) {
      throw AuthenticationError(
          fmt::format("World: rank {} was refused by {}", rank, e.what_without_backtrace()));
    } catch (const Error& e) {
      throw TimeoutError(
          fmt::format("World: rank {} cannot reach the master {}:{} within {:.1f} s: {}", rank,
                      master_addr, master_port, opts.timeout.count(), e.what_without_backtrace()));
    }
  }

  /// Every rank announces itself; every rank checks that all announced the same world size.
  void join_world() {
    members.assign(static_cast<size_t>(world_size), {});
    names.assign(static_cast<size_t>(world_size), "");
    if (opts.python_compatible) {
      names[static_cast<size_t>(rank)] = name;
      members[static_cast<size_t>(rank)] = {::getpid(), host};
      return;
    }
    const int64_t seen = store->add(fmt::format("torchpar/world/joined/{}", rank), 1);
    if (seen > 1) {
      throw Error(fmt::format("World: rank {} joined twice (another process already uses rank {})",
                              rank, rank));
    }
    store->set(fmt::format("torchpar/world/rank/{}", rank),
               bytes_of(fmt::format("{}\n{}\n{}\n{}", world_size, ::getpid(), host, name)));
    const auto deadline =
        std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(opts.timeout);
    for (int q = 0; q < world_size; ++q) {
      const std::string key = fmt::format("torchpar/world/rank/{}", q);
      const auto left = std::max(std::chrono::milliseconds(1),
                                 std::chrono::duration_cast<std::chrono::milliseconds>(
                                     deadline - std::chrono::steady_clock::now()));
      try {
        store->wait({key}, left);
      } catch (const RankLostError&) {
        throw;
      } catch (const std::exception&) {
        throw TimeoutError(fmt::format(
            "World: rank {} did not join within {:.1f} s (world size {}, this is rank {})", q,
            opts.timeout.count(), world_size, rank));
      }
      std::istringstream in(string_of(store->get(key)));
      std::string ws, pid, h, nm;
      std::getline(in, ws);
      std::getline(in, pid);
      std::getline(in, h);
      std::getline(in, nm);
      if (ws != std::to_string(world_size)) {
        throw Error(
            fmt::format("World: ranks disagree on the world size: rank {} says {}, rank {} says {}",
                        q, ws, rank, world_size));
      }
      members[static_cast<size_t>(q)] = {std::atoi(pid.c_str()), h};
      names[static_cast<size_t>(q)] = nm;
    }
  }

  CollectiveGroup make_group(std::vector<int> ranks, Backend backend,
                             std::optional<Seconds> timeout) {
    std::lock_guard<std::mutex> g(mu);
    if (destroyed) throw ClosedError("World: destroyed");
    if (ranks.empty()) {
      for (int r = 0; r < world_size; ++r) ranks.push_back(r);
    }
    std::set<int> uniq;
    for (int r : ranks) {
      if (r < 0 || r >= world_size) {
        throw Error(
            fmt::format("World::create_collective_group: rank {} is out of range for "
                        "world size {}",
                        r, world_size));
      }
      if (!uniq.insert(r).second) {
        throw Error(fmt::format("World::create_collective_group: rank {} is listed twice", r));
      }
    }
    const auto it = std::find(ranks.begin(), ranks.end(), rank);
    if (it == ranks.end()) {
      throw Error(
          fmt::format("World::create_collective_group: this rank ({}) is not in the "
                      "group [{}]; only members create a group",
                      rank, join(ranks)));
    }
    const int rel = static_cast<int>(it - ranks.begin());
    const int n = created[ranks]++;
    const std::string key = fmt::format("torchpar/group/{}/{}/", join(ranks), n);
    auto gstore = c10::make_intrusive<c10d::PrefixStore>(key, store);
    const Seconds t = timeout.value_or(opts.timeout);
    const auto t_ms = ms(t);

    // Which backend: every member publishes its host; shm only when all are on one host.
    if (backend != Backend::kGloo) {
      gstore->set(fmt::format("host/{}", rel), bytes_of(host));
      bool one_host = true;
      for (size_t q = 0; q < ranks.size(); ++q) {
        const std::string hk = fmt::format("host/{}", q);
        try {
          gstore->wait({hk}, t_ms);
        } catch (const RankLostError&) {
          throw;
        } catch (const std::exception&) {
          throw TimeoutError(fmt::format(
              "World::create_collective_group: rank {} did not join group [{}] within {:.1f} s",
              ranks[q], join(ranks), t.count()));
        }
        if (string_of(gstore->get(hk)) != host) one_host = false;
      }
      if (!one_host && backend == Backend::kShm) {
        throw Error(
            fmt::format("World::create_collective_group: backend shm needs every rank "
                        "of [{}] on one host; use gloo or auto",
                        join(ranks)));
      }
      backend = one_host ? Backend::kShm : Backend::kGloo;
    }
    std::vector<detail::MemberInfo> info;
    for (int r : ranks) info.push_back(members[static_cast<size_t>(r)]);
    const std::string gname = fmt::format("group [{}] #{} (rank {} of {}, {})", join(ranks), n, rel,
                                          ranks.size(), to_string(backend));
    auto gloo = detail::create_gloo_backend(
        {.store = c10::make_intrusive<c10d::PrefixStore>("gloo", gstore),
         .rank = rel,
         .world_ranks = ranks,
         .timeout = t,
         .name = gname,
         .device = device,
         .members = info,
         .my_host = host});
    if (backend == Backend::kGloo) return CollectiveGroup(gloo);
    return CollectiveGroup(
        detail::create_shm_backend({.store = c10::make_intrusive<c10d::PrefixStore>("shm", gstore),
                                    .rank = rel,
                                    .world_ranks = ranks,
                                    .timeout = t,
                                    .name = gname,
                                    .p2p = gloo}));
  }

  CollectiveGroup& get_default_group() {
    {
      std::lock_guard<std::mutex> g(mu);
      if (default_group) return *default_group;
      if (destroyed) throw ClosedError("World: destroyed");
    }
    if (!opts.python_compatible) {
      auto grp = make_group({}, Backend::kGloo, std::nullopt);
      std::lock_guard<std::mutex> g(mu);
      default_group = std::move(grp);
      return *default_group;
    }
    // The key layout of torch.distributed.init_process_group (LibTorch 1.13): the default
    // group's store is PrefixStore("default_pg"), the gloo group's PrefixStore("0") inside it,
    // then a store-based barrier on "store_based_barrier_key:1".
    auto pg_store = c10::make_intrusive<c10d::PrefixStore>("default_pg", store);
    std::vector<int> all;
    for (int r = 0; r < world_size; ++r) all.push_back(r);
    auto gloo = detail::create_gloo_backend(
        {.store = c10::make_intrusive<c10d::PrefixStore>("0", pg_store),
         .rank = rank,
         .world_ranks = all,
         .timeout = opts.timeout,
         .name = fmt::format("default group (rank {} of {}, gloo)", rank, world_size),
         .device = device,
         .members = members,
         .my_host = host});
    const std::string key = "store_based_barrier_key:1";
    pg_store->add(key, 1);
    if (!detail::store_wait_count(*pg_store, key, world_size, deadline_after(opts.timeout))) {
      throw TimeoutError("World: not every rank created the default group in time");
    }
    detail::set_gloo_sequence_number(*gloo);
    std::lock_guard<std::mutex> g(mu);
    default_group = CollectiveGroup(gloo);
    return *default_group;
  }

  /// Rank 0 serves the store: it waits (briefly) for the others to leave before it goes.
  void leave() noexcept {
    if (destroyed || !store) return;
    destroyed = true;
    try {
      if (default_group) default_group->destroy();
      if (!opts.python_compatible) {
        store->add("torchpar/world/left", 1);
        if (rank == 0 && std::uncaught_exceptions() == 0) {
          // Wait (at most 10 s) while some other rank may still use the store.
          detail::store_wait_count(
              *store, "torchpar/world/left", world_size,
              deadline_after(std::min<Seconds>(std::chrono::seconds(10), opts.timeout)), [&] {
                for (int q = 1; q < world_size; ++q) {
                  const auto& m = members[static_cast<size_t>(q)];
                  if (m.host != host || detail::pid_alive(m.pid)) return true;
                }
                return false;
              });
        }
      }
    } catch (...) {  // the store may be gone already: nothing to wait for
    }
    store.reset();
    server.reset();  // closes every connection, joins its threads
  }
};

World::World(WorldOptions options) : impl_(std::make_unique<Impl>()) {
  // Gloo and the store write to sockets without MSG_NOSIGNAL: a peer that died would kill
  // this process with SIGPIPE instead of failing the operation. Python ignores SIGPIPE;
  // do the same unless the program chose a disposition of its own.
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
  impl_->opts = std::move(options);
  impl_->resolve();
  impl_->connect();
  try {
    impl_->join_world();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(fmt::format(
        "World: rank {} lost the connection to the store at {}:{} while joining (did rank 0 "
        "fail or refuse the world?): {}",
        impl_->rank, impl_->master_addr, impl_->master_port, detail::message_of(e)));
  }
}

World::~World() {
  if (impl_) impl_->leave();
}
World::World(World&&) noexcept = default;
World& World::operator=(World&&) noexcept = default;

int World::get_rank() const { return impl_->rank; }
int World::get_world_size() const { return impl_->world_size; }
const std::string& World::get_name() const { return impl_->name; }
int World::get_local_rank() const { return impl_->local_rank; }
int World::get_local_world_size() const { return impl_->local_world_size; }
std::vector<std::string> World::get_names() const { return impl_->names; }

CollectiveGroup World::create_collective_group(
    std::vector<int> ranks, Backend backend, std::optional<std::chrono::duration<double>> timeout) {
  return impl_->make_group(std::move(ranks), backend, timeout);
}

CollectiveGroup& World::default_group() { return impl_->get_default_group(); }

void World::destroy() { impl_->leave(); }

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
