// The auth handshake (Python multiprocessing.connection's) over real sockets: right key
// accepted both ways, wrong key refused on both sides, a stalled peer times out, an oversized
// frame is refused without allocating; and against Python itself: the installed python3's
// multiprocessing.connection Client/Listener, and a hand-written CPython 3.12 ({sha256})
// peer that checks our frames byte for byte.
#include "torchpar/core/auth.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <thread>

#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/ipc/listener.h"
#include "torchpar/manager/manager.h"

extern char** environ;

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

tp::AuthDeadline in(std::chrono::milliseconds d) { return std::chrono::steady_clock::now() + d; }

std::pair<tp::UniqueFd, tp::UniqueFd> socket_pair() {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  return {tp::UniqueFd(sv[0]), tp::UniqueFd(sv[1])};
}

const tp::AuthKey kKey = {'s', 'e', 'c', 'r', 'e', 't', '-', 'k', 'e', 'y'};
const tp::AuthKey kOther = {'o', 't', 'h', 'e', 'r'};

TEST(Auth, SameKeyIsAcceptedBothWays) {
  auto [a, b] = socket_pair();
  auto server =
      std::async(std::launch::async, [&, fd = a.get()] { tp::auth_accept(fd, kKey, in(10s)); });
  tp::auth_connect(b.get(), kKey, in(10s));
  server.get();
  // The connection is usable afterwards: one more frame each way.
  tp::send_frame(b.get(), "after", in(5s));
  EXPECT_EQ(tp::recv_frame(a.get(), 256, in(5s)), "after");
}

// Python users write authkey=b"secret-key": an AuthKey is built from text too, byte for byte
// (before: a std::vector<uint8_t> alias, which a string did not convert to), wherever an
// AuthKey is taken (here the handshake, a Listener's and a Manager's options).
TEST(Auth, KeyFromTextIsTheSameBytes) {
  const std::string text = "secret-key";
  EXPECT_EQ(tp::AuthKey("secret-key"), kKey);
  EXPECT_EQ(tp::AuthKey(text), kKey);
  EXPECT_EQ(tp::AuthKey(std::string_view(text)), kKey);
  EXPECT_EQ(tp::AuthKey("").size(), 0u);
  auto [a, b] = socket_pair();
  auto server = std::async(std::launch::async,
                           [&, fd = a.get()] { tp::auth_accept(fd, "secret-key", in(10s)); });
  tp::auth_connect(b.get(), kKey, in(10s));
  server.get();
  tp::ListenerOptions listener;
  listener.authkey = "secret-key";
  tp::ManagerOptions manager;
  manager.authkey = text;
  EXPECT_EQ(*listener.authkey, *manager.authkey);
  EXPECT_EQ(tp::to_hex(*listener.authkey), "7365637265742d6b6579");
}

TEST(Auth, WrongKeyIsRefusedOnBothSides) {
  auto [a, b] = socket_pair();
  auto server =
      std::async(std::launch::async, [&, fd = a.get()] { tp::auth_accept(fd, kKey, in(10s)); });
  EXPECT_THROW(tp::auth_connect(b.get(), kOther, in(10s)), tp::AuthenticationError);
  EXPECT_THROW(server.get(), tp::AuthenticationError);
}

