#include "manager/server.h"

#include <c10/util/Type.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <string_view>
#include <system_error>
#include <thread>
#include <tuple>
#include <typeinfo>
#include <utility>
#include <vector>

#include "core/liveness.h"
#include "core/socket_address.h"
#include "manager/shm_channel.h"
#include "torchpar/core/error.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar::detail {
namespace {

using manager::Request;
using manager::RequestKind;
using manager::Response;

Response failure(std::string type, std::string message) {
  Response r;
  r.ok = false;
  r.error_type = std::move(type);
  r.error_message = std::move(message);
  return r;
}

Response success(std::string value = {}) {
  Response r;
  r.ok = true;
  r.value = std::move(value);
  return r;
}

// Opens the call channel a client made (kAttachChannel). Another host's name, another
// user's, or no /dev/shm: an "OSError" reply, and the connection stays on its socket.
Response attach_channel(const std::string& name, std::unique_ptr<ShmChannel>* channel) {
  try {
    *channel = ShmChannel::open(name);
    return success();
  } catch (const std::exception& e) {
    return failure("OSError", fmt::format("cannot open the call channel '{}': {}", name, e.what()));
  }
}

// One line on stderr, as the Listener logs a refused peer: worth a trace on the server.
void log_line(const std::string& line) noexcept {
  std::fprintf(stderr, "torchpar: %s\n", line.c_str());
  std::fflush(stderr);
}

}  // namespace

bool CallContext::peer_gone() const { return socket_peer_gone(fd); }

std::unique_ptr<ServedObject> make_served_object(const std::string& type_id,
                                                 const std::string& args) {
  // The built-in typeids (SyncManager's), each with its factory (served_*.cpp).
  using Factory = std::unique_ptr<ServedObject> (*)(const std::string& args);
  // One typeid a line, so that adding one is a one-line change.
  // clang-format off
  static const std::pair<std::string_view, Factory> kBuiltin[] = {
      {"dict", &make_served_dict},
      {"list", &make_served_list},
      {"Namespace", &make_served_namespace},
      {"Value", &make_served_value},
      {"Array", &make_served_array},
      {"Queue", &make_served_queue},
      {"Lock", &make_served_lock},
      {"RLock", &make_served_rlock},
      {"Event", &make_served_event},
      {"Semaphore", &make_served_semaphore},
      {"BoundedSemaphore", &make_served_bounded_semaphore},
      {"Condition", &make_served_condition},
      {"Barrier", &make_served_barrier},
  };
  // clang-format on
  for (const auto& [name, factory] : kBuiltin) {
    if (name == type_id) return factory(args);
  }
  if (auto registered = make_served_registered(type_id, args)) return registered;
  throw ServedError("ValueError",
                    fmt::format("the manager has no typeid '{}' (a registered type must be "
                                "registered before the server starts: torchpar/manager/register.h)",
                                type_id));
}

std::shared_ptr<ManagerServer::Served> ManagerServer::find(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = objects_.find(id);
  if (it == objects_.end()) {
    throw ServedError("KeyError",
                      fmt::format("the manager holds no object {} (freed, or never made)", id));
  }
  return it->second.served;
}

uint64_t ManagerServer::add_object(std::string type_id, std::unique_ptr<ServedObject> object,
                                   int64_t refcount) {
  auto served = std::make_shared<Served>();
  served->type_id = std::move(type_id);
  served->object = std::move(object);
  std::lock_guard<std::mutex> g(mu_);
  const uint64_t id = next_id_++;
  objects_.emplace(id, Entry{std::move(served), refcount});
  return id;
}

bool ManagerServer::incref(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = objects_.find(id);
  if (it == objects_.end()) return false;
  ++it->second.refcount;
  return true;
}

size_t ManagerServer::number_of_objects() {
  std::lock_guard<std::mutex> g(mu_);
  return objects_.size();
}

void ManagerServer::stop() {
  stopping_ = true;
  listener_.close();  // wakes serve_forever's accept; the process exits
}

bool ManagerServer::decref(uint64_t id, int64_t count) {
  std::shared_ptr<Served> dropped;  // destroyed after the table lock is released
  std::lock_guard<std::mutex> g(mu_);
  auto it = objects_.find(id);
  if (it == objects_.end()) return false;
  it->second.refcount -= count;
  if (it->second.refcount <= 0) {
    dropped = std::move(it->second.served);
    objects_.erase(it);
  }
  return true;
}

