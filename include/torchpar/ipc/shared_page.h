#pragma once
/// SharedPage: a small zero-filled shared-memory object (memfd + mapping) that copies of
/// an IPC object share, and that travels to child processes as an fd.

#include <cstddef>
#include <memory>

#include "torchpar/core/fd.h"

namespace torchpar::detail {

class OutputArchive;
class InputArchive;

class SharedPage {
 public:
  /// A new zero-filled object of `bytes` (rounded up to pages). Throws ShmError.
  static std::shared_ptr<SharedPage> create(size_t bytes, const char* what);
  /// Maps the object behind `fd` (from a payload); at least `min_bytes` long, else
  /// SerializationError.
  static std::shared_ptr<SharedPage> open(UniqueFd fd, size_t min_bytes);
  ~SharedPage();
  SharedPage(const SharedPage&) = delete;
  SharedPage& operator=(const SharedPage&) = delete;

  void* data() const { return base_; }
  size_t size() const { return size_; }
  int fd() const { return fd_.get(); }

  /// Archive helpers: the fd goes out of band.
  static void save(OutputArchive& ar, const std::shared_ptr<SharedPage>& page);
  static std::shared_ptr<SharedPage> load(InputArchive& ar, size_t min_bytes);

 private:
  SharedPage() = default;
  UniqueFd fd_;
  void* base_ = nullptr;
  size_t size_ = 0;
};

}  // namespace torchpar::detail