TEST(Auth, StalledPeerTimesOut) {
  auto [a, b] = socket_pair();
  ASSERT_EQ(::send(b.get(), "\0", 1, 0), 1);  // one byte of a length, then nothing
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(tp::answer_challenge(a.get(), kKey, in(300ms)), tp::TimeoutError);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST(Auth, OversizedFrameIsRefusedWithoutReadingIt) {
  auto [a, b] = socket_pair();
  const unsigned char huge[4] = {0x20, 0, 0, 0};  // 512 MiB
  ASSERT_EQ(::send(b.get(), huge, 4, 0), 4);
  EXPECT_THROW(tp::answer_challenge(a.get(), kKey, in(5s)), tp::AuthenticationError);
  const unsigned char minus_one[4] = {0xff, 0xff, 0xff, 0xff};  // CPython's 64-bit length marker
  ASSERT_EQ(::send(b.get(), minus_one, 4, 0), 4);
  EXPECT_THROW(tp::recv_frame(a.get(), 256, in(5s)), tp::AuthenticationError);
}

TEST(Auth, ChallengeFrameHasCPythonLayout) {
  auto [a, b] = socket_pair();
  auto server = std::async(std::launch::async, [&, fd = a.get()] {
    EXPECT_ANY_THROW(tp::deliver_challenge(fd, kKey, in(5s)));
  });
  unsigned char hdr[4];
  tp::detail::recv_all(b.get(), hdr, 4, in(5s), "test");
  EXPECT_EQ(hdr[0], 0);
  EXPECT_EQ(hdr[1], 0);
  EXPECT_EQ(hdr[2], 0);
  EXPECT_EQ(hdr[3], 11 + 8 + 40);  // #CHALLENGE# {sha256} 40 random bytes
  std::string msg(59, '\0');
  tp::detail::recv_all(b.get(), msg.data(), msg.size(), in(5s), "test");
  EXPECT_EQ(msg.substr(0, 19), "#CHALLENGE#{sha256}");
  b.reset();  // the server's answer read ends
  server.get();
}

TEST(Auth, HexRoundTripAndKeyFile) {
  const tp::AuthKey k = tp::random_authkey(32);
  EXPECT_EQ(k.size(), 32u);
  EXPECT_EQ(tp::from_hex(tp::to_hex(k)), k);
  EXPECT_THROW(tp::from_hex("abc"), tp::Error);
  EXPECT_THROW(tp::from_hex("zz"), tp::Error);

  char dir[] = "/tmp/tp_auth_XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  ::setenv("XDG_CACHE_HOME", dir, 1);
  ::unsetenv("TORCHPAR_AUTHKEY");
  const auto k1 = tp::default_authkey();
  const auto k2 = tp::default_authkey();
  EXPECT_EQ(k1, k2);
  EXPECT_EQ(k1.size(), 32u);
  struct stat st {};
  ASSERT_EQ(::stat(tp::default_authkey_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600);
  ASSERT_EQ(::stat(fmt::format("{}/torchpar", dir).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700);
  // A key file others can read is refused.
  ::chmod(tp::default_authkey_path().c_str(), 0644);
  EXPECT_THROW(tp::default_authkey(), tp::Error);
  ::setenv("TORCHPAR_AUTHKEY", "00ff10", 1);
  EXPECT_EQ(tp::default_authkey(), (tp::AuthKey{0, 255, 16}));
  ::unsetenv("TORCHPAR_AUTHKEY");
  ::unsetenv("XDG_CACHE_HOME");
  ::unlink(tp::default_authkey_path().c_str());
  ::rmdir(fmt::format("{}/torchpar", dir).c_str());
  ::rmdir(dir);
}

TEST(Auth, KeyFromTheEnvironment) {
  ::unsetenv("TORCHPAR_AUTHKEY");
  EXPECT_FALSE(tp::authkey_from_env().has_value());
  ::setenv("TORCHPAR_AUTHKEY", "00fF10", 1);
  EXPECT_EQ(tp::authkey_from_env(), (tp::AuthKey{0, 255, 16}));
  // Set but unusable: a ValueError naming the variable, never echoing the secret.
  for (const char* bad : {"", "abc", "00zq", "0x00"}) {
    ::setenv("TORCHPAR_AUTHKEY", bad, 1);
    try {
      (void)tp::authkey_from_env();
      ADD_FAILURE() << "TORCHPAR_AUTHKEY=\"" << bad << "\" was accepted";
    } catch (const tp::ValueError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("TORCHPAR_AUTHKEY"), std::string::npos) << what;
      if (*bad) {
        EXPECT_EQ(what.find(bad), std::string::npos) << "the value leaked: " << what;
      }
    }
  }
  ::unsetenv("TORCHPAR_AUTHKEY");
}

TEST(Auth, LegacyMd5ChallengeIsAnsweredOnlyWhenAllowed) {
  // A Python <= 3.11 server's challenge: 20 random bytes, no digest prefix.
  const std::string legacy = "#CHALLENGE#" + std::string(20, 'r');
  {
    auto [a, b] = socket_pair();
    tp::send_frame(a.get(), legacy, in(5s));
    try {
      tp::answer_challenge(b.get(), kKey, in(5s));
      ADD_FAILURE() << "a legacy challenge was answered by default";
    } catch (const tp::AuthenticationError& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "legacy HMAC-MD5 challenge from a Python <= 3.11 peer: set allow_legacy_md5"),
                std::string::npos)
          << e.what();
    }
  }
  auto [a, b] = socket_pair();
  tp::send_frame(a.get(), legacy, in(5s));
  auto peer = std::async(std::launch::async, [&, fd = a.get()] {
    std::string answer = tp::recv_frame(fd, 256, in(5s));
    tp::send_frame(fd, "#WELCOME#", in(5s));
    return answer;
  });
  tp::answer_challenge(b.get(), kKey, in(5s), {.allow_legacy_md5 = true});
  const std::string answer = peer.get();
  EXPECT_EQ(answer.size(), 16u);  // a bare HMAC-MD5, as Python 3.11 expects
  EXPECT_NE(answer[0], '{');
}

