// Pipe/Connection and Queue/SimpleQueue/JoinableQueue across real processes, under the
// fork and spawn start methods: tensors shared and copied, timeouts, close, many
// producers and consumers, killed consumers, and resource hygiene.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <atomic>
#include <future>
#include <set>
#include <thread>

#include "ipc/pipe_mailbox.h"
#include "serialize/fd_elision.h"
#include "support/child.h"
#include "support/run_tests.h"
#include "support/start_methods.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

void echo_connection(tp::Connection c) {
  for (;;) {
    auto t = c.recv<at::Tensor>(30s);
    if (t.numel() == 0) return;
    t.add_(1);  // shared: the parent sees this
    c.send(std::string("ok"));
  }
}

void queue_modify(tp::Queue<at::Tensor> in, tp::Queue<std::string> out) {
  at::Tensor t = in.get(30s);
  t.fill_(7);
  out.put("modified");
}

void producer(int i, tp::Queue<int64_t> q, int n) {
  for (int k = 0; k < n; ++k) q.put(int64_t{i} * 1000000 + k);
}

void consumer(int, tp::Queue<int64_t> q, tp::Queue<std::vector<int64_t>> results) {
  std::vector<int64_t> got;
  for (;;) {
    const int64_t v = q.get(60s);
    if (v < 0) break;
    got.push_back(v);
  }
  results.put(got);
}

void blocked_getter(int, tp::Queue<int> q, tp::Queue<std::string> out, tp::Event started) {
  started.set();
  try {
    q.get(30s);
    out.put("got");
  } catch (const tp::ClosedError&) {
    out.put("closed");
  }
}

void simple_echo(int, tp::SimpleQueue<int> in, tp::SimpleQueue<int> out) {
  out.put(in.get(30s) + 1);
}

// SimpleQueue offers Python's SimpleQueue calls and no more (before: every Queue member).
template <class Q>
concept HasQsize = requires(Q q) {
  q.qsize();
};
template <class Q>
concept HasNowait = requires(Q q) {
  q.get_nowait();
};
template <class Q>
concept HasFull = requires(Q q) {
  q.full();
};
static_assert(HasQsize<tp::Queue<int>> && !HasQsize<tp::SimpleQueue<int>>);
static_assert(!HasNowait<tp::SimpleQueue<int>> && !HasFull<tp::SimpleQueue<int>>);

void joinable_worker(int i, tp::JoinableQueue<int> q, at::Tensor acc) {
  for (;;) {
    int v = q.get(30s);
    if (v < 0) {
      q.task_done();
      return;
    }
    acc[i].add_(v);  // one slot per worker: no lost updates
    q.task_done();
  }
}

// Runs `producers` x `per` items through `q` into `consumers` consumer processes and
// checks that every item arrived exactly once.
void check_producers_consumers(tp::Queue<int64_t> q, int producers, int consumers, int per,
                               tp::SpawnOptions o) {
  tp::Queue<std::vector<int64_t>> results;
  o.join = false;
  auto cons = tp::start_processes(consumer, std::make_tuple(q, results), consumers, o);
  auto prod = tp::start_processes(producer, std::make_tuple(q, per), producers, o);
  EXPECT_TRUE(prod.join(120s));
  for (int i = 0; i < consumers; ++i) q.put(-1);
  std::multiset<int64_t> all;
  for (int i = 0; i < consumers; ++i)
    for (auto v : results.get(60s)) all.insert(v);
  EXPECT_TRUE(cons.join(60s));
  ASSERT_EQ(all.size(), static_cast<size_t>(producers * per));
  for (int i = 0; i < producers; ++i)
    for (int k = 0; k < per; ++k) EXPECT_EQ(all.count(int64_t{i} * 1000000 + k), 1u);
}

}  // namespace

class Ipc : public tp::testing::StartMethodTest {};

TEST_P(Ipc, PipeCarriesSharedTensors) {
  auto [a, b] = tp::Pipe();
  auto ctx = tp::start_processes([](int, tp::Connection c) { echo_connection(c); },
                                 std::make_tuple(b), 1, opts(false));
  at::Tensor t = at::zeros({1000});
  for (int i = 1; i <= 3; ++i) {
    a.send(t);
    EXPECT_EQ(a.recv<std::string>(30s), "ok");
    EXPECT_EQ(t[0].item<float>(), static_cast<float>(i));
  }
  a.send(at::empty({0}));
  EXPECT_TRUE(ctx.join(30s));
}

TEST_P(Ipc, QueueSharesByDefaultAndCopiesOnRequest) {
  for (bool copy : {false, true}) {
    tp::Queue<at::Tensor> in(0, {.copy_tensor = copy});
    tp::Queue<std::string> out;
    auto ctx = tp::start_processes(
        [](int, tp::Queue<at::Tensor> i, tp::Queue<std::string> o) {
          queue_modify(std::move(i), std::move(o));
        },
        std::make_tuple(in, out), 1, opts(false));
    at::Tensor t = at::zeros({16});
    in.put(t);
    EXPECT_EQ(out.get(30s), "modified");
    EXPECT_EQ(t.sum().item<float>(), copy ? 0.0f : 7.0f * 16) << "copy=" << copy;
    EXPECT_TRUE(ctx.join(30s));
  }
}

TEST_P(Ipc, ManyProducersAndConsumersLoseNothing) {
  // Bounded: producers block now and then. Under spawn, 2 + 2 processes: each one is a
  // LibTorch start; fork and forkserver run the 6 + 3.
  const bool spawn = GetParam() == "spawn";
  check_producers_consumers(tp::Queue<int64_t>(64), spawn ? 2 : 6, spawn ? 2 : 3, 400, opts());
}

