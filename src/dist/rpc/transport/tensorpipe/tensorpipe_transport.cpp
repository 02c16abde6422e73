// The TensorPipe implementation of the RPC transport (transport.h). Wire format:
// docs/wire_format.md, "RPC transport".
//
// Threads. TensorPipe runs its callbacks on whichever thread drives its context's deferred
// executor at the time: one of its loop threads, or any thread that is inside a TensorPipe
// call (its executor is "on demand"). So here:
//   - callbacks never block and never run user code: messages and losses go to a queue that
//     the transport's own dispatch thread hands to the handlers, one at a time, in order;
//   - no TensorPipe call is made while mutex_ is held (the call may run callbacks inline,
//     and those take mutex_);
//   - the handshakes of accepted pipes run on one thread each (a stalled peer delays nobody
//     else), at most kMaxPendingHandshakes at a time, tracked and joined by close();
//   - outgoing connects and their handshakes run on the sending thread;
//   - a listener thread re-creates TensorPipe's listener when it fails (see listen_loop).
//
// Lock order: mutex_, then events_mu_.

#include <arpa/inet.h>
#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>
#include <tensorpipe/tensorpipe.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <list>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/auth_channel.h"
#include "core/signals.h"
#include "dist/rpc/transport/tensorpipe/pipe_channel.h"
#include "dist/rpc/transport/transport.h"
#include "ipc/socket_address.h"
#include "torchpar/core/error.h"

namespace torchpar::rpc {
namespace {

using Clock = std::chrono::steady_clock;
using detail::error_text;
using detail::kMessageTag;
using detail::PipeAuthChannel;
using detail::wait_until_peer_closes;

/// Accepted pipes whose handshake runs at once; more are closed unheard (each holds a thread).
constexpr int kMaxPendingHandshakes = 64;
/// How long a refusing side waits for the peer to read `#FAILURE#` and hang up.
constexpr auto kRefusalLinger = std::chrono::seconds(1);
/// How long the listener thread tries to get the port back after TensorPipe's listener failed.
constexpr auto kRelistenPatience = std::chrono::seconds(5);

/// One line on stderr: refused peers and listener trouble leave a trace on the server even
/// though no caller hears of them.
void log_line(const std::string& line) noexcept {
  std::fprintf(stderr, "torchpar: %s\n", line.c_str());
  std::fflush(stderr);
}

/// Runs the body of a TensorPipe callback: an exception unwinding into TensorPipe would end
/// the process, so one is logged (naming `transport` and what failed) and dropped.
template <class Fn>
void in_callback(const std::string& transport, std::string_view what, Fn&& body) noexcept {
  try {
    body();
  } catch (const std::exception& e) {
    log_line(fmt::format("rpc transport {}: {} failed: {}", transport, what, e.what()));
  } catch (...) {
    log_line(fmt::format("rpc transport {}: {} failed", transport, what));
  }
}

/// `text` for a log line: at most 64 bytes, non-printable bytes as '?'. Peers choose it.
std::string printable(std::string_view text) {
  std::string out(text.substr(0, 64));
  for (char& c : out) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  if (text.size() > 64) out += "...";
  return out;
}

/// `d` in seconds, for messages.
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

/// The TensorPipe URL of a member's address: "tcp://host:port" (or "uv://host:port") with a
/// numeric host (TensorPipe resolves no names; a bracketed literal for IPv6) and a port.
std::string pipe_url(const std::string& address) {
  std::string_view rest = address;
  for (std::string_view scheme : {"tcp://", "uv://"}) {
    if (rest.substr(0, scheme.size()) == scheme) {
      rest.remove_prefix(scheme.size());
      break;
    }
  }
  if (rest.size() == address.size() || rest.empty()) {
    throw ValueError(fmt::format("rpc transport: address \"{}\" is not \"tcp://<ip>:<port>\"",
                                 printable(address)));
  }
  const auto parsed = torchpar::detail::parse_socket_address(rest);
  unsigned char buf[sizeof(in6_addr)];
  if (parsed.kind != torchpar::detail::SocketAddress::Kind::kTcp || parsed.port == 0 ||
      ::inet_pton(parsed.ipv6 ? AF_INET6 : AF_INET, parsed.host.c_str(), buf) != 1) {
    throw ValueError(fmt::format(
        "rpc transport: address \"{}\" is not \"tcp://<ip>:<port>\" (an IP address, not a "
        "name, and a port)",
        printable(address)));
  }
  return "uv://" + parsed.text();
}

/// One pipe of an authenticated member (connected by this side or accepted).
struct Conn {
  std::shared_ptr<tensorpipe::Pipe> pipe;
  std::string peer;
  bool dead = false;  // guarded by the transport's mutex_: lost (reported once) or closing
};

/// What the transport knows of one member (all fields guarded by the transport's mutex_).
struct Peer {
  /// Set by a sender from before it looks for a pipe until its write is issued: concurrent
  /// senders wait for one connect, and writes reach TensorPipe in the order of send calls.
  /// (A flag and a condition variable rather than a std::timed_mutex: ThreadSanitizer does
  /// not see the pthread_mutex_clocklock behind try_lock_until.)
  bool busy = false;
  /// Notified when `busy` clears, and by close().
  std::condition_variable idle;
  /// Where sends go: the first of `conns`, kept until it is lost.
  std::shared_ptr<Conn> out;
  /// Every open authenticated pipe of this member.
  std::vector<std::shared_ptr<Conn>> conns;
};

/// A message or a loss for the dispatch thread.
struct Event {
  std::string peer;
  std::optional<Message> message;  // set: on_message; empty: on_peer_lost(why)
  std::string why;
};

/// Threads that run one task each and are joined at the end; a finished one is joined by the
/// next start().
class TaskThreads {
 public:
  /// Runs `task` on a new thread. Errors: std::system_error when no thread can be made.
  void start(std::function<void()> task) {
    std::list<std::thread> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it : finished_) done.splice(done.end(), running_, it);
      finished_.clear();
      running_.emplace_back();
      const auto it = std::prev(running_.end());
      try {
        *it = std::thread([this, it, task = std::move(task)] {
          task();
          std::lock_guard<std::mutex> l(mu_);
          if (!joining_) finished_.push_back(it);
        });
      } catch (...) {
        running_.erase(it);
        throw;
      }
    }
    for (auto& t : done) t.join();  // they have returned or are returning
  }