TEST(Auth, LegacyMd5AnswerIsRefusedUnlessAllowed) {
  for (const bool allow : {false, true}) {
    auto [a, b] = socket_pair();
    auto server = std::async(std::launch::async, [&, fd = a.get()] {
      try {
        tp::deliver_challenge(fd, kKey, in(5s), {.allow_legacy_md5 = allow});
        return std::string("accepted");
      } catch (const tp::AuthenticationError& e) {
        return std::string(e.what());
      }
    });
    EXPECT_EQ(tp::recv_frame(b.get(), 256, in(5s)).substr(0, 19), "#CHALLENGE#{sha256}");
    tp::send_frame(b.get(), std::string(16, 'm'), in(5s));  // a bare 16-byte answer
    EXPECT_EQ(tp::recv_frame(b.get(), 256, in(5s)), "#FAILURE#");
    const std::string why = server.get();
    if (allow) {
      EXPECT_NE(why.find("digest received was wrong"), std::string::npos) << why;  // checked
    } else {
      EXPECT_NE(why.find("legacy bare HMAC-MD5 answer from a Python <= 3.11 peer: set "
                         "allow_legacy_md5"),
                std::string::npos)
          << why;
    }
  }
}

// ---- against Python ---------------------------------------------------------------------

// Debian 12's python3 is 3.11, which speaks only the legacy HMAC-MD5 form.
constexpr tp::AuthOptions kLegacyOk{.allow_legacy_md5 = true};

/// A listening loopback socket on a kernel-chosen port.
tp::UniqueFd listen_loopback(int* port) {
  tp::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  EXPECT_EQ(::listen(fd.get(), 4), 0);
  socklen_t len = sizeof(a);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return fd;
}

tp::UniqueFd connect_loopback(int port, std::chrono::seconds within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  for (;;) {
    tp::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) return fd;
    if (std::chrono::steady_clock::now() > deadline) return {};
    std::this_thread::sleep_for(20ms);
  }
}

/// Runs /usr/bin/python3 -c script args... (posix_spawn, no shell); its exit code, or -1 if
/// it did not end within `timeout` (it is killed then).
struct Python {
  pid_t pid = -1;
  Python(const std::string& script, std::vector<std::string> args) {
    std::vector<std::string> argv = {"/usr/bin/python3", "-c", script};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (auto& s : argv) cargv.push_back(s.data());
    cargv.push_back(nullptr);
    if (::posix_spawn(&pid, cargv[0], nullptr, nullptr, cargv.data(), environ) != 0) pid = -1;
  }
  int wait(std::chrono::seconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        return -1;
      }
      std::this_thread::sleep_for(10ms);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

bool have_python() { return ::access("/usr/bin/python3", X_OK) == 0; }

// The installed Python's own Client and Listener (3.11 speaks the legacy HMAC-MD5 variant,
// 3.12+ the {sha256} one; both must interoperate, as they do with each other).
constexpr const char* kPyClient = R"(
import sys
from multiprocessing.connection import Client, AuthenticationError
try:
    c = Client(('127.0.0.1', int(sys.argv[1])), authkey=bytes.fromhex(sys.argv[2]))
    c.send_bytes(b'hello from python')
    sys.exit(0)
except AuthenticationError:
    sys.exit(3)
)";

constexpr const char* kPyListener = R"(
import sys
from multiprocessing.connection import Listener, AuthenticationError
l = Listener(('127.0.0.1', 0), authkey=bytes.fromhex(sys.argv[1]))
open(sys.argv[2], 'w').write(str(l.address[1]))
try:
    c = l.accept()
    assert c.recv_bytes() == b'hello from torchpar'
    sys.exit(0)
except AuthenticationError:
    sys.exit(3)
)";

// CPython 3.12's modern variant written out by hand, checking our frames byte for byte.
constexpr const char* kPy312Peer = R"(
import hmac, os, socket, struct, sys
key = bytes.fromhex(sys.argv[2])
s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))
def recv_exact(n):
    b = b''
    while len(b) < n:
        c = s.recv(n - len(b))
        assert c, 'closed'
        b += c
    return b
