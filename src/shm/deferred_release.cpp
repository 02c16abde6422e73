#include "deferred_release.h"

#include <c10/core/CPUAllocator.h>
#include <pthread.h>

#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <new>
#include <thread>
#include <utility>

#include "torchpar/core/error.h"

namespace torchpar::detail {
namespace {

struct QueuedBuffer {
  c10::DataPtr ptr;
  size_t nbytes;
};

struct BufferReaper {
  std::mutex mu;
  std::condition_variable cv;  // work queued, or a buffer freed
  std::deque<QueuedBuffer> pending;
  size_t pending_bytes = 0;
  uint64_t queued = 0;  // handed to the thread, in this process
  uint64_t freed = 0;   // freed by it
  bool running = false;
  bool closing = false;  // the process is exiting: callers free their buffers
  std::thread thread;    // joined at exit, so that it ends with its thread-local state freed

  BufferReaper() {
    // A fork while the thread or a caller holds `mu` would leave the child's copy locked;
    // the child has no thread, and the parent's condition variable may hold the parent
    // thread's waiter state: both are made new there.
    ::pthread_atfork([] { get().mu.lock(); }, [] { get().mu.unlock(); },
                     [] {
                       BufferReaper& r = get();
                       r.mu.unlock();
                       new (&r.cv) std::condition_variable();
                       // The parent's thread is not in this process: forget its handle
                       // (destroying or joining it would fail).
                       new (&r.thread) std::thread();
                       r.running = false;
                       // A buffer the parent's thread was freeing at the fork is not in
                       // `pending`: this child never frees its copy (private pages, gone at
                       // exit).
                       r.pending_bytes = 0;
                       for (const auto& p : r.pending) r.pending_bytes += p.nbytes;
                       r.freed = 0;
                       r.queued = r.pending.size();
                     });
    // At exit, before the statics of LibTorch's allocator (made before this object) are
    // destroyed: the thread finishes the buffer it is freeing and ends, and the ones still
    // queued are freed here, so that no deleter runs during static destruction.
    std::atexit([] { get().close(); });
  }

  void close() noexcept {
    std::deque<QueuedBuffer> left;
    {
      std::lock_guard<std::mutex> lock(mu);
      closing = true;
      left.swap(pending);
      for (const auto& q : left) pending_bytes -= q.nbytes;  // the thread's own buffer stays
      cv.notify_all();
    }
    if (thread.joinable() && thread.get_id() != std::this_thread::get_id()) thread.join();
  }  // `left` frees them here

  static BufferReaper& get() {
    static auto* r = new BufferReaper();  // never destroyed: its thread is joined at exit
    return *r;
  }

  /// Starts the thread unless it runs; false when none can be started. Under `mu`.
  bool ensure_running() {
    if (running) return true;
    try {
      thread = std::thread([this] { run(); });
    } catch (...) {
      return false;
    }
    running = true;
    return true;
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return !pending.empty() || closing; });
      if (pending.empty()) return;  // closing
      QueuedBuffer p = std::move(pending.front());
      pending.pop_front();
      lock.unlock();
      p.ptr.clear();  // the munmap
      lock.lock();
      pending_bytes -= p.nbytes;
      ++freed;
      cv.notify_all();
    }
  }
};

bool default_cpu_buffer(const c10::DataPtr& ptr) {
  const c10::DeleterFnPtr d = ptr.get_deleter();
  return d != nullptr && d == c10::GetDefaultCPUAllocator()->raw_deleter();
}

}  // namespace

void release_later(c10::DataPtr&& ptr, size_t nbytes) noexcept {
  c10::DataPtr mine = std::move(ptr);  // freed here unless queued
  if (nbytes < kDeferredReleaseMinBytes || !default_cpu_buffer(mine)) return;
  BufferReaper& r = BufferReaper::get();
  std::lock_guard<std::mutex> lock(r.mu);
  // Exiting, too much waiting, or no thread: the caller frees it (on return).
  if (r.closing || r.pending_bytes + nbytes > kDeferredReleaseMaxPendingBytes ||
      !r.ensure_running()) {
    return;
  }
  r.pending.push_back({std::move(mine), nbytes});
  r.pending_bytes += nbytes;
  ++r.queued;
  r.cv.notify_all();
}

uint64_t drain_released(double timeout) {
  BufferReaper& r = BufferReaper::get();
  std::unique_lock<std::mutex> lock(r.mu);
  const uint64_t target = r.queued;
  if (r.freed < target && (r.closing || !r.ensure_running())) {  // freed here instead
    std::deque<QueuedBuffer> left;
    left.swap(r.pending);
    r.pending_bytes = 0;
    r.freed += left.size();
    const uint64_t freed = r.freed;
    lock.unlock();
    return freed;  // `left` frees them on return
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
  if (!r.cv.wait_until(lock, deadline, [&] { return r.freed >= target; })) {
    throw TimeoutError(
        fmt::format("drain_released: {} of {} queued buffers freed after {:.3f} s (the rest go on)",
                    r.freed, target, timeout));
  }
  return r.freed;
}

}  // namespace torchpar::detail