  /// Joins every thread; start() must not be called afterwards.
  void join_all() {
    std::list<std::thread> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      joining_ = true;
      all.swap(running_);
      finished_.clear();
    }
    for (auto& t : all) t.join();
  }

 private:
  std::mutex mu_;
  bool joining_ = false;
  std::list<std::thread> running_;
  std::vector<std::list<std::thread>::iterator> finished_;
};

class TensorPipeTransport final : public Transport {
 public:
  TensorPipeTransport(TransportOptions options, TransportHandlers handlers);
  ~TensorPipeTransport() override;

  std::string address() const override { return address_; }
  void send(const std::string& peer, const std::string& address, Message msg,
            Clock::time_point deadline) override;
  void close() override;

 private:
  void close_now();

  // Listening.
  std::vector<std::string> listen_urls(uint16_t port) const;
  void arm_accept(const std::shared_ptr<tensorpipe::Listener>& listener);
  void on_accept(const tensorpipe::Listener* from, const tensorpipe::Error& error,
                 std::shared_ptr<tensorpipe::Pipe> pipe);
  void listen_loop();
  std::shared_ptr<tensorpipe::Listener> listen_again();

  // Connections.
  void serve_handshake(const std::shared_ptr<tensorpipe::Pipe>& pipe);
  std::shared_ptr<Conn> connect(const std::string& peer, const std::string& address,
                                Clock::time_point deadline);
  std::shared_ptr<Conn> add_conn(std::shared_ptr<tensorpipe::Pipe> pipe, const std::string& peer);
  std::shared_ptr<Peer> peer_entry(const std::string& peer);  // requires mutex_
  void lose(const std::shared_ptr<Conn>& conn, const std::string& why);