Response ManagerServer::handle(const Request& request, bool* shutdown, Held* held, int fd) {
  try {
    switch (static_cast<RequestKind>(request.kind)) {
      case RequestKind::kCreate: {
        auto served = std::make_shared<Served>();
        constexpr std::string_view kPython = "python:";  // Manager::python_object
        if (request.type_id.starts_with(kPython)) {
          served->type_id = request.type_id.substr(kPython.size());
          served->object = make_python_object(served->type_id, request.args);
        } else {
          served->type_id = request.type_id;
          served->object = make_served_object(request.type_id, request.args);
        }
        std::lock_guard<std::mutex> g(mu_);
        const uint64_t id = next_id_++;
        objects_.emplace(id, Entry{std::move(served), 1});
        ++(*held)[id];
        return success(served_encode(id));
      }
      case RequestKind::kCall: {
        std::shared_ptr<Served> served = find(request.object_id);
        const CallContext context{request.caller, fd};
        if (!served->object->serialized()) {
          return success(served->object->call(request.method, request.args, context));
        }
        std::lock_guard<std::mutex> g(served->mu);
        return success(served->object->call(request.method, request.args, context));
      }
      case RequestKind::kIncref: {
        std::lock_guard<std::mutex> g(mu_);
        auto it = objects_.find(request.object_id);
        if (it == objects_.end()) {
          return failure("KeyError", fmt::format("incref of object {}, which the manager no "
                                                 "longer holds (was the sender's proxy gone "
                                                 "before this one was loaded?)",
                                                 request.object_id));
        }
        ++it->second.refcount;
        ++(*held)[request.object_id];
        return success();
      }
      case RequestKind::kDecref: {
        // Only references this connection took can be given back through it.
        auto it = held->find(request.object_id);
        if (it == held->end()) {
          return failure("KeyError", fmt::format("decref of object {}, which this connection "
                                                 "holds no reference to",
                                                 request.object_id));
        }
        if (--it->second == 0) held->erase(it);
        decref(request.object_id, 1);
        return success();
      }
      case RequestKind::kShutdown:
        *shutdown = true;
        return success();
      case RequestKind::kNumberOfObjects: {
        std::lock_guard<std::mutex> g(mu_);
        return success(served_encode(static_cast<uint64_t>(objects_.size())));
      }
      case RequestKind::kAttachChannel:
        // serve_connection takes the one that may come, first on a call connection.
        return failure("ValueError",
                       "attach_channel only as the first request of a connection, on its socket");
    }
    return failure("ValueError", fmt::format("unknown request kind {}", int{request.kind}));
  } catch (const ServedError& e) {
    return failure(e.type(), e.what());
  } catch (const std::exception& e) {
    return failure(c10::demangle(typeid(e).name()), e.what());
  }
}

void ManagerServer::serve_connection(Connection connection) {
  Held held;
  bool shutdown = false;
  bool first = true;
  // Set once the client attached a call channel: requests and responses travel there.
  std::unique_ptr<ShmChannel> channel;
  while (!shutdown) {
    std::string bytes;
    try {
      bytes = channel ? channel->recv(connection, std::nullopt, manager::kMaxMessageBytes)
                      : connection.recv_bytes(std::nullopt, manager::kMaxMessageBytes);
    } catch (const std::exception&) {
      break;  // the client left, or broke the framing (or the channel's): end the connection
    }
    if (first && !bytes.empty() && bytes[0] == '\x80') {  // PROTO: a pickle, a Python client
      serve_python_connection(*this, connection, std::move(bytes), &shutdown);
      break;
    }
    Response response;
    bool attached = false;
    try {
      const Request request = loads<Request>(Payload{std::move(bytes), {}});
      if (first && static_cast<RequestKind>(request.kind) == RequestKind::kAttachChannel) {
        response = attach_channel(request.type_id, &channel);
        attached = channel != nullptr;
      } else {
        response = handle(request, &shutdown, &held, connection.fileno());
      }
    } catch (const std::exception& e) {
      // A whole frame that is no request: the stream is still in sync, so say so and go on.
      response = failure("SerializationError", fmt::format("malformed request: {}", e.what()));
    }
    first = false;
    try {
      if (channel && !attached) {
        channel->send(dumps(response, {.copy_tensor = true}).bytes, connection);
      } else {
        connection.send(response);  // the reply to an attach goes on the socket
      }
    } catch (const std::exception&) {
      break;
    }
  }
  if (shutdown) {
    stop();
    return;
  }
  // The client is gone: what it still held goes with it.
  for (const auto& [id, count] : held) decref(id, count);
}

void ManagerServer::serve_forever(const std::function<void()>& ready) {
  try {
    if (ready) ready();
  } catch (...) {  // the parent may be gone
    stopping_ = true;
    listener_.close();
    throw;
  }
  accept_loop();
}

