// The TensorPipe implementation of the RPC transport (transport.h), in two modes: uv (TCP)
// plus shm when options.shm (create_tensorpipe_transport), or shm alone, the same-host half
// of create_transport's composite (create_tensorpipe_shm_transport). Wire format:
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

#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>
#include <tensorpipe/tensorpipe.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "core/auth_channel.h"
#include "core/signals.h"
#include "core/socket_address.h"
#include "rpc/transport/support.h"
#include "rpc/transport/tensorpipe/factory.h"
#include "rpc/transport/tensorpipe/pipe_channel.h"
#include "rpc/transport/transport.h"
#include "torchpar/core/error.h"

namespace torchpar::rpc {
namespace {

using Clock = std::chrono::steady_clock;
using detail::error_text;
using detail::kMaxPendingHandshakes;
using detail::kMessageTag;
using detail::log_line;
using detail::PipeAuthChannel;
using detail::printable;
using detail::seconds;
using detail::wait_until_peer_closes;

/// Which TensorPipe transports the context registers and listens on.
enum class Mode {
  kUv,       ///< uv (TCP), plus shm when options.shm: address "tcp://<ip>:<port>"
  kShmOnly,  ///< shm alone: address "shm://<abstract socket name>"
};

/// How long a refusing side waits for the peer to read `#FAILURE#` and hang up.
constexpr auto kRefusalLinger = std::chrono::seconds(1);
/// How long the listener thread tries to get the port back after TensorPipe's listener failed.
constexpr auto kRelistenPatience = std::chrono::seconds(5);

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

/// The TensorPipe URL of a member's address. kUv: "tcp://<ip>:<port>" (or "uv://..."), a
/// numeric host (TensorPipe resolves no names) and a port. kShmOnly: "shm://<name>", the name
/// of an abstract Unix socket (detail::is_shm_url). Errors: ValueError.
std::string pipe_url(const std::string& address, Mode mode) {
  if (mode == Mode::kUv) {
    constexpr std::string_view kUvScheme = "uv://";
    const std::string tcp = address.compare(0, kUvScheme.size(), kUvScheme) == 0
                                ? "tcp://" + address.substr(kUvScheme.size())
                                : address;
    return "uv://" + detail::parse_tcp_address(tcp).text();
  }
  if (!detail::is_shm_url(address)) {
    throw ValueError(
        fmt::format("rpc transport: address \"{}\" is not \"shm://<name>\"", printable(address)));
  }
  return address;
}

/// One pipe of an authenticated member (connected by this side or accepted).
struct PipeConn {
  std::shared_ptr<tensorpipe::Pipe> pipe;
  std::string peer;
  bool dead = false;  // guarded by the transport's mutex_: lost (reported once) or closing
};

// The members, their pipes and the send order: support.h's ConnectionTable (a member's `busy`
// flag is held from before a sender looks for a pipe until its write is issued, so writes
// reach TensorPipe in the order of send calls).
class TensorPipeTransport final : public Transport, private detail::ConnectionTable<PipeConn> {
 public:
  TensorPipeTransport(TransportOptions options, TransportHandlers handlers, Mode mode);
  ~TensorPipeTransport() override;

  std::string address() const override { return address_; }
  void send(const std::string& peer, const std::string& address, Message msg,
            Clock::time_point deadline) override;
  void close() override;

 private:
  void close_now();

  // Listening.
  void listen_first();
  std::vector<std::string> listen_urls(bool again) const;
  void arm_accept(const std::shared_ptr<tensorpipe::Listener>& listener);
  void on_accept(const tensorpipe::Listener* from, const tensorpipe::Error& error,
                 std::shared_ptr<tensorpipe::Pipe> pipe);
  void listen_loop();
  std::shared_ptr<tensorpipe::Listener> listen_again();

  // Connections.
  void serve_handshake(const std::shared_ptr<tensorpipe::Pipe>& pipe);
  std::shared_ptr<PipeConn> connect(const std::string& peer, const std::string& address,
                                    Clock::time_point deadline);
  std::shared_ptr<PipeConn> add_conn(std::shared_ptr<tensorpipe::Pipe> pipe,
                                     const std::string& peer);
  void lose(const std::shared_ptr<PipeConn>& conn, const std::string& why);

  // Messages.
  void arm_read(const std::shared_ptr<PipeConn>& conn);
  void on_descriptor(const std::shared_ptr<PipeConn>& conn, const tensorpipe::Descriptor& d);
  std::string check_descriptor(const tensorpipe::Descriptor& d) const;
  void write(const std::shared_ptr<PipeConn>& conn, Message msg);