  // Messages.
  void arm_read(const std::shared_ptr<Conn>& conn);
  void on_descriptor(const std::shared_ptr<Conn>& conn, const tensorpipe::Descriptor& d);
  std::string check_descriptor(const tensorpipe::Descriptor& d) const;
  void write(const std::shared_ptr<Conn>& conn, Message msg);

  // Handlers.
  void post(Event event);
  void dispatch_loop();
  /// Runs on_message, logging (not propagating) what it throws.
  void deliver(const std::string& peer, Message msg) noexcept;

  bool closed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return closed_;
  }

  const TransportOptions options_;
  const TransportHandlers handlers_;
  std::string host_;     // numeric bind host as it goes in a URL ("127.0.0.1", "[::1]")
  uint16_t port_ = 0;    // the uv listener's port; kept when the listener is re-created
  std::string address_;  // "tcp://host:port"
  std::shared_ptr<tensorpipe::Context> ctx_;

  std::once_flag close_once_;
  mutable std::mutex mutex_;
  bool closed_ = false;
  std::shared_ptr<tensorpipe::Listener> listener_;
  bool relisten_ = false;       // the listener failed: listen_loop makes a new one
  std::string listener_error_;  // why, for its log line
  std::condition_variable listen_cv_;
  int pending_handshakes_ = 0;
  int active_sends_ = 0;  // send calls in progress (close waits for them)
  std::condition_variable sends_cv_;
  std::unordered_map<std::string, std::shared_ptr<Peer>> peers_;

  std::mutex events_mu_;
  std::condition_variable events_cv_;
  std::deque<Event> events_;
  bool stop_dispatch_ = false;

  TaskThreads handshakes_;
  std::thread listen_thread_;
  std::thread dispatcher_;
};

// ---- construction and close ----------------------------------------------------------------

TensorPipeTransport::TensorPipeTransport(TransportOptions options, TransportHandlers handlers)
    : options_(std::move(options)), handlers_(std::move(handlers)) {
  if (options_.authkey.empty()) {
    throw ValueError("rpc transport: the authkey is empty (every connection proves the key)");
  }
  if (options_.name.empty() || options_.name.size() > kMaxHandshakeFrame) {
    throw ValueError(fmt::format("rpc transport: the name must hold 1 to {} bytes, not {}",
                                 kMaxHandshakeFrame, options_.name.size()));
  }
  // libuv writes to sockets without MSG_NOSIGNAL: a member that dies mid-message would end
  // this process with SIGPIPE.
  torchpar::detail::ignore_sigpipe_if_default();
  // TensorPipe aborts the process when its listener cannot bind (an exception on its loop
  // thread): bind here first, which also turns a host name into the numeric address TensorPipe
  // needs and reports a bad host as SystemError.
  std::string host = options_.bind_host;
  if (host.find(':') != std::string::npos && host.front() != '[') host = "[" + host + "]";
  const auto parsed = torchpar::detail::parse_socket_address(host + ":0");
  if (parsed.kind != torchpar::detail::SocketAddress::Kind::kTcp) {
    throw ValueError(fmt::format("rpc transport: bind_host \"{}\" is not a host or IP address",
                                 printable(options_.bind_host)));
  }
  std::string bound;
  dev_t device = 0;
  ino_t inode = 0;
  torchpar::detail::listen_on(parsed, 1, &bound, &device, &inode);  // closed at once
  host_ = bound.substr(0, bound.rfind(':'));

  try {
    ctx_ = std::make_shared<tensorpipe::Context>(tensorpipe::ContextOptions().name(options_.name));
    ctx_->registerTransport(0, "uv", tensorpipe::transport::uv::create());
    if (options_.shm) ctx_->registerTransport(100, "shm", tensorpipe::transport::shm::create());
    ctx_->registerChannel(0, "basic", tensorpipe::channel::basic::create());
    ctx_->registerChannel(100, "cma", tensorpipe::channel::cma::create());
    listener_ = ctx_->listen(listen_urls(0));
    const std::string uv = listener_->address("uv");
    port_ = static_cast<uint16_t>(std::stoul(uv.substr(uv.rfind(':') + 1)));
  } catch (const std::exception& e) {
    if (ctx_) {
      ctx_->close();
      ctx_->join();
    }
    throw SystemError("listen", 0, fmt::format("tcp://{}:0", host_), e.what());
  }
  address_ = fmt::format("tcp://{}:{}", host_, port_);
  // A connection accepted before the threads run waits in the queue for them.
  arm_accept(listener_);
  try {
    dispatcher_ = std::thread([this] { dispatch_loop(); });
    listen_thread_ = std::thread([this] { listen_loop(); });
  } catch (...) {
    close();  // joins what started; no destructor runs after a constructor throws
    throw;
  }
}

