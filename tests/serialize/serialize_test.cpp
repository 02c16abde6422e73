// dumps / loads: round trips of every supported type, tensor identity, both tensor modes,
// hostile input, and payloads over a real socketpair with fd passing.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <array>
#include <map>
#include <optional>
#include <random>
#include <tuple>
#include <unordered_map>
#include <variant>

#include "support/child.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;

namespace {

struct Point {
  int x = 0;
  double y = 0;
  std::string label;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(x, y, label);
  }
  bool operator==(const Point&) const = default;
};

struct Batch {
  at::Tensor data;
  at::Tensor target;
  std::vector<Point> points;
  std::map<std::string, std::vector<int64_t>> meta;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(data, target, points, meta);
  }
};

template <class T>
T round_trip(const T& v, bool copy = true) {
  return tp::loads<T>(tp::dumps(v, {.copy_tensor = copy}));
}

}  // namespace

TEST(Serialize, StandardTypesRoundTrip) {
  EXPECT_EQ(round_trip(42), 42);
  EXPECT_EQ(round_trip(-1.5), -1.5);
  EXPECT_EQ(round_trip(true), true);
  EXPECT_EQ(round_trip(std::string("héllo\0x", 8)), std::string("héllo\0x", 8));
  EXPECT_EQ(round_trip(std::vector<int>{1, 2, 3}), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(round_trip(std::vector<std::string>{}), std::vector<std::string>{});
  std::map<std::string, double> m{{"a", 1}, {"b", 2}};
  EXPECT_EQ(round_trip(m), m);
  std::unordered_map<int, std::string> um{{1, "x"}, {2, "y"}};
  EXPECT_EQ(round_trip(um), um);
  auto tup = std::make_tuple(1, std::string("s"), 2.5f);
  EXPECT_EQ(round_trip(tup), tup);
  auto pr = std::make_pair(std::string("k"), std::vector<double>{1.0});
  EXPECT_EQ(round_trip(pr), pr);
  std::optional<int> none, some = 7;
  EXPECT_EQ(round_trip(none), none);
  EXPECT_EQ(round_trip(some), some);
  std::variant<int, std::string> v1 = 3, v2 = std::string("three");
  EXPECT_EQ(round_trip(v1), v1);
  EXPECT_EQ(round_trip(v2), v2);
  Point p{1, 2.5, "p"};
  EXPECT_EQ(round_trip(p), p);
  std::vector<std::map<int, std::vector<Point>>> nested{{{1, {p, p}}}, {}};
  EXPECT_EQ(round_trip(nested), nested);
}

class SerializeTensor : public ::testing::TestWithParam<bool> {};

TEST_P(SerializeTensor, EveryDtypeAndShape) {
  const bool copy = GetParam();
  for (auto dt : {at::kByte, at::kChar, at::kShort, at::kInt, at::kLong, at::kHalf, at::kFloat,
                  at::kDouble, at::kComplexFloat, at::kComplexDouble, at::kBool, at::kBFloat16}) {
    for (auto sizes : std::vector<std::vector<int64_t>>{{}, {0}, {5}, {2, 3, 4}}) {
      at::Tensor t = at::arange(0, c10::multiply_integers(sizes), at::kDouble).reshape(sizes);
      t = dt == at::kBool ? (t.remainder(2) == 0) : t.to(dt);
      at::Tensor expect = t.clone();
      at::Tensor u = round_trip(t, copy);
      ASSERT_EQ(u.scalar_type(), dt);
      ASSERT_EQ(u.sizes(), t.sizes());
      ASSERT_TRUE(at::equal(u, expect)) << dt << " " << t.sizes();
      ASSERT_EQ(tp::is_shared(u), !copy);
    }
  }
}

TEST_P(SerializeTensor, ViewsKeepStorageIdentityAndLayout) {
  const bool copy = GetParam();
  at::Tensor base = at::arange(0, 24, at::kFloat).reshape({4, 6});
  std::vector<at::Tensor> v{base, base.t(), base.narrow(1, 2, 3), base[2], base};
  auto back = round_trip(v, copy);
  ASSERT_EQ(back.size(), 5u);
  for (size_t i = 0; i < v.size(); ++i) {
    EXPECT_TRUE(at::equal(back[i], v[i]));
    EXPECT_EQ(back[i].strides(), v[i].strides());
    EXPECT_EQ(back[i].storage_offset(), v[i].storage_offset());
  }
  // One storage after loads: a write through one view shows through the others.
  back[1].fill_(-1);
  EXPECT_EQ(back[0].sum().item<float>(), -24.0f);
  EXPECT_EQ(back[0].data_ptr(), back[4].data_ptr());
}

TEST_P(SerializeTensor, UndefinedAndRequiresGrad) {
  at::Tensor undefined;
  EXPECT_FALSE(round_trip(undefined, GetParam()).defined());
  at::Tensor w = at::ones({3}).requires_grad_(true);
  at::Tensor back = round_trip(w, GetParam());
  EXPECT_TRUE(back.requires_grad());
  EXPECT_TRUE(at::equal(back.detach(), w.detach()));
}

TEST_P(SerializeTensor, UserStructWithTensors) {
  Batch b{at::randn({8, 3}), at::randint(0, 10, {8}), {{1, 2, "a"}}, {{"ids", {4, 5}}}};
  Batch back = round_trip(b, GetParam());
  EXPECT_TRUE(at::equal(back.data, b.data));
  EXPECT_TRUE(at::equal(back.target, b.target));
  EXPECT_EQ(back.points, b.points);
  EXPECT_EQ(back.meta, b.meta);
}

TEST_P(SerializeTensor, IValues) {
  at::Tensor t = at::arange(6).reshape({2, 3});
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("tensor", t);
  d.insert("n", int64_t{3});
  c10::List<int64_t> ints({1, 2, 3});
  c10::IValue v = c10::ivalue::Tuple::create(
      {c10::IValue(), c10::IValue(true), c10::IValue(int64_t{-7}), c10::IValue(2.5),
       c10::IValue(c10::complex<double>(1, -2)), c10::IValue(std::string("str")), c10::IValue(t),
       c10::IValue(ints), c10::IValue(d), c10::IValue(c10::List<at::Tensor>({t, t}))});
  c10::IValue back = round_trip(v, GetParam());
  ASSERT_TRUE(back.isTuple());
  const auto& e = back.toTupleRef().elements();
  ASSERT_EQ(e.size(), 10u);
  EXPECT_TRUE(e[0].isNone());
  EXPECT_EQ(e[1].toBool(), true);
  EXPECT_EQ(e[2].toInt(), -7);
  EXPECT_EQ(e[3].toDouble(), 2.5);
  EXPECT_EQ(e[4].toComplexDouble(), c10::complex<double>(1, -2));
  EXPECT_EQ(e[5].toStringRef(), "str");
  EXPECT_TRUE(at::equal(e[6].toTensor(), t));
  EXPECT_EQ(e[7].toIntVector(), (std::vector<int64_t>{1, 2, 3}));
  auto bd = e[8].toGenericDict();
  EXPECT_TRUE(at::equal(bd.at("tensor").toTensor(), t));
  EXPECT_EQ(bd.at("n").toInt(), 3);
  auto tl = e[9].toTensorVector();
  ASSERT_EQ(tl.size(), 2u);
  EXPECT_EQ(tl[0].data_ptr(), tl[1].data_ptr()) << "identity kept inside IValues";
  EXPECT_EQ(tl[0].data_ptr(), e[6].toTensor().data_ptr());
}

INSTANTIATE_TEST_SUITE_P(Modes, SerializeTensor, ::testing::Values(true, false),
                         [](const auto& param_info) {
                           return param_info.param ? "copy" : "shared";
                         });

TEST(SerializeHostile, EveryTruncationThrows) {
  Batch b{at::randn({4, 2}), at::arange(4), {{1, 2, "x"}}, {{"k", {1}}}};
  tp::Payload full = tp::dumps(b);
  for (size_t n = 0; n < full.bytes.size(); ++n) {
    tp::Payload cut{full.bytes.substr(0, n), {}};
    EXPECT_THROW(tp::loads<Batch>(cut), tp::SerializationError) << "prefix " << n;
  }
}

TEST(SerializeHostile, TrailingBytesAndWrongTypeThrow) {
  tp::Payload p = tp::dumps(std::string("hello"));
  p.bytes += "x";
  EXPECT_THROW(tp::loads<std::string>(p), tp::SerializationError);
  EXPECT_THROW(tp::loads<at::Tensor>(tp::dumps(std::vector<int>{1, 2, 3})), tp::SerializationError);
  EXPECT_THROW(tp::loads<int>(tp::Payload{"garbage!", {}}), tp::SerializationError);
}

// A tensor dumps cannot carry is an argument error: ValueError naming it (was c10::Error).
TEST(SerializeHostile, TensorsThatCannotTravelAreValueErrors) {
  EXPECT_THROW(tp::dumps(at::eye(3).to_sparse()), tp::ValueError);
  EXPECT_THROW(tp::dumps(std::vector<at::Tensor>{at::zeros({2}), at::eye(2).to_sparse()}),
               tp::ValueError);
}

TEST(SerializeHostile, HugeSizeClaimsDoNotAllocate) {
  // A vector<double> claiming 2^60 elements: refused by the size check, not by bad_alloc.
  tp::Payload p = tp::dumps(std::vector<double>{1.0});
  uint64_t huge = uint64_t{1} << 60;
  std::memcpy(p.bytes.data() + 5, &huge, 8);
  try {
    tp::loads<std::vector<double>>(p);
    FAIL();
  } catch (const tp::SerializationError& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds"), std::string::npos) << e.what();
  }
  // A tensor claiming more storage bytes than the payload holds.
  tp::Payload t = tp::dumps(at::ones({4}));
  const size_t nbytes_at = t.bytes.size() - 16 - 8;  // 16 data bytes, u64 nbytes before them
  std::memcpy(t.bytes.data() + nbytes_at, &huge, 8);
  EXPECT_THROW(tp::loads<at::Tensor>(t), tp::SerializationError);
}

TEST(SerializeHostile, RandomAndMutatedBytesNeverCrash) {
  std::mt19937_64 rng(1234);
  c10::IValue v = c10::ivalue::Tuple::create(
      {c10::IValue(at::ones({3})), c10::IValue("s"), c10::IValue(c10::List<int64_t>({1, 2}))});
  tp::Payload good = tp::dumps(v);
  int rejected = 0;
  for (int i = 0; i < 3000; ++i) {
    tp::Payload p{good.bytes, {}};
    for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k)
      p.bytes[rng() % p.bytes.size()] = static_cast<char>(rng());
    try {
      (void)tp::loads<c10::IValue>(p);
    } catch (const tp::SerializationError&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 0);
  for (int i = 0; i < 1000; ++i) {
    std::string bytes(rng() % 200, '\0');
    for (auto& c : bytes) c = static_cast<char>(rng());
    if (i % 2 == 0 && bytes.size() >= 5) std::memcpy(bytes.data(), "TPAR\1", 5);
    EXPECT_THROW((void)tp::loads<Batch>(tp::Payload{bytes, {}}), tp::SerializationError);
  }
}

TEST(SerializeHostile, DeepNestingIsRefused) {
  std::string bytes = "TPAR\1";
  for (int i = 0; i < 100000; ++i) {
    bytes.push_back(9);  // tuple
    uint64_t one = 1;
    bytes.append(reinterpret_cast<const char*>(&one), 8);
  }
  EXPECT_THROW((void)tp::loads<c10::IValue>(tp::Payload{bytes, {}}), tp::SerializationError);
}

TEST(SerializeHostile, SharedHandleWithoutFdOrBadName) {
  at::Tensor t = at::ones({8});
  tp::Payload p = tp::dumps(t, {.copy_tensor = false});
  tp::Payload nofd{p.bytes, {}};
  EXPECT_THROW((void)tp::loads<at::Tensor>(nofd), tp::SerializationError);
  // A file that is not a torchpar segment, with a handle that names it (dev and ino: a
  // handle naming a segment this process has mapped is served from that mapping, fd unseen).
  tp::Payload wrongfd{p.bytes, {}};
  wrongfd.fds.emplace_back(::memfd_create("notours", 0));
  ASSERT_EQ(::ftruncate(wrongfd.fds[0].get(), 1 << 16), 0);
  struct stat real {
  }, fake{};
  ASSERT_EQ(::fstat(p.fds.at(0).get(), &real), 0);
  ASSERT_EQ(::fstat(wrongfd.fds[0].get(), &fake), 0);
  const uint64_t real_id[2] = {static_cast<uint64_t>(real.st_dev),
                               static_cast<uint64_t>(real.st_ino)};
  const uint64_t fake_id[2] = {static_cast<uint64_t>(fake.st_dev),
                               static_cast<uint64_t>(fake.st_ino)};
  const auto pos = wrongfd.bytes.find(std::string(reinterpret_cast<const char*>(real_id), 16));
  ASSERT_NE(pos, std::string::npos) << "the handle's dev and ino are not in the payload";
  std::memcpy(wrongfd.bytes.data() + pos, fake_id, 16);
  EXPECT_THROW((void)tp::loads<at::Tensor>(wrongfd), tp::SerializationError);
  // Consume the reference the first dumps took, as a receiver would.
  (void)tp::loads<at::Tensor>(p);
}

TEST(PayloadIo, SocketpairBothModesAcrossProcesses) {
  for (bool copy : {true, false}) {
    auto c = tp::testing::fork_child([](int sock) {
      for (int i = 0; i < 3; ++i) {
        auto b = tp::loads<Batch>(tp::recv_payload(sock, std::chrono::seconds(30)));
        b.data.add_(1);  // visible to the parent only in shared mode
        tp::send_payload(sock, tp::dumps(b.points));
      }
      return 0;
    });
    Batch b{at::zeros({1000}), at::arange(3), {{7, 8, "p"}}, {}};
    for (int i = 0; i < 3; ++i) {
      tp::send_payload(c.sock, tp::dumps(b, {.copy_tensor = copy}));
      auto pts = tp::loads<std::vector<Point>>(tp::recv_payload(c.sock, std::chrono::seconds(30)));
      EXPECT_EQ(pts, b.points);
    }
    EXPECT_EQ(b.data.sum().item<float>(), copy ? 0.0f : 3000.0f);
    EXPECT_EQ(tp::testing::wait_child(c), 0);
  }
}

TEST(PayloadIo, ManyFdsInOnePayload) {
  // 600 distinct large segments -> 600 fds, more than one SCM_RIGHTS message carries.
  std::vector<at::Tensor> ts;
  for (int i = 0; i < 600; ++i)
    ts.push_back(tp::empty_shared({300 << 10}, at::kByte).fill_(i % 256));
  tp::Payload p = tp::dumps(ts, {.copy_tensor = false});
  EXPECT_EQ(p.fds.size(), 600u);
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  std::thread writer([&] { tp::send_payload(sv[0], p); });
  tp::Payload q = tp::recv_payload(sv[1], std::chrono::seconds(30));
  writer.join();
  auto back = tp::loads<std::vector<at::Tensor>>(q);
  for (int i = 0; i < 600; i += 37) EXPECT_EQ(back[i][17].item<uint8_t>(), i % 256);
  ::close(sv[0]);
  ::close(sv[1]);
}

TEST(PayloadIo, TimeoutAndClosedPeer) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  EXPECT_THROW(tp::recv_payload(sv[1], std::chrono::milliseconds(50)), tp::TimeoutError);
  ::close(sv[0]);
  EXPECT_THROW(tp::recv_payload(sv[1], std::chrono::milliseconds(1000)), tp::ClosedError);
  ::close(sv[1]);
  // A frame cut in the middle.
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  tp::Payload p = tp::dumps(std::string(1000, 'x'));
  std::string wire;
  {
    int pv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pv), 0);
    tp::send_payload(pv[0], p);
    wire.resize(16 + 100);
    ASSERT_EQ(::read(pv[1], wire.data(), wire.size()), static_cast<ssize_t>(wire.size()));
    ::close(pv[0]);
    ::close(pv[1]);
  }
  ASSERT_EQ(::write(sv[0], wire.data(), wire.size()), static_cast<ssize_t>(wire.size()));
  ::close(sv[0]);
  EXPECT_THROW(tp::recv_payload(sv[1], std::chrono::milliseconds(1000)), tp::ClosedError);
  ::close(sv[1]);
}