  const TransportOptions options_;
  const Mode mode_;
  std::string host_;      // kUv: numeric bind host as it goes in a URL ("127.0.0.1", "[::1]")
  uint16_t port_ = 0;     // kUv: the uv listener's port; kept when the listener is re-created
  std::string shm_name_;  // kShmOnly: the abstract socket's name; kept likewise
  std::string address_;   // "tcp://host:port" or "shm://name"
  std::shared_ptr<tensorpipe::Context> ctx_;

  std::once_flag close_once_;
  // Guarded by mutex_ (ConnectionTable's), as the rest of this block.
  std::shared_ptr<tensorpipe::Listener> listener_;
  bool relisten_ = false;       // the listener failed: listen_loop makes a new one
  std::string listener_error_;  // why, for its log line
  std::condition_variable listen_cv_;
  int pending_handshakes_ = 0;

  detail::Dispatcher dispatcher_;
  detail::TaskThreads handshakes_;
  std::thread listen_thread_;
};

// ---- construction and close ----------------------------------------------------------------

TensorPipeTransport::TensorPipeTransport(TransportOptions options, TransportHandlers handlers,
                                         Mode mode)
    : options_(std::move(options)), mode_(mode), dispatcher_(options_.name, std::move(handlers)) {
  detail::check_options(options_);
  // libuv, and the shm transport's setup, write to sockets without MSG_NOSIGNAL: a member that
  // dies mid-message would end this process with SIGPIPE.
  torchpar::detail::ignore_sigpipe_if_default();
  listen_first();
  // A connection accepted before the threads run waits in the queue for them.
  arm_accept(listener_);
  try {
    dispatcher_.start();
    listen_thread_ = std::thread([this] { listen_loop(); });
  } catch (...) {
    close();  // joins what started; no destructor runs after a constructor throws
    throw;
  }
}

void TensorPipeTransport::listen_first() {
  if (mode_ == Mode::kUv) {
    // TensorPipe aborts the process when its uv listener cannot bind (an exception on its loop
    // thread): bind here first, which also turns a host name into the numeric address
    // TensorPipe needs and reports a bad host as SystemError.
    std::string bound;
    dev_t device = 0;
    ino_t inode = 0;
    torchpar::detail::listen_on(detail::bind_address(options_), 1, &bound, &device,
                                &inode);  // closed at once
    host_ = bound.substr(0, bound.rfind(':'));
  }
  const std::string where = mode_ == Mode::kUv ? fmt::format("tcp://{}:0", host_) : "shm://";
  try {
    ctx_ = std::make_shared<tensorpipe::Context>(tensorpipe::ContextOptions().name(options_.name));
    if (mode_ == Mode::kUv) ctx_->registerTransport(0, "uv", tensorpipe::transport::uv::create());
    // Registering skips an shm transport that is not viable here (no boot id, no network
    // namespace id, no shared memory); listening on it then fails below.
    if (mode_ == Mode::kShmOnly || options_.shm) {
      ctx_->registerTransport(100, "shm", tensorpipe::transport::shm::create());
    }
    ctx_->registerChannel(0, "basic", tensorpipe::channel::basic::create());
    ctx_->registerChannel(100, "cma", tensorpipe::channel::cma::create());
    listener_ = ctx_->listen(listen_urls(/*again=*/false));
    if (mode_ == Mode::kUv) {
      const std::string uv = listener_->address("uv");
      port_ = static_cast<uint16_t>(std::stoul(uv.substr(uv.rfind(':') + 1)));
      address_ = fmt::format("tcp://{}:{}", host_, port_);
    } else {
      shm_name_ = listener_->address("shm");
      address_ = "shm://" + shm_name_;
      pipe_url(address_, mode_);  // the autobound name is one send() accepts
    }
  } catch (const std::exception& e) {
    if (ctx_) {
      ctx_->close();
      ctx_->join();
    }
    throw SystemError("listen", 0, where, e.what());
  }
}

TensorPipeTransport::~TensorPipeTransport() {
  try {
    close();
  } catch (const std::exception& e) {
    log_line(fmt::format("rpc transport {}: close failed: {}", printable(options_.name), e.what()));
  }
  // close() called from a handler leaves the dispatch thread to dispatcher_'s destructor.
}

void TensorPipeTransport::close() {
  // A second caller waits until the first one is done: after close returns, no handler runs.
  std::call_once(close_once_, [this] { close_now(); });
}

void TensorPipeTransport::close_now() {
  std::shared_ptr<tensorpipe::Listener> listener;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    close_locked([](PipeConn&) {});  // waiting senders fail now
    listener = listener_;
  }
  listen_cv_.notify_all();
  dispatcher_.stop();
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
  dispatcher_.join();
  handshakes_.join_all();
  const auto peers = drain_after_close();  // send calls fail fast now; pipes released unlocked
  std::lock_guard<std::mutex> lock(mutex_);
  listener_.reset();
}

// ---- listening --------------------------------------------------------------------------------

std::vector<std::string> TensorPipeTransport::listen_urls(bool again) const {
  // An empty shm name autobinds an abstract Unix socket. kUv: peers learn it from TensorPipe's
  // own connection setup, never from address(), so a new listener may take a new name.
  // kShmOnly: the name is the address, so a new listener takes the same one.
  if (mode_ == Mode::kShmOnly) return {again ? "shm://" + shm_name_ : "shm://"};
  std::vector<std::string> urls{fmt::format("uv://{}:{}", host_, again ? port_ : 0)};
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
  // its uv bind fails (its shm listener merely fails): wait until a bind of our own (with
  // SO_REUSEADDR, as libuv's) succeeds. Another process taking the port or name between that
  // probe and TensorPipe's bind would still end this one; the port was ours a moment before,
  // so that needs an unlucky accident (or, for the shm name, a local user's intent).
  const auto address = torchpar::detail::parse_socket_address(
      mode_ == Mode::kUv ? fmt::format("{}:{}", host_, port_) : "@" + shm_name_);
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
    return ctx_->listen(listen_urls(/*again=*/true));
  } catch (const std::exception& e) {
    log_line(fmt::format("rpc transport {}: cannot listen on {} again ({})",
                         printable(options_.name), address_, e.what()));
    return nullptr;
  }
}

