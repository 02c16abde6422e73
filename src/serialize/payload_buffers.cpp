#include "serialize/payload_buffers.h"

#include <pthread.h>

#include <c10/core/CPUAllocator.h>

#include <mutex>
#include <vector>

#include "torchpar/serialize/serialize.h"

namespace torchpar::detail {
namespace {

struct BufferCache {
  std::mutex mu;
  std::vector<std::string> buffers;  // at most kCachedBufferCount
  size_t bytes = 0;                  // their capacities

  BufferCache() {
    // A fork while another thread holds `mu` would leave the child's copy locked for
    // good; the child also drops the parent's buffers, whose pages it would otherwise
    // copy on its first write into them.
    ::pthread_atfork([] { cache().mu.lock(); }, [] { cache().mu.unlock(); },
                     [] {
                       cache().mu.unlock();
                       clear_payload_buffers();
                     });
  }
  static BufferCache& cache();
};

BufferCache& BufferCache::cache() {
  static auto* c = new BufferCache();  // never destroyed: storages may outlive statics
  return *c;
}

void delete_shared_buffer(void* ctx) { release_shared_buffer(static_cast<SharedBuffer*>(ctx)); }

}  // namespace

std::string take_payload_buffer(size_t min_capacity) {
  std::string out;
  if (min_capacity < kCachedBufferBytes) return out;
  auto& c = BufferCache::cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto it = c.buffers.begin(); it != c.buffers.end(); ++it) {
    const size_t cap = it->capacity();
    if (cap >= min_capacity && cap / 2 <= min_capacity) {
      c.bytes -= cap;
      out.swap(*it);
      c.buffers.erase(it);
      break;
    }
  }
  return out;
}

void recycle_payload_buffer(std::string&& buffer) noexcept {
  std::string dropped;  // freed after the lock is released
  {
    const size_t cap = buffer.capacity();
    if (cap < kCachedBufferBytes || cap > kCachedBufferLimit) {
      dropped.swap(buffer);
    } else {
      auto& c = BufferCache::cache();
      std::lock_guard<std::mutex> lock(c.mu);
      if (c.buffers.size() >= kCachedBufferCount || c.bytes + cap > kCachedBufferLimit) {
        dropped.swap(buffer);
      } else {
        buffer.clear();
        try {
          c.buffers.push_back(std::move(buffer));
          c.bytes += cap;
        } catch (...) {  // no room for the entry: the buffer is simply freed
        }
      }
    }
  }
}

void clear_payload_buffers() noexcept {
  std::vector<std::string> dropped;
  {
    auto& c = BufferCache::cache();
    std::lock_guard<std::mutex> lock(c.mu);
    dropped.swap(c.buffers);
    c.bytes = 0;
  }
}

void release_shared_buffer(SharedBuffer* buffer) noexcept {
  if (buffer->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  recycle_payload_buffer(std::move(buffer->bytes));
  delete buffer;
}

c10::Storage storage_over(SharedBuffer* buffer, const char* data, size_t nbytes) {
  buffer->refs.fetch_add(1, std::memory_order_relaxed);
  c10::DataPtr ptr(const_cast<char*>(data), buffer, &delete_shared_buffer,
                   c10::Device(c10::DeviceType::CPU));
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, std::move(ptr),
                      c10::GetCPUAllocator(), /*resizable=*/true);
}

}  // namespace torchpar::detail

namespace torchpar {
void empty_payload_cache() { detail::clear_payload_buffers(); }
}  // namespace torchpar
