#pragma once
// The child side of a start: running the target, reporting an exception into the error
// slot (a 4 KiB shared page the child can never block on), and exiting.

#include <c10/util/Type.h>

#include <cstdint>
#include <exception>
#include <string>
#include <typeinfo>

namespace torchpar::detail {

inline constexpr size_t kErrorSlotBytes = 4096;
inline constexpr uint32_t kErrorSlotMagic = 0x45525254;  // "TRRE"

struct ErrorSlot {
  uint32_t magic;
  uint32_t type_len;
  uint32_t msg_len;
  char data[kErrorSlotBytes - 12];
};

/// Writes {type, message} into the slot (truncated to fit).
void write_error_slot(void* slot, const std::string& type, const std::string& message) noexcept;
/// Reads the slot; false when the child wrote nothing.
bool read_error_slot(const void* slot, std::string* type, std::string* message);

/// Sets the intra-op thread budget of this (child) process.
void set_child_threads(int threads);

/// Flushes stdio, unlinks this process's file_system segments and _exit()s: a child never
/// runs the parent's atexit handlers or static destructors.
[[noreturn]] void exit_child(int code) noexcept;

/// Prints "Process <name>:" and "<type>: <message>" to stderr, as Python prints a child's
/// traceback. One write(2), so lines of children failing together do not interleave.
void print_child_error(const std::string& name, const std::string& type,
                       const std::string& message) noexcept;

/// Runs `body`, catching everything into the slot and onto stderr; returns the exit code
/// (0 or 1). `name` is read after `body` (spawn's body fills it from its launch record).
template <class Body>
int run_child_body(void* slot, const std::string& name, Body&& body) noexcept {
  std::string type, message;
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    type = c10::demangle(typeid(e).name());
    message = e.what();
  } catch (...) {
    type = "unknown exception";
    message = "a non-std::exception was thrown";
  }
  write_error_slot(slot, type, message);
  print_child_error(name, type, message);
  return 1;
}

}  // namespace torchpar::detail
