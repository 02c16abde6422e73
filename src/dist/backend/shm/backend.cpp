#include "dist/backend/shm/backend.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif
#include <climits>
#include <cstring>
#include <fstream>
#include <thread>

#include "core/cpu_relax.h"
#include "core/futex.h"
#include "core/liveness.h"
#include "dist/reduce_kernels.h"
#include "dist/store.h"
#include "dist/work.h"
#include "shm/cleaner.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {
namespace {

constexpr size_t kStreamBytes = 4 << 20;  // tensors at least this big: results bypass caches

/// memcpy with non-temporal stores: the destination (a large user tensor) is not read
/// before it is written, which saves the read-for-ownership traffic of normal stores.
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

void copy_out(char* dst, const char* src, size_t n, bool stream) {
  if (stream) {
    stream_copy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

constexpr uint64_t kMagic = 0x314c4c4f43524154ULL;  // "TPARCOLL" reversed-ish
constexpr size_t kSmallBytes = 32 << 10;            // one-step all_reduce below this

enum class OpCode : int32_t {
  kAllReduce = 1,
  kAllGather,
  kBroadcast,
  kReduce,
  kGather,
  kScatter,
  kReduceScatter,
  kAllToAll,
  kBarrier
};

const char* op_name(OpCode op) {
  switch (op) {
    case OpCode::kAllReduce:
      return "all_reduce";
    case OpCode::kAllGather:
      return "all_gather";
    case OpCode::kBroadcast:
      return "broadcast";
    case OpCode::kReduce:
      return "reduce";
    case OpCode::kGather:
      return "gather";
    case OpCode::kScatter:
      return "scatter";
    case OpCode::kReduceScatter:
      return "reduce_scatter";
    case OpCode::kAllToAll:
      return "all_to_all";
    case OpCode::kBarrier:
      return "barrier";
  }
  return "?";
}

/// What a rank is doing: every rank must agree on it for the operation to go on.
struct OpMeta {
  int32_t op;
  int32_t dtype;
  int64_t numel;  // per tensor (per list element for list operations)
  int32_t root;   // src/dst, -1 when none
  int32_t reduce_op;
  uint64_t call;  // operations issued so far on this group
};

struct alignas(64) RankCtl {
  std::atomic<uint32_t> seq;  // last step this rank arrived at
  int32_t pid;
  uint8_t pad0[56];
  OpMeta meta[2];  // by step parity
  uint8_t pad1[256 - 64 - 2 * sizeof(OpMeta)];
};
static_assert(sizeof(RankCtl) == 256);

struct Header {
  uint64_t magic;
  uint32_t nranks;
  uint32_t pad;
  uint64_t slot_bytes;
  uint64_t data_offset;
  uint64_t total_bytes;
  alignas(64) std::atomic<uint32_t> waiters;
  alignas(64) std::atomic<uint32_t> aborted;
  int32_t failed_rank;
  char abort_msg[512];
};
static_assert(sizeof(Header) <= 4096);

class ShmBackend final : public GroupBackend {
 public:
  explicit ShmBackend(const ShmBackendOptions& o)
      : GroupBackend(o.rank, o.world_ranks, o.timeout, o.name), p2p_(o.p2p) {
    attach(o.store);
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    spin_ = static_cast<unsigned>(size()) <= cores;
  }

  ~ShmBackend() override { destroy(); }

  Backend kind() const override { return Backend::Shm; }

  void destroy() override {
    if (base_) {
      ::munmap(base_, total_);
      base_ = nullptr;
    }
    if (p2p_) {
      p2p_->destroy();
      p2p_.reset();
    }
  }

  // ---- collectives ------------------------------------------------------------------

  void all_reduce(const at::Tensor& t, const ReduceCallOptions& o) override {
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

  void reduce(const at::Tensor& t, int dst, const ReduceCallOptions& o) override {
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

  void broadcast(const at::Tensor& t, int src, const CallOptions& o) override {
    begin(OpCode::kBroadcast, t, src, ReduceOp::SUM, o.timeout);
    char* data = static_cast<char*>(t.data_ptr());
    const size_t bytes = t.nbytes();
    const bool stream = bytes >= kStreamBytes;
    for_chunks(bytes, slot_, [&](size_t off, size_t len) {
      if (rank() == src) std::memcpy(my_slot(), data + off, len);
      arrive_and_wait();
      if (rank() != src) copy_out(data + off, slot(src), len, stream);
    });
    if (stream) stream_fence();
  }

  void all_gather(const std::vector<at::Tensor>& out, const at::Tensor& in,
                  const CallOptions& o) override {
    begin(OpCode::kAllGather, in, -1, ReduceOp::SUM, o.timeout);
    gather_impl(in, out, /*to_all=*/true, -1);
  }

  void gather(const at::Tensor& in, const std::vector<at::Tensor>& out, int dst,
              const CallOptions& o) override {
    begin(OpCode::kGather, in, dst, ReduceOp::SUM, o.timeout);
    gather_impl(in, out, false, dst);
  }

  void scatter(const at::Tensor& out, const std::vector<at::Tensor>& in, int src,
               const CallOptions& o) override {
    begin(OpCode::kScatter, out, src, ReduceOp::SUM, o.timeout);
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

  void reduce_scatter(const at::Tensor& out, const std::vector<at::Tensor>& in,
                      const ReduceCallOptions& o) override {
    begin(OpCode::kReduceScatter, out, -1, o.op, o.timeout);
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

  void all_to_all(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& in,
                  const CallOptions& o) override {
    begin(OpCode::kAllToAll, in[0], -1, ReduceOp::SUM, o.timeout);
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

  void barrier(const CallOptions& o) override {
    begin_meta(OpCode::kBarrier, -1, 0, -1, ReduceOp::SUM, o.timeout);
    arrive_and_wait();
    check_meta();
  }

  Work isend(const at::Tensor& t, int dst, int tag) override { return p2p().isend(t, dst, tag); }
  Work irecv(const at::Tensor& t, std::optional<int> src, int tag) override {
    return p2p().irecv(t, src, tag);
  }

 private:
  // ---- segment ------------------------------------------------------------------------

  void attach(const c10::intrusive_ptr<c10d::Store>& store) {
    const int P = size();
    slot_ = shm_slot_bytes();
    const size_t ctl_bytes = (static_cast<size_t>(P) * sizeof(RankCtl) + 4095) / 4096 * 4096;
    const size_t data_off = 4096 + ctl_bytes;
    total_ = data_off + 2 * static_cast<size_t>(P) * slot_;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout());
    std::string shm_name;
    UniqueFd fd;
    if (rank() == 0) {
      ensure_cleaner();  // the name goes with this process, even on SIGKILL
      shm_name = make_segment_name();
      fd = UniqueFd(::shm_open(shm_name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
      if (!fd) throw_system_error("shm_open", errno, shm_name);
      int rc = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(total_));
      if (rc != 0) {
        ::shm_unlink(shm_name.c_str());
        throw ShmError("posix_fallocate", rc, shm_name,
                       fmt::format("{}: cannot reserve {} in /dev/shm for the shm backend (use "
                                   "backend gloo, or TORCHPAR_SHM_SLOT_BYTES to shrink it)",
                                   name(), format_bytes(total_)));
      }
      map(fd.get());
      auto* h = header();
      h->nranks = static_cast<uint32_t>(P);
      h->slot_bytes = slot_;
      h->data_offset = data_off;
      h->total_bytes = total_;
      h->magic = kMagic;
      store->set("shm_name", std::vector<uint8_t>(shm_name.begin(), shm_name.end()));
    } else {
      try {
        store->wait({"shm_name"}, ms);
      } catch (const std::exception&) {
        throw TimeoutError(
            fmt::format("{}: rank 0 did not publish the shared-memory segment within {:.1f} s",
                        name(), timeout().count()));
      }
      auto v = store->get("shm_name");
      shm_name.assign(v.begin(), v.end());
      fd = UniqueFd(::shm_open(shm_name.c_str(), O_RDWR, 0600));
      if (!fd) {
        throw Error(fmt::format(
            "{}: cannot open the shm backend's segment {} ({}): are all ranks on one host "
            "(same /dev/shm)? Use backend gloo otherwise",
            name(), shm_name, std::strerror(errno)));
      }
      map(fd.get());
      if (header()->magic != kMagic || header()->nranks != static_cast<uint32_t>(P) ||
          header()->total_bytes != total_) {
        throw Error(fmt::format("{}: the shm backend's segment {} has a different geometry", name(),
                                shm_name));
      }
    }
    data_ = base_ + data_off;
    ctl_ = reinterpret_cast<RankCtl*>(base_ + 4096);
    ctl_[rank()].pid = ::getpid();
    // Every rank attached -> unlink the name: the memory goes with the last mapping.
    store->add("attached", 1);
    bool all_attached = false;
    try {
      all_attached = store_wait_count(*store, "attached", P, SteadyClock::now() + ms);
    } catch (...) {
      if (rank() == 0) ::shm_unlink(shm_name.c_str());
      throw;
    }
    if (!all_attached) {
      if (rank() == 0) ::shm_unlink(shm_name.c_str());
      std::string missing;
      for (int q = 0; q < P; ++q) {
        if (ctl_[q].pid == 0) missing += (missing.empty() ? "" : ", ") + std::to_string(q);
      }
      throw TimeoutError(
          fmt::format("{}: rank(s) {} did not attach to the shared-memory segment within {:.1f} s",
                      name(), missing, timeout().count()));
    }
    if (rank() == 0) ::shm_unlink(shm_name.c_str());
  }

  void map(int fd) {
    void* p = ::mmap(nullptr, total_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw_system_error("mmap", errno, "shm backend segment");
    base_ = static_cast<char*>(p);
  }

  Header* header() const { return reinterpret_cast<Header*>(base_); }
  char* slot_of(uint32_t set, int q) const {
    return data_ + (static_cast<size_t>(set) * size() + q) * slot_;
  }
  /// This rank's slot for the step it is about to arrive at.
  char* my_slot() const { return slot_of((step_ + 1) & 1, rank()); }
  /// Rank q's slot of the step every rank arrived at.
  char* slot(int q) const { return slot_of(step_ & 1, q); }
  size_t piece_bytes(size_t es) const { return slot_ / size() / es * es; }

  template <class F>
  static void for_chunks(size_t bytes, size_t chunk, F&& f) {
    if (bytes == 0) {
      f(0, 0);
      return;
    }
    for (size_t off = 0; off < bytes; off += chunk) f(off, std::min(chunk, bytes - off));
  }

  // ---- steps ---------------------------------------------------------------------------

  void begin(OpCode op, const at::Tensor& t, int root, ReduceOp rop,
             std::chrono::duration<double> timeout) {
    begin_meta(op, static_cast<int32_t>(t.scalar_type()), t.numel(), root, rop, timeout);
  }

  void begin_meta(OpCode op, int32_t dtype, int64_t numel, int root, ReduceOp rop,
                  std::chrono::duration<double> timeout) {
    if (!base_) throw ClosedError(fmt::format("{}: the group was destroyed", name()));
    throw_if_aborted();
    cur_ =
        OpMeta{static_cast<int32_t>(op), dtype, numel, root, static_cast<int32_t>(rop), ++calls_};
    call_timeout_ = timeout;
    deadline_ = SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(timeout);
    meta_pending_ = true;
  }

  /// Arrive at the next step and wait for every rank to arrive there too.
  void arrive_and_wait() {
    const uint32_t next = step_ + 1;
    if (meta_pending_) ctl_[rank()].meta[next & 1] = cur_;
    ctl_[rank()].seq.store(next, std::memory_order_seq_cst);
    if (header()->waiters.load(std::memory_order_seq_cst) != 0) {
      futex_wake_n(reinterpret_cast<uint32_t*>(&ctl_[rank()].seq), INT_MAX);
    }
    step_ = next;
    for (int q = 0; q < size(); ++q) {
      if (q != rank()) wait_for(q, next);
    }
    if (meta_pending_) {
      meta_pending_ = false;
      check_meta();
    }
  }

  static bool reached(uint32_t seq, uint32_t target) {
    return static_cast<int32_t>(seq - target) >= 0;
  }

  void wait_for(int q, uint32_t target) {
    auto& seq = ctl_[q].seq;
    if (reached(seq.load(std::memory_order_acquire), target)) return;
    if (spin_) {
      for (int i = 0; i < 20000; ++i) {
        cpu_relax();
        if (reached(seq.load(std::memory_order_acquire), target)) return;
      }
    }
    for (int i = 0; i < 50; ++i) {
      ::sched_yield();
      if (reached(seq.load(std::memory_order_acquire), target)) return;
    }
    auto* h = header();
    auto last_check = SteadyClock::now();
    for (;;) {
      h->waiters.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t seen = seq.load(std::memory_order_seq_cst);
      if (!reached(seen, target) && h->aborted.load() == 0) {
        futex_wait_until(reinterpret_cast<uint32_t*>(&seq), seen, deadline_);
      }
      h->waiters.fetch_sub(1, std::memory_order_seq_cst);
      if (reached(seq.load(std::memory_order_acquire), target)) return;
      throw_if_aborted();
      const auto now = SteadyClock::now();
      if (now >= deadline_) {
        fail(q,
             fmt::format("{}: rank {} (pid {}) did not reach {} call #{} within {:.1f} s", name(),
                         q, ctl_[q].pid, op_name(static_cast<OpCode>(cur_.op)), cur_.call,
                         call_timeout_.count()),
             /*timeout=*/true);
      }
      if (now - last_check > std::chrono::milliseconds(50)) {
        last_check = now;
        if (!pid_alive(ctl_[q].pid)) {
          fail(q,
               fmt::format("{}: rank {} (pid {}) died before finishing {} call #{}", name(), q,
                           ctl_[q].pid, op_name(static_cast<OpCode>(cur_.op)), cur_.call),
               false);
        }
      }
    }
  }

  [[noreturn]] void fail(int q, const std::string& msg, bool timeout) {
    auto* h = header();
    uint32_t expected = 0;
    if (h->aborted.compare_exchange_strong(expected, 1)) {
      h->failed_rank = q;
      std::snprintf(h->abort_msg, sizeof(h->abort_msg), "%s", msg.c_str());
      h->aborted.store(2);
      for (int r = 0; r < size(); ++r) {
        futex_wake_n(reinterpret_cast<uint32_t*>(&ctl_[r].seq), INT_MAX);
      }
    }
    if (timeout) throw TimeoutError(msg);
    throw RankLostError(q, msg);
  }

  void throw_if_aborted() {
    auto* h = header();
    if (h->aborted.load(std::memory_order_acquire) == 0) return;
    while (h->aborted.load(std::memory_order_acquire) == 1) ::sched_yield();
    throw RankLostError(h->failed_rank,
                        fmt::format("{}: the group is broken: {}", name(), h->abort_msg));
  }

  void check_meta() {
    const OpMeta& mine = cur_;
    for (int q = 0; q < size(); ++q) {
      const OpMeta& m = ctl_[q].meta[step_ & 1];
      if (m.op == mine.op && m.dtype == mine.dtype && m.numel == mine.numel &&
          m.root == mine.root && m.reduce_op == mine.reduce_op) {
        continue;
      }
      // Every rank sees the same metadata, so every rank raises; no one goes on.
      auto describe = [](const OpMeta& x) {
        return fmt::format("{}(dtype {}, numel {}, root {}, op {})",
                           op_name(static_cast<OpCode>(x.op)),
                           c10::toString(static_cast<at::ScalarType>(x.dtype)), x.numel, x.root,
                           to_string(static_cast<ReduceOp>(x.reduce_op)));
      };
      const std::string msg =
          fmt::format("{}: ranks disagree on call #{}: rank {} called {}, rank {} called {}",
                      name(), mine.call, rank(), describe(mine), q, describe(m));
      auto* h = header();
      uint32_t expected = 0;
      if (h->aborted.compare_exchange_strong(expected, 1)) {
        h->failed_rank = q;
        std::snprintf(h->abort_msg, sizeof(h->abort_msg), "%s", msg.c_str());
        h->aborted.store(2);
      }
      throw Error(msg);
    }
  }

  // ---- algorithms ----------------------------------------------------------------------

  /// dst[i] = op over ranks (in rank order) of slot(q)[byte_off + i*es].
  void combine_all(char* dst, size_t byte_off, size_t n, at::ScalarType dtype, ReduceOp op) {
    if (size() == 1) {
      std::memcpy(dst, slot(0) + byte_off, n * c10::elementSize(dtype));
      return;
    }
    reduce_combine(dst, slot(0) + byte_off, slot(1) + byte_off, n, dtype, op);
    for (int q = 2; q < size(); ++q) reduce_combine(dst, dst, slot(q) + byte_off, n, dtype, op);
  }

  void small_reduce(char* data, size_t n, at::ScalarType dtype, ReduceOp op, bool to_all, int dst) {
    const size_t bytes = n * c10::elementSize(dtype);
    std::memcpy(my_slot(), data, bytes);
    arrive_and_wait();
    if (to_all || rank() == dst) combine_all(data, 0, n, dtype, op);
  }

  /// Reduce-scatter + all-gather, one slot-sized chunk at a time. Step 1: every rank
  /// publishes the pieces of the chunk the others reduce (never its own piece). Step 2: each
  /// rank reduces its own piece from its tensor and the others' slots into its slot of the
  /// other set. Then every rank copies the reduced pieces out. Per chunk of C bytes a rank moves
  /// about 4C bytes instead of the 5.5C of publishing the whole chunk, and the reduction reads its
  /// own operand straight from the tensor.
  void chunked_reduce(char* data, size_t n, at::ScalarType dtype, ReduceOp op, bool to_all,
                      int dst) {
    const size_t es = c10::elementSize(dtype);
    const size_t P = static_cast<size_t>(size());
    const size_t me = static_cast<size_t>(rank());
    const size_t chunk_elems = slot_ / es;
    for (size_t first = 0; first < n; first += chunk_elems) {
      const size_t m = std::min(chunk_elems, n - first);
      char* src = data + first * es;
      auto lo = [&](size_t r) { return m * r / P; };
      char* pub = my_slot();
      for (size_t r = 0; r < P; ++r) {
        if (r != me) std::memcpy(pub + lo(r) * es, src + lo(r) * es, (lo(r + 1) - lo(r)) * es);
      }
      arrive_and_wait();
      const size_t a = lo(me), len = lo(me + 1) - a;
      char* out = my_slot() + a * es;
      auto operand = [&](size_t q) -> const char* {
        return (q == me ? src : slot(static_cast<int>(q))) + a * es;
      };
      reduce_combine(out, operand(0), operand(1), len, dtype, op);
      for (size_t q = 2; q < P; ++q) reduce_combine(out, out, operand(q), len, dtype, op);
      arrive_and_wait();
      if (to_all || rank() == dst) {
        for (size_t r = 0; r < P; ++r) {
          std::memcpy(src + lo(r) * es, slot(static_cast<int>(r)) + lo(r) * es,
                      (lo(r + 1) - lo(r)) * es);
        }
      }
    }
  }

  void gather_impl(const at::Tensor& in, const std::vector<at::Tensor>& out, bool to_all, int dst) {
    const char* src = static_cast<const char*>(in.data_ptr());
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

  GroupBackend& p2p() const {
    if (!p2p_) throw ClosedError(fmt::format("{}: the group was destroyed", name()));
    return *p2p_;
  }

  std::shared_ptr<GroupBackend> p2p_;
  char* base_ = nullptr;
  char* data_ = nullptr;
  RankCtl* ctl_ = nullptr;
  size_t total_ = 0;
  size_t slot_ = 0;
  uint32_t step_ = 0;
  uint64_t calls_ = 0;
  OpMeta cur_{};
  bool meta_pending_ = false;
  bool spin_ = true;
  std::chrono::duration<double> call_timeout_{0};  // of the current operation
  SteadyClock::time_point deadline_{};
};

}  // namespace

size_t shm_slot_bytes() {
  if (const char* env = std::getenv("TORCHPAR_SHM_SLOT_BYTES")) {
    const long long v = std::atoll(env);
    if (v >= 4096) return static_cast<size_t>(v) / 64 * 64;
  }
  // 256 KiB: a chunk, the peer's chunk and the output stay in a core's L2. With 1 MiB slots
  // broadcast and all_gather ran 2-5x slower on the 2-core EPYC VM (16 MiB broadcast 2.9 ms
  // against 0.63 ms), all_reduce no faster.
  return 256 << 10;
}

std::shared_ptr<GroupBackend> create_shm_backend(const ShmBackendOptions& options) {
  return std::make_shared<ShmBackend>(options);
}

}  // namespace torchpar::detail
