// Rendezvous as a hostile network and a dying rank 0 would try it: the store listens on
// loopback only for a one-host job; a stray client that sends one byte and stalls delays no
// one; a client with the wrong key is refused and cannot take a rank; a huge length is
// refused without allocating; rank 0 (the store's host) SIGKILLed during or after the
// rendezvous, or mid-collective, makes the others raise a torchpar error naming rank 0 within
// the timeout, and no thread keeps burning CPU afterwards.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "dist/store.h"
#include "support/child.h"
#include "support/ranks.h"
#include "support/run_tests.h"
#include "torchpar/dist/launch_env.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using tp::testing::free_port;
using namespace std::chrono_literals;

namespace {

const tp::AuthKey kKey = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
const tp::AuthKey kWrongKey = {9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9};

tp::World make_world(int rank, int world, int port, double timeout, const tp::AuthKey& key = kKey) {
  // The key travels in the environment as `torchpar run` passes it (the old code ignores it).
  ::setenv("TORCHPAR_AUTHKEY", tp::to_hex(key).c_str(), 1);
  return tp::World(tp::WorldOptions{.rank = rank,
                                    .world_size = world,
                                    .master_addr = "127.0.0.1",
                                    .master_port = port,
                                    .timeout = std::chrono::duration<double>(timeout)});
}

/// Sockets in state `st` (hex, "0A" LISTEN, "01" ESTABLISHED) with local port `port`, as
/// "addr" hex strings from /proc/net/tcp and /proc/net/tcp6.
std::vector<std::string> sockets_on(int port, const char* st) {
  std::vector<std::string> out;
  for (const char* f : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(f);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::string sl, local, remote, state;
      ls >> sl >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (colon == std::string::npos) continue;
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port && state == st) {
        out.push_back(local.substr(0, colon));
      }
    }
  }
  return out;
}

/// CPU seconds (user + system) from a /proc stat line (fields 14 and 15).
double stat_cpu_seconds(const std::string& stat_path) {
  std::ifstream in(stat_path);
  std::string s;
  std::getline(in, s);
  const auto paren = s.rfind(')');
  if (paren == std::string::npos) return 0;
  std::istringstream rest(s.substr(paren + 2));
  std::string f;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> f; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(f);
  }
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

/// CPU seconds of each thread of this process now: "name (tid)" -> seconds.
std::map<std::string, double> thread_cpu_seconds() {
  std::map<std::string, double> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(e.path() / "comm");
    std::string name;
    std::getline(comm, name);
    out[fmt::format("{} ({})", name, e.path().filename().string())] =
        stat_cpu_seconds((e.path() / "stat").string());
  }
  return out;
}

/// No thread of this process keeps a core busy: CPU used over a 1 s idle window stays under
/// 0.15 s (a spinning thread uses about 1 s). A window over it is measured again once (work still
/// ending right after an error, on a loaded machine, can take one window); the error names the
/// busiest threads.
void expect_idle(const char* when) {
  double used = 0;
  std::string busiest;
  for (int window = 0; window < 2; ++window) {
    const auto before = thread_cpu_seconds();
    std::this_thread::sleep_for(1s);
    const auto after = thread_cpu_seconds();
    used = 0;
    std::vector<std::pair<double, std::string>> by_thread;
    for (const auto& [name, seconds] : after) {
      const auto b = before.find(name);
      const double d = seconds - (b == before.end() ? 0.0 : b->second);
      used += d;
      by_thread.emplace_back(d, name);
    }
    if (used < 0.15) return;
    std::sort(by_thread.rbegin(), by_thread.rend());
    busiest.clear();
    for (size_t i = 0; i < by_thread.size() && i < 3; ++i)
      busiest +=
          fmt::format("{}{} {:.2f} s", i ? ", " : "", by_thread[i].second, by_thread[i].first);
  }
  TORCHPAR_RCHECK(false, "{}: {:.2f} s of CPU used in 1 s of idling, twice (a thread spins: {})",
                  when, used, busiest);
}

tp::UniqueFd connect_when_listening(int port, std::chrono::seconds within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < deadline) {
    tp::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) return fd;
    std::this_thread::sleep_for(20ms);
  }
  return {};
}

// ---- the store binds loopback ------------------------------------------------------------

void loopback_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port, 30);
  if (rank == 0) {
    const auto listening = sockets_on(port, "0A");
    TORCHPAR_RCHECK(!listening.empty(), "nothing listens on port {}", port);
    for (const auto& a : listening) {
      // 127.0.0.1 in /proc/net/tcp's byte order; ::1 in tcp6's
      TORCHPAR_RCHECK(a == "0100007F" || a == "00000000000000000000000001000000",
                      "the store listens on {} (hex), not on loopback only", a);
    }
  }
  auto g = w.create_collective_group({}, tp::Backend::kGloo);
  auto t = at::ones({4});
  g.all_reduce(t);
  TORCHPAR_RCHECK(t[0].item<float>() == world, "all_reduce");
}