// ---- connections ------------------------------------------------------------------------------

std::shared_ptr<PipeConn> TensorPipeTransport::add_conn(std::shared_ptr<tensorpipe::Pipe> pipe,
                                                        const std::string& peer) {
  auto conn = std::make_shared<PipeConn>();
  conn->pipe = std::move(pipe);
  conn->peer = peer;
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return nullptr;
  file_locked(conn);
  return conn;
}

void TensorPipeTransport::lose(const std::shared_ptr<PipeConn>& conn, const std::string& why) {
  bool report = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (conn->dead) return;
    report = unfile_locked(conn);
  }
  if (report) dispatcher_.post_lost(conn->peer, why);
  conn->pipe->close();
}

void TensorPipeTransport::serve_handshake(const std::shared_ptr<tensorpipe::Pipe>& pipe) {
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.handshake_timeout);
  std::shared_ptr<PipeConn> conn;
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

std::shared_ptr<PipeConn> TensorPipeTransport::connect(const std::string& peer,
                                                       const std::string& address,
                                                       Clock::time_point deadline) {
  const std::string url = pipe_url(address, mode_);
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

void TensorPipeTransport::arm_read(const std::shared_ptr<PipeConn>& conn) {
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

void TensorPipeTransport::on_descriptor(const std::shared_ptr<PipeConn>& conn,
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
      if (options_.inline_handlers) {
        if (!closed()) dispatcher_.deliver(conn->peer, std::move(*msg));
      } else {
        dispatcher_.post_message(conn->peer, std::move(*msg));
      }
      arm_read(conn);
    });
  });
}

void TensorPipeTransport::write(const std::shared_ptr<PipeConn>& conn, Message msg) {
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
  detail::check_storages(msg);
  run_send(
      peer, deadline, [&] { return connect(peer, address, deadline); },
      [&](const std::shared_ptr<PipeConn>& conn) { write(conn, std::move(msg)); });
}

}  // namespace

std::unique_ptr<Transport> create_tensorpipe_transport(TransportOptions options,
                                                       TransportHandlers handlers) {
  return std::make_unique<TensorPipeTransport>(std::move(options), std::move(handlers), Mode::kUv);
}

std::unique_ptr<Transport> detail::create_tensorpipe_shm_transport(TransportOptions options,
                                                                   TransportHandlers handlers) {
  return std::make_unique<TensorPipeTransport>(std::move(options), std::move(handlers),
                                               Mode::kShmOnly);
}

}  // namespace torchpar::rpc
