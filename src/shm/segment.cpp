#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "cleaner.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {
namespace {

uint64_t round_up(uint64_t v, uint64_t m) { return (v + m - 1) / m * m; }

uint64_t mem_available() {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return UINT64_MAX;
  char line[256];
  uint64_t kb = UINT64_MAX;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %lu kB", &kb) == 1) break;
  }
  std::fclose(f);
  return kb == UINT64_MAX ? kb : kb * 1024;
}

const char* place(SharingStrategy s) {
  return s == SharingStrategy::kFileSystem ? "/dev/shm" : "memfd (anonymous shared memory)";
}

[[noreturn]] void throw_no_space(SharingStrategy s, int err, uint64_t asked) {
  throw ShmError("posix_fallocate", err, place(s),
                 fmt::format("shared memory exhausted: asked {}, free {}{}", format_bytes(asked),
                             format_bytes(shm_bytes_free(s)),
                             s == SharingStrategy::kFileSystem
                                 ? " (enlarge /dev/shm, e.g. docker --shm-size, or use the "
                                   "file_descriptor strategy)"
                                 : ""));
}

}  // namespace

uint64_t shm_bytes_free(SharingStrategy strategy) {
  if (strategy == SharingStrategy::kFileDescriptor) return mem_available();
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) != 0) return 0;
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

std::shared_ptr<Segment> Segment::create(SharingStrategy strategy, uint64_t block_size,
                                         uint32_t num_blocks) {
  const uint64_t header = round_up(sizeof(SegmentHeader) + 4ULL * num_blocks, kPageSize);
  const uint64_t total = header + block_size * num_blocks;
  if (total > shm_bytes_free(strategy)) throw_no_space(strategy, ENOSPC, total);

  std::shared_ptr<Segment> seg(new Segment());
  seg->strategy_ = strategy;
  int raw = -1;
  if (strategy == SharingStrategy::kFileDescriptor) {
    raw = check_syscall("memfd_create", "torchpar segment",
                        [&] { return ::memfd_create("torchpar", MFD_CLOEXEC); });
  } else {
    ensure_cleaner();
    for (int attempt = 0; raw < 0; ++attempt) {
      seg->name_ = make_segment_name();
      raw = retry_eintr([&] {
        return ::shm_open(seg->name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      });
      if (raw < 0 && (errno != EEXIST || attempt > 100))
        throw_system_error("shm_open", errno, seg->name_);
    }
  }
  UniqueFd fd(raw);
  seg->owner_pid_ = static_cast<int>(::getpid());  // from here on the dtor unlinks the name
  int err = retry_eintr([&] {
    int e = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(total));
    if (e == EINTR) errno = EINTR;
    return e == EINTR ? -1 : e;
  });
  if (err == ENOSPC || err == ENOMEM) throw_no_space(strategy, err, total);
  if (err != 0) throw_system_error("posix_fallocate", err, seg->name_.empty() ? "memfd" : seg->name_);
  seg->fd_ = std::move(fd);
  seg->map(total, seg->name_.empty() ? "memfd" : seg->name_);
  if (block_size >= (2u << 20)) ::madvise(seg->base_, total, MADV_HUGEPAGE);  // best effort

  auto* h = seg->header();
  h->magic = kSegmentMagic;
  h->version = kSegmentVersion;
  h->num_blocks = num_blocks;
  h->block_size = block_size;
  h->data_offset = header;
  h->total_size = total;
  h->creator_pid = static_cast<int32_t>(::getpid());
  struct stat st {};
  check_syscall("fstat", "torchpar segment", [&] { return ::fstat(seg->fd_.get(), &st); });
  if (strategy == SharingStrategy::kFileSystem) {
    seg->key_ = "fs:" + seg->name_;
    seg->fd_.reset();  // the name travels, not the fd: keep no fd per segment
  } else {
    seg->key_ = fmt::format("fd:{}:{}", st.st_dev, st.st_ino);
  }
  return seg;
}

std::shared_ptr<Segment> Segment::open_fd(UniqueFd fd) {
  std::shared_ptr<Segment> seg(new Segment());
  seg->strategy_ = SharingStrategy::kFileDescriptor;
  struct stat st {};
  check_syscall("fstat", fmt::format("received fd {}", fd.get()),
                [&] { return ::fstat(fd.get(), &st); });
  seg->key_ = fmt::format("fd:{}:{}", st.st_dev, st.st_ino);
  seg->fd_ = std::move(fd);
  seg->map(static_cast<uint64_t>(st.st_size), "received memfd");
  seg->validate("received memfd");
  return seg;
}

std::shared_ptr<Segment> Segment::open_name(const std::string& name) {
  if (name.rfind("/torchpar_", 0) != 0 || name.find('/', 1) != std::string::npos ||
      name.size() > 200)
    throw ShmError("shm_open", EINVAL, name, "not a torchpar segment name");
  std::shared_ptr<Segment> seg(new Segment());
  seg->strategy_ = SharingStrategy::kFileSystem;
  seg->name_ = name;
  seg->key_ = "fs:" + name;
  int raw = retry_eintr([&] { return ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600); });
  if (raw < 0)
    throw ShmError("shm_open", errno, name,
                   errno == ENOENT ? "the segment is gone: its creating process exited before "
                                     "the handle was opened"
                                   : "");
  UniqueFd fd(raw);
  struct stat st {};
  check_syscall("fstat", name, [&] { return ::fstat(fd.get(), &st); });
  seg->fd_ = std::move(fd);
  seg->map(static_cast<uint64_t>(st.st_size), name);
  seg->fd_.reset();
  seg->validate(name);
  return seg;
}

void Segment::map(uint64_t size, const std::string& what) {
  if (size < kPageSize) throw ShmError("mmap", EINVAL, what, fmt::format("segment of {} bytes is too small", size));
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
  if (p == MAP_FAILED) throw ShmError("mmap", errno, what, fmt::format("{} bytes", size));
  base_ = static_cast<char*>(p);
  size_ = size;
}

void Segment::validate(const std::string& what) const {
  const auto* h = header();
  auto bad = [&](const char* why) {
    throw ShmError("mmap", EINVAL, what, fmt::format("not a valid torchpar segment: {}", why));
  };
  if (h->magic != kSegmentMagic) bad("bad magic");
  if (h->version != kSegmentVersion) bad("unsupported version");
  if (h->num_blocks == 0 || h->block_size == 0) bad("empty geometry");
  const uint64_t refs_end = sizeof(SegmentHeader) + 4ULL * h->num_blocks;
  if (h->data_offset < refs_end || h->data_offset > size_) bad("bad data offset");
  if (h->block_size > (size_ - h->data_offset) / h->num_blocks) bad("blocks exceed the mapping");
}

bool Segment::owned_here() const { return owner_pid_ == static_cast<int>(::getpid()); }

Segment::~Segment() {
  if (base_ != nullptr) ::munmap(base_, size_);
  if (!name_.empty() && owned_here()) {
    ::shm_unlink(name_.c_str());
  }
}

}  // namespace torchpar::detail
