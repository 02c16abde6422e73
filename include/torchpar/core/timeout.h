#pragma once
/// The one timeout type of the public API.

#include <chrono>
#include <optional>

namespace torchpar {

/// How long a blocking call may wait, in seconds (fractions allowed): std::nullopt waits
/// without a limit, zero or a negative duration tries once without blocking. Every
/// blocking call of torchpar takes this type (std::chrono durations convert implicitly:
/// `std::chrono::milliseconds(50)` or `0.5s`).
using Timeout = std::optional<std::chrono::duration<double>>;

}  // namespace torchpar
