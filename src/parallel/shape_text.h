#pragma once
// A tensor shape as error messages of src/parallel/ print it. Private to src/parallel/.

#include <c10/util/ArrayRef.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <string>

namespace torchpar::detail {

/// "[2, 3]" for sizes {2, 3}; "[]" for a scalar's.
inline std::string shape_of(c10::IntArrayRef sizes) {
  return fmt::format("[{}]", fmt::join(sizes, ", "));
}

}  // namespace torchpar::detail
