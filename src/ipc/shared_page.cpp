#include "torchpar/ipc/shared_page.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"
#include "torchpar/serialize/archive.h"

namespace torchpar::detail {

std::shared_ptr<SharedPage> SharedPage::create(size_t bytes, const char* what) {
  std::shared_ptr<SharedPage> p(new SharedPage());
  p->size_ = (bytes + 4095) / 4096 * 4096;
  const int fd = ::memfd_create(what, MFD_CLOEXEC);
  if (fd < 0) throw ShmError("memfd_create", errno, what);
  p->fd_.reset(fd);
  const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(p->size_));
  if (err != 0) throw ShmError("posix_fallocate", err, what, format_bytes(p->size_));
  void* m = ::mmap(nullptr, p->size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) throw ShmError("mmap", errno, what);
  p->base_ = m;
  return p;
}

std::shared_ptr<SharedPage> SharedPage::open(UniqueFd fd, size_t min_bytes) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw ShmError("fstat", errno, "shared object");
  if (static_cast<size_t>(st.st_size) < min_bytes)
    throw SerializationError(
        fmt::format("shared object of {} bytes, expected at least {}", st.st_size, min_bytes));
  std::shared_ptr<SharedPage> p(new SharedPage());
  p->size_ = static_cast<size_t>(st.st_size);
  void* m = ::mmap(nullptr, p->size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (m == MAP_FAILED) throw ShmError("mmap", errno, "shared object");
  p->base_ = m;
  p->fd_ = std::move(fd);
  return p;
}

SharedPage::~SharedPage() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

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
