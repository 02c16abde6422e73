#pragma once
// The one executor of a collective group: where CollectiveGroup decides sync vs async, so
// that every backend's collectives can be plain synchronous calls.

#include <c10/util/FunctionRef.h>

#include <functional>
#include <memory>
#include <thread>

#include "dist/backend/backend.h"
#include "dist/work.h"

namespace torchpar::detail {

/// A Work that completed without error (source -1), shared by every call that ran inline.
/// Thread-safe.
std::shared_ptr<PromiseWork> completed_work();

/// Runs a group's collectives one at a time, in issue order, on a backend whose calls are
/// synchronous.
///
/// A synchronous call first tries try_run_inline: on the caller's thread when nothing is
/// queued or running (no thread hop, so small collectives keep their latency); otherwise it
/// is submitted, queued behind the earlier asynchronous calls, and the caller waits for its
/// Work. Every submitted call is run by the executor's thread, started at the first one.
///
/// Guarantees: a call's Work completes (value or error) once the call ran; errors travel in
/// the Work as std::exception_ptr (try_run_inline: they propagate to its caller). Calls never
/// overlap.
/// Lifetime: the thread and every queued call hold the state, and the state holds the
/// backend, by shared_ptr: nothing is freed under a running call. stop() (and the
/// destructor) lets the queued calls finish, then joins the thread.
/// Safety: the group's contract: one calling thread at a time (submit, try_run_inline and
/// stop from any thread, but not at once; a hand-over between threads must synchronize, as
/// a mutex does). The executor's own thread is the only other one, and the fast path takes
/// no lock and no locked instruction: it runs inline only once every submitted call has
/// finished, which only the caller's next submit can change. Two threads caught calling at
/// once get torchpar::Error (a best-effort check, not a lock).
class GroupExecutor {
 public:
  using Op = std::function<void(GroupBackend&)>;

  explicit GroupExecutor(std::shared_ptr<GroupBackend> backend);
  ~GroupExecutor();
  GroupExecutor(const GroupExecutor&) = delete;
  GroupExecutor& operator=(const GroupExecutor&) = delete;

  /// Queues `op` for the executor's thread (see the class comment) and returns its Work.
  /// Errors: ClosedError after stop().
  std::shared_ptr<PromiseWork> submit(Op op);
  /// A synchronous call's fast path: runs `op` on the caller's thread and returns true when
  /// nothing is queued or running, else returns false without running it (then submit it).
  /// `op`'s exception propagates. Errors: ClosedError after stop().
  bool try_run_inline(c10::function_ref<void(GroupBackend&)> op);
  /// Lets queued calls finish, joins the thread; later submits throw ClosedError.
  void stop() noexcept;

 private:
  struct State;
  static void worker_loop(const std::shared_ptr<State>& state);
  std::shared_ptr<State> state_;
  std::thread worker_;
};

}  // namespace torchpar::detail
