// The shm backend's single copies: large broadcast, all_gather, reduce_scatter and all_to_all
// copied straight between the ranks' tensors with cross-memory attach (process_vm_readv and
// process_vm_writev), where the slots take two copies per byte (backend_impl.h says when).
//
// Every operation here runs two steps: in the first each rank publishes the addresses of its
// tensors in its slot (and checks the others' metadata); between the two it copies; the second
// tells every rank that nobody copies from or into its tensors any more.

#include <ATen/core/Tensor.h>
#include <fmt/format.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "core/liveness.h"
#include "dist/backend/shm/backend_impl.h"
#include "dist/reduce_kernels.h"
#include "dist/store.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"

namespace torchpar::detail::shm_backend {
namespace {

/// A reduce_scatter reads the others' pieces this much at a time into a private block (kept
/// in the core's L2) and combines from there.
constexpr size_t kSingleCopyBlockBytes = 128 << 10;

/// An all_gather or all_to_all copies this rank's own part with non-temporal stores when the
/// part is at least this big: it does not stay in the cache anyway, and the stores skip
/// reading the destination first. 2 ranks, each copying its own part and reading the other's
/// with process_vm_readv, interleaved on the 2-core EPYC VM: 4 MiB parts 0.56-0.59 ms memcpy /
/// 0.66-0.68 streamed (cache-resident), 8 MiB 1.77-1.86 / 1.61-1.72, 16 MiB 5.05 / 3.74-4.21,
/// 64 MiB 22.5-23.7 / 18.3-21.2.
constexpr size_t kStreamOwnPartBytes = 8 << 20;

/// Copies `n` bytes of this rank's own part: streamed when `stream` (see kStreamOwnPartBytes).
void copy_own_part(char* dst, const char* src, size_t n, bool stream) {
  if (!stream) {
    std::memcpy(dst, src, n);
    return;
  }
  stream_copy(dst, src, n);
  stream_fence();
}

/// One rank's contiguous tensors' data, as addresses to publish.
uint64_t address_of(const void* p) { return reinterpret_cast<uintptr_t>(p); }

/// Whether two tensors' bytes share memory.
bool overlap(const at::Tensor& a, const at::Tensor& b) {
  const auto* x = static_cast<const char*>(a.data_ptr());
  const auto* y = static_cast<const char*>(b.data_ptr());
  return a.nbytes() > 0 && b.nbytes() > 0 && x < y + b.nbytes() && y < x + a.nbytes();
}

/// An output this rank writes while the others may still read its inputs: staged outputs. When
/// some output shares memory with an input the others read (an in-place all_to_all, an
/// all_gather into a list that holds the input at another rank's place), every result of this
/// rank goes to a private buffer first and into the outputs after the last step, once nobody
/// reads this rank's inputs; the other ranks run the same steps either way.
class Stage {
 public:
  Stage(bool staged, size_t bytes) {
    if (staged) buf_ = std::make_unique<char[]>(bytes);
  }
  bool on() const { return buf_ != nullptr; }
  /// Where the part at byte `off` of the results goes: the stage, or `out`.
  char* at(size_t off, void* out) const {
    return on() ? buf_.get() + off : static_cast<char*>(out);
  }

 private:
  std::unique_ptr<char[]> buf_;
};

}  // namespace

void ShmBackend::probe_single_copy(c10d::Store& store, SteadyClock::time_point deadline) {
  bool ok = env_flag("TORCHPAR_SHM_SINGLE_COPY", true);
  for (int q = 0; q < size() && ok; ++q) {
    if (q == rank()) continue;
    uint64_t seen = 0;
    iovec local{&seen, sizeof seen};
    iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(ctl_[q].probe_addr)), sizeof seen};
    const ssize_t n = ::process_vm_readv(ctl_[q].pid, &local, 1, &remote, 1, 0);
    ok = n == static_cast<ssize_t>(sizeof seen) &&
         seen == (kMagic ^ static_cast<uint64_t>(static_cast<uint32_t>(ctl_[q].pid)));
  }
  ctl_[rank()].single_copy.store(ok ? kSingleCopyYes : kSingleCopyNo, std::memory_order_release);
  if (!store_barrier(store, "single_copy_probed", size(), deadline)) {
    throw TimeoutError(fmt::format(
        "{}: a rank did not finish attaching to the shared-memory segment within {:.1f} s", name(),
        timeout().count()));
  }
  single_copy_ = size() > 1;
  for (int q = 0; q < size(); ++q) {
    if (ctl_[q].single_copy.load(std::memory_order_acquire) != kSingleCopyYes) single_copy_ = false;
  }
}

