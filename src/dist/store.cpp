#include "dist/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "dist/store_wire.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kForever = Clock::time_point::max();
constexpr size_t kMaxFrame = kStoreMaxValueBytes * 2 + 64 * 1024;

enum Cmd : uint8_t {
  kSet = 1,
  kGet,
  kAdd,
  kCompareSet,
  kCheck,
  kWait,
  kDelete,
  kNumKeys,
  kSetEphemeral
};
enum Status : uint8_t { kOk = 0, kTimedOut = 1, kRefused = 2 };

using namespace store_wire;  // NOLINT(google-build-using-namespace): the wire helpers

/// Reads one framed message; a length over kMaxFrame is refused before allocating.
std::string read_message(int fd, Clock::time_point deadline, std::string_view what) {
  unsigned char hdr[4];
  recv_all(fd, hdr, 4, deadline, what);
  const uint32_t n = (uint32_t{hdr[0]} << 24) | (uint32_t{hdr[1]} << 16) | (uint32_t{hdr[2]} << 8) |
                     uint32_t{hdr[3]};
  if (n > kMaxFrame) {
    throw Error(fmt::format("{}: message of {} bytes refused (at most {})", what, n, kMaxFrame));
  }
  std::string out(n, '\0');
  recv_all(fd, out.data(), n, deadline, what);
  return out;
}

void check_key(const std::string& key) {
  if (key.size() > kStoreMaxKeyBytes) {
    throw Error(fmt::format("store: key of {} bytes is over the limit of {}", key.size(),
                            kStoreMaxKeyBytes));
  }
}

Clock::time_point after(std::chrono::milliseconds ms) {
  if (ms.count() <= 0) return kForever;  // c10d's kNoTimeout
  return Clock::now() + ms;
}

/// The calling thread's StoreDeadline (kForever: none).
thread_local Clock::time_point t_store_deadline = kForever;

/// Replies a StoreDeadline left unread past this many: the connection counts as broken.
constexpr int kMaxUnread = 64;

/// Waits until `fd` is readable (or closed) or `deadline` passed; false at the deadline.
bool readable_by(int fd, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left.count(), 0, 1000)));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return true;  // the read reports it
    if (Clock::now() >= deadline) return false;
  }
}

}  // namespace

// ---- server -------------------------------------------------------------------------------

StoreServer::StoreServer(const std::string& bind_addr, int port, AuthKey key,
                         std::chrono::milliseconds handshake_timeout)
    : key_(std::move(key)), handshake_timeout_(handshake_timeout) {
  const std::string where = fmt::format("store on {}:{}", bind_addr, port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const int gai = ::getaddrinfo(bind_addr == "localhost" ? "127.0.0.1" : bind_addr.c_str(),
                                std::to_string(port).c_str(), &hints, &res);
  if (gai != 0 || !res) {
    throw Error(fmt::format("World: cannot resolve the address {} to serve the store on: {}",
                            bind_addr, ::gai_strerror(gai)));
  }
  std::string last_error;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd) continue;
    const int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (ai->ai_family == AF_INET6) {
      ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    }
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), 1024) != 0) {
      last_error = std::strerror(errno);
      continue;
    }
    listen_fd_ = std::move(fd);
    break;
  }
  ::freeaddrinfo(res);
  if (!listen_fd_) {
    throw Error(fmt::format(
        "World: rank 0 cannot serve the {}: {} (the address must be one of this host's; set "
        "WorldOptions::store_bind_addr or TORCHPAR_STORE_BIND_ADDR, e.g. 0.0.0.0 for every "
        "interface)",
        where, last_error));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(listen_fd_.get(), reinterpret_cast<sockaddr*>(&ss), &len);
  port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  wake_fd_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_) throw_system_error("eventfd", errno, where);
  acceptor_ = std::thread([this] { accept_loop(); });
}

StoreServer::~StoreServer() {
  stop_ = true;
  const uint64_t one = 1;
  (void)!::write(wake_fd_.get(), &one, sizeof(one));
  if (acceptor_.joinable()) acceptor_.join();
  {
    std::lock_guard<std::mutex> g(conns_mu_);
    for (auto& c : conns_) ::shutdown(c->fd.get(), SHUT_RDWR);  // wakes their reads
  }
  {
    std::lock_guard<std::mutex> g(mu_);  // waiters re-check stop_
  }
  cv_.notify_all();
  reap(/*all=*/true);
}

