#include "allocator.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "torchpar/core/env.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {
namespace {

constexpr uint64_t kMinBlock = 512;            // smallest slab size class
constexpr uint64_t kMaxSlabBlock = 256 << 10;  // larger storages get their own segment
constexpr uint64_t kSlabBytes = 2 << 20;       // data bytes per slab segment, at most
// A size class's first slab holds 64 KiB (or one block), the later ones kSlabBytes: a slab
// is reserved (posix_fallocate zeroes every page) when it is made, so a cold share_memory_
// of 4 KiB paid for 2 MiB (197 us against PyTorch's 49 us for its exact-size segment). One
// small slab more per class in use costs one fd and mapping; a doubling series cost six
// and broke ipc_test's fd budget for a queue of 1,000 tensors.
constexpr uint64_t kFirstSlabBytes = 64 << 10;
constexpr uint64_t kLargeRound = 2 << 20;        // large segments of 8 MiB and more round to 2 MiB,
constexpr uint64_t kSmallLargeRound = 64 << 10;  // smaller ones to 64 KiB (reserving is paid
constexpr uint64_t kSmallLargeMax = 8 << 20;     // per page: 1 MiB reserved 2 MiB before)

/// Bytes of the segment for a large storage of `nbytes`.
uint64_t large_segment_bytes(uint64_t nbytes) {
  const uint64_t round = nbytes < kSmallLargeMax ? kSmallLargeRound : kLargeRound;
  return (nbytes + round - 1) / round * round;
}

constexpr size_t kMaxPending = 1 << 20;  // released-but-still-referenced blocks kept

uint64_t cache_limit_bytes() {
  static const uint64_t limit = []() -> uint64_t {
    // Read on a release path that must not throw: a value that is not a whole decimal number
    // disables the cache, as 0 does.
    try {
      return env_unsigned("TORCHPAR_SHM_CACHE_BYTES", uint64_t{1} << 30);
    } catch (const ValueError&) {
      return 0;
    }
  }();
  return limit;
}

int size_class(uint64_t n) {
  int c = 0;
  for (uint64_t b = kMinBlock; b < n; b <<= 1) ++c;
  return c;
}
constexpr int kNumClasses = 10;  // 512 B .. 256 KiB
constexpr int kNumStrategies = 2;

struct Slab {
  std::shared_ptr<Segment> seg;
  std::vector<uint32_t> free;
};

struct Pending {
  std::shared_ptr<Segment> seg;
  uint32_t block;
  Slab* slab;  // nullptr for large segments
};

struct State {
  std::mutex mu;
  // Creator side.
  std::vector<std::unique_ptr<Slab>> slabs[kNumStrategies][kNumClasses];
  std::unordered_map<const Segment*, Slab*> slab_of;
  std::multimap<uint64_t, std::shared_ptr<Segment>> large_cache[kNumStrategies];
  uint64_t cached_bytes = 0;
  std::deque<Pending> pending;
  uint64_t pending_bytes = 0;  // of large segments in `pending`
  // Scans for blocks whose other holders all died (see reclaim_dead_holders).
  std::chrono::steady_clock::time_point last_holder_scan{};
  uint64_t pending_added = 0;  // blocks put on `pending` since the last scan
  // Every segment mapped in this process, by cross-process identity.
  std::unordered_map<std::string, std::weak_ptr<Segment>> mapped;
  // Live storages.
  BlockRef* live = nullptr;
  uint64_t live_count = 0;
  uint64_t segments_created = 0;
  uint64_t cache_hits = 0;
  // Segments imported lately, kept mapped (most recent last) so that a stream of tensors
  // from one peer segment does not map and unmap it for every tensor.
  std::deque<std::shared_ptr<Segment>> imported_recent;
  uint64_t imported_recent_bytes = 0;
  // References a fork() took for a child of ours, by child pid (given back at reaping).
  std::unordered_map<int, std::vector<std::pair<std::shared_ptr<Segment>, uint32_t>>> forks;
};

// The references the last fork() of this thread took for its child.
thread_local std::vector<std::pair<std::shared_ptr<Segment>, uint32_t>> t_last_fork;

// Set in a child forked by the process layer (see parent_releases_fork_refs).
std::atomic<bool> g_parent_releases{false};

State& state() {
  static State* s = [] {
    auto* st = new State();  // leaked on purpose: storages may die during static destruction
    ::pthread_atfork(
        [] {
          // Before fork: take one reference per live storage on behalf of the child, here
          // in the parent, so the parent cannot reuse a block before the child runs.
          // (A failed fork leaves these references behind: those blocks are then never
          // reused, which costs memory, never correctness.)
          State& s0 = state();
          s0.mu.lock();
          t_last_fork.clear();
          for (BlockRef* r = s0.live; r != nullptr; r = r->next) {
            r->seg->refs(r->block).fetch_add(1);
            t_last_fork.emplace_back(r->seg, r->block);
          }
        },
        [] { state().mu.unlock(); },
        [] {
          // In a forked child: inherited storages are ordinary holders of their blocks, and
          // the parent's free lists are forgotten so the two processes never hand out the
          // same block.
          State& s2 = state();
          for (BlockRef* r = s2.live; r != nullptr; r = r->next) {
            r->local_owner = false;
            r->inherited = true;
          }
          g_parent_releases.store(false);
          t_last_fork.clear();
          s2.forks.clear();
          for (auto& per : s2.slabs)
            for (auto& v : per)
              for (auto& slab : v) slab->seg->disown();
          for (auto& c : s2.large_cache)
            for (auto& [_, seg] : c) seg->disown();
          for (auto& p : s2.pending) p.seg->disown();
          for (BlockRef* r = s2.live; r != nullptr; r = r->next) r->seg->disown();
          for (auto& per : s2.slabs)
            for (auto& v : per) v.clear();
          s2.slab_of.clear();
          for (auto& c : s2.large_cache) c.clear();
          s2.cached_bytes = 0;
          s2.pending.clear();
          s2.imported_recent.clear();
          s2.imported_recent_bytes = 0;
          s2.mu.unlock();
        });
    return st;
  }();
  return *s;
}

void link_live(State& s, BlockRef* r) {
  r->next = s.live;
  if (s.live != nullptr) s.live->prev = r;
  s.live = r;
  ++s.live_count;
}

void unlink_live(State& s, BlockRef* r) {
  if (r->prev != nullptr)
    r->prev->next = r->next;
  else
    s.live = r->next;
  if (r->next != nullptr) r->next->prev = r->prev;
  --s.live_count;
}

void make_free(State& s, const std::shared_ptr<Segment>& seg, uint32_t block, Slab* slab) {
  if (slab != nullptr) {
    slab->free.push_back(block);
    return;
  }
  const int si = static_cast<int>(seg->strategy());
  if (s.cached_bytes + seg->total_size() > cache_limit_bytes()) return;  // dropped: unmapped
  s.cached_bytes += seg->total_size();
  s.large_cache[si].emplace(seg->block_size(), seg);
}

uint64_t pending_size(const Pending& p) { return p.slab == nullptr ? p.seg->total_size() : 0; }

// Moves pending blocks whose cross-process count reached 0 back to the free lists. Looks
// at most `budget` entries from the front (the oldest, the likeliest to be free); entries
// still in use go to the back, so a block pinned for long does not stall the scan.
void reclaim_pending(State& s, size_t budget = 64) {
  for (size_t n = std::min(budget, s.pending.size()); n > 0; --n) {
    Pending p = std::move(s.pending.front());
    s.pending.pop_front();
    if (p.seg->refs(p.block).load() == 0) {
      s.pending_bytes -= pending_size(p);
      make_free(s, p.seg, p.block, p.slab);
    } else {
      s.pending.push_back(std::move(p));
    }
  }
}

// Gives up the oldest pending blocks while the list is over its bounds. Their memory is
// returned when the other holders let go; a name stays until this process exits (the
// cleaner unlinks it), so a handle still in flight can be opened.
void trim_pending(State& s, std::vector<std::shared_ptr<Segment>>& drop) {
  while (!s.pending.empty() &&
         (s.pending.size() > kMaxPending || s.pending_bytes > cache_limit_bytes())) {
    Pending& p = s.pending.front();
    s.pending_bytes -= pending_size(p);
    if (p.slab == nullptr) {
      if (p.seg->refs(p.block).load() != 0) p.seg->disown();
      drop.push_back(std::move(p.seg));
    }
    s.pending.pop_front();
  }
}

// (major, minor, inode) of the segments mapped by any other process, among `wanted`.
std::set<std::tuple<unsigned, unsigned, uint64_t>> mapped_by_others(
    const std::set<std::tuple<unsigned, unsigned, uint64_t>>& wanted) {
  std::set<std::tuple<unsigned, unsigned, uint64_t>> found;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return wanted;  // cannot tell: assume every one is in use
  const long self = static_cast<long>(::getpid());
  std::string path;
  char line[4096];
  while (auto* e = ::readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (pid <= 0 || *end != '\0' || pid == self) continue;
    path = fmt::format("/proc/{}/maps", pid);
    FILE* f = std::fopen(path.c_str(), "re");
    if (f == nullptr) continue;  // gone, or not ours to read (and then not our memory)
    while (std::fgets(line, sizeof line, f) != nullptr) {
      unsigned maj = 0, min = 0;
      unsigned long long ino = 0;
      // "start-end perms offset MM:mm inode path"
      if (std::sscanf(line, "%*s %*s %*s %x:%x %llu", &maj, &min, &ino) != 3 || ino == 0) continue;
      const auto key = std::make_tuple(maj, min, static_cast<uint64_t>(ino));
      if (wanted.count(key) != 0) found.insert(key);
    }
    std::fclose(f);
  }
  ::closedir(proc);
  return found;
}

// A process that imported a block and then died without releasing it (SIGKILL) leaves the
// block's cross-process count above 0 for ever, so the creator would never reuse it. When
// the pending list does not free anything, look at who still maps each pending segment:
// a block with no export in flight, held by no storage of ours and no forked child of
// ours, in a segment no other live process maps, has only dead holders: it is freed.
// /proc is read with the lock released; at most every 10 ms when blocks were added since
// the last scan, else at most every second.
void reclaim_dead_holders(State& s, std::unique_lock<std::mutex>& lock) {
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  const auto since = now - s.last_holder_scan;
  if (s.pending.empty() ||
      since < (s.pending_added > 0 ? std::chrono::milliseconds(10) : std::chrono::seconds(1)))
    return;
  s.last_holder_scan = now;
  s.pending_added = 0;
  std::set<std::pair<const Segment*, uint32_t>> ours;
  for (BlockRef* r = s.live; r != nullptr; r = r->next) ours.emplace(r->seg.get(), r->block);
  for (auto& [_, refs] : s.forks)
    for (auto& [seg, block] : refs) ours.emplace(seg.get(), block);
  std::set<std::tuple<unsigned, unsigned, uint64_t>> wanted;
  std::vector<std::shared_ptr<Segment>> keep_alive;  // the candidates, while unlocked
  for (auto& p : s.pending) {
    if (p.seg->refs(p.block).load() == 0 || p.seg->exports(p.block).load() != 0) continue;
    if (p.seg->ino() == 0) continue;  // no identity to look for: assume it is in use
    wanted.emplace(major(p.seg->dev()), minor(p.seg->dev()), p.seg->ino());
    keep_alive.push_back(p.seg);
  }
  if (wanted.empty()) return;
  lock.unlock();
  const auto in_use = mapped_by_others(wanted);
  lock.lock();
  for (auto& p : s.pending) {
    const auto key = std::make_tuple(major(p.seg->dev()), minor(p.seg->dev()), p.seg->ino());
    if (wanted.count(key) == 0 || in_use.count(key) != 0) continue;
    if (ours.count({p.seg.get(), p.block}) != 0 || p.seg->exports(p.block).load() != 0) continue;
    p.seg->refs(p.block).store(0);  // every holder is dead: reclaim_pending frees it
  }
  reclaim_pending(s, s.pending.size());
}

at::DataPtr make_data_ptr(State& s, std::shared_ptr<Segment> seg, uint32_t block, uint64_t nbytes,
                          bool local_owner) {
  auto* ref = new BlockRef();
  char* p = seg->block_ptr(block);
  ref->seg = std::move(seg);
  ref->block = block;
  ref->nbytes = nbytes;
  ref->local_owner = local_owner;
  link_live(s, ref);
  return at::DataPtr(p, ref, &block_deleter, at::Device(at::kCPU));
}

void register_mapped(State& s, const std::shared_ptr<Segment>& seg) {
  if (s.mapped.size() > 1024) {  // drop expired entries now and then
    for (auto it = s.mapped.begin(); it != s.mapped.end();) {
      if (it->second.expired())
        it = s.mapped.erase(it);
      else
        ++it;
    }
  }
  s.mapped[seg->key()] = seg;
}

constexpr size_t kRecentSegments = 64;
constexpr uint64_t kRecentBytes = 256ULL << 20;

void keep_recent(State& s, const std::shared_ptr<Segment>& seg,
                 std::vector<std::shared_ptr<Segment>>& drop) {
  if (!s.imported_recent.empty() && s.imported_recent.back() == seg) return;
  for (auto it = s.imported_recent.begin(); it != s.imported_recent.end(); ++it) {
    if (*it == seg) {
      s.imported_recent.erase(it);
      s.imported_recent_bytes -= seg->total_size();
      break;
    }
  }
  s.imported_recent.push_back(seg);
  s.imported_recent_bytes += seg->total_size();
  while (s.imported_recent.size() > kRecentSegments || s.imported_recent_bytes > kRecentBytes) {
    s.imported_recent_bytes -= s.imported_recent.front()->total_size();
    drop.push_back(std::move(s.imported_recent.front()));
    s.imported_recent.pop_front();
  }
}

}  // namespace

