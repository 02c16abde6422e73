// The manager's call channel (src/manager/shm_channel.h): calls between processes of one
// host travel through shared memory.
//   - ShmChannel alone, in two threads and in two processes (fork, spawn): ping-pong of
//     10000 messages of 0, 1, kDataBytes - 1 and kDataBytes bytes (shared memory) and of
//     1 MiB (a marker, then the socket), each checked byte for byte; a receiver that sleeps
//     is woken; a peer gone or silent ends a wait (ClosedError, TimeoutError) in time; a
//     length over the data area is a ProtocolError;
//   - a Manager with the channel: small and 4 MiB tensors through a dict, in the owner and
//     in children (the channel mapped in both processes), the same with
//     TORCHPAR_MANAGER_SHM=0 (nothing mapped);
//   - faults: a client child SIGKILLed while blocked in a Queue get (the server's wait and
//     its connection threads end, others go on); the server SIGKILLed while a call waits on
//     the channel (ClosedError naming the address within 2 s); the server SIGSTOPped (a
//     call with a 0.5 s timeout raises TimeoutError in about that time);
//   - no /dev/shm/torchpar_<pid>_<ns>_mgr* name is left, during use or after shutdown, nor
//     after its creator was SIGKILLed before unlinking it (its cleaner unlinks it).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "manager/shm_channel.h"
#include "shm/cleaner.h"
#include "support/child.h"
#include "support/manager.h"
#include "support/start_methods.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;
using tp::detail::ShmChannel;

namespace {

using tp::testing::child_options;
using tp::testing::eventually;
using tp::testing::exit_code;
using tp::testing::manager_options;
using tp::testing::require;
using tp::testing::seconds_since;

using Clock = std::chrono::steady_clock;
using TensorDict = tp::DictProxy<std::string, at::Tensor>;
using IntQueue = tp::QueueProxy<int64_t>;

constexpr int64_t kMessages = 10000;
constexpr size_t kBig = size_t{1} << 20;  // over the data area: the socket

/// Message i's size: 0, 1, kDataBytes - 1 and kDataBytes in turn; every 500th is 1 MiB.
size_t size_of(int64_t i) {
  static const size_t kSizes[] = {0, 1, ShmChannel::kDataBytes - 1, ShmChannel::kDataBytes};
  return i % 500 == 499 ? kBig : kSizes[i % 4];
}

/// Bytes that differ per message and per direction, so a message read from the wrong area
/// or a stale one does not pass.
std::string pattern(size_t n, uint64_t seed) {
  std::string s(n, '\0');
  for (size_t k = 0; k < n; ++k) s[k] = static_cast<char>((seed * 131 + k * 7 + (k >> 9)) & 0xff);
  return s;
}
std::string request_bytes(int64_t i) { return pattern(size_of(i), static_cast<uint64_t>(i)); }
std::string reply_bytes(int64_t i) {
  return pattern(size_of(i), static_cast<uint64_t>(i) ^ 0x5a5a5a5aULL);
}

tp::detail::Deadline in(std::chrono::duration<double> d) { return tp::detail::deadline_after(d); }

/// The peer of a ping-pong: answers `n` requests on the channel `name`.
void echo_peer(std::string name, tp::Connection socket, int64_t n) {
  auto channel = ShmChannel::open(name);
  for (int64_t i = 0; i < n; ++i) {
    const std::string got = channel->recv(socket, in(30s), SIZE_MAX);
    if (got != request_bytes(i)) {
      throw std::runtime_error("request " + std::to_string(i) + " arrived changed (" +
                               std::to_string(got.size()) + " bytes)");
    }
    channel->send(reply_bytes(i), socket);
  }
}

/// The creator's side of the ping-pong; unlinks the name after the first reply.
void ping_pong(ShmChannel& channel, tp::Connection& socket, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    channel.send(request_bytes(i), socket);
    const std::string got = channel.recv(socket, in(30s), SIZE_MAX);
    ASSERT_EQ(got.size(), size_of(i)) << "reply " << i;
    ASSERT_TRUE(got == reply_bytes(i)) << "reply " << i << " differs";
    if (i == 0) channel.unlink();
  }
}

bool name_exists(const std::string& name) {
  const auto names = tp::testing::shm_entries(name.substr(1));
  return std::find(names.begin(), names.end(), name.substr(1)) != names.end();
}

