#include "dist/rendezvous.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <optional>
#include <sstream>

#include "core/deadline.h"
#include "core/liveness.h"
#include "core/message_of.h"
#include "core/signals.h"
#include "dist/create_group.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/dist/launch_env.h"

namespace torchpar::detail {
namespace {

using Seconds = std::chrono::duration<double>;

std::chrono::milliseconds to_ms(Seconds s) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(s);
}

/// A launcher variable (RANK, WORLD_SIZE, ...) as World reads it: the core table's parser,
/// its errors prefixed with "World: "; `fallback` when unset, or an Error naming the option
/// and the variable when `required`.
int env_int(const char* name, int fallback, bool required, const char* what) {
  std::optional<int> v;
  try {
    v = torchpar::env_int(name);
  } catch (const ValueError& e) {
    throw ValueError(fmt::format("World: {}", e.what_without_backtrace()));
  }
  if (!v) {
    if (required) {
      throw Error(fmt::format(
          "World: {} is not given: set WorldOptions::{} or the environment variable {} (as "
          "torchrun and `torchpar run` do)",
          what, what, name));
    }
    return fallback;
  }
  return *v;
}

}  // namespace

Rendezvous::Rendezvous(WorldOptions options) : opts(std::move(options)) {
  // Gloo and the store write to sockets without MSG_NOSIGNAL.
  detail::ignore_sigpipe_if_default();
  resolve();
  connect();
  try {
    join_world();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(fmt::format(
        "World: rank {} lost the connection to the store at {}:{} while joining (did rank 0 "
        "fail or refuse the world?): {}",
        rank, master_addr, master_port, message_of(e)));
  }
}

Rendezvous::~Rendezvous() { leave(); }

void Rendezvous::resolve() {
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
  lost = std::make_shared<LostRanks>(world_size);
}

void Rendezvous::connect() {
  std::string init = opts.init_method.empty() ? "env://" : opts.init_method;
  if (init.rfind("file://", 0) == 0) {
    const std::string path = init.substr(7);
    if (path.empty()) throw Error("World: init_method file:// needs a path");
    try {
      store = c10::make_intrusive<c10d::FileStore>(path, world_size);
    } catch (const std::exception& e) {
      throw Error(fmt::format("World: cannot open the FileStore {}: {}", path, message_of(e)));
    }
    store->setTimeout(to_ms(opts.timeout));
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
    } else if (auto a = env_text("MASTER_ADDR")) {
      master_addr = *a;
    } else {
      throw Error(
          "World: the master address is not given: set WorldOptions::master_addr or "
          "MASTER_ADDR (as torchrun and `torchpar run` do)");
    }
    master_port =
        opts.master_port >= 0 ? opts.master_port : env_int("MASTER_PORT", -1, true, "master_port");
  } else {
    throw Error(fmt::format(
        "World: unknown init_method '{}': expected env://, tcp://host:port or file:///path", init));
  }
  if (master_port <= 0 || master_port > 65535) {
    throw Error(fmt::format("World: master port {} is out of range 1..65535", master_port));
  }
  if (opts.python_compatible) {
    connect_tcp_store();
  } else {
    connect_our_store();
  }
  device = gloo_device_for(store, master_addr, master_port);
}