TensorPipeTransport::~TensorPipeTransport() {
  try {
    close();
  } catch (const std::exception& e) {
    log_line(fmt::format("rpc transport {}: close failed: {}", printable(options_.name), e.what()));
  }
  // close() called from a handler leaves the dispatch thread to this destructor.
  if (dispatcher_.joinable()) {
    if (dispatcher_.get_id() == std::this_thread::get_id()) {
      dispatcher_.detach();
    } else {
      dispatcher_.join();
    }
  }
}

void TensorPipeTransport::close() {
  // A second caller waits until the first one is done: after close returns, no handler runs.
  std::call_once(close_once_, [this] { close_now(); });
}

void TensorPipeTransport::close_now() {
  std::shared_ptr<tensorpipe::Listener> listener;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    listener = listener_;
    for (auto& [name, p] : peers_) p->idle.notify_all();  // waiting senders fail now
  }
  listen_cv_.notify_all();
  {
    std::lock_guard<std::mutex> lock(events_mu_);
    stop_dispatch_ = true;
    events_.clear();
  }
  events_cv_.notify_all();
  // The listener thread makes TensorPipe calls: it ends before the context closes.
  if (listen_thread_.joinable()) listen_thread_.join();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    listener = listener_;
  }
  // Closing the context fails every pending operation (their callbacks see closed_ and
  // report nothing) and unblocks handshakes and connecting senders; join() waits until no
  // TensorPipe callback runs any more.
  if (listener) listener->close();
  if (ctx_) {
    ctx_->close();
    ctx_->join();
  }
  if (dispatcher_.joinable() && dispatcher_.get_id() != std::this_thread::get_id()) {
    dispatcher_.join();
  }
  handshakes_.join_all();
  std::unordered_map<std::string, std::shared_ptr<Peer>> peers;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    sends_cv_.wait(lock, [&] { return active_sends_ == 0; });  // all fail fast now
    peers.swap(peers_);
    listener_.reset();
  }
}

// ---- listening --------------------------------------------------------------------------------

std::vector<std::string> TensorPipeTransport::listen_urls(uint16_t port) const {
  std::vector<std::string> urls{fmt::format("uv://{}:{}", host_, port)};
  // An empty shm name autobinds an abstract Unix socket; peers learn it from TensorPipe's
  // own connection setup, never from address().
  if (options_.shm) urls.emplace_back("shm://");
  return urls;
}

void TensorPipeTransport::arm_accept(const std::shared_ptr<tensorpipe::Listener>& listener) {
  const tensorpipe::Listener* from = listener.get();
  listener->accept(
      [this, from](const tensorpipe::Error& error, std::shared_ptr<tensorpipe::Pipe> pipe) {
        in_callback(options_.name, "accepting", [&] { on_accept(from, error, std::move(pipe)); });
      });
}

