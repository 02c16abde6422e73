// Registered (custom) manager types across real processes: a user type made in the server
// with constructor arguments and called through Proxy<T> from the owner and from children
// of every start method (the server started by each start method too, so its registry
// comes from static registration or from main before torchpar::init), a method that is not
// exposed, what a member throws, typed checks before anything is sent, serialized calls
// versus a thread-safe type, and references freed with the last proxy.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/manager.h"
#include "support/start_methods.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

using tp::testing::exit_code;
using tp::testing::manager_options;
using tp::testing::require;

struct Counter {
  Counter() = default;
  explicit Counter(int64_t start) : n(start) {}
  int64_t increment(int64_t by) { return n += by; }
  int64_t value() const { return n; }
  void reset() noexcept { n = 0; }
  /// Read, pause, write: loses updates unless the server runs one call at a time.
  int64_t bump() {
    const int64_t v = n;
    std::this_thread::sleep_for(200us);  // widens the window a concurrent call would hit
    n = v + 1;
    return n;
  }
  void fail(const std::string& why) { throw std::out_of_range(why); }
  int64_t n = 0;
};

static const auto kCounterType = tp::register_managed_type<Counter>("Counter")
                                     .init<int64_t>()
                                     .expose("increment", &Counter::increment)
                                     .expose("value", &Counter::value)
                                     .expose("reset", &Counter::reset)
                                     .expose("bump", &Counter::bump)
                                     .expose("fail", &Counter::fail);

class TensorStore {
 public:
  explicit TensorStore(std::string name) : name_(std::move(name)) {}
  void put(const std::string& key, at::Tensor t) { items_[key] = std::move(t); }
  at::Tensor get(const std::string& key) const { return items_.at(key); }
  std::vector<std::string> keys() const {
    std::vector<std::string> out;
    for (const auto& kv : items_) out.push_back(kv.first);
    return out;
  }
  std::string name() const { return name_; }

 private:
  std::string name_;
  std::map<std::string, at::Tensor> items_;
};

TORCHPAR_REGISTER_MANAGED_TYPE(tp::register_managed_type<TensorStore>("TensorStore")
                                   .init<std::string>()
                                   .expose("put", &TensorStore::put)
                                   .expose("get", &TensorStore::get)
                                   .expose("keys", &TensorStore::keys)
                                   .expose("name", &TensorStore::name));

