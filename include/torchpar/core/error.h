#pragma once
/// torchpar's error family. Every error derives from `torchpar::Error`, which derives
/// from `c10::Error` so that code catching LibTorch errors (and Python bindings) sees
/// them too. `what()` is the message alone, without a C++ backtrace.
///
/// docs/errors.md says for each error whether it is recoverable and what state the
/// object that threw is left in.

#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <utility>

namespace torchpar {

/// Base of every torchpar error.
class Error : public c10::Error {
 public:
  explicit Error(std::string msg);
  const char* what() const noexcept override { return what_without_backtrace(); }
};

/// A blocking call ran out of time (Python: TimeoutError / multiprocessing.TimeoutError).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

/// The object (queue, connection, pool) was closed (Python: ValueError "closed", EOFError).
class ClosedError : public Error {
 public:
  using Error::Error;
};

/// A peer did not prove the job's key in the connection handshake (or refused ours), or
/// broke the handshake protocol (Python: multiprocessing.AuthenticationError). The
/// connection was closed; nothing else changed.
class AuthenticationError : public Error {
 public:
  using Error::Error;
};

/// The peer sent a frame this end refuses: longer than the `maxlength` of recv_bytes, or
/// with a length no sender writes (a negative one other than the 64-bit marker). The
/// connection was closed, as its stream is out of sync (Python: OSError "bad message
/// length" from Connection.recv_bytes).
class ProtocolError : public Error {
 public:
  using Error::Error;
};

/// A Barrier was broken (abort, reset, or a waiter's timeout); every waiter of that round
/// raises it and the barrier stays broken until reset() (Python:
/// threading.BrokenBarrierError).
class BrokenBarrierError : public Error {
 public:
  using Error::Error;
};

/// A value is not one of those allowed (an unknown start method or sharing strategy
/// name, an option out of range). Nothing changed (Python: ValueError).
class ValueError : public Error {
 public:
  using Error::Error;
};

/// A system call failed. Carries the syscall, its errno and the object it acted on
/// (a path, a shared-memory name, an fd).
class SystemError : public Error {
 public:
  SystemError(std::string syscall, int err, std::string object, std::string detail = {});
  const std::string& syscall() const noexcept { return syscall_; }
  int error_code() const noexcept { return errno_; }
  const std::string& object() const noexcept { return object_; }

 private:
  std::string syscall_;
  int errno_;
  std::string object_;
};

/// Shared memory could not be created, reserved, mapped or opened. For an exhausted
/// /dev/shm (or memory, for memfd) the message names the place, the bytes asked and
/// the bytes free. The process can go on: nothing was mapped.
class ShmError : public SystemError {
 public:
  using SystemError::SystemError;
};

/// Bytes given to `loads` are not a valid torchpar payload of the requested type
/// (truncated, corrupted, hostile, or another type). Nothing is leaked.
class SerializationError : public Error {
 public:
  using Error::Error;
};

/// Base of "a peer is gone": a process, worker, rank or RPC member that a call depended on
/// died, exited, or lost its connection, so the call cannot complete. Its subclasses say which
/// kind of peer and carry its details: WorkerLostError (a pool worker), RankLostError (a
/// collective group's rank, the store's host), ProcessExitedException (a child process),
/// WorkerError (a TensorParallel worker), RpcPeerLostError (an RPC member). Catch it to treat
/// them alike; docs/errors.md says what state each leaves.
class PeerLostError : public Error {
 public:
  using Error::Error;
};

/// Base of "the remote side raised": code running in another process (a pool task, a child
/// process, a Manager method, an RPC callee) threw; the exception object stays there and its
/// type name (type()) and message (message()) travel. Subclasses: TaskError, RemoteError
/// (and RpcRemoteError), ProcessRaisedException. The peer itself goes on (except a child
/// process, which ended).
class RemoteRaisedError : public Error {
 public:
  /// `what` is the whole message; `type` and `message` the remote exception's.
  RemoteRaisedError(std::string what, std::string type, std::string message)
      : Error(std::move(what)), type_(std::move(type)), message_(std::move(message)) {}
  /// The remote exception's type name ("std::domain_error", "KeyError").
  const std::string& type() const noexcept { return type_; }
  /// Its message (its what(), without a backtrace).
  const std::string& message() const noexcept { return message_; }

 private:
  std::string type_;
  std::string message_;
};

/// A pool worker died (killed, crashed, exited) while it held this task. Carries the
/// worker's pid and Python-style exit code (minus the signal number). The pool replaced
/// the worker and goes on. (CPython's Pool hangs instead.)
class WorkerLostError : public PeerLostError {
 public:
  WorkerLostError(int pid, int exit_code);
  int pid() const noexcept { return pid_; }
  int exit_code() const noexcept { return exit_code_; }

 private:
  int pid_;
  int exit_code_;
};

/// A worker process of a tensor-parallel engine (TensorParallel) failed the call in flight:
/// it raised (type() and message() are its exception's, exit_code() is nullopt), or it died
/// (exit_code() is Python's exitcode: the code, or minus the signal number; signal_name() is
/// "SIGKILL" for -9). rank() is the worker's rank, pid() its process id. The engine that
/// threw is broken: its other workers were killed, and every later call raises this error
/// again. Source: what parallelformers' ParallelProcess should raise instead of hanging
/// (its issues #16, #19, #24).
class WorkerError : public PeerLostError {
 public:
  /// The worker raised `type`: `message`. `where` names the call ("TensorParallel.generate").
  WorkerError(const std::string& where, int rank, int pid, std::string type, std::string message);
  /// The worker ended with `exit_code` (Python's exitcode) while the call was in flight.
  WorkerError(const std::string& where, int rank, int pid, int exit_code);
  int rank() const noexcept { return rank_; }
  int pid() const noexcept { return pid_; }
  const std::string& type() const noexcept { return type_; }
  const std::string& message() const noexcept { return message_; }
  /// nullopt when the worker raised; its exit code (minus the signal) when it died.
  std::optional<int> exit_code() const noexcept { return exit_code_; }
  /// "SIGKILL" for a worker killed by a signal, "" otherwise.
  std::string signal_name() const;

