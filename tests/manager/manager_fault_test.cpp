// Manager faults beyond manager_test's (which covers a killed server failing a later call,
// the server dying with its owner, and strangers' junk before the handshake):
//   - the server SIGKILLed while calls are pending in other threads of this process (server
//     started by fork and by spawn): the pending calls and every later one fail at once with
//     ClosedError naming the manager's address;
//   - a client process (fork and spawn) SIGKILLed in the middle of a blocking call: the other
//     clients' calls go on, its references are dropped, and the server thread of its call
//     ends once the call returns;
//   - Python's protocol after a correct handshake: mutated control requests and calls are
//     each answered with a reply of the protocol on the same connection;
//   - after a correct handshake: frames that are no request (mutated and truncated valid
//     requests, random bytes) are answered with SerializationError and the connection goes
//     on; huge length prefixes (4-byte and CPython's 64-bit form) end that connection
//     without the server allocating what they claim; half frames and stalled handshakes
//     leave the server serving;
//   - a flood of unauthenticated connections (silent ones, and ones that send garbage a byte
//     at a time) holds up no client: a new client connects and calls within 5 s, the
//     owner's calls go on, each stranger is closed within its handshake's 5 s, the server's
//     fds stay bounded, and the owner's dict is intact afterwards;
//   - a new connection that fails while the server lives (its socket file moved away) is a
//     TimeoutError of that call, never "gone": the client and its references stay; a
//     control request that times out (server SIGSTOPped) keeps the connection too.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <latch>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "manager/client.h"
#include "manager/protocol.h"
#include "manager/server.h"
#include "support/child.h"
#include "support/manager.h"
#include "support/raw_socket.h"
#include "support/start_methods.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

using tp::testing::exit_code;
using tp::testing::gone;
using tp::testing::manager_options;
using tp::testing::raw_connect;
using tp::testing::send_raw;