TEST(RendezvousSecurity, StoreListensOnLoopbackForOneHostJob) {
  auto res = tp::testing::run_ranks(2, 60, &loopback_rank, 2, free_port());
  for (auto& r : res) EXPECT_EQ(r.exitcode, 0) << r.error;
}

// ---- a stray client that sends one byte and stalls ---------------------------------------

void quick_rank(int rank, int world, int port) {
  auto w = make_world(rank, world, port, 5);
  auto g = w.create_collective_group({}, tp::Backend::kGloo);
  auto t = at::ones({4});
  g.all_reduce(t);
  TORCHPAR_RCHECK(t[0].item<float>() == world, "all_reduce");
}

TEST(RendezvousSecurity, StalledStrayClientDelaysNoOne) {
  const int port = free_port();
  tp::Process r0(tp::ProcessOptions{.start_method = tp::StartMethod::kFork}, &quick_rank, 0, 3,
                 port);
  r0.start();
  auto stray = connect_when_listening(port, 20s);
  ASSERT_TRUE(stray) << "rank 0 never listened";
  // One byte, then silence (c10d TCPStore reads it as a SET and blocks for the rest).
  ASSERT_EQ(::send(stray.get(), "\0", 1, MSG_NOSIGNAL), 1);
  std::vector<tp::Process> others;
  for (int r = 1; r < 3; ++r) {
    others.emplace_back(tp::ProcessOptions{.start_method = tp::StartMethod::kFork}, &quick_rank, r,
                        3, port);
    others.back().start();
  }
  // 5 s timeout: well within 30 s unless the stray blocks the store (it took 11-45 s and
  // ended in std::terminate with c10d's TCPStore).
  ASSERT_TRUE(r0.join(30s)) << "rank 0 hung";
  EXPECT_EQ(r0.exitcode(), 0) << (r0.error() ? r0.error()->second : "");
  for (auto& p : others) {
    if (!p.join(30s)) {
      p.kill();
      p.join(5s);
      ADD_FAILURE() << "a rank hung";
      continue;
    }
    EXPECT_EQ(p.exitcode(), 0) << (p.error() ? p.error()->second : "");
  }
}

// ---- a client with the wrong key ---------------------------------------------------------

void stranger_rank(int rank, int world, int port) {
  try {
    auto w = make_world(rank, world, port, 5, kWrongKey);
  } catch (const tp::AuthenticationError& e) {
    return;  // refused, as it should be
  }
  throw std::runtime_error("a rank with the wrong key joined the World");
}

TEST(RendezvousSecurity, WrongKeyIsRefusedAndCannotTakeARank) {
  const int port = free_port();
  tp::Process r0(tp::ProcessOptions{.start_method = tp::StartMethod::kFork}, &quick_rank, 0, 2,
                 port);
  r0.start();
  ASSERT_TRUE(connect_when_listening(port, 20s)) << "rank 0 never listened";
  tp::Process stranger(tp::ProcessOptions{.start_method = tp::StartMethod::kFork}, &stranger_rank,
                       1, 2, port);
  stranger.start();
  ASSERT_TRUE(stranger.join(30s)) << "the stranger hung";
  EXPECT_EQ(stranger.exitcode(), 0) << (stranger.error() ? stranger.error()->second : "");
  // The real rank 1 still gets its place (no "joined twice").
  tp::Process r1(tp::ProcessOptions{.start_method = tp::StartMethod::kFork}, &quick_rank, 1, 2,
                 port);
  r1.start();
  ASSERT_TRUE(r1.join(30s));
  ASSERT_TRUE(r0.join(30s));
  EXPECT_EQ(r1.exitcode(), 0) << (r1.error() ? r1.error()->second : "");
  EXPECT_EQ(r0.exitcode(), 0) << (r0.error() ? r0.error()->second : "");
}

// ---- huge lengths ------------------------------------------------------------------------