namespace {
struct Node {
  std::vector<Node> kids;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(kids);
  }
};
}  // namespace

TEST(SerializeHostile, SharedHandleLoadsOnce) {
  at::Tensor t = at::ones({8});
  tp::Payload p = tp::dumps(t, {.copy_tensor = false});
  at::Tensor a = tp::loads<at::Tensor>(p);
  EXPECT_TRUE(at::equal(a, t));
  try {
    (void)tp::loads<at::Tensor>(p);
    FAIL() << "a second load of the same shared payload must be refused";
  } catch (const tp::SerializationError& e) {
    EXPECT_NE(std::string(e.what()).find("loaded once"), std::string::npos) << e.what();
  }
}

TEST(SerializeHostile, SharedPtrIdOfAnotherTypeIsRefused) {
  auto s = std::make_shared<std::string>("a string of some length");
  auto v = std::make_shared<std::vector<float>>(3, 1.0f);
  tp::Payload ok = tp::dumps(std::make_tuple(s, v, s));
  auto back =
      tp::loads<std::tuple<std::shared_ptr<std::string>, std::shared_ptr<std::vector<float>>,
                           std::shared_ptr<std::string>>>(ok);
  EXPECT_EQ(std::get<0>(back).get(), std::get<2>(back).get()) << "identity kept";
  EXPECT_EQ(*std::get<1>(back), *v);
  // Forge: the vector's slot refers back to the string's id (1).
  tp::Payload bad =
      tp::dumps(std::make_tuple(uint32_t{0x80000001u}, std::string("abc"), uint32_t{1}));
  EXPECT_THROW(
      (void)(tp::loads<
             std::tuple<std::shared_ptr<std::string>, std::shared_ptr<std::vector<float>>>>(bad)),
      tp::SerializationError);
}

