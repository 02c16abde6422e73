#include "manager/client.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <random>
#include <string_view>
#include <thread>
#include <utility>

#include "core/futex.h"
#include "core/liveness.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"
#include "torchpar/ipc/listener.h"
#include "torchpar/manager/proxy.h"
#include "torchpar/manager/python.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar {
namespace detail {
namespace {

using manager::Request;
using manager::RequestKind;
using manager::Response;

// Idle call connections a process keeps per manager.
constexpr size_t kMaxIdle = 4;

// The pause between two attempts to connect a call connection while the server lives.
constexpr auto kFirstRetryPause = std::chrono::milliseconds(10);
constexpr auto kMaxRetryPause = std::chrono::milliseconds(200);

// TORCHPAR_MANAGER_SHM=0 keeps calls on their sockets (benchmarks compare both paths).
bool shm_channel_enabled() { return env_flag("TORCHPAR_MANAGER_SHM", true); }

// Connections by address, for this process (a fork child finds its parent's entries and
// skips them: their pid is not its own).
std::mutex g_clients_mu;
std::map<std::string, std::weak_ptr<ManagerClient>>& clients() {
  static auto* m = new std::map<std::string, std::weak_ptr<ManagerClient>>();  // never freed:
  return *m;  // proxies may be destroyed during static destruction
}

}  // namespace

ManagerClient::ManagerClient(Connection connection, std::string address,
                             std::optional<AuthKey> authkey, Timeout timeout, bool share_tensors)
    : connection_(std::move(connection)),
      address_(std::move(address)),
      authkey_(std::move(authkey)),
      timeout_(timeout),
      share_tensors_(share_tensors),
      pid_(::getpid()),
      shm_channel_(shm_channel_enabled()) {}

std::shared_ptr<ManagerClient> ManagerClient::get(const std::string& address,
                                                  const std::optional<AuthKey>& authkey,
                                                  Timeout timeout, bool share_tensors) {
  // One connection per manager and key: a client with another key must do its own
  // handshake (and be refused if the key is wrong). Proxies that share tensors and proxies
  // that copy them do not share a client (the choice is the client's).
  // The call timeout is the client's too: a proxy loaded with another timeout gets its own.
  const std::string slot =
      fmt::format("{}\n{}\n{}\n{}", address, authkey ? to_hex(*authkey) : std::string("-"),
                  timeout ? timeout->count() : -1.0, share_tensors);
  std::lock_guard<std::mutex> g(g_clients_mu);
  auto& map = clients();
  if (auto it = map.find(slot); it != map.end()) {
    if (auto c = it->second.lock(); c && c->pid() == ::getpid() && !c->broken()) return c;
  }
  Connection connection = Client(address, {.authkey = authkey, .timeout = timeout});
  auto c = std::make_shared<ManagerClient>(std::move(connection), address, authkey, timeout,
                                           share_tensors);
  map[slot] = c;
  return c;
}

bool ManagerClient::broken() const {
  std::lock_guard<std::mutex> g(mu_);
  return !broken_.empty();
}

void ManagerClient::break_with(std::string why) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (broken_.empty()) broken_ = std::move(why);
    connection_.close();
  }
  std::lock_guard<std::mutex> g(pool_mu_);
  for (auto& c : idle_) c.connection.close();
  idle_.clear();
}

uint64_t ManagerClient::caller_id() {
  static std::atomic<uint64_t> next_thread{1};
  thread_local const uint64_t thread_ordinal = next_thread++;
  // The process part: one random draw per program image mixed with the pid, so a fork child
  // (whose one thread keeps the parent's ordinal) gets its own. It is computed from values
  // that never change within a process: every thread sees the same one from its first call.
  // (It was re-seeded by whichever thread first saw a new pid: threads making their first
  // calls at once could re-seed it between another thread's acquire and its wait, which the
  // server then refused as "cannot wait on un-acquired lock".)
  static const uint64_t seed = [] {
    std::random_device rd;
    return uint64_t{rd()} << 32 ^ rd();
  }();
  uint64_t x = seed ^ static_cast<uint64_t>(::getpid());  // splitmix64's finalizer
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return (x << 20) + thread_ordinal;
}