void StoreServer::reap(bool all) {
  std::list<std::unique_ptr<Conn>> finished;
  {
    std::lock_guard<std::mutex> g(conns_mu_);
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (all || (*it)->done) {
        finished.push_back(std::move(*it));
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : finished) {
    if (c->thread.joinable()) c->thread.join();
  }
}

void StoreServer::accept_loop() {
  constexpr int kMaxHandshaking = 128;  // strangers cannot make us start unbounded threads
  while (!stop_) {
    pollfd p[2] = {{listen_fd_.get(), POLLIN, 0}, {wake_fd_.get(), POLLIN, 0}};
    const int r = ::poll(p, 2, 1000);
    if (stop_) return;
    reap(false);
    if (r <= 0 || !(p[0].revents & POLLIN)) continue;
    UniqueFd fd(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd) {
      // EMFILE and friends: back off instead of spinning on a pending connection
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) ::poll(nullptr, 0, 50);
      continue;
    }
    if (handshaking_.load() >= kMaxHandshaking) continue;  // closes it
    const int one = 1;
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto conn = std::make_unique<Conn>();
    conn->fd = std::move(fd);
    Conn* c = conn.get();
    handshaking_.fetch_add(1);
    std::lock_guard<std::mutex> g(conns_mu_);
    conns_.push_back(std::move(conn));
    c->thread = std::thread([this, c] { serve(c); });
  }
}

void StoreServer::serve(Conn* c) {
  const int fd = c->fd.get();
  bool authenticated = false;
  std::vector<std::string> ephemeral;  // keys set with kSetEphemeral on this connection
  try {
    auth_accept(fd, key_, Clock::now() + handshake_timeout_);
    authenticated = true;
    handshaking_.fetch_sub(1);
    while (!stop_) {
      const std::string req = read_message(fd, kForever, "store connection");
      if (!handle(fd, req, &ephemeral)) break;
    }
  } catch (const std::exception&) {
    // A stranger, a wrong key, a stalled or closed client, a violation: end this connection
    // only. The client sees the refusal (#FAILURE#) or the closed socket.
  }
  if (!authenticated) handshaking_.fetch_sub(1);
  if (!ephemeral.empty()) {  // the connection's own keys go with it (an agent's liveness)
    {
      std::lock_guard<std::mutex> g(mu_);
      for (const auto& k : ephemeral) data_.erase(k);
    }
    cv_.notify_all();
  }
  ::shutdown(fd, SHUT_RDWR);
  c->done = true;
}

namespace {

/// Sends one reply: the status byte, then `out`.
bool send_reply(int fd, Status st, const std::string& out) {
  std::string body(1, static_cast<char>(st));
  body += out;
  const std::string f = frame(std::move(body));
  send_all(fd, f.data(), f.size(), Clock::now() + std::chrono::seconds(30), "store reply");
  return true;
}

std::string read_key(Reader& in) { return std::string(in.bytes(kStoreMaxKeyBytes)); }

/// A count, then that many keys (at most kStoreMaxKeys, else the reader fails).
std::vector<std::string> read_keys(Reader& in) {
  std::vector<std::string> ks;
  const uint32_t n = in.u32();
  if (n > kStoreMaxKeys) in.ok = false;
  for (uint32_t i = 0; in.ok && i < n; ++i) ks.push_back(read_key(in));
  return ks;
}

}  // namespace

bool StoreServer::all_present(const std::vector<std::string>& ks) const {
  for (const auto& k : ks) {
    if (!data_.count(k)) return false;
  }
  return true;
}

bool StoreServer::wait_keys(std::unique_lock<std::mutex>& lk, const std::vector<std::string>& ks,
                            int64_t timeout_ms) {
  const auto deadline = after(std::chrono::milliseconds(timeout_ms));
  while (!all_present(ks)) {
    if (stop_) return false;
    if (deadline == kForever) {
      cv_.wait(lk);
    } else if (cv_.wait_until(lk, deadline) == std::cv_status::timeout && !all_present(ks)) {
      return false;
    }
  }
  return true;
}

int64_t StoreServer::add_to(const std::string& k, int64_t delta) {
  int64_t value = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto& v = data_[k];
    if (!v.empty()) value = std::strtoll(std::string(v.begin(), v.end()).c_str(), nullptr, 10);
    value += delta;
    const std::string s = std::to_string(value);
    v.assign(s.begin(), s.end());
  }
  cv_.notify_all();
  return value;
}