TEST(SerializeHostile, DeepUserRecursionIsRefused) {
  // Node{kids=[Node{kids=[...]}]} 100000 levels deep: size tag 1 per level.
  std::string bytes = "TPAR\1";
  for (int i = 0; i < 100000; ++i) {
    uint64_t one = 1;
    bytes.append(reinterpret_cast<const char*>(&one), 8);
  }
  uint64_t zero = 0;
  bytes.append(reinterpret_cast<const char*>(&zero), 8);
  try {
    (void)tp::loads<Node>(tp::Payload{bytes, {}});
    FAIL();
  } catch (const tp::SerializationError& e) {
    EXPECT_NE(std::string(e.what()).find("nested"), std::string::npos) << e.what();
  }
  Node shallow{{Node{{Node{}}}, Node{}}};
  EXPECT_EQ(round_trip(shallow).kids.size(), 2u);
}

TEST(SerializeHostile, LargeElementsCannotAmplifyAllocation) {
  // 1 MiB of payload claiming 2^20 elements of 16 KiB each must fail on the bytes, not
  // after allocating 16 GiB.
  std::string bytes = "TPAR\1";
  uint64_t n = 1 << 20;
  bytes.append(reinterpret_cast<const char*>(&n), 8);
  bytes.append(1 << 20, '\0');
  using Big = std::vector<std::array<float, 4096>>;
  EXPECT_THROW((void)tp::loads<Big>(tp::Payload{bytes, {}}), tp::SerializationError);
  EXPECT_THROW((void)tp::loads<std::vector<double>>(tp::Payload{bytes, {}}),
               tp::SerializationError);
  EXPECT_THROW((void)tp::loads<std::u32string>(tp::Payload{bytes, {}}), tp::SerializationError);
}

