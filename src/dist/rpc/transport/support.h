#pragma once
// What the RPC transports (tcp/, tensorpipe/) share: log lines, peer-chosen text made safe for
// them, the threads that run one connection each, and the dispatch thread that hands messages
// and losses to the handlers in order. Private to src/dist/rpc/transport/.

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "dist/rpc/transport/transport.h"
#include "ipc/socket_address.h"

namespace torchpar::rpc::detail {

/// One line "torchpar: <line>" on stderr: refused peers and listener trouble leave a trace on
/// the server even though no caller hears of them. Never throws.
void log_line(const std::string& line) noexcept;

/// `text` for a log line or an error message: at most 64 bytes, non-printable bytes as '?'
/// (peers choose names and addresses).
std::string printable(std::string_view text);

/// `d` in seconds, for messages.
inline double seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

/// Checks what every transport's factory requires of its options.
/// Errors: ValueError for an empty key, or a name that is empty or over 256 bytes.
void check_options(const TransportOptions& options);

/// Checks that every storage of `msg` may travel. Errors: ValueError for an undefined storage
/// or one not on the CPU.
void check_storages(const Message& msg);

/// The bind host of `options` as parse_socket_address takes it with a port (an IPv6 literal
/// gets brackets). Errors: ValueError when it is no host or IP.
torchpar::detail::SocketAddress bind_address(const TransportOptions& options);

/// The socket address of a member's TCP address "tcp://<ip>:<port>": a numeric IPv4 address,
/// or an IPv6 one in brackets (no names: addresses come from the store, and a name would need
/// a resolver call on the sending thread), and a port from 1 to 65535.
/// Errors: ValueError naming the (printable) address.
torchpar::detail::SocketAddress parse_tcp_address(std::string_view address);

/// Whether `url` is "shm://<name>" with a name TensorPipe's shm transport may have bound: 1 to
/// 107 bytes of [0-9A-Za-z._-] (it autobinds 5 hex digits).
bool is_shm_url(std::string_view url);

/// Threads that run one task each (a handshake, a connection's reader) and are joined at the
/// end; a finished one is joined by the next start().
/// Safety: start() from any thread; join_all() once, after the last start() returned, never
/// from one of these threads.
class TaskThreads {
 public:
  /// Runs `task` on a new thread. Errors: std::system_error when no thread can be made.
  void start(std::function<void()> task);
  /// Joins every thread; start() must not be called afterwards.
  void join_all();

 private:
  std::mutex mu_;
  bool joining_ = false;
  std::list<std::thread> running_;
  std::vector<std::list<std::thread>::iterator> finished_;
};

/// The transport's dispatch thread: runs the handlers for queued messages and losses, one at a
/// time, in the order they were posted; handlers that throw are logged, not propagated.
///
/// Lifetime: start() once; stop() drops what is queued and ends the thread after the handler
/// it runs (if any); join() waits for that unless called on the dispatch thread itself (a
/// handler that closed the transport), which leaves the thread to the destructor (detached).
/// Safety: thread-safe.
class Dispatcher {
 public:
  /// `name` (the member's) prefixes log lines.
  Dispatcher(std::string name, TransportHandlers handlers);
  ~Dispatcher();
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  /// Starts the thread. Errors: std::system_error.
  void start();
  /// Queues on_message(peer, msg); dropped after stop().
  void post_message(const std::string& peer, Message msg);
  /// Queues on_peer_lost(peer, why); dropped after stop().
  void post_lost(const std::string& peer, const std::string& why);
  /// Runs on_message(peer, msg) on the calling thread now (inline_handlers).
  void deliver(const std::string& peer, Message msg) noexcept;
  /// Drops the queue and makes the thread return after its current handler. Idempotent.
  void stop();
  /// Joins the thread (after stop()), unless called on it.
  void join();

 private:
  struct Event {
    std::string peer;
    std::optional<Message> message;  // set: on_message; empty: on_peer_lost(why)
    std::string why;
  };
  void post(Event event);
  void loop();
  void lost(const std::string& peer, const std::string& why) noexcept;

  const std::string name_;
  const TransportHandlers handlers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  bool stopped_ = false;
  std::thread thread_;
};

}  // namespace torchpar::rpc::detail
