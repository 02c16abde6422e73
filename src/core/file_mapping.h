#pragma once
// A private, copy-on-write mapping of a whole regular file (read-mostly data such as a
// torch.save archive). Shared memory is mapped only in shm/; this is the one other place
// that maps memory, because a file's pages are not shared between processes here.

#include <cstddef>
#include <memory>
#include <string>

namespace torchpar::detail {

/// A whole file mapped MAP_PRIVATE with PROT_READ | PROT_WRITE: a write (a tensor changed in
/// place) copies that page instead of raising SIGSEGV; the file never changes. Unmapped in
/// the destructor. Not copyable; share it through shared_ptr. Thread-safe to read.
class FileMapping {
 public:
  /// Maps `path`. Errors: SystemError (open, fstat, mmap; naming the path);
  /// SerializationError when it is not a regular file or is empty (`what` prefixes the
  /// message, e.g. the calling function's name).
  static std::shared_ptr<FileMapping> map(const std::string& path, const std::string& what);

  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;
  ~FileMapping();

  char* data() const noexcept { return base_; }
  /// Bytes mapped (the file's size when it was mapped).
  size_t size() const noexcept { return size_; }

 private:
  FileMapping(char* base, size_t size) noexcept : base_(base), size_(size) {}
  char* base_;
  size_t size_;
};

}  // namespace torchpar::detail
