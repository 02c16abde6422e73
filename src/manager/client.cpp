#include "manager/client.h"

#include <fmt/format.h>
#include <unistd.h>

#include <map>
#include <utility>

#include "torchpar/core/error.h"
#include "torchpar/ipc/listener.h"
#include "torchpar/manager/proxy.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar {
namespace detail {
namespace {

using manager::Request;
using manager::RequestKind;
using manager::Response;

// Connections by address, for this process (a fork child finds its parent's entries and
// skips them: their pid is not its own).
std::mutex g_clients_mu;
std::map<std::string, std::weak_ptr<ManagerClient>>& clients() {
  static auto* m = new std::map<std::string, std::weak_ptr<ManagerClient>>();  // never freed:
  return *m;  // proxies may be destroyed during static destruction
}

}  // namespace

ManagerClient::ManagerClient(Connection connection, std::string address,
                             std::optional<AuthKey> authkey, Timeout timeout)
    : connection_(std::move(connection)),
      address_(std::move(address)),
      authkey_(std::move(authkey)),
      timeout_(timeout),
      pid_(::getpid()) {}

std::shared_ptr<ManagerClient> ManagerClient::get(const std::string& address,
                                                  const std::optional<AuthKey>& authkey,
                                                  Timeout timeout) {
  // One connection per manager and key: a client with another key must do its own
  // handshake (and be refused if the key is wrong).
  const std::string slot = address + "\n" + (authkey ? to_hex(*authkey) : std::string("-"));
  std::lock_guard<std::mutex> g(g_clients_mu);
  auto& map = clients();
  if (auto it = map.find(slot); it != map.end()) {
    if (auto c = it->second.lock(); c && c->pid() == ::getpid() && !c->broken()) return c;
  }
  Connection connection = Client(address, {.authkey = authkey, .timeout = timeout});
  auto c = std::make_shared<ManagerClient>(std::move(connection), address, authkey, timeout);
  map[slot] = c;
  return c;
}

bool ManagerClient::broken() const {
  std::lock_guard<std::mutex> g(mu_);
  return !broken_.empty();
}

void ManagerClient::break_with(std::string why) {
  std::lock_guard<std::mutex> g(mu_);
  if (broken_.empty()) broken_ = std::move(why);
  connection_.close();
}

std::string ManagerClient::request(const Request& request) {
  std::lock_guard<std::mutex> g(mu_);
  if (!broken_.empty()) throw ClosedError(broken_);
  Response response;
  try {
    connection_.send(request);
    response =
        loads<Response>(Payload{connection_.recv_bytes(timeout_, manager::kMaxMessageBytes), {}});
  } catch (const TimeoutError&) {
    broken_ = fmt::format(
        "manager at {}: no reply within {} s; this process's connection to it was closed "
        "(a late reply would be read as the next one's)",
        address_, timeout_ ? timeout_->count() : 0);
    connection_.close();
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

ProxyRef::ProxyRef(std::shared_ptr<ManagerClient> c, std::string t, uint64_t i)
    : client(std::move(c)), type_id(std::move(t)), id(i), pid(::getpid()) {}

ProxyRef::~ProxyRef() {
  // Only the process that took the reference gives it back; a fork child's inherited copy
  // must not write to its parent's connection.
  if (!client || pid != ::getpid() || client->broken()) return;
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

std::shared_ptr<detail::ProxyRef> BaseProxy::ref() const {
  // A fork child inherits the parent's reference and connection: it takes its own.
  static std::mutex mu;
  std::lock_guard<std::mutex> g(mu);
  detail::ProxyRef& r = checked(ref_);
  if (r.pid != ::getpid()) {
    auto client =
        detail::ManagerClient::get(r.client->address(), r.client->authkey(), r.client->timeout());
    ref_ = detail::ProxyRef::adopt(std::move(client), r.type_id, r.id);
  }
  return ref_;
}

std::string BaseProxy::call_method(const std::string& method, const std::string& args) const {
  const std::shared_ptr<detail::ProxyRef> r = ref();
  detail::manager::Request request;
  request.kind = static_cast<uint8_t>(detail::manager::RequestKind::kCall);
  request.object_id = r->id;
  request.method = method;
  request.args = args;
  return r->client->request(request);
}

void BaseProxy::save(detail::OutputArchive& ar) const {
  const detail::ProxyRef& r = checked(ref_);
  const Timeout timeout = r.client->timeout();
  ar(r.client->address(), r.client->authkey(), timeout ? timeout->count() : -1.0, r.type_id, r.id);
}

void BaseProxy::load(detail::InputArchive& ar) {
  std::string address;
  std::optional<AuthKey> authkey;
  double timeout_s = -1;
  std::string type_id;
  uint64_t id = 0;
  ar(address, authkey, timeout_s, type_id, id);
  const Timeout timeout =
      timeout_s < 0 ? Timeout() : Timeout(std::chrono::duration<double>(timeout_s));
  ref_ = detail::ProxyRef::adopt(detail::ManagerClient::get(address, authkey, timeout),
                                 std::move(type_id), id);
}

}  // namespace torchpar
