// Listener / Client over real sockets (TCP, Unix socket files, abstract names): bytes both
// ways (empty, 1 MiB), typed values with tensors copied, the handshake (right key, wrong key,
// garbage, a silent peer), timeouts, maxlength, the 64-bit length form, address errors; and
// against Python's own multiprocessing.connection Client and Listener (/usr/bin/python3,
// started by argv through exec_program) in both directions, right and wrong key, and a
// Python <= 3.11 peer refused without allow_legacy_md5.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "support/raw_socket.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

using tp::testing::raw_connect;
using tp::testing::send_raw;

const tp::AuthKey kKey = {'l', 'i', 's', 't', 'e', 'n', '-', 'k', 'e', 'y'};
const tp::AuthKey kOther = {'o', 't', 'h', 'e', 'r'};

/// A private directory for socket files, removed with what is left in it.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/tp_listener_XXXXXX";
    path = ::mkdtemp(tmpl) ? tmpl : "";
  }
  ~TempDir() {
    for (const char* name : {"s.sock", "py.sock"}) {
      ::unlink((path + "/" + name).c_str());
    }
    ::rmdir(path.c_str());
  }
};

std::string abstract_name() {
  static std::atomic<int> n{0};
  return fmt::format("@torchpar-listener-test-{}-{}", ::getpid(), n++);
}

/// An address of the given kind: "tcp" (port 0), "unix" (a file in `dir`), "abstract".
std::string address_of(const std::string& kind, const TempDir& dir) {
  if (kind == "tcp") return ":0";
  if (kind == "unix") return dir.path + "/s.sock";
  return abstract_name();
}

/// Waits for `f` at most `within`; a hung side fails the test instead of hanging it.
template <class T>
T get_within(std::future<T>& f, std::chrono::seconds within = 60s) {
  if (f.wait_for(within) != std::future_status::ready) {
    ADD_FAILURE() << "a side of the test hung for " << within.count() << " s";
    std::abort();  // the future's destructor would block
  }
  return f.get();
}

std::string big_message(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + 7) & 0xff);
  return s;
}

// ---- ours with ours, per address family --------------------------------------------------

class ListenerFamily : public ::testing::TestWithParam<std::string> {};

TEST_P(ListenerFamily, BytesBothWaysEmptyAndOneMebibyte) {
  TempDir dir;
  tp::Listener l(address_of(GetParam(), dir), {.authkey = kKey});
  if (GetParam() == "tcp") {
    EXPECT_EQ(l.address().rfind("127.0.0.1:", 0), 0u) << l.address();
    EXPECT_NE(l.address(), "127.0.0.1:0");
  }
  const std::string big = big_message(1 << 20);
  auto server = std::async(std::launch::async, [&] {
    tp::Connection c = l.accept(20s);
    EXPECT_EQ(c.framing(), tp::Connection::Framing::kPython);
    for (int i = 0; i < 3; ++i) c.send_bytes(c.recv_bytes(20s));  // echo
    return true;
  });
  tp::Connection c = tp::Client(l.address(), {.authkey = kKey, .timeout = 20s});
  EXPECT_EQ(c.framing(), tp::Connection::Framing::kPython);
  for (const std::string& m : {std::string("hello"), std::string(), big}) {
    c.send_bytes(m);
    EXPECT_EQ(c.recv_bytes(20s), m);
  }
  EXPECT_TRUE(get_within(server));
}

TEST_P(ListenerFamily, TypedValuesTravelWithTensorsCopied) {
  TempDir dir;
  tp::Listener l(address_of(GetParam(), dir), {.authkey = kKey});
  auto server = std::async(std::launch::async, [&] {
    tp::Connection c = l.accept(20s);
    at::Tensor t = c.recv<at::Tensor>(20s);
    t.add_(1);  // a copy: the sender's tensor must not change
    c.send(t);
    c.send(c.recv<std::string>(20s) + " back");
    return true;
  });
  tp::Connection c = tp::Client(l.address(), {.authkey = kKey, .timeout = 20s});
  at::Tensor t = at::arange(12, at::kFloat).reshape({3, 4});
  tp::share_memory_(t);  // even a shared tensor is copied over a Listener connection
  c.send(t);
  at::Tensor back = c.recv<at::Tensor>(20s);
  EXPECT_TRUE(at::equal(back, at::arange(12, at::kFloat).reshape({3, 4}) + 1));
  EXPECT_TRUE(at::equal(t, at::arange(12, at::kFloat).reshape({3, 4})));
  c.send(std::string("caf\xc3\xa9"));
  EXPECT_EQ(c.recv<std::string>(20s), "caf\xc3\xa9 back");
  EXPECT_TRUE(get_within(server));
}

