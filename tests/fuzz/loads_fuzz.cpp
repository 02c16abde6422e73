// libFuzzer target for torchpar::loads: arbitrary bytes must give a value or a
// SerializationError, never a crash, an out-of-bounds read or a runaway allocation.
#include <cstddef>
#include <cstdint>
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

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  // The first byte picks the type; the rest follows a valid header so that the fuzzer
  // spends its time past the magic check.
  torchpar::Payload p{std::string("TPAR\1") + std::string(reinterpret_cast<const char*>(data + 1), size - 1), {}};
  switch (data[0] % 4) {
    case 0: try_load<c10::IValue>(p); break;
    case 1: try_load<at::Tensor>(p); break;
    case 2: try_load<Record>(p); break;
    default: try_load<std::vector<at::Tensor>>(p); break;
  }
  return 0;
}