TEST(Serialize, TemporaryStoragesKeepTheirOwnIds) {
  // conj() views are resolved into temporary storages during dumps; each must keep its
  // own data even when the allocator hands the second the first one's address.
  at::Tensor a = at::complex(at::ones({4}), at::ones({4}));
  at::Tensor b = at::complex(at::full({4}, 2.0f), at::full({4}, 3.0f));
  auto back = round_trip(std::vector<at::Tensor>{a.conj(), b.conj()});
  EXPECT_TRUE(at::equal(back[0], a.conj().resolve_conj()));
  EXPECT_TRUE(at::equal(back[1], b.conj().resolve_conj()));
}

TEST(Serialize, PublicDumpsIsTheDefaultContext) {
  // dumps(value, options) is dumps_with(value, {.copy_tensor = options.copy_tensor}): the
  // same bytes, with every internal knob at its default (fds passed, no side channel).
  const std::vector<int> v{1, 2, 3};
  EXPECT_EQ(tp::dumps(v).bytes, tp::detail::dumps_with(v, {}).bytes);
  at::Tensor t = at::arange(8, at::kFloat);
  const tp::Payload p = tp::dumps(t);
  EXPECT_EQ(p.bytes, tp::detail::dumps_with(t, {.copy_tensor = true}).bytes);
  EXPECT_TRUE(p.fds.empty());
  at::Tensor s = at::arange(8, at::kFloat);
  tp::Payload shared = tp::dumps(s, {.copy_tensor = false});
  EXPECT_EQ(shared.fds.size(), tp::get_sharing_strategy() == "file_descriptor" ? 1u : 0u);
  EXPECT_TRUE(at::equal(tp::loads<at::Tensor>(std::move(shared)), s));
}

