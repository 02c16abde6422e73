#include "torchpar/manager/manager.h"

#include <fmt/format.h>

#include <charconv>
#include <tuple>
#include <utility>

#include "manager/client.h"
#include "manager/server.h"
#include "torchpar/core/error.h"
#include "torchpar/ipc/connection.h"
#include "torchpar/process/process.h"

namespace torchpar {
namespace {

using detail::manager::Request;
using detail::manager::RequestKind;

constexpr auto kShutdownWait = std::chrono::seconds(10);

/// Waits for the server's {ok, address or error} on `ready`. On failure, the server is
/// stopped and reaped before the error is raised.
std::string await_ready(Connection& ready, Process& server, Timeout timeout) {
  try {
    auto [ok, text] = ready.recv<std::tuple<bool, std::string>>(timeout);
    if (ok) return text;
    server.join(kShutdownWait);
    throw Error(fmt::format("Manager: the server process could not start: {}", text));
  } catch (const TimeoutError&) {
    server.kill();
    server.join(kShutdownWait);
    throw TimeoutError(fmt::format("Manager: the server process did not report ready within {} s",
                                   timeout ? timeout->count() : 0));
  } catch (const ClosedError&) {
    server.join(kShutdownWait);
    const auto err = server.error();
    throw Error(fmt::format("Manager: the server process exited before it was ready ({})",
                            err ? err->first + ": " + err->second
                                : fmt::format("exit code {}", server.exitcode().value_or(-1))));
  }
}

}  // namespace

Manager::Manager(std::shared_ptr<detail::ManagerClient> client, std::string address)
    : client_(std::move(client)), address_(std::move(address)) {}
Manager::Manager(Manager&&) noexcept = default;

Manager& Manager::operator=(Manager&& other) noexcept {
  if (this != &other) {
    if (server_) {
      try {
        shutdown();
      } catch (...) {  // as the destructor
      }
    }
    client_ = std::move(other.client_);
    server_ = std::move(other.server_);
    address_ = std::move(other.address_);
  }
  return *this;
}

Manager::Manager(ManagerOptions options) {
  const AuthKey key = options.authkey ? *options.authkey : default_authkey();
  auto [mine, theirs] = Pipe();
  ProcessOptions po;
  po.name = "ManagerServer";
  po.daemon = true;  // a Manager destroyed without shutdown still takes its server along
  po.start_method = options.start_method;
  server_ =
      std::make_unique<Process>(po, &detail::manager_server_main, theirs, options.address, key);
  server_->start();
  theirs.close();  // so that a server dying before it reports is seen as end of stream
  address_ = await_ready(mine, *server_, options.start_timeout);
  try {
    client_ = detail::ManagerClient::get(address_, key, options.timeout, options.share_tensors);
  } catch (...) {
    server_->kill();
    server_->join(kShutdownWait);
    throw;
  }
}

Manager Manager::connect(const std::string& address, ManagerOptions options) {
  const AuthKey key = options.authkey ? *options.authkey : default_authkey();
  return Manager(detail::ManagerClient::get(address, key, options.timeout, options.share_tensors),
                 address);
}

Manager Manager::connect(const std::string& address, const AuthKey& authkey,
                         ManagerOptions options) {
  options.authkey = authkey;
  return connect(address, std::move(options));
}

Manager::~Manager() {
  if (!server_) return;
  try {
    shutdown();
  } catch (...) {  // destructors do not throw; the daemon Process kills the server
  }
}

const std::string& Manager::address() const { return address_; }

int Manager::pid() const { return server_ ? server_->pid() : -1; }

std::shared_ptr<detail::ProxyRef> Manager::create(const std::string& type_id,
                                                  const std::string& args) {
  if (!client_) throw ClosedError("Manager: moved from");
  Request r;
  r.kind = static_cast<uint8_t>(RequestKind::kCreate);
  r.type_id = type_id;
  r.args = args;
  const std::string value = client_->request(r);
  const auto id = loads<uint64_t>(Payload{value, {}});
  return std::make_shared<detail::ProxyRef>(client_, type_id, id);
}

std::shared_ptr<detail::ProxyRef> Manager::create_python(const std::string& type_id,
                                                         std::vector<pickle::Value> args) {
  auto ref = create("python:" + type_id, pickle::encode(pickle::Value::tuple(std::move(args))));
  ref->type_id = type_id;  // Python's typeid: what its Token carries
  return ref;
}

PythonProxy Manager::python_object(const std::string& type_id, std::vector<pickle::Value> args) {
  return PythonProxy(create_python(type_id, std::move(args)));
}

std::shared_ptr<detail::ProxyRef> Manager::attach(const std::string& type_id,
                                                  const std::string& ident) {
  if (!client_) throw ClosedError("Manager: moved from");
  uint64_t id = 0;
  const auto [p, ec] = std::from_chars(ident.data(), ident.data() + ident.size(), id, 16);
  if (ident.empty() || ec != std::errc() || p != ident.data() + ident.size()) {
    throw ValueError(fmt::format(
        "Manager::python_proxy: ident '{}' is not an object id (a Token's id: lowercase hex)",
        ident));
  }
  return detail::ProxyRef::adopt(client_, type_id, id);
}

PythonProxy Manager::python_proxy(const std::string& type_id, const std::string& ident) {
  return PythonProxy(attach(type_id, ident));
}

size_t Manager::number_of_objects() {
  if (!client_) throw ClosedError("Manager: moved from");
  Request r;
  r.kind = static_cast<uint8_t>(RequestKind::kNumberOfObjects);
  return static_cast<size_t>(loads<uint64_t>(Payload{client_->request(r), {}}));
}

void Manager::shutdown() {
  if (!server_) {
    if (!client_) return;  // moved from
    throw Error(fmt::format(
        "Manager::shutdown: this Manager connected to {} and does not own its server", address_));
  }
  if (server_->exitcode()) return;  // already down
  try {
    Request r;
    r.kind = static_cast<uint8_t>(RequestKind::kShutdown);
    client_->request(r);
  } catch (const Error&) {
    // The server is gone or unreachable: stop it the hard way below.
  }
  client_->break_with(fmt::format("manager at {} was shut down", address_));
  if (!server_->join(kShutdownWait)) {
    server_->kill();
    server_->join(kShutdownWait);
  }
}

void serve_manager(const std::string& address, const AuthKey& authkey,
                   const std::function<void(const std::string&)>& ready, bool allow_legacy_md5) {
  auto server =
      std::make_shared<detail::ManagerServer>(Listener(address), authkey, allow_legacy_md5);
  server->serve_forever([&] {
    if (ready) ready(server->address());
  });
}

}  // namespace torchpar
