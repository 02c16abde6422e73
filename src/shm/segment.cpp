#include "segment.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>

#include <pthread.h>

#include <fmt/format.h>

#include "core/prefault.h"
#include "torchpar/core/error.h"

namespace torchpar::detail {
namespace {

uint64_t round_up(uint64_t v, uint64_t m) { return (v + m - 1) / m * m; }

// MemAvailable for a request of `asked` bytes: a reading of the last 100 ms serves a
// request of at most 1/16 of it; other requests read /proc/meminfo again. A reading costs
// about five system calls (~10 us here), which a small cold segment (a 64 KiB slab) paid on
// every creation. Safety: any thread (a racing reader only reads again).
uint64_t mem_available_for(uint64_t asked) {
  static std::atomic<uint64_t> last_bytes{0};
  static std::atomic<int64_t> last_ns{0};
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  const uint64_t cached = last_bytes.load(std::memory_order_relaxed);
  if (cached != 0 && asked <= cached / 16 &&
      now - last_ns.load(std::memory_order_relaxed) < int64_t{100'000'000})
    return cached;
  const uint64_t fresh = shm_bytes_free(SharingStrategy::kFileDescriptor);
  last_bytes.store(fresh, std::memory_order_relaxed);
  last_ns.store(now, std::memory_order_relaxed);
  return fresh;
}

// Every large segment keeps one fd (file_descriptor strategy): lift the soft fd limit to
// the hard one, once, so that a thousand large shared tensors do not hit EMFILE.
void raise_nofile_limit() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct rlimit rl {};
    if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &rl);
    }
  });
}

}  // namespace

std::shared_ptr<Segment> Segment::create(SharingStrategy strategy, uint64_t block_size,
                                         uint32_t num_blocks) {
  const uint64_t header = round_up(sizeof(SegmentHeader) + 8ULL * num_blocks, kPageSize);
  const uint64_t total = header + block_size * num_blocks;
  const uint64_t free_bytes = strategy == SharingStrategy::kFileDescriptor
                                  ? mem_available_for(total)
                                  : shm_bytes_free(strategy);
  if (total > free_bytes) throw_shm_exhausted(strategy, ENOSPC, total);

  std::shared_ptr<Segment> seg(new Segment());
  seg->strategy_ = strategy;
  if (strategy == SharingStrategy::kFileDescriptor) {
    raise_nofile_limit();
    seg->region_ = ShmRegion::create_memfd(total, "torchpar");
    // dev/ino identify the segment in other processes' /proc/<pid>/maps (the allocator's
    // check for blocks whose holders all died), for both strategies.
    seg->key_ = fmt::format("fd:{}:{}", seg->region_.dev(), seg->region_.ino());
  } else {
    // The name travels, not the fd: the region keeps no fd per segment.
    seg->region_ = ShmRegion::create_owned(total);
    seg->key_ = "fs:" + seg->region_.name();
  }
  seg->owner_pid_ = cached_pid();  // from here on the dtor unlinks the name
  char* base = seg->region_.data();
  if (block_size >= (2u << 20)) ::madvise(base, total, MADV_HUGEPAGE);  // best effort
  // A one-block segment is written whole right away (share_memory_ copies the tensor in).
  if (num_blocks == 1) prefault_for_write(base, total);

  auto& h = seg->region_.as<SegmentHeader>();
  h.magic = kSegmentMagic;
  h.version = kSegmentVersion;
  h.num_blocks = num_blocks;
  h.block_size = block_size;
  h.data_offset = header;
  h.total_size = total;
  h.creator_pid = static_cast<int32_t>(cached_pid());
  seg->set_geometry(block_size, num_blocks, header);
  return seg;
}

std::shared_ptr<Segment> Segment::open_fd(UniqueFd fd) {
  std::shared_ptr<Segment> seg(new Segment());
  seg->strategy_ = SharingStrategy::kFileDescriptor;
  const std::string what = fmt::format("received fd {}", fd.get());
  seg->region_ = ShmRegion::open_fd(std::move(fd), kPageSize, what.c_str());
  seg->key_ = fmt::format("fd:{}:{}", seg->region_.dev(), seg->region_.ino());
  seg->validate(what);
  return seg;
}

std::shared_ptr<Segment> Segment::open_name(const std::string& name) {
  std::shared_ptr<Segment> seg(new Segment());
  seg->strategy_ = SharingStrategy::kFileSystem;
  try {
    seg->region_ = ShmRegion::open_named(name, /*writable=*/true, kPageSize);
  } catch (const ShmError& e) {
    if (e.syscall() != "shm_open" || e.error_code() != ENOENT) throw;
    throw ShmError("shm_open", ENOENT, name,
                   "the segment is gone: its creating process exited before the handle was "
                   "opened");
  }
  seg->key_ = "fs:" + name;
  seg->validate(name);
  return seg;
}

void Segment::set_geometry(uint64_t block_size, uint32_t num_blocks, uint64_t data_offset) {
  block_size_ = block_size;
  num_blocks_ = num_blocks;
  data_offset_ = data_offset;
  counters_ = region_.as_array<uint32_t>(sizeof(SegmentHeader), 2ULL * num_blocks);
}

void Segment::validate(const std::string& what) {
  // Copy first, then check the copies: the shared header may change under us.
  const SegmentHeader h = region_.as<SegmentHeader>();
  const uint64_t size = region_.size();
  auto bad = [&](const char* why) {
    throw ShmError("mmap", EINVAL, what, fmt::format("not a valid torchpar segment: {}", why));
  };
  if (h.magic != kSegmentMagic) bad("bad magic");
  if (h.version != kSegmentVersion) bad("unsupported version");
  if (h.num_blocks == 0 || h.block_size == 0) bad("empty geometry");
  const uint64_t counters_end = sizeof(SegmentHeader) + 8ULL * h.num_blocks;
  if (h.data_offset < counters_end || h.data_offset > size) bad("bad data offset");
  if (h.block_size > (size - h.data_offset) / h.num_blocks) bad("blocks exceed the mapping");
  set_geometry(h.block_size, h.num_blocks, h.data_offset);
}

namespace {
std::atomic<int> g_pid{0};
}  // namespace

int cached_pid() {
  int p = g_pid.load(std::memory_order_relaxed);
  if (p == 0) {
    static std::once_flag once;
    std::call_once(once, [] { ::pthread_atfork(nullptr, nullptr, [] { g_pid.store(0); }); });
    p = static_cast<int>(::getpid());
    g_pid.store(p, std::memory_order_relaxed);
  }
  return p;
}

bool Segment::owned_here() const { return owner_pid_ == cached_pid(); }

Segment::~Segment() {
  if (!region_.name().empty() && owned_here()) ::shm_unlink(region_.name().c_str());
}

}  // namespace torchpar::detail
