// Python's key semantics for the pickle value model (see pickle.h): key_equal, key_hash and
// the decoder's deduplication of dict keys and set elements.
#include <cmath>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "manager/pickle_impl.h"
#include "torchpar/manager/pickle.h"

namespace torchpar::pickle {

// ---- key semantics -----------------------------------------------------------------------------

namespace {

constexpr uint64_t kHashModulus = (uint64_t{1} << 61) - 1;  // CPython's _PyHASH_MODULUS
constexpr int kHashBits = 61;

int64_t finish_hash(uint64_t x, bool negative) {
  auto h = static_cast<int64_t>(negative ? (~x + 1) : x);
  return h == -1 ? -2 : h;
}

int64_t hash_int64(int64_t v) {
  const bool neg = v < 0;
  const uint64_t mag = neg ? (~static_cast<uint64_t>(v) + 1) : static_cast<uint64_t>(v);
  return finish_hash(mag % kHashModulus, neg);
}

int64_t hash_bigint(std::string_view le) {
  const bool neg = impl::negative_le(le);
  const std::string mag = impl::magnitude_le(le);
  unsigned __int128 r = 0;
  for (size_t i = mag.size(); i-- > 0;)
    r = ((r << 8) | static_cast<uint8_t>(mag[i])) % kHashModulus;
  return finish_hash(static_cast<uint64_t>(r), neg);
}

// CPython's _Py_HashDouble for finite values.
int64_t hash_double(double v) {
  if (std::isinf(v)) return v > 0 ? 314159 : -314159;
  if (std::isnan(v)) return 0;
  int e;
  double m = std::frexp(v, &e);
  bool neg = false;
  if (m < 0) {
    neg = true;
    m = -m;
  }
  uint64_t x = 0;
  while (m != 0) {
    x = ((x << 28) & kHashModulus) | x >> (kHashBits - 28);
    m *= 268435456.0;  // 2**28
    e -= 28;
    const auto y = static_cast<uint64_t>(m);
    m -= static_cast<double>(y);
    x += y;
    if (x >= kHashModulus) x -= kHashModulus;
  }
  e = e >= 0 ? e % kHashBits : kHashBits - 1 - ((-1 - e) % kHashBits);
  x = ((x << e) & kHashModulus) | x >> (kHashBits - e);
  return finish_hash(x, neg);
}

uint64_t fnv1a(std::string_view s, uint64_t seed) {
  uint64_t h = 14695981039346656037ull ^ seed;
  for (char ch : s) {
    h ^= static_cast<uint8_t>(ch);
    h *= 1099511628211ull;
  }
  return h;
}

[[noreturn]] void unsupported(const Value& v) { throw UnsupportedKeyError(v.type_name()); }

/// The exact integer value of an integral double of magnitude >= 2**63 (two's complement).
std::string le_of_big_double(double d) {
  int e;
  const double m = std::frexp(std::fabs(d), &e);
  const auto mant = static_cast<uint64_t>(std::ldexp(m, 53));
  const int shift = e - 53;  // >= 11 here
  std::string mag(static_cast<size_t>(shift / 8), '\0');
  unsigned __int128 rest = static_cast<unsigned __int128>(mant) << (shift % 8);
  while (rest != 0) {
    mag.push_back(static_cast<char>(static_cast<uint8_t>(rest & 0xff)));
    rest >>= 8;
  }
  return impl::signed_le(std::move(mag), d < 0);
}

bool int_equals_double(int64_t i, double d) {
  if (!std::isfinite(d) || std::trunc(d) != d) return false;
  if (d < -9223372036854775808.0 || d >= 9223372036854775808.0) return false;
  return static_cast<int64_t>(d) == i;
}

bool bigint_equals_double(const std::string& le, double d) {
  if (!std::isfinite(d) || std::trunc(d) != d) return false;
  if (d >= -9223372036854775808.0 && d < 9223372036854775808.0) return false;
  return le_of_big_double(d) == le;
}

}  // namespace

bool is_key_type(const Value& v) noexcept {
  switch (v.kind()) {
    case Value::Kind::kNone:
    case Value::Kind::kBool:
    case Value::Kind::kInt:
    case Value::Kind::kBigInt:
    case Value::Kind::kFloat:
    case Value::Kind::kStr:
    case Value::Kind::kBytes:
      return true;
    case Value::Kind::kTuple:
      for (const Value& x : std::get<Tuple>(v.data()).items)
        if (!is_key_type(x)) return false;
      return true;
    default:
      return false;
  }
}

int64_t key_hash(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kNone:
      return 0x4e6f6e65;  // fixed; CPython 3.11 hashes None by address
    case Value::Kind::kBool:
      return std::get<bool>(v.data()) ? 1 : 0;
    case Value::Kind::kInt:
      return hash_int64(std::get<int64_t>(v.data()));
    case Value::Kind::kBigInt:
      return hash_bigint(std::get<BigInt>(v.data()).bytes);
    case Value::Kind::kFloat:
      return hash_double(std::get<double>(v.data()));
    case Value::Kind::kStr:
      return static_cast<int64_t>(fnv1a(std::get<Str>(v.data()).utf8, 0x5354));
    case Value::Kind::kBytes:
      return static_cast<int64_t>(fnv1a(std::get<Bytes>(v.data()).data, 0x4259));
    case Value::Kind::kTuple: {
      // CPython 3.8+'s tuplehash (xxHash's round on 64-bit).
      constexpr uint64_t kPrime1 = 11400714785074694791ull;
      constexpr uint64_t kPrime2 = 14029467366897019727ull;
      constexpr uint64_t kPrime5 = 2870177450012600261ull;
      const auto& items = std::get<Tuple>(v.data()).items;
      uint64_t acc = kPrime5;
      for (const Value& x : items) {
        const auto lane = static_cast<uint64_t>(key_hash(x));
        acc += lane * kPrime2;
        acc = (acc << 31) | (acc >> 33);
        acc *= kPrime1;
      }
      acc += items.size() ^ (kPrime5 ^ 3527539ull);
      if (acc == ~uint64_t{0}) return 1546275796;
      return static_cast<int64_t>(acc);
    }
    default:
      unsupported(v);
  }
}

