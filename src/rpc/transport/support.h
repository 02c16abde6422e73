#pragma once
// What the RPC transports (tcp/, tensorpipe/) share: log lines, peer-chosen text made safe for
// them, the threads that run one connection each, and the dispatch thread that hands messages
// and losses to the handlers in order. Private to src/rpc/transport/.

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/socket_address.h"
#include "rpc/transport/transport.h"
#include "torchpar/core/error.h"

namespace torchpar::rpc::detail {

/// One line "torchpar: <line>" on stderr: refused peers and listener trouble leave a trace on
/// the server even though no caller hears of them. Never throws.
void log_line(const std::string& line) noexcept;

/// `text` for a log line or an error message: at most 64 bytes, non-printable bytes as '?'
/// (peers choose names and addresses).
std::string printable(std::string_view text);

/// Accepted connections (sockets, pipes) whose handshake runs at once; more are closed
/// unheard (each holds a thread). Both transports.
inline constexpr int kMaxPendingHandshakes = 64;

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

/// What release_reader_thread() calls on a reader thread that runs an inline handler of a
/// `may_block` message: hands its connection to another reader. Set (current_reader) only
/// for the duration of that handler, on that thread.
class ReaderHandoff {
 public:
  /// Gives the connection another reader now (once; later calls do nothing). Never throws.
  virtual void release() noexcept = 0;

 protected:
  ~ReaderHandoff() = default;
};

/// The hand-off of the handler running on this thread, or nullptr (release_reader_thread).
ReaderHandoff*& current_reader() noexcept;

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

/// What both transports keep of the members they talk to, the same way: each member's open
/// authenticated connections, the one sends use, and the lock that orders sends to it; the
/// closed flag; the send calls in progress. A transport derives from it and guards its own
/// state with the same mutex_.
///
/// `Conn` has `std::string peer` (set before it is filed) and `bool dead` (guarded by mutex_).
/// Lock order: mutex_ only; no call that blocks or calls back into TensorPipe runs under it.
template <class Conn>
class ConnectionTable {
 protected:
  using Clock = std::chrono::steady_clock;

  /// What the transport knows of one member (all fields guarded by mutex_).
  struct Peer {
    /// Set by a sender from before it looks for a connection until its write is issued (or,
    /// for TCP, done): concurrent senders wait for one connect, and messages go out in the
    /// order of send calls. (A flag and a condition variable rather than a std::timed_mutex:
    /// ThreadSanitizer does not see the pthread_mutex_clocklock behind try_lock_until.)
    bool busy = false;
    /// Notified when `busy` clears, and by close_locked().
    std::condition_variable idle;
    /// Where sends go: the first of `conns`, kept until it is lost.
    std::shared_ptr<Conn> out;
    /// Every open authenticated connection of this member.
    std::vector<std::shared_ptr<Conn>> conns;
  };

  /// One send call to `peer`: waits (until `deadline`) for the sends to `peer` before it,
  /// then calls `connect()` -> shared_ptr<Conn> (which files the new connection) when none is
  /// open, then `write(conn)`; close() waits until every such call has returned.
  /// Errors: ClosedError once closed; TimeoutError when an earlier send holds `peer` past
  /// `deadline`; what connect and write throw.
  template <class Connect, class Write>
  void run_send(const std::string& peer, Clock::time_point deadline, Connect&& connect,
                Write&& write) {
    std::shared_ptr<Peer> p;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) throw ClosedError("rpc transport: closed");
      p = entry_locked(peer);
      ++active_sends_;
    }
    struct Active {
      ConnectionTable* self;
      ~Active() {
        std::lock_guard<std::mutex> lock(self->mutex_);
        if (--self->active_sends_ == 0) self->sends_cv_.notify_all();
      }
    } active{this};

    std::shared_ptr<Conn> conn;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!p->idle.wait_until(lock, deadline, [&] { return closed_ || !p->busy; })) {
        throw TimeoutError(fmt::format(
            "rpc transport: send to {}: another send to it (connecting or writing) held it "
            "past the deadline",
            printable(peer)));
      }
      if (closed_) throw ClosedError("rpc transport: closed");
      p->busy = true;
      conn = p->out;
    }
    struct Busy {
      ConnectionTable* self;
      Peer* peer;
      ~Busy() {
        std::lock_guard<std::mutex> lock(self->mutex_);
        peer->busy = false;
        peer->idle.notify_one();
      }
    } busy{this, p.get()};

    if (!conn) {
      conn = connect();
      // A connection the peer opened meanwhile may have become the one sends use: keep to one.
      std::lock_guard<std::mutex> lock(mutex_);
      if (p->out) conn = p->out;
    }
    write(conn);
  }

  /// Files `conn` under its member (the one sends use when it has none). Requires mutex_
  /// held and not closed_.
  void file_locked(const std::shared_ptr<Conn>& conn) {
    auto p = entry_locked(conn->peer);
    p->conns.push_back(conn);
    if (!p->out) p->out = conn;
  }

  /// Marks `conn` dead and takes it out of the table; returns whether its loss is to be
  /// reported (not once closed). Requires mutex_ held and `conn` not dead.
  bool unfile_locked(const std::shared_ptr<Conn>& conn) {
    conn->dead = true;
    if (auto it = peers_.find(conn->peer); it != peers_.end()) {
      auto& p = *it->second;
      std::erase(p.conns, conn);
      if (p.out == conn) p.out = p.conns.empty() ? nullptr : p.conns.front();
    }
    return !closed_;
  }

  /// Sets closed_, wakes the senders waiting for a member, and calls `each(conn)` for every
  /// open connection. Requires mutex_ held.
  template <class Each>
  void close_locked(Each&& each) {
    closed_ = true;
    for (auto& [name, p] : peers_) {
      p->idle.notify_all();
      for (auto& c : p->conns) each(*c);
    }
  }

  /// Waits until no send call is in progress (after close_locked they all fail fast), then
  /// empties the table; the connections are released by the caller, unlocked.
  std::unordered_map<std::string, std::shared_ptr<Peer>> drain_after_close() {
    std::unordered_map<std::string, std::shared_ptr<Peer>> peers;
    std::unique_lock<std::mutex> lock(mutex_);
    sends_cv_.wait(lock, [&] { return active_sends_ == 0; });
    peers.swap(peers_);
    return peers;
  }

  bool closed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return closed_;
  }

  mutable std::mutex mutex_;
  bool closed_ = false;

 private:
  std::shared_ptr<Peer> entry_locked(const std::string& peer) {
    auto& p = peers_[peer];
    if (!p) p = std::make_shared<Peer>();
    return p;
  }

  int active_sends_ = 0;  // send calls in progress (close waits for them)
  std::condition_variable sends_cv_;
  std::unordered_map<std::string, std::shared_ptr<Peer>> peers_;
};

}  // namespace torchpar::rpc::detail