void block_deleter(void* ctx) {
  auto* ref = static_cast<BlockRef*>(ctx);
  State& s = state();
  std::shared_ptr<Segment> seg;
  std::vector<std::shared_ptr<Segment>> drop;  // unmapped after the lock is released
  {
    std::lock_guard<std::mutex> lock(s.mu);
    unlink_live(s, ref);
    const bool parent_gives_back = ref->inherited && g_parent_releases.load();
    const uint32_t left = parent_gives_back ? 1 : ref->seg->refs(ref->block).fetch_sub(1) - 1;
    if (ref->local_owner && ref->seg->owned_here()) {
      auto it = s.slab_of.find(ref->seg.get());
      Slab* slab = it == s.slab_of.end() ? nullptr : it->second;
      if (left == 0) {
        make_free(s, ref->seg, ref->block, slab);
      } else {
        s.pending.push_back({ref->seg, ref->block, slab});
        s.pending_bytes += pending_size(s.pending.back());
        ++s.pending_added;
        trim_pending(s, drop);
      }
    }
    seg = std::move(ref->seg);  // a last unmap happens outside the lock
  }
  delete ref;
}

BlockRef* block_of(const c10::Storage& storage) {
  if (!storage) return nullptr;
  const auto& dp = storage.data_ptr();
  if (dp.get_deleter() != &block_deleter) return nullptr;
  return static_cast<BlockRef*>(dp.get_context());
}

