#include "dist/create_group.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <sstream>

#include "core/deadline.h"
#include "core/host_identity.h"
#include "dist/backend/gloo/backend.h"
#include "dist/backend/hierarchical/backend.h"
#include "dist/backend/shm/backend.h"
#include "dist/store.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"

namespace torchpar::detail {
namespace {

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

/// The local address that routes to addr:port (a UDP connect sends nothing); "" when none.
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

std::string ranks_text(const std::vector<int>& v) { return fmt::format("{}", fmt::join(v, ",")); }

}  // namespace

GlooDeviceSpec gloo_device_for(const c10::intrusive_ptr<c10d::Store>& store,
                               const std::string& master_addr, int master_port) {
  GlooDeviceSpec device;
  if (auto ifname = env_text("GLOO_SOCKET_IFNAME")) {
    device.interface = *ifname;
    return device;
  }
  if (auto a = env_text("TORCHPAR_GLOO_ADDR")) {
    device.address = *a;
    return device;
  }
  if (!master_addr.empty()) {
    device.address = local_address_towards(master_addr, master_port);
    return device;
  }
  c10d::Store* s = store.get();
  for (int depth = 0; s != nullptr && depth < 64; ++depth) {
    if (auto* prefix = dynamic_cast<c10d::PrefixStore*>(s)) {
      s = prefix->getUnderlyingStore().get();
    } else {
      if (auto* tcp = dynamic_cast<c10d::TCPStore*>(s)) {
        device.address = local_address_towards(tcp->getHost(), tcp->getPort());
      }
      break;
    }
  }
  return device;
}

CollectiveGroup create_collective_group(const GroupSetup& setup) {
  const auto& ranks = setup.world_ranks;
  const int n = static_cast<int>(ranks.size());
  const int rel = setup.rank;
  if (!setup.store) throw Error(fmt::format("{}: no store to meet on", setup.label));
  if (rel < 0 || rel >= n) {
    throw Error(fmt::format("{}: rank {} is out of range for {} ranks", setup.label, rel, n));
  }
  const std::string my_host = host_key();
  std::vector<MemberInfo> info = setup.members;
  Backend backend = setup.backend;
  // Which backend: every member publishes its pid and host; shm only when all are on one
  // host, hierarchical when they span hosts and some host holds more than one of them.
  if (backend != Backend::kGloo || static_cast<int>(info.size()) != n) {
    info.assign(static_cast<size_t>(n), {});
    setup.store->set(fmt::format("member/{}", rel),
                     store_bytes(fmt::format("{}\n{}", ::getpid(), my_host)));
    std::vector<std::string> keys;
    for (int q = 0; q < n; ++q) keys.push_back(fmt::format("member/{}", q));
    const int missing = store_wait_keys(*setup.store, keys, Deadline::after(setup.timeout).at());
    if (missing >= 0) {
      throw TimeoutError(fmt::format("{}: rank {} did not join group [{}] within {:.1f} s",
                                     setup.label, ranks[static_cast<size_t>(missing)],
                                     ranks_text(ranks), setup.timeout.count()));
    }
    for (int q = 0; q < n; ++q) {
      std::istringstream in(store_string(setup.store->get(keys[static_cast<size_t>(q)])));
      std::string pid, host;
      if (!std::getline(in, pid) || !std::getline(in, host)) {
        throw Error(fmt::format("{}: rank {} published a malformed member record", setup.label,
                                ranks[static_cast<size_t>(q)]));
      }
      info[static_cast<size_t>(q)] = {std::atoi(pid.c_str()), host};
    }
  }
  if (backend != Backend::kGloo) {
    bool one_host = true;
    for (const auto& m : info) one_host = one_host && m.host == my_host;
    if (!one_host && backend == Backend::kShm) {
      throw Error(fmt::format(
          "{}: backend shm needs every rank of [{}] on one host; use hierarchical, gloo or auto",
          setup.label, ranks_text(ranks)));
    }
    if (backend == Backend::kAuto) {
      const size_t hosts = hosts_of(info).size();
      backend = one_host                         ? Backend::kShm
                : hosts < static_cast<size_t>(n) ? Backend::kHierarchical
                                                 : Backend::kGloo;
    }
  }
  const std::string name =
      fmt::format("{} (rank {} of {}, {})", setup.label, rel, n, to_string(backend));
  // The group in Gloo's terms; the flat Gloo group (every backend's send/recv) meets under
  // "gloo" in the group's store.
  const GroupSpec spec{.store = setup.store,
                       .rank = rel,
                       .world_ranks = ranks,
                       .timeout = setup.timeout,
                       .name = name};
  const GlooBackendOptions group{
      .group = spec, .device = setup.device, .members = info, .my_host = my_host};
  GlooBackendOptions flat = group;
  flat.group.store = c10::make_intrusive<c10d::PrefixStore>("gloo", setup.store);
  auto gloo = create_gloo_backend(flat);
  std::shared_ptr<GroupBackend> made;
  if (backend == Backend::kGloo) {
    made = gloo;
  } else if (backend == Backend::kHierarchical) {
    made = create_hierarchical_backend({.gloo = group, .flat = gloo});
  } else {
    GroupSpec shm = spec;
    shm.store = c10::make_intrusive<c10d::PrefixStore>("shm", setup.store);
    made = create_shm_backend({.group = shm, .p2p = gloo});
  }
  made->set_lost_ranks(setup.lost);
  return CollectiveGroup(std::move(made));
}

}  // namespace torchpar::detail
