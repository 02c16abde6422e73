// The manager's list, Namespace, Value and Array, after CPython's _test_multiprocessing
// manager cases (test_list, test_list_proxy_in_list, test_namespace, test_value, test_array):
// their semantics in the owner, the same objects changed by children of every start method
// and seen by the parent, proxies handed over through a Queue and as Pool arguments, tensors
// as copied values, IndexError / AttributeError reaching the caller, and the server's
// reference counts going back down.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
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

using Ints = std::vector<int64_t>;
using List = tp::ListProxy<int64_t>;
using IntArray = tp::ArrayProxy<int64_t>;
using Handoff = std::tuple<List, tp::NamespaceProxy>;

Ints range(int64_t n) {
  Ints v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

/// Waits until the server holds `n` objects: a fork child's references go back when the
/// server sees its connection close, which the child's exit does not wait for.
size_t objects_settle_at(tp::Manager& m, size_t n) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  size_t now = m.number_of_objects();
  while (now != n && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
    now = m.number_of_objects();
  }
  return now;
}

template <class F>
void expect_remote_error(F&& f, const std::string& type, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "no RemoteError " << type << ": " << message;
  } catch (const tp::RemoteError& e) {
    EXPECT_EQ(e.type(), type) << e.what();
    EXPECT_EQ(e.message(), message) << e.what();
  }
}

// Proxies that can call any method, as a client that does not stick to the typed ones would.
struct RawList : List {
  explicit RawList(const List& l) : List(l) {}
  using List::call_method;
};
struct RawValue : tp::ValueProxy<double> {
  explicit RawValue(const tp::ValueProxy<double>& v) : tp::ValueProxy<double>(v) {}
  using tp::ValueProxy<double>::call_method;
};

// ---- children ----------------------------------------------------------------------------

/// Checks what the parent made, then changes every object (CPython's children in test_list,
/// test_namespace, test_value and test_array).
void child_edit(List l, tp::NamespaceProxy ns, tp::ValueProxy<double> v, IntArray a) {
  require(l.to_vector() == Ints{0, 1, 2}, "the parent's list");
  l.append(3);
  l.set(0, -1);
  require(ns.get<std::string>("name") == "Bob", "the parent's name");
  ns.set("job", std::string("Builder"));
  ns.del("name");
  require(v.get() == 1.25, "the parent's value");
  v.set(-2.5);
  // test_array's child: the running sum of the array, in place.
  const auto n = static_cast<int64_t>(a.size());
  require(n == 10, "the parent's array length");
  for (int64_t i = 1; i < n; ++i) a.set(i, a.get(i) + a.get(i - 1));
}

/// Appends base, base + 1, ..., base + 19, one call each.
void child_append(List l, int64_t base) {
  for (int64_t i = 0; i < 20; ++i) l.append(base + i);
}

/// Takes a list and a namespace from `q` and uses both.
void child_from_queue(tp::Queue<Handoff> q) {
  auto [l, ns] = q.get(30s);
  l.append(7);
  ns.set("seen", static_cast<uint64_t>(l.size()));
}

/// A Pool task: a[i] = i * i, read back through the same proxy.
int64_t square_into(IntArray a, int64_t i) {
  a.set(i, i * i);
  return a.get(i);
}

double read_value(tp::ValueProxy<double> v) { return v.get(); }

// ---- semantics in the owner --------------------------------------------------------------

TEST(ManagerContainers, ListBehavesAsPythonsList) {
  tp::Manager m(manager_options());
  auto a = m.list<int64_t>(range(10));
  EXPECT_EQ(a.type_id(), "list");
  EXPECT_EQ(a.to_vector(), range(10));
  auto b = m.list<int64_t>();
  EXPECT_EQ(b.to_vector(), Ints{});
  EXPECT_EQ(b.size(), 0u);
  b.extend(range(5));
  EXPECT_EQ(b.to_vector(), range(5));
  EXPECT_EQ(b.get(2), 2);
  EXPECT_EQ(b.get(-1), 4);
  EXPECT_EQ(b.get(-5), 0);
  b.append(5);
  b.set(0, 10);
  b.set(-1, 50);
  EXPECT_EQ(b.to_vector(), (Ints{10, 1, 2, 3, 4, 50}));
  b.insert(0, -1);
  b.insert(-1, 7);      // before the last item
  b.insert(100, 99);    // past the end: appended
  b.insert(-100, -99);  // before the start: first
  EXPECT_EQ(b.to_vector(), (Ints{-99, -1, 10, 1, 2, 3, 4, 7, 50, 99}));
  EXPECT_EQ(b.pop(), 99);
  EXPECT_EQ(b.pop(0), -99);
  EXPECT_EQ(b.pop(-2), 7);
  EXPECT_EQ(b.to_vector(), (Ints{-1, 10, 1, 2, 3, 4, 50}));
  EXPECT_EQ(b.size(), 7u);
  b.clear();
  EXPECT_EQ(b.size(), 0u);
  EXPECT_EQ(a.to_vector(), range(10));  // another list, untouched
  auto s = m.list<std::string>({"x", "y"});
  s.append("z");
  EXPECT_EQ(s.to_vector(), (std::vector<std::string>{"x", "y", "z"}));
}