TEST_P(Ipc, CloseWakesAWaitingConsumer) {
  tp::Queue<int> q;
  tp::Queue<std::string> out;
  tp::Event started;
  auto ctx = tp::start_processes(blocked_getter, std::make_tuple(q, out, started), 1, opts(false));
  ASSERT_TRUE(started.wait(60s)) << "the child did not start within 60 s";
  // Lets the child get into its wait. Not needed for correctness: a close before its get
  // also makes it raise ClosedError.
  std::this_thread::sleep_for(200ms);
  const auto t0 = std::chrono::steady_clock::now();
  q.close();
  EXPECT_EQ(out.get(10s), "closed");  // before get(10s) gives up: close woke it
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 8s);
  EXPECT_TRUE(ctx.join(10s));
}

TEST_P(Ipc, SimpleQueueAcrossProcesses) {
  tp::SimpleQueue<int> in, out;
  EXPECT_TRUE(in.empty());
  auto ctx = tp::start_processes(simple_echo, std::make_tuple(in, out), 1, opts(false));
  in.put(41);
  EXPECT_EQ(out.get(30s), 42);
  EXPECT_TRUE(ctx.join(30s));
  EXPECT_TRUE(in.empty());
  out.close();
  EXPECT_THROW(out.get(1s), tp::ClosedError);
}

TEST_P(Ipc, JoinableQueueAcrossProcesses) {
  tp::JoinableQueue<int> q;
  at::Tensor acc = at::zeros({2}, at::kLong);
  tp::share_memory_(acc);
  auto ctx = tp::start_processes(joinable_worker, std::make_tuple(q, acc), 2, opts(false));
  for (int v = 1; v <= 100; ++v) q.put(v);
  EXPECT_TRUE(q.join(60s));
  EXPECT_EQ(acc.sum().item<int64_t>(), 5050);
  q.put(-1);
  q.put(-1);
  EXPECT_TRUE(ctx.join(30s));
}

TORCHPAR_INSTANTIATE_FOR_START_METHODS(Ipc);

TEST(Queue, HundredProducerProcesses) {
  tp::SpawnOptions o;
  o.start_method = tp::StartMethod::kFork;
  check_producers_consumers(tp::Queue<int64_t>(32), 100, 4, 50, o);
}

TEST(Queue, TimeoutsFullAndEmpty) {
  tp::Queue<int> q(2);
  q.put(1);
  q.put_nowait(2);
  EXPECT_TRUE(q.full());
  EXPECT_EQ(q.qsize(), 2u);
  EXPECT_THROW(q.put_nowait(3), tp::Full);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(q.put(3, 0.1s), tp::Full);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 90ms);
  EXPECT_EQ(q.get(), 1);
  EXPECT_EQ(q.get_nowait(), 2);
  EXPECT_TRUE(q.empty());
  EXPECT_THROW(q.get_nowait(), tp::Empty);
  const auto t1 = std::chrono::steady_clock::now();
  EXPECT_THROW(q.get(0.1s), tp::Empty);
  EXPECT_GE(std::chrono::steady_clock::now() - t1, 90ms);
  q.close();
  EXPECT_THROW(q.put(1), tp::ClosedError);
  EXPECT_THROW(q.get(), tp::ClosedError);
}

TEST(Queue, LargeMessageOutlivesItsSender) {
  tp::Queue<at::Tensor> q(0, {.copy_tensor = true, .capacity_bytes = 1 << 20});
  auto c = tp::testing::fork_child([q](int) mutable {
    q.put(at::full({2 << 20}, 3.0f));  // 8 MiB: spilled out of the ring
    return 0;
  });
  EXPECT_EQ(tp::testing::wait_child(c), 0);  // the sender is gone before the get
  at::Tensor t = q.get(10s);
  EXPECT_EQ(t.numel(), 2 << 20);
  EXPECT_EQ(t.sum().item<float>(), 3.0f * (2 << 20));
  EXPECT_TRUE(tp::testing::shm_entries("torchpar_" + std::to_string(::getpid()) + "_").empty())
      << "the getter unlinks the spill file";
}

