// libFuzzer target for the manager's request decoder and dispatcher: arbitrary frames, as a
// client that passed the handshake could send them, go through loads<Request> and then
// ManagerServer::handle (what a connection thread does with each frame), on a fresh server
// per input. They must give a Response or a SerializationError, never a crash, an
// out-of-bounds read, a leak of the server's state or a runaway allocation.
//
// An input is a session: records of a 2-byte big-endian length and that many bytes, each
// one frame, handled in order on one connection's reference table, so the fuzzer can make a
// dict and then call it.
//
// A session whose first frame is a pickle (0x80, as the server tells a Python client) is
// Python's protocol instead: the frames go through serve_python_connection over a socket
// pair, as a Python client's requests, against a server that already holds one object of
// each of SyncManager's types (idents 1 to 11: dict, list, Namespace, Value, Array, Queue,
// Lock, RLock, Semaphore, Condition, Event); a blocking call ends because the client side
// has sent everything and shut its writing down (the server sees its caller gone).
#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "manager/py_objects.h"
#include "manager/server.h"
#include "torchpar/manager/pickle.h"
#include "torchpar/torchpar.h"

namespace {

namespace tp = torchpar;
using tp::detail::ManagerServer;
using tp::detail::manager::Request;
using tp::detail::manager::RequestKind;

constexpr size_t kMaxRecords = 16;

/// A server needs a Listener; the fuzzer's is closed at once (handle never accepts).
const tp::Listener& closed_listener() {
  static const tp::Listener* l = [] {
    auto* x = new tp::Listener("@torchpar-manager-fuzz-" + std::to_string(::getpid()));
    x->close();
    return x;
  }();
  return *l;
}

/// The "connection" calls come on: a socket whose peer is closed, so a blocking call
/// (Queue get, Event wait) sees its caller gone and returns at once instead of hanging.
int gone_peer_fd() {
  static const int fd = [] {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) std::abort();
    ::close(sv[1]);
    return sv[0];
  }();
  return fd;
}

std::string bytes_of(const Request& r) { return tp::dumps(r, {.copy_tensor = true}).bytes; }

template <class T>
std::string payload(const T& value) {
  return tp::dumps(value, {.copy_tensor = true}).bytes;
}

Request request(RequestKind kind, uint64_t object_id = 0, std::string method = {},
                std::string args = {}, std::string type_id = {}) {
  Request r;
  r.kind = static_cast<uint8_t>(kind);
  r.object_id = object_id;
  r.method = std::move(method);
  r.args = std::move(args);
  r.type_id = std::move(type_id);
  r.caller = 7;
  return r;
}

/// A valid session on a fresh server: a dict (id 1) made, used through each method, then
/// given back; and requests the server refuses.
std::vector<std::string> seed_session() {
  const std::string k = payload(std::string("key"));
  const std::string v = payload(int64_t{42});
  const std::string t = payload(at::arange(4, at::kFloat));
  std::vector<Request> s = {
      request(RequestKind::kCreate, 0, {}, {}, "dict"),
      request(RequestKind::kCall, 1, "set", payload(std::make_tuple(k, v))),
      request(RequestKind::kCall, 1, "set", payload(std::make_tuple(v, t))),
      request(RequestKind::kCall, 1, "get", payload(std::make_tuple(k))),
      request(RequestKind::kCall, 1, "contains", payload(std::make_tuple(v))),
      request(RequestKind::kCall, 1, "keys"),
      request(RequestKind::kCall, 1, "items"),
      request(RequestKind::kCall, 1, "update",
              payload(std::make_tuple(std::vector<std::pair<std::string, std::string>>{{v, k}}))),
      request(RequestKind::kCall, 1, "pop", payload(std::make_tuple(k))),
      request(RequestKind::kCall, 1, "size"),
      request(RequestKind::kIncref, 1),
      request(RequestKind::kCall, 1, "clear"),
      request(RequestKind::kDecref, 1),
      request(RequestKind::kNumberOfObjects),
      request(RequestKind::kCall, 1, "no_such_method"),
      request(RequestKind::kCreate, 0, {}, {}, "no_such_typeid"),
  };
  std::vector<std::string> out;
  for (const Request& r : s) out.push_back(bytes_of(r));
  return out;
}

namespace pk = tp::pickle;

/// The objects every Python session finds in the server, in ident order (1, 2, ...).
const std::vector<std::pair<std::string, std::vector<pk::Value>>>& python_objects() {
  static const std::vector<std::pair<std::string, std::vector<pk::Value>>> objects = {
      {"dict", {}},
      {"list", {pk::Value::list({1, pk::Value::str("a")})}},
      {"Namespace", {}},
      {"Value", {pk::Value::str("i"), 7}},
      {"Array", {pk::Value::str("d"), pk::Value::list({1.5, 2.5})}},
      {"Queue", {2}},
      {"Lock", {}},
      {"RLock", {}},
      {"Semaphore", {1}},
      {"Condition", {}},
      {"Event", {}},
  };
  return objects;
}

std::string python_request(pk::Value ident, const char* method, std::vector<pk::Value> args) {
  return pk::encode(pk::Value::tuple({std::move(ident), pk::Value::str(method),
                                      pk::Value::tuple(std::move(args)), pk::Value::dict({})}));
}