void ShmBackend::cma_copy(bool write, int q, char* local, uint64_t remote, size_t len) {
  const pid_t pid = ctl_[q].pid;
  while (len > 0) {
    iovec l{local, len};
    iovec r{reinterpret_cast<void*>(static_cast<uintptr_t>(remote)), len};
    const ssize_t n = write ? ::process_vm_writev(pid, &l, 1, &r, 1, 0)
                            : ::process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n > 0) {
      local += n;
      remote += static_cast<uint64_t>(n);
      len -= static_cast<size_t>(n);
      continue;
    }
    const int err = n < 0 ? errno : EFAULT;
    if (err == EINTR) continue;
    // Rank q gave up first (its timeout, or a rank it waited for is gone) and may have
    // freed its tensor: its reason is the group's.
    barrier_.throw_if_aborted();
    // A process being torn down fails with ESRCH, or EFAULT while its memory goes away.
    bool gone = err == ESRCH || !pid_alive(pid);
    // EFAULT from a live peer: its tensor was valid until it returns from this operation,
    // which it cannot before the step after this copy, so it is going away (its exit tears its
    // memory down before its pid goes) or gave up (its abort). Bounded wait to tell which.
    for (int i = 0; i < 100 && !gone && err == EFAULT; ++i) {
      barrier_.throw_if_aborted();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      gone = !pid_alive(pid);
    }
    const std::string msg =
        gone ? fmt::format("{}: rank {} (pid {}) died before finishing {} call #{}", name(), q, pid,
                           wait_.op, wait_.call)
             : fmt::format("{}: {} of {} bytes with rank {} (pid {}) failed in {} call #{}: {}",
                           name(), write ? "process_vm_writev" : "process_vm_readv", len, q, pid,
                           wait_.op, wait_.call, std::strerror(err));
    barrier_.abort(q, msg, gone ? AbortKind::kLost : AbortKind::kError);
    barrier_.throw_if_aborted();
    throw Error(msg);  // not reached: the abort above (or an earlier one) throws
  }
}

void ShmBackend::exchange_addresses(std::initializer_list<const void*> addrs) {
  char* out = my_slot();
  for (const void* a : addrs) {
    const uint64_t v = address_of(a);
    std::memcpy(out, &v, sizeof v);
    out += sizeof v;
  }
  arrive_and_wait();
}

void ShmBackend::exchange_addresses(const std::vector<at::Tensor>& tensors) {
  char* out = my_slot();
  for (const auto& t : tensors) {
    const uint64_t v = address_of(t.data_ptr());
    std::memcpy(out, &v, sizeof v);
    out += sizeof v;
  }
  arrive_and_wait();
}

void ShmBackend::broadcast_single_copy(char* data, size_t bytes, int src) {
  exchange_addresses({data});
  if (size() == 2) {
    // Both cores copy: the root writes the second half into the other rank's tensor while
    // that rank reads the first half from the root's.
    const size_t half = bytes / 2 / 4096 * 4096;
    if (rank() == src) {
      const int q = 1 - src;
      cma_copy(/*write=*/true, q, data + half, peer_addr(q, 0) + half, bytes - half);
    } else {
      cma_copy(/*write=*/false, src, data, peer_addr(src, 0), half);
    }
  } else if (rank() != src) {
    cma_copy(/*write=*/false, src, data, peer_addr(src, 0), bytes);
  }
  arrive_and_wait();
}

