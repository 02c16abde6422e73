// Text helpers of the pickle decoder (see pickle_impl.h): protocol 0's quoted STRING and
// raw-unicode-escape UNICODE arguments, protocol 2's latin-1 bytes, error-message escaping.
#include <algorithm>
#include <charconv>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "manager/pickle_impl.h"

namespace torchpar::pickle::impl {

std::string printable(std::string_view s) {
  std::string out;
  for (char ch : s.substr(0, 100)) {
    const auto c = static_cast<uint8_t>(ch);
    if (c < 0x20 || c >= 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += ch;
    }
  }
  if (s.size() > 100) out += "...";
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out.push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

std::optional<std::string> latin1_of_utf8(std::string_view utf8) {
  std::string out;
  out.reserve(utf8.size());
  for (size_t i = 0; i < utf8.size(); ++i) {
    const auto c = static_cast<uint8_t>(utf8[i]);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else if ((c == 0xc2 || c == 0xc3) && i + 1 < utf8.size()) {
      out.push_back(static_cast<char>(((c & 0x03) << 6) | (utf8[++i] & 0x3f)));
    } else {
      return std::nullopt;
    }
  }
  return out;
}

namespace {
/// The character a one-letter escape of a Python 2 str literal stands for, or -1.
int simple_escape(char e) {
  switch (e) {
    case 'n':
      return '\n';
    case 't':
      return '\t';
    case 'r':
      return '\r';
    case 'a':
      return '\a';
    case 'b':
      return '\b';
    case 'f':
      return '\f';
    case 'v':
      return '\v';
    case '\\':
    case '\'':
    case '"':
      return e;
    default:
      return -1;
  }
}
}  // namespace

std::optional<std::string> python2_string_literal(std::string_view t, std::string* error) {
  if (t.size() < 2 || t.front() != t.back() || (t.front() != '\'' && t.front() != '"')) {
    *error = "the STRING argument is not quoted";
    return std::nullopt;
  }
  t = t.substr(1, t.size() - 2);
  std::string out;
  for (size_t i = 0; i < t.size(); ++i) {
    const char ch = t[i];
    if (ch != '\\' || i + 1 == t.size()) {
      out.push_back(ch);
      continue;
    }
    const char e = t[++i];
    if (const int c = simple_escape(e); c >= 0) {
      out.push_back(static_cast<char>(c));
    } else if (e == '\n') {
      // a line continuation: nothing
    } else if (e == 'x') {
      unsigned v = 0;
      if (i + 2 >= t.size() ||
          std::from_chars(t.data() + i + 1, t.data() + i + 3, v, 16).ptr != t.data() + i + 3) {
        *error = "a truncated or malformed \\x escape in STRING";
        return std::nullopt;
      }
      out.push_back(static_cast<char>(v));
      i += 2;
    } else if (e >= '0' && e <= '7') {
      unsigned v = static_cast<unsigned>(e - '0');
      for (int k = 0; k < 2 && i + 1 < t.size() && t[i + 1] >= '0' && t[i + 1] <= '7'; ++k)
        v = v * 8 + static_cast<unsigned>(t[++i] - '0');
      out.push_back(static_cast<char>(v & 0xff));
    } else {
      out.push_back('\\');  // Python keeps unknown escapes as they are
      out.push_back(e);
    }
  }
  return out;
}

std::optional<std::string> raw_unicode_escape(std::string_view t) {
  std::string out;
  for (size_t i = 0; i < t.size(); ++i) {
    size_t digits = 0;
    if (t[i] == '\\' && i + 1 < t.size()) digits = t[i + 1] == 'u' ? 4 : t[i + 1] == 'U' ? 8 : 0;
    if (digits == 0) {
      append_utf8(out, static_cast<uint8_t>(t[i]));  // latin-1
      continue;
    }
    uint32_t cp = 0;
    const char* end = t.data() + std::min(t.size(), i + 2 + digits);
    if (std::from_chars(t.data() + i + 2, end, cp, 16).ptr != t.data() + i + 2 + digits ||
        cp > 0x10ffff)
      return std::nullopt;
    append_utf8(out, cp);
    i += 1 + digits;
  }
  return out;
}

}  // namespace torchpar::pickle::impl
