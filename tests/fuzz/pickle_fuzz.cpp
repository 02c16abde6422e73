// libFuzzer target for the pickle codec of Python's manager protocol
// (include/torchpar/manager/pickle.h): arbitrary bytes, as a Python client that passed the
// handshake could send them, go through decode. Each must give a Value or a PickleError, never a
// crash, an out-of-bounds read, a leak or a runaway allocation (the limits are lowered so that a
// hostile expansion shows up within -malloc_limit_mb). What decodes is encoded again at protocols 2
// to 5 and must decode to the same value (abort otherwise), and key_hash / key_equal run on the
// dict keys and set elements found.
//
// Built without LibTorch: the codec, torchpar's error classes and c10's exception base.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "torchpar/manager/pickle.h"

namespace {

namespace pk = torchpar::pickle;
using pk::Value;

/// Seeds: what Python's manager protocol sends, at protocols 2 to 5 (our encoder writes the
/// same opcodes as CPython's pickler), plus protocol 0 text.
std::vector<std::string> seeds() {
  const Value token = Value::object(
      "multiprocessing.managers", "Token", {},
      Value::tuple({Value::str("dict"), Value::tuple({Value::str("127.0.0.1"), Value(5000)}),
                    Value::str("7f3a")}),
      /*new_object=*/true);
  const std::vector<Value> values = {
      // A request (ident, methodname, args, kwds) and the answers.
      Value::tuple({Value::str("7f3a"), Value::str("__setitem__"),
                    Value::tuple({Value::str("k"), Value::list({Value(1), Value(2.5)})}),
                    Value::dict({})}),
      Value::tuple({Value::str("#RETURN"), Value()}),
      Value::tuple(
          {Value::str("#ERROR"), Value::object("builtins", "KeyError", {Value::str("k")})}),
      Value::tuple({Value::str("#PROXY"), Value::tuple({Value::list({Value::str("get")}), token})}),
      Value::object("multiprocessing.managers", "RemoteError", {Value::str("Traceback\n")}),
      Value::object("_queue", "Empty", {}),
      Value::dict({{Value::tuple({Value(1), Value::bytes("b")}), Value::set({Value(1)})},
                   {Value::integer_from_decimal("1267650600228229401496703205376"),
                    Value::frozenset({Value::str("q")})},
                   {Value(-1.5), Value::bytearray("ba")}}),
  };
  std::vector<std::string> out;
  for (int proto = 2; proto <= 5; ++proto)
    for (const Value& v : values) out.push_back(pk::encode(v, proto));
  out.emplace_back("(dp0\nVk\np1\n(lp2\nI1\naF2.5\naL12345678901234567890L\nasS'x'\nI01\ns.");
  return out;
}

void check_keys(const Value& v) {
  const auto visit_key = [](const Value& k) {
    if (!pk::is_key_type(k)) return;
    (void)pk::key_hash(k);
    if (!pk::key_equal(k, k) && !(k.is<double>())) {
      // Only NaN (and tuples holding one) is unequal to itself.
      if (k.repr().find("nan") == std::string::npos) std::abort();
    }
  };
  if (const auto* d = std::get_if<pk::Dict>(&v.data())) {
    for (const auto& item : d->items) {
      visit_key(item.key);
      check_keys(item.value);
    }
  } else if (const auto* s = std::get_if<pk::Set>(&v.data())) {
    for (const Value& x : s->items) visit_key(x);
  } else if (const auto* l = std::get_if<pk::List>(&v.data())) {
    for (const Value& x : l->items) check_keys(x);
  } else if (const auto* t = std::get_if<pk::Tuple>(&v.data())) {
    for (const Value& x : t->items) check_keys(x);
  }
}

}  // namespace

// Seeds an empty corpus directory (the last non-flag argument).
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  std::string dir;
  for (int i = 1; i < *argc; ++i)
    if ((*argv)[i][0] != '-') dir = (*argv)[i];
  if (dir.empty() || !std::filesystem::is_directory(dir) || !std::filesystem::is_empty(dir))
    return 0;
  const std::vector<std::string> s = seeds();
  for (size_t i = 0; i < s.size(); ++i) {
    std::ofstream f(dir + "/seed" + std::to_string(i), std::ios::binary);
    f.write(s[i].data(), static_cast<std::streamsize>(s[i].size()));
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pk::DecodeOptions o;
  o.max_elements = 100000;
  o.max_bytes = size_t{16} << 20;
  o.max_memo = 100000;
  Value v;
  try {
    v = pk::decode(std::string_view(reinterpret_cast<const char*>(data), size), o);
  } catch (const pk::PickleError&) {
    return 0;
  }
  check_keys(v);
  (void)v.repr();
  for (int proto = 2; proto <= 5; ++proto) {
    std::string again;
    try {
      again = pk::encode(v, proto);
    } catch (const pk::PickleError&) {
      continue;  // a global's name with a newline below protocol 4, a str over 4 GiB
    }
    pk::DecodeOptions wide;  // the re-encoding may take more room (protocol 2's bytes)
    if (!(pk::decode(again, wide) == v)) {
      std::fprintf(stderr, "protocol %d: %s did not round-trip\n", proto, v.repr().c_str());
      std::abort();
    }
  }
  return 0;
}

// gcc's -fsanitize-coverage=trace-cmp also reports float compares, which libFuzzer does not
// consume; give them no-op definitions.
extern "C" void __sanitizer_cov_trace_cmpf(float, float) {}
extern "C" void __sanitizer_cov_trace_cmpd(double, double) {}
