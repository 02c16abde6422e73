#include "dist/backend/shm/backend_impl.h"

#include <fmt/format.h>
#include <sys/mman.h>  // shm_unlink
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/cpu_relax.h"
#include "core/prefault.h"
#include "dist/store.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {

size_t shm_slot_bytes() {
  // Below 4096 (0 too): the default. Not a whole decimal number: ValueError.
  const uint64_t v = env_unsigned("TORCHPAR_SHM_SLOT_BYTES", 0);
  if (v >= 4096) return static_cast<size_t>(v) / 64 * 64;
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
    : GroupBackend(o.group.rank, o.group.world_ranks, o.group.timeout, o.group.name), p2p_(o.p2p) {
  attach(o.group.store);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  spin_ = static_cast<unsigned>(size()) <= cores;
  barrier_ =
      StepBarrier(SegmentLayout::header(region_.data()), ctl_, rank(), size(), name(), spin_);
}

ShmBackend::~ShmBackend() { destroy(); }

void ShmBackend::destroy() {
  region_ = ShmRegion();  // unmaps
  data_ = nullptr;
  ctl_ = nullptr;
  rings_.clear();
  root_steps_.clear();
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
    try {
      region_ = ShmRegion::create_owned(layout_.total_bytes);  // goes with us, even on SIGKILL
    } catch (const ShmError& e) {
      if (e.syscall() != "posix_fallocate") throw;
      throw ShmError(e.syscall(), e.error_code(), e.object(),
                     fmt::format("{}: cannot reserve {} in /dev/shm for the shm backend (use "
                                 "backend gloo, or TORCHPAR_SHM_SLOT_BYTES to shrink it)",
                                 name(), format_bytes(layout_.total_bytes)));
    }
    shm_name = region_.name();
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
  for (int q = 0; q < P; ++q) {
    rings_.push_back(layout_.ring(region_.data(), q));
    root_steps_.push_back(layout_.root_steps(region_.data(), q));
  }
  // Room for every step a root can publish before a catch_up checks them (up to kRingDepth):
  // growing the vector in a broadcast took fresh heap pages, whose first touch costs 2-3 us
  // on these VMs (a 4-byte broadcast's root: 3 such calls among its first 250 at 0.05 us).
  ring_steps_.reserve(2 * kRingDepth);
  touch_pages();
  ctl_[rank()].cpu.store(-1, std::memory_order_relaxed);
  probe_word_ = kMagic ^ static_cast<uint64_t>(::getpid());
  ctl_[rank()].probe_addr = reinterpret_cast<uintptr_t>(&probe_word_);
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
  probe_single_copy(*store, SteadyClock::now() + ms);
}

void ShmBackend::touch_pages() {
  // Populating the page tables (one madvise) is not enough on the VMs we measure on: the
  // hypervisor's shadow page tables still fault at each page's first access (~12-17 us),
  // which then lands inside some collective (a 4-byte broadcast's root entering a new page
  // of its ring: a 17 us call among 0.07 us ones; a reader faulting on it stalls the root
  // once its ring is full). So every page is touched once here, before anyone publishes:
  // written (an atomic no-op) where only this rank writes, read elsewhere.
  char* base = region_.data();
  prefault_for_write(base, layout_.total_bytes);
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  auto touch = [&](char* from, size_t bytes, bool write) {
    for (size_t off = 0; off < bytes; off += page) {
      if (write) {
        __atomic_fetch_or(reinterpret_cast<unsigned char*>(from + off), 0, __ATOMIC_RELAXED);
      } else {
        (void)*static_cast<volatile const char*>(from + off);
      }
    }
  };
  touch(base, static_cast<size_t>(data_ - base), false);  // header, control blocks, rings
  touch(reinterpret_cast<char*>(rings_[rank()]), SegmentLayout::kRingBytes, true);
  touch(reinterpret_cast<char*>(root_steps_[rank()]), SegmentLayout::kRootStepBytes, true);
  for (uint32_t set = 0; set < 2; ++set) {
    for (int q = 0; q < size(); ++q) touch(slot_of(set, q), slot_, q == rank());
  }
}

// ---- steps ---------------------------------------------------------------------------

void ShmBackend::begin(OpCode op, const at::Tensor& t, int root, ReduceOp rop,
                       std::chrono::duration<double> timeout, bool ring_root) {
  begin_meta(op, static_cast<int32_t>(t.scalar_type()), t.numel(), root, rop, timeout, ring_root);
}

void ShmBackend::begin_meta(OpCode op, int32_t dtype, int64_t numel, int root, ReduceOp rop,
                            std::chrono::duration<double> timeout, bool ring_root) {
  if (!data_) throw ClosedError(fmt::format("{}: the group was destroyed", name()));
  barrier_.throw_if_aborted();
  const OpMeta m{static_cast<int32_t>(op), dtype, numel, root, static_cast<int32_t>(rop), ++calls_};
  // The signature is a chain of ten dependent multiplies on the way to this rank's arrival:
  // recomputed only when the operation differs from the last one. The comparison is of two
  // 64-bit keys built in registers: comparing the fields let GCC merge adjacent 32-bit ones
  // into 64-bit loads of two 32-bit stores it had just made on the stack, a store-forwarding
  // stall each (perf on a 1-rank group: two thirds of begin_meta's time).
  const uint64_t key_a = static_cast<uint32_t>(m.op) | uint64_t{static_cast<uint32_t>(dtype)} << 32;
  const uint64_t key_b = static_cast<uint32_t>(root) | uint64_t{static_cast<uint32_t>(m.reduce_op)}
                                                           << 32;
  if (key_a != sig_key_a_ || key_b != sig_key_b_ || numel != cur_.numel) {
    cur_sig_ = op_signature(m);
    sig_key_a_ = key_a;
    sig_key_b_ = key_b;
  }
  cur_ = m;
  wait_ = StepWait{.timeout = timeout, .op = op_name(op), .call = calls_};
  meta_pending_ = true;
  if (!ring_root) ensure_writable();
}

void ShmBackend::ring_publish(const void* data, size_t bytes) {
  const uint32_t next = step_ + 1;
  // Entry next % kRingDepth last held step next - kRingDepth: every rank read it once it
  // arrived at the step after.
  const uint32_t need = next - kRingDepth + 1;
  if (deferred_.step != 0) {
    // A broadcast through the slots left its metadata check for later: do it before going
    // further, while the others cannot yet have overwritten their metadata of that step.
    catch_up(step_);
  } else if (static_cast<int32_t>(synced_ - need) < 0) {
    // The ring is full: wait until the others freed half of it (every step up to there is
    // published, so they get there without this rank), looking at their counters every 16
    // pauses. Waiting for one entry at a time, the root took each reader's counter line away
    // at every call, and each arrival then waited for the line to come back: the root ran at
    // that pace from then on. 4-byte broadcast, 2 ranks, 6 interleaved runs: median
    // 0.101-0.110 -> 0.101 us, p99 0.41-0.45 -> 0.33-0.35 us.
    constexpr int kPollPauses = 16;
    catch_up(need + kRingDepth / 2, kPollPauses);
  }
  RingEntry& e = rings_[rank()][next % kRingDepth];
  copy_inline(e.data, data, bytes);
  e.meta = cur_;
  e.sig = cur_sig_;
  e.step.store(next, std::memory_order_release);
  // Read by the others' catch_up only after they saw this rank arrive at `next` (acquire).
  root_steps_[rank()][next % kRingDepth].store(next, std::memory_order_relaxed);
  meta_pending_ = false;
  step_ = next;
  ring_steps_.push_back(next);
  barrier_.arrive(next);
  // The entry after next was last read by the others kRingDepth calls ago: take its line
  // back now, so that call's stores, and the fences after them (the arrival's, the
  // executor's, the tensor's reference count), do not wait for the others to drop their
  // copies. Not the next entry: a reader's prefetcher fetches the line after the one it reads,
  // and taking that one back fights it (4-byte broadcast, 2 ranks, slow placement: no
  // prefetch 0.24-0.26 us, next entry 0.13-0.24, the one after 0.13-0.17).
  prefetch_for_write(&rings_[rank()][(next + 2) % kRingDepth]);
}

void ShmBackend::ring_read(int src, void* data, size_t bytes) {
  arrive_only();
  meta_pending_ = false;
  const RingEntry& e = rings_[src][step_ % kRingDepth];
  bool there = false;
  if (spin_) {
    // The root is usually ahead: its entry is there at the first look. Otherwise spin a
    // little on the entry itself, then wait on the root's counter (which it stores after the
    // entry), with the barrier's deadline, liveness checks and sleep.
    for (int i = 0; i < 64 && !there; ++i) {
      there = e.step.load(std::memory_order_acquire) == step_;
      if (!there) cpu_relax();
    }
  }
  if (!there) {
    barrier_.wait_for(src, step_, wait_);
    there = e.step.load(std::memory_order_acquire) == step_;
  }
  // The root reached this step without publishing a tiny broadcast there: it called
  // something else (its counter's signature says what).
  if (!there) {
    meta_mismatch(src, step_, cur_);  // the same operation can only have been published here
    const std::string msg =
        fmt::format("{}: rank {} reached {} call #{} without publishing its data", name(), src,
                    op_name(OpCode::kBroadcast), cur_.call);
    barrier_.abort(src, msg, AbortKind::kError);
    throw Error(msg);
  }
  if (e.sig != cur_sig_) meta_mismatch(src, step_, cur_);
  copy_inline(data, e.data, bytes);
  if (size() == 2) synced_ = step_;
}

void ShmBackend::catch_up(uint32_t need, int pauses) {
  uint32_t lowest = step_ + 1;
  for (int q = 0; q < size(); ++q) {
    if (q == rank()) continue;
    barrier_.wait_for(q, need, wait_, pauses);
    const uint32_t seen = ctl_[q].seq.load(std::memory_order_acquire);
    if (static_cast<int32_t>(seen - lowest) < 0) lowest = seen;
  }
  synced_ = lowest;
  auto everyone_at = [&](uint32_t step) { return static_cast<int32_t>(synced_ - step) >= 0; };
  if (deferred_.step != 0 && everyone_at(deferred_.step)) {
    // Nobody can have overwritten the metadata of that step: that takes arriving two steps
    // later, and every other rank's next write waits for this rank to arrive again.
    const Deferred d = deferred_;
    deferred_.step = 0;
    for (int q = 0; q < size(); ++q) check_meta_of(q, d.step, d.meta, d.sig);
  }
  // Steps at which this rank published a tiny broadcast as root: another rank that did the
  // same at that step (both think they are the root) left its own ring entry there. Its entry
  // stays until it runs kRingDepth steps further, which needs this rank one step further
  // than the step checked: a check as soon as the others reached the step finds it.
  size_t kept = 0;
  for (const uint32_t d : ring_steps_) {
    if (!everyone_at(d)) {
      ring_steps_[kept++] = d;
      continue;
    }
    for (int q = 0; q < size(); ++q) {
      if (q != rank() && root_steps_[q][d % kRingDepth].load(std::memory_order_acquire) == d) {
        meta_mismatch(q, d, rings_[rank()][d % kRingDepth].meta);
      }
    }
  }
  ring_steps_.resize(kept);
}

void ShmBackend::meta_mismatch(int q, uint32_t step, const OpMeta& mine) {
  // Rank q published its operation beside its counter, or in its ring when it was a tiny
  // broadcast's root.
  const RingEntry& e = rings_[q][step % kRingDepth];
  const OpMeta& m =
      e.step.load(std::memory_order_acquire) == step ? e.meta : ctl_[q].meta[step & 1];
  if (m.op == mine.op && m.dtype == mine.dtype && m.numel == mine.numel && m.root == mine.root &&
      m.reduce_op == mine.reduce_op) {
    return;
  }
  // Every rank that compares sees the same metadata, so it raises; no one goes on.
  auto describe = [](const OpMeta& x) {
    return fmt::format("{}(dtype {}, numel {}, root {}, op {})", op_name(static_cast<OpCode>(x.op)),
                       c10::toString(static_cast<at::ScalarType>(x.dtype)), x.numel, x.root,
                       to_string(static_cast<ReduceOp>(x.reduce_op)));
  };
  const std::string msg =
      fmt::format("{}: ranks disagree on call #{}: rank {} called {}, rank {} called {}", name(),
                  mine.call, rank(), describe(mine), q, describe(m));
  barrier_.abort(q, msg, AbortKind::kError);
  throw Error(msg);
}

}  // namespace shm_backend
}  // namespace torchpar::detail