long vm_hwm_kib(int pid) {
  std::ifstream in(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

/// Sends `bytes` on an authenticated connection; true if the server then closes it.
bool server_closes_after(int port, const std::string& bytes) {
  auto fd = connect_when_listening(port, 20s);
  if (!fd) return false;
  tp::auth_connect(fd.get(), kKey, std::chrono::steady_clock::now() + 10s);
  ::send(fd.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
  char c;
  try {
    tp::detail::recv_all(fd.get(), &c, 1, std::chrono::steady_clock::now() + 10s, "test");
  } catch (const tp::ClosedError&) {
    return true;
  }
  return false;
}

TEST(RendezvousSecurity, HugeLengthsAreRefusedWithoutAllocating) {
  const int port = free_port();
  tp::Process r0(tp::ProcessOptions{.start_method = tp::StartMethod::kFork}, &quick_rank, 0, 2,
                 port);
  r0.start();
  ASSERT_TRUE(connect_when_listening(port, 20s)) << "rank 0 never listened";
  const long before = vm_hwm_kib(r0.pid());
  // A frame announcing 512 MiB.
  EXPECT_TRUE(server_closes_after(port, std::string("\x20\x00\x00\x00", 4)));
  // A small frame whose key claims 512 MiB (set: command 1, key length, ...).
  std::string f("\x00\x00\x00\x10\x01\x20\x00\x00\x00", 9);
  f.append(11, 'k');
  EXPECT_TRUE(server_closes_after(port, f));
  const long after = vm_hwm_kib(r0.pid());
  EXPECT_LT(after - before, 64 * 1024)
      << "rank 0's peak memory grew by " << (after - before) << " KiB";
  // The store still serves the real rank.
  tp::Process r1(tp::ProcessOptions{.start_method = tp::StartMethod::kFork}, &quick_rank, 1, 2,
                 port);
  r1.start();
  ASSERT_TRUE(r1.join(30s));
  ASSERT_TRUE(r0.join(30s));
  EXPECT_EQ(r1.exitcode(), 0) << (r1.error() ? r1.error()->second : "");
  EXPECT_EQ(r0.exitcode(), 0) << (r0.error() ? r0.error()->second : "");
}

// ---- rank 0 dies -------------------------------------------------------------------------

/// The error must be in the torchpar family, name rank 0 and come within the timeout.
void check_rank0_error(const tp::Error& e, std::chrono::steady_clock::time_point t0, double limit) {
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string msg = e.what();
  TORCHPAR_RCHECK(msg.find("rank 0") != std::string::npos, "the error does not name rank 0: {}",
                  msg);
  TORCHPAR_RCHECK(s < limit, "raised after {:.1f} s (limit {:.1f} s): {}", s, limit, msg);
}

/// World built; rank 0 dies; the others use the store (group creation) and must raise.
void rank0_dies_after_rendezvous(int rank, int world, int port, std::string backend) {
  std::optional<tp::World> w;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    // Rank 0 returns first; the others may still be reading the rendezvous when it dies.
    w.emplace(make_world(rank, world, port, 8));
    if (rank == 0) ::raise(SIGKILL);
    auto g = w->create_collective_group({}, tp::backend_from_string(backend));
    auto t = at::ones({4});
    g.all_reduce(t);
  } catch (const tp::Error& e) {
    check_rank0_error(e, t0, 8 + 5);
    expect_idle("after the error, World alive");
    if (w) w->destroy();
    expect_idle("after destroy");
    return;
  }
  throw std::runtime_error("group creation without rank 0 did not throw");
}

/// A collective in flight when rank 0 dies.
void rank0_dies_in_collective(int rank, int world, int port, std::string backend) {
  auto w = make_world(rank, world, port, 8);
  auto g = w.create_collective_group({}, tp::backend_from_string(backend), 8.0s);
  auto t = at::ones({1000});
  g.all_reduce(t);  // everyone is up
  if (rank == 0) ::raise(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    g.all_reduce(t);
    g.all_reduce(t);
  } catch (const tp::Error& e) {
    check_rank0_error(e, t0, 8 + 5);
    expect_idle("after the error, group alive");
    g.destroy();
    w.destroy();
    expect_idle("after destroy");
    return;
  }
  throw std::runtime_error("all_reduce without rank 0 did not throw");
}

/// Runs `rank_fn` as 3 ranks on gloo and on shm: rank 0 must die by SIGKILL and ranks 1
/// and 2 return normally (each checks inside that it raised RankLostError naming rank 0).
void expect_rank_zero_lost(void (*rank_fn)(int, int, int, std::string)) {
  for (std::string backend : {"gloo", "shm"}) {
    auto res = tp::testing::run_ranks(3, 60, rank_fn, 3, free_port(), backend);
    EXPECT_EQ(res[0].exitcode, -SIGKILL) << backend;
    EXPECT_EQ(res[1].exitcode, 0) << backend << ": " << res[1].error;
    EXPECT_EQ(res[2].exitcode, 0) << backend << ": " << res[2].error;
  }
}

TEST(RankZeroLost, AfterRendezvousOthersRaiseNamingRankZero) {
  expect_rank_zero_lost(&rank0_dies_after_rendezvous);
}

TEST(RankZeroLost, MidCollectiveOthersRaiseNamingRankZero) {
  expect_rank_zero_lost(&rank0_dies_in_collective);
}

/// Rank 1 waits in the rendezvous for rank 2, which never comes; rank 0 is SIGKILLed then.
TEST(RankZeroLost, DuringRendezvousTheWaitingRankRaises) {
  const int port = free_port();
  tp::Process r0(
      tp::ProcessOptions{.start_method = tp::StartMethod::kFork},
      +[](int p) { make_world(0, 3, p, 8); }, port);
  r0.start();
  ASSERT_TRUE(connect_when_listening(port, 20s)) << "rank 0 never listened";
  tp::Process r1(
      tp::ProcessOptions{.start_method = tp::StartMethod::kFork},
      +[](int p) {
        const auto t0 = std::chrono::steady_clock::now();
        try {
          make_world(1, 3, p, 8);
        } catch (const tp::Error& e) {
          check_rank0_error(e, t0, 8 + 5);
          expect_idle("after the error");
          return;
        }
        throw std::runtime_error("the World was built without rank 2");
      },
      port);
  r1.start();
  // Ask the store (as a client with the key) to wait for rank 1's announcement: then rank 1
  // has joined and waits for rank 2. Kill rank 0 at that point.
  {
    auto fd = connect_when_listening(port, 20s);
    ASSERT_TRUE(fd);
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    tp::auth_connect(fd.get(), kKey, deadline);
    const std::string key = "torchpar/world/rank/1";
    std::string req("\x06\x00\x00\x00\x01", 5);  // wait, one key
    req += std::string("\x00\x00\x00", 3) + static_cast<char>(key.size()) + key;
    req += std::string("\x00\x00\x00\x00\x00\x00\x4e\x20", 8);  // 20000 ms
    std::string msg = std::string("\x00\x00\x00", 3) + static_cast<char>(req.size()) + req;
    tp::detail::send_all(fd.get(), msg.data(), msg.size(), deadline, "test");
    char reply[5];
    tp::detail::recv_all(fd.get(), reply, 5, deadline, "test");
    ASSERT_EQ(reply[4], 0) << "rank 1 did not join";
  }
  r0.kill();
  ASSERT_TRUE(r0.join(10s));
  ASSERT_TRUE(r1.join(40s)) << "rank 1 hung";
  EXPECT_EQ(r1.exitcode(), 0) << (r1.error() ? r1.error()->second : "");
}

}  // namespace

// launch_env() reads the launcher's variables with World's parser (`torchpar train` decides
// from it whether it is one rank of a job): values, defaults, and each refusal naming the
// variables.
TEST(LaunchEnv, ReadsChecksAndNamesTheVariables) {
  const char* names[] = {"RANK",        "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT"};
  std::map<std::string, std::optional<std::string>> saved;
  for (const char* n : names) {
    if (const char* v = std::getenv(n))
      saved[n] = v;
    else
      saved[n] = std::nullopt;
  }
  // Sets the six variables ("-": unset) and returns launch_env()'s ValueError message, or "".
  std::optional<tp::LaunchEnv> got;
  auto with = [&](std::vector<const char*> values) -> std::string {
    for (size_t i = 0; i < values.size(); ++i) {
      if (std::string_view(values[i]) == "-")
        ::unsetenv(names[i]);
      else
        ::setenv(names[i], values[i], 1);
    }
    try {
      got = tp::launch_env();
    } catch (const tp::ValueError& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  EXPECT_EQ(with({"-", "-", "-", "-", "-", "-"}), "");
  EXPECT_FALSE(got);
  EXPECT_EQ(with({"3", "4", "-", "-", "10.0.0.1", "29500"}), "");
  ASSERT_TRUE(got);
  EXPECT_EQ(got->rank, 3);
  EXPECT_EQ(got->world_size, 4);
  EXPECT_EQ(got->local_rank, 3);  // LOCAL_* default to the global ones
  EXPECT_EQ(got->local_world_size, 4);
  EXPECT_EQ(got->master_addr, "10.0.0.1");
  EXPECT_EQ(got->master_port, 29500);
  EXPECT_EQ(with({"3", "4", "1", "2", "h", "1"}), "");
  EXPECT_EQ(got->local_rank, 1);
  EXPECT_EQ(got->local_world_size, 2);
  EXPECT_NE(with({"0", "-", "-", "-", "h", "1"})
                .find("RANK is set in the environment but "
                      "WORLD_SIZE is not"),
            std::string::npos);
  EXPECT_NE(with({"zero", "2", "-", "-", "h", "1"}).find("must be whole numbers (RANK='zero'"),
            std::string::npos);
  EXPECT_NE(with({"2", "2", "-", "-", "h", "1"}).find("RANK=2 and WORLD_SIZE=2"),
            std::string::npos);
  EXPECT_NE(with({"0", "2", "-", "-", "-", "1"}).find("MASTER_ADDR=unset, MASTER_PORT='1'"),
            std::string::npos);
  EXPECT_NE(with({"0", "2", "-", "-", "h", "65536"}).find("MASTER_ADDR='h', MASTER_PORT='65536'"),
            std::string::npos);
  EXPECT_NE(with({"0", "2", "x", "-", "h", "1"}).find("LOCAL_RANK must be a whole number"),
            std::string::npos);
  for (const auto& [n, v] : saved) {
    if (v)
      ::setenv(n.c_str(), v->c_str(), 1);
    else
      ::unsetenv(n.c_str());
  }
}

// The store server's commands, each answered as c10d's TCPStore does (src/dist/store.cpp).
TEST(StoreServer, EveryCommandAnswersAsTCPStoreDoes) {
  using Bytes = std::vector<uint8_t>;
  auto bytes = [](const std::string& s) { return Bytes(s.begin(), s.end()); };
  const tp::AuthKey key = "store-test";
  tp::detail::StoreServer server("127.0.0.1", 0, key, std::chrono::milliseconds(5000));
  tp::detail::StoreClient s("127.0.0.1", server.port(), key, std::chrono::milliseconds(10000));
  s.set("a", bytes("1"));
  EXPECT_EQ(s.get("a"), bytes("1"));
  EXPECT_EQ(s.add("n", 5), 5);
  EXPECT_EQ(s.add("n", -2), 3);
  EXPECT_EQ(s.get("n"), bytes("3"));
  // compareSet: a missing key is created only when `expected` is empty.
  EXPECT_EQ(s.compareSet("c", bytes("x"), bytes("y")), bytes("x"));
  EXPECT_FALSE(s.check({"c"}));
  EXPECT_EQ(s.compareSet("c", {}, bytes("y")), bytes("y"));
  EXPECT_EQ(s.compareSet("c", bytes("nope"), bytes("z")), bytes("y"));
  EXPECT_EQ(s.compareSet("c", bytes("y"), bytes("z")), bytes("z"));
  EXPECT_TRUE(s.check({"a", "n", "c"}));
  EXPECT_FALSE(s.check({"a", "missing"}));
  EXPECT_EQ(s.getNumKeys(), 3);
  EXPECT_TRUE(s.deleteKey("a"));
  EXPECT_FALSE(s.deleteKey("a"));
  EXPECT_EQ(s.getNumKeys(), 2);
  s.wait({"n", "c"}, std::chrono::milliseconds(1000));
  EXPECT_THROW(s.wait({"never"}, std::chrono::milliseconds(50)), tp::TimeoutError);
  // A get waits for a key another client sets.
  std::thread setter([&] {
    tp::detail::StoreClient other("127.0.0.1", server.port(), key,
                                  std::chrono::milliseconds(10000));
    other.set("late", bytes("v"));
  });
  EXPECT_EQ(s.get("late"), bytes("v"));
  setter.join();
}

// An ephemeral key (an elastic agent's liveness) lives as long as the connection that set
// it: another client sees it, and sees it gone once that connection ends; plain keys of the
// same connection stay.
TEST(StoreServer, EphemeralKeyGoesWithItsConnection) {
  using Bytes = std::vector<uint8_t>;
  const tp::AuthKey key = "store-test";
  tp::detail::StoreServer server("127.0.0.1", 0, key, std::chrono::milliseconds(5000));
  tp::detail::StoreClient watcher("127.0.0.1", server.port(), key,
                                  std::chrono::milliseconds(10000));
  {
    tp::detail::StoreClient agent("127.0.0.1", server.port(), key,
                                  std::chrono::milliseconds(10000));
    agent.set_ephemeral("conn/a", Bytes{'1'});
    agent.set("plain", Bytes{'2'});
    EXPECT_TRUE(watcher.check({"conn/a", "plain"}));
  }
  const auto by = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (watcher.check({"conn/a"}) && std::chrono::steady_clock::now() < by)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_FALSE(watcher.check({"conn/a"}));
  EXPECT_TRUE(watcher.check({"plain"}));
}

int main(int argc, char** argv) {
  tp::init(argc, argv);
  return torchpar::testing::run_tests(argc, argv);
}
