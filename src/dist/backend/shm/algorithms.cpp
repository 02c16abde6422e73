// The shm backend's collectives: chunked copies and reductions through the segment's data
// slots, one step barrier per chunk (segment_layout.h has the step protocol). Tensors (and the
// whole input lists of reduce_scatter and all_to_all) of at most kInlineBytes travel inline, in
// the cache line of each rank's step counter.

#include <ATen/core/Tensor.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <memory>

#include "dist/backend/shm/backend_impl.h"
#include "dist/reduce_kernels.h"

namespace torchpar::detail::shm_backend {
namespace {

constexpr size_t kSmallBytes = 32 << 10;  // one-step all_reduce below this
constexpr size_t kStreamBytes = 4 << 20;  // tensors at least this big: results bypass caches
/// A chunked reduction combines its piece this much at a time into a private block and
/// copies the block out with memcpy. Storing the combined values straight into the slot
/// was the slowest part of a 16 MiB all_reduce (per 128 KiB piece on the 2-core EPYC VM:
/// 20-25 us straight, 12-13 us through 16 KiB blocks, where memcpy writes whole lines the
/// other rank still holds without reading them first). Larger blocks restart the streams
/// less often: 16 MiB on 2 ranks, 3 interleaved runs each, 16 KiB 1.57-1.70 ms, 32 KiB
/// 1.46-1.61, 64 KiB 1.45-1.52, 128-256 KiB no better (software prefetch of the next block:
/// worse, 1.84-1.95).
constexpr size_t kReduceBlockBytes = 64 << 10;

void copy_out(char* dst, const char* src, size_t n, bool stream) {
  if (stream) {
    stream_copy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

template <class F>
void for_chunks(size_t bytes, size_t chunk, F&& f) {
  if (bytes == 0) {
    f(0, 0);
    return;
  }
  for (size_t off = 0; off < bytes; off += chunk) f(off, std::min(chunk, bytes - off));
}

}  // namespace

void stream_copy(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (n < head + 64) {
    std::memcpy(dst, src, n);
    return;
  }
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const size_t body = n & ~size_t{63};
  for (size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + body, src + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

void ShmBackend::all_reduce(const at::Tensor& t, const ReduceCallOptions& o) {
  begin(OpCode::kAllReduce, t, -1, o.op, o.timeout);
  const size_t es = t.element_size();
  const size_t n = t.numel();
  char* data = static_cast<char*>(t.data_ptr());
  if (size() == 1) return;  // the sum (and the product, min, max) of one tensor is itself
  if (n * es <= std::min(kSmallBytes, slot_)) {
    small_reduce(data, n, t.scalar_type(), o.op, /*to_all=*/true, -1);
  } else {
    chunked_reduce(data, n, t.scalar_type(), o.op, /*to_all=*/true, -1);
  }
}

void ShmBackend::reduce(const at::Tensor& t, int dst, const ReduceCallOptions& o) {
  begin(OpCode::kReduce, t, dst, o.op, o.timeout);
  const size_t es = t.element_size();
  const size_t n = t.numel();
  char* data = static_cast<char*>(t.data_ptr());
  if (size() == 1) return;
  if (n * es <= std::min(kSmallBytes, slot_)) {
    small_reduce(data, n, t.scalar_type(), o.op, false, dst);
  } else {
    chunked_reduce(data, n, t.scalar_type(), o.op, false, dst);
  }
}

void ShmBackend::broadcast(const at::Tensor& t, int src, const CallOptions& o) {
  char* data = static_cast<char*>(t.data_ptr());
  const size_t bytes = t.nbytes();
  // The root publishes and goes on (as MPI's root returns once its data is sent). Tiny
  // tensors go through the root's ring: it runs up to kRingDepth calls ahead. Larger ones
  // through the slots: the root waits before reusing a set for every rank to have read it
  // (ensure_writable), so it runs one chunk ahead and copies in while the others copy out.
  if (bytes <= kInlineBytes) {
    begin(OpCode::kBroadcast, t, src, ReduceOp::kSum, o.timeout, /*ring_root=*/rank() == src);
    if (rank() == src) {
      ring_publish(data, bytes);
    } else {
      ring_read(src, data, bytes);
    }
    return;
  }
  begin(OpCode::kBroadcast, t, src, ReduceOp::kSum, o.timeout);
  if (single_copy(bytes)) return broadcast_single_copy(data, bytes, src);
  const bool stream = bytes >= kStreamBytes;
  for_chunks(bytes, slot_, [&](size_t off, size_t len) {
    if (rank() == src) {
      ensure_writable();
      std::memcpy(my_slot(), data + off, len);
      arrive_and_go();
    } else {
      arrive_and_wait_for(src);
      copy_out(data + off, slot(src), len, stream);
    }
  });
  if (stream && rank() != src) stream_fence();
}

void ShmBackend::all_gather(const std::vector<at::Tensor>& out, const at::Tensor& in,
                            const CallOptions& o) {
  begin(OpCode::kAllGather, in, -1, ReduceOp::kSum, o.timeout);
  if (single_copy(in.nbytes())) return all_gather_single_copy(in, out);
  gather_impl(in, out, /*to_all=*/true, -1);
}

void ShmBackend::gather(const at::Tensor& in, const std::vector<at::Tensor>& out, int dst,
                        const CallOptions& o) {
  begin(OpCode::kGather, in, dst, ReduceOp::kSum, o.timeout);
  gather_impl(in, out, false, dst);
}

void ShmBackend::scatter(const at::Tensor& out, const std::vector<at::Tensor>& in, int src,
                         const CallOptions& o) {
  begin(OpCode::kScatter, out, src, ReduceOp::kSum, o.timeout);
  const size_t bytes = out.nbytes();
  const size_t piece = piece_bytes(out.element_size());
  char* dst = static_cast<char*>(out.data_ptr());
  for_chunks(bytes, piece, [&](size_t off, size_t len) {
    if (rank() == src) {
      for (int q = 0; q < size(); ++q) {
        std::memcpy(my_slot() + q * piece, static_cast<const char*>(in[q].data_ptr()) + off, len);
      }
    }
    arrive_and_wait();
    std::memcpy(dst + off, slot(src) + rank() * piece, len);
  });
}

void ShmBackend::reduce_scatter(const at::Tensor& out, const std::vector<at::Tensor>& in,
                                const ReduceCallOptions& o) {
  begin(OpCode::kReduceScatter, out, -1, o.op, o.timeout);
  if (single_copy(out.nbytes() * size())) return reduce_scatter_single_copy(out, in, o.op);
  const size_t bytes = out.nbytes();
  if (bytes * size() <= kInlineBytes) {
    // Every piece in the counter's cache line (a 4-byte reduce_scatter of 2 ranks: 8 bytes).
    for (int q = 0; q < size(); ++q) copy_inline(my_inline() + q * bytes, in[q].data_ptr(), bytes);
    arrive_and_wait();
    const size_t off = static_cast<size_t>(rank()) * bytes;
    char* dst = static_cast<char*>(out.data_ptr());
    if (size() == 1) return copy_inline(dst, inline_of(0) + off, bytes);
    reduce_combine(dst, inline_of(0) + off, inline_of(1) + off, out.numel(), out.scalar_type(),
                   o.op);
    for (int q = 2; q < size(); ++q) {
      reduce_combine(dst, dst, inline_of(q) + off, out.numel(), out.scalar_type(), o.op);
    }
    return;
  }
  const size_t es = out.element_size();
  const size_t piece = piece_bytes(es);
  char* dst = static_cast<char*>(out.data_ptr());
  for_chunks(out.nbytes(), piece, [&](size_t off, size_t len) {
    for (int q = 0; q < size(); ++q) {
      std::memcpy(my_slot() + q * piece, static_cast<const char*>(in[q].data_ptr()) + off, len);
    }
    arrive_and_wait();
    combine_all(dst + off, rank() * piece, len / es, out.scalar_type(), o.op);
  });
}

void ShmBackend::all_to_all(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& in,
                            const CallOptions& o) {
  begin(OpCode::kAllToAll, in[0], -1, ReduceOp::kSum, o.timeout);
  if (single_copy(in[0].nbytes() * size())) return all_to_all_single_copy(out, in);
  const size_t bytes = in[0].nbytes();
  if (bytes * size() <= kInlineBytes) {
    for (int q = 0; q < size(); ++q) copy_inline(my_inline() + q * bytes, in[q].data_ptr(), bytes);
    arrive_and_wait();
    for (int q = 0; q < size(); ++q) {
      copy_inline(out[q].data_ptr(), inline_of(q) + static_cast<size_t>(rank()) * bytes, bytes);
    }
    return;
  }
  const size_t piece = piece_bytes(in[0].element_size());
  for_chunks(in[0].nbytes(), piece, [&](size_t off, size_t len) {
    for (int q = 0; q < size(); ++q) {
      std::memcpy(my_slot() + q * piece, static_cast<const char*>(in[q].data_ptr()) + off, len);
    }
    arrive_and_wait();
    for (int q = 0; q < size(); ++q) {
      std::memcpy(static_cast<char*>(out[q].data_ptr()) + off, slot(q) + rank() * piece, len);
    }
  });
}

void ShmBackend::barrier(const CallOptions& o) {
  begin_meta(OpCode::kBarrier, -1, 0, -1, ReduceOp::kSum, o.timeout);
  arrive_and_wait();
  check_meta();
}

// ---- helpers ---------------------------------------------------------------------------

/// dst[i] = op over ranks (in rank order) of slot(q)[byte_off + i*es].
void ShmBackend::combine_all(char* dst, size_t byte_off, size_t n, at::ScalarType dtype,
                             ReduceOp op) {
  if (size() == 1) {
    std::memcpy(dst, slot(0) + byte_off, n * c10::elementSize(dtype));
    return;
  }
  reduce_combine(dst, slot(0) + byte_off, slot(1) + byte_off, n, dtype, op);
  for (int q = 2; q < size(); ++q) reduce_combine(dst, dst, slot(q) + byte_off, n, dtype, op);
}

void ShmBackend::combine_inline(char* dst, size_t n, at::ScalarType dtype, ReduceOp op) {
  if (size() == 1) {
    copy_inline(dst, inline_of(0), n * c10::elementSize(dtype));
    return;
  }
  reduce_combine(dst, inline_of(0), inline_of(1), n, dtype, op);
  for (int q = 2; q < size(); ++q) reduce_combine(dst, dst, inline_of(q), n, dtype, op);
}

void ShmBackend::small_reduce(char* data, size_t n, at::ScalarType dtype, ReduceOp op, bool to_all,
                              int dst) {
  const size_t bytes = n * c10::elementSize(dtype);
  if (bytes <= kInlineBytes) {
    copy_inline(my_inline(), data, bytes);
    arrive_and_wait();
    if (to_all || rank() == dst) combine_inline(data, n, dtype, op);
    return;
  }
  std::memcpy(my_slot(), data, bytes);
  arrive_and_wait();
  if (to_all || rank() == dst) combine_all(data, 0, n, dtype, op);
}

/// Reduce-scatter + all-gather, pipelined over slot-sized chunks with one step per chunk.
/// Every chunk has the same piece boundaries (rank r's piece: elements [C*r/P, C*(r+1)/P)
/// of a full chunk of C elements, clipped to the chunk's length), so in one step a rank's
/// slot holds both the pieces of chunk j the others reduce (never its own piece) and, in
/// its own piece's place, its reduced piece of chunk j-1. After the step's barrier each rank
/// copies the others' reduced pieces of chunk j-1 into its tensor, reduces its piece of
/// chunk j from its tensor and the others' slots, a block of kReduceBlockBytes at a time
/// (each block memcpy'd into its slot of the next set and into its tensor), publishes the
/// pieces of chunk j+1, and arrives at the next step. Per chunk of C bytes on 2 ranks a rank
/// reads 1.5C and writes 1.5C, besides the C reads from the other rank's slot; one barrier
/// per chunk instead of two (the ranks' imbalance was paid at each).
void ShmBackend::chunked_reduce(char* data, size_t n, at::ScalarType dtype, ReduceOp op,
                                bool to_all, int dst) {
  const size_t es = c10::elementSize(dtype);
  const size_t P = static_cast<size_t>(size());
  const size_t me = static_cast<size_t>(rank());
  const bool receives = to_all || rank() == dst;
  const size_t chunk_elems = slot_ / es;
  const size_t chunks = (n + chunk_elems - 1) / chunk_elems;
  const size_t block_elems = kReduceBlockBytes / es;
  if (!reduce_block_) reduce_block_ = std::make_unique<char[]>(kReduceBlockBytes);
  char* block = reduce_block_.get();
  auto length = [&](size_t j) { return std::min(chunk_elems, n - j * chunk_elems); };
  // Rank r's piece of chunk j: elements [lo(j, r), lo(j, r + 1)) of the chunk. A tensor of
  // one chunk is split evenly; in longer ones a shorter last chunk is clipped to the full
  // chunk's boundaries (its later pieces are short or empty) so that no piece of it lands
  // on the reduced piece of the chunk before, which shares its step.
  const size_t span = chunks == 1 ? n : chunk_elems;
  auto lo = [&](size_t j, size_t r) { return std::min(span * r / P, length(j)); };
  auto chunk_data = [&](size_t j) { return data + j * chunk_elems * es; };
  auto publish = [&](size_t j) {
    char* src = chunk_data(j);
    char* pub = my_slot();
    for (size_t r = 0; r < P; ++r) {
      if (r != me) {
        std::memcpy(pub + lo(j, r) * es, src + lo(j, r) * es, (lo(j, r + 1) - lo(j, r)) * es);
      }
    }
  };
  // The others' reduced pieces of chunk j, in the set of the step every rank arrived at.
  auto copy_out = [&](size_t j) {
    char* src = chunk_data(j);
    for (size_t r = 0; r < P; ++r) {
      if (r == me) continue;  // reduced into the tensor already
      std::memcpy(src + lo(j, r) * es, slot(static_cast<int>(r)) + lo(j, r) * es,
                  (lo(j, r + 1) - lo(j, r)) * es);
    }
  };
  publish(0);
  arrive_and_wait();
  for (size_t j = 0; j < chunks; ++j) {
    if (j > 0 && receives) copy_out(j - 1);
    char* src = chunk_data(j);
    const size_t a = lo(j, me), len = lo(j, me + 1) - a;
    char* out = my_slot() + a * es;  // the next step's set: every rank is done reading it
    for (size_t i = 0; i < len; i += block_elems) {
      const size_t k = std::min(block_elems, len - i);
      const size_t off = (a + i) * es;
      auto operand = [&](size_t q) -> const char* {
        return (q == me ? src : slot(static_cast<int>(q))) + off;
      };
      reduce_combine(block, operand(0), operand(1), k, dtype, op);
      for (size_t q = 2; q < P; ++q) reduce_combine(block, block, operand(q), k, dtype, op);
      std::memcpy(out + i * es, block, k * es);
      if (receives) std::memcpy(src + off, block, k * es);  // after its last read of src
    }
    if (j + 1 < chunks) publish(j + 1);
    arrive_and_wait();
  }
  if (receives) copy_out(chunks - 1);
}

void ShmBackend::gather_impl(const at::Tensor& in, const std::vector<at::Tensor>& out, bool to_all,
                             int dst) {
  const char* src = static_cast<const char*>(in.data_ptr());
  if (in.nbytes() <= kInlineBytes) {
    std::memcpy(my_inline(), src, in.nbytes());
    arrive_and_wait();
    if (to_all || rank() == dst) {
      for (int q = 0; q < size(); ++q) std::memcpy(out[q].data_ptr(), inline_of(q), in.nbytes());
    }
    return;
  }
  const bool stream = in.nbytes() * size() >= kStreamBytes;
  for_chunks(in.nbytes(), slot_, [&](size_t off, size_t len) {
    std::memcpy(my_slot(), src + off, len);
    arrive_and_wait();
    if (to_all || rank() == dst) {
      for (int q = 0; q < size(); ++q) {
        copy_out(static_cast<char*>(out[q].data_ptr()) + off, slot(q), len, stream);
      }
    }
  });
  if (stream) stream_fence();
}

}  // namespace torchpar::detail::shm_backend