void TensorPipeTransport::on_accept(const tensorpipe::Listener* from,
                                    const tensorpipe::Error& error,
                                    std::shared_ptr<tensorpipe::Pipe> pipe) {
  std::shared_ptr<tensorpipe::Listener> current;
  bool refuse = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;  // the pipe closes as it goes out of scope
    if (listener_.get() == from) current = listener_;
    if (error) {
      // One incoming connection that fails before TensorPipe's setup (a port scanner, a
      // client that gives up) puts TensorPipe's listener in a permanent error state.
      if (current && !error.isOfType<tensorpipe::ListenerClosedError>()) {
        relisten_ = true;
        listener_error_ = error_text(error);
        listen_cv_.notify_all();
      }
      return;
    }
    refuse = pending_handshakes_ >= kMaxPendingHandshakes;
    if (!refuse) ++pending_handshakes_;
  }
  if (current) arm_accept(current);
  if (refuse) {
    log_line(fmt::format("rpc transport {}: {} handshakes pending; closing a new connection",
                         printable(options_.name), kMaxPendingHandshakes));
    pipe->close();
    return;
  }
  try {
    handshakes_.start([this, pipe] { serve_handshake(pipe); });
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --pending_handshakes_;
    }
    log_line(fmt::format("rpc transport {}: no thread for a handshake ({}); closing a connection",
                         printable(options_.name), e.what()));
    pipe->close();
  }
}

void TensorPipeTransport::listen_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    listen_cv_.wait(lock, [&] { return closed_ || relisten_; });
    if (closed_) return;
    relisten_ = false;
    const std::string why = listener_error_;
    auto old = std::move(listener_);
    lock.unlock();
    log_line(fmt::format(
        "rpc transport {}: an incoming connection failed during TensorPipe's setup ({}), which "
        "stops TensorPipe's listener; listening again on {}",
        printable(options_.name), why, address_));
    if (old) old->close();
    auto fresh = listen_again();
    lock.lock();
    if (closed_) {
      listener_ = std::move(fresh);  // close() closes it with the context
      return;
    }
    listener_ = fresh;
    if (fresh) {
      lock.unlock();
      arm_accept(fresh);
      lock.lock();
    }
    // Under a stream of failing connections, re-create at most 20 times a second.
    listen_cv_.wait_for(lock, std::chrono::milliseconds(50), [&] { return closed_; });
  }
}

std::shared_ptr<tensorpipe::Listener> TensorPipeTransport::listen_again() {
  // TensorPipe closes the old listener's socket asynchronously, and aborts the process when
  // its bind fails: wait until a bind of our own (with SO_REUSEADDR, as libuv's) succeeds.
  // Another process taking the port between that probe and TensorPipe's bind would still
  // abort this one; the port was ours a moment before, so that needs an unlucky accident.
  const auto address = torchpar::detail::parse_socket_address(fmt::format("{}:{}", host_, port_));
  const auto give_up = Clock::now() + kRelistenPatience;
  for (;;) {
    try {
      std::string bound;
      dev_t device = 0;
      ino_t inode = 0;
      torchpar::detail::listen_on(address, 1, &bound, &device, &inode);
      break;
    } catch (const SystemError& e) {
      if (e.error_code() != EADDRINUSE || Clock::now() > give_up) {
        log_line(
            fmt::format("rpc transport {}: cannot listen on {} again ({}): no member can "
                        "connect to this one any more",
                        printable(options_.name), address_, e.what()));
        return nullptr;
      }
    }
    std::unique_lock<std::mutex> lock(mutex_);
    if (listen_cv_.wait_for(lock, std::chrono::milliseconds(10), [&] { return closed_; })) {
      return nullptr;
    }
  }
  try {
    return ctx_->listen(listen_urls(port_));
  } catch (const std::exception& e) {
    log_line(fmt::format("rpc transport {}: cannot listen on {} again ({})",
                         printable(options_.name), address_, e.what()));
    return nullptr;
  }
}

// ---- connections ------------------------------------------------------------------------------

std::shared_ptr<Peer> TensorPipeTransport::peer_entry(const std::string& peer) {
  auto& p = peers_[peer];
  if (!p) p = std::make_shared<Peer>();
  return p;
}

std::shared_ptr<Conn> TensorPipeTransport::add_conn(std::shared_ptr<tensorpipe::Pipe> pipe,
                                                    const std::string& peer) {
  auto conn = std::make_shared<Conn>();
  conn->pipe = std::move(pipe);
  conn->peer = peer;
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return nullptr;
  auto p = peer_entry(peer);
  p->conns.push_back(conn);
  if (!p->out) p->out = conn;
  return conn;
}

