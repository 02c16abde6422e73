// Python's pickle format for the manager protocol: the value model, Python's key semantics
// and the encoder. The decoder is in pickle_decode.cpp. See pickle.h.
#include "manager/pickle.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "manager/pickle_impl.h"

namespace torchpar::detail::pickle {

// ---- errors ------------------------------------------------------------------------------------

PickleError::PickleError(const std::string& message) : ValueError("pickle: " + message) {}

PickleError::PickleError(const std::string& message, int opcode, size_t offset)
    : ValueError(opcode < 0 ? fmt::format("pickle: {} (at offset {}, the end of the input)",
                                          message, offset)
                            : fmt::format("pickle: {} (opcode {} at offset {})", message,
                                          impl::opcode_name(opcode), offset)),
      offset_(offset) {}

UnsupportedKeyError::UnsupportedKeyError(std::string type_name)
    : ValueError(fmt::format(
          "{} is not supported as a dict key or set element by a foreign manager server "
          "(supported: None, bool, int, float, str, bytes and tuples of those){}",
          type_name,
          type_name == "list" || type_name == "dict" || type_name == "set" ||
                  type_name == "bytearray"
              ? fmt::format("; Python: TypeError: unhashable type: '{}'", type_name)
              : "")),
      type_name_(std::move(type_name)) {}

namespace impl {

std::string opcode_name(int op) {
  const char* name = nullptr;
  switch (op) {
#define TORCHPAR_PICKLE_OPCODE_NAME(NAME, BYTE) \
  case BYTE:                                    \
    name = #NAME;                               \
    break;
    TORCHPAR_PICKLE_OPCODES(TORCHPAR_PICKLE_OPCODE_NAME)
#undef TORCHPAR_PICKLE_OPCODE_NAME
    default:
      break;
  }
  return name != nullptr ? fmt::format("0x{:02x} {}", op, name)
                         : fmt::format("0x{:02x} (unknown)", op);
}

bool valid_utf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
      cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<uint8_t>(s[i + k]);
      if ((cc & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3f);
    }
    // Overlong forms and code points past U+10FFFF are invalid; surrogates (U+D800-DFFF) are
    // kept, as Python's 'surrogatepass' reads and writes them.
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff))) return false;
    i += len;
  }
  return true;
}

void normalize_le(std::string& b) {
  while (b.size() >= 2) {
    const auto last = static_cast<uint8_t>(b.back());
    const auto prev = static_cast<uint8_t>(b[b.size() - 2]);
    if ((last == 0x00 && (prev & 0x80) == 0) || (last == 0xff && (prev & 0x80) != 0)) {
      b.pop_back();
    } else {
      break;
    }
  }
  if (b.size() == 1 && b[0] == 0) b.clear();
}

std::string le_of_int64(int64_t v) {
  std::string b(8, '\0');
  auto u = static_cast<uint64_t>(v);
  for (size_t i = 0; i < 8; ++i) b[i] = static_cast<char>((u >> (8 * i)) & 0xff);
  normalize_le(b);
  return b;
}

bool negative_le(std::string_view b) {
  return !b.empty() && (static_cast<uint8_t>(b.back()) & 0x80) != 0;
}

/// The magnitude of a two's-complement number, little-endian, unsigned.
std::string magnitude_le(std::string_view b) {
  std::string m(b);
  if (!negative_le(b)) return m;
  unsigned carry = 1;
  for (char& ch : m) {
    unsigned v = (~static_cast<unsigned>(static_cast<uint8_t>(ch)) & 0xff) + carry;
    ch = static_cast<char>(v & 0xff);
    carry = v >> 8;
  }
  return m;
}

/// Two's complement of an unsigned little-endian magnitude, with room for the sign.
std::string signed_le(std::string magnitude, bool negative) {
  magnitude.push_back('\0');
  if (negative) {
    unsigned carry = 1;
    for (char& ch : magnitude) {
      unsigned v = (~static_cast<unsigned>(static_cast<uint8_t>(ch)) & 0xff) + carry;
      ch = static_cast<char>(v & 0xff);
      carry = v >> 8;
    }
  }
  normalize_le(magnitude);
  return magnitude;
}

Value integer_from_le(std::string bytes) {
  normalize_le(bytes);
  if (bytes.size() > 8) return Value(BigInt{std::move(bytes)});
  uint64_t u = negative_le(bytes) ? ~uint64_t{0} : 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    u &= ~(uint64_t{0xff} << (8 * i));
    u |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  }
  return Value(static_cast<int64_t>(u));
}