TEST(PayloadIo, SharedTensorWithoutFdsReopensThroughProc) {
  // pass_fds=false: bytes only (as a shared-memory queue carries them); the receiver opens
  // the exporter's segment through /proc/<pid>/fd/<n>.
  at::Tensor t = at::zeros({256});
  tp::Payload p = tp::detail::dumps_with(t, {.copy_tensor = false, .pass_fds = false});
  EXPECT_TRUE(p.fds.empty());
  auto c = tp::testing::fork_child([bytes = p.bytes](int sock) {
    auto u = tp::loads<at::Tensor>(tp::Payload{bytes, {}});
    u.fill_(5);
    tp::testing::send_line(sock, "done");
    return 0;
  });
  ASSERT_EQ(tp::testing::recv_line(c.sock), "done");
  EXPECT_EQ(t.sum().item<float>(), 5.0f * 256);
  EXPECT_EQ(tp::testing::wait_child(c), 0);
  // The child claimed the one export: a second load here is refused.
  EXPECT_THROW((void)tp::loads<at::Tensor>(p), tp::SerializationError);
}

namespace {

bool points_into(const at::Tensor& t, const char* base, size_t size) {
  const auto* p = static_cast<const char*>(t.data_ptr());
  return p >= base && p < base + size;
}

}  // namespace

