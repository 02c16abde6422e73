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

/// A pool worker died (killed, crashed, exited) while it held this task. Carries the
/// worker's pid and Python-style exit code (minus the signal number). The pool replaced
/// the worker and goes on. (CPython's Pool hangs instead.)
class WorkerLostError : public Error {
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
class WorkerError : public Error {
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
class RankLostError : public Error {
 public:
  RankLostError(int rank, std::string msg) : Error(std::move(msg)), rank_(rank) {}
  int rank() const noexcept { return rank_; }

 private:
  int rank_;
};

/// A task raised in a pool worker process: its exception type name and message.
class TaskError : public Error {
 public:
  TaskError(std::string type, std::string message);
  const std::string& type() const noexcept { return type_; }
  const std::string& message() const noexcept { return message_; }

 private:
  std::string type_;
  std::string message_;
};

/// A method called through a Manager proxy raised in the manager's server process: the
/// exception's type name ("KeyError", "std::out_of_range", ...) and message (Python:
/// multiprocessing.managers.RemoteError). The exception object itself does not cross
/// processes. The server and the object go on; the object holds what the method did
/// before it raised.
class RemoteError : public Error {
 public:
  RemoteError(std::string type, std::string message);
  /// `where` replaces "the manager's server process" in what() (e.g. "member 'w1'").
  RemoteError(std::string type, std::string message, const std::string& where);
  const std::string& type() const noexcept { return type_; }
  const std::string& message() const noexcept { return message_; }

 private:
  std::string type_;
  std::string message_;
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
class ProcessRaisedException : public Error {
 public:
  ProcessRaisedException(int index, int pid, std::string type, std::string message);
  int error_index() const noexcept { return index_; }
  int pid() const noexcept { return pid_; }
  const std::string& type() const noexcept { return type_; }
  const std::string& message() const noexcept { return message_; }

 private:
  int index_;
  int pid_;
  std::string type_;
  std::string message_;
};

/// A child process exited with a non-zero code or was killed by a signal. `exit_code()` is
/// Python's exitcode: the code, or minus the signal number. `signal_name()` is e.g.
/// "SIGKILL" (empty for a plain exit). Source: torch.multiprocessing.ProcessExitedException.
class ProcessExitedException : public Error {
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

/// Name of a signal number ("SIGKILL"), or "signal N".
std::string signal_name(int signo);

}  // namespace torchpar