/// Channel names (in /dev/shm) made by process `pid`: under its file_system prefix.
std::vector<std::string> channel_names_of(int pid) {
  return tp::testing::shm_entries(tp::detail::segment_prefix(pid) + "mgr");
}

/// True when process `pid` maps a call channel (its name is unlinked, the mapping stays).
bool maps_channel(int pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("/torchpar_") != std::string::npos && line.find("_mgr") != std::string::npos)
      return true;
  }
  return false;
}

int thread_count(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

std::string error_of(const tp::Process& p) {
  const auto e = p.error();
  return e ? e->first + ": " + e->second : "";
}

/// Sets TORCHPAR_MANAGER_SHM for the scope (children started in it inherit it).
class ShmSwitch {
 public:
  explicit ShmSwitch(bool on) {
    if (const char* v = std::getenv("TORCHPAR_MANAGER_SHM")) old_ = v;
    ::setenv("TORCHPAR_MANAGER_SHM", on ? "1" : "0", 1);
  }
  ~ShmSwitch() {
    if (old_) {
      ::setenv("TORCHPAR_MANAGER_SHM", old_->c_str(), 1);
    } else {
      ::unsetenv("TORCHPAR_MANAGER_SHM");
    }
  }
  ShmSwitch(const ShmSwitch&) = delete;
  ShmSwitch& operator=(const ShmSwitch&) = delete;

 private:
  std::optional<std::string> old_;
};

/// SIGCONTs `pid` when the scope ends, whatever the test did.
struct Resume {
  int pid;
  ~Resume() { ::kill(pid, SIGCONT); }
};

// ---- ShmChannel alone ----------------------------------------------------------------------

TEST(ShmChannel, PingPongBetweenThreads) {
  auto [a, b] = tp::Pipe();
  auto creator = ShmChannel::create();
  const std::string name = creator->name();
  EXPECT_EQ(name.rfind("/" + tp::detail::segment_prefix(::getpid()) + "mgr", 0), 0u) << name;
  EXPECT_TRUE(name_exists(name));
  auto peer =
      std::async(std::launch::async, [name, b = b]() mutable { echo_peer(name, b, kMessages); });
  ping_pong(*creator, a, kMessages);
  ASSERT_EQ(peer.wait_for(60s), std::future_status::ready);
  peer.get();  // rethrows what the peer found
  EXPECT_FALSE(name_exists(name));
}

TEST(ShmChannel, ASleepingReceiverIsWoken) {
  auto [a, b] = tp::Pipe();
  auto creator = ShmChannel::create();
  auto opener = ShmChannel::open(creator->name());
  creator->unlink();
  for (int round = 0; round < 3; ++round) {
    auto late = std::async(std::launch::async, [&, b = b]() mutable {
      // Past the spin and a few futex slices: the receiver sleeps when this arrives.
      std::this_thread::sleep_for(50ms);
      opener->send("late " + std::to_string(round), b);
    });
    const auto t0 = Clock::now();
    EXPECT_EQ(creator->recv(a, in(10s), SIZE_MAX), "late " + std::to_string(round));
    EXPECT_LT(seconds_since(t0), 5.0);
    late.get();
  }
}

TEST(ShmChannel, AGonePeerOrADeadlineEndsTheWait) {
  auto [a, b] = tp::Pipe();
  auto creator = ShmChannel::create();
  auto opener = ShmChannel::open(creator->name());
  creator->unlink();
  // Nothing comes: TimeoutError at the deadline.
  auto t0 = Clock::now();
  EXPECT_THROW(creator->recv(a, in(0.3s), SIZE_MAX), tp::TimeoutError);
  EXPECT_GE(seconds_since(t0), 0.29);
  EXPECT_LT(seconds_since(t0), 3.0);
  // The peer closes its socket while this waits without a deadline: ClosedError within a
  // slice or so.
  auto closer = std::async(std::launch::async, [b = b]() mutable {
    std::this_thread::sleep_for(100ms);
    b.close();
  });
  t0 = Clock::now();
  EXPECT_THROW(creator->recv(a, std::nullopt, SIZE_MAX), tp::ClosedError);
  EXPECT_LT(seconds_since(t0), 3.0);
  closer.get();
}

TEST(ShmChannel, ALengthOverTheDataAreaIsAProtocolError) {
  auto [a, b] = tp::Pipe();
  auto creator = ShmChannel::create();
  auto opener = ShmChannel::open(creator->name());
  // A third mapping plays the corrupt peer: a length past the data area, then the bump.
  auto region = tp::detail::ShmRegion::open_named(creator->name(), /*writable=*/true,
                                                  ShmChannel::kTotalBytes);
  creator->unlink();
  auto* h = &region.as<tp::detail::ShmChannelHeader>();
  for (const uint64_t bad :
       {ShmChannel::kDataBytes + 1, uint64_t{1} << 40, ShmChannel::kOnSocket - 1}) {
    std::atomic_ref<uint64_t>(h->lanes[0].length).store(bad);
    std::atomic_ref<uint32_t>(h->lanes[0].seq).fetch_add(1);
    EXPECT_THROW(opener->recv(b, in(10s), SIZE_MAX), tp::ProtocolError) << bad;
  }
  // A channel name that is not one, and an object that is no channel, are refused.
  EXPECT_THROW(ShmChannel::open("/torchpar_x"), tp::ProtocolError);
  EXPECT_THROW(ShmChannel::open("/torchpar_mgr_0_doesnotexist"), tp::ShmError);
}

// Before: a client SIGKILLed between making its channel and unlinking the name (the server
// had not answered kAttachChannel yet) left /dev/shm/torchpar_mgr_<pid>_* (132 KiB) for
// good. Now the name is under the client's file_system prefix and the client's cleaner
// unlinks it once the client is gone.
TEST(ShmChannel, TheNameOfAKilledCreatorIsSwept) {
  tp::testing::Child c = tp::testing::fork_child([](int sock) {
    auto channel = ShmChannel::create();
    tp::testing::send_line(sock, channel->name());
    ::pause();
    return 0;
  });
  const std::string name = tp::testing::recv_line(c.sock);
  ASSERT_TRUE(name_exists(name)) << name;
  ::kill(c.pid, SIGKILL);
  EXPECT_EQ(tp::testing::wait_child(c), -SIGKILL);
  // The cleaner sees the death at once; 30 s allows for a loaded machine.
  EXPECT_TRUE(eventually([&] { return !name_exists(name); }, 30s)) << name << " left behind";
}

class ShmChannelProcesses : public ::testing::TestWithParam<std::string> {};

TEST_P(ShmChannelProcesses, PingPong) {
  auto [mine, theirs] = tp::Pipe();
  auto channel = ShmChannel::create();
  const std::string name = channel->name();
  tp::Process peer(child_options(GetParam()), echo_peer, name, theirs, kMessages);
  peer.start();
  theirs.close();  // so that the peer's death shows on `mine`
  ping_pong(*channel, mine, kMessages);
  EXPECT_FALSE(name_exists(name));
  EXPECT_EQ(exit_code(peer), 0) << error_of(peer);
}

TEST_P(ShmChannelProcesses, APeerKilledMidWaitIsSeen) {
  auto [mine, theirs] = tp::Pipe();
  auto channel = ShmChannel::create();
  // The peer awaits one more request than it gets: SIGKILLed while it waits.
  tp::Process peer(child_options(GetParam()), echo_peer, channel->name(), theirs, int64_t{2});
  peer.start();
  theirs.close();
  channel->send(request_bytes(0), mine);
  EXPECT_EQ(channel->recv(mine, in(30s), SIZE_MAX), reply_bytes(0));
  channel->unlink();
  peer.kill();
  const auto t0 = Clock::now();
  EXPECT_THROW(channel->recv(mine, in(30s), SIZE_MAX), tp::ClosedError);
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_EQ(exit_code(peer), -SIGKILL);
}

INSTANTIATE_TEST_SUITE_P(PeerStart, ShmChannelProcesses, ::testing::Values("fork", "spawn"),
                         tp::testing::start_method_name);

// ---- a Manager with (and without) the channel -----------------------------------------------

/// Small tensors (the channel) and 4 MiB ones (the socket) through `d`, checked.
void tensors_through(TensorDict d, std::string prefix) {
  for (int64_t i = 0; i < 200; ++i) {
    const at::Tensor t = at::arange(16, at::kLong) + i;
    d.set(prefix + std::to_string(i), t);
    const auto back = d.get(prefix + std::to_string(i));
    require(back && at::equal(*back, t), "small tensor " + std::to_string(i) + " changed");
  }
  for (int64_t i = 0; i < 3; ++i) {
    const at::Tensor big = at::arange(int64_t{1} << 20, at::kFloat) * static_cast<float>(i + 1);
    d.set(prefix + "big" + std::to_string(i), big);
    const auto back = d.get(prefix + "big" + std::to_string(i));
    require(back && at::equal(*back, big), "4 MiB tensor " + std::to_string(i) + " changed");
  }
}

/// A child client: the tensors, then whether it maps a channel as `expect_channel` says.
void tensor_child(TensorDict d, std::string prefix, bool expect_channel) {
  tensors_through(d, prefix);
  require(maps_channel(::getpid()) == expect_channel,
          expect_channel ? "the child's calls used no channel" : "the child mapped a channel");
}

class ManagerChannel : public ::testing::TestWithParam<std::string> {};

TEST_P(ManagerChannel, SmallAndLargeTensorsWithTheChannelOnAndOff) {
  for (const bool on : {true, false}) {
    SCOPED_TRACE(on ? "channel on" : "TORCHPAR_MANAGER_SHM=0");
    ShmSwitch shm(on);
    tp::Manager m(manager_options());
    TensorDict d = m.dict<std::string, at::Tensor>();
    ASSERT_NO_THROW(tensors_through(d, "owner"));
    EXPECT_EQ(maps_channel(m.pid()), on) << "the server's maps";
    tp::Process child(child_options(GetParam()), tensor_child, d, std::string("child"), on);
    child.start();
    EXPECT_EQ(exit_code(child), 0) << error_of(child);
    EXPECT_EQ(d.size(), 2 * 203u);
    EXPECT_TRUE(at::equal(*d.get("child7"), at::arange(16, at::kLong) + 7));
    EXPECT_TRUE(channel_names_of(::getpid()).empty());
    EXPECT_TRUE(channel_names_of(child.pid()).empty());
    m.shutdown();
  }
}

/// Blocks in a Queue get until SIGKILLed.
void blocked_get(IntQueue q) { q.get(true, 60s); }

/// Takes a few calls, concurrently with the kill.
void live_client(TensorDict d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d.set("live" + std::to_string(i), at::full({4}, i, at::kLong));
}

// A queue proxy that can also call the served queue's debugging method.
struct RawQueue : IntQueue {
  explicit RawQueue(const IntQueue& q) : IntQueue(q) {}
  int64_t n_getters() const { return decode<int64_t>(call_method("_n_getters", {})); }
};

TEST_P(ManagerChannel, AClientKilledInABlockingCallEndsItsServerThreads) {
  tp::Manager m(manager_options());
  auto q = m.Queue<int64_t>();
  RawQueue raw(q);
  TensorDict d = m.dict<std::string, at::Tensor>();
  ASSERT_EQ(raw.n_getters(), 0);  // this process's one call connection exists now
  const int threads_before = thread_count(m.pid());
  ASSERT_GT(threads_before, 0);

  tp::Process doomed(child_options(GetParam()), blocked_get, q);
  doomed.start();
  ASSERT_TRUE(eventually([&] { return raw.n_getters() == 1; }));
  EXPECT_GT(thread_count(m.pid()), threads_before);  // the child's connections
  tp::Process live(child_options(GetParam()), live_client, d, int64_t{300});
  live.start();
  doomed.kill();
  EXPECT_EQ(exit_code(doomed), -SIGKILL);
  EXPECT_EQ(exit_code(live), 0) << error_of(live);
  EXPECT_EQ(d.size(), 300u);

  // The dead getter's wait in the server ends (it takes nothing), and so do the threads of
  // both children's connections.
  EXPECT_TRUE(eventually([&] { return raw.n_getters() == 0; }, 10s));
  EXPECT_TRUE(eventually([&] { return thread_count(m.pid()) <= threads_before; }, 10s))
      << thread_count(m.pid()) << " threads, " << threads_before << " before";
  q.put(5);
  EXPECT_EQ(q.get(true, 10s), 5);
  EXPECT_TRUE(channel_names_of(doomed.pid()).empty());
}

TEST_P(ManagerChannel, ServerKilledWhileACallWaitsOnTheChannel) {
  tp::ManagerOptions o = manager_options();
  o.start_method = tp::start_method_from_string(GetParam());
  tp::Manager m(o);
  auto q = m.Queue<int64_t>();
  RawQueue raw(q);
  EXPECT_EQ(q.qsize(), 0);  // the first call opens a call connection and its channel
  ASSERT_TRUE(maps_channel(m.pid()));
  auto pending = std::async(std::launch::async, [&] {
    try {
      q.get(true, 60s);
    } catch (const tp::ClosedError& e) {
      return std::make_pair(std::string(e.what()), Clock::now());
    } catch (const std::exception& e) {
      return std::make_pair("not a ClosedError: " + std::string(e.what()), Clock::now());
    }
    return std::make_pair(std::string("no error"), Clock::now());
  });
  ASSERT_TRUE(eventually([&] { return raw.n_getters() == 1; }));
  const auto killed_at = Clock::now();
  ASSERT_EQ(::kill(m.pid(), SIGKILL), 0);
  ASSERT_EQ(pending.wait_for(20s), std::future_status::ready);
  const auto [message, failed_at] = pending.get();
  EXPECT_NE(message.find(m.address()), std::string::npos) << message;
  EXPECT_NE(message.find("is gone"), std::string::npos) << message;
  EXPECT_LT(std::chrono::duration<double>(failed_at - killed_at).count(), 2.0);
  // Later calls fail at once too.
  EXPECT_THROW(q.qsize(), tp::ClosedError);
}

TEST_P(ManagerChannel, AStoppedServerTimesOut) {
  tp::ManagerOptions o = manager_options();
  o.start_method = tp::start_method_from_string(GetParam());
  o.timeout = 0.5s;
  tp::Manager m(o);
  auto d = m.dict<std::string, int64_t>();
  d.set("x", 1);  // the call connection and its channel exist now
  ASSERT_TRUE(maps_channel(m.pid()));
  {
    Resume resume{m.pid()};
    ASSERT_EQ(::kill(m.pid(), SIGSTOP), 0);
    ASSERT_TRUE(eventually([&] { return tp::testing::proc_state(m.pid()) == 'T'; }, 10s));
    const auto t0 = Clock::now();
    EXPECT_THROW(d.get("x"), tp::TimeoutError);
    const double took = seconds_since(t0);
    EXPECT_GE(took, 0.45);
    EXPECT_LT(took, 2.5);
  }
  // Running again: a new call connection serves, and the server shuts down.
  EXPECT_TRUE(eventually([&] { return tp::testing::proc_state(m.pid()) != 'T'; }, 10s));
  EXPECT_EQ(d.get("x"), std::optional<int64_t>(1));
  m.shutdown();
}

/// Calls from several threads at once (several call connections, each with a channel).
void concurrent_calls(TensorDict d, std::string prefix) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([d, prefix, t]() mutable {
      for (int64_t i = 0; i < 50; ++i) {
        d.set(prefix + std::to_string(t) + "_" + std::to_string(i), at::full({2}, i, at::kLong));
      }
    });
  }
  for (auto& th : threads) th.join();
}

TEST_P(ManagerChannel, NoChannelNameIsLeftBehind) {
  std::vector<int> clients{::getpid()};
  {
    tp::Manager m(manager_options());
    TensorDict d = m.dict<std::string, at::Tensor>();
    concurrent_calls(d, "owner");
    tp::Process child(child_options(GetParam()), concurrent_calls, d, std::string("child"));
    child.start();
    EXPECT_EQ(exit_code(child), 0) << error_of(child);
    clients.push_back(child.pid());
    EXPECT_EQ(d.size(), 400u);
    // In use: every name is unlinked as soon as the server has it mapped.
    for (int pid : clients) EXPECT_TRUE(channel_names_of(pid).empty()) << pid;
    EXPECT_TRUE(maps_channel(m.pid()));
    m.shutdown();
  }
  for (int pid : clients) EXPECT_TRUE(channel_names_of(pid).empty()) << pid;
  EXPECT_FALSE(maps_channel(::getpid())) << "a channel outlived the manager's shutdown";
}

INSTANTIATE_TEST_SUITE_P(Start, ManagerChannel, ::testing::Values("fork", "spawn"),
                         tp::testing::start_method_name);

}  // namespace

int main(int argc, char** argv) { return tp::testing::manager_test_main(argc, argv); }