void ManagerServer::accept_loop() {
  while (!stopping_) {
    Connection c;
    try {
      // No key on the Listener: accept returns at once, the handshake runs on the
      // connection's own thread (admit), so the kernel's queue never fills up.
      c = listener_.accept(std::nullopt);
    } catch (const ClosedError&) {
      return;  // shutdown
    } catch (const std::exception&) {
      // EMFILE and the like: back off rather than spin on a pending connection.
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    if (!admit(std::move(c))) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

size_t ManagerServer::pending_handshakes() const {
  std::lock_guard<std::mutex> g(pending_mu_);
  return handshaking_;
}

bool ManagerServer::admit(Connection connection) {
  uint64_t ticket = 0;
  {
    std::unique_lock<std::mutex> lock(pending_mu_);
    if (pending_.size() >= kMaxPendingHandshakes) {
      // The oldest has waited longest: a client with the key answers in milliseconds, so it
      // is a stranger. Its fd is open (its thread leaves the map before closing it); the
      // shutdown wakes its handshake, which ends with ClosedError.
      const auto oldest = pending_.begin();
      ::shutdown(oldest->second, SHUT_RDWR);
      pending_.erase(oldest);
      const auto now = std::chrono::steady_clock::now();
      if (now - last_eviction_log_ > std::chrono::seconds(10)) {
        last_eviction_log_ = now;
        log_line(fmt::format(
            "Manager {}: {} connections are in the handshake at once; closing the oldest of "
            "them (a flood of unauthenticated connections?)",
            listener_.address(), kMaxPendingHandshakes));
      }
    }
    // The closed ones' threads leave at once (their poll wakes); waiting for them keeps the
    // threads and fds of strangers bounded. Bounded itself: no thread stalls past its
    // handshake's deadline.
    pending_cv_.wait_for(lock, kHandshakeTimeout,
                         [&] { return handshaking_ < kMaxPendingHandshakes; });
    ticket = next_ticket_++;
    pending_.emplace(ticket, connection.fileno());
    ++handshaking_;
  }
  try {
    // Detached: the process exits after shutdown without waiting for other clients, as
    // Python's manager server does. The thread holds the server alive.
    std::thread([self = shared_from_this(), connection, ticket]() mutable {
      self->handshake_then_serve(std::move(connection), ticket);
    }).detach();
    return true;
  } catch (const std::system_error&) {  // no more threads: refuse this peer
    {
      std::lock_guard<std::mutex> g(pending_mu_);
      pending_.erase(ticket);
      --handshaking_;
    }
    connection.close();
    return false;
  }
}

void ManagerServer::handshake_then_serve(Connection connection, uint64_t ticket) {
  bool ok = true;
  std::string refusal;  // logged, unless the accepting thread closed it
  if (authkey_) {
    const int fd = connection.fileno();
    const std::string peer = describe_peer(fd);
    try {
      auth_accept(fd, *authkey_, std::chrono::steady_clock::now() + kHandshakeTimeout,
                  {.allow_legacy_md5 = allow_legacy_md5_});
    } catch (const AuthenticationError& e) {
      ok = false;
      refusal = fmt::format("Manager {}: refused peer {}: {}", address(), peer, e.what());
    } catch (const ClosedError&) {
      ok = false;
      refusal =
          fmt::format("Manager {}: refused peer {}: it closed the connection during the handshake",
                      address(), peer);
    } catch (const std::exception&) {
      ok = false;  // silent past its deadline, or a reset: closed without a word
    }
  }
  bool closed_by_acceptor = false;
  {
    std::lock_guard<std::mutex> g(pending_mu_);
    closed_by_acceptor = pending_.erase(ticket) == 0;
    --handshaking_;
  }
  pending_cv_.notify_all();
  // After leaving the map: the accepting thread never shuts down an fd number reused.
  if (!ok || closed_by_acceptor) {
    if (!ok && !closed_by_acceptor && !refusal.empty()) log_line(refusal);
    connection.close();
    return;
  }
  serve_connection(std::move(connection));
}

void manager_server_main(Connection ready, std::string address, AuthKey authkey) {
  ::signal(SIGINT, SIG_IGN);
  std::shared_ptr<ManagerServer> server;
  try {
    server = std::make_shared<ManagerServer>(Listener(address), std::move(authkey));
  } catch (const std::exception& e) {
    ready.send(std::make_tuple(false, std::string(e.what())));
    throw;
  }
  server->serve_forever([&] {
    ready.send(std::make_tuple(true, server->address()));
    ready.close();
  });
}

}  // namespace torchpar::detail