/// c10d's TCPStore, as Python ranks expect it (unauthenticated; listens on every
/// interface: LibTorch 1.13 has no bind address). Only for python_compatible.
void Rendezvous::connect_tcp_store() {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(master_port);
  o.isServer = rank == 0;
  o.numWorkers = world_size;
  // Python ranks count arrivals on the store's init key: take part when mixing with them.
  o.waitWorkers = true;
  o.timeout = to_ms(opts.timeout);
  try {
    store = c10::make_intrusive<c10d::TCPStore>(master_addr, o);
  } catch (const std::exception& e) {
    const char* why = message_of(e);
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
void Rendezvous::connect_our_store() {
  const AuthKey key = opts.authkey.empty() ? default_authkey() : opts.authkey;
  if (rank == 0) {
    std::string bind = opts.store_bind_addr;
    if (bind.empty()) bind = env_text("TORCHPAR_STORE_BIND_ADDR").value_or(master_addr);
    server_ = std::make_unique<StoreServer>(bind, master_port, key, to_ms(opts.timeout));
  }
  try {
    store = c10::make_intrusive<StoreClient>(master_addr, master_port, key, to_ms(opts.timeout));
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
void Rendezvous::join_world() {
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
             store_bytes(fmt::format("{}\n{}\n{}\n{}", world_size, ::getpid(), host, name)));
  const auto deadline = Deadline::after(opts.timeout).at();
  for (int q = 0; q < world_size; ++q) {
    // Key by key, so that a rank announcing another world size is named at once.
    const std::string key = fmt::format("torchpar/world/rank/{}", q);
    if (store_wait_keys(*store, {key}, deadline) >= 0) {
      throw TimeoutError(fmt::format(
          "World: rank {} did not join within {:.1f} s (world size {}, this is rank {})", q,
          opts.timeout.count(), world_size, rank));
    }
    std::istringstream in(store_string(store->get(key)));
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

void Rendezvous::leave() noexcept {
  if (left_ || !store) return;
  left_ = true;
  try {
    if (!opts.python_compatible) {
      const std::string key = "torchpar/world/left";
      auto left_key = [](int q) { return fmt::format("torchpar/world/left/{}", q); };
      if (rank == 0 && std::uncaught_exceptions() == 0) {
        // Rank 0 serves the store: wait (at most 10 s) while some other rank may still use
        // it, that is while one has not left and is not known gone (its process gone from
        // this host, or found lost by a group of this process).
        std::vector<bool> done(static_cast<size_t>(world_size), false);
        done[0] = true;
        auto keep_waiting = [&] {
          for (int q = 1; q < world_size; ++q) {
            if (done[static_cast<size_t>(q)]) continue;
            const auto& m = members[static_cast<size_t>(q)];
            if (lost->contains(q) || (m.host == host && !pid_alive(m.pid)) ||
                store->check({left_key(q)})) {
              done[static_cast<size_t>(q)] = true;
              continue;
            }
            return true;
          }
          return false;
        };
        store_barrier(
            *store, key, world_size,
            Deadline::after(std::min<Seconds>(std::chrono::seconds(10), opts.timeout)).at(),
            keep_waiting);
      } else {
        store->set(left_key(rank), store_bytes("1"));
        store->add(key, 1);
      }
    }
  } catch (...) {  // the store may be gone already: nothing to wait for
  }
  store.reset();
  server_.reset();  // closes every connection, joins its threads
}

}  // namespace torchpar::detail

namespace torchpar {

std::optional<LaunchEnv> launch_env() {
  // Presence first (env_value: set even if empty), then the numbers, so that the message says
  // what is missing before what is malformed.
  const std::optional<std::string> rank_text = env_value("RANK");
  const std::optional<std::string> size_text = env_value("WORLD_SIZE");
  const bool has_rank = rank_text && !rank_text->empty();
  const bool has_size = size_text && !size_text->empty();
  if (!has_rank && !has_size) return std::nullopt;
  if (!has_rank || !has_size) {
    throw ValueError(fmt::format(
        "{} is set in the environment but {} is not: a launcher (torchrun, `torchpar run`) sets "
        "both for each rank of a job; set both to run as one rank of a job, or neither",
        has_rank ? "RANK" : "WORLD_SIZE", has_rank ? "WORLD_SIZE" : "RANK"));
  }
  std::optional<int> rank, size;
  try {
    rank = env_int("RANK");
    size = env_int("WORLD_SIZE");
  } catch (const ValueError& e) {
    throw ValueError(
        fmt::format("RANK and WORLD_SIZE in the environment must be whole numbers "
                    "(RANK='{}', WORLD_SIZE='{}'): {}",
                    *rank_text, *size_text, e.what_without_backtrace()));
  }
  if (*size < 1 || *rank < 0 || *rank >= *size) {
    throw ValueError(
        fmt::format("RANK={} and WORLD_SIZE={} in the environment: need WORLD_SIZE >= 1 and 0 <= "
                    "RANK < WORLD_SIZE",
                    *rank, *size));
  }
  LaunchEnv env;
  env.rank = *rank;
  env.world_size = *size;
  env.local_rank = detail::env_int("LOCAL_RANK", env.rank, false, "local_rank");
  env.local_world_size =
      detail::env_int("LOCAL_WORLD_SIZE", env.world_size, false, "local_world_size");
  const std::optional<std::string> addr = env_text("MASTER_ADDR");
  const std::optional<std::string> port_text = env_value("MASTER_PORT");
  std::optional<int> port;
  try {
    port = env_int("MASTER_PORT");
  } catch (const ValueError&) {
    // reported below with MASTER_ADDR
  }
  if (!addr || !port || *port < 1 || *port > 65535) {
    throw ValueError(fmt::format(
        "RANK and WORLD_SIZE are set in the environment, so this process is one rank of a job, "
        "which also needs MASTER_ADDR and MASTER_PORT (rank 0's address and a port in 1..65535; "
        "got MASTER_ADDR={}, MASTER_PORT={})",
        addr ? fmt::format("'{}'", *addr) : "unset",
        port_text ? fmt::format("'{}'", *port_text) : "unset"));
  }
  env.master_addr = *addr;
  env.master_port = *port;
  return env;
}

}  // namespace torchpar