bool integer_from_decimal(std::string_view text, Value* out) {
  bool negative = false;
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) {
    negative = text[0] == '-';
    text.remove_prefix(1);
  }
  // CPython 3.11 refuses to convert more than 4300 digits (quadratic time).
  if (text.empty() || text.size() > 4300) return false;
  std::string mag;  // unsigned little-endian
  for (char ch : text) {
    if (ch < '0' || ch > '9') return false;
    unsigned carry = static_cast<unsigned>(ch - '0');
    for (char& b : mag) {
      unsigned v = static_cast<unsigned>(static_cast<uint8_t>(b)) * 10 + carry;
      b = static_cast<char>(v & 0xff);
      carry = v >> 8;
    }
    while (carry != 0) {
      mag.push_back(static_cast<char>(carry & 0xff));
      carry >>= 8;
    }
  }
  *out = integer_from_le(signed_le(std::move(mag), negative));
  return true;
}

std::string decimal_of_le(std::string_view le) {
  const bool negative = negative_le(le);
  std::string mag = magnitude_le(le);
  // Base 10^9 limbs by repeated division of the big-endian magnitude.
  std::vector<uint32_t> be;
  for (size_t i = mag.size(); i-- > 0;) be.push_back(static_cast<uint8_t>(mag[i]));
  std::vector<uint32_t> limbs;
  while (!be.empty()) {
    std::vector<uint32_t> q;
    uint64_t rem = 0;
    for (uint32_t d : be) {
      uint64_t cur = (rem << 8) | d;
      uint32_t qd = static_cast<uint32_t>(cur / 1000000000u);
      rem = cur % 1000000000u;
      if (!q.empty() || qd != 0) q.push_back(qd);
    }
    limbs.push_back(static_cast<uint32_t>(rem));
    be = std::move(q);
  }
  if (limbs.empty()) return "0";
  std::string s = negative ? "-" : "";
  s += std::to_string(limbs.back());
  for (size_t i = limbs.size() - 1; i-- > 0;) s += fmt::format("{:09d}", limbs[i]);
  return s;
}

}  // namespace impl

// ---- Value -------------------------------------------------------------------------------------

Value Value::integer(std::string_view le_bytes) {
  return impl::integer_from_le(std::string(le_bytes));
}

Value Value::integer_from_decimal(std::string_view digits) {
  Value v;
  if (!impl::integer_from_decimal(digits, &v)) {
    throw PickleError(
        fmt::format("not a decimal integer of at most 4300 digits: '{}'", digits.substr(0, 64)));
  }
  return v;
}

Value Value::dict(std::vector<DictItem> items) { return Value(Dict{std::move(items)}); }

Value Value::object(std::string module, std::string name, std::vector<Value> args,
                    std::optional<Value> state, bool new_object) {
  Object o{{std::move(module), std::move(name)}, std::move(args), new_object, nullptr};
  if (state) o.state = std::make_shared<const Value>(std::move(*state));
  return Value(std::move(o));
}

namespace {

const char* const kKindNames[] = {"NoneType", "bool",  "int",       "int",   "float",
                                  "str",      "bytes", "bytearray", "tuple", "list",
                                  "dict",     "set",   "frozenset", "type",  "object"};

bool same_items(const std::vector<Value>& a, const std::vector<Value>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i])) return false;
  return true;
}

}  // namespace

void Value::throw_wrong_kind(size_t wanted) const {
  throw torchpar::ValueError(
      fmt::format("pickle value: expected {}, got {}", kKindNames[wanted], type_name()));
}

std::string Value::type_name() const {
  if (const auto* o = std::get_if<Object>(&data_)) {
    const size_t dot = o->type.name.rfind('.');
    return dot == std::string::npos ? o->type.name : o->type.name.substr(dot + 1);
  }
  return kKindNames[data_.index()];
}

