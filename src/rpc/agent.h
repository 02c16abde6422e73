#pragma once
// The RPC engine of one process: its transport, the calls it waits for, the services,
// functions and values it serves. RpcGroup (rpc_group.cpp) is a named view on it; the World
// starts one per process with its first group (create.cpp).
//
// Files: agent.cpp (construction, tables, sending, the timer, shutdown), agent_calls.cpp
// (calls, replies, the dispatch of received messages), agent_rref.cpp (the RRef protocol).
//
// Threads (docs/thread_model.md, "RPC agent"): the transport's threads deliver messages
// (on_message, inline: a TCP connection's reader thread, or TensorPipe's shm loop thread; so
// messages of different members may be handled concurrently, those of one member in arrival
// order): replies complete futures there, RRef bookkeeping happens there (so it follows
// arrival order), fetches go to the agent's thread pool, and so do calls, except on a TCP
// reader (a message with may_block), which runs the call itself: the transport gives the
// connection another reader when the call runs long or waits. One timer thread fails calls
// whose deadline passed. User threads, readers running calls and the pool send.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <typeindex>
#include <vector>

#include "rpc/message.h"
#include "rpc/rpc_state.h"
#include "rpc/transport/transport.h"
#include "torchpar/pool/thread_pool.h"
#include "torchpar/rpc/rpc_group.h"

namespace torchpar::detail {

struct RpcAgentOptions {
  std::string name;                ///< this member
  std::vector<std::string> names;  ///< every World member, by rank
  std::vector<std::string> hosts;  ///< their host keys, by rank
  c10::intrusive_ptr<c10d::Store> store;
  AuthKey authkey;
  std::string bind_host = "127.0.0.1";
  size_t num_threads = 4;
  bool shm = true;
  std::chrono::duration<double> store_timeout = std::chrono::seconds(300);
};

/// A value this member owns for others: a remote() result or a paired value.
struct OwnedValue {
  std::string creator;  ///< who made it (remote() caller; the owner for pairs)
  bool ready = false;
  RpcValue value;                 ///< remote() result (encoded for another host)
  std::string error_type, error;  ///< remote() whose function threw
  uint8_t error_status = 0;
  std::shared_ptr<void> object;  ///< paired value
  std::type_index type = typeid(void);
  std::function<RpcValue(bool)> encode;        ///< paired value: encodes a copy
  int64_t refs = 0;                            ///< counted user references (remote() results)
  bool pinned = false;                         ///< paired: lives until unpair
  std::vector<std::function<void()>> waiters;  ///< run once ready
};

// ---- shared by agent*.cpp ------------------------------------------------------------------

/// The function registered under `name` in this process, or nullptr.
std::shared_ptr<RpcHandler> find_rpc_function(const std::string& name);
/// The deadline of a call with `timeout` (time_point::max() for none or > 1e9 s).
std::chrono::steady_clock::time_point rpc_deadline(Timeout timeout);
/// The error a reply's status stands for (RpcRemoteError, RpcKeyNotFoundError for `key`,
/// RpcPeerLostError; ProtocolError for an unknown status).
std::exception_ptr rpc_status_error(uint8_t status, const std::string& type, const std::string& msg,
                                    const std::string& peer, const std::string& key);
/// The message of a call to `peer` that ended with its connection: names the member and says
/// it is gone, however the transport noticed (`why`).
std::string rpc_gone_message(const std::string& what, const std::string& peer,
                             const std::string& why);

/// The process's RPC engine. Lifetime: shared by the World (RpcRuntime), every RpcGroup and
/// RRefState; shutdown() (World::destroy, the destructor) stops it.
class RpcAgent : public std::enable_shared_from_this<RpcAgent> {
 public:
  enum class Target : uint8_t { kFunction = 0, kService = 1 };

  /// Starts the transport and publishes its address under torchpar/rpc/addr/<name>.
  static std::shared_ptr<RpcAgent> create(RpcAgentOptions options);
  ~RpcAgent();

  const std::string& name() const { return opts_.name; }
  bool is_member(const std::string& member) const;
  /// ValueError when `member` is not a World member.
  bool same_host(const std::string& member) const;

  /// Runs fn(store) on the World's store. The store's client is thread-safe but runs one
  /// request at a time, so nothing here may wait inside the store (c10d's wait): waits
  /// poll with short requests (store_poll_keys, store_barrier), leaving the store to the
  /// other threads of this process (a reply's address lookup, another group's registration).
  template <class Fn>
  auto with_store(Fn fn) {
    return fn(*opts_.store);
  }
  std::chrono::duration<double> store_timeout() const { return opts_.store_timeout; }

  void open_group(const std::string& group);
  /// Fails this member's calls of `group` in flight and refuses the group's calls.
  void close_group(const std::string& group);