TEST(ManagerContainers, NamespaceBehavesAsPythonsNamespace) {
  tp::Manager m(manager_options());
  auto n = m.Namespace();
  EXPECT_EQ(n.type_id(), "Namespace");
  EXPECT_EQ(n.names(), std::vector<std::string>{});
  n.set("name", std::string("Bob"));
  n.set("job", std::string("Builder"));
  n.set("_hidden", std::string("hidden"));
  EXPECT_EQ(n.get<std::string>("name"), "Bob");
  EXPECT_EQ(n.get<std::string>("job"), "Builder");
  EXPECT_EQ(n.names(), (std::vector<std::string>{"name", "job", "_hidden"}));
  n.del("job");
  EXPECT_TRUE(n.has("name"));
  EXPECT_FALSE(n.has("job"));
  EXPECT_EQ(n.names(), (std::vector<std::string>{"name", "_hidden"}));
  n.set("name", int64_t{3});  // a name may change its type, and keeps its place
  EXPECT_EQ(n.get<int64_t>("name"), 3);
  EXPECT_EQ(n.names(), (std::vector<std::string>{"name", "_hidden"}));
  n.set("v", std::vector<double>{1.5, 2.5});
  EXPECT_EQ(n.get<std::vector<double>>("v"), (std::vector<double>{1.5, 2.5}));
  n.set("job", std::string("again"));  // set after del: a new name, at the end
  EXPECT_EQ(n.names(), (std::vector<std::string>{"name", "_hidden", "v", "job"}));
}

TEST(ManagerContainers, ValueHoldsOneValue) {
  tp::Manager m(manager_options());
  auto i = m.Value<int64_t>(5);
  auto d = m.Value<double>(1.25);
  auto h = m.Value<int16_t>(-232);
  auto c = m.Value<char>('x');
  auto s = m.Value<std::string>("text");
  EXPECT_EQ(i.type_id(), "Value");
  EXPECT_EQ(i.get(), 5);
  EXPECT_EQ(d.get(), 1.25);
  EXPECT_EQ(h.get(), -232);
  EXPECT_EQ(c.get(), 'x');
  EXPECT_EQ(s.get(), "text");
  i.set(-7);
  d.set(2.5);
  h.set(123);
  c.set('y');
  s.set(std::string(100000, 'q'));  // a long value round-trips whole
  EXPECT_EQ(i.get(), -7);
  EXPECT_EQ(d.get(), 2.5);
  EXPECT_EQ(h.get(), 123);
  EXPECT_EQ(c.get(), 'y');
  EXPECT_EQ(s.get(), std::string(100000, 'q'));
}

TEST(ManagerContainers, ArrayHasAFixedLength) {
  tp::Manager m(manager_options());
  auto a = m.Array<int64_t>(range(10));
  EXPECT_EQ(a.type_id(), "Array");
  EXPECT_EQ(a.size(), 10u);
  EXPECT_EQ(a.to_vector(), range(10));
  EXPECT_EQ(a.get(3), 3);
  EXPECT_EQ(a.get(-1), 9);
  EXPECT_EQ(a.get(-10), 0);
  a.set(0, 100);
  a.set(-1, 900);
  EXPECT_EQ(a.to_vector(), (Ints{100, 1, 2, 3, 4, 5, 6, 7, 8, 900}));
  EXPECT_EQ(a.size(), 10u);
  auto d = m.Array<double>({0.5, 1.5});
  d.set(1, -1.5);
  EXPECT_EQ(d.to_vector(), (std::vector<double>{0.5, -1.5}));
  auto empty = m.Array<double>({});
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_EQ(empty.to_vector(), std::vector<double>{});
}