TEST(SerializeLarge, ConsumedPayloadIsAliasedNotCopied) {
  const at::Tensor t = at::arange(1 << 20, at::kFloat);  // 4 MiB: the whole payload
  tp::Payload p = tp::dumps(t);
  const char* base = p.bytes.data();
  const size_t size = p.bytes.size();
  at::Tensor back = tp::loads<at::Tensor>(std::move(p));
  ASSERT_TRUE(points_into(back, base, size));
  EXPECT_EQ((static_cast<const char*>(back.data_ptr()) - base) % 64, 0);  // mode 4 alignment
  EXPECT_TRUE(at::equal(back, t));
  back.add_(1);  // its own memory: the source is untouched
  EXPECT_EQ(t[5].item<float>(), 5.0f);
  EXPECT_EQ(back[5].item<float>(), 6.0f);
  // Resizable as a copied tensor: the resize moves it to memory of its own.
  back.resize_({2 << 20});
  EXPECT_FALSE(points_into(back, base, size));
  EXPECT_EQ(back[(1 << 20) - 1].item<float>(), static_cast<float>(1 << 20));

  // A payload the caller keeps is copied from, and loads again.
  tp::Payload kept = tp::dumps(t);
  at::Tensor a = tp::loads<at::Tensor>(kept);
  at::Tensor b = tp::loads<at::Tensor>(kept);
  EXPECT_FALSE(points_into(a, kept.bytes.data(), kept.bytes.size()));
  EXPECT_NE(a.data_ptr(), b.data_ptr());
  EXPECT_TRUE(at::equal(a, t) && at::equal(b, t));
}

