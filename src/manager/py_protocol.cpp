// Python's manager protocol (multiprocessing.managers.Server) on a connection of the C++
// manager server: CPython's own SyncManager client, with no bindings, creates and calls
// objects here (py_objects.h). Requests are pickled `(ident, methodname, args, kwds)`;
// answers `('#RETURN', value)`, `('#ERROR', exception)` (the client raises it),
// `('#TRACEBACK', text)` (RemoteError) or `('#PROXY', (exposed, token))`. As in Python's
// server, the first request of a connection is a control call (create, incref, decref,
// dummy, get_methods, number_of_objects, debug_info, shutdown, accept_connection), and
// accept_connection turns the connection into one that serves a proxy's calls.
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "manager/py_objects.h"
#include "manager/server.h"
#include "torchpar/manager/pickle.h"

namespace torchpar::detail {
namespace {

using pickle::Value;
using py::PyException;
using py::PyServed;

/// An error Python's server would answer with ('#TRACEBACK', format_exc()).
struct Traceback : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string ident_of(uint64_t id) { return fmt::format("{:x}", id); }

uint64_t id_of(const Value& ident) {
  if (!ident.is<pickle::Str>()) throw Traceback(fmt::format("KeyError: {}", ident.repr()));
  const std::string& s = ident.as<pickle::Str>().utf8;
  uint64_t id = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), id, 16);
  if (ec != std::errc() || p != s.data() + s.size() || s.empty())
    throw Traceback(fmt::format("KeyError: {}", ident.repr()));
  return id;
}

/// The server's address as Python's Token carries it: ('host', port) or a path.
Value address_value(const std::string& address) {
  const auto colon = address.rfind(':');
  if (!address.empty() && address[0] != '/' && colon != std::string::npos) {
    int64_t port = 0;
    const auto [p, ec] =
        std::from_chars(address.data() + colon + 1, address.data() + address.size(), port);
    if (ec == std::errc() && p == address.data() + address.size()) {
      std::string host = address.substr(0, colon);
      if (host.size() > 1 && host.front() == '[') host = host.substr(1, host.size() - 2);
      return Value::tuple({Value::str(host), port});
    }
  }
  return Value::str(address);
}

Value token(const std::string& type_id, const Value& address, uint64_t id) {
  return Value::object("multiprocessing.managers", "Token", {},
                       Value::tuple({Value::str(type_id), address, Value::str(ident_of(id))}),
                       /*new_object=*/true);
}

Value names(const std::vector<std::string>& methods) {
  std::vector<Value> out;
  for (const auto& m : methods) out.push_back(Value::str(m));
  return Value::tuple(std::move(out));
}

/// True the first time `id` is pinned in this process (PythonClient::pin_referenced).
bool pin_once(uint64_t id) {
  static std::mutex mu;
  static std::set<uint64_t> pinned;
  std::lock_guard<std::mutex> lock(mu);
  return pinned.insert(id).second;
}

class PythonClient {
 public:
  PythonClient(ManagerServer& server, Connection& conn)
      : server_(server), conn_(conn), address_(address_value(server.address())) {
    static std::atomic<uint64_t> next{1};
    caller_ = (uint64_t{0x5079} << 48) | next++;  // "Py": apart from the C++ clients' ids
  }

  /// Answers `frame`; true to go on reading.
  bool answer(const std::string& frame, bool* shutdown) {
    Value reply;
    try {
      reply = Value::tuple({Value::str("#RETURN"), handle(frame, shutdown)});
    } catch (const PyException& e) {
      reply = Value::tuple({Value::str("#ERROR"), e.value()});
    } catch (const pickle::PickleError& e) {
      reply = Value::tuple(
          {Value::str("#TRACEBACK"), Value::str(fmt::format("UnpicklingError: {}\n", e.what()))});
    } catch (const std::exception& e) {  // a traceback's text ends with a newline
      reply = Value::tuple({Value::str("#TRACEBACK"), Value::str(fmt::format("{}\n", e.what()))});
    }
    conn_.send_bytes(pickle::encode(reply));
    return !*shutdown;
  }

 private:
  Value handle(const std::string& frame, bool* shutdown) {
    static const pickle::DecodeOptions options{.max_elements = size_t{1} << 20};
    Value request = pickle::decode(frame, options);
    auto* t = request.is<pickle::Tuple>() ? &request.as<pickle::Tuple>().items : nullptr;
    if (t == nullptr || t->size() != 4 || !(*t)[1].is<pickle::Str>() ||
        !(*t)[2].is<pickle::Tuple>() || !(*t)[3].is<pickle::Dict>())
      throw Traceback(
          fmt::format("ValueError: a request is (ident, methodname, args tuple, kwds dict), got {}",
                      request.type_name()));
    const std::string method = (*t)[1].as<pickle::Str>().utf8;
    auto& args = (*t)[2].as<pickle::Tuple>().items;
    pin_referenced(request);
    const auto& kwds = (*t)[3].as<pickle::Dict>();
    if (!serving_) return control(method, args, kwds, shutdown);
    return call(id_of((*t)[0]), method, args, kwds);
  }

