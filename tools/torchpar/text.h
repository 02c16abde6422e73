#pragma once
// Byte-level text of the GPT commands (`torchpar infer`, `torchpar serve`): token = byte value.

#include <cstddef>
#include <cstdint>
#include <string>

namespace torchpar::cli {

/// `bytes` as valid UTF-8: each maximal part of an ill-formed sequence (a byte that starts no
/// sequence, or the valid start of a sequence that breaks off) becomes one U+FFFD, as Python's
/// bytes.decode("utf-8", "replace") does (the Unicode standard's practice). Overlong forms,
/// surrogates and code points above U+10FFFF are ill-formed.
inline std::string valid_utf8(const std::string& bytes) {
  static constexpr const char* kReplacement = "\xEF\xBF\xBD";
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    size_t len = 0;                      // 0: c starts no sequence
    unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // no overlong forms
      if (c == 0xED) hi = 0x9F;  // no surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // no overlong forms
      if (c == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
    }
    size_t k = 1;  // bytes of the well-formed prefix
    for (; len > 0 && k < len && i + k < bytes.size(); ++k) {
      const auto cc = static_cast<unsigned char>(bytes[i + k]);
      if (cc < (k == 1 ? lo : 0x80) || cc > (k == 1 ? hi : 0xBF)) break;
    }
    if (len > 0 && k == len)
      out.append(bytes, i, len);
    else
      out += kReplacement;
    i += k;
  }
  return out;
}

/// The length of the longest prefix of `bytes` that does not end inside a UTF-8 sequence that
/// more bytes could still complete: what a stream may show now (valid_utf8 of it) without
/// changing what valid_utf8 of the whole gives later. It cuts only before a byte that starts a
/// sequence, where valid_utf8 of the whole starts a new character too.
inline size_t utf8_complete_prefix(const std::string& bytes) {
  const size_t n = bytes.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(bytes[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: its lead is further back
    size_t len = 1;
    unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range, as valid_utf8 has it
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    }
    if (len <= back) return n;  // complete (or ill-formed: valid_utf8 decides it now)
    for (size_t k = 1; k < back; ++k) {
      const auto cc = static_cast<unsigned char>(bytes[n - back + k]);
      if (cc < (k == 1 ? lo : 0x80) || cc > (k == 1 ? hi : 0xBF)) return n;  // already broken
    }
    return n - back;  // well-formed so far and short of bytes: hold it back
  }
  return n;
}

/// Token ids -> bytes: ids >= 256 (a vocabulary larger than bytes) become 0xFF, which
/// valid_utf8 shows as U+FFFD.
inline char token_byte(int64_t token) {
  return token >= 0 && token < 256 ? static_cast<char>(token) : '\xFF';
}

}  // namespace torchpar::cli