namespace {
// Creates a segment; when shared memory is short, gives the cached free segments back to
// the system and tries once more.
std::shared_ptr<Segment> create_segment(SharingStrategy strategy, uint64_t block_size,
                                        uint32_t num_blocks) {
  try {
    return Segment::create(strategy, block_size, num_blocks);
  } catch (const ShmError&) {
    if (shm_stats().cached_bytes == 0) throw;
    empty_shm_cache();
    return Segment::create(strategy, block_size, num_blocks);
  }
}
}  // namespace

at::DataPtr shm_allocate(uint64_t nbytes) {
  const SharingStrategy strategy = current_sharing_strategy();
  const int si = static_cast<int>(strategy);
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);

  if (nbytes <= kMaxSlabBlock) {
    const int c = size_class(nbytes);
    auto& slabs = s.slabs[si][c];
    // Free blocks first; only when there are none, look for pending blocks whose other
    // holders let go (a full scan, amortized over the blocks it frees).
    for (int attempt = 0; attempt < 3; ++attempt) {
      for (auto& slab : slabs) {
        if (!slab->free.empty()) {
          uint32_t b = slab->free.back();
          slab->free.pop_back();
          slab->seg->refs(b).store(1);
          return make_data_ptr(s, slab->seg, b, nbytes, true);
        }
      }
      if (attempt == 0 && !s.pending.empty())
        reclaim_pending(s);
      else if (attempt == 1 && !s.pending.empty())
        reclaim_dead_holders(s, lock);
      else
        break;
    }
    const uint64_t block_size = kMinBlock << c;
    const uint64_t slab_bytes = slabs.empty() ? std::max(block_size, kFirstSlabBytes) : kSlabBytes;
    const auto nblocks = static_cast<uint32_t>(slab_bytes / block_size);
    lock.unlock();  // creating a segment may fork the cleaner and fault memory in
    auto seg = create_segment(strategy, block_size, nblocks);
    lock.lock();
    ++s.segments_created;
    auto slab = std::make_unique<Slab>();
    slab->seg = seg;
    for (uint32_t b = nblocks; b-- > 1;) slab->free.push_back(b);
    s.slab_of[seg.get()] = slab.get();
    slabs.push_back(std::move(slab));
    register_mapped(s, seg);
    seg->refs(0).store(1);
    return make_data_ptr(s, seg, 0, nbytes, true);
  }

  const uint64_t want = large_segment_bytes(nbytes);
  auto& cache = s.large_cache[si];
  auto it = cache.lower_bound(want);
  if ((it == cache.end() || it->first > want + want / 4 + kLargeRound) && !s.pending.empty()) {
    reclaim_pending(s);
    it = cache.lower_bound(want);
    if (it == cache.end() || it->first > want + want / 4 + kLargeRound) {
      reclaim_dead_holders(s, lock);
      it = cache.lower_bound(want);
    }
  }
  if (it != cache.end() && it->first <= want + want / 4 + kLargeRound) {
    auto seg = it->second;
    cache.erase(it);
    s.cached_bytes -= seg->total_size();
    ++s.cache_hits;
    seg->refs(0).store(1);
    return make_data_ptr(s, seg, 0, nbytes, true);
  }
  lock.unlock();
  auto seg = create_segment(strategy, want, 1);
  lock.lock();
  ++s.segments_created;
  register_mapped(s, seg);
  seg->refs(0).store(1);
  return make_data_ptr(s, seg, 0, nbytes, true);
}

