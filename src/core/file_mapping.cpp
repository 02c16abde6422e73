#include "core/file_mapping.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>

#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {

std::shared_ptr<FileMapping> FileMapping::map(const std::string& path, const std::string& what) {
  // Non-blocking: opening a FIFO would wait for a writer; the fstat below refuses it instead.
  UniqueFd fd(check_syscall(
      "open", path, [&] { return ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK); }));
  struct stat st {};
  check_syscall("fstat", path, [&] { return ::fstat(fd.get(), &st); });
  if (!S_ISREG(st.st_mode) || st.st_size == 0)
    throw SerializationError(fmt::format(
        "{}: '{}' is not a torch.save archive (empty or not a regular file)", what, path));
  const auto size = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd.get(), 0);
  if (p == MAP_FAILED) throw_system_error("mmap", errno, path);
  return std::shared_ptr<FileMapping>(new FileMapping(static_cast<char*>(p), size));
}

FileMapping::~FileMapping() { ::munmap(base_, size_); }

}  // namespace torchpar::detail