/// Python sessions: control calls, then a proxy's connection calling each object.
std::vector<std::vector<std::string>> python_seeds() {
  using pk::Value;
  const auto id = [](int i) {  // idents are hex, as the server writes them
    char text[16];
    std::snprintf(text, sizeof text, "%x", i);
    return Value::str(text);
  };
  return {
      {python_request(Value(), "create", {Value::str("dict")}),
       python_request(Value(), "incref", {id(1)}), python_request(Value(), "decref", {id(1)}),
       python_request(Value(), "number_of_objects", {}), python_request(Value(), "dummy", {})},
      {python_request(Value(), "accept_connection", {Value::str("fuzz")}),
       python_request(id(1), "__setitem__", {Value::str("k"), Value::tuple({1, 2.5})}),
       python_request(id(1), "__getitem__", {Value::str("k")}), python_request(id(1), "items", {}),
       python_request(id(1), "__iter__", {}), python_request(id(2), "append", {Value::bytes("b")}),
       python_request(id(2), "__getitem__", {Value::object("builtins", "slice", {0, 1})}),
       python_request(id(2), "sort", {}),
       python_request(id(3), "__setattr__", {Value::str("x"), 1}),
       python_request(id(4), "set", {9}), python_request(id(5), "__setitem__", {0, 3.5}),
       python_request(id(6), "put", {Value::str("item")}), python_request(id(6), "get", {}),
       python_request(id(7), "acquire", {}), python_request(id(7), "release", {}),
       python_request(id(11), "set", {}), python_request(id(11), "wait", {0.01})},
  };
}

/// Runs a Python session: `frames` from one client, on a server holding python_objects().
void run_python_session(std::vector<std::string> frames) {
  auto server = std::make_shared<ManagerServer>(closed_listener());
  for (const auto& [type_id, args] : python_objects()) {
    server->add_object(type_id, tp::detail::py::make_py_object(type_id, args, pk::Dict{}), 1);
  }
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) std::abort();
  // The client: every frame after the first (the server gets the first as read), then the
  // end of its writing, then it reads the replies until the server closes.
  std::thread client(
      [fd = sv[1], rest = std::vector<std::string>(frames.begin() + 1, frames.end())] {
        for (const std::string& f : rest) {
          const uint32_t n = htonl(static_cast<uint32_t>(f.size()));
          std::string framed(reinterpret_cast<const char*>(&n), 4);
          framed += f;
          for (size_t off = 0; off < framed.size();) {
            const ssize_t w = ::send(fd, framed.data() + off, framed.size() - off, MSG_NOSIGNAL);
            if (w <= 0) break;
            off += static_cast<size_t>(w);
          }
        }
        ::shutdown(fd, SHUT_WR);
        char buf[4096];
        while (::recv(fd, buf, sizeof buf, 0) > 0) {
        }
        ::close(fd);
      });
  {
    tp::Connection conn(tp::UniqueFd(sv[0]), true, true, tp::Connection::Framing::kPython);
    bool shutdown = false;
    tp::detail::serve_python_connection(*server, conn, std::move(frames[0]), &shutdown);
  }  // closes sv[0]: the client's reading ends
  client.join();
}

void write_seed(const std::string& path, const std::vector<std::string>& records) {
  std::ofstream f(path, std::ios::binary);
  for (const std::string& r : records) {
    const size_t n = std::min<size_t>(r.size(), 0xffff);
    f.put(static_cast<char>(n >> 8));
    f.put(static_cast<char>(n & 0xff));
    f.write(r.data(), static_cast<std::streamsize>(n));
  }
}

}  // namespace

// Seeds an empty corpus directory (the last non-flag argument) with valid sessions.
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  std::string dir;
  for (int i = 1; i < *argc; ++i)
    if ((*argv)[i][0] != '-') dir = (*argv)[i];
  (void)closed_listener();
  if (dir.empty() || !std::filesystem::is_directory(dir) || !std::filesystem::is_empty(dir))
    return 0;
  const auto python = python_seeds();
  for (size_t i = 0; i < python.size(); ++i) {
    write_seed(dir + "/python" + std::to_string(i), python[i]);
  }
  const std::vector<std::string> session = seed_session();
  write_seed(dir + "/session", session);
  for (size_t i = 0; i < session.size(); ++i) {
    // The create, then one request alone: every method's argument decoder on its own.
    write_seed(dir + "/request" + std::to_string(i), {session[0], session[i]});
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 2 && data[2] == 0x80) {  // the first frame is a pickle: a Python client
    std::vector<std::string> frames;
    for (size_t at = 0; frames.size() < kMaxRecords && at + 2 <= size;) {
      const size_t n = std::min<size_t>((size_t{data[at]} << 8) | data[at + 1], size - at - 2);
      frames.emplace_back(reinterpret_cast<const char*>(data + at + 2), n);
      at += 2 + n;
    }
    run_python_session(std::move(frames));
    return 0;
  }
  auto server = std::make_shared<ManagerServer>(closed_listener());
  ManagerServer::Held held;
  bool shutdown = false;
  size_t at = 0;
  for (size_t records = 0; records < kMaxRecords && at + 2 <= size; ++records) {
    const size_t n = std::min<size_t>((size_t{data[at]} << 8) | data[at + 1], size - at - 2);
    std::string frame(reinterpret_cast<const char*>(data + at + 2), n);
    at += 2 + n;
    Request r;
    try {
      r = tp::loads<Request>(tp::Payload{std::move(frame), {}});
    } catch (const tp::SerializationError&) {
      continue;  // the server answers "malformed request" and reads the next frame
    }
    // handle catches what the request raises and turns it into a Response.
    (void)server->handle(r, &shutdown, &held, gone_peer_fd());
  }
  return 0;
}

// gcc's -fsanitize-coverage=trace-cmp also reports float compares, which libFuzzer does not
// consume; give them no-op definitions.
extern "C" void __sanitizer_cov_trace_cmpf(float, float) {}
extern "C" void __sanitizer_cov_trace_cmpd(double, double) {}
