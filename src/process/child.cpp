#include "child.h"

#include <unistd.h>

#include <ATen/Parallel.h>
#include <c10/util/Type.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "shm/cleaner.h"

namespace torchpar::detail {

void write_error_slot(void* slot, const std::string& type, const std::string& message) noexcept {
  auto* s = static_cast<ErrorSlot*>(slot);
  const size_t cap = sizeof(s->data);
  const size_t t = std::min(type.size(), cap / 4);
  const size_t m = std::min(message.size(), cap - t);
  std::memcpy(s->data, type.data(), t);
  std::memcpy(s->data + t, message.data(), m);
  s->type_len = static_cast<uint32_t>(t);
  s->msg_len = static_cast<uint32_t>(m);
  __atomic_store_n(&s->magic, kErrorSlotMagic, __ATOMIC_RELEASE);
}

bool read_error_slot(const void* slot, std::string* type, std::string* message) {
  const auto* s = static_cast<const ErrorSlot*>(slot);
  if (__atomic_load_n(&s->magic, __ATOMIC_ACQUIRE) != kErrorSlotMagic) return false;
  const size_t cap = sizeof(s->data);
  const size_t t = std::min<size_t>(s->type_len, cap);
  const size_t m = std::min<size_t>(s->msg_len, cap - t);
  type->assign(s->data, t);
  message->assign(s->data + t, m);
  return true;
}

void print_child_error(const std::string& name, const std::string& type,
                       const std::string& message) noexcept {
  try {
    std::fflush(stderr);
    const std::string text = "Process " + (name.empty() ? std::string("?") : name) + ":\n" + type +
                             ": " + message + "\n";
    for (size_t off = 0; off < text.size();) {
      const ssize_t n = ::write(2, text.data() + off, text.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      off += static_cast<size_t>(n);
    }
  } catch (...) {
  }
}

void set_child_threads(int threads) { at::set_num_threads(std::max(1, threads)); }

void exit_child(int code) noexcept {
  std::fflush(nullptr);
  unlink_own_segments();
  ::_exit(code);
}

}  // namespace torchpar::detail