TEST(ManagerContainers, IndexAndAttributeErrorsReachTheCaller) {
  tp::Manager m(manager_options());
  auto l = m.list<int64_t>({1, 2, 3});
  expect_remote_error([&] { l.get(3); }, "IndexError", "list index out of range");
  expect_remote_error([&] { l.get(-4); }, "IndexError", "list index out of range");
  expect_remote_error([&] { l.set(3, 0); }, "IndexError", "list assignment index out of range");
  expect_remote_error([&] { l.set(-4, 0); }, "IndexError", "list assignment index out of range");
  expect_remote_error([&] { l.pop(3); }, "IndexError", "pop index out of range");
  expect_remote_error([&] { l.pop(-4); }, "IndexError", "pop index out of range");
  EXPECT_EQ(l.to_vector(), (Ints{1, 2, 3}));  // the failed calls changed nothing
  auto empty = m.list<int64_t>();
  expect_remote_error([&] { empty.pop(); }, "IndexError", "pop from empty list");
  expect_remote_error([&] { empty.pop(0); }, "IndexError", "pop from empty list");
  expect_remote_error([&] { empty.get(0); }, "IndexError", "list index out of range");

  auto a = m.Array<int64_t>({1, 2});
  expect_remote_error([&] { a.get(2); }, "IndexError", "array index out of range");
  expect_remote_error([&] { a.get(-3); }, "IndexError", "array index out of range");
  expect_remote_error([&] { a.set(2, 0); }, "IndexError", "array assignment index out of range");
  EXPECT_EQ(a.to_vector(), (Ints{1, 2}));

  auto n = m.Namespace();
  n.set("name", std::string("Bob"));
  expect_remote_error([&] { n.get<std::string>("job"); }, "AttributeError",
                      "'Namespace' object has no attribute 'job'");
  expect_remote_error([&] { n.del("job"); }, "AttributeError",
                      "'Namespace' object has no attribute 'job'");
  EXPECT_EQ(n.names(), std::vector<std::string>{"name"});

  // Methods the proxies do not offer are not served either.
  RawList raw(l);
  expect_remote_error([&] { raw.call_method("remove", {}); }, "AttributeError",
                      "method 'remove' of 'list' is not exposed by the manager");
  RawValue raw_value(m.Value<double>(1.0));
  expect_remote_error([&] { raw_value.call_method("append", {}); }, "AttributeError",
                      "method 'append' of 'Value' is not exposed by the manager");
  l.append(4);  // the objects and the server go on
  EXPECT_EQ(l.to_vector(), (Ints{1, 2, 3, 4}));
}

TEST(ManagerContainers, TensorsAreCopiedBothWays) {
  tp::Manager m(manager_options());
  const at::Tensor ref = at::arange(6, at::kFloat).reshape({2, 3});

  auto l = m.list<at::Tensor>();
  at::Tensor t = ref.clone();
  l.append(t);
  t.add_(100);  // the manager holds a copy
  at::Tensor back = l.get(0);
  EXPECT_TRUE(at::equal(back, ref));
  EXPECT_EQ(back.sizes().vec(), (std::vector<int64_t>{2, 3}));
  back.add_(1);  // and hands out copies
  EXPECT_TRUE(at::equal(l.get(0), ref));

  auto v = m.Value(at::ones({4}, at::kDouble));
  v.get().mul_(5);
  EXPECT_TRUE(at::equal(v.get(), at::ones({4}, at::kDouble)));
  EXPECT_EQ(v.get().scalar_type(), at::kDouble);

  auto a = m.Array<at::Tensor>({at::zeros({2}), at::ones({2})});
  a.get(1).add_(1);
  EXPECT_TRUE(at::equal(a.get(1), at::ones({2})));
  a.set(0, t);
  t.zero_();
  EXPECT_TRUE(at::equal(a.get(0), ref + 100));

  auto n = m.Namespace();
  at::Tensor w = ref.clone();
  n.set("w", w);
  w.zero_();
  EXPECT_TRUE(at::equal(n.get<at::Tensor>("w"), ref));
}

TEST(ManagerContainers, ProxiesAsItemsStillWork) {  // CPython test_list_proxy_in_list
  tp::Manager m(manager_options());
  auto a = m.list<int64_t>(range(3));
  auto f = m.list<List>({a});
  a.append(3);
  EXPECT_EQ(f.get(0).to_vector(), range(4));
  f.get(0).append(4);  // a proxy loaded from the list reaches the same list
  EXPECT_EQ(a.to_vector(), range(5));
  auto n = m.Namespace();
  n.set("list", a);
  n.get<List>("list").append(5);
  EXPECT_EQ(a.get(-1), 5);
  // Each loaded proxy took a reference and gave it back: the three objects, nothing more.
  EXPECT_EQ(m.number_of_objects(), 3u);
}

