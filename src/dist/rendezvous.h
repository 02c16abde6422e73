#pragma once
// A World's rendezvous: who this rank is, where the store is, and every rank's pid, host and
// name. Group creation (world.cpp) builds on it.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>
#include <vector>

#include "core/host_identity.h"  // host_key(): ranks with equal keys share a host
#include "dist/group_spec.h"     // MemberInfo, GlooDeviceSpec
#include "dist/lost_ranks.h"
#include "dist/store.h"
#include "torchpar/dist/world.h"

namespace torchpar::detail {

/// This rank's view of the job once every rank joined.
///
/// Construction is collective: it resolves the options (missing ones from RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), serves the store on rank 0
/// (torchpar's authenticated StoreServer; c10d's TCPStore with python_compatible; or every
/// rank opens the FileStore of file://), connects, announces this rank (world size, pid,
/// host key, name) and reads every other rank's announcement, each within the timeout.
/// Errors: those World's constructor documents (torchpar::Error, TimeoutError naming the
/// rank that did not join, AuthenticationError, RankLostError when rank 0 is gone).
/// Lifetime: leave() (or the destructor) drops the store; rank 0, which serves it, first
/// waits (at most 10 s) for the other ranks to leave, except those known gone: a rank of
/// this host whose process is gone, or one a group of this process found lost. Safety: the fields
/// are written by the constructor only; leave() from one thread.
class Rendezvous {
 public:
  explicit Rendezvous(WorldOptions options);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  /// Idempotent; never throws (the store may be gone already).
  void leave() noexcept;

  WorldOptions opts;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string name;                 // this rank's
  std::vector<std::string> names;   // by world rank
  std::vector<MemberInfo> members;  // by world rank (pid, host key)
  std::string host;                 // this rank's host key
  std::string master_addr;
  int master_port = 0;
  GlooDeviceSpec device;  // where this rank's Gloo groups bind
  c10::intrusive_ptr<c10d::Store> store;
  /// Ranks this process's groups found lost; rank 0's leave does not wait for them.
  std::shared_ptr<LostRanks> lost;

 private:
  void resolve();
  void connect();
  void connect_tcp_store();
  void connect_our_store();
  void join_world();

  std::unique_ptr<StoreServer> server_;  // rank 0, unless python_compatible / file://
  bool left_ = false;
};

}  // namespace torchpar::detail