TEST(Queue, RefusesValuesCarryingFds) {
  tp::Queue<tp::Queue<int>> q;
  try {
    q.put(tp::Queue<int>());
    FAIL();
  } catch (const tp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Process arguments"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(q.empty());
}

TEST(Queue, LargeMessagesAndStrings) {
  tp::SimpleQueue<at::Tensor> q({.copy_tensor = true, .capacity_bytes = 1 << 20});
  at::Tensor big = at::arange(16 << 20, at::kFloat);  // 64 MiB: spills out of the ring
  q.put(big);
  at::Tensor back = q.get(30s);
  EXPECT_TRUE(at::equal(back, big));
  EXPECT_FALSE(tp::is_shared(back));
  tp::Queue<std::string> s(0, {.capacity_bytes = 4096});
  std::string text(100000, 'x');
  s.put(text);
  EXPECT_EQ(s.get(), text);
}

TEST(Queue, ThousandTransfersLeaveNoFdsOrSegments) {
  tp::Queue<at::Tensor> q;
  const int fds0 = tp::testing::count_open_fds();
  // Names this process and its child made (by pid, so other tests running beside this one
  // do not count).
  const std::string own = "torchpar_" + std::to_string(::getpid()) + "_";
  const auto shm0 = tp::testing::shm_entries(own).size();
  auto c = tp::testing::fork_child([q](int) mutable {
    for (int i = 0; i < 1000; ++i) {
      at::Tensor t = q.get(30s);
      if (t[0].item<float>() != static_cast<float>(i)) return 2;
    }
    return 0;
  });
  for (int i = 0; i < 1000; ++i) q.put(at::full({1024}, static_cast<float>(i)));
  EXPECT_EQ(tp::testing::wait_child(c, 120s), 0);
  EXPECT_LE(tp::testing::count_open_fds(), fds0 + 4);
  EXPECT_EQ(tp::testing::shm_entries(own).size(), shm0);
  EXPECT_TRUE(tp::testing::shm_entries("torchpar_" + std::to_string(c.pid) + "_").empty());
}

TEST(Queue, KilledConsumerDoesNotWedgeTheOthers) {
  tp::Queue<int> q;
  tp::Queue<int> out;
  tp::Semaphore arrived(0);
  auto victim = tp::testing::fork_child([q, arrived](int) mutable {
    arrived.release();
    q.get(60s);
    return 0;
  });
  auto survivor = tp::testing::fork_child([q, out, arrived](int) mutable {
    arrived.release();
    for (int i = 0; i < 3; ++i) out.put(q.get(60s));
    return 0;
  });
  ASSERT_TRUE(arrived.acquire(30s) && arrived.acquire(30s)) << "the consumers did not start";
  // Lets both get into their wait inside get. Not needed for correctness: a victim killed
  // before its get leaves every item to the survivor too.
  std::this_thread::sleep_for(200ms);
  ::kill(victim.pid, SIGKILL);
  EXPECT_EQ(tp::testing::wait_child(victim), -SIGKILL);
  for (int i = 0; i < 3; ++i) q.put(i);
  std::set<int> got;
  for (int i = 0; i < 3; ++i) got.insert(out.get(10s));
  EXPECT_EQ(got, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(tp::testing::wait_child(survivor), 0);
}

// Connection::send passes the value's own fds (DumpsContext::borrow_fds): a thousand
// shared tensors later the sender has closed none of them by mistake (the tensor still
// reads back, its segment fd is open) and leaked none.
TEST(Pipe, SharedTensorsSentManyTimesKeepFdsBalanced) {
  auto [mine, theirs] = tp::Pipe();
  at::Tensor t = at::zeros({1024});
  tp::share_memory_(t);
  const int fds0 = tp::testing::count_open_fds();
  auto c = tp::testing::fork_child([theirs = theirs](int) mutable {
    for (int i = 0; i < 1000; ++i) {
      at::Tensor got = theirs.recv<at::Tensor>(30s);
      got.add_(1);  // shared: the sender sees every increment
      theirs.send(i);
    }
    return 0;
  });
  for (int i = 0; i < 1000; ++i) {
    mine.send(t);
    ASSERT_EQ(mine.recv<int>(30s), i);
  }
  EXPECT_EQ(tp::testing::wait_child(c, 120s), 0);
  EXPECT_EQ(t[0].item<float>(), 1000.0f);
  EXPECT_LE(tp::testing::count_open_fds(), fds0 + 2);
  // A send that fails in dumps (a sparse tensor after the Connection) must release, not
  // close, the fds it borrowed from the value.
  auto [a, b] = tp::Pipe();
  using Bad = std::tuple<tp::Connection, at::Tensor>;
  EXPECT_ANY_THROW(mine.send(Bad{a, at::eye(3).to_sparse()}));
  EXPECT_NE(::fcntl(a.fileno(), F_GETFD), -1) << "a borrowed fd was closed by a failed send";
  a.send_bytes("still open");
  EXPECT_EQ(b.recv_bytes(5s), "still open");
}

// A segment's fd crosses a connection once (src/serialize/fd_elision.h): sent again, its
// handle comes without the fd and the receiver finds the segment pinned from the first time.
// So every tensor arrives even when the sender has exited before anything was read and the
// receiver empties its caches between messages (a handle reopened through the dead sender's
// /proc/<pid>/fd would fail). 20 segments, more than the 16 remembered, go out, then again
// in reverse (the last 16 without fds, the first 4 with), then the first one 3 more times.
// Closing the end unpins them: no fd is left open.
TEST(Pipe, TensorsResentWithoutTheirFdsArriveAfterTheSenderExited) {
  constexpr int kSegments = 20;
  std::vector<int> order;
  for (int i = 0; i < kSegments; ++i) order.push_back(i);
  for (int i = kSegments - 1; i >= 0; --i) order.push_back(i);
  for (int k = 0; k < 3; ++k) order.push_back(0);
  const int fds0 = tp::testing::count_open_fds();
  {
    auto [mine, theirs] = tp::Pipe();
    auto c = tp::testing::fork_child([theirs = theirs, order](int) mutable {
      std::vector<at::Tensor> sent;  // 300 KiB each: a segment of its own (not a slab block)
      for (int i = 0; i < kSegments; ++i) sent.push_back(at::full({75 << 10}, float(i)));
      for (int i : order) theirs.send(sent[i]);
      return 0;
    });
    theirs.close();
    ASSERT_EQ(tp::testing::wait_child(c, 60s), 0);
    for (size_t k = 0; k < order.size(); ++k) {
      SCOPED_TRACE(::testing::Message() << "message " << k << ", segment " << order[k]);
      at::Tensor t = mine.recv<at::Tensor>(10s);
      ASSERT_EQ(t.numel(), 75 << 10);
      EXPECT_EQ(t[0].item<float>(), float(order[k]));
      EXPECT_EQ(t[-1].item<float>(), float(order[k]));
      t.reset();
      tp::empty_shm_cache();  // only the connection's pins keep a segment mapped now
    }
    mine.close();
  }
  EXPECT_LE(tp::testing::count_open_fds(), fds0) << "pinned segments outlived the closed end";
}

// The rule both ends apply, and its bounds.
TEST(Pipe, FdElisionRemembersTheLastSixteenSmallSegmentsPerProcess) {
  using tp::detail::FdElision;
  FdElision e;
  EXPECT_FALSE(e.elide(1, 100, 4096)) << "a first send passes the fd";
  EXPECT_TRUE(e.elide(1, 100, 4096)) << "a second one does not";
  for (uint64_t ino = 1; ino <= FdElision::kSegments; ++ino) EXPECT_FALSE(e.elide(2, ino, 4096));
  EXPECT_FALSE(e.elide(1, 100, 4096)) << "16 segments later the first is forgotten";
  EXPECT_TRUE(e.elide(1, 100, 4096));
  EXPECT_FALSE(e.elide(1, 200, FdElision::kMaxSegmentBytes + 1));
  EXPECT_FALSE(e.elide(1, 200, FdElision::kMaxSegmentBytes + 1)) << "a large segment always";
  // A forked child remembers nothing of its parent's sends.
  auto c = tp::testing::fork_child([&e](int) { return e.elide(1, 100, 4096) ? 1 : 0; });
  EXPECT_EQ(tp::testing::wait_child(c, 30s), 0);
  EXPECT_TRUE(e.elide(1, 100, 4096)) << "the parent still does";
  // Pins: the last 16 of each sending process, 16 processes at most (segments not mapped
  // here pin nothing but still count, as the sender counted them).
  for (int32_t pid = 1; pid <= 20; ++pid)
    for (uint64_t ino = 1; ino <= 20; ++ino) e.pin(pid, 3, ino, 4096);
  EXPECT_EQ(e.pinned(), FdElision::kSegments * FdElision::kSenders);
  e.pin(99, 3, 1, FdElision::kMaxSegmentBytes + 1);
  EXPECT_EQ(e.pinned(), FdElision::kSegments * FdElision::kSenders) << "a large one is not";
  e.forget();
  EXPECT_EQ(e.pinned(), 0u);
  EXPECT_FALSE(e.elide(1, 100, 4096)) << "forget() forgets the sends too";
}

TEST(Pipe, BytesPollClosedAndDirection) {
  auto [a, b] = tp::Pipe();
  EXPECT_FALSE(b.poll());
  a.send_bytes("hello");
  EXPECT_TRUE(b.poll(1s));
  EXPECT_EQ(b.recv_bytes(), "hello");
  EXPECT_THROW(b.recv_bytes(0.05s), tp::TimeoutError);
  a.close();
  EXPECT_TRUE(a.closed());
  EXPECT_THROW(a.send_bytes("x"), tp::ClosedError);
  EXPECT_THROW(b.recv_bytes(1s), tp::ClosedError);
  auto [r, w] = tp::Pipe(false);
  EXPECT_THROW(r.send_bytes("x"), tp::Error);
  EXPECT_THROW(w.recv_bytes(), tp::Error);
  // Regression (issue 13): poll on the write-only end returned true instead of raising.
  EXPECT_THROW(w.poll(), tp::Error);
  EXPECT_THROW(w.poll(0.01s), tp::Error);
  EXPECT_FALSE(r.poll());
  w.send(std::vector<int>{1, 2});
  EXPECT_EQ(r.recv<std::vector<int>>(1s), (std::vector<int>{1, 2}));
}

// Two connected kPayload ends over a stream socket pair (a Pipe's ends are SOCK_SEQPACKET):
// the framing for a Unix stream socket handed to Connection.
std::pair<tp::Connection, tp::Connection> stream_pair() {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  return {tp::Connection(tp::UniqueFd(sv[0]), true, true),
          tp::Connection(tp::UniqueFd(sv[1]), true, true)};
}

// recv spins on the read itself for a moment (detail::recv_payload_spinning, or
// recv_payload_records on a Pipe's records) before it sleeps: a frame that comes during the
// spin, after it, or split around its end arrives whole, with and without a timeout, and a
// timeout of 0 on an empty pipe still times out.
TEST(Pipe, FramesArriveWholeAroundTheReceiveSpin) {
  for (const bool records : {true, false}) {
    SCOPED_TRACE(records ? "Pipe (records)" : "stream socket pair");
    auto [a, b] = records ? tp::Pipe() : stream_pair();
    EXPECT_THROW(b.recv_bytes(0s), tp::TimeoutError);
    for (const bool with_timeout : {true, false}) {
      SCOPED_TRACE(with_timeout ? "recv_bytes(5s)" : "recv_bytes()");
      auto recv = [&, &b = b] { return with_timeout ? b.recv_bytes(5s) : b.recv_bytes(); };
      for (const auto delay : {0ms, 30ms}) {
        std::thread sender([&, &a = a] {
          std::this_thread::sleep_for(delay);
          a.send_bytes("whole");
        });
        EXPECT_EQ(recv(), "whole");
        sender.join();
      }
      // A frame that comes in two writes, the second after the spin has ended (magic
      // "PARF", no fds, 5 bytes): on a stream its header is split; as records the first
      // holds the header and 2 bytes, the second the other 3.
      const uint32_t head[4] = {0x46524150u, 0u, 5u, 0u};
      std::string frame(reinterpret_cast<const char*>(head), sizeof head);
      frame += "split";
      const size_t cut = records ? sizeof head + 2 : 6;
      std::thread sender([&, &a = a] {
        ASSERT_EQ(::send(a.fileno(), frame.data(), cut, MSG_NOSIGNAL), static_cast<ssize_t>(cut));
        std::this_thread::sleep_for(30ms);
        ASSERT_EQ(::send(a.fileno(), frame.data() + cut, frame.size() - cut, MSG_NOSIGNAL),
                  static_cast<ssize_t>(frame.size() - cut));
      });
      EXPECT_EQ(recv(), "split");
      sender.join();
    }
    EXPECT_FALSE(b.poll()) << "nothing left over on the socket";
  }
}

// A Pipe sends a frame as SOCK_SEQPACKET records (docs/wire_format.md): the header with up
// to 16 KiB, fd records of up to 250 fds, then records of up to 128 KiB. Every length
// around those edges and a frame with more fds than one record carries arrive whole in a
// child and back, over an end the child got by fork and one rebuilt from its fd alone.
TEST(Pipe, RecordsCarryEveryLengthAndManyFds) {
  auto [mine, theirs] = tp::Pipe();
  const std::vector<size_t> lengths = {0, 1, 16383, 16384, 16385, 147457, (3u << 20) + 7};
  constexpr int kPipes = 260;  // fds in one frame: more than the 250 of one record
  auto c = tp::testing::fork_child([&, theirs = theirs](int) mutable {
    tp::Connection again(tp::UniqueFd(::dup(theirs.fileno())), true, true);
    for (size_t i = 0; i < lengths.size(); ++i) again.send_bytes(again.recv_bytes(30s));
    auto [ends, tail] = theirs.recv<std::tuple<std::vector<tp::Connection>, std::string>>(30s);
    for (size_t i = 0; i < ends.size(); ++i) ends[i].send(static_cast<int>(i));
    theirs.send(tail.size());
    return 0;
  });
  for (const size_t n : lengths) {
    std::string bytes(n, '\0');
    for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<char>(i * 131 + n);
    mine.send_bytes(bytes);
    EXPECT_EQ(mine.recv_bytes(30s), bytes) << n << " bytes";
  }
  std::vector<tp::Connection> keep, send;
  for (int i = 0; i < kPipes; ++i) {
    auto [x, y] = tp::Pipe();
    keep.push_back(x);
    send.push_back(y);
  }
  mine.send(std::make_tuple(send, std::string(100000, 'z')));
  send.clear();
  for (int i = 0; i < kPipes; ++i) EXPECT_EQ(keep[i].recv<int>(30s), i);
  EXPECT_EQ(mine.recv<size_t>(30s), 100000u);
  EXPECT_EQ(tp::testing::wait_child(c, 60s), 0);
}

// A first record that is no frame's start is refused with a SerializationError naming the
// problem; it is dropped whole, so the next message arrives intact, and an empty record is
// skipped. A fault after a frame's first record is a ProtocolError that closes the
// receiving end (the rest of the frame may still be queued). A peer gone mid-frame is a
// ClosedError.
TEST(Pipe, MalformedRecordsAreRefusedAndThePipeStaysInStep) {
  auto [a, b] = tp::Pipe();
  auto raw = [](const tp::Connection& c, const std::string& record) {
    ASSERT_EQ(::send(c.fileno(), record.data(), record.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(record.size()));
  };
  auto header = [](uint64_t nbytes, uint32_t magic = 0x46524150u) {
    const uint32_t head[4] = {magic, 0u, static_cast<uint32_t>(nbytes),
                              static_cast<uint32_t>(nbytes >> 32)};
    return std::string(reinterpret_cast<const char*>(head), sizeof head);
  };
  auto refused = [&, &a = a, &b = b](const std::string& what) {
    try {
      (void)b.recv_bytes(5s);
      ADD_FAILURE() << "no error; expected one naming: " << what;
    } catch (const tp::SerializationError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    a.send_bytes("after");
    EXPECT_EQ(b.recv_bytes(5s), "after");
  };
  raw(a, "abc");
  refused("shorter than a frame header");
  raw(a, header(4, 0x12345678u) + "abcd");
  refused("bad frame magic");
  raw(a, header(4) + std::string(20, 'x'));
  refused("the first record holds 20 bytes of a frame of 4");
  raw(a, "");  // an empty record: no frame's, not the end of the stream either
  a.send_bytes("after the empty record");
  EXPECT_EQ(b.recv_bytes(5s), "after the empty record");
  EXPECT_FALSE(b.closed());
  raw(a, header(100) + std::string(10, 'x'));
  raw(a, std::string(200, 'y'));
  try {
    (void)b.recv_bytes(5s);
    ADD_FAILURE() << "a record too long for its frame was taken";
  } catch (const tp::ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("a record longer than the frame's next part"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("the connection was closed"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(b.closed());
  auto [c, d] = tp::Pipe();
  raw(c, header(1000) + std::string(10, 'x'));
  c.close();
  try {
    (void)d.recv_bytes(5s);
    ADD_FAILURE() << "a frame cut short by the peer's close was received";
  } catch (const tp::ClosedError& e) {
    EXPECT_NE(std::string(e.what()).find("mid-frame (10 of 1000 bytes)"), std::string::npos)
        << e.what();
  }
}

// A peer that exits with messages of ours unread: a SOCK_SEQPACKET socket reports
// ECONNRESET before the replies the peer sent, a stream after them; both read the replies,
// then end with a ClosedError (EOFError), as Python's Pipe does.
TEST(Pipe, APeerGoneWithMessagesUnreadLeavesItsRepliesReadable) {
  for (const bool records : {true, false}) {
    SCOPED_TRACE(records ? "Pipe (records)" : "stream socket pair");
    auto [mine, theirs] = records ? tp::Pipe() : stream_pair();
    mine.send_bytes("job 1");
    mine.send_bytes("job 2");
    auto c = tp::testing::fork_child([theirs = theirs](int) mutable {
      if (theirs.recv_bytes(30s) != "job 1") return 1;
      theirs.send_bytes("result 1");
      return 0;  // job 2 left unread
    });
    theirs.close();  // the child's is the last copy of its end
    ASSERT_EQ(tp::testing::wait_child(c, 60s), 0);
    EXPECT_EQ(mine.recv_bytes(5s), "result 1");
    EXPECT_THROW(mine.recv_bytes(5s), tp::ClosedError);
  }
}

// A sender whose peer goes away in the middle of a long frame closes its own end: the part
// sent cannot be taken back, and a next frame would be read as its continuation.
TEST(Pipe, ASendFailingMidFrameClosesTheSendingEnd) {
  auto [a, b] = tp::Pipe();
  std::thread sender([&, &a = a] {
    EXPECT_ANY_THROW(a.send_bytes(std::string(4 << 20, 'x')));  // more than the buffer holds
  });
  ASSERT_TRUE(b.poll(10s)) << "the frame's first record did not arrive";
  b.close();
  sender.join();
  EXPECT_TRUE(a.closed());
}

// A socket whose send buffer cannot hold a record of the default lengths (EMSGSIZE) gets
// shorter records: a 1 MiB message still arrives whole.
TEST(Pipe, ASmallSendBufferMakesShorterRecords) {
  auto [a, b] = tp::Pipe();
  const int small = 4096;  // the kernel doubles it: an 8 KiB buffer
  ASSERT_EQ(::setsockopt(a.fileno(), SOL_SOCKET, SO_SNDBUF, &small, sizeof small), 0);
  std::string bytes(1 << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i % 251);
  std::thread sender([&, &a = a] { a.send_bytes(bytes); });
  EXPECT_EQ(b.recv_bytes(30s), bytes);
  sender.join();
  // A frame whose first record is over the buffer too (sent while the receiver reads: the
  // buffer holds one record at a time).
  sender = std::thread([&, &a = a] { a.send_bytes(std::string(20000, 'q')); });
  EXPECT_EQ(b.recv_bytes(30s), std::string(20000, 'q'));
  sender.join();
}

// A Pipe's small messages to a reader that already waits in recv go through a shared slot
// (src/ipc/pipe_mailbox.h), the rest over the socket. A child reads 3,000 messages while the
// parent sends them: bytes of every size around the slot's 16 KiB, shared tensors (their
// fds on the socket the first time), some through a copy of the end rebuilt from its fd
// alone (no slot: it always writes the socket), some right after the child's answer to the
// one before (the child then waits in recv: they go through the slot), some in bursts while
// the child sleeps (they queue on the socket). Every message arrives once, in order, whole,
// and the slot was used; then the same over an end that crossed a Pipe (save/load carries
// the slot's fd).
TEST(Pipe, SmallMessagesThroughTheMailboxKeepTheirOrderWithTheSocketsMessages) {
  for (const bool passed : {false, true}) {
    SCOPED_TRACE(passed ? "the reading end crossed a Pipe" : "the reading end by fork");
    auto [mine, theirs] = tp::Pipe();
    auto [carrier_in, carrier_out] = tp::Pipe();
    at::Tensor shared = at::arange(1024, at::kFloat);
    tp::share_memory_(shared);
    constexpr int kMessages = 3000;
    auto c = tp::testing::fork_child([&, theirs = theirs, carrier_in = carrier_in](int) mutable {
      tp::Connection end = passed ? carrier_in.recv<tp::Connection>(30s) : theirs;
      int bad = 0;
      for (int i = 0; i < kMessages; ++i) {
        if (i % 5 == 4) {
          auto t = end.recv<std::tuple<int, at::Tensor>>(30s);
          if (std::get<0>(t) != i || std::get<1>(t)[1023].item<float>() != 1023.0f) ++bad;
          if (i % 10 == 9) end.send(i);
          continue;
        }
        const std::string b = end.recv_bytes(30s);
        const size_t len = static_cast<size_t>(i) * 37 % 20000;
        if (b.size() != len + 4 || std::memcmp(b.data(), &i, 4) != 0 ||
            b.find_first_not_of(static_cast<char>('a' + i % 26), 4) != std::string::npos)
          ++bad;
        if (i % 97 == 0) std::this_thread::sleep_for(2ms);  // a burst queues on the socket
        if (i % 10 == 9) end.send(i);  // then waits in recv for the next message
      }
      end.send(bad);
      return 0;
    });
    if (passed) carrier_out.send(theirs);
    tp::Connection bare(tp::UniqueFd(::fcntl(mine.fileno(), F_DUPFD_CLOEXEC, 0)), true, true);
    const uint64_t slot0 = tp::detail::PipeMailbox::deliveries();
    for (int i = 0; i < kMessages; ++i) {
      if (i % 5 == 4) {
        mine.send(std::tuple<int, at::Tensor>{i, shared});
      } else {
        std::string b(4 + static_cast<size_t>(i) * 37 % 20000, static_cast<char>('a' + i % 26));
        std::memcpy(b.data(), &i, 4);
        (i % 7 == 3 ? bare : mine).send_bytes(b);
      }
      if (i % 10 == 9) {
        ASSERT_EQ(mine.recv<int>(30s), i);  // the child waits for the next
      }
    }
    EXPECT_EQ(mine.recv<int>(60s), 0) << "messages lost, reordered or broken";
    // Both ways were taken: of the 300 messages sent right after an answer, those under 16
    // KiB and not through the bare end mostly go through the slot (143-200 of them here).
    EXPECT_GE(tp::detail::PipeMailbox::deliveries() - slot0, 20u) << "the slot was not used";
    EXPECT_EQ(tp::testing::wait_child(c, 120s), 0);
  }
}

namespace {

using W = tp::detail::PipeMailbox::Word;

// The control line of the direction `side` reads, mapped from the mailbox's fd: the state
// word (PipeMailbox::Word: mode, senders on the socket, the pid that set the mode, completed
// socket sends) and the length.
struct MailboxView {
  explicit MailboxView(int fd) {
    void* p = ::mmap(nullptr, kPage, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap of the mailbox failed");
    base = static_cast<char*>(p);
  }
  ~MailboxView() { ::munmap(base, kPage); }
  std::atomic<uint64_t>& state(int side) {
    return *reinterpret_cast<std::atomic<uint64_t>*>(base + 128 * side);
  }
  std::atomic<uint32_t>& length(int side) {
    return *reinterpret_cast<std::atomic<uint32_t>*>(base + 128 * side + 8);
  }
  char* data(int side) { return base + 4096 + tp::detail::PipeMailbox::kBytes * side; }
  uint64_t mode(int side) { return state(side).load() & W::kModeMask; }
  int32_t pid(int side) {
    return static_cast<int32_t>((state(side).load() & W::kPidMask) >> W::kPidShift);
  }
  // Sets the mode and pid of `side`'s word, keeping its counters.
  void set(int side, uint64_t mode, int32_t pid) {
    uint64_t v = state(side).load();
    while (!state(side).compare_exchange_weak(v, W::make(v, mode, pid))) {
    }
  }
  // Moves `side`'s word from mode `from` to `to` (pid `pid`); false when it was not in `from`.
  bool move(int side, uint64_t from, uint64_t to, int32_t pid) {
    uint64_t v = state(side).load();
    while ((v & W::kModeMask) == from) {
      if (state(side).compare_exchange_weak(v, W::make(v, to, pid))) return true;
    }
    return false;
  }
  static constexpr size_t kPage = 4096 + 2 * tp::detail::PipeMailbox::kBytes;
  char* base = nullptr;
};

tp::detail::Deadline in(std::chrono::milliseconds d) { return tp::detail::SteadyClock::now() + d; }

}  // namespace

// The slot's protocol, one rule at a time (src/ipc/pipe_mailbox.h): a sender delivers only to
// a reader that announced itself, only when every record it sent was read, and a reader
// takes the slot's message before the socket's; a message too long for the slot, a record
// already on the socket, a sender that goes to the socket while the reader waits, and a
// write on the socket by an end without the slot each send the reader to the socket; a
// claimer that died, and a reader killed while announced, leave marks the next reader clears;
// a reader whose deadline passes while its claimer is stopped times out and orphans the claim
// (nothing waits in the slot); a corrupted length is refused and the slot freed.
TEST(PipeMailbox, ARulePerCase) {
  using tp::detail::PipeMailbox;
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  tp::UniqueFd s0(sv[0]), s1(sv[1]);
  auto [x, y] = PipeMailbox::create_pair();  // x writes what y reads (y: side 1)
  MailboxView view(x->fd());
  const int32_t me = ::getpid();
  EXPECT_FALSE(x->try_deliver(s0.get(), "nobody waits"));
  EXPECT_FALSE(y->published());

  auto receive_async = [&, &y = y](std::chrono::milliseconds deadline,
                                   std::chrono::milliseconds spin) {
    return std::async(std::launch::async, [&, deadline, spin] {
      return y->receive(s1.get(), in(deadline),
                        std::chrono::duration_cast<std::chrono::microseconds>(spin));
    });
  };
  auto wait_mode = [&](uint64_t mode) {
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (view.mode(1) != mode && std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
    return view.mode(1) == mode;
  };
  auto read_byte = [&] {
    char c = 0;
    EXPECT_EQ(::recv(s1.get(), &c, 1, MSG_DONTWAIT), 1);
    return c;
  };

  {  // delivered to the waiting reader
    auto got = receive_async(10000ms, 5000ms);
    ASSERT_TRUE(wait_mode(W::kSpinning));
    EXPECT_EQ(view.pid(1), me) << "the word names the spinner";
    EXPECT_FALSE(x->try_deliver(s0.get(), std::string(PipeMailbox::kBytes + 1, 'x')));
    EXPECT_TRUE(x->try_deliver(s0.get(), "hello"));
    EXPECT_EQ(got.get(), std::optional<std::string>("hello"));
    EXPECT_EQ(view.mode(1), W::kIdle);
  }
  {  // a record sent from the sender's socket still unread: no delivery until it is read;
     // then the slot's message comes before a record sent after it
    view.set(1, W::kSpinning, me);
    ASSERT_EQ(::send(s0.get(), "u", 1, 0), 1);
    EXPECT_FALSE(x->try_deliver(s0.get(), "after u"));
    EXPECT_EQ(read_byte(), 'u');
    EXPECT_TRUE(x->try_deliver(s0.get(), "after u"));
    EXPECT_TRUE(y->published());
    {
      PipeMailbox::SocketSend on_socket(x.get());  // moves the counters under the message
      ASSERT_EQ(::send(s0.get(), "v", 1, 0), 1);
    }
    EXPECT_EQ(y->receive(s1.get(), in(1000ms), 50us), std::optional<std::string>("after u"));
    EXPECT_EQ(y->receive(s1.get(), in(1000ms), 50us), std::nullopt) << "then the socket's";
    EXPECT_EQ(read_byte(), 'v');
  }
  {  // a zero timeout with a record queued: the record, not a TimeoutError
    ASSERT_EQ(::send(s0.get(), "z", 1, 0), 1);
    EXPECT_EQ(y->receive(s1.get(), in(0ms), 0us), std::nullopt);
    EXPECT_EQ(y->receive(s1.get(), in(0ms), 50us), std::nullopt);
    EXPECT_EQ(read_byte(), 'z');
    EXPECT_THROW(y->receive(s1.get(), in(0ms), 50us), tp::TimeoutError) << "and none: a timeout";
    EXPECT_FALSE(y->poll(s1.get(), in(0ms)));
    ASSERT_EQ(::send(s0.get(), "q", 1, 0), 1);
    EXPECT_TRUE(y->poll(s1.get(), in(0ms)));
    EXPECT_EQ(read_byte(), 'q');
  }
  {  // a record on the socket: the reader is sent there at once, not after its spin
    ASSERT_EQ(::send(s0.get(), "r", 1, 0), 1);
    auto got = receive_async(60000ms, 60000ms);
    ASSERT_EQ(got.wait_for(30s), std::future_status::ready);
    EXPECT_EQ(got.get(), std::nullopt);
    EXPECT_EQ(view.mode(1), W::kIdle);
    EXPECT_EQ(read_byte(), 'r');
  }
  {  // a sender goes to the socket: the announced reader is sent there, at once
    auto got = receive_async(60000ms, 60000ms);
    ASSERT_TRUE(wait_mode(W::kSpinning));
    {
      PipeMailbox::SocketSend on_socket(x.get());
      EXPECT_EQ(view.mode(1), W::kIdle) << "the announcement taken back";
      EXPECT_FALSE(x->try_deliver(s0.get(), "late")) << "not while a send is on the socket";
      ASSERT_EQ(::send(s0.get(), "s", 1, 0), 1);
    }
    ASSERT_EQ(got.wait_for(30s), std::future_status::ready) << "the reader waited out its spin";
    EXPECT_EQ(got.get(), std::nullopt);
    EXPECT_EQ(read_byte(), 's');
  }
  {  // an end without the slot writes the socket: the spinning reader's peek sees it
    auto got = receive_async(60000ms, 60000ms);
    ASSERT_TRUE(wait_mode(W::kSpinning));
    ASSERT_EQ(::send(s0.get(), "p", 1, 0), 1);
    ASSERT_EQ(got.wait_for(30s), std::future_status::ready) << "the reader waited out its spin";
    EXPECT_EQ(got.get(), std::nullopt);
    EXPECT_EQ(view.mode(1), W::kIdle) << "the reader withdrew";
    EXPECT_EQ(read_byte(), 'p');
  }
  // A zombie (exited, not reaped until the end): it still answers kill(pid, 0), and its pid
  // cannot be reused meanwhile.
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  while (tp::testing::proc_state(dead) != 'Z') std::this_thread::sleep_for(1ms);
  {  // a claimer that died: the reader clears its mark and waits on the socket
    auto got = receive_async(20000ms, 5000ms);
    ASSERT_TRUE(wait_mode(W::kSpinning));
    ASSERT_TRUE(view.move(1, W::kSpinning, W::kClaimed, dead));
    ASSERT_TRUE(wait_mode(W::kIdle)) << "the dead claimer's mark stays";
    ASSERT_EQ(::send(s0.get(), "d", 1, 0), 1);
    EXPECT_EQ(got.get(), std::nullopt);
    EXPECT_EQ(read_byte(), 'd');
  }
  {  // a reader killed while announced: a message delivered to it is the next reader's, and
     // its mark alone is cleared by the next reader that sleeps
    auto child = tp::testing::fork_child([&, &y = y](int) {
      (void)y->receive(s1.get(), in(60000ms), 60000ms);
      return 0;
    });
    ASSERT_TRUE(wait_mode(W::kSpinning));
    EXPECT_EQ(view.pid(1), child.pid);
    ::kill(child.pid, SIGKILL);
    EXPECT_EQ(tp::testing::wait_child(child, 30s), -SIGKILL);
    EXPECT_TRUE(x->try_deliver(s0.get(), "orphan's"));
    EXPECT_EQ(y->receive(s1.get(), in(1000ms), 50us), std::optional<std::string>("orphan's"));
    // Delivered to a dead reader's mark, then a record: the slot's message first, though
    // the next reader finds the mark (it cannot announce) and the record at its first peek.
    view.set(1, W::kSpinning, dead);
    EXPECT_TRUE(x->try_deliver(s0.get(), "B"));
    ASSERT_EQ(::send(s0.get(), "C", 1, 0), 1);
    EXPECT_EQ(y->receive(s1.get(), in(1000ms), 50us), std::optional<std::string>("B"));
    EXPECT_EQ(y->receive(s1.get(), in(1000ms), 50us), std::nullopt);
    EXPECT_EQ(read_byte(), 'C');
    view.set(1, W::kSpinning, dead);
    EXPECT_THROW(y->receive(s1.get(), in(100ms), 50us), tp::TimeoutError);
    EXPECT_EQ(view.mode(1), W::kIdle) << "the dead spinner's mark stays";
  }
  {  // the claimer is stopped past the reader's deadline: TimeoutError, the claim orphaned
     // (its sender sends on the socket instead: nothing waits in the slot unseen by select)
    auto got = receive_async(1000ms, 1000ms);
    ASSERT_TRUE(wait_mode(W::kSpinning));
    // A live claimer that does not publish.
    ASSERT_TRUE(view.move(1, W::kSpinning, W::kClaimed, me));
    EXPECT_THROW(got.get(), tp::TimeoutError);
    EXPECT_EQ(view.mode(1), W::kOrphaned);
    EXPECT_EQ(view.pid(1), me) << "the claimer's pid stays, for it to find its claim";
    EXPECT_FALSE(y->published());
    // The next receive does not wait for the orphaned claim: the socket's record comes.
    ASSERT_EQ(::send(s0.get(), "o", 1, 0), 1);
    EXPECT_EQ(y->receive(s1.get(), in(5000ms), 50us), std::nullopt);
    EXPECT_EQ(read_byte(), 'o');
    view.set(1, W::kIdle, 0);
  }
  {  // a stopped claimer does not hold up another sender's record: the claim is orphaned
    auto got = receive_async(60000ms, 1000ms);
    ASSERT_TRUE(wait_mode(W::kSpinning));
    ASSERT_TRUE(view.move(1, W::kSpinning, W::kClaimed, me));
    ASSERT_EQ(::send(s0.get(), "t", 1, 0), 1);
    ASSERT_EQ(got.wait_for(30s), std::future_status::ready);
    EXPECT_EQ(got.get(), std::nullopt);
    EXPECT_EQ(view.mode(1), W::kOrphaned);
    EXPECT_EQ(read_byte(), 't');
    view.set(1, W::kIdle, 0);
  }
  {  // a corrupted length is refused, the slot freed
    view.length(1).store(PipeMailbox::kBytes + 1);
    view.set(1, W::kPublished, me);
    EXPECT_THROW(y->receive(s1.get(), in(1000ms), 50us), tp::ProtocolError);
    EXPECT_EQ(view.mode(1), W::kIdle);
  }
  EXPECT_THROW(PipeMailbox::open(tp::UniqueFd(::dup(x->fd())), 2), tp::SerializationError);
  EXPECT_EQ(::waitpid(dead, nullptr, 0), dead);
}

int main(int argc, char** argv) {
  torchpar::init(argc, argv);
  return torchpar::testing::run_tests(argc, argv);
}