bool operator==(const Value& a, const Value& b) {
  if (a.data_.index() != b.data_.index()) return false;
  return std::visit(
      [&](const auto& x) -> bool {
        using T = std::decay_t<decltype(x)>;
        const T& y = std::get<T>(b.data_);
        if constexpr (std::is_same_v<T, None>) {
          return true;
        } else if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, int64_t>) {
          return x == y;
        } else if constexpr (std::is_same_v<T, double>) {
          uint64_t bx, by;
          std::memcpy(&bx, &x, 8);
          std::memcpy(&by, &y, 8);
          return bx == by;
        } else if constexpr (std::is_same_v<T, BigInt>) {
          return x.bytes == y.bytes;
        } else if constexpr (std::is_same_v<T, Str>) {
          return x.utf8 == y.utf8;
        } else if constexpr (std::is_same_v<T, Bytes> || std::is_same_v<T, ByteArray>) {
          return x.data == y.data;
        } else if constexpr (std::is_same_v<T, Dict>) {
          if (x.items.size() != y.items.size()) return false;
          for (size_t i = 0; i < x.items.size(); ++i)
            if (!(x.items[i].key == y.items[i].key) || !(x.items[i].value == y.items[i].value))
              return false;
          return true;
        } else if constexpr (std::is_same_v<T, Global>) {
          return x.module == y.module && x.name == y.name;
        } else if constexpr (std::is_same_v<T, Object>) {
          if (x.type.module != y.type.module || x.type.name != y.type.name ||
              x.new_object != y.new_object || !same_items(x.args, y.args) ||
              (x.state == nullptr) != (y.state == nullptr))
            return false;
          return x.state == nullptr || *x.state == *y.state;
        } else {
          return same_items(x.items, y.items);
        }
      },
      a.data_);
}

// ---- repr --------------------------------------------------------------------------------------

namespace {

std::string repr_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // [-]d[.ddd]e[+-]XX, the shortest round-trip digits
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t e_at = sci.find('e');
  const int exp10 = std::stoi(sci.substr(e_at + 1));
  std::string digits = sci.substr(0, e_at);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  if (exp10 < -4 || exp10 >= 16) {  // Python's repr: scientific outside [1e-4, 1e16)
    std::string m = digits.substr(0, 1);
    if (digits.size() > 1) m += "." + digits.substr(1);
    return fmt::format("{}{}e{}{:02d}", sign, m, exp10 < 0 ? '-' : '+', std::abs(exp10));
  }
  if (exp10 < 0) return sign + "0." + std::string(static_cast<size_t>(-exp10 - 1), '0') + digits;
  const auto int_digits = static_cast<size_t>(exp10 + 1);
  if (digits.size() <= int_digits)
    return sign + digits + std::string(int_digits - digits.size(), '0') + ".0";
  return sign + digits.substr(0, int_digits) + "." + digits.substr(int_digits);
}

std::string repr_text(std::string_view s, bool is_bytes) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out = is_bytes ? "b" : "";
  out += quote;
  for (char ch : s) {
    const auto c = static_cast<uint8_t>(ch);
    if (ch == quote || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f || (is_bytes && c >= 0x80)) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += ch;  // non-ASCII str characters as they are (Python: the printable ones)
    }
  }
  out += quote;
  return out;
}

void repr_items(std::string& out, const std::vector<Value>& items) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += ", ";
    out += items[i].repr();
  }
}

}  // namespace

std::string Value::repr() const {
  return std::visit(
      [&](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, None>) {
          return "None";
        } else if constexpr (std::is_same_v<T, bool>) {
          return x ? "True" : "False";
        } else if constexpr (std::is_same_v<T, int64_t>) {
          return std::to_string(x);
        } else if constexpr (std::is_same_v<T, double>) {
          return repr_float(x);
        } else if constexpr (std::is_same_v<T, BigInt>) {
          // CPython 3.11 refuses str() of ints past 4300 digits too.
          return x.bytes.size() > 1780 ? fmt::format("<int of {} bytes>", x.bytes.size())
                                       : impl::decimal_of_le(x.bytes);
        } else if constexpr (std::is_same_v<T, Str>) {
          return repr_text(x.utf8, false);
        } else if constexpr (std::is_same_v<T, Bytes>) {
          return repr_text(x.data, true);
        } else if constexpr (std::is_same_v<T, ByteArray>) {
          return "bytearray(" + repr_text(x.data, true) + ")";
        } else if constexpr (std::is_same_v<T, Tuple>) {
          std::string out = "(";
          repr_items(out, x.items);
          return out + (x.items.size() == 1 ? ",)" : ")");
        } else if constexpr (std::is_same_v<T, List>) {
          std::string out = "[";
          repr_items(out, x.items);
          return out + "]";
        } else if constexpr (std::is_same_v<T, Dict>) {
          std::string out = "{";
          for (size_t i = 0; i < x.items.size(); ++i) {
            if (i > 0) out += ", ";
            out += x.items[i].key.repr() + ": " + x.items[i].value.repr();
          }
          return out + "}";
        } else if constexpr (std::is_same_v<T, Set>) {
          if (x.items.empty()) return "set()";
          std::string out = "{";
          repr_items(out, x.items);
          return out + "}";
        } else if constexpr (std::is_same_v<T, FrozenSet>) {
          if (x.items.empty()) return "frozenset()";
          std::string out = "frozenset({";
          repr_items(out, x.items);
          return out + "})";
        } else if constexpr (std::is_same_v<T, Global>) {
          return fmt::format("<class '{}.{}'>", x.module, x.name);
        } else {
          std::string out = type_name() + "(";
          repr_items(out, x.args);
          out += ")";
          if (x.state) out += " " + x.state->repr();
          return out;
        }
      },
      data_);
}