  void add_service(const std::string& group, const std::string& key, RpcHandler fn);
  bool remove_service(const std::string& group, const std::string& key);
  bool has_service(const std::string& group, const std::string& key) const;

  /// A World-unique RRef id made by this member.
  std::string new_rref_id();
  void add_pinned(const std::string& id, std::shared_ptr<OwnedValue> value);
  void remove_pinned(const std::string& id);
  std::shared_ptr<OwnedValue> find_owned(const std::string& id) const;

  /// Sends a call; the future completes with its reply, its error, or TimeoutError.
  /// `rref_id` non-empty: the callee keeps the result as that RRef and replies nothing
  /// (the returned future is then nullptr).
  std::shared_ptr<RpcFutureState> call(const std::string& to, Target target,
                                       const std::string& group, const std::string& name,
                                       RpcValue args, Timeout timeout,
                                       const std::string& rref_id = {});
  /// The value of an RRef (see RRef::to_here).
  RpcValue fetch(const RRefState& rref, Timeout timeout);
  /// A counted user reference is gone (RRefState's destructor). Never throws.
  void release(const RRefState& rref) noexcept;

  size_t owned_rrefs() const;
  size_t pending_calls() const;

  /// Stops the transport, fails every call in flight, joins the threads. Idempotent.
  void shutdown();

 private:
  explicit RpcAgent(RpcAgentOptions options);
  using Header = RpcHeader;
  using Clock = std::chrono::steady_clock;
  /// A call waiting for its reply (pending_, by call id).
  struct Pending {
    std::string to, group, what;
    std::shared_ptr<RpcFutureState> state;
    std::chrono::steady_clock::time_point deadline;
    double seconds = 0;
  };

  /// The transport address `member` published (cached; polls the store until its deadline).
  std::string address_of(const std::string& member);
  void send(const std::string& to, const Header& h, RpcValue body,
            std::chrono::steady_clock::time_point deadline);
  /// A message from `peer` (receive thread): replies and RRef bookkeeping inline, fetches to
  /// the pool, calls to the pool or (msg.may_block) run here. Blocks only in a call run here.
  void on_message(const std::string& peer, rpc::Message msg);
  /// `peer`'s connection ended (receive or dispatch thread): fails the calls waiting for it
  /// and frees the values only it referenced.
  void on_peer_lost(const std::string& peer, const std::string& why);
  /// Runs a call (pool thread) and replies, or stores the result as the call's RRef.
  void execute(const std::string& peer, Header h, RpcValue args);
  /// Replies to a fetch (pool thread), at once or when the value becomes ready.
  void serve_fetch(const std::string& peer, Header h);
  /// A remote() call from `peer` arrived: files its unready value with one reference.
  void rref_created(const std::string& peer, const std::string& id);
  /// A user reference to `id` is gone: one reference less; freed at zero (unless pinned).
  void rref_deleted(const std::string& id);
  /// Frees the unpinned values `peer` created (it is gone; nobody else can reach them).
  void drop_values_of(const std::string& peer);
  void reply(const std::string& peer, uint64_t id, uint8_t status, const std::string& type,
             const std::string& error, RpcValue body);
  void reply_owned(const std::string& peer, uint64_t id, const OwnedValue& v);
  std::shared_ptr<RpcFutureState> track(const std::string& to, const std::string& group,
                                        const std::string& what, Timeout timeout, uint64_t* id);
  void fail_pending(const std::function<bool(const Pending&)>& which,
                    const std::function<std::exception_ptr(const Pending&)>& error);
  /// The timer thread: fails calls whose deadline passed, until shutdown.
  void timer_loop();

  RpcAgentOptions opts_;
  std::unique_ptr<rpc::Transport> transport_;
  std::unique_ptr<ThreadPoolCore> pool_;
  std::string address_;

  // Everything below is guarded by mu_.
  mutable std::mutex mu_;
  std::condition_variable timer_cv_;  // a new earliest deadline, or shutdown
  /// When the timer thread wakes next (time_point::max(): not before a notify); min() while
  /// it is awake, when it sees every call filed anyway.
  std::chrono::steady_clock::time_point timer_wake_ = std::chrono::steady_clock::time_point::min();
  bool closed_ = false;
  uint64_t next_call_ = 1;
  uint64_t next_rref_ = 1;
  std::map<uint64_t, Pending> pending_;           // calls and fetches awaiting a reply
  std::map<std::string, std::string> addresses_;  // member -> transport address (cache)
  std::set<std::string> open_groups_;             // groups this member is in
  /// (group, key) -> the service this member registered.
  std::map<std::pair<std::string, std::string>, std::shared_ptr<RpcHandler>> services_;
  std::map<std::string, std::shared_ptr<OwnedValue>> owned_;  // RRef id -> value held here
  std::thread timer_;
};

}  // namespace torchpar::detail
