#pragma once
/// SharedPage: a small zero-filled shared-memory object (a sealed memfd + mapping, see
/// shm/ShmRegion) that copies of an IPC object share, and that travels to child processes
/// as an fd. A peer cannot truncate it (sealed); a received fd without the seals, or
/// smaller than expected, is refused (ShmError).
///
/// Internal: nothing here is public API (namespace torchpar::detail); it may change without
/// notice. It is an installed header only because the templates of shared_value.h (Value,
/// Array) use it in the user's translation units and the classes of synchronize.h hold one;
/// include "torchpar/ipc/shared_value.h" or "torchpar/ipc/synchronize.h" instead.

#include <cstddef>
#include <memory>

#include "torchpar/core/fd.h"

namespace torchpar::detail {

class OutputArchive;
class InputArchive;
class ShmRegion;

class SharedPage {
 public:
  /// A new zero-filled object of `bytes` (rounded up to pages). Throws ShmError.
  static std::shared_ptr<SharedPage> create(size_t bytes, const char* what);
  /// Maps the object behind `fd` (from a payload): a sealed memfd of at least `min_bytes`,
  /// else ShmError.
  static std::shared_ptr<SharedPage> open(UniqueFd fd, size_t min_bytes);
  ~SharedPage();
  SharedPage(const SharedPage&) = delete;
  SharedPage& operator=(const SharedPage&) = delete;

  void* data() const;
  size_t size() const;
  int fd() const;

  /// Archive helpers: the fd goes out of band.
  static void save(OutputArchive& ar, const std::shared_ptr<SharedPage>& page);
  static std::shared_ptr<SharedPage> load(InputArchive& ar, size_t min_bytes);

 private:
  SharedPage() = default;
  std::unique_ptr<ShmRegion> region_;
};

}  // namespace torchpar::detail