namespace {

std::string fd_key(uint64_t dev, uint64_t ino) { return fmt::format("fd:{}:{}", dev, ino); }

// The live mapping of `key` in this process, or nullptr.
std::shared_ptr<Segment> find_mapped(State& s, const std::string& key) {
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.mapped.find(key);
  return it == s.mapped.end() ? nullptr : it->second.lock();
}

// The block of a handle in its mapped segment `seg`: checks the handle against the
// segment, then adopts (claims one export) or borrows a reference.
at::DataPtr import_block(State& s, std::shared_ptr<Segment> seg, const StorageHandle& h,
                         bool adopt) {
  const uint64_t segment_bytes = h.segment_bytes;
  const uint32_t block = h.block;
  const uint64_t nbytes = h.nbytes;
  {
    std::vector<std::shared_ptr<Segment>> drop;
    std::lock_guard<std::mutex> lock(s.mu);
    keep_recent(s, seg, drop);
  }
  if (seg->total_size() != segment_bytes)
    throw SerializationError(
        fmt::format("shared tensor handle says its segment has {} bytes, "
                    "the segment has {}",
                    segment_bytes, seg->total_size()));
  if (block >= seg->num_blocks() || nbytes > seg->block_size())
    throw SerializationError(
        fmt::format("shared tensor handle names block {} of {} bytes; the "
                    "segment has {} blocks of {} bytes",
                    block, nbytes, seg->num_blocks(), seg->block_size()));
  auto exports = seg->exports(block);
  if (adopt) {
    // Claim one export of the block: the reference it carries becomes this storage's.
    uint32_t cur = exports.load();
    do {
      if ((cur & ~kPinnedExport) == 0)
        throw SerializationError(
            (cur & kPinnedExport) != 0
                ? "shared tensor handle has no export left to claim: it was already "
                  "imported, or its block is pinned for borrowers (dumps with pin_shared, a "
                  "manager's stored value), whose payloads load with adopt_shared=false"
                : "shared tensor handle was already imported, or never exported: "
                  "a payload made with copy_tensor=false can be loaded once");
    } while (!exports.compare_exchange_weak(cur, cur - 1));
  } else {
    // Borrow: the payload's export is never claimed, so its reference keeps the block
    // from being reused and a reference of our own is safe to add. Without an unclaimed
    // export the block may already hold another storage.
    if (exports.load() == 0)
      throw SerializationError(
          "shared tensor handle has no unclaimed export (it was loaded with "
          "adopt_shared=true, or never exported): cannot borrow the block");
    seg->refs(block).fetch_add(1);
  }
  std::lock_guard<std::mutex> lock(s.mu);
  return make_data_ptr(s, std::move(seg), block, nbytes, false);
}

}  // namespace