void ManagerClient::attach_channel(CallConnection& c) {
  std::unique_ptr<ShmChannel> channel;
  try {
    channel = ShmChannel::create();
  } catch (const std::exception&) {
    return;  // no /dev/shm, or it is full: this connection uses its socket
  }
  Request r;
  r.kind = static_cast<uint8_t>(RequestKind::kAttachChannel);
  r.type_id = channel->name();
  c.connection.send(r);
  const auto response =
      loads<Response>(Payload{c.connection.recv_bytes(timeout_, manager::kMaxMessageBytes), {}});
  channel->unlink();  // both sides have it mapped (or the server could not open it)
  if (response.ok) c.channel = std::move(channel);
}

std::string ManagerClient::call(Request request, Timeout wait) {
  if (broken()) throw ClosedError(broken_text());
  request.caller = caller_id();
  CallConnection c;
  {
    std::lock_guard<std::mutex> g(pool_mu_);
    if (!idle_.empty()) {
      c = std::move(idle_.back());
      idle_.pop_back();
    }
  }
  const bool fresh = c.connection.closed();
  if (fresh) c.connection = connect_call(request.method);
  const Timeout reply_timeout =
      timeout_ && wait ? Timeout(*timeout_ + *wait) : Timeout(std::nullopt);
  Response response;
  try {
    if (fresh && shm_channel_) attach_channel(c);
    if (c.channel) {
      const Deadline deadline = deadline_after(reply_timeout);
      c.channel->send(dumps(request, {.copy_tensor = true}).bytes, c.connection);
      response = loads<Response>(
          Payload{c.channel->recv(c.connection, deadline, manager::kMaxMessageBytes), {}});
    } else {
      c.connection.send(request);
      response = loads<Response>(
          Payload{c.connection.recv_bytes(reply_timeout, manager::kMaxMessageBytes), {}});
    }
  } catch (const TimeoutError&) {
    c.connection.close();  // a late reply would be read as the next call's
    throw TimeoutError(fmt::format("manager at {}: no reply to '{}' within {} s", address_,
                                   request.method, reply_timeout ? reply_timeout->count() : 0));
  } catch (const ClosedError&) {
    c.connection.close();
    break_with(
        fmt::format("manager at {} is gone: the connection to its server closed (it was shut down, "
                    "exited or was killed)",
                    address_));
    throw ClosedError(broken_text());
  } catch (const Error& e) {
    c.connection.close();
    break_with(fmt::format("manager at {}: the connection failed: {}", address_, e.what()));
    throw ClosedError(broken_text());
  }
  {
    std::lock_guard<std::mutex> g(pool_mu_);
    // A burst of concurrent calls leaves no more than kMaxIdle connections (and server
    // threads) behind; the others close.
    if (!broken() && idle_.size() < kMaxIdle) idle_.push_back(std::move(c));
  }
  if (!response.ok) throw RemoteError(response.error_type, response.error_message);
  return std::move(response.value);
}