bool key_equal(const Value& a, const Value& b) {
  using K = Value::Kind;
  const K ka = a.kind();
  const K kb = b.kind();
  if (!is_key_type(a)) unsupported(a);
  if (!is_key_type(b)) unsupported(b);
  const auto numeric = [](K k) {
    return k == K::kBool || k == K::kInt || k == K::kBigInt || k == K::kFloat;
  };
  if (numeric(ka) && numeric(kb)) {
    const auto as_int = [](const Value& v) -> int64_t {
      return v.kind() == K::kBool ? int64_t{std::get<bool>(v.data())} : std::get<int64_t>(v.data());
    };
    const bool ia = ka == K::kBool || ka == K::kInt;
    const bool ib = kb == K::kBool || kb == K::kInt;
    if (ia && ib) return as_int(a) == as_int(b);
    if (ka == K::kFloat && kb == K::kFloat)
      return std::get<double>(a.data()) == std::get<double>(b.data());
    if (ka == K::kBigInt && kb == K::kBigInt)
      return std::get<BigInt>(a.data()).bytes == std::get<BigInt>(b.data()).bytes;
    if (ka == K::kFloat && ib) return int_equals_double(as_int(b), std::get<double>(a.data()));
    if (kb == K::kFloat && ia) return int_equals_double(as_int(a), std::get<double>(b.data()));
    if (ka == K::kFloat && kb == K::kBigInt)
      return bigint_equals_double(std::get<BigInt>(b.data()).bytes, std::get<double>(a.data()));
    if (kb == K::kFloat && ka == K::kBigInt)
      return bigint_equals_double(std::get<BigInt>(a.data()).bytes, std::get<double>(b.data()));
    return false;  // an int64 and a BigInt never hold the same value
  }
  if (ka != kb) return false;
  switch (ka) {
    case K::kNone:
      return true;
    case K::kStr:
      return std::get<Str>(a.data()).utf8 == std::get<Str>(b.data()).utf8;
    case K::kBytes:
      return std::get<Bytes>(a.data()).data == std::get<Bytes>(b.data()).data;
    case K::kTuple: {
      const auto& x = std::get<Tuple>(a.data()).items;
      const auto& y = std::get<Tuple>(b.data()).items;
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!key_equal(x[i], y[i])) return false;
      return true;
    }
    default:
      return false;
  }
}

void impl::dedupe_keys(std::vector<Value>& keys, std::vector<Value>* values) {
  if (keys.size() < 2) return;
  for (const Value& k : keys)
    if (!is_key_type(k)) return;
  std::vector<size_t> keep;  // indices into keys, in order
  keep.reserve(keys.size());
  bool changed = false;
  std::unordered_map<Value, size_t, KeyHash, KeyEqual> first;
  first.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    auto [it, inserted] = first.try_emplace(keys[i], keep.size());
    if (inserted) {
      keep.push_back(i);
      continue;
    }
    changed = true;
    if (values != nullptr) (*values)[keep[it->second]] = std::move((*values)[i]);
  }
  if (!changed) return;
  std::vector<Value> k2;
  std::vector<Value> v2;
  for (size_t i : keep) {
    k2.push_back(std::move(keys[i]));
    if (values != nullptr) v2.push_back(std::move((*values)[i]));
  }
  keys = std::move(k2);
  if (values != nullptr) *values = std::move(v2);
}

}  // namespace torchpar::pickle