void TensorPipeTransport::lose(const std::shared_ptr<Conn>& conn, const std::string& why) {
  bool report = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (conn->dead) return;
    conn->dead = true;
    if (auto it = peers_.find(conn->peer); it != peers_.end()) {
      auto& p = *it->second;
      std::erase(p.conns, conn);
      if (p.out == conn) p.out = p.conns.empty() ? nullptr : p.conns.front();
    }
    report = !closed_;
  }
  if (report) post(Event{.peer = conn->peer, .message = std::nullopt, .why = why});
  conn->pipe->close();
}

void TensorPipeTransport::serve_handshake(const std::shared_ptr<tensorpipe::Pipe>& pipe) {
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.handshake_timeout);
  std::shared_ptr<Conn> conn;
  try {
    // The remote name is what the peer's TensorPipe context calls itself: unproven, for logs.
    const std::string claimed = printable(pipe->getRemoteName());
    PipeAuthChannel channel(pipe, fmt::format("rpc transport {}: handshake with a peer calling "
                                              "itself \"{}\"",
                                              printable(options_.name), claimed));
    torchpar::detail::auth_accept(channel, options_.authkey, deadline, options_.auth);
    const std::string name = channel.recv(kMaxHandshakeFrame, deadline);
    if (name.empty()) throw AuthenticationError("protocol error: an empty member name");
    conn = add_conn(pipe, name);
    if (!conn) pipe->close();  // closed meanwhile
  } catch (const std::exception& e) {
    if (!closed()) {
      log_line(fmt::format("rpc transport {}: refused a connection: {}", printable(options_.name),
                           e.what()));
      // The accepting side is the one that refuses a wrong key (it checks first); the
      // refused side hangs up as soon as it reads the refusal.
      if (dynamic_cast<const AuthenticationError*>(&e)) {
        wait_until_peer_closes(pipe, std::min(deadline, Clock::now() + kRefusalLinger));
      }
    }
    pipe->close();
  } catch (...) {
    pipe->close();
  }
  if (conn) arm_read(conn);
  std::lock_guard<std::mutex> lock(mutex_);
  --pending_handshakes_;
}

std::shared_ptr<Conn> TensorPipeTransport::connect(const std::string& peer,
                                                   const std::string& address,
                                                   Clock::time_point deadline) {
  const std::string url = pipe_url(address);
  const auto started = Clock::now();
  const auto handshake_deadline = std::min(
      deadline, started + std::chrono::duration_cast<Clock::duration>(options_.handshake_timeout));
  std::shared_ptr<tensorpipe::Pipe> pipe;
  try {
    pipe = ctx_->connect(url, tensorpipe::PipeOptions().remoteName(peer));
  } catch (const std::exception& e) {
    throw ValueError(fmt::format("rpc transport: cannot connect to {} at {}: {}", printable(peer),
                                 printable(address), e.what()));
  }
  try {
    PipeAuthChannel channel(
        pipe, fmt::format("rpc transport {}: connection to {} at {}", printable(options_.name),
                          printable(peer), printable(address)));
    torchpar::detail::auth_connect(channel, options_.authkey, handshake_deadline, options_.auth);
    channel.send(options_.name, handshake_deadline);
  } catch (const TimeoutError& e) {
    pipe->close();
    if (closed()) throw ClosedError("rpc transport: closed while connecting");
    throw TimeoutError(
        fmt::format("{} (after {:.3g} s)", e.what(), seconds(Clock::now() - started)));
  } catch (const Error&) {
    pipe->close();
    if (closed()) throw ClosedError("rpc transport: closed while connecting");
    throw;
  } catch (...) {
    pipe->close();
    throw;
  }
  auto conn = add_conn(pipe, peer);
  if (!conn) {
    pipe->close();
    throw ClosedError("rpc transport: closed while connecting");
  }
  arm_read(conn);
  return conn;
}

// ---- messages ---------------------------------------------------------------------------------

