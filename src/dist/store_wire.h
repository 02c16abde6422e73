#pragma once
// The store's wire encoding (docs in dist/store.h): big-endian integers, length-prefixed
// strings and frames, and a bounds-checked reader. Private to src/dist/store.cpp.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace torchpar::detail::store_wire {

inline void put_u32(std::string& s, uint32_t v) {
  for (int i = 3; i >= 0; --i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline void put_i64(std::string& s, int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int i = 7; i >= 0; --i) s.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}
inline void put_bytes(std::string& s, const void* p, size_t n) {
  put_u32(s, static_cast<uint32_t>(n));
  s.append(static_cast<const char*>(p), n);
}
inline void put_str(std::string& s, const std::string& v) { put_bytes(s, v.data(), v.size()); }
inline void put_vec(std::string& s, const std::vector<uint8_t>& v) {
  put_bytes(s, v.data(), v.size());
}

/// Reads fields from a received message; every length is checked against what is left.
/// Holds a view: the message must outlive the Reader (never `Reader r{call(...)}`, whose
/// temporary reply is gone at the end of that statement).
struct Reader {
  std::string_view in;
  bool ok = true;
  uint64_t take(int n) {
    if (in.size() < static_cast<size_t>(n)) {
      ok = false;
      return 0;
    }
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | static_cast<unsigned char>(in[i]);
    in.remove_prefix(static_cast<size_t>(n));
    return v;
  }
  uint8_t u8() { return static_cast<uint8_t>(take(1)); }
  uint32_t u32() { return static_cast<uint32_t>(take(4)); }
  int64_t i64() { return static_cast<int64_t>(take(8)); }
  std::string_view bytes(size_t cap) {
    const uint32_t n = u32();
    if (!ok || n > cap || n > in.size()) {
      ok = false;
      return {};
    }
    auto out = in.substr(0, n);
    in.remove_prefix(n);
    return out;
  }
};

inline std::string frame(std::string body) {
  std::string out;
  out.reserve(body.size() + 4);
  put_u32(out, static_cast<uint32_t>(body.size()));
  out += body;
  return out;
}

}  // namespace torchpar::detail::store_wire