bool ManagerClient::server_gone() {
  std::lock_guard<std::mutex> g(mu_);
  if (!broken_.empty()) return true;
  // Nothing is in flight on the control connection while mu_ is held, and the server sends
  // nothing unasked: anything readable (EOF, a reset) means the server is gone. A late
  // reply (late_replies_) is readable too, so then only a hang up counts.
  if (late_replies_ == 0) return socket_peer_gone(connection_.fileno());
  pollfd p{connection_.fileno(), POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

Connection ManagerClient::connect_call(const std::string& method) {
  const Deadline deadline = deadline_after(timeout_);
  std::string last;
  for (auto pause = std::chrono::milliseconds(kFirstRetryPause);;
       pause = std::min(pause * 2, std::chrono::milliseconds(kMaxRetryPause))) {
    try {
      return Client(address_, {.authkey = authkey_, .timeout = deadline.remaining()});
    } catch (const TimeoutError& e) {
      last = e.what();
    } catch (const Error& e) {
      // Refused, reset, the handshake closed by a server that shed load, the kernel's own
      // connect timeout: the server is gone only when this process's control connection
      // says so. Otherwise try again until the call's deadline.
      last = e.what();
      if (server_gone()) {
        break_with(
            fmt::format("manager at {} is gone: cannot connect to it ({})", address_, e.what()));
        throw ClosedError(broken_text());
      }
    }
    if (past(deadline)) {
      // Slow is not gone: this call fails; the references and later calls are unharmed.
      throw TimeoutError(fmt::format(
          "manager at {}: could not connect for '{}' within {} s ({}); the server is still "
          "there (this process's connection to it is open), so later calls go on",
          address_, method, timeout_ ? timeout_->count() : 0, last));
    }
    std::this_thread::sleep_for(
        std::min<SteadyClock::duration>(pause, deadline ? *deadline - SteadyClock::now() : pause));
  }
}

std::string ManagerClient::broken_text() const {
  std::lock_guard<std::mutex> g(mu_);
  return broken_;
}

std::string ManagerClient::request(const Request& request) {
  std::lock_guard<std::mutex> g(mu_);
  if (!broken_.empty()) throw ClosedError(broken_);
  Response response;
  try {
    // Replies to requests that timed out come first, in order: skip them.
    while (late_replies_ > 0) {
      (void)connection_.recv_bytes(timeout_, manager::kMaxMessageBytes);
      --late_replies_;
    }
    connection_.send(request);
    ++late_replies_;  // until its reply is read
    response =
        loads<Response>(Payload{connection_.recv_bytes(timeout_, manager::kMaxMessageBytes), {}});
    --late_replies_;
  } catch (const TimeoutError&) {
    if (!connection_.closed()) {
      // Nothing of the reply was read: the stream is in sync. The connection (and so every
      // reference this process holds) stays; the late reply is skipped by the next request.
      throw TimeoutError(fmt::format(
          "manager at {}: no reply within {} s (the request may still run; the connection "
          "stays open and later requests skip its reply)",
          address_, timeout_ ? timeout_->count() : 0));
    }
    broken_ = fmt::format(
        "manager at {}: a reply arrived only in part within {} s; this process's connection "
        "to it was closed (its stream is out of sync)",
        address_, timeout_ ? timeout_->count() : 0);
    throw TimeoutError(broken_);
  } catch (const ClosedError&) {
    broken_ = fmt::format(
        "manager at {} is gone: the connection to its server closed (it was shut down, "
        "exited or was killed)",
        address_);
    connection_.close();
    throw ClosedError(broken_);
  } catch (const Error& e) {
    broken_ = fmt::format("manager at {}: the connection failed: {}", address_, e.what());
    connection_.close();
    throw ClosedError(broken_);
  }
  if (!response.ok) throw RemoteError(response.error_type, response.error_message);
  return std::move(response.value);
}

bool ManagerClient::stalled() const {
  std::lock_guard<std::mutex> g(mu_);
  return late_replies_ > 0;
}

ProxyRef::ProxyRef(std::shared_ptr<ManagerClient> c, std::string t, uint64_t i)
    : client(std::move(c)), type_id(std::move(t)), id(i), pid(::getpid()) {}

ProxyRef::~ProxyRef() {
  // Only the process that took the reference gives it back; a fork child's inherited copy
  // must not write to its parent's connection.
  // Nor while the server owes replies (it is stopped or overloaded): a destructor must not
  // wait for it. The reference is then given back when this process's connection ends.
  if (!client || pid != ::getpid() || client->broken() || client->stalled()) return;
  try {
    Request r;
    r.kind = static_cast<uint8_t>(RequestKind::kDecref);
    r.object_id = id;
    client->request(r);
  } catch (...) {  // the manager may be gone: nothing left to free
  }
}

std::shared_ptr<ProxyRef> ProxyRef::adopt(std::shared_ptr<ManagerClient> client,
                                          std::string type_id, uint64_t id) {
  Request r;
  r.kind = static_cast<uint8_t>(RequestKind::kIncref);
  r.object_id = id;
  client->request(r);
  return std::make_shared<ProxyRef>(std::move(client), std::move(type_id), id);
}

}  // namespace detail

// ---- BaseProxy ------------------------------------------------------------------------

namespace {
const std::string kEmpty;

detail::ProxyRef& checked(const std::shared_ptr<detail::ProxyRef>& ref) {
  if (!ref) throw Error("proxy refers to no object (default-constructed)");
  return *ref;
}
}  // namespace

const std::string& BaseProxy::address() const { return ref_ ? ref_->client->address() : kEmpty; }
const std::string& BaseProxy::type_id() const { return ref_ ? ref_->type_id : kEmpty; }
uint64_t BaseProxy::id() const { return ref_ ? ref_->id : 0; }
bool BaseProxy::share_tensors() const { return ref_ && ref_->client->share_tensors(); }

std::shared_ptr<detail::ProxyRef> BaseProxy::ref() const {
  // A fork child inherits the parent's reference and connection: it takes its own.
  static std::mutex mu;
  std::lock_guard<std::mutex> g(mu);
  detail::ProxyRef& r = checked(ref_);
  if (r.pid != ::getpid()) {
    auto client = detail::ManagerClient::get(r.client->address(), r.client->authkey(),
                                             r.client->timeout(), r.client->share_tensors());
    ref_ = detail::ProxyRef::adopt(std::move(client), r.type_id, r.id);
  }
  return ref_;
}

std::string BaseProxy::call_method(const std::string& method, const std::string& args,
                                   Timeout wait) const {
  const std::shared_ptr<detail::ProxyRef> r = ref();
  detail::manager::Request request;
  request.kind = static_cast<uint8_t>(detail::manager::RequestKind::kCall);
  request.object_id = r->id;
  request.method = method;
  request.args = args;
  return r->client->call(std::move(request), wait);
}

void BaseProxy::save(detail::OutputArchive& ar) const {
  const detail::ProxyRef& r = checked(ref_);
  const Timeout timeout = r.client->timeout();
  ar(r.client->address(), r.client->authkey(), timeout ? timeout->count() : -1.0, r.type_id, r.id,
     r.client->share_tensors());
}

void BaseProxy::load(detail::InputArchive& ar) {
  std::string address;
  std::optional<AuthKey> authkey;
  double timeout_s = -1;
  std::string type_id;
  uint64_t id = 0;
  bool share_tensors = false;
  ar(address, authkey, timeout_s, type_id, id, share_tensors);
  const Timeout timeout =
      timeout_s < 0 ? Timeout() : Timeout(std::chrono::duration<double>(timeout_s));
  ref_ = detail::ProxyRef::adopt(
      detail::ManagerClient::get(address, authkey, timeout, share_tensors), std::move(type_id), id);
}

// ---- PythonProxy ----------------------------------------------------------------------

std::string PythonProxy::ident() const { return fmt::format("{:x}", id()); }

pickle::Value PythonProxy::call(const std::string& method, std::vector<pickle::Value> args,
                                Timeout wait) const {
  return pickle::decode(
      call_method(method, pickle::encode(pickle::Value::tuple(std::move(args))), wait));
}

pickle::Value PythonProxy::copy() const { return pickle::decode(call_method("#GETVALUE", {})); }

std::optional<pickle::Value> PythonDictProxy::get(const pickle::Value& key) const {
  try {
    return call("__getitem__", {key});
  } catch (const RemoteError& e) {
    if (e.type() == "KeyError") return std::nullopt;
    throw;
  }
}

bool PythonDictProxy::contains(const pickle::Value& key) const {
  const pickle::Value v = call("__contains__", {key});
  return v.as<bool>();
}

size_t PythonDictProxy::size() const { return static_cast<size_t>(call("__len__").as<int64_t>()); }

namespace {
/// The items of a list or tuple result.
std::vector<pickle::Value> sequence_items(pickle::Value v) {
  if (v.is<pickle::List>()) return std::move(v.as<pickle::List>().items);
  return std::move(v.as<pickle::Tuple>().items);
}
}  // namespace

std::vector<pickle::Value> PythonDictProxy::keys() const { return sequence_items(call("keys")); }

std::vector<std::pair<pickle::Value, pickle::Value>> PythonDictProxy::items() const {
  std::vector<std::pair<pickle::Value, pickle::Value>> out;
  for (auto& item : sequence_items(call("items"))) {
    auto& pair = item.as<pickle::Tuple>().items;
    if (pair.size() != 2) throw Error("PythonDictProxy::items: an item that is not a pair");
    out.emplace_back(std::move(pair[0]), std::move(pair[1]));
  }
  return out;
}

}  // namespace torchpar
