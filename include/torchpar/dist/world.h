#pragma once
/// World: the ranks of a distributed job and their rendezvous (torch.distributed's
/// init_process_group, machin.parallel.distributed.World).

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torchpar/core/auth.h"
#include "torchpar/dist/collective_group.h"

namespace torchpar {

class RpcGroup;
struct RpcGroupOptions;

/// How a World finds its peers. Fields left unset come from the environment torchrun and
/// `torchpar run` set: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
/// MASTER_PORT.
struct WorldOptions {
  /// Name of this rank (machin's World(name=...)); default "rank<rank>".
  std::string name{};
  /// -1: from RANK / WORLD_SIZE.
  int rank = -1;
  int world_size = -1;
  /// "env://" (default: MASTER_ADDR/MASTER_PORT), "tcp://host:port" or "file:///path"
  /// (a c10d FileStore on a shared file system; the file must not exist before the run).
  std::string init_method{};
  /// Override MASTER_ADDR / MASTER_PORT (port -1: from the environment).
  std::string master_addr{};
  int master_port = -1;
  /// Seconds: rendezvous limit and the default timeout of every collective group.
  std::chrono::duration<double> timeout = std::chrono::seconds(300);
  /// Lay the store out as Python's torch.distributed.init_process_group does, so a Python
  /// rank (same LibTorch version) joins default_group() with backend gloo. Skips the
  /// world-size cross-check, which Python ranks would not answer.
  bool python_compatible = false;
  /// The job's key: every connection to rank 0's store and every RPC connection must prove
  /// it (the handshake of Python's multiprocessing.connection; see torchpar/core/auth.h).
  /// Empty: TORCHPAR_AUTHKEY (hex), as `torchpar run` sets it for its ranks (32 fresh random
  /// bytes per job). Without either, the store falls back to the per-user key file
  /// (default_authkey()) but RPC does not start: create_rpc_group throws ValueError.
  /// Ranks with different keys cannot join one World (nor call each other over RPC). The
  /// store does not use it with python_compatible (c10d's TCPStore has no authentication)
  /// nor with file:// (the file's permissions guard it); RPC always does.
  AuthKey authkey{};
  /// Address rank 0's store listens on. Empty: TORCHPAR_STORE_BIND_ADDR, else the master
  /// address itself (loopback for a one-host job, so the job is not reachable from the
  /// network). "0.0.0.0" or "::" listens on every interface: only when asked here.
  std::string store_bind_addr{};
};

/// Membership of one distributed job and the store its groups meet through.
///
/// Construction is collective: every rank constructs its World with the same world size;
/// rank 0 hosts the store (torchpar's authenticated store, bound to the master address;
/// c10d's TCPStore with python_compatible; or all share a FileStore). It returns when all
/// ranks joined. Safety: a World may be used from several threads; its groups may not (see
/// CollectiveGroup).
/// Errors (torchpar::Error, within `timeout`): rank outside [0, world_size), missing
/// RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, master unreachable, ranks that disagree on the
/// world size, a rank joining twice, a rank that never joins (TimeoutError naming it);
/// AuthenticationError when this rank's key differs from rank 0's; RankLostError naming
/// rank 0 when rank 0 (the store's host) goes away, here or in any later store use.
/// Source: torch.distributed.init_process_group, machin.parallel.distributed.World.
class World {
 public:
  explicit World(WorldOptions options = {});
  ~World();
  World(World&&) noexcept;
  World& operator=(World&&) noexcept;

  int get_rank() const;
  int get_world_size() const;
  const std::string& get_name() const;
  /// LOCAL_RANK / LOCAL_WORLD_SIZE when set, else rank / world size.
  int get_local_rank() const;
  int get_local_world_size() const;
  /// Names of every rank, by rank.
  std::vector<std::string> get_names() const;

  /// How many times the launcher restarted this job's workers before starting this process:
  /// TORCHELASTIC_RESTART_COUNT, which torchrun and `torchpar run` set (0 when unset, as for
  /// a process no elastic launcher started). Under torchrun a membership change (a node
  /// joins or leaves, the workers restart in a new round) does not increase it; only a
  /// failure does. Read from the environment at each call.
  /// Errors: ValueError naming the variable when it is not a whole number >= 0.
  /// Safety: thread-safe (as long as nobody changes the environment meanwhile).
  /// Source: torch.distributed.elastic's TORCHELASTIC_RESTART_COUNT.
  int restart_count() const;
  /// The rendezvous round this process was started in: TORCHPAR_RDZV_ROUND, which
  /// `torchpar run` sets and increases on every restart and every membership change; else
  /// restart_count() (under torchrun, which exports no round). Use it to tell a fresh start
  /// (0) from a restart, e.g. to call ElasticState::restore only when it is > 0.
  /// Errors, safety: as restart_count().
  int rendezvous_round() const;