def recv_frame():
    (n,) = struct.unpack('!i', recv_exact(4))
    assert 0 <= n <= 256, n
    return recv_exact(n)
def send_frame(b):
    s.sendall(struct.pack('!i', len(b)) + b)
# answer the server's challenge
m = recv_frame()
assert m.startswith(b'#CHALLENGE#{sha256}') and len(m) == 11 + 8 + 40, m
msg = m[len(b'#CHALLENGE#'):]
send_frame(b'{sha256}' + hmac.new(key, msg, 'sha256').digest())
assert recv_frame() == b'#WELCOME#'
# challenge the server
msg = b'{sha256}' + os.urandom(40)
send_frame(b'#CHALLENGE#' + msg)
r = recv_frame()
ok = r == b'{sha256}' + hmac.new(key, msg, 'sha256').digest()
send_frame(b'#WELCOME#' if ok else b'#FAILURE#')
sys.exit(0 if ok else 4)
)";

TEST(AuthPython, PythonClientWithRightKeyIsAccepted) {
  if (!have_python()) GTEST_SKIP() << "no /usr/bin/python3";
  int port = 0;
  auto l = listen_loopback(&port);
  Python py(kPyClient, {std::to_string(port), tp::to_hex(kKey)});
  tp::UniqueFd c(::accept4(l.get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(c);
  tp::auth_accept(c.get(), kKey, in(20s), kLegacyOk);
  EXPECT_EQ(tp::recv_frame(c.get(), 256, in(20s)), "hello from python");
  EXPECT_EQ(py.wait(30s), 0);
}

TEST(AuthPython, PythonClientWithWrongKeyIsRefused) {
  if (!have_python()) GTEST_SKIP() << "no /usr/bin/python3";
  int port = 0;
  auto l = listen_loopback(&port);
  Python py(kPyClient, {std::to_string(port), tp::to_hex(kOther)});
  tp::UniqueFd c(::accept4(l.get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(c);
  EXPECT_THROW(tp::auth_accept(c.get(), kKey, in(20s), kLegacyOk), tp::AuthenticationError);
  c.reset();
  EXPECT_EQ(py.wait(30s), 3);  // Python raised AuthenticationError too
}

std::string port_file_of(const char* tag) {
  return fmt::format("/tmp/tp_auth_py_{}_{}", tag, ::getpid());
}

int read_port_file(const std::string& path, std::chrono::seconds within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < deadline) {
    if (FILE* f = std::fopen(path.c_str(), "r")) {
      int port = 0;
      const int n = std::fscanf(f, "%d", &port);
      std::fclose(f);
      if (n == 1 && port > 0) return port;
    }
    std::this_thread::sleep_for(20ms);
  }
  return 0;
}

TEST(AuthPython, PythonListenerAcceptsRightKeyRefusesWrong) {
  if (!have_python()) GTEST_SKIP() << "no /usr/bin/python3";
  for (bool right : {true, false}) {
    const std::string pf = port_file_of(right ? "r" : "w");
    ::unlink(pf.c_str());
    Python py(kPyListener, {tp::to_hex(kKey), pf});
    const int port = read_port_file(pf, 30s);
    ASSERT_GT(port, 0);
    auto c = connect_loopback(port, 10s);
    ASSERT_TRUE(c);
    if (right) {
      tp::auth_connect(c.get(), kKey, in(20s), kLegacyOk);
      tp::send_frame(c.get(), "hello from torchpar", in(20s));
      EXPECT_EQ(py.wait(30s), 0);
    } else {
      EXPECT_THROW(tp::auth_connect(c.get(), kOther, in(20s), kLegacyOk), tp::AuthenticationError);
      c.reset();
      EXPECT_EQ(py.wait(30s), 3);
    }
    ::unlink(pf.c_str());
  }
}

TEST(AuthPython, Sha256VariantMatchesCPython312ByteForByte) {
  if (!have_python()) GTEST_SKIP() << "no /usr/bin/python3";
  int port = 0;
  auto l = listen_loopback(&port);
  Python py(kPy312Peer, {std::to_string(port), tp::to_hex(kKey)});
  tp::UniqueFd c(::accept4(l.get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(c);
  tp::auth_accept(c.get(), kKey, in(20s));
  EXPECT_EQ(py.wait(30s), 0);
}

}  // namespace