TEST(ManagerContainers, ObjectsAreFreedWithTheirLastProxy) {
  tp::Manager m(manager_options());
  EXPECT_EQ(m.number_of_objects(), 0u);
  {
    auto l = m.list<int64_t>({1});
    auto n = m.Namespace();
    auto v = m.Value<int64_t>(1);
    auto a = m.Array<int64_t>({1});
    EXPECT_EQ(m.number_of_objects(), 4u);
    {
      auto l2 = l;  // copies share one reference
      auto [x, y] = tp::Pipe();
      x.send(n);
      auto n2 = y.recv<tp::NamespaceProxy>(30s);  // a reference of its own
      EXPECT_EQ(n2.id(), n.id());
      n2.set("via pipe", int64_t{1});
      EXPECT_EQ(n.get<int64_t>("via pipe"), 1);
      EXPECT_EQ(m.number_of_objects(), 4u);
    }
    v = tp::ValueProxy<int64_t>();  // dropping the only proxy frees the object
    EXPECT_EQ(m.number_of_objects(), 3u);
    EXPECT_EQ(l.get(0), 1);
    EXPECT_EQ(a.get(0), 1);
  }
  EXPECT_EQ(m.number_of_objects(), 0u);
}

// ---- objects of Python's kind from C++ (Manager::python_object, PythonDictProxy) ----------

/// The RemoteError type `f` raised ("" when it raised none).
template <class F>
std::string remote_error_type(F&& f) {
  try {
    f();
  } catch (const tp::RemoteError& e) {
    return e.type();
  }
  return "";
}

TEST(ManagerContainers, PythonKindDictKeepsPythonsKeySemantics) {
  using tp::pickle::Value;
  tp::Manager m(manager_options());
  auto d = m.python_dict();
  EXPECT_EQ(d.type_id(), "dict");
  EXPECT_EQ(d.ident(), fmt::format("{:x}", d.id()));
  d.set(1, Value::str("int"));
  d.set(1.0, Value::str("float"));  // 1 == 1.0 in Python: the same key, the first kept
  d.set(Value::str("a"), 1);
  d.set(Value::bytes("a"), 2);  // b"a" != "a"
  d.set(Value::tuple({Value::str("t"), 2}), Value::list({1, 2.5, Value()}));
  EXPECT_EQ(d.size(), 4u);
  EXPECT_EQ(*d.get(true), Value::str("float"));  // True == 1 too
  EXPECT_EQ(*d.get(Value::bytes("a")), Value(2));
  EXPECT_EQ(*d.get(Value::tuple({Value::str("t"), 2.0})), Value::list({1, 2.5, Value()}));
  EXPECT_FALSE(d.get(Value::str("missing")).has_value());
  EXPECT_TRUE(d.contains(Value::str("a")));
  EXPECT_EQ(d.keys(), (std::vector<Value>{1, Value::str("a"), Value::bytes("a"),
                                          Value::tuple({Value::str("t"), 2})}));
  EXPECT_EQ(d.items().at(0).second, Value::str("float"));
  EXPECT_EQ(remote_error_type([&] { d.pop(Value::str("missing")); }), "KeyError");
  EXPECT_EQ(remote_error_type([&] { d.set(Value::list({}), 1); }), "TypeError");  // unhashable
  EXPECT_EQ(remote_error_type([&] { d.call("no_such_method"); }), "AttributeError");
  EXPECT_EQ(d.pop(Value::bytes("a")), Value(2));
  d.erase(Value::str("a"));
  EXPECT_EQ(d.copy().kind(), Value::Kind::kDict);
  EXPECT_EQ(d.copy().as<tp::pickle::Dict>().items.size(), 2u);
  d.clear();
  EXPECT_EQ(d.size(), 0u);
}

TEST(ManagerContainers, PythonKindObjectsAreSharedByIdentAndFreed) {
  using tp::pickle::Value;
  tp::Manager m(manager_options());
  {
    auto d = m.python_dict();
    auto same = m.python_dict(d.ident());  // as a Python client rebuilds a proxy from a Token
    same.set(Value::str("k"), 7);
    EXPECT_EQ(*d.get(Value::str("k")), Value(7));
    EXPECT_THROW(m.python_dict("not hex"), tp::ValueError);
    EXPECT_EQ(remote_error_type([&] { m.python_dict("fffff"); }), "KeyError");

    auto l = m.python_object("list", {Value::list({1, 2})});
    l.call("append", {Value::str("x")});
    EXPECT_EQ(l.call("__len__"), Value(3));
    EXPECT_EQ(l.call("__getitem__", {-1}), Value::str("x"));
    EXPECT_EQ(remote_error_type([&] { l.call("__getitem__", {10}); }), "IndexError");

    auto q = m.python_object("Queue", {int64_t{1}});
    q.call("put", {Value::str("item")});
    EXPECT_EQ(q.call("get"), Value::str("item"));
    const auto start = std::chrono::steady_clock::now();
    EXPECT_EQ(remote_error_type([&] { q.call("get", {true, 0.2}, 5s); }), "Empty");
    EXPECT_GE(std::chrono::steady_clock::now() - start, 190ms);  // it waited its timeout
    EXPECT_EQ(remote_error_type([&] { m.python_object("NoSuchType"); }), "ValueError");
    EXPECT_EQ(m.number_of_objects(), 3u);
  }
  EXPECT_EQ(m.number_of_objects(), 0u);
}