  Value control(const std::string& method, std::vector<Value>& args, const pickle::Dict& kwds,
                bool* shutdown) {
    const auto ident = [&]() -> uint64_t {
      if (args.empty()) throw Traceback(fmt::format("TypeError: {} needs an ident", method));
      return id_of(args[0]);
    };
    if (method == "dummy") return {};
    if (method == "create") {
      if (args.empty() || !args[0].is<pickle::Str>())
        throw Traceback("TypeError: create needs a typeid");
      const std::string type_id = args[0].as<pickle::Str>().utf8;
      std::vector<Value> rest(args.begin() + 1, args.end());
      std::unique_ptr<PyServed> object = py::make_py_object(type_id, std::move(rest), kwds);
      const Value exposed = names(object->exposed());
      // Python's create increfs once; the client's proxy increfs, then decrefs that one.
      const uint64_t id = server_.add_object(type_id, std::move(object), 1);
      return Value::tuple({Value::str(ident_of(id)), exposed});
    }
    if (method == "incref") {
      if (!server_.incref(ident())) throw Traceback(fmt::format("KeyError: {}", args[0].repr()));
      return {};
    }
    if (method == "decref") {
      if (!server_.decref(ident(), 1)) throw Traceback(fmt::format("KeyError: {}", args[0].repr()));
      return {};
    }
    if (method == "accept_connection") {
      serving_ = true;
      return {};
    }
    if (method == "get_methods") {
      if (args.empty() || !args[0].is<pickle::Object>() || !args[0].as<pickle::Object>().state)
        throw Traceback("TypeError: get_methods needs a Token");
      const Value& state = *args[0].as<pickle::Object>().state;
      const auto& fields = state.as<pickle::Tuple>().items;
      return names(py_object(id_of(fields.at(2)))->exposed());
    }
    if (method == "number_of_objects") return static_cast<int64_t>(server_.number_of_objects());
    if (method == "debug_info") return Value::str("");
    if (method == "shutdown") {
      *shutdown = true;
      return {};
    }
    throw Traceback(fmt::format("AssertionError: '{}' unrecognized", method));
  }

  /// A proxy of one of this server's objects that travels inside a request (a Queue
  /// appended to a managed list) is kept as a value; Python's server keeps the object alive
  /// for it (id_to_local_proxy_obj), so does this one: each object so referenced is pinned
  /// (one reference, held until the server exits), whatever its clients' proxies do.
  void pin_referenced(const Value& v) {
    if (const auto* o = std::get_if<pickle::Object>(&v.data())) {
      if (o->type.module == "multiprocessing.managers" && o->type.name == "Token" && o->state &&
          o->state->is<pickle::Tuple>()) {
        const auto& f = o->state->as<pickle::Tuple>().items;
        if (f.size() == 3 && py::py_equal(f[1], address_)) {
          try {
            const uint64_t id = id_of(f[2]);
            if (pin_once(id)) server_.incref(id);
          } catch (const Traceback&) {
          }
        }
      }
      for (const auto& a : o->args) pin_referenced(a);
      if (o->state) pin_referenced(*o->state);
      return;
    }
    std::visit(
        [&](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, pickle::Tuple> || std::is_same_v<T, pickle::List> ||
                        std::is_same_v<T, pickle::Set> || std::is_same_v<T, pickle::FrozenSet>) {
            for (const auto& item : x.items) pin_referenced(item);
          } else if constexpr (std::is_same_v<T, pickle::Dict>) {
            for (const auto& item : x.items) pin_referenced(item.value);
          }
        },
        v.data());
  }

  PyServed* py_object(uint64_t id) {
    std::shared_ptr<ManagerServer::Served> served;
    try {
      served = server_.find(id);
    } catch (const ServedError&) {
      throw Traceback(fmt::format("KeyError: '{}'", ident_of(id)));
    }
    auto* object = dynamic_cast<PyServed*>(served->object.get());
    if (object == nullptr)
      throw Traceback(fmt::format("TypeError: object '{}' ({}) was made by a C++ client",
                                  ident_of(id), served->type_id));
    held_ = std::move(served);  // alive while it is used, even if decref'd meanwhile
    return object;
  }

  Value call(uint64_t id, const std::string& method, std::vector<Value>& args,
             const pickle::Dict& kwds) {
    PyServed* object = py_object(id);
    const auto served = held_;
    const auto exposed = object->exposed();
    std::unique_lock<std::mutex> lock(served->mu, std::defer_lock);
    if (object->serialized()) lock.lock();
    if (std::find(exposed.begin(), exposed.end(), method) == exposed.end()) {
      if (method == "__repr__" || method == "__str__") return Value::str(object->repr());
      if (method == "#GETVALUE") return object->value();
      throw Traceback(fmt::format("AttributeError: method '{}' of '{}' object is not in exposed={}",
                                  method, served->type_id, names(exposed).repr()));
    }
    const CallContext context{caller_, conn_.fileno()};
    Value result = object->py_call(method, args, kwds, context);
    if (const auto type_id = object->proxy_typeid(method)) {
      std::vector<Value> items;
      if (result.is<pickle::List>()) items = std::move(result.as<pickle::List>().items);
      auto iterator = py::make_py_iterator(std::move(items), object);
      const Value rexposed = names(iterator->exposed());
      const uint64_t rid = server_.add_object(*type_id, std::move(iterator), 1);
      throw ProxyReply{Value::tuple({rexposed, token(*type_id, address_, rid)})};
    }
    return result;
  }

 public:
  /// A result served as a new proxy: answered ('#PROXY', (exposed, token)).
  struct ProxyReply {
    Value value;
  };

 private:
  ManagerServer& server_;
  Connection& conn_;
  Value address_;
  uint64_t caller_ = 0;
  bool serving_ = false;
  std::shared_ptr<ManagerServer::Served> held_;
};

