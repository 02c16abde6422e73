#include "core/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>

#include <fmt/format.h>

#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {

void write_file_atomically(const std::string& path, std::string_view bytes) {
  // Beside the target, so that the rename stays within one file system.
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  try {
    UniqueFd fd(check_syscall("open", tmp, [&] {
      return ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    }));
    for (size_t off = 0; off < bytes.size();) {
      const ssize_t n = check_syscall(
          "write", tmp, [&] { return ::write(fd.get(), bytes.data() + off, bytes.size() - off); });
      off += static_cast<size_t>(n);
    }
    check_syscall("fsync", tmp, [&] { return ::fsync(fd.get()); });
    fd.reset();
    check_syscall("rename", path, [&] { return std::rename(tmp.c_str(), path.c_str()); });
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

}  // namespace torchpar::detail