// ---- allow-list --------------------------------------------------------------------------------

namespace {
std::string allow_key(std::string_view module, std::string_view name) {
  std::string k;
  k.reserve(module.size() + name.size() + 1);
  k.append(module).append(" ").append(name);
  return k;
}
}  // namespace

GlobalAllowList::GlobalAllowList(
    std::initializer_list<std::pair<std::string_view, std::string_view>> names) {
  for (const auto& [m, n] : names) add(m, n);
}

void GlobalAllowList::add(std::string_view module, std::string_view name) {
  names_.insert(allow_key(module, name));
}

bool GlobalAllowList::contains(std::string_view module, std::string_view name) const {
  return names_.count(allow_key(module, name)) != 0;
}

const GlobalAllowList& GlobalAllowList::defaults() {
  static const GlobalAllowList* list = [] {
    auto* l = new GlobalAllowList;
    for (const char* n :
         {"set", "frozenset", "bytes", "bytearray", "slice", "complex", "range",
          // The builtin exception classes a served method (or Python's server) raises.
          "BaseException", "Exception", "ArithmeticError", "AssertionError", "AttributeError",
          "BlockingIOError", "BrokenPipeError", "BufferError", "ChildProcessError",
          "ConnectionAbortedError", "ConnectionError", "ConnectionRefusedError",
          "ConnectionResetError", "EOFError", "FileExistsError", "FileNotFoundError",
          "FloatingPointError", "ImportError", "IndexError", "InterruptedError",
          "IsADirectoryError", "KeyError", "KeyboardInterrupt", "LookupError", "MemoryError",
          "ModuleNotFoundError", "NameError", "NotADirectoryError", "NotImplementedError",
          "OSError", "OverflowError", "PermissionError", "ProcessLookupError", "RecursionError",
          "ReferenceError", "RuntimeError", "StopIteration", "SystemError", "TimeoutError",
          "TypeError", "UnboundLocalError", "UnicodeError", "ValueError", "ZeroDivisionError"})
      l->add("builtins", n);
    l->add("_codecs", "encode");
    l->add("_queue", "Empty");
    l->add("queue", "Empty");
    l->add("queue", "Full");
    l->add("threading", "BrokenBarrierError");
    for (const char* n : {"TimeoutError", "AuthenticationError", "ProcessError", "BufferTooShort"})
      l->add("multiprocessing.context", n);
    for (const char* n : {"Token", "RemoteError", "Namespace", "Value", "RebuildProxy", "AutoProxy",
                          "BaseProxy", "IteratorProxy", "AcquirerProxy", "ConditionProxy",
                          "EventProxy", "BarrierProxy", "NamespaceProxy", "ValueProxy",
                          "BaseListProxy", "ListProxy", "DictProxy", "ArrayProxy", "PoolProxy"})
      l->add("multiprocessing.managers", n);
    l->add("array", "array");
    l->add("array", "_array_reconstructor");
    return l;
  }();
  return *list;
}

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

// ---- encoder -----------------------------------------------------------------------------------

namespace {

using namespace impl;  // NOLINT(google-build-using-namespace): the opcode names

constexpr size_t kMaxEncodeDepth = 10000;
constexpr size_t kBatch = 1000;  // items per APPENDS / SETITEMS / ADDITEMS, as pickle.py

class Encoder {
 public:
  explicit Encoder(int protocol) : proto_(protocol) {}