TEST(SerializeLarge, TensorsAliasingOnePayloadOutliveEachOther) {
  const at::Tensor x = at::full({1 << 19}, 3.0, at::kDouble);  // 4 MiB each
  const at::Tensor y = at::full({1 << 20}, 7, at::kInt);
  tp::Payload p = tp::dumps(std::make_tuple(x, std::string("between"), y));
  const char* base = p.bytes.data();
  const size_t size = p.bytes.size();
  auto [bx, s, by] = tp::loads<std::tuple<at::Tensor, std::string, at::Tensor>>(std::move(p));
  EXPECT_TRUE(points_into(bx, base, size) && points_into(by, base, size));
  EXPECT_EQ(s, "between");
  bx = at::Tensor();  // the buffer stays while `by` holds it
  EXPECT_TRUE(at::equal(by, y));
}

TEST(SerializeLarge, SmallShareOfAPayloadIsCopied) {
  // 1 MiB of tensor in a 16 MiB payload: aliasing would keep 16x its size alive.
  const at::Tensor t = at::ones({1 << 18}, at::kFloat);
  tp::Payload p = tp::dumps(std::make_pair(std::vector<char>(16 << 20, 'x'), t));
  const char* base = p.bytes.data();
  const size_t size = p.bytes.size();
  auto [filler, back] = tp::loads<std::pair<std::vector<char>, at::Tensor>>(std::move(p));
  EXPECT_FALSE(points_into(back, base, size));
  EXPECT_TRUE(at::equal(back, t));
  EXPECT_EQ(filler.size(), size_t{16} << 20);
}

TEST(SerializeLarge, LargeBuffersAreReusedAndCanBeFreed) {
  tp::empty_payload_cache();
  const at::Tensor t = at::randn({10 << 20});  // 40 MiB
  const char* first = nullptr;
  {
    tp::Payload p = tp::dumps(t);
    first = p.bytes.data();
    at::Tensor back = tp::loads<at::Tensor>(std::move(p));
    EXPECT_TRUE(at::equal(back, t));
  }  // the buffer goes back to the cache with `back`
  tp::Payload p2 = tp::dumps(t);
  EXPECT_EQ(p2.bytes.data(), first);
  // A kept payload's large copy also comes from the cache, and goes back to it.
  at::Tensor copied = tp::loads<at::Tensor>(p2);
  EXPECT_TRUE(at::equal(copied, t));
  const void* copied_at = copied.data_ptr();
  copied = at::Tensor();
  tp::Payload p3 = tp::dumps(t);
  EXPECT_EQ(static_cast<const void*>(p3.bytes.data()), copied_at);
  tp::empty_payload_cache();
  // In a forked child, which drops the parent's buffers, the same round trip works.
  auto child = tp::testing::fork_child([&](int) {
    at::Tensor again = tp::loads<at::Tensor>(tp::dumps(t));
    return at::equal(again, t) ? 0 : 1;
  });
  EXPECT_EQ(tp::testing::wait_child(child), 0);
}

TEST(SerializeHostile, AlignedStorageRecordIsChecked) {
  // dumps of a 1-D tensor of 1 MiB: magic+version (5), tensor header (32), storage id (4),
  // mode (1) at 37, nbytes (8), then the padding length at 46.
  tp::Payload good = tp::dumps(at::ones({1 << 18}, at::kFloat));
  ASSERT_EQ(good.bytes[37], 4);
  tp::Payload bad_pad{good.bytes, {}};
  bad_pad.bytes[46] = static_cast<char>(64);
  EXPECT_THROW((void)tp::loads<at::Tensor>(std::move(bad_pad)), tp::SerializationError);
  for (size_t n : {size_t{46}, size_t{47}, size_t{60}, good.bytes.size() - 1}) {
    EXPECT_THROW((void)tp::loads<at::Tensor>(tp::Payload{good.bytes.substr(0, n), {}}),
                 tp::SerializationError)
        << "prefix " << n;
  }
  // A consumed payload that fails to load (wrong type) throws and leaks nothing.
  using TensorAndInt = std::pair<at::Tensor, int>;
  EXPECT_THROW((void)tp::loads<TensorAndInt>(tp::Payload{good.bytes, {}}), tp::SerializationError);
  EXPECT_TRUE(at::equal(tp::loads<at::Tensor>(tp::Payload{good.bytes, {}}),
                        at::ones({1 << 18}, at::kFloat)));
}