TEST_P(ListenerFamily, WrongKeyIsRefusedOnBothSides) {
  TempDir dir;
  tp::Listener l(address_of(GetParam(), dir), {.authkey = kKey});
  auto server = std::async(std::launch::async, [&] {
    try {
      l.accept(20s);
      return std::string("accepted");
    } catch (const tp::AuthenticationError& e) {
      return std::string(e.what());
    }
  });
  EXPECT_THROW(tp::Client(l.address(), {.authkey = kOther, .timeout = 20s}),
               tp::AuthenticationError);
  const std::string refusal = get_within(server);
  EXPECT_NE(refusal, "accepted");
  EXPECT_NE(refusal.find(l.address()), std::string::npos) << refusal;
  EXPECT_NE(refusal.find("refused peer"), std::string::npos) << refusal;
}

TEST_P(ListenerFamily, NoKeyMeansNoHandshake) {
  TempDir dir;
  tp::Listener l(address_of(GetParam(), dir));
  auto server = std::async(std::launch::async, [&] {
    tp::Connection c = l.accept(20s);
    c.send_bytes("no handshake");
    return true;
  });
  tp::Connection c = tp::Client(l.address(), {.timeout = 20s});
  EXPECT_EQ(c.recv_bytes(20s), "no handshake");
  EXPECT_TRUE(get_within(server));
}

INSTANTIATE_TEST_SUITE_P(Families, ListenerFamily, ::testing::Values("tcp", "unix", "abstract"));

// ---- addresses ---------------------------------------------------------------------------

TEST(Listener, UnixSocketFileIsPrivateAndUnlinkedByClose) {
  TempDir dir;
  const std::string path = dir.path + "/s.sock";
  tp::Listener l(path, {.authkey = kKey});
  EXPECT_EQ(l.address(), path);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // A second Listener on the same path fails, naming it, and leaves the first one alone.
  try {
    tp::Listener second(path);
    ADD_FAILURE() << "a second Listener bound the same path";
  } catch (const tp::SystemError& e) {
    EXPECT_EQ(e.error_code(), EADDRINUSE);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  EXPECT_EQ(::access(path.c_str(), F_OK), 0);
  l.close();
  EXPECT_TRUE(l.closed());
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
  l.close();  // idempotent
}

TEST(Listener, CloseDoesNotUnlinkAReplacedPath) {
  TempDir dir;
  const std::string path = dir.path + "/s.sock";
  tp::Listener l(path);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  tp::UniqueFd file(::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600));
  ASSERT_TRUE(file);
  l.close();
  EXPECT_EQ(::access(path.c_str(), F_OK), 0);  // someone else's file stays
}

TEST(Listener, AbstractNamesAcceptPythonsNulSpelling) {
  const std::string name = abstract_name();
  tp::Listener l(std::string(1, '\0') + name.substr(1));
  EXPECT_EQ(l.address(), name);  // reported as @name
  auto server = std::async(std::launch::async, [&] {
    l.accept(20s).send_bytes("abstract");
    return true;
  });
  EXPECT_EQ(tp::Client(name, {.timeout = 20s}).recv_bytes(20s), "abstract");
  EXPECT_TRUE(get_within(server));
}

TEST(Listener, MalformedAddressesAreValueErrors) {
  for (const char* bad :
       {"nonsense", "host:99999", "host:port", "::1:5000", "127.0.0.1:", "[::1]5000", "@"}) {
    EXPECT_THROW(tp::Listener{bad}, tp::ValueError) << bad;
    EXPECT_THROW(tp::Client(bad, {.timeout = 1s}), tp::ValueError) << bad;
  }
  EXPECT_THROW(tp::Listener(std::string("/tmp/") + std::string(200, 'x')), tp::ValueError);
}

TEST(Listener, EmptyAndPortOnlyAddressesAreLoopback) {
  tp::Listener a("");
  EXPECT_EQ(a.address().rfind("127.0.0.1:", 0), 0u) << a.address();
  tp::Listener b(":0");
  EXPECT_EQ(b.address().rfind("127.0.0.1:", 0), 0u) << b.address();
  tp::Listener c("localhost:0");
  EXPECT_EQ(c.address().rfind("127.0.0.1:", 0), 0u) << c.address();
}