  std::string run(const Value& v) {
    out_.push_back(static_cast<char>(kPROTO));
    out_.push_back(static_cast<char>(proto_));
    size_t frame_at = 0;
    if (proto_ >= 4) {
      out_.push_back(static_cast<char>(kFRAME));
      frame_at = out_.size();
      out_.append(8, '\0');
    }
    save(v, 0);
    op(kSTOP);
    if (proto_ >= 4) {
      const uint64_t n = out_.size() - frame_at - 8;
      for (size_t i = 0; i < 8; ++i) out_[frame_at + i] = static_cast<char>((n >> (8 * i)) & 0xff);
    }
    return std::move(out_);
  }

 private:
  void op(unsigned char c) { out_.push_back(static_cast<char>(c)); }
  void le(uint64_t v, size_t n) {
    for (size_t i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }

  void save_str(std::string_view s) {
    if (!valid_utf8(s)) throw PickleError("a str is not valid UTF-8");
    if (proto_ >= 4 && s.size() < 256) {
      op(kSHORT_BINUNICODE);
      le(s.size(), 1);
    } else if (s.size() <= 0xffffffffu) {
      op(kBINUNICODE);
      le(s.size(), 4);
    } else if (proto_ >= 4) {
      op(kBINUNICODE8);
      le(s.size(), 8);
    } else {
      throw PickleError(fmt::format("a str of {} bytes needs protocol 4", s.size()));
    }
    out_.append(s);
  }

  void save_global(std::string_view module, std::string_view name) {
    if (proto_ >= 4) {
      save_str(module);
      save_str(name);
      op(kSTACK_GLOBAL);
      return;
    }
    if (module.find('\n') != std::string_view::npos || name.find('\n') != std::string_view::npos)
      throw PickleError("a global's module or name contains a newline");
    op(kGLOBAL);
    out_.append(module).append("\n").append(name).append("\n");
  }

  void save_bytes(std::string_view b) {
    if (proto_ < 3) {  // protocol 2 has no bytes: _codecs.encode(latin-1 text, 'latin1')
      save_global("_codecs", "encode");
      std::string text;
      for (char ch : b) {
        const auto c = static_cast<uint8_t>(ch);
        if (c < 0x80) {
          text.push_back(ch);
        } else {
          text.push_back(static_cast<char>(0xc0 | (c >> 6)));
          text.push_back(static_cast<char>(0x80 | (c & 0x3f)));
        }
      }
      save_str(text);
      save_str("latin1");
      op(kTUPLE2);
      op(kREDUCE);
      return;
    }
    if (b.size() < 256) {
      op(kSHORT_BINBYTES);
      le(b.size(), 1);
    } else if (b.size() <= 0xffffffffu) {
      op(kBINBYTES);
      le(b.size(), 4);
    } else if (proto_ >= 4) {
      op(kBINBYTES8);
      le(b.size(), 8);
    } else {
      throw PickleError(fmt::format("bytes of {} bytes need protocol 4", b.size()));
    }
    out_.append(b);
  }

  void save_int(int64_t v) {
    if (v >= 0 && v <= 0xff) {
      op(kBININT1);
      le(static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v <= 0xffff) {
      op(kBININT2);
      le(static_cast<uint64_t>(v), 2);
    } else if (v >= std::numeric_limits<int32_t>::min() &&
               v <= std::numeric_limits<int32_t>::max()) {
      op(kBININT);
      le(static_cast<uint64_t>(v), 4);
    } else {
      save_long(le_of_int64(v));
    }
  }

  void save_long(std::string_view bytes) {
    if (bytes.size() < 256) {
      op(kLONG1);
      le(bytes.size(), 1);
    } else if (bytes.size() <= 0x7fffffffu) {
      op(kLONG4);
      le(bytes.size(), 4);
    } else {
      throw PickleError(fmt::format("an int of {} bytes is too large to pickle", bytes.size()));
    }
    out_.append(bytes);
  }

  void save_float(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    op(kBINFLOAT);
    for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  }

  void save_items(const std::vector<Value>& items, size_t depth) {
    for (const Value& x : items) save(x, depth);
  }

  void save_tuple(const std::vector<Value>& items, size_t depth) {
    switch (items.size()) {
      case 0:
        op(kEMPTY_TUPLE);
        return;
      case 1:
      case 2:
      case 3:
        save_items(items, depth);
        op(items.size() == 1 ? kTUPLE1 : items.size() == 2 ? kTUPLE2 : kTUPLE3);
        return;
      default:
        op(kMARK);
        save_items(items, depth);
        op(kTUPLE);
    }
  }

  /// EMPTY_LIST then batches of APPENDS (APPEND for a batch of one).
  void save_list(const std::vector<Value>& items, size_t depth) {
    op(kEMPTY_LIST);
    for (size_t at = 0; at < items.size(); at += kBatch) {
      const size_t n = std::min(kBatch, items.size() - at);
      if (n == 1) {
        save(items[at], depth);
        op(kAPPEND);
        continue;
      }
      op(kMARK);
      for (size_t i = at; i < at + n; ++i) save(items[i], depth);
      op(kAPPENDS);
    }
  }

  void save_set(const std::vector<Value>& items, bool frozen, size_t depth) {
    if (proto_ < 4) {  // builtins.set([items]) / frozenset([items])
      save_global("builtins", frozen ? "frozenset" : "set");
      save_list(items, depth);
      op(kTUPLE1);
      op(kREDUCE);
      return;
    }
    if (frozen) {
      op(kMARK);
      save_items(items, depth);
      op(kFROZENSET);
      return;
    }
    op(kEMPTY_SET);
    for (size_t at = 0; at < items.size(); at += kBatch) {
      const size_t n = std::min(kBatch, items.size() - at);
      op(kMARK);
      for (size_t i = at; i < at + n; ++i) save(items[i], depth);
      op(kADDITEMS);
    }
  }

  void save(const Value& v, size_t depth) {
    if (depth > kMaxEncodeDepth)
      throw PickleError(fmt::format("a value nested deeper than {} levels", kMaxEncodeDepth));
    std::visit(
        [&](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, None>) {
            op(kNONE);
          } else if constexpr (std::is_same_v<T, bool>) {
            op(x ? kNEWTRUE : kNEWFALSE);
          } else if constexpr (std::is_same_v<T, int64_t>) {
            save_int(x);
          } else if constexpr (std::is_same_v<T, BigInt>) {
            save_long(x.bytes);
          } else if constexpr (std::is_same_v<T, double>) {
            save_float(x);
          } else if constexpr (std::is_same_v<T, Str>) {
            save_str(x.utf8);
          } else if constexpr (std::is_same_v<T, Bytes>) {
            save_bytes(x.data);
          } else if constexpr (std::is_same_v<T, ByteArray>) {
            if (proto_ >= 5) {
              op(kBYTEARRAY8);
              le(x.data.size(), 8);
              out_.append(x.data);
            } else {
              save_global("builtins", "bytearray");
              save_bytes(x.data);
              op(kTUPLE1);
              op(kREDUCE);
            }
          } else if constexpr (std::is_same_v<T, Tuple>) {
            save_tuple(x.items, depth + 1);
          } else if constexpr (std::is_same_v<T, List>) {
            save_list(x.items, depth + 1);
          } else if constexpr (std::is_same_v<T, Dict>) {
            op(kEMPTY_DICT);
            for (size_t at = 0; at < x.items.size(); at += kBatch) {
              const size_t n = std::min(kBatch, x.items.size() - at);
              if (n > 1) op(kMARK);
              for (size_t i = at; i < at + n; ++i) {
                save(x.items[i].key, depth + 1);
                save(x.items[i].value, depth + 1);
              }
              op(n > 1 ? kSETITEMS : kSETITEM);
            }
          } else if constexpr (std::is_same_v<T, Set>) {
            save_set(x.items, false, depth + 1);
          } else if constexpr (std::is_same_v<T, FrozenSet>) {
            save_set(x.items, true, depth + 1);
          } else if constexpr (std::is_same_v<T, Global>) {
            save_global(x.module, x.name);
          } else {
            save_global(x.type.module, x.type.name);
            save_tuple(x.args, depth + 1);
            op(x.new_object ? kNEWOBJ : kREDUCE);
            if (x.state) {
              save(*x.state, depth + 1);
              op(kBUILD);
            }
          }
        },
        v.data());
  }

  int proto_;
  std::string out_;
};

}  // namespace

std::string encode(const Value& value, int protocol) {
  if (protocol < 2 || protocol > 5)
    throw PickleError(fmt::format("cannot encode protocol {} (2 to 5 are written)", protocol));
  return Encoder(protocol).run(value);
}

}  // namespace torchpar::detail::pickle