std::string StoreServer::compare_set(const std::string& k, std::string_view expected,
                                     std::string_view desired) {
  std::string out;
  {
    std::lock_guard<std::mutex> g(mu_);
    // c10d TCPStore's semantics: a missing key is created only when `expected` is empty.
    auto it = data_.find(k);
    if (it == data_.end()) {
      if (expected.empty()) {
        data_[k].assign(desired.begin(), desired.end());
        put_bytes(out, desired.data(), desired.size());
      } else {
        put_bytes(out, expected.data(), expected.size());
      }
    } else {
      if (std::string_view(reinterpret_cast<const char*>(it->second.data()), it->second.size()) ==
          expected) {
        it->second.assign(desired.begin(), desired.end());
      }
      put_vec(out, it->second);
    }
  }
  cv_.notify_all();
  return out;
}

bool StoreServer::handle(int fd, const std::string& req, std::vector<std::string>* ephemeral) {
  Reader in{req};
  const uint8_t cmd = in.u8();
  std::string out;
  switch (cmd) {
    case kSet: {
      auto k = read_key(in);
      auto v = in.bytes(kStoreMaxValueBytes);
      if (!in.ok) return false;
      {
        std::lock_guard<std::mutex> g(mu_);
        data_[k].assign(v.begin(), v.end());
      }
      cv_.notify_all();
      return send_reply(fd, kOk, out);
    }
    case kGet: {
      auto k = read_key(in);
      const int64_t timeout_ms = in.i64();
      if (!in.ok) return false;
      std::unique_lock<std::mutex> lk(mu_);
      if (!wait_keys(lk, {k}, timeout_ms)) return send_reply(fd, kTimedOut, out);
      put_vec(out, data_[k]);
      lk.unlock();
      return send_reply(fd, kOk, out);
    }
    case kAdd: {
      auto k = read_key(in);
      const int64_t delta = in.i64();
      if (!in.ok) return false;
      put_i64(out, add_to(k, delta));
      return send_reply(fd, kOk, out);
    }
    case kCompareSet: {
      auto k = read_key(in);
      auto expected = in.bytes(kStoreMaxValueBytes);
      auto desired = in.bytes(kStoreMaxValueBytes);
      if (!in.ok) return false;
      return send_reply(fd, kOk, compare_set(k, expected, desired));
    }
    case kCheck: {
      auto ks = read_keys(in);
      if (!in.ok) return false;
      std::lock_guard<std::mutex> g(mu_);
      out.push_back(all_present(ks) ? 1 : 0);
      return send_reply(fd, kOk, out);
    }
    case kWait: {
      auto ks = read_keys(in);
      const int64_t timeout_ms = in.i64();
      if (!in.ok) return false;
      std::unique_lock<std::mutex> lk(mu_);
      const bool ok = wait_keys(lk, ks, timeout_ms);
      lk.unlock();
      return send_reply(fd, ok ? kOk : kTimedOut, out);
    }
    case kDelete: {
      auto k = read_key(in);
      if (!in.ok) return false;
      std::lock_guard<std::mutex> g(mu_);
      out.push_back(data_.erase(k) ? 1 : 0);
      return send_reply(fd, kOk, out);
    }
    case kSetEphemeral: {
      auto k = read_key(in);
      auto v = in.bytes(kStoreMaxValueBytes);
      if (!in.ok || ephemeral->size() >= kStoreMaxKeys) return false;
      {
        std::lock_guard<std::mutex> g(mu_);
        data_[k].assign(v.begin(), v.end());
      }
      ephemeral->push_back(k);
      cv_.notify_all();
      return send_reply(fd, kOk, out);
    }
    case kNumKeys: {
      std::lock_guard<std::mutex> g(mu_);
      put_i64(out, static_cast<int64_t>(data_.size()));
      return send_reply(fd, kOk, out);
    }
    default:
      return false;
  }
}

// ---- client -------------------------------------------------------------------------------

