#pragma once
// The message of an exception for another error's message.

#include <c10/util/Exception.h>

#include <exception>

namespace torchpar::detail {

/// The message of any exception, without LibTorch's backtrace (c10::Error's what() carries
/// one). Never throws.
inline const char* message_of(const std::exception& e) noexcept {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

}  // namespace torchpar::detail
