#include "torchpar/core/error.h"

#include <cstring>

#include <fmt/format.h>

namespace torchpar {

Error::Error(std::string msg) : c10::Error(std::move(msg), /*backtrace=*/"") {}

SystemError::SystemError(std::string syscall, int err, std::string object, std::string detail)
    : Error(fmt::format("{} failed on {}: {} (errno {}){}{}", syscall, object, std::strerror(err),
                        err, detail.empty() ? "" : "; ", detail)),
      syscall_(std::move(syscall)),
      errno_(err),
      object_(std::move(object)) {}

}  // namespace torchpar

#include "torchpar/version.h"

namespace torchpar {
const char* version() { return TORCHPAR_VERSION; }
}  // namespace torchpar
