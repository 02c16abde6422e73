#include "torchpar/ipc/detail/shared_page.h"

#include <algorithm>

#include "shm/region.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"
#include "torchpar/serialize/archive.h"

namespace torchpar::detail {

std::shared_ptr<SharedPage> SharedPage::create(size_t bytes, const char* what) {
  std::shared_ptr<SharedPage> p(new SharedPage());
  p->region_ = std::make_unique<ShmRegion>(
      ShmRegion::create_memfd((std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096, what));
  return p;
}

std::shared_ptr<SharedPage> SharedPage::open(UniqueFd fd, size_t min_bytes) {
  std::shared_ptr<SharedPage> p(new SharedPage());
  try {
    p->region_ =
        std::make_unique<ShmRegion>(ShmRegion::open_fd(std::move(fd), min_bytes, "shared object"));
  } catch (const ShmError& e) {
    if (e.error_code() != EINVAL) throw;
    throw SerializationError(e.what_without_backtrace());  // a payload carrying a bad fd
  }
  return p;
}

SharedPage::~SharedPage() = default;

void* SharedPage::data() const { return region_->data(); }
size_t SharedPage::size() const { return region_->size(); }
int SharedPage::fd() const { return region_->fd(); }

void SharedPage::save(OutputArchive& ar, const std::shared_ptr<SharedPage>& page) {
  const uint32_t idx = ar.fd_index(page->fd());
  ar(idx);
}

std::shared_ptr<SharedPage> SharedPage::load(InputArchive& ar, size_t min_bytes) {
  uint32_t idx = 0;
  ar(idx);
  return open(ar.take_fd(idx), min_bytes);
}

}  // namespace torchpar::detail