void ShmBackend::all_gather_single_copy(const at::Tensor& in, const std::vector<at::Tensor>& out) {
  const size_t bytes = in.nbytes();
  const char* src = static_cast<const char*>(in.data_ptr());
  bool staged = false;
  for (int q = 0; q < size(); ++q) staged = staged || (q != rank() && overlap(out[q], in));
  const Stage stage(staged, bytes * size());
  auto dst = [&](int q) { return stage.at(q * bytes, out[q].data_ptr()); };
  // This rank's own part first, while the others publish (the input may be its own output).
  const bool stream = bytes >= kStreamOwnPartBytes;
  if (dst(rank()) != src) copy_own_part(dst(rank()), src, bytes, stream);
  exchange_addresses({src});
  for (int i = 1; i < size(); ++i) {
    const int q = (rank() + i) % size();  // not all from rank 0 at once
    cma_copy(/*write=*/false, q, dst(q), peer_addr(q, 0), bytes);
  }
  arrive_and_wait();
  if (stage.on()) {
    for (int q = 0; q < size(); ++q) std::memcpy(out[q].data_ptr(), dst(q), bytes);
  }
}

void ShmBackend::all_to_all_single_copy(const std::vector<at::Tensor>& out,
                                        const std::vector<at::Tensor>& in) {
  const size_t bytes = in[0].nbytes();
  const int me = rank();
  bool staged = false;  // an output over an input, but for this rank's own part in place
  for (int q = 0; q < size(); ++q) {
    for (int p = 0; p < size(); ++p) {
      const bool own_in_place = q == me && p == me && out[q].data_ptr() == in[p].data_ptr();
      staged = staged || (!own_in_place && overlap(out[q], in[p]));
    }
  }
  const Stage stage(staged, bytes * size());
  auto dst = [&](int q) { return stage.at(q * bytes, out[q].data_ptr()); };
  const bool stream = bytes >= kStreamOwnPartBytes;
  if (dst(me) != in[me].data_ptr()) {
    copy_own_part(dst(me), static_cast<const char*>(in[me].data_ptr()), bytes, stream);
  }
  exchange_addresses(in);
  for (int i = 1; i < size(); ++i) {
    const int q = (me + i) % size();
    cma_copy(/*write=*/false, q, dst(q), peer_addr(q, static_cast<size_t>(me)), bytes);
  }
  arrive_and_wait();
  if (stage.on()) {
    for (int q = 0; q < size(); ++q) std::memcpy(out[q].data_ptr(), dst(q), bytes);
  }
}

void ShmBackend::reduce_scatter_single_copy(const at::Tensor& out,
                                            const std::vector<at::Tensor>& in, ReduceOp op) {
  const at::ScalarType dtype = out.scalar_type();
  const size_t es = out.element_size();
  const size_t bytes = out.nbytes();
  const int me = rank();
  exchange_addresses(in);
  // out = in_0[me] op in_1[me] op ... in rank order (the bits every backend gives), a block
  // at a time: the others' blocks read into private buffers first.
  const size_t block = kSingleCopyBlockBytes / es * es;
  if (!single_copy_blocks_) single_copy_blocks_ = std::make_unique<char[]>(2 * block);
  char* blocks = single_copy_blocks_.get();
  // The output over an input the others read, or over this rank's own input elsewhere than in
  // place: the sum goes to a stage first (see Stage).
  bool staged = false;
  for (int p = 0; p < size(); ++p) {
    // In place is safe only where this rank's piece is read by the first combine, before any
    // result is written (ranks 0 and 1; a later rank's piece would be read after).
    const bool in_place = p == me && me < 2 && out.data_ptr() == in[p].data_ptr();
    staged = staged || (!in_place && overlap(out, in[p]));
  }
  const Stage stage(staged, bytes);
  char* dst = stage.at(0, out.data_ptr());
  const char* mine = static_cast<const char*>(in[me].data_ptr());
  for (size_t off = 0; off < bytes; off += block) {
    const size_t len = std::min(block, bytes - off);
    auto operand = [&](int q, char* buf) -> const char* {
      if (q == me) return mine + off;
      cma_copy(/*write=*/false, q, buf, peer_addr(q, static_cast<size_t>(me)) + off, len);
      return buf;
    };
    const char* a = operand(0, blocks);
    const char* b = operand(1, blocks + block);
    reduce_combine(dst + off, a, b, len / es, dtype, op);
    for (int q = 2; q < size(); ++q) {
      reduce_combine(dst + off, dst + off, operand(q, blocks), len / es, dtype, op);
    }
  }
  arrive_and_wait();
  if (stage.on()) std::memcpy(out.data_ptr(), dst, bytes);
}

}  // namespace torchpar::detail::shm_backend
