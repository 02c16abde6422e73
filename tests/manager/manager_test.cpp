// Manager across real processes: a server process per test, dict proxies used in the owner
// and in children of every start method, a second client by address and key, reference
// counts on the server, remote errors, a wrong key, shutdown, a server killed with SIGKILL,
// a server outliving no owner, strangers sending garbage to its port, shutdown while
// another client waits, and a client reaching the server over TCP by a non-loopback address.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>

#include "support/child.h"
#include "support/manager.h"
#include "support/start_methods.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

using tp::testing::exit_code;
using tp::testing::gone;
using tp::testing::gone_within;
using tp::testing::manager_options;
using tp::testing::require;

using Dict = tp::DictProxy<std::string, int64_t>;

/// A child: checks what the parent wrote, then writes its own items.
void child_fill(Dict d, int64_t base) {
  require(d.get("from-parent") == std::optional<int64_t>(7), "the parent's item");
  for (int64_t i = 0; i < 10; ++i) d.set(fmt::format("k{}", i), base + i);
}

/// A second client: connects by address and key, makes a dict, hands it to the parent
/// through `pipe`, and keeps it until the parent says it has its own reference.
void second_client(std::string address, std::string key_hex, tp::Connection pipe) {
  tp::ManagerOptions o = manager_options();
  o.authkey = tp::from_hex(key_hex);
  tp::Manager m = tp::Manager::connect(address, o);
  auto d = m.dict<std::string, int64_t>();
  d.set("second", 2);
  pipe.send(d);
  require(pipe.recv<std::string>(30s) == "loaded", "the parent's ack");
}

/// A client blocked in a Queue get when the owner shuts the manager down: reports what the
/// get raised ("<type>: <message>") on `pipe`.
void blocked_getter(tp::QueueProxy<int64_t> q, tp::Connection pipe) {
  pipe.send(std::string("waiting"));
  try {
    q.get();
    pipe.send(std::string("no error"));
  } catch (const tp::ClosedError& e) {
    pipe.send("ClosedError: " + std::string(e.what()));
  } catch (const std::exception& e) {
    pipe.send("other: " + std::string(e.what()));
  }
}

/// A client as on another host: connects over TCP to `address` (a non-loopback address of
/// this machine) with the socket path only (no shared-memory channel), uses the dict.
void tcp_client(std::string address, std::string key_hex) {
  ::setenv("TORCHPAR_MANAGER_SHM", "0", 1);
  tp::ManagerOptions o = manager_options();
  o.authkey = tp::from_hex(key_hex);
  tp::Manager m = tp::Manager::connect(address, o);
  auto d = m.dict<std::string, int64_t>();
  d.set("over-tcp", 5);
  require(d.get("over-tcp") == std::optional<int64_t>(5), "a round trip over TCP");
  require(m.number_of_objects() >= 1, "the server's objects");
}

/// The first IPv4 address of this machine that is not loopback ("" when it has none).
std::string non_loopback_ipv4() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string found;
  for (ifaddrs* a = list; a && found.empty(); a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET || (a->ifa_flags & IFF_LOOPBACK) ||
        !(a->ifa_flags & IFF_UP)) {
      continue;
    }
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text)) found = text;
  }
  ::freeifaddrs(list);
  return found;
}

