// libFuzzer target for torchpar::loads: arbitrary bytes must give a value or a
// SerializationError, never a crash, an out-of-bounds read or a runaway allocation.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "torchpar/torchpar.h"

namespace {
struct Record {
  std::vector<std::string> names;
  std::map<int, std::variant<double, std::string>> fields;
  std::optional<at::Tensor> tensor;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(names, fields, tensor);
  }
};

template <class T>
void try_load(const torchpar::Payload& p) {
  try {
    (void)torchpar::loads<T>(p);
  } catch (const torchpar::SerializationError&) {
  }
}
}  // namespace

// Seeds an empty corpus directory (the last non-flag argument) with valid payloads.
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  std::string dir;
  for (int i = 1; i < *argc; ++i)
    if ((*argv)[i][0] != '-') dir = (*argv)[i];
  if (dir.empty() || !std::filesystem::is_directory(dir) || !std::filesystem::is_empty(dir))
    return 0;
  at::Tensor t = at::arange(12, at::kFloat).reshape({3, 4});
  c10::IValue iv = c10::ivalue::Tuple::create({c10::IValue(t), c10::IValue("s"),
                                               c10::IValue(c10::List<int64_t>({1, 2})),
                                               c10::IValue(2.5), c10::IValue(true), c10::IValue()});
  Record r{{"a", "bc"}, {{1, 2.0}, {2, std::string("x")}}, t.t()};
  std::vector<torchpar::Payload> seeds;
  seeds.push_back(torchpar::dumps(iv));
  seeds.push_back(torchpar::dumps(t.narrow(1, 1, 2)));
  seeds.push_back(torchpar::dumps(r));
  seeds.push_back(torchpar::dumps(std::vector<at::Tensor>{t, t[1], at::ones({2}, at::kBool)}));
  for (size_t i = 0; i < seeds.size(); ++i) {
    std::ofstream f(dir + "/seed" + std::to_string(i), std::ios::binary);
    f.put(static_cast<char>(i));
    f.write(seeds[i].bytes.data() + 5, static_cast<std::streamsize>(seeds[i].bytes.size() - 5));
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  // The first byte picks the type; the rest follows a valid header so that the fuzzer
  // spends its time past the magic check.
  torchpar::Payload p{
      std::string("TPAR\1") + std::string(reinterpret_cast<const char*>(data + 1), size - 1), {}};
  switch (data[0] % 4) {
    case 0:
      try_load<c10::IValue>(p);
      break;
    case 1:
      try_load<at::Tensor>(p);
      break;
    case 2:
      try_load<Record>(p);
      break;
    default:
      try_load<std::vector<at::Tensor>>(p);
      break;
  }
  return 0;
}

// gcc's -fsanitize-coverage=trace-cmp also reports float compares, which libFuzzer does not
// consume; give them no-op definitions.
extern "C" void __sanitizer_cov_trace_cmpf(float, float) {}
extern "C" void __sanitizer_cov_trace_cmpd(double, double) {}
