#pragma once
// The message of an exception for another error's message.

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace torchpar::detail {

/// The message of any exception, without LibTorch's backtrace (c10::Error's what() carries
/// one). Never throws.
inline const char* message_of(const std::exception& e) noexcept {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

/// The message of a stored exception ("a non-std::exception" for others). Never throws.
inline std::string message_of(const std::exception_ptr& e) noexcept {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return message_of(x);
  } catch (...) {
    return "a non-std::exception";
  }
}

}  // namespace torchpar::detail