TEST(Client, NothingListeningIsAnErrorNamingTheAddress) {
  // A bound socket that does not listen holds a port nobody accepts on.
  tp::UniqueFd held(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(held.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  socklen_t len = sizeof a;
  ASSERT_EQ(::getsockname(held.get(), reinterpret_cast<sockaddr*>(&a), &len), 0);
  const std::string address = fmt::format("127.0.0.1:{}", ntohs(a.sin_port));
  try {
    tp::Client(address, {.authkey = kKey, .timeout = 10s});
    ADD_FAILURE() << "connected to " << address;
  } catch (const tp::SystemError& e) {
    EXPECT_EQ(e.error_code(), ECONNREFUSED);
    EXPECT_NE(std::string(e.what()).find(address), std::string::npos) << e.what();
  }
  TempDir dir;
  const std::string missing = dir.path + "/s.sock";
  try {
    tp::Client(missing, {.timeout = 10s});
    ADD_FAILURE() << "connected to " << missing;
  } catch (const tp::SystemError& e) {
    EXPECT_EQ(e.error_code(), ENOENT);
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
}

// ---- accept under strangers --------------------------------------------------------------

TEST(Listener, AcceptTimesOutWithoutPeers) {
  tp::Listener l(":0", {.authkey = kKey});
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(l.accept(200ms), tp::TimeoutError);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 150ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_THROW(l.accept(0s), tp::TimeoutError);
}

TEST(Listener, SilentPeerTimesOutAcceptAndHandshake) {
  tp::Listener l(":0", {.authkey = kKey, .handshake_timeout = 300ms});
  auto silent = raw_connect(l.address());  // connects, never speaks
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(l.accept(20s), tp::TimeoutError);  // the handshake limit applies
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  tp::Listener l2(":0", {.authkey = kKey});
  auto silent3 = raw_connect(l2.address());
  t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(l2.accept(300ms), tp::TimeoutError);  // accept's own deadline applies
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

TEST(Listener, GarbageIsRefusedAndTheListenerGoesOn) {
  tp::Listener l(":0", {.authkey = kKey});
  {
    auto raw = raw_connect(l.address());
    send_raw(raw.get(), "GET / HTTP/1.1\r\nHost: x\r\n\r\n");  // "GET " as a length: 1.2 GB
    EXPECT_THROW(l.accept(10s), tp::AuthenticationError);
  }
  {
    auto raw = raw_connect(l.address());
    std::string frame("\0\0\0\x64", 4);  // a plausible length, then noise as the answer
    frame += big_message(100);
    send_raw(raw.get(), frame);
    EXPECT_THROW(l.accept(10s), tp::AuthenticationError);
  }
  {
    auto raw = raw_connect(l.address());
    raw.reset();  // connects and leaves
    EXPECT_THROW(l.accept(10s), tp::Error);
  }
  auto server = std::async(std::launch::async, [&] {
    l.accept(20s).send_bytes("still serving");
    return true;
  });
  EXPECT_EQ(tp::Client(l.address(), {.authkey = kKey, .timeout = 20s}).recv_bytes(20s),
            "still serving");
  EXPECT_TRUE(get_within(server));
}

TEST(Listener, CloseFromAnotherThreadWakesAccept) {
  tp::Listener l(":0");
  auto waiter = std::async(std::launch::async, [l]() mutable {
    try {
      l.accept(30s);
      return std::string("accepted");
    } catch (const tp::ClosedError&) {
      return std::string("closed");
    }
  });
  std::this_thread::sleep_for(100ms);
  l.close();
  EXPECT_EQ(get_within(waiter), "closed");
  EXPECT_THROW(l.accept(1s), tp::ClosedError);
}

// ---- the Connection a Listener returns ---------------------------------------------------

/// A connected pair through a Listener without a key: {accepted, client}.
std::pair<tp::Connection, tp::Connection> connected_pair(tp::Listener& l) {
  auto server = std::async(std::launch::async, [&] { return l.accept(20s); });
  tp::Connection client = tp::Client(l.address(), {.timeout = 20s});
  return {get_within(server), client};
}

TEST(ListenerConnection, LongerThanMaxlengthClosesTheConnection) {
  tp::Listener l(":0");
  auto [server, client] = connected_pair(l);
  client.send_bytes(std::string(100, 'x'));
  try {
    server.recv_bytes(10s, 10);
    ADD_FAILURE() << "no ProtocolError";
  } catch (const tp::ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("bad message length"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(server.closed());
  // Exactly maxlength is fine.
  auto [s2, c2] = connected_pair(l);
  c2.send_bytes(std::string(10, 'y'));
  EXPECT_EQ(s2.recv_bytes(10s, 10), std::string(10, 'y'));
}

TEST(ListenerConnection, PipeHonoursMaxlengthToo) {
  auto [a, b] = tp::Pipe();
  b.send_bytes(std::string(100, 'x'));
  EXPECT_THROW(a.recv_bytes(10s, 10), tp::ProtocolError);
  EXPECT_TRUE(a.closed());
}

TEST(ListenerConnection, TimeoutBeforeAMessageLeavesItUsable) {
  tp::Listener l(":0");
  auto [server, client] = connected_pair(l);
  EXPECT_THROW(server.recv_bytes(100ms), tp::TimeoutError);
  EXPECT_FALSE(server.closed());
  client.send_bytes("late");
  EXPECT_EQ(server.recv_bytes(10s), "late");
}

TEST(ListenerConnection, TimeoutInsideAMessageClosesIt) {
  tp::Listener l(":0");
  auto server = std::async(std::launch::async, [&] { return l.accept(20s); });
  auto raw = raw_connect(l.address());
  tp::Connection c = get_within(server);
  send_raw(raw.get(), std::string("\0\0\0\x10partial", 11));  // 16 announced, 7 sent
  EXPECT_THROW(c.recv_bytes(300ms), tp::TimeoutError);
  EXPECT_TRUE(c.closed());
}

TEST(ListenerConnection, ReadsCPythonsSixtyFourBitLengthForm) {
  tp::Listener l(":0");
  auto server = std::async(std::launch::async, [&] { return l.accept(20s); });
  auto raw = raw_connect(l.address());
  tp::Connection c = get_within(server);
  // -1, then the length as 8 bytes (CPython sends this form only above 2 GiB, and reads it
  // for any length).
  send_raw(raw.get(), std::string("\xff\xff\xff\xff\0\0\0\0\0\0\0\x05hello", 17));
  EXPECT_EQ(c.recv_bytes(10s), "hello");
  EXPECT_EQ(tp::detail::frame_header(5), std::string("\0\0\0\x05", 4));
  EXPECT_EQ(tp::detail::frame_header(uint64_t{1} << 31),
            std::string("\xff\xff\xff\xff\0\0\0\0\x80\0\0\0", 12));
  send_raw(raw.get(), std::string("\xff\xff\xff\xfe", 4));  // -2: no sender writes that
  EXPECT_THROW(c.recv_bytes(10s), tp::ProtocolError);
  EXPECT_TRUE(c.closed());
}

TEST(ListenerConnection, PeerGoneIsClosedErrorNotSigpipe) {
  tp::Listener l(":0");
  auto [server, client] = connected_pair(l);
  client.close();
  const std::string chunk(64 << 10, 'z');
  bool closed = false;
  for (int i = 0; i < 1000 && !closed; ++i) {
    try {
      server.send_bytes(chunk);
    } catch (const tp::ClosedError&) {
      closed = true;  // and this process got no SIGPIPE
    }
  }
  EXPECT_TRUE(closed);
  EXPECT_THROW(server.recv_bytes(10s), tp::ClosedError);
}

TEST(ListenerConnection, ValuesCarryingFdsAreRefused) {
  tp::Listener l(":0");
  auto [server, client] = connected_pair(l);
  tp::Queue<int> q;
  EXPECT_THROW(client.send(q), tp::Error);
  client.send(int64_t{42});  // nothing of the refused value went out
  EXPECT_EQ(server.recv<int64_t>(10s), 42);
}

TEST(ListenerConnection, KeepsItsFramingThroughAPipe) {
  tp::Listener l(":0");
  auto [server, client] = connected_pair(l);
  auto [a, b] = tp::Pipe();
  a.send(client);
  tp::Connection moved = b.recv<tp::Connection>(10s);
  EXPECT_EQ(moved.framing(), tp::Connection::Framing::kPython);
  moved.send_bytes("through a pipe");
  EXPECT_EQ(server.recv_bytes(10s), "through a pipe");
}

// ---- against Python's multiprocessing.connection -----------------------------------------

bool have_python() { return ::access("/usr/bin/python3", X_OK) == 0; }

/// /usr/bin/python3 -c script args..., started by argv, with its stdout on a pipe.
class Python {
 public:
  Python(const std::string& script, const std::vector<std::string>& args) {
    int p[2];
    EXPECT_EQ(::pipe2(p, O_CLOEXEC), 0);
    out_ = tp::UniqueFd(p[0]);
    tp::UniqueFd w(p[1]);
    std::vector<std::string> argv = {"/usr/bin/python3", "-c", script};
    argv.insert(argv.end(), args.begin(), args.end());
    tp::ExecOptions o;
    o.stdout_fd = w.get();
    pid_ = tp::exec_program(argv, o);
  }
  ~Python() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      tp::wait_program(pid_, 30s);
    }
  }
  /// One line of its stdout (without the newline); "" if none came within `within`.
  std::string read_line(std::chrono::seconds within = 30s) {
    const auto deadline = std::chrono::steady_clock::now() + within;
    std::string line;
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{out_.get(), POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      char ch;
      if (::read(out_.get(), &ch, 1) != 1) break;
      if (ch == '\n') return line;
      line.push_back(ch);
    }
    return "";
  }
  /// Its exit code; -1 (after SIGKILL) if it did not end within `within`.
  int wait(std::chrono::seconds within = 60s) {
    auto status = tp::wait_program(pid_, within);
    if (!status) return -1;  // the destructor kills it
    pid_ = -1;
    return tp::exit_code_of(*status);
  }

 private:
  pid_t pid_ = -1;
  tp::UniqueFd out_;
};

// Python's Client against our Listener: exits 3 when refused.
constexpr const char* kPyClient = R"(
import sys
from multiprocessing.connection import Client, AuthenticationError
addr = sys.argv[1]
if addr.startswith('@'):
    addr = '\0' + addr[1:]
elif '/' not in addr:
    host, port = addr.rsplit(':', 1)
    addr = (host, int(port))
key = None if sys.argv[2] == '-' else bytes.fromhex(sys.argv[2])
try:
    c = Client(addr, authkey=key)
except AuthenticationError:
    sys.exit(3)
c.send_bytes(b'hello from python')
c.send_bytes(b'')
assert c.recv_bytes() == b'hello from torchpar'
big = c.recv_bytes()
assert len(big) == 1 << 20, len(big)
c.send_bytes(big)
assert c.recv_bytes() == b''
c.close()
)";

// Python's Listener against our Client: prints its address, exits 3 when it refused us.
constexpr const char* kPyListener = R"(
import sys
from multiprocessing.connection import Listener, AuthenticationError
key = None if sys.argv[2] == '-' else bytes.fromhex(sys.argv[2])
if sys.argv[1] == 'tcp':
    l = Listener(('127.0.0.1', 0), authkey=key)
    print('127.0.0.1:%d' % l.address[1], flush=True)
else:  # a socket path, or '@name' for an abstract socket ('\0name' to Python)
    where = sys.argv[1]
    l = Listener('\0' + where[1:] if where.startswith('@') else where, authkey=key)
    print(where, flush=True)
try:
    c = l.accept()
except AuthenticationError:
    sys.exit(3)
m = c.recv_bytes()
c.send_bytes(b'python got ' + m)
c.send_bytes(b'')
big = c.recv_bytes()
c.send_bytes(big[::-1])
assert c.recv_bytes() == b'bye'
c.close()
l.close()
)";

class PythonInterop : public ::testing::TestWithParam<std::string> {};

TEST_P(PythonInterop, PythonClientTalksToOurListener) {
  if (!have_python()) GTEST_SKIP() << "no /usr/bin/python3";
  TempDir dir;
  for (const bool with_key : {true, false}) {
    tp::Listener l(address_of(GetParam(), dir),
                   {.authkey = with_key ? std::optional(kKey) : std::nullopt,
                    .allow_legacy_md5 = true});  // python3 <= 3.11 speaks only that
    Python py(kPyClient, {l.address(), with_key ? tp::to_hex(kKey) : "-"});
    tp::Connection c = l.accept(60s);
    EXPECT_EQ(c.recv_bytes(30s), "hello from python");
    EXPECT_EQ(c.recv_bytes(30s), "");
    c.send_bytes("hello from torchpar");
    const std::string big = big_message(1 << 20);
    c.send_bytes(big);
    EXPECT_EQ(c.recv_bytes(30s), big);
    c.send_bytes("");
    EXPECT_EQ(py.wait(), 0);
    l.close();
  }
}

TEST_P(PythonInterop, PythonClientWithWrongKeyIsRefused) {
  if (!have_python()) GTEST_SKIP() << "no /usr/bin/python3";
  TempDir dir;
  tp::Listener l(address_of(GetParam(), dir), {.authkey = kKey, .allow_legacy_md5 = true});
  Python py(kPyClient, {l.address(), tp::to_hex(kOther)});
  EXPECT_THROW(l.accept(60s), tp::AuthenticationError);
  EXPECT_EQ(py.wait(), 3);  // Python raised AuthenticationError too
}

TEST_P(PythonInterop, OurClientTalksToPythonsListenerAndIsRefusedWithAWrongKey) {
  if (!have_python()) GTEST_SKIP() << "no /usr/bin/python3";
  TempDir dir;
  for (const bool right_key : {true, false}) {
    const std::string where = GetParam() == "tcp"    ? "tcp"
                              : GetParam() == "unix" ? dir.path + "/py.sock"
                                                     : abstract_name();
    Python py(kPyListener, {where, tp::to_hex(kKey)});
    const std::string address = py.read_line();
    ASSERT_FALSE(address.empty());
    if (!right_key) {
      EXPECT_THROW(
          tp::Client(address, {.authkey = kOther, .timeout = 30s, .allow_legacy_md5 = true}),
          tp::AuthenticationError);
      EXPECT_EQ(py.wait(), 3);  // Python's accept raised AuthenticationError
      continue;
    }
    tp::Connection c =
        tp::Client(address, {.authkey = kKey, .timeout = 30s, .allow_legacy_md5 = true});
    c.send_bytes("torchpar");
    EXPECT_EQ(c.recv_bytes(30s), "python got torchpar");
    EXPECT_EQ(c.recv_bytes(30s), "");
    std::string big = big_message(1 << 20);
    c.send_bytes(big);
    std::reverse(big.begin(), big.end());
    EXPECT_EQ(c.recv_bytes(30s), big);
    c.send_bytes("bye");
    EXPECT_EQ(py.wait(), 0);
  }
}

TEST(PythonLegacy, APython311PeerIsRefusedWithoutAllowLegacyMd5) {
  if (!have_python()) GTEST_SKIP() << "no /usr/bin/python3";
  {
    Python version("import sys; print(int(sys.version_info < (3, 12)))", {});
    if (version.read_line() != "1") GTEST_SKIP() << "python3 >= 3.12 speaks {sha256}";
    EXPECT_EQ(version.wait(), 0);
  }
  const std::string why = "from a Python <= 3.11 peer: set allow_legacy_md5";
  // Its Client against our Listener: its bare HMAC-MD5 answer is refused (#FAILURE#).
  {
    tp::Listener l(":0", {.authkey = kKey});
    Python py(kPyClient, {l.address(), tp::to_hex(kKey)});
    try {
      l.accept(60s);
      ADD_FAILURE() << "a legacy Python client was accepted";
    } catch (const tp::AuthenticationError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
    EXPECT_EQ(py.wait(), 3);  // Python's AuthenticationError: "digest sent was rejected"
  }
  // Its Listener against our Client: its 20-byte challenge is not answered.
  {
    Python py(kPyListener, {"tcp", tp::to_hex(kKey)});
    const std::string address = py.read_line();
    ASSERT_FALSE(address.empty());
    try {
      tp::Client(address, {.authkey = kKey, .timeout = 30s});
      ADD_FAILURE() << "a legacy Python listener's challenge was answered";
    } catch (const tp::AuthenticationError& e) {
      EXPECT_NE(std::string(e.what()).find("legacy HMAC-MD5 challenge " + why), std::string::npos)
          << e.what();
    }
    EXPECT_NE(py.wait(), 0);  // its accept saw us leave (EOFError)
  }
}

INSTANTIATE_TEST_SUITE_P(Families, PythonInterop, ::testing::Values("tcp", "unix", "abstract"));

}  // namespace