/// Callers wait in wait_open until open() (or their limit); thread-safe, so a waiting call
/// holds up no other call on it.
class Gate {
 public:
  bool wait_open(double max_s) {
    std::unique_lock<std::mutex> lock(mu_);
    ++waiting_;
    const bool opened =
        cv_.wait_for(lock, std::chrono::duration<double>(max_s), [&] { return open_; });
    --waiting_;
    return opened;
  }
  void open() {
    std::lock_guard<std::mutex> g(mu_);
    open_ = true;
    cv_.notify_all();
  }
  int64_t waiting() {
    std::lock_guard<std::mutex> g(mu_);
    return waiting_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  int64_t waiting_ = 0;
};

static const auto kGateType = tp::register_managed_type<Gate>("Gate")
                                  .expose("wait_open", &Gate::wait_open)
                                  .expose("open", &Gate::open)
                                  .expose("waiting", &Gate::waiting)
                                  .thread_safe();

using Dict = tp::DictProxy<std::string, int64_t>;

/// Polls `f` (a call to the server) until it returns `want`, for at most `within`.
template <class F, class V>
bool becomes(F&& f, const V& want, std::chrono::seconds within = 30s) {
  const auto deadline = Clock::now() + within;
  while (f() != want) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

/// Runs `f`, expecting ClosedError; returns its message ("" and a failure otherwise).
template <class F>
std::string closed_error_of(F&& f) {
  try {
    f();
  } catch (const tp::ClosedError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a ClosedError: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no ClosedError";
  return "";
}

int64_t rss_kib(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

tp::Connection authenticated(const std::string& address) {
  return tp::Client(address, {.authkey = tp::default_authkey(), .timeout = 30s});
}

std::string encode_request(const tp::detail::manager::Request& r) {
  return tp::dumps(r, {.copy_tensor = true}).bytes;
}

bool decodes_as_request(const std::string& bytes) {
  try {
    (void)tp::loads<tp::detail::manager::Request>(tp::Payload{bytes, {}});
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// ---- the server killed -------------------------------------------------------------------

class ServerKilled : public ::testing::TestWithParam<std::string> {};

TEST_P(ServerKilled, PendingAndLaterCallsFailAtOnceNamingTheAddress) {
  tp::ManagerOptions o = manager_options();
  o.start_method = tp::start_method_from_string(GetParam());
  tp::Manager m(o);
  auto gate = m.make(kGateType);
  Dict d = m.dict<std::string, int64_t>();
  d.set("x", 1);
  // Two calls blocked in the server, each in a thread of its own (one connection each).
  struct Outcome {
    std::string message;
    Clock::time_point at;
  };
  auto pending = [&gate] {
    Outcome out;
    out.message = closed_error_of([&] { gate.call<bool>("wait_open", 25.0); });
    out.at = Clock::now();
    return out;
  };
  auto a = std::async(std::launch::async, pending);
  auto b = std::async(std::launch::async, pending);
  ASSERT_TRUE(becomes([&] { return gate.call<int64_t>("waiting"); }, int64_t{2}));

  const auto killed_at = Clock::now();
  ASSERT_EQ(::kill(m.pid(), SIGKILL), 0);
  ASSERT_EQ(a.wait_for(20s), std::future_status::ready) << "a pending call outlived its server";
  ASSERT_EQ(b.wait_for(20s), std::future_status::ready) << "a pending call outlived its server";
  for (Outcome out : {a.get(), b.get()}) {
    EXPECT_NE(out.message.find(m.address()), std::string::npos) << out.message;
    // At once: the kernel closes the dead server's sockets (generous bound for loaded CI).
    EXPECT_LT(out.at - killed_at, 5s);
  }
  // Every later call, of any kind, fails at once without waiting for anything.
  const auto t0 = Clock::now();
  EXPECT_NE(closed_error_of([&] { d.size(); }).find(m.address()), std::string::npos);
  EXPECT_NE(closed_error_of([&] { gate.call<int64_t>("waiting"); }).find(m.address()),
            std::string::npos);
  EXPECT_NE(closed_error_of([&] { m.number_of_objects(); }).find(m.address()), std::string::npos);
  EXPECT_NE(closed_error_of([&] { m.make(kGateType); }).find(m.address()), std::string::npos);
  EXPECT_LT(Clock::now() - t0, 1s);
  const auto deadline = Clock::now() + 10s;
  while (!gone(m.pid()) && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(gone(m.pid()));
}

INSTANTIATE_TEST_SUITE_P(ServerStart, ServerKilled, ::testing::Values("fork", "spawn"),
                         tp::testing::start_method_name);

// ---- a client killed mid-call ------------------------------------------------------------

/// A client that takes objects of its own, says so, then blocks in a call until killed.
void doomed_client(std::string address, tp::Proxy<Gate> gate, tp::Connection pipe) {
  tp::Manager own = tp::Manager::connect(address, manager_options());
  auto mine = own.dict<std::string, int64_t>();
  mine.set("mine", 1);
  auto my_gate = own.make(kGateType);
  pipe.send(std::string("ready"));
  gate.call<bool>("wait_open", 25.0);  // SIGKILLed while this waits in the server
}

void live_client(Dict d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d.set("live" + std::to_string(i), i);
}

class ClientKilled : public ::testing::TestWithParam<std::string> {};

TEST_P(ClientKilled, MidCallDisturbsNoOtherClient) {
  tp::Manager m(manager_options());
  auto gate = m.make(kGateType);
  Dict d = m.dict<std::string, int64_t>();
  const size_t objects_before = m.number_of_objects();
  ASSERT_EQ(objects_before, 2u);

  tp::ProcessOptions po;
  po.start_method = tp::start_method_from_string(GetParam());
  auto [mine, theirs] = tp::Pipe();
  tp::Process doomed(po, doomed_client, m.address(), gate, theirs);
  doomed.start();
  ASSERT_EQ(mine.recv<std::string>(60s), "ready");
  ASSERT_TRUE(becomes([&] { return gate.call<int64_t>("waiting"); }, int64_t{1}));
  EXPECT_EQ(m.number_of_objects(), objects_before + 2);

  // Another client process works through the kill.
  tp::Process live(po, live_client, d, int64_t{200});
  live.start();
  doomed.kill();
  EXPECT_EQ(exit_code(doomed), -SIGKILL);
  EXPECT_EQ(exit_code(live), 0);
  EXPECT_EQ(d.size(), 200u);

  // What the dead client held goes with its connection; its blocked call ends once the
  // gate opens (its reply has nobody to go to) and the server thread with it.
  EXPECT_TRUE(becomes([&] { return m.number_of_objects(); }, objects_before));
  gate.call("open");
  EXPECT_TRUE(becomes([&] { return gate.call<int64_t>("waiting"); }, int64_t{0}));
  EXPECT_TRUE(gate.call<bool>("wait_open", 0.0));
  d.set("after", 1);
  EXPECT_EQ(d.get("after"), std::optional<int64_t>(1));
}

INSTANTIATE_TEST_SUITE_P(ClientStart, ClientKilled, ::testing::Values("fork", "spawn"),
                         tp::testing::start_method_name);

// ---- garbage after the handshake ---------------------------------------------------------

TEST(ManagerGarbage, FramesThatAreNoRequestsAreAnsweredAndTheConnectionGoesOn) {
  tp::Manager m(manager_options());
  Dict d = m.dict<std::string, int64_t>();
  d.set("x", 1);
  using tp::detail::manager::Request;
  using tp::detail::manager::RequestKind;
  using tp::detail::manager::Response;
  Request call;
  call.kind = static_cast<uint8_t>(RequestKind::kCall);
  call.object_id = d.id();
  call.method = "get";
  call.args = tp::dumps(std::make_tuple(tp::dumps(std::string("x")).bytes)).bytes;
  Request create;
  create.kind = static_cast<uint8_t>(RequestKind::kCreate);
  create.type_id = "dict";

  // Truncations and byte flips of valid requests, and random bytes with and without a
  // payload's magic; only what does not decode as a request is sent (a mutation that still
  // decodes could be any request, a shutdown included).
  std::vector<std::string> garbage;
  for (const Request& r : {call, create}) {
    const std::string valid = encode_request(r);
    for (size_t n = 0; n < valid.size(); ++n) garbage.push_back(valid.substr(0, n));
    for (size_t i = 0; i < valid.size(); ++i) {
      for (const unsigned char x : {0x01, 0x80, 0xff}) {
        std::string s = valid;
        s[i] = static_cast<char>(s[i] ^ x);
        garbage.push_back(s);
      }
    }
    garbage.push_back(valid + "trailing");
  }
  std::mt19937 rng(20240516);
  for (int i = 0; i < 100; ++i) {
    std::string s = i % 2 ? std::string("TPAR\1") : std::string();
    const size_t n = rng() % 300;
    for (size_t k = 0; k < n; ++k) s.push_back(static_cast<char>(rng() & 0xff));
    garbage.push_back(s);
  }

  tp::Connection c = authenticated(m.address());
  size_t sent = 0;
  for (const std::string& g : garbage) {
    if (decodes_as_request(g)) continue;
    c.send_bytes(g);
    const auto r = tp::loads<Response>(tp::Payload{c.recv_bytes(30s, 1 << 20), {}});
    EXPECT_FALSE(r.ok);
    EXPECT_EQ(r.error_type, "SerializationError") << r.error_message;
    ++sent;
  }
  EXPECT_GT(sent, 150u);
  // The same connection still serves requests, and so does the server.
  Request count;
  count.kind = static_cast<uint8_t>(RequestKind::kNumberOfObjects);
  c.send_bytes(encode_request(count));
  const auto r = tp::loads<Response>(tp::Payload{c.recv_bytes(30s, 1 << 20), {}});
  ASSERT_TRUE(r.ok) << r.error_message;
  EXPECT_EQ(tp::loads<uint64_t>(tp::Payload{r.value, {}}), 1u);
  EXPECT_EQ(d.get("x"), std::optional<int64_t>(1));
}

/// True when `bytes` decode as a request of Python's protocol whose method is `name`.
bool python_request_is(const std::string& bytes, const std::string& name) {
  namespace pk = tp::pickle;
  try {
    const pk::Value v = pk::decode(bytes);
    if (!v.is<pk::Tuple>()) return false;
    const auto& items = v.as<pk::Tuple>().items;
    return items.size() > 1 && items[1].is<pk::Str>() && items[1].as<pk::Str>().utf8 == name;
  } catch (const std::exception&) {
    return false;
  }
}

/// A reply of Python's protocol: ('#RETURN' | '#ERROR' | '#TRACEBACK' | '#PROXY', value).
bool is_python_reply(const std::string& bytes) {
  namespace pk = tp::pickle;
  const pk::Value v = pk::decode(bytes);
  if (!v.is<pk::Tuple>() || v.as<pk::Tuple>().items.size() != 2) return false;
  const auto& kind = v.as<pk::Tuple>().items[0];
  if (!kind.is<pk::Str>()) return false;
  const std::string& k = kind.as<pk::Str>().utf8;
  return k == "#RETURN" || k == "#ERROR" || k == "#TRACEBACK" || k == "#PROXY";
}

// Python's protocol after a correct handshake (the path CPython's clients take): byte flips,
// truncations and random tails of valid control requests and of calls on a dict and a list
// are each answered with a reply of the protocol (an error for most), on the same
// connection; the server and the objects a C++ client holds are intact afterwards.
TEST(ManagerGarbage, MutatedPythonRequestsGetProtocolRepliesAndTheServerServes) {
  namespace pk = tp::pickle;
  using pk::Value;
  tp::Manager m(manager_options());
  tp::PythonDictProxy d = m.python_dict();
  d.set(Value::str("x"), 1);
  tp::PythonProxy l = m.python_object("list", {Value::list({1, 2})});
  const auto request = [](Value ident, const char* method, std::vector<Value> args) {
    return pk::encode(Value::tuple(
        {std::move(ident), Value::str(method), Value::tuple(std::move(args)), Value::dict({})}));
  };
  const std::vector<std::string> control = {
      request(Value(), "create", {Value::str("dict")}),
      request(Value(), "incref", {Value::str(l.ident())}),
      request(Value(), "number_of_objects", {}),
      request(Value(), "dummy", {}),
  };
  const std::vector<std::string> calls = {
      request(Value::str(d.ident()), "__setitem__", {Value::str("k"), Value::list({1, 2.5})}),
      request(Value::str(d.ident()), "__getitem__", {Value::str("x")}),
      request(Value::str(d.ident()), "items", {}),
      request(Value::str(l.ident()), "__getitem__", {Value::object("builtins", "slice", {0, 1})}),
      request(Value::str(l.ident()), "append", {Value::tuple({Value::bytes("b"), 3})}),
  };
  std::mt19937 rng(20261129);
  const auto mutations = [&](const std::string& valid) {
    std::vector<std::string> out;
    for (size_t n = 1; n < valid.size(); n += 3) out.push_back(valid.substr(0, n));
    for (size_t i = 0; i < valid.size(); ++i) {
      std::string s = valid;
      s[i] = static_cast<char>(s[i] ^ (1 << (rng() % 8)));
      out.push_back(s);
      s = valid;
      s[i] = static_cast<char>(rng() & 0xff);
      out.push_back(s);
    }
    std::string tail = valid.substr(0, valid.size() / 2);
    for (int k = 0; k < 40; ++k) tail.push_back(static_cast<char>(rng() & 0xff));
    out.push_back(tail);
    return out;
  };
  size_t answered = 0;
  for (const bool serving : {false, true}) {
    tp::Connection c = authenticated(m.address());
    if (serving) {  // a connection for a proxy's calls, as BaseProxy._connect makes one
      c.send_bytes(request(Value(), "accept_connection", {Value::str("mutations")}));
      ASSERT_TRUE(is_python_reply(c.recv_bytes(30s, 1 << 20)));
    }
    for (int round = 0; round < 3; ++round) {  // another rng draw each round
      for (const std::string& valid : serving ? calls : control) {
        for (const std::string& g : mutations(valid)) {
          // A mutation that still asks for shutdown, or (serving) a decref, would be obeyed.
          if (python_request_is(g, "shutdown") || python_request_is(g, "decref")) continue;
          if (g.empty() || static_cast<unsigned char>(g[0]) != 0x80) continue;  // not a pickle
          c.send_bytes(g);
          const std::string reply = c.recv_bytes(30s, 1 << 20);
          ASSERT_TRUE(is_python_reply(reply)) << "reply of " << reply.size() << " bytes";
          ++answered;
        }
      }
    }
  }
  EXPECT_GT(answered, 2000u);
  EXPECT_EQ(*d.get(Value::str("x")), Value(1));
  EXPECT_GE(l.call("__len__").as<int64_t>(), 2);
  EXPECT_GE(m.number_of_objects(), 2u);
}

TEST(ManagerGarbage, HugeLengthPrefixesEndTheConnectionWithoutAllocating) {
  tp::Manager m(manager_options());
  Dict d = m.dict<std::string, int64_t>();
  d.set("x", 1);
  const int64_t rss_before = rss_kib(m.pid());
  ASSERT_GT(rss_before, 0);
  // Over the server's 1 GiB limit: 2 GiB - 1 in 4 bytes, and 2^62 in CPython's 64-bit form.
  for (const std::string& header : {std::string("\x7f\xff\xff\xff", 4),
                                    std::string("\xff\xff\xff\xff\x40\0\0\0\0\0\0\0", 12)}) {
    tp::Connection c = authenticated(m.address());
    send_raw(c.fileno(), header + "tail");
    EXPECT_THROW(c.recv_bytes(30s), tp::ClosedError);  // the server hung up on us
  }
  // Under the limit (1 GiB - 1) but never sent: the server reads what arrives, then sees the
  // peer leave.
  {
    tp::Connection c = authenticated(m.address());
    send_raw(c.fileno(), std::string("\x3f\xff\xff\xff", 4) + std::string(1000, 'z'));
  }
  EXPECT_EQ(d.get("x"), std::optional<int64_t>(1));  // serves (after the last frame's thread)
  EXPECT_LT(rss_kib(m.pid()) - rss_before, 256 * 1024) << "the server allocated what a length "
                                                          "prefix claimed";
  EXPECT_EQ(m.number_of_objects(), 1u);
}

TEST(ManagerGarbage, StalledHandshakesAndHalfFramesLeaveTheServerServing) {
  tp::Manager m(manager_options());
  Dict d = m.dict<std::string, int64_t>();
  d.set("x", 1);
  // Before the handshake: one peer silent, one with half a challenge answer, one with a
  // frame over the handshake's 256 bytes.
  tp::UniqueFd silent = raw_connect(m.address());
  tp::UniqueFd half = raw_connect(m.address());
  send_raw(half.get(), std::string("\0\0\0\x28{sha256}", 12));
  tp::UniqueFd oversized = raw_connect(m.address());
  send_raw(oversized.get(), std::string("\0\0\x01\x2c", 4) + std::string(300, 'o'));
  const auto t0 = Clock::now();
  // After the handshake: half a frame, then gone.
  {
    tp::Connection c = authenticated(m.address());
    send_raw(c.fileno(), std::string("\0\0\0\x64", 4) + std::string(10, 'h'));
  }
  // A new client gets through at once while the strangers are still connected: each
  // connection has its handshake on a server thread of its own (for at most 5 s).
  // (A connection of its own: this process's Manager connections are made already.)
  tp::Connection c = authenticated(m.address());
  tp::detail::manager::Request count;
  count.kind = static_cast<uint8_t>(tp::detail::manager::RequestKind::kNumberOfObjects);
  c.send_bytes(encode_request(count));
  const auto r =
      tp::loads<tp::detail::manager::Response>(tp::Payload{c.recv_bytes(30s, 1 << 20), {}});
  ASSERT_TRUE(r.ok) << r.error_message;
  EXPECT_EQ(tp::loads<uint64_t>(tp::Payload{r.value, {}}), 1u);
  EXPECT_LT(Clock::now() - t0, 4s);
  EXPECT_EQ(d.get("x"), std::optional<int64_t>(1));
  d.set("y", 2);
  EXPECT_EQ(d.size(), 2u);
  EXPECT_FALSE(gone(m.pid()));
}

// ---- a flood of unauthenticated connections -----------------------------------------------

/// Open fds of process `pid`.
int fd_count(int pid) {
  int n = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

/// A TCP connection to "127.0.0.1:port" that does not wait for the connect to finish (a
/// listener whose queue is full drops it silently: that must not hold up the test).
tp::UniqueFd connect_nonblocking(const std::string& address) {
  const auto colon = address.rfind(':');
  tp::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  const int r = ::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
  EXPECT_TRUE(r == 0 || errno == EINPROGRESS) << address << ": " << std::strerror(errno);
  return fd;
}

/// True once the peer of `fd` hung up (it closed the connection).
bool hung_up(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

TEST(ManagerFlood, UnauthenticatedConnectionsHoldUpNoClientAndTakeNoReference) {
  tp::Manager m(manager_options());
  Dict d = m.dict<std::string, int64_t>();
  for (int64_t i = 0; i < 100; ++i) d.set("k" + std::to_string(i), i);
  const int fds_before = fd_count(m.pid());
  ASSERT_GT(fds_before, 0);

  // 200 strangers that connect and say nothing, 16 that send garbage a byte at a time.
  std::vector<tp::UniqueFd> strangers;
  for (int i = 0; i < 200; ++i) strangers.push_back(connect_nonblocking(m.address()));
  std::vector<int> slow;
  for (int i = 0; i < 16; ++i) {
    strangers.push_back(connect_nonblocking(m.address()));
    slow.push_back(strangers.back().get());
  }
  std::atomic<bool> stop{false};
  std::thread dribble([&] {
    // A plausible answer's frame header, then its body, one byte per 100 ms each.
    const std::string answer = std::string("\0\0\0\x28{sha256}", 12) + std::string(32, 'g');
    for (size_t i = 0; !stop; i = (i + 1) % answer.size()) {
      for (int fd : slow) (void)::send(fd, &answer[i], 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      std::this_thread::sleep_for(100ms);
    }
  });
  struct Join {
    std::atomic<bool>& stop;
    std::thread& t;
    ~Join() {
      stop = true;
      t.join();
    }
  } join{stop, dribble};
  // The flood reached the server (the old server's 16 accepting threads held one each).
  ASSERT_TRUE(tp::testing::eventually([&] { return fd_count(m.pid()) >= fds_before + 16; }, 10s))
      << fd_count(m.pid()) << " fds, " << fds_before << " before";

  // (a) A new client (another ManagerClient of this process: its timeout differs) connects,
  // makes an object and calls it within 5 s, as do concurrent calls of the owner, each on a
  // new connection. Before, the handshakes ran in 16 accepting threads, 5 s per stranger.
  const auto t0 = Clock::now();
  tp::ManagerOptions o = manager_options();
  o.timeout = 10s;
  std::optional<tp::Manager> other;
  EXPECT_NO_THROW(other.emplace(tp::Manager::connect(m.address(), o)));
  ASSERT_TRUE(other);
  Dict d2 = other->dict<std::string, int64_t>();
  d2.set("new", 7);
  EXPECT_EQ(d2.get("new"), std::optional<int64_t>(7));
  std::vector<std::future<std::optional<int64_t>>> owner_calls;
  for (int i = 0; i < 6; ++i) {
    owner_calls.push_back(
        std::async(std::launch::async, [&d, i] { return d.get("k" + std::to_string(i)); }));
  }
  for (int i = 0; i < 6; ++i) EXPECT_EQ(owner_calls[i].get(), std::optional<int64_t>(i));
  EXPECT_LT(Clock::now() - t0, 5s);

  // (c) Bounded: the server holds at most kMaxPendingHandshakes strangers (plus this test's
  // own connections), however many come, and closes each within its 5 s handshake.
  const int bound =
      fds_before + static_cast<int>(tp::detail::ManagerServer::kMaxPendingHandshakes) + 16;
  EXPECT_LE(fd_count(m.pid()), bound);
  for (int i = 0; i < 200; ++i) strangers.push_back(connect_nonblocking(m.address()));
  EXPECT_LE(fd_count(m.pid()), bound);
  EXPECT_TRUE(tp::testing::eventually(
      [&] {
        for (const auto& fd : strangers) {
          if (!hung_up(fd.get())) return false;
        }
        return true;
      },
      15s))
      << "the server still holds strangers after their handshake's 5 s";
  EXPECT_LE(fd_count(m.pid()), bound);

  // (b) The flood ends: the owner's dict, its references and its connection are intact.
  stop = true;
  strangers.clear();
  EXPECT_EQ(d.size(), 100u);
  for (int64_t i = 0; i < 100; ++i) {
    ASSERT_EQ(d.get("k" + std::to_string(i)), std::optional<int64_t>(i));
  }
  d.set("after", 1);
  EXPECT_EQ(m.number_of_objects(), 2u);  // d and d2
  EXPECT_EQ(d2.get("new"), std::optional<int64_t>(7));
  EXPECT_FALSE(gone(m.pid()));
}

TEST(ManagerFlood, AFailedConnectWhileTheServerLivesIsATimeoutNotGone) {
  // A Unix socket file: moved away, new connections fail (ENOENT) while the server and this
  // process's control connection live.
  const std::string dir =
      std::filesystem::temp_directory_path() / ("torchpar_mgr_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  struct Remove {
    std::string dir;
    ~Remove() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } remove{dir};
  tp::ManagerOptions o = manager_options();
  o.address = dir + "/manager.sock";
  tp::Manager m(o);
  tp::ManagerOptions quick = o;
  quick.timeout = 1s;
  tp::Manager client = tp::Manager::connect(m.address(), quick);
  Dict d = client.dict<std::string, int64_t>();  // control request only: no call connection yet
  ASSERT_EQ(m.number_of_objects(), 1u);

  ASSERT_EQ(std::rename(o.address.c_str(), (dir + "/moved.sock").c_str()), 0);
  const auto t0 = Clock::now();
  EXPECT_THROW(d.set("x", 1), tp::TimeoutError);  // before: ClosedError "gone", client broken
  EXPECT_GE(Clock::now() - t0, 900ms);            // tried again until its timeout
  ASSERT_EQ(std::rename((dir + "/moved.sock").c_str(), o.address.c_str()), 0);

  d.set("x", 1);  // the same client goes on; its reference was kept
  EXPECT_EQ(d.get("x"), std::optional<int64_t>(1));
  EXPECT_EQ(m.number_of_objects(), 1u);
}

// True once every thread of `pid` is stopped (state T): kill(SIGSTOP) returns before a thread
// running on another core has stopped, which may still answer a request sent at once.
bool all_threads_stopped(int pid) {
  std::error_code ec;
  bool any = false;
  for (const auto& task :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(task.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto paren = stat.rfind(')');
    if (paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'T')
      return false;
    any = true;
  }
  return any;
}

TEST(ManagerFlood, AControlRequestPastItsTimeoutKeepsTheConnectionAndItsReferences) {
  tp::Manager m(manager_options());
  tp::ManagerOptions quick = manager_options();
  quick.timeout = 0.5s;
  tp::Manager client = tp::Manager::connect(m.address(), quick);
  Dict d = client.dict<std::string, int64_t>();
  d.set("x", 1);
  ASSERT_EQ(::kill(m.pid(), SIGSTOP), 0);
  struct Cont {
    int pid;
    ~Cont() { ::kill(pid, SIGCONT); }
  } cont{m.pid()};
  const auto stop_deadline = Clock::now() + 10s;
  while (!all_threads_stopped(m.pid()) && Clock::now() < stop_deadline)
    std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(all_threads_stopped(m.pid())) << "the server did not stop within 10 s";
  EXPECT_THROW(client.number_of_objects(), tp::TimeoutError);
  ASSERT_EQ(::kill(m.pid(), SIGCONT), 0);
  // The late reply is skipped; before, the connection was closed and the server dropped
  // this client's references (the dict was freed: "KeyError").
  EXPECT_EQ(client.number_of_objects(), 1u);
  EXPECT_EQ(d.get("x"), std::optional<int64_t>(1));
  auto copy = client.dict<std::string, int64_t>();
  EXPECT_EQ(m.number_of_objects(), 2u);
}

}  // namespace

// The caller id that makes a client thread the owner of an RLock or Condition on the server:
// threads making their first calls at once in a new process (a fork child) each keep one id.
// (The process part was re-seeded by whichever thread first saw the new pid, so a thread's id
// could change between its acquire and its wait: "cannot wait on un-acquired lock".)
TEST(ManagerCallerId, StableWhenAProcessesThreadsStartAtOnce) {
  for (int round = 0; round < 20; ++round) {
    tp::testing::Child c = tp::testing::fork_child([](int) {
      constexpr int kThreads = 8;
      std::latch go(kThreads);
      std::atomic<int> changed{0};
      std::vector<std::thread> threads;
      for (int i = 0; i < kThreads; ++i) {
        threads.emplace_back([&] {
          go.arrive_and_wait();
          const uint64_t first = tp::detail::ManagerClient::caller_id();
          for (int k = 0; k < 1000; ++k)
            if (tp::detail::ManagerClient::caller_id() != first) ++changed;
        });
      }
      for (auto& t : threads) t.join();
      return changed.load() == 0 ? 0 : 1;
    });
    ASSERT_EQ(tp::testing::wait_child(c), 0) << "a thread's caller id changed, round " << round;
  }
}

int main(int argc, char** argv) { return tp::testing::manager_test_main(argc, argv); }