std::string TensorPipeTransport::check_descriptor(const tensorpipe::Descriptor& d) const {
  if (d.metadata != kMessageTag) {
    return fmt::format("not an RPC message ({} bytes of metadata)", d.metadata.size());
  }
  if (d.payloads.size() != 2) {
    return fmt::format("{} payloads (an RPC message has 2: header and body)", d.payloads.size());
  }
  const size_t header = d.payloads[0].length;
  if (header > options_.max_header_bytes) {
    return fmt::format("a header of {} bytes (at most {})", header, options_.max_header_bytes);
  }
  if (d.tensors.size() > options_.max_storages) {
    return fmt::format("{} storages (at most {})", d.tensors.size(), options_.max_storages);
  }
  // total <= limit throughout, so no sum can overflow.
  const size_t limit = options_.max_message_bytes;
  size_t total = 0;
  bool fits = true;
  auto add = [&](size_t n) {
    if (n > limit - total) fits = false;
    if (fits) total += n;
  };
  add(header);
  add(d.payloads[1].length);
  for (const auto& t : d.tensors) {
    if (t.sourceDevice.type != tensorpipe::kCpuDeviceType ||
        (t.targetDevice.has_value() && t.targetDevice->type != tensorpipe::kCpuDeviceType)) {
      return fmt::format("a storage on {} (only CPU storages travel)", t.sourceDevice.toString());
    }
    add(t.length);
  }
  if (!fits) {
    return fmt::format("a message of more than {} bytes (max_message_bytes)", limit);
  }
  return {};
}

void TensorPipeTransport::arm_read(const std::shared_ptr<Conn>& conn) {
  conn->pipe->readDescriptor(
      [this, conn](const tensorpipe::Error& error, tensorpipe::Descriptor d) {
        in_callback(options_.name, "receiving", [&] {
          if (error) {
            lose(conn, error_text(error));
            return;
          }
          try {
            on_descriptor(conn, d);
          } catch (const std::exception& e) {  // bad_alloc for a message within the limits
            lose(conn, fmt::format("cannot receive a message: {}", e.what()));
          }
        });
      });
}

void TensorPipeTransport::on_descriptor(const std::shared_ptr<Conn>& conn,
                                        const tensorpipe::Descriptor& d) {
  if (const std::string why = check_descriptor(d); !why.empty()) {
    lose(conn, "protocol error: " + why);
    return;
  }
  // Allocated only now, each of the announced size.
  auto msg = std::make_shared<Message>();
  msg->header.resize(d.payloads[0].length);
  msg->body.resize(d.payloads[1].length);
  tensorpipe::Allocation allocation;
  allocation.payloads.push_back(tensorpipe::Allocation::Payload{msg->header.data()});
  allocation.payloads.push_back(tensorpipe::Allocation::Payload{msg->body.data()});
  msg->storages.reserve(d.tensors.size());
  for (const auto& t : d.tensors) {
    msg->storages.emplace_back(c10::Storage::use_byte_size_t(), t.length, c10::GetCPUAllocator(),
                               /*resizable=*/false);
    // A zero-length storage may have no data pointer; TensorPipe accepts nullptr for it.
    allocation.tensors.push_back(
        tensorpipe::Allocation::Tensor{tensorpipe::CpuBuffer{msg->storages.back().data()}});
  }
  conn->pipe->read(std::move(allocation), [this, conn, msg](const tensorpipe::Error& error) {
    in_callback(options_.name, "receiving", [&] {
      if (error) {
        lose(conn, error_text(error));
        return;
      }
      if (options_.inline_handlers && handlers_.on_message) {
        if (!closed()) deliver(conn->peer, std::move(*msg));
      } else {
        post(Event{.peer = conn->peer, .message = std::move(*msg), .why = {}});
      }
      arm_read(conn);
    });
  });
}