namespace {

/// Connects to addr:port, retrying (the server may not listen yet) until `deadline`.
UniqueFd connect_retrying(const std::string& addr, int port, Clock::time_point deadline,
                          const std::string& where) {
  std::string last = "no address";
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* res = nullptr;
    const int gai = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (gai != 0) {
      last = ::gai_strerror(gai);
      res = nullptr;
    }
    for (addrinfo* ai = res; ai; ai = ai->ai_next) {
      UniqueFd fd(
          ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
      if (!fd) continue;
      int rc = ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::min(deadline, Clock::now() + std::chrono::seconds(5)) - Clock::now());
        pollfd p{fd.get(), POLLOUT, 0};
        if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 1))) == 1) {
          int err = 0;
          socklen_t len = sizeof(err);
          ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
          rc = err == 0 ? 0 : -1;
          errno = err;
        } else {
          errno = ETIMEDOUT;
        }
      }
      if (rc == 0) {
        ::freeaddrinfo(res);
        const int one = 1;
        ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return fd;
      }
      last = std::strerror(errno);
    }
    if (res) ::freeaddrinfo(res);
    if (Clock::now() + std::chrono::milliseconds(50) >= deadline) {
      throw TimeoutError(fmt::format("cannot reach {}: {}", where, last));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace

StoreClient::StoreClient(const std::string& addr, int port, const AuthKey& key,
                         std::chrono::milliseconds timeout, const std::string& host_role)
    : c10d::Store(timeout), where_(fmt::format("the store at {}:{} ({})", addr, port, host_role)) {
  const auto deadline = after(timeout);
  for (;;) {
    fd_ = connect_retrying(addr, port, deadline, where_);
    try {
      auth_connect(fd_.get(), key, deadline);
      return;
    } catch (const AuthenticationError& e) {
      throw AuthenticationError(fmt::format(
          "{} and this process do not share the job's key ({}): give every rank the same "
          "WorldOptions::authkey or TORCHPAR_AUTHKEY (hex)",
          where_, e.what_without_backtrace()));
    } catch (const ClosedError&) {
      // The server closed before the handshake ended (it was busy or restarting): retry
      // within the deadline, as for a refused connection.
      if (Clock::now() >= deadline) throw TimeoutError(fmt::format("cannot reach {}", where_));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
}

StoreClient::~StoreClient() = default;

StoreDeadline::StoreDeadline(Clock::time_point deadline) : previous_(t_store_deadline) {
  t_store_deadline = std::min(previous_, deadline);
}

StoreDeadline::~StoreDeadline() { t_store_deadline = previous_; }

std::string StoreClient::call(const std::string& req, std::chrono::milliseconds wait_ms,
                              const char* what) {
  std::lock_guard<std::mutex> g(mu_);
  if (!broken_.empty()) throw RankLostError(0, broken_);
  // The reply of a wait comes when the server's own timer fires: allow for it.
  const auto op = timeout_;
  const auto deadline = wait_ms.count() > 0 ? Clock::now() + wait_ms + std::chrono::seconds(5)
                        : op.count() > 0    ? Clock::now() + op + std::chrono::seconds(5)
                                            : kForever;
  // The caller's StoreDeadline: waited for with poll before any byte of a reply is read, so
  // that giving up there leaves the stream in step (the reply is dropped by a later call).
  const Clock::time_point cap = t_store_deadline;
  const bool capped = cap < deadline;
  bool cap_hit = false;
  std::string reply;
  try {
    const std::string f = frame(req);
    send_all(fd_.get(), f.data(), f.size(), std::min(deadline, cap), where_);
    int pending = unread_ + 1;  // the replies still to come, ours last
    unread_ = 0;
    for (;;) {
      if (capped && !readable_by(fd_.get(), cap)) {
        unread_ = pending;
        cap_hit = true;
        break;
      }
      reply = read_message(fd_.get(), deadline, where_);
      if (--pending == 0) break;
    }
  } catch (const TimeoutError&) {
    broken_ = fmt::format("{} stopped answering (a {} timed out)", where_, what);
    throw TimeoutError(broken_);
  } catch (const Error& e) {
    broken_ = fmt::format(
        "lost the connection to {}: its host exited or closed the store ({} failed: {})", where_,
        what, e.what_without_backtrace());
    fd_.reset();
    throw RankLostError(0, broken_);
  }
  if (cap_hit) {
    const std::string msg =
        fmt::format("{} did not answer a {} within the caller's limit (rank 0 is stopped or busy)",
                    where_, what);
    if (unread_ > kMaxUnread) broken_ = msg;
    throw TimeoutError(msg);
  }
  if (reply.empty()) throw Error(fmt::format("{}: empty reply to {}", where_, what));
  const auto st = static_cast<uint8_t>(reply[0]);
  if (st == kTimedOut) {
    throw TimeoutError(fmt::format("{}: {} timed out after {} ms", where_, what,
                                   (wait_ms.count() > 0 ? wait_ms : timeout_).count()));
  }
  if (st != kOk) throw Error(fmt::format("{}: {} refused: {}", where_, what, reply.substr(1)));
  return reply.substr(1);
}

void StoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  put(kSet, key, value, "set");
}

void StoreClient::put(uint8_t cmd, const std::string& key, const std::vector<uint8_t>& value,
                      const char* what) {
  check_key(key);
  if (value.size() > kStoreMaxValueBytes) {
    throw Error(fmt::format("store: value of {} bytes is over the limit of {}", value.size(),
                            kStoreMaxValueBytes));
  }
  std::string req(1, static_cast<char>(cmd));
  put_str(req, key);
  put_vec(req, value);
  call(req, std::chrono::milliseconds(0), what);
}

std::vector<uint8_t> StoreClient::compareSet(const std::string& key,
                                             const std::vector<uint8_t>& expected,
                                             const std::vector<uint8_t>& desired) {
  check_key(key);
  std::string req(1, static_cast<char>(kCompareSet));
  put_str(req, key);
  put_vec(req, expected);
  put_vec(req, desired);
  const std::string rep = call(req, std::chrono::milliseconds(0), "compareSet");
  Reader r{rep};  // a view: the reply must outlive it
  auto v = r.bytes(kStoreMaxValueBytes);
  return {v.begin(), v.end()};
}

std::vector<uint8_t> StoreClient::get(const std::string& key) {
  check_key(key);
  std::string req(1, static_cast<char>(kGet));
  put_str(req, key);
  put_i64(req, timeout_.count());
  const std::string rep = call(req, timeout_, "get");
  Reader r{rep};
  auto v = r.bytes(kStoreMaxValueBytes);
  return {v.begin(), v.end()};
}

int64_t StoreClient::add(const std::string& key, int64_t value) {
  check_key(key);
  std::string req(1, static_cast<char>(kAdd));
  put_str(req, key);
  put_i64(req, value);
  const std::string rep = call(req, std::chrono::milliseconds(0), "add");
  Reader r{rep};
  return r.i64();
}

void StoreClient::set_ephemeral(const std::string& key, const std::vector<uint8_t>& value) {
  put(kSetEphemeral, key, value, "set_ephemeral");
}

bool StoreClient::deleteKey(const std::string& key) {
  check_key(key);
  std::string req(1, static_cast<char>(kDelete));
  put_str(req, key);
  return call(req, std::chrono::milliseconds(0), "deleteKey") == std::string(1, '\1');
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  std::string req(1, static_cast<char>(kCheck));
  put_u32(req, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) {
    check_key(k);
    put_str(req, k);
  }
  return call(req, std::chrono::milliseconds(0), "check") == std::string(1, '\1');
}

int64_t StoreClient::getNumKeys() {
  const std::string rep =
      call(std::string(1, static_cast<char>(kNumKeys)), std::chrono::milliseconds(0), "getNumKeys");
  Reader r{rep};
  return r.i64();
}

void StoreClient::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void StoreClient::wait(const std::vector<std::string>& keys,
                       const std::chrono::milliseconds& timeout) {
  if (keys.size() > kStoreMaxKeys) throw Error("store: too many keys to wait for");
  std::string req(1, static_cast<char>(kWait));
  put_u32(req, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) {
    check_key(k);
    put_str(req, k);
  }
  put_i64(req, timeout.count());
  call(req, timeout, "wait");
}

bool store_wait_count(c10d::Store& store, const std::string& key, int64_t count,
                      Clock::time_point deadline, const std::function<bool()>& keep_waiting) {
  while (store.add(key, 0) < count) {
    if (Clock::now() > deadline || (keep_waiting && !keep_waiting())) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

bool store_barrier(c10d::Store& store, const std::string& key, int64_t count,
                   Clock::time_point deadline, const std::function<bool()>& keep_waiting) {
  store.add(key, 1);
  return store_wait_count(store, key, count, deadline, keep_waiting);
}

int store_wait_keys(c10d::Store& store, const std::vector<std::string>& keys,
                    Clock::time_point deadline) {
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto left =
        std::max(std::chrono::milliseconds(1),
                 std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    try {
      store.wait({keys[i]}, left);
    } catch (const RankLostError&) {
      throw;
    } catch (const std::exception&) {  // c10d stores time out with c10::Error
      return static_cast<int>(i);
    }
  }
  return -1;
}

int store_poll_keys(c10d::Store& store, const std::vector<std::string>& keys,
                    Clock::time_point deadline) {
  for (size_t i = 0; i < keys.size(); ++i) {
    while (!store.check({keys[i]})) {
      if (Clock::now() > deadline) return static_cast<int>(i);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  return -1;
}

}  // namespace torchpar::detail