/// `n` callers meet inside meet(): each waits (at most max_s) for the others.
class Meeting {
 public:
  bool meet(int64_t n, double max_s) {
    std::unique_lock<std::mutex> lock(mu_);
    ++inside_;
    cv_.notify_all();
    return cv_.wait_for(lock, std::chrono::duration<double>(max_s), [&] { return inside_ >= n; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t inside_ = 0;
};

// The same class twice: calls run concurrently on one, one at a time on the other.
static const auto kMeetingType =
    tp::register_managed_type<Meeting>("Meeting").expose("meet", &Meeting::meet).thread_safe();
static const auto kSerialMeetingType =
    tp::register_managed_type<Meeting>("SerialMeeting").expose("meet", &Meeting::meet);

/// Registered in main() before torchpar::init (the other documented place).
struct Late {
  int64_t answer() const { return 42; }
};

template <class F>
tp::RemoteError remote_error_of(F&& f) {
  try {
    f();
  } catch (const tp::RemoteError& e) {
    return e;
  }
  ADD_FAILURE() << "no RemoteError";
  return tp::RemoteError("none", "none");
}

// ---- in the owner ------------------------------------------------------------------------

TEST(ManagerCustom, RegisteredTypeIsMadeWithArgumentsAndCalledInTheServer) {
  tp::Manager m(manager_options());
  tp::Proxy<Counter> c = m.make(kCounterType, int64_t{10});
  EXPECT_EQ(c.type_id(), "Counter");
  EXPECT_EQ(c.address(), m.address());
  EXPECT_EQ(c.call<int64_t>("value"), 10);
  EXPECT_EQ(c.call<int64_t>("increment", int64_t{5}), 15);
  EXPECT_EQ(c.call<int64_t>("increment", int64_t{-1}), 14);
  c.call("reset");  // a void noexcept member
  EXPECT_EQ(c.call<int64_t>("value"), 0);
  // By typeid, and with strings and tensors both ways (copied).
  auto s = m.make<TensorStore>("TensorStore", "weights");
  EXPECT_EQ(s.call<std::string>("name"), "weights");
  at::Tensor t = at::arange(6, at::kFloat);
  s.call("put", std::string("w"), t);
  t.add_(100);  // the server holds a copy
  EXPECT_TRUE(at::equal(s.call<at::Tensor>("get", std::string("w")), at::arange(6, at::kFloat)));
  EXPECT_EQ(s.call<std::vector<std::string>>("keys"), std::vector<std::string>{"w"});
  EXPECT_EQ(m.number_of_objects(), 2u);
}

TEST(ManagerCustom, WithShareTensorsTheServerAdoptsTheArgumentsSharedMemory) {
  // A registered member's arguments are loaded once in the server, adopting their shared
  // tensors (not pinned for borrowers as stored values are): the server's tensor aliases
  // the caller's. Results still come back as copies.
  tp::ManagerOptions o = manager_options();
  o.share_tensors = true;
  tp::Manager m(o);
  auto s = m.make<TensorStore>("TensorStore", std::string("shared"));
  at::Tensor t = at::arange(6, at::kFloat);
  s.call("put", std::string("w"), t);
  EXPECT_TRUE(tp::is_shared(t));
  t.add_(100);  // the server holds the same memory
  at::Tensor got = s.call<at::Tensor>("get", std::string("w"));
  EXPECT_TRUE(at::equal(got, at::arange(6, at::kFloat) + 100));
  got.fill_(0);  // a copy
  EXPECT_TRUE(
      at::equal(s.call<at::Tensor>("get", std::string("w")), at::arange(6, at::kFloat) + 100));
  // The same tensor again: a second export of the block, claimed by its one load.
  s.call("put", std::string("w2"), t);
  EXPECT_EQ(s.call<std::vector<std::string>>("keys"), (std::vector<std::string>{"w", "w2"}));
}

TEST(ManagerCustom, MethodNotExposedIsAnAttributeErrorListingTheExposedOnes) {
  tp::Manager m(manager_options());
  auto s = m.make<TensorStore>("TensorStore", std::string("x"));
  const tp::RemoteError e = remote_error_of([&] { s.call("clear"); });
  EXPECT_EQ(e.type(), "AttributeError");
  EXPECT_NE(e.message().find("'TensorStore' exposes no method 'clear' (exposed: get, keys, name, "
                             "put)"),
            std::string::npos)
      << e.message();
  EXPECT_EQ(s.call<std::string>("name"), "x");  // the object goes on
}

TEST(ManagerCustom, WhatAMemberThrowsReachesTheCallerWithTypeAndMessage) {
  tp::Manager m(manager_options());
  auto c = m.make(kCounterType, int64_t{1});
  tp::RemoteError e = remote_error_of([&] { c.call("fail", std::string("no such slot 7")); });
  EXPECT_EQ(e.type(), "std::out_of_range");
  EXPECT_NE(e.message().find("no such slot 7"), std::string::npos) << e.message();
  auto s = m.make<TensorStore>("TensorStore", std::string("x"));
  e = remote_error_of([&] { s.call<at::Tensor>("get", std::string("missing")); });
  EXPECT_EQ(e.type(), "std::out_of_range");
  EXPECT_EQ(c.call<int64_t>("increment", int64_t{1}), 2);  // server and object go on
}

TEST(ManagerCustom, WrongTypesAreRefusedBeforeAnythingIsSent) {
  tp::Manager m(manager_options());
  auto c = m.make(kCounterType, int64_t{1});
  const size_t objects = m.number_of_objects();
  // An int is not the int64_t the member takes; a wrong result type; a wrong init.
  EXPECT_THROW(c.call<int64_t>("increment", 5), tp::ValueError);
  EXPECT_THROW(c.call<double>("value"), tp::ValueError);
  EXPECT_THROW(c.call<int64_t>("reset"), tp::ValueError);
  EXPECT_THROW(m.make<Counter>("Counter", 5), tp::ValueError);
  EXPECT_THROW(m.make<Counter>("Counter", std::string("x")), tp::ValueError);
  EXPECT_THROW(m.make<TensorStore>("Counter", std::string("x")), tp::ValueError);
  try {
    c.call<int64_t>("increment", 5);
  } catch (const tp::ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("std::tuple<long>"), std::string::npos) << what;
    EXPECT_NE(what.find("std::tuple<int>"), std::string::npos) << what;
  }
  EXPECT_EQ(m.number_of_objects(), objects);
  EXPECT_EQ(c.call<int64_t>("value"), 1);  // nothing reached the server
}

TEST(ManagerCustom, UnknownTypeidIsARemoteValueError) {
  tp::Manager m(manager_options());
  const tp::RemoteError e = remote_error_of([&] { m.make<Counter>("NoSuchType"); });
  EXPECT_EQ(e.type(), "ValueError");
  EXPECT_NE(e.message().find("NoSuchType"), std::string::npos) << e.message();
  EXPECT_EQ(m.number_of_objects(), 0u);
}

TEST(ManagerCustom, CallsAreSerializedUnlessTheTypeIsThreadSafe) {
  tp::Manager m(manager_options());
  // Read-pause-write from 4 threads: no update lost, since the calls run one at a time.
  auto c = m.make(kCounterType, int64_t{0});
  std::vector<std::future<void>> bumps;
  for (int t = 0; t < 4; ++t) {
    bumps.push_back(std::async(std::launch::async, [c] {
      for (int i = 0; i < 25; ++i) c.call<int64_t>("bump");
    }));
  }
  for (auto& f : bumps) ASSERT_EQ(f.wait_for(120s), std::future_status::ready);
  for (auto& f : bumps) f.get();
  EXPECT_EQ(c.call<int64_t>("value"), 100);

  // Two callers meet inside a thread-safe object; a serialized one lets in one at a time,
  // so the first waits out its limit alone and the second finds it has been there.
  auto meet_twice = [](const tp::Proxy<Meeting>& meeting, double max_s) {
    auto a = std::async(std::launch::async,
                        [&] { return meeting.call<bool>("meet", int64_t{2}, max_s); });
    auto b = std::async(std::launch::async,
                        [&] { return meeting.call<bool>("meet", int64_t{2}, max_s); });
    EXPECT_EQ(a.wait_for(60s), std::future_status::ready);
    EXPECT_EQ(b.wait_for(60s), std::future_status::ready);
    return int{a.get()} + int{b.get()};
  };
  EXPECT_EQ(meet_twice(m.make(kMeetingType), 20.0), 2);
  EXPECT_EQ(meet_twice(m.make(kSerialMeetingType), 1.0), 1);
}

TEST(ManagerCustom, ObjectsAreFreedWithTheirLastProxyAndTravelThroughAPipe) {
  tp::Manager m(manager_options());
  {
    auto c = m.make(kCounterType, int64_t{3});
    auto [x, y] = tp::Pipe();
    x.send(c);
    {
      auto loaded = y.recv<tp::Proxy<Counter>>(30s);
      EXPECT_EQ(loaded.id(), c.id());
      EXPECT_EQ(loaded.call<int64_t>("increment", int64_t{1}), 4);
    }
    EXPECT_EQ(c.call<int64_t>("value"), 4);
    EXPECT_EQ(m.number_of_objects(), 1u);
  }
  EXPECT_EQ(m.number_of_objects(), 0u);
}

TEST(ManagerCustom, ATypeRegisteredAfterInitReachesAForkedServerButNotASpawnedOne) {
  static const auto kAfterInit =
      tp::register_managed_type<Late>("AfterInit").expose("answer", &Late::answer);
  tp::ManagerOptions o = manager_options();
  o.start_method = tp::StartMethod::kFork;  // inherits this process's registry as it is now
  tp::Manager forked(o);
  EXPECT_EQ(forked.make(kAfterInit).call<int64_t>("answer"), 42);
  o.start_method = tp::StartMethod::kSpawn;  // re-runs main up to init: no AfterInit there
  tp::Manager spawned(o);
  const tp::RemoteError e = remote_error_of([&] { spawned.make(kAfterInit); });
  EXPECT_EQ(e.type(), "ValueError");
  EXPECT_NE(e.message().find("'AfterInit'"), std::string::npos) << e.message();
}

// ---- across processes --------------------------------------------------------------------

void child_increments(tp::Proxy<Counter> c, int64_t times) {
  for (int64_t i = 0; i < times; ++i) c.call<int64_t>("increment", int64_t{1});
  require(c.call<int64_t>("value") >= times, "the child's increments");
}

void child_uses_late(tp::Proxy<Late> late) {
  require(late.call<int64_t>("answer") == 42, "Late::answer in the server");
}

class ManagerCustomAcrossProcesses : public tp::testing::StartMethodTest {};

TEST_P(ManagerCustomAcrossProcesses, ServerAndChildrenOfEveryStartMethodKnowTheTypes) {
  tp::ManagerOptions o = manager_options();
  o.start_method = tp::start_method_from_string(GetParam());  // the server's registry
  tp::Manager m(o);
  {
    auto c = m.make(kCounterType, int64_t{1000});
    auto late = m.make<Late>("Late");  // registered in main before init
    tp::ProcessOptions po;
    po.start_method = tp::start_method_from_string(GetParam());
    tp::Process p1(po, child_increments, c, int64_t{20});
    tp::Process p2(po, child_increments, c, int64_t{30});
    tp::Process p3(po, child_uses_late, late);
    p1.start();
    p2.start();
    p3.start();
    EXPECT_EQ(exit_code(p1), 0);
    EXPECT_EQ(exit_code(p2), 0);
    EXPECT_EQ(exit_code(p3), 0);
    EXPECT_EQ(c.call<int64_t>("value"), 1050);
  }
  // The children's references went with them (decref, or their connection closing).
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (m.number_of_objects() != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(m.number_of_objects(), 0u);
}

TORCHPAR_INSTANTIATE_FOR_START_METHODS(ManagerCustomAcrossProcesses);

}  // namespace

int main(int argc, char** argv) {
  // Before init: a spawned or forkserver server re-runs main up to init, so it registers
  // Late too.
  tp::register_managed_type<Late>("Late").expose("answer", &Late::answer);
  return tp::testing::manager_test_main(argc, argv);
}