  /// Creates a group of the world ranks `ranks` (empty: every rank). Collective over the
  /// members only: each member calls it with the same ranks, in the same order relative to
  /// its other group creations; non-members must not call it.
  /// `timeout`: the group's limit for each operation (default: the World's).
  /// Throws torchpar::Error when this rank is not in `ranks`, ranks repeat or are out of
  /// range, or kShm is asked for ranks on different hosts.
  CollectiveGroup create_collective_group(
      std::vector<int> ranks = {}, Backend backend = Backend::kAuto,
      std::optional<std::chrono::duration<double>> timeout = std::nullopt);

  /// The group of all ranks with backend gloo, laid out like Python's default process group
  /// when python_compatible is set (created on first use; collective on first use).
  CollectiveGroup& default_group();

  /// Creates the RPC group `group_name` of the World members named in `members` (machin's
  /// RpcGroup(group_name, group_members)): collective over those members (each calls it
  /// with the same name and members; it returns once all joined). The first group of a
  /// process starts its RPC agent: a TCP listener on 127.0.0.1 (TORCHPAR_RPC_ADDR names
  /// another host or IP; TensorPipe's shared memory serves members of this host), whose
  /// address is published in the World's store, and which accepts only peers proving the
  /// job's key. Include "torchpar/rpc/rpc_group.h" to use the result.
  ///
  /// Key:     WorldOptions::authkey, else TORCHPAR_AUTHKEY (hex), which `torchpar run` sets
  ///          to a fresh 32-byte key per job. Never the per-user key file: without a key
  ///          RPC does not start. Each member decides from its own options and environment
  ///          before anything listens; a member that refuses marks itself in the store, so
  ///          the others fail at once with a ValueError naming it instead of waiting for
  ///          options.timeout. The key is read when the process's agent starts (its first
  ///          group); later groups use the same agent and key.
  ///          ```cpp
  ///          World world(WorldOptions{.authkey = my_job_key});  // or TORCHPAR_AUTHKEY
  ///          auto group = world.create_rpc_group("workers", world.get_names());
  ///          ```
  /// Units:   options.timeout, seconds: how long to wait for every member to join.
  /// Errors:  ValueError when this member has no key ("set WorldOptions::authkey or
  ///          TORCHPAR_AUTHKEY (hex), as `torchpar run` does"), when TORCHPAR_AUTHKEY is
  ///          set but empty or not hex, or when another member refused for that reason
  ///          (naming it); a member that refused starts no listener. ValueError
  ///          also for an empty name or one with '/', unknown or repeated members, a caller
  ///          that is not a member, a name already created in this process; TimeoutError
  ///          naming a member that did not join within options.timeout; ClosedError after
  ///          destroy(); SystemError when the listener cannot start. A peer proving another
  ///          key is refused at connection time: calls to or from it fail with
  ///          AuthenticationError, and nothing it sent runs.
  /// Safety:  thread-safe. Source: machin.parallel.distributed.World.create_rpc_group.
  RpcGroup create_rpc_group(const std::string& group_name, std::vector<std::string> members);
  RpcGroup create_rpc_group(const std::string& group_name, std::vector<std::string> members,
                            const RpcGroupOptions& options);

  /// Destroys the default group and drops the store connection; the World is unusable after.
  void destroy();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// A TCP port that was free a moment ago: the kernel's pick for a socket bound to port 0,
/// on loopback (`loopback_only`) or on every address. Another process may take it before
/// you bind it; rendezvous on it fails clearly then, as torchrun's does.
///
/// Returns: a port number in [1, 65535], host byte order.
/// Errors:  torchpar::Error naming the failed syscall (socket, bind, getsockname).
/// Safety:  thread- and process-safe; nothing blocks. Source:
/// torch.distributed.elastic.utils.get_free_port /
///          torchrun's choice of MASTER_PORT with --rdzv-endpoint port 0.
int find_free_port(bool loopback_only = true);

}  // namespace torchpar