void TensorPipeTransport::write(const std::shared_ptr<Conn>& conn, Message msg) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (conn->dead) {
      throw ClosedError(
          fmt::format("rpc transport: the connection to {} was lost", printable(conn->peer)));
    }
  }
  // TensorPipe reads the bytes until the write's callback runs, which owns them till then.
  auto held = std::make_shared<Message>(std::move(msg));
  tensorpipe::Message message;
  message.metadata = std::string(kMessageTag);
  for (std::string* part : {&held->header, &held->body}) {
    tensorpipe::Message::Payload payload;
    payload.data = part->data();
    payload.length = part->size();
    message.payloads.push_back(std::move(payload));
  }
  message.tensors.reserve(held->storages.size());
  for (const auto& s : held->storages) {
    tensorpipe::Message::Tensor tensor;
    tensor.buffer = tensorpipe::CpuBuffer{s.nbytes() == 0 ? nullptr : s.data()};
    tensor.length = s.nbytes();
    message.tensors.push_back(std::move(tensor));
  }
  conn->pipe->write(std::move(message), [this, conn, held](const tensorpipe::Error& error) {
    in_callback(options_.name, "sending", [&] {
      if (error) lose(conn, error_text(error));
    });
  });
}

void TensorPipeTransport::send(const std::string& peer, const std::string& address, Message msg,
                               Clock::time_point deadline) {
  for (size_t i = 0; i < msg.storages.size(); ++i) {
    const auto& s = msg.storages[i];
    if (!s) throw ValueError(fmt::format("rpc transport: storage {} is undefined", i));
    if (s.device().type() != c10::DeviceType::CPU) {
      throw ValueError(fmt::format("rpc transport: storage {} is on {}; only CPU storages travel",
                                   i, s.device().str()));
    }
  }
  std::shared_ptr<Peer> p;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) throw ClosedError("rpc transport: closed");
    p = peer_entry(peer);
    ++active_sends_;
  }
  struct Active {  // close() waits until every send call is out
    TensorPipeTransport* self;
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
          "rpc transport: send to {}: another send to it (connecting) held it past the deadline",
          printable(peer)));
    }
    if (closed_) throw ClosedError("rpc transport: closed");
    p->busy = true;
    conn = p->out;
  }
  struct Busy {
    TensorPipeTransport* self;
    Peer* peer;
    ~Busy() {
      std::lock_guard<std::mutex> lock(self->mutex_);
      peer->busy = false;
      peer->idle.notify_one();
    }
  } busy{this, p.get()};

  if (!conn) {
    conn = connect(peer, address, deadline);
    // A pipe the peer opened meanwhile may have become the one sends use: keep to one.
    std::lock_guard<std::mutex> lock(mutex_);
    if (p->out) conn = p->out;
  }
  write(conn, std::move(msg));
}

// ---- handlers ---------------------------------------------------------------------------------

void TensorPipeTransport::post(Event event) {
  {
    std::lock_guard<std::mutex> lock(events_mu_);
    if (stop_dispatch_) return;
    events_.push_back(std::move(event));
  }
  events_cv_.notify_one();
}

void TensorPipeTransport::deliver(const std::string& peer, Message msg) noexcept {
  try {
    if (handlers_.on_message) handlers_.on_message(peer, std::move(msg));
  } catch (const std::exception& e) {
    log_line(fmt::format("rpc transport {}: a handler threw (ignored): {}",
                         printable(options_.name), e.what()));
  } catch (...) {
    log_line(fmt::format("rpc transport {}: a handler threw (ignored)", printable(options_.name)));
  }
}

void TensorPipeTransport::dispatch_loop() {
  for (;;) {
    Event event;
    {
      std::unique_lock<std::mutex> lock(events_mu_);
      events_cv_.wait(lock, [&] { return stop_dispatch_ || !events_.empty(); });
      if (stop_dispatch_) return;
      event = std::move(events_.front());
      events_.pop_front();
    }
    if (event.message) {
      deliver(event.peer, std::move(*event.message));
      continue;
    }
    try {
      if (handlers_.on_peer_lost) handlers_.on_peer_lost(event.peer, event.why);
    } catch (const std::exception& e) {
      log_line(fmt::format("rpc transport {}: a handler threw (ignored): {}",
                           printable(options_.name), e.what()));
    } catch (...) {
      log_line(
          fmt::format("rpc transport {}: a handler threw (ignored)", printable(options_.name)));
    }
  }
}

}  // namespace

std::unique_ptr<Transport> create_tensorpipe_transport(TransportOptions options,
                                                       TransportHandlers handlers) {
  return std::make_unique<TensorPipeTransport>(std::move(options), std::move(handlers));
}

}  // namespace torchpar::rpc
