// Python's pickle format for the manager protocol: errors, the integer helpers, the value
// model and the allow-list. Python's key semantics are in pickle_keys.cpp, the encoder in
// pickle_encode.cpp, the decoder in pickle_decode.cpp (opcodes), pickle_tree.cpp (STOP) and
// pickle_text.cpp (protocol 0's text). See pickle.h.
#include "torchpar/manager/pickle.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "manager/pickle_impl.h"

namespace torchpar::pickle {

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
          if (x.state) out.append(" ").append(x.state->repr());
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

}  // namespace torchpar::pickle