// ---- across processes --------------------------------------------------------------------

class ManagerContainersAcrossProcesses : public tp::testing::StartMethodTest {
 protected:
  tp::ProcessOptions process_options() {
    tp::ProcessOptions po;
    po.start_method = tp::start_method_from_string(GetParam());
    return po;
  }
};

TEST_P(ManagerContainersAcrossProcesses, ChildrenChangeWhatTheParentSees) {
  tp::Manager m(manager_options());
  {
    auto l = m.list<int64_t>({0, 1, 2});
    auto ns = m.Namespace();
    ns.set("name", std::string("Bob"));
    auto v = m.Value<double>(1.25);
    auto a = m.Array<int64_t>(range(10));
    tp::Process p(process_options(), child_edit, l, ns, v, a);
    p.start();
    ASSERT_EQ(exit_code(p), 0);
    EXPECT_EQ(l.to_vector(), (Ints{-1, 1, 2, 3}));
    EXPECT_FALSE(ns.has("name"));
    EXPECT_EQ(ns.get<std::string>("job"), "Builder");
    EXPECT_EQ(ns.names(), std::vector<std::string>{"job"});
    EXPECT_EQ(v.get(), -2.5);
    Ints sums = range(10);
    std::partial_sum(sums.begin(), sums.end(), sums.begin());
    EXPECT_EQ(a.to_vector(), sums);

    // Two children append at once: every item arrives, each child's in its own order.
    l.clear();
    tp::Process c1(process_options(), child_append, l, int64_t{100});
    tp::Process c2(process_options(), child_append, l, int64_t{200});
    c1.start();
    c2.start();
    EXPECT_EQ(exit_code(c1), 0);
    EXPECT_EQ(exit_code(c2), 0);
    Ints from1, from2;
    for (int64_t x : l.to_vector()) (x >= 200 ? from2 : from1).push_back(x);
    Ints want1 = range(20), want2 = range(20);
    for (auto& x : want1) x += 100;
    for (auto& x : want2) x += 200;
    EXPECT_EQ(from1, want1);
    EXPECT_EQ(from2, want2);
    EXPECT_EQ(objects_settle_at(m, 4), 4u);  // the children's references went with them
  }
  EXPECT_EQ(objects_settle_at(m, 0), 0u);
}

TEST_P(ManagerContainersAcrossProcesses, ProxiesTravelThroughQueuesAndPoolArguments) {
  tp::Manager m(manager_options());
  {
    auto l = m.list<int64_t>();
    auto ns = m.Namespace();
    tp::Queue<Handoff> q;
    tp::Process p(process_options(), child_from_queue, q);
    p.start();
    q.put(Handoff{l, ns});  // the parent keeps its proxies until the child has loaded them
    ASSERT_EQ(exit_code(p), 0);
    EXPECT_EQ(l.to_vector(), Ints{7});
    EXPECT_EQ(ns.get<uint64_t>("seen"), 1u);

    auto a = m.Array<int64_t>(Ints(8, -1));
    auto v = m.Value<double>(0.5);
    Ints squares;
    std::vector<std::tuple<IntArray, int64_t>> items;
    for (int64_t i = 0; i < 8; ++i) {
      items.emplace_back(a, i);
      squares.push_back(i * i);
    }
    {
      tp::Pool pool(options(2));
      EXPECT_EQ(pool.starmap(square_into, items, 1), squares);
      EXPECT_EQ(pool.apply(read_value, std::make_tuple(v)), 0.5);
      pool.close();
      EXPECT_TRUE(pool.join(60s));
    }
    EXPECT_EQ(a.to_vector(), squares);
    items.clear();
    EXPECT_EQ(objects_settle_at(m, 4), 4u);  // the workers' references went with them
  }
  EXPECT_EQ(objects_settle_at(m, 0), 0u);
}

TORCHPAR_INSTANTIATE_FOR_START_METHODS(ManagerContainersAcrossProcesses);

}  // namespace

int main(int argc, char** argv) { return tp::testing::manager_test_main(argc, argv); }
