#include "dist/backend/shm/backend.h"

#include <fmt/format.h>
#include <sys/mman.h>  // shm_unlink
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "dist/store.h"
#include "shm/cleaner.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {

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
  return std::make_shared<shm_backend::ShmBackend>(options);
}

namespace shm_backend {

ShmBackend::ShmBackend(const ShmBackendOptions& o)
    : GroupBackend(o.rank, o.world_ranks, o.timeout, o.name), p2p_(o.p2p) {
  attach(o.store);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  barrier_ = StepBarrier(SegmentLayout::header(region_.data()), ctl_, rank(), size(), name(),
                         /*spin=*/static_cast<unsigned>(size()) <= cores);
}

ShmBackend::~ShmBackend() { destroy(); }

void ShmBackend::destroy() {
  region_ = ShmRegion();  // unmaps
  data_ = nullptr;
  ctl_ = nullptr;
  if (p2p_) {
    p2p_->destroy();
    p2p_.reset();
  }
}

Work ShmBackend::isend(const at::Tensor& t, int dst, int tag) { return p2p().isend(t, dst, tag); }

Work ShmBackend::irecv(const at::Tensor& t, std::optional<int> src, int tag) {
  return p2p().irecv(t, src, tag);
}

GroupBackend& ShmBackend::p2p() const {
  if (!p2p_) throw ClosedError(fmt::format("{}: the group was destroyed", name()));
  return *p2p_;
}

// ---- segment ------------------------------------------------------------------------

void ShmBackend::attach(const c10::intrusive_ptr<c10d::Store>& store) {
  const int P = size();
  slot_ = shm_slot_bytes();
  layout_ = SegmentLayout::of(P, slot_);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout());
  std::string shm_name;
  if (rank() == 0) {
    ensure_cleaner();  // the name goes with this process, even on SIGKILL
    shm_name = make_segment_name();
    try {
      region_ = ShmRegion::create_named(shm_name, layout_.total_bytes);
    } catch (const ShmError& e) {
      if (e.syscall() != "posix_fallocate") throw;
      throw ShmError(e.syscall(), e.error_code(), shm_name,
                     fmt::format("{}: cannot reserve {} in /dev/shm for the shm backend (use "
                                 "backend gloo, or TORCHPAR_SHM_SLOT_BYTES to shrink it)",
                                 name(), format_bytes(layout_.total_bytes)));
    }
    layout_.init_header(region_.data());
    store->set("shm_name", std::vector<uint8_t>(shm_name.begin(), shm_name.end()));
  } else {
    if (store_wait_keys(*store, {"shm_name"}, SteadyClock::now() + ms) >= 0) {
      throw TimeoutError(
          fmt::format("{}: rank 0 did not publish the shared-memory segment within {:.1f} s",
                      name(), timeout().count()));
    }
    auto v = store->get("shm_name");
    shm_name.assign(v.begin(), v.end());
    try {
      region_ = ShmRegion::open_named(shm_name, /*writable=*/true, layout_.total_bytes);
    } catch (const ShmError& e) {
      throw Error(
          fmt::format("{}: cannot open the shm backend's segment {} ({}): are all ranks on one "
                      "host (same /dev/shm)? Use backend gloo otherwise",
                      name(), shm_name, e.what()));
    }
    if (!layout_.matches(region_.data())) {
      throw Error(fmt::format("{}: the shm backend's segment {} has a different geometry", name(),
                              shm_name));
    }
  }
  data_ = layout_.data(region_.data());
  ctl_ = SegmentLayout::ctl(region_.data());
  ctl_[rank()].cpu.store(-1, std::memory_order_relaxed);
  ctl_[rank()].pid = static_cast<int32_t>(::getpid());
  // Every rank attached -> unlink the name: the memory goes with the last mapping.
  bool all_attached = false;
  try {
    all_attached = store_barrier(*store, "attached", P, SteadyClock::now() + ms);
  } catch (...) {
    if (rank() == 0) ::shm_unlink(shm_name.c_str());
    throw;
  }
  if (rank() == 0) ::shm_unlink(shm_name.c_str());
  if (!all_attached) {
    std::string missing;
    for (int q = 0; q < P; ++q) {
      if (ctl_[q].pid != 0) continue;
      if (!missing.empty()) missing += ", ";
      missing += std::to_string(q);
    }
    throw TimeoutError(
        fmt::format("{}: rank(s) {} did not attach to the shared-memory segment within {:.1f} s",
                    name(), missing, timeout().count()));
  }
}

// ---- steps ---------------------------------------------------------------------------

void ShmBackend::begin(OpCode op, const at::Tensor& t, int root, ReduceOp rop,
                       std::chrono::duration<double> timeout) {
  begin_meta(op, static_cast<int32_t>(t.scalar_type()), t.numel(), root, rop, timeout);
}

void ShmBackend::begin_meta(OpCode op, int32_t dtype, int64_t numel, int root, ReduceOp rop,
                            std::chrono::duration<double> timeout) {
  if (!data_) throw ClosedError(fmt::format("{}: the group was destroyed", name()));
  barrier_.throw_if_aborted();
  cur_ = OpMeta{static_cast<int32_t>(op), dtype, numel, root, static_cast<int32_t>(rop), ++calls_};
  cur_sig_ = op_signature(cur_);
  wait_ = StepWait{
      .deadline = SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(timeout),
      .timeout = timeout,
      .op = op_name(op),
      .call = calls_};
  meta_pending_ = true;
}

void ShmBackend::check_meta() {
  const OpMeta& mine = cur_;
  for (int q = 0; q < size(); ++q) {
    if (ctl_[q].inline_step[step_ & 1].sig == cur_sig_) continue;
    const OpMeta& m = ctl_[q].meta[step_ & 1];
    if (m.op == mine.op && m.dtype == mine.dtype && m.numel == mine.numel && m.root == mine.root &&
        m.reduce_op == mine.reduce_op) {
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
        fmt::format("{}: ranks disagree on call #{}: rank {} called {}, rank {} called {}", name(),
                    mine.call, rank(), describe(mine), q, describe(m));
    barrier_.abort(q, msg);
    throw Error(msg);
  }
}

}  // namespace shm_backend
}  // namespace torchpar::detail