at::DataPtr shm_import(const StorageHandle& h, UniqueFd fd, bool adopt) {
  return shm_import_borrowed(h, fd.get(), adopt, &fd);
}

at::DataPtr shm_import_borrowed(const StorageHandle& h, int fd, bool adopt, UniqueFd* owned) {
  State& s = state();
  std::shared_ptr<Segment> seg;
  std::string key;
  UniqueFd opened;  // the /proc/<pid>/fd path's own fd
  const SharingStrategy strategy = h.strategy;
  if (strategy == SharingStrategy::kFileDescriptor) {
    // A segment this process has mapped already (the usual case when the same tensors go
    // back and forth) is found by the handle's identity, without a look at the fd.
    key = fd_key(h.dev, h.ino);
    seg = find_mapped(s, key);
    if (!seg && fd >= 0) {
      struct stat st {};
      check_syscall("fstat", fmt::format("received fd {}", fd), [&] { return ::fstat(fd, &st); });
      key = fd_key(st.st_dev, st.st_ino);
      seg = find_mapped(s, key);
    } else if (!seg) {
      if (h.pid <= 0 || h.fd_number < 0)
        throw SerializationError("shared tensor handle without its file descriptor");
      const std::string path = fmt::format("/proc/{}/fd/{}", h.pid, h.fd_number);
      const int raw = retry_eintr([&] { return ::open(path.c_str(), O_RDWR | O_CLOEXEC); });
      if (raw < 0)
        throw ShmError("open", errno, path,
                       "cannot reach the exporter's segment (has the sending process exited?)");
      opened.reset(raw);
      struct stat st {};
      if (::fstat(raw, &st) != 0 || static_cast<uint64_t>(st.st_dev) != h.dev ||
          static_cast<uint64_t>(st.st_ino) != h.ino)
        throw ShmError("open", ESTALE, path, "the fd no longer names the exported segment");
    }
  } else {
    key = "fs:" + h.name;
    seg = find_mapped(s, key);
  }
  if (!seg) {
    if (strategy == SharingStrategy::kFileDescriptor) {
      // The mapping keeps an fd of its own: the one opened above, the caller's if it gave
      // it away, or else a duplicate of the borrowed one.
      UniqueFd mine;
      if (opened.valid())
        mine = std::move(opened);
      else if (owned != nullptr && owned->get() == fd)
        mine = std::move(*owned);
      else
        mine.reset(check_syscall("fcntl(F_DUPFD_CLOEXEC)", fmt::format("received fd {}", fd),
                                 [&] { return ::fcntl(fd, F_DUPFD_CLOEXEC, 0); }));
      seg = Segment::open_fd(std::move(mine));
    } else {
      seg = Segment::open_name(h.name);
    }
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.mapped.find(key);
    if (auto existing = it == s.mapped.end() ? nullptr : it->second.lock())
      seg = existing;
    else
      register_mapped(s, seg);
  }
  return import_block(s, std::move(seg), h, adopt);
}

