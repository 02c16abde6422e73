#pragma once
// The state behind RpcFuture and RRef (torchpar/rpc/rpc_group.h declares them; only the RPC
// layer sees their fields).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "torchpar/rpc/rpc_group.h"

namespace torchpar::detail {

class RpcAgent;

/// One call's outcome, shared by the caller's RpcFuture and the agent.
/// Safety: thread-safe; complete() takes effect once (a late reply after a timeout is dropped).
struct RpcFutureState {
  mutable std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  /// 1 once done (set under `mu`, read without it): what wait() spins on before it sleeps.
  uint32_t ready = 0;
  RpcValue value;
  std::exception_ptr error;
  std::vector<std::function<void()>> callbacks;

  /// How long wait() spins before it sleeps: 60 us, or none after a small request (< 64 KiB)
  /// when the transport's reader spins for the reply itself (Transport::reader_spins: TCP,
  /// the default; see wait()).
  std::chrono::microseconds spin{60};

  void complete(RpcValue v, std::exception_ptr e);
  /// Waits up to `timeout`; false when it passed first. Spins up to `spin` first, giving the
  /// core away every few microseconds.
  bool wait(Timeout timeout);
};

/// One RRef as this process knows it: where its value lives and, on the owner, the value.
struct RRefState {
  std::shared_ptr<RpcAgent> agent;
  std::string owner;
  std::string id;       ///< "<creator>#<n>", unique in the World
  bool counted = true;  ///< false for paired values (pinned until unpair)
  ~RRefState();         ///< a counted user reference tells the owner it is gone
};

}  // namespace torchpar::detail