template <class F>
void expect_error_naming(F&& f, const std::string& what, const char* type_name) {
  try {
    f();
    ADD_FAILURE() << "no " << type_name;
  } catch (const tp::ClosedError& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

// A proxy that can call any method, as a client that does not stick to DictProxy's would.
struct RawProxy : Dict {
  explicit RawProxy(const Dict& d) : Dict(d) {}
  using Dict::call_method;
};

// ---- in the owner ------------------------------------------------------------------------

TEST(Manager, DictBehavesAsPythonsDict) {
  tp::Manager m(manager_options());
  EXPECT_GT(m.pid(), 0);
  EXPECT_EQ(m.address().rfind("127.0.0.1:", 0), 0u) << m.address();
  auto d = m.dict<std::string, int64_t>();
  EXPECT_EQ(d.type_id(), "dict");
  EXPECT_EQ(d.address(), m.address());
  EXPECT_EQ(d.size(), 0u);
  d.set("b", 2);
  d.set("a", 1);
  d.set("c", 3);
  d.set("b", 20);  // an existing key keeps its place
  EXPECT_EQ(d.size(), 3u);
  EXPECT_EQ(d.get("b"), std::optional<int64_t>(20));
  EXPECT_EQ(d.get("zz"), std::nullopt);
  EXPECT_TRUE(d.contains("a"));
  EXPECT_FALSE(d.contains("zz"));
  EXPECT_EQ(d.keys(), (std::vector<std::string>{"b", "a", "c"}));
  EXPECT_EQ(d.items(),
            (std::vector<std::pair<std::string, int64_t>>{{"b", 20}, {"a", 1}, {"c", 3}}));
  EXPECT_EQ(d.pop("a"), 1);
  EXPECT_FALSE(d.contains("a"));
  d.update({{"x", 9}, {"b", 21}});
  EXPECT_EQ(d.keys(), (std::vector<std::string>{"b", "c", "x"}));
  EXPECT_EQ(d.get("b"), std::optional<int64_t>(21));
  d.clear();
  EXPECT_EQ(d.size(), 0u);
}

// The rest of Python's MutableMapping (before: no popitem, setdefault, values or copy).
TEST(Manager, DictHasPopitemSetdefaultValuesCopy) {
  tp::Manager m(manager_options());
  auto d = m.dict<std::string, int64_t>();
  EXPECT_EQ(d.setdefault("a", 1), 1);  // absent: set
  EXPECT_EQ(d.setdefault("a", 5), 1);  // present: kept
  d.set("b", 2);
  d.set("c", 3);
  EXPECT_EQ(d.values(), (std::vector<int64_t>{1, 2, 3}));
  const auto snapshot = d.copy();
  EXPECT_EQ(snapshot, (std::vector<std::pair<std::string, int64_t>>{{"a", 1}, {"b", 2}, {"c", 3}}));
  EXPECT_EQ(d.popitem(), (std::pair<std::string, int64_t>{"c", 3}));  // last in, first out
  EXPECT_EQ(d.popitem(), (std::pair<std::string, int64_t>{"b", 2}));
  d.set("a", 10);  // an existing key keeps its place
  EXPECT_EQ(d.popitem(), (std::pair<std::string, int64_t>{"a", 10}));
  EXPECT_EQ(snapshot.size(), 3u) << "copy() is a copy, not a view";
  EXPECT_EQ(d.size(), 0u);
  try {
    d.popitem();
    ADD_FAILURE() << "popitem of an empty dict did not raise";
  } catch (const tp::RemoteError& e) {
    EXPECT_EQ(e.type(), "KeyError") << e.what();
  }
  EXPECT_TRUE(d.values().empty());
  EXPECT_EQ(d.setdefault("z", 26), 26);
  EXPECT_EQ(d.get("z"), std::optional<int64_t>(26));
}

TEST(Manager, RemoteErrorsCarryTypeAndMessage) {
  tp::Manager m(manager_options());
  auto d = m.dict<std::string, int64_t>();
  try {
    d.pop("missing");
    ADD_FAILURE() << "no RemoteError";
  } catch (const tp::RemoteError& e) {
    EXPECT_EQ(e.type(), "KeyError");
    EXPECT_NE(e.message().find("no such key"), std::string::npos) << e.what();
  }
  RawProxy raw(d);
  try {
    raw.call_method("__del__", {});
    ADD_FAILURE() << "no RemoteError";
  } catch (const tp::RemoteError& e) {
    EXPECT_EQ(e.type(), "AttributeError");
    EXPECT_NE(e.message().find("__del__"), std::string::npos) << e.what();
  }
  try {
    raw.call_method("get", "not a payload");
    ADD_FAILURE() << "no RemoteError";
  } catch (const tp::RemoteError& e) {
    EXPECT_EQ(e.type(), "torchpar::SerializationError") << e.what();
  }
  d.set("after", 1);  // the object and the server go on
  EXPECT_EQ(d.get("after"), std::optional<int64_t>(1));
}

TEST(Manager, TensorValuesAreCopiedBothWays) {
  tp::Manager m(manager_options());
  auto d = m.dict<int64_t, at::Tensor>();
  at::Tensor t = at::arange(6, at::kFloat);
  d.set(1, t);
  t.add_(100);  // the manager holds a copy
  at::Tensor back = *d.get(1);
  EXPECT_TRUE(at::equal(back, at::arange(6, at::kFloat)));
  back.add_(1);
  EXPECT_TRUE(at::equal(*d.get(1), at::arange(6, at::kFloat)));
}

TEST(Manager, ObjectsAreFreedWithTheirLastProxy) {
  tp::Manager m(manager_options());
  EXPECT_EQ(m.number_of_objects(), 0u);
  {
    auto a = m.dict<std::string, int64_t>();
    {
      auto b = m.dict<std::string, int64_t>();
      auto b2 = b;  // copies share one reference
      EXPECT_EQ(m.number_of_objects(), 2u);
    }
    EXPECT_EQ(m.number_of_objects(), 1u);
    // A serialized proxy takes its own reference when loaded (here through a Pipe).
    auto [x, y] = tp::Pipe();
    x.send(a);
    {
      Dict loaded = y.recv<Dict>(30s);
      EXPECT_EQ(loaded.id(), a.id());
      loaded.set("via pipe", 1);
    }
    EXPECT_EQ(a.get("via pipe"), std::optional<int64_t>(1));
    EXPECT_EQ(m.number_of_objects(), 1u);
  }
  EXPECT_EQ(m.number_of_objects(), 0u);
}

TEST(Manager, DefaultProxyRefersToNothing) {
  Dict d;
  EXPECT_FALSE(d);
  EXPECT_THROW(d.size(), tp::Error);
}

// ---- across processes --------------------------------------------------------------------

class ManagerAcrossProcesses : public tp::testing::StartMethodTest {};

TEST_P(ManagerAcrossProcesses, ChildrenShareTheDict) {
  tp::ManagerOptions o = manager_options();
  o.start_method = tp::start_method_from_string(GetParam());  // the server's own start too
  tp::Manager m(o);
  {
    auto d = m.dict<std::string, int64_t>();
    d.set("from-parent", 7);
    tp::ProcessOptions po;
    po.start_method = tp::start_method_from_string(GetParam());
    tp::Process p1(po, child_fill, d, int64_t{100});
    tp::Process p2(po, child_fill, d, int64_t{200});
    p1.start();
    p2.start();
    EXPECT_EQ(exit_code(p1), 0);
    EXPECT_EQ(exit_code(p2), 0);
    EXPECT_EQ(d.size(), 11u);
    for (int64_t i = 0; i < 10; ++i) {
      const auto v = d.get("k" + std::to_string(i));
      ASSERT_TRUE(v.has_value());
      EXPECT_TRUE(*v == 100 + i || *v == 200 + i) << *v;
    }
  }
  // The children's references went with them: spawned and forkserver children sent their
  // decrefs, a fork child (which _exits without destructors) had its references dropped by
  // the server when its connection closed. So the parent's was the last one.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (m.number_of_objects() != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(m.number_of_objects(), 0u);
}

TORCHPAR_INSTANTIATE_FOR_START_METHODS(ManagerAcrossProcesses);

TEST(Manager, SecondClientConnectsByAddressAndKey) {
  const tp::AuthKey key = tp::random_authkey();
  tp::ManagerOptions o = manager_options();
  o.authkey = key;
  tp::Manager m(o);
  auto [mine, theirs] = tp::Pipe();
  tp::Process p(second_client, m.address(), tp::to_hex(key), theirs);
  p.start();
  Dict d = mine.recv<Dict>(60s);
  mine.send(std::string("loaded"));
  EXPECT_EQ(exit_code(p), 0);
  EXPECT_EQ(d.get("second"), std::optional<int64_t>(2));  // the child is gone, the dict stays
  EXPECT_EQ(m.number_of_objects(), 1u);
}

TEST(Manager, WrongKeyIsRefused) {
  tp::ManagerOptions o = manager_options();
  o.authkey = tp::random_authkey();
  tp::Manager m(o);
  tp::ManagerOptions wrong = manager_options();
  wrong.authkey = tp::random_authkey();
  EXPECT_THROW(tp::Manager::connect(m.address(), wrong), tp::AuthenticationError);
  tp::Manager ok = tp::Manager::connect(m.address(), o);
  EXPECT_EQ(ok.number_of_objects(), 0u);
  EXPECT_EQ(ok.pid(), -1);
  EXPECT_THROW(ok.shutdown(), tp::Error);  // it does not own the server
}

TEST(Manager, ConnectTakesTheAddressAndTheKey) {  // BaseManager(address, authkey).connect()
  tp::ManagerOptions o = manager_options();
  o.authkey = tp::AuthKey("a shared secret");
  tp::Manager m(o);
  auto d = m.dict<std::string, int64_t>();
  d.set("k", 7);
  EXPECT_THROW(tp::Manager::connect(m.address(), "another secret"), tp::AuthenticationError);
  tp::Manager by_string = tp::Manager::connect(m.address(), "a shared secret");
  EXPECT_EQ(by_string.number_of_objects(), 1u);
  tp::Manager by_bytes = tp::Manager::connect(
      m.address(), tp::AuthKey(std::string("a shared secret")), manager_options());
  EXPECT_EQ(by_bytes.number_of_objects(), 1u);
}

TEST(Manager, ShutdownEndsTheServerAndFailsLaterCalls) {
  tp::Manager m(manager_options());
  auto d = m.dict<std::string, int64_t>();
  d.set("x", 1);
  const int pid = m.pid();
  m.shutdown();
  EXPECT_TRUE(gone_within(pid, 10s));
  expect_error_naming([&] { d.get("x"); }, m.address(), "ClosedError");
  m.shutdown();  // idempotent
}

TEST(Manager, ShutdownWhileClientsAreConnectedFailsTheirCalls) {
  tp::Manager m(manager_options());
  auto q = m.Queue<int64_t>();
  auto [mine, theirs] = tp::Pipe();
  tp::Process p(blocked_getter, q, theirs);
  p.start();
  ASSERT_EQ(mine.recv<std::string>(60s), "waiting");
  std::this_thread::sleep_for(200ms);  // the child's get reaches the server and blocks
  const int pid = m.pid();
  m.shutdown();
  EXPECT_TRUE(gone_within(pid, 10s));
  const std::string what = mine.recv<std::string>(30s);
  EXPECT_EQ(what.rfind("ClosedError: ", 0), 0u) << what;
  EXPECT_NE(what.find(m.address()), std::string::npos) << what;
  EXPECT_EQ(exit_code(p), 0);
}

TEST(Manager, ServesOtherHostsOverTcp) {
  const std::string ip = non_loopback_ipv4();
  if (ip.empty()) GTEST_SKIP() << "this machine has no non-loopback IPv4 address";
  const tp::AuthKey key = tp::random_authkey();
  tp::ManagerOptions o = manager_options();
  o.authkey = key;
  o.address = "0.0.0.0:0";
  tp::Manager m(o);
  const auto colon = m.address().rfind(':');
  ASSERT_NE(colon, std::string::npos) << m.address();
  const std::string there = ip + m.address().substr(colon);  // "<ip>:<port>"
  tp::Process p(tcp_client, there, tp::to_hex(key));
  p.start();
  EXPECT_EQ(exit_code(p), 0);
  EXPECT_EQ(m.number_of_objects(), 0u);  // the client's dict went with it
  // A wrong key over the same path is refused.
  tp::ManagerOptions wrong = manager_options();
  wrong.authkey = tp::random_authkey();
  EXPECT_THROW(tp::Manager::connect(there, wrong), tp::AuthenticationError);
}

TEST(Manager, KilledServerFailsCallsAtOnce) {
  tp::Manager m(manager_options());
  auto d = m.dict<std::string, int64_t>();
  d.set("x", 1);
  ASSERT_EQ(::kill(m.pid(), SIGKILL), 0);
  ASSERT_TRUE(gone_within(m.pid(), 10s));
  const auto t0 = std::chrono::steady_clock::now();
  expect_error_naming([&] { d.size(); }, m.address(), "ClosedError");
  expect_error_naming([&] { d.size(); }, m.address(), "ClosedError");  // and every later one
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

TEST(Manager, ServerDiesWithItsOwner) {
  auto child = tp::testing::fork_child([](int sock) {
    tp::ManagerOptions o = manager_options();
    o.start_method = tp::StartMethod::kFork;
    tp::Manager m(o);
    tp::testing::send_line(sock, std::to_string(m.pid()));
    std::this_thread::sleep_for(120s);  // killed long before
    return 0;
  });
  const std::string line = tp::testing::recv_line(child.sock, 60s);
  ASSERT_FALSE(line.empty());
  const int server = std::stoi(line);
  ASSERT_FALSE(gone(server));
  ::kill(child.pid, SIGKILL);
  tp::testing::wait_child(child, 30s);
  EXPECT_TRUE(gone_within(server, 10s)) << "the manager server outlived its owner";
}

TEST(Manager, StrangersAndGarbageDoNotDisturbTheServer) {
  tp::Manager m(manager_options());
  auto d = m.dict<std::string, int64_t>();
  d.set("x", 1);
  const auto colon = m.address().rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(m.address().substr(colon + 1))));
  for (const std::string& junk : {std::string("GET / HTTP/1.1\r\n\r\n"), std::string(4, '\xff'),
                                  std::string("\0\0\0\x08garbage!", 12)}) {
    tp::UniqueFd raw(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_EQ(::connect(raw.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    ASSERT_EQ(::send(raw.get(), junk.data(), junk.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(junk.size()));
  }
  // An authenticated client that sends frames that are no requests: answered with an error
  // frame (the stream is in sync), or dropped for an oversized frame.
  tp::Connection c = tp::Client(m.address(), {.authkey = tp::default_authkey(), .timeout = 30s});
  c.send_bytes("not a request");
  EXPECT_FALSE(c.recv_bytes(30s, 1 << 20).empty());
  EXPECT_EQ(d.get("x"), std::optional<int64_t>(1));
  d.set("y", 2);
  EXPECT_EQ(d.size(), 2u);
}

}  // namespace

int main(int argc, char** argv) { return tp::testing::manager_test_main(argc, argv); }
