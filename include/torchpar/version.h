#pragma once
/// torchpar's version.

#define TORCHPAR_VERSION_MAJOR 0
#define TORCHPAR_VERSION_MINOR 1
#define TORCHPAR_VERSION_PATCH 0

namespace torchpar {
/// "major.minor.patch" of the library this program runs against.
const char* version();
}  // namespace torchpar