std::shared_ptr<Segment> mapped_fd_segment(uint64_t dev, uint64_t ino) {
  return find_mapped(state(), fd_key(dev, ino));
}

void claim_fork_refs(int pid) {
  State& s = state();
  auto refs = std::move(t_last_fork);
  t_last_fork.clear();
  std::lock_guard<std::mutex> lock(s.mu);
  s.forks[pid] = std::move(refs);
}

void parent_releases_fork_refs() { g_parent_releases.store(true); }

void release_fork_refs(int pid) {
  State& s = state();
  std::vector<std::pair<std::shared_ptr<Segment>, uint32_t>> refs;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.forks.find(pid);
    if (it == s.forks.end()) return;
    refs = std::move(it->second);
    s.forks.erase(it);
    for (auto& [seg, block] : refs) seg->refs(block).fetch_sub(1);
    reclaim_pending(s, s.pending.size());
  }
}

}  // namespace torchpar::detail

namespace torchpar {

ShmStats shm_stats() {
  auto& s = detail::state();
  std::lock_guard<std::mutex> lock(s.mu);
  ShmStats st;
  for (auto& [_, w] : s.mapped) {
    if (auto seg = w.lock()) {
      ++st.segments;
      st.mapped_bytes += seg->total_size();
    }
  }
  st.live_blocks = s.live_count;
  st.cached_bytes = s.cached_bytes;
  st.segments_created = s.segments_created;
  st.cache_hits = s.cache_hits;
  return st;
}

void empty_shm_cache() {
  auto& s = detail::state();
  std::multimap<uint64_t, std::shared_ptr<detail::Segment>> drop[detail::kNumStrategies];
  std::deque<std::shared_ptr<detail::Segment>> recent;
  std::vector<std::unique_ptr<detail::Slab>> free_slabs;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    for (int i = 0; i < detail::kNumStrategies; ++i) drop[i].swap(s.large_cache[i]);
    // Slabs with every block free go back to the system too (PyTorch's leak checks expect
    // no segment left once the tensors are gone). A slab block on the pending list is
    // not on its free list, so such a slab is never fully free.
    for (auto& per_strategy : s.slabs) {
      for (auto& slabs : per_strategy) {
        for (auto it = slabs.begin(); it != slabs.end();) {
          if ((*it)->free.size() == (*it)->seg->num_blocks()) {
            s.slab_of.erase((*it)->seg.get());
            free_slabs.push_back(std::move(*it));
            it = slabs.erase(it);
          } else {
            ++it;
          }
        }
      }
    }
    s.cached_bytes = 0;
    recent.swap(s.imported_recent);
    s.imported_recent_bytes = 0;
  }
}

}  // namespace torchpar