 private:
  int rank_;
  int pid_;
  std::string type_;
  std::string message_;
  std::optional<int> exit_code_;
};

/// A rank of a collective group died or failed mid-operation (the others raise it within
/// the group timeout instead of hanging). rank() is relative to the group, -1 if unknown.
class RankLostError : public PeerLostError {
 public:
  RankLostError(int rank, std::string msg) : PeerLostError(std::move(msg)), rank_(rank) {}
  int rank() const noexcept { return rank_; }

 private:
  int rank_;
};

/// A task raised in a pool worker process: its exception type name and message.
class TaskError : public RemoteRaisedError {
 public:
  TaskError(std::string type, std::string message);
};

/// A method called through a Manager proxy raised in the manager's server process: the
/// exception's type name ("KeyError", "std::out_of_range", ...) and message (Python:
/// multiprocessing.managers.RemoteError). The exception object itself does not cross
/// processes. The server and the object go on; the object holds what the method did
/// before it raised.
class RemoteError : public RemoteRaisedError {
 public:
  RemoteError(std::string type, std::string message);
  /// `where` replaces "the manager's server process" in what() (e.g. "member 'w1'").
  RemoteError(std::string type, std::string message, const std::string& where);
};

/// get() found no item within its timeout (Python: queue.Empty).
class Empty : public Error {
 public:
  using Error::Error;
};

/// put() found no room within its timeout (Python: queue.Full).
class Full : public Error {
 public:
  using Error::Error;
};

/// A child process ended by throwing: carries its index (rank), pid, the exception's type
/// name and message. Source: torch.multiprocessing.ProcessRaisedException.
class ProcessRaisedException : public RemoteRaisedError {
 public:
  ProcessRaisedException(int index, int pid, std::string type, std::string message);
  int error_index() const noexcept { return index_; }
  int pid() const noexcept { return pid_; }

 private:
  int index_;
  int pid_;
};

/// A child process exited with a non-zero code or was killed by a signal. `exit_code()` is
/// Python's exitcode: the code, or minus the signal number. `signal_name()` is e.g.
/// "SIGKILL" (empty for a plain exit). Source: torch.multiprocessing.ProcessExitedException.
class ProcessExitedException : public PeerLostError {
 public:
  ProcessExitedException(int index, int pid, int exit_code);
  int error_index() const noexcept { return index_; }
  int pid() const noexcept { return pid_; }
  int exit_code() const noexcept { return exit_code_; }
  std::string signal_name() const;

 private:
  int index_;
  int pid_;
  int exit_code_;
};

// ---- RPC (torchpar/rpc/rpc_group.h) -------------------------------------------------------

/// register_service / pair: the key is taken in this group (machin: "... has already been
/// registered/paired to Group ..."). key(): the key; owner(): the member holding it.
class RpcKeyTakenError : public Error {
 public:
  RpcKeyTakenError(std::string key, std::string owner, std::string msg)
      : Error(std::move(msg)), key_(std::move(key)), owner_(std::move(owner)) {}
  const std::string& key() const noexcept { return key_; }
  const std::string& owner() const noexcept { return owner_; }

 private:
  std::string key_, owner_;
};

/// deregister_service / unpair of a key another member owns (machin: "... not
/// registered/paired to ..."). owner(): the member holding it, empty when nobody does.
class RpcKeyNotOwnedError : public Error {
 public:
  RpcKeyNotOwnedError(std::string key, std::string owner, std::string msg)
      : Error(std::move(msg)), key_(std::move(key)), owner_(std::move(owner)) {}
  const std::string& key() const noexcept { return key_; }
  const std::string& owner() const noexcept { return owner_; }

 private:
  std::string key_, owner_;
};

/// registered_* / get_paired of a key nobody holds (machin: "... not found on Group ...").
class RpcKeyNotFoundError : public Error {
 public:
  RpcKeyNotFoundError(std::string key, std::string msg)
      : Error(std::move(msg)), key_(std::move(key)) {}
  const std::string& key() const noexcept { return key_; }

 private:
  std::string key_;
};

/// The callee threw: type() is its exception's demangled type name, message() its message
/// (what() without a backtrace); what() adds "(raised on member '<name>')".
class RpcRemoteError : public RemoteError {
 public:
  RpcRemoteError(std::string type, std::string message, const std::string& member)
      : RemoteError(std::move(type), std::move(message), "member '" + member + "'") {}
};

/// A call could not reach its member: it died, closed its group, or its connection broke.
/// member(): the callee's name.
class RpcPeerLostError : public PeerLostError {
 public:
  RpcPeerLostError(std::string member, std::string msg)
      : PeerLostError(std::move(msg)), member_(std::move(member)) {}
  const std::string& member() const noexcept { return member_; }

 private:
  std::string member_;
};

/// Name of a signal number ("SIGKILL"), or "signal N".
std::string signal_name(int signo);

}  // namespace torchpar