/// Reads a Python connection's frames with one recv per request: CPython's client sends a
/// small request's header and pickle in one send, and Connection::recv_bytes spends a poll and
/// two recvs on them (server CPU per request was ~22 us on this VM, mostly system calls). The
/// Python connection owns its socket from its first frame on, so reading ahead is safe.
class FrameReader {
 public:
  explicit FrameReader(int fd) : fd_(fd) {}

  /// The next frame; nullopt at EOF, a reset, or a frame over `max_bytes` (the connection
  /// ends, as it does for Connection::recv_bytes' ProtocolError).
  std::optional<std::string> next(size_t max_bytes) {
    if (!fill(4)) return std::nullopt;
    const auto* h = reinterpret_cast<const unsigned char*>(buf_.data() + pos_);
    const auto n = static_cast<int32_t>((uint32_t{h[0]} << 24) | (uint32_t{h[1]} << 16) |
                                        (uint32_t{h[2]} << 8) | uint32_t{h[3]});
    size_t header = 4;
    uint64_t length = static_cast<uint64_t>(n);
    if (n == -1) {
      if (!fill(12)) return std::nullopt;
      h = reinterpret_cast<const unsigned char*>(buf_.data() + pos_ + 4);
      length = 0;
      for (int i = 0; i < 8; ++i) length = (length << 8) | h[i];
      header = 12;
    } else if (n < 0) {
      return std::nullopt;
    }
    if (length > max_bytes) return std::nullopt;
    if (!fill(header + length)) return std::nullopt;
    std::string frame = buf_.substr(pos_ + header, length);
    pos_ += header + length;
    return frame;
  }

 private:
  /// At least `need` unread bytes buffered; false at EOF or an error.
  bool fill(size_t need) {
    if (buf_.size() - pos_ >= need) return true;
    buf_.erase(0, pos_);
    pos_ = 0;
    while (buf_.size() < need) {
      const size_t old = buf_.size();
      buf_.resize(old + std::max<size_t>(need - old, size_t{64} << 10));
      const ssize_t r = ::recv(fd_, buf_.data() + old, buf_.size() - old, 0);
      buf_.resize(old + static_cast<size_t>(std::max<ssize_t>(r, 0)));
      if (r > 0) continue;
      if (r == 0) return false;
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        struct pollfd pfd {
          fd_, POLLIN, 0
        };
        (void)::poll(&pfd, 1, -1);
        continue;
      }
      return false;
    }
    return true;
  }

  int fd_;
  std::string buf_;
  size_t pos_ = 0;
};

}  // namespace

void serve_python_connection(ManagerServer& server, Connection& connection, std::string first,
                             bool* shutdown) {
  PythonClient client(server, connection);
  FrameReader reader(connection.fileno());
  std::string frame = std::move(first);
  for (;;) {
    try {
      if (!client.answer(frame, shutdown)) return;
    } catch (const PythonClient::ProxyReply& proxy) {
      try {
        connection.send_bytes(pickle::encode(Value::tuple({Value::str("#PROXY"), proxy.value})));
      } catch (const std::exception&) {
        return;
      }
    } catch (const std::exception&) {
      return;  // the reply could not be sent: the client is gone
    }
    auto next = reader.next(manager::kMaxMessageBytes);
    if (!next) return;  // EOF (the client closed its one-shot connection) or broken framing
    frame = std::move(*next);
  }
}

}  // namespace torchpar::detail
