#include "core/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

#include <fmt/format.h>

#include "torchpar/core/error.h"
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

std::string read_small_file(const std::string& path, size_t max_bytes, std::string_view what) {
  UniqueFd fd(check_syscall(
      "open", path, [&] { return ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK); }));
  struct stat st {};
  check_syscall("fstat", path, [&] { return ::fstat(fd.get(), &st); });
  if (!S_ISREG(st.st_mode))
    throw SerializationError(fmt::format(
        "{}: '{}' is not a regular file (a FIFO, device, directory or socket)", what, path));
  if (static_cast<uint64_t>(st.st_size) > max_bytes)
    throw SerializationError(fmt::format("{}: '{}' is {} bytes, more than the {} allowed", what,
                                         path, st.st_size, max_bytes));
  std::string bytes(max_bytes + 1, '\0');
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = check_syscall(
        "read", path, [&] { return ::read(fd.get(), bytes.data() + got, bytes.size() - got); });
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  if (got > max_bytes)
    throw SerializationError(
        fmt::format("{}: '{}' grew past the {} bytes allowed while read", what, path, max_bytes));
  bytes.resize(got);
  return bytes;
}

}  // namespace torchpar::detail
