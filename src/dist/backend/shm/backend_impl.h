#pragma once
// The shared-memory collective backend's class: internal to the backend (backend.cpp,
// algorithms.cpp), to the backend composed of it (hierarchical/, which aborts its host's
// segment) and to tests. Group creation uses backend.h's factory only.
//
// Every rank of the group maps one segment. Files: backend.h (the options and the factory),
// segment_layout.h (the segment: header, control blocks, slots, and the step protocol),
// step_barrier.{h,cpp} (arrive/wait with deadline and liveness, the one abort),
// algorithms.cpp (the nine collectives over the slots), single_copy.cpp (large broadcast,
// all_gather, reduce_scatter and all_to_all copied straight between the ranks' tensors),
// backend.cpp (the segment's creation through shm/'s ShmRegion, the rendezvous through the
// group's store, per-operation bookkeeping, the factory).
//
// all_reduce: small messages in one step (each rank reduces all slots, in rank order so every
// rank gets the same bits); large ones per chunk in two steps: reduce-scatter (rank r
// reduces its 1/P of the chunk into its slot of the other set) then all-gather.
//
// Single copies: where every rank may read every other rank's memory (probed at attach), a
// large broadcast, all_gather, reduce_scatter or all_to_all publishes the addresses of its
// tensors in its slot and the ranks copy straight between them with process_vm_readv /
// process_vm_writev (the cross-memory attach Open MPI's vader uses): one copy per byte where
// the slots take two, and on 2 ranks a broadcast's root writes half of the tensor while the
// other rank reads the other half. A second step ends the operation, so no rank returns (and
// frees or changes its tensor) while another still copies from or into it.
//
// Failure: waits spin, then yield, then futex-sleep in slices of 100 ms, checking the
// deadline and that the awaited rank's pid lives. The first rank to see a failure marks
// the segment aborted with a message and its kind; every rank then throws the same error
// for it: RankLostError (a process is gone), TimeoutError (a rank is alive but did not
// arrive: stopped or slow) or torchpar::Error (the ranks disagree on the operation).
// Point-to-point operations go through a Gloo group made beside the segment.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dist/backend/backend.h"
#include "dist/backend/shm/backend.h"
#include "dist/backend/shm/segment_layout.h"
#include "dist/backend/shm/step_barrier.h"
#include "shm/region.h"

namespace torchpar::detail {

/// Bytes of one data slot (per rank and set); TORCHPAR_SHM_SLOT_BYTES overrides.
/// Errors: ValueError when TORCHPAR_SHM_SLOT_BYTES is not a whole decimal number.
size_t shm_slot_bytes();

namespace shm_backend {

/// memcpy with non-temporal stores (SSE2; plain memcpy elsewhere): the destination (a large
/// user tensor) is not read before it is written, which saves the read-for-ownership traffic
/// of normal stores. Call stream_fence() before telling another thread or process the bytes
/// are there. (algorithms.cpp)
void stream_copy(char* dst, const char* src, size_t n);
void stream_fence();

/// The shm backend of one rank (see the file comment). Lifetime: the constructor maps the
/// segment (rank 0 creates it) and returns once every rank attached, the name unlinked;
/// destroy() (or the destructor) unmaps it and destroys the p2p group. Safety: one
/// operation at a time (CollectiveGroup's executor guarantees it).
class ShmBackend final : public GroupBackend {
 public:
  explicit ShmBackend(const ShmBackendOptions& o);
  ~ShmBackend() override;

  Backend kind() const override { return Backend::kShm; }
  void destroy() override;

  // algorithms.cpp
  void all_reduce(const at::Tensor& t, const ReduceCallOptions& o) override;
  void all_gather(const std::vector<at::Tensor>& out, const at::Tensor& in,
                  const CallOptions& o) override;
  void broadcast(const at::Tensor& t, int src, const CallOptions& o) override;
  void reduce(const at::Tensor& t, int dst, const ReduceCallOptions& o) override;
  void gather(const at::Tensor& in, const std::vector<at::Tensor>& out, int dst,
              const CallOptions& o) override;
  void scatter(const at::Tensor& out, const std::vector<at::Tensor>& in, int src,
               const CallOptions& o) override;
  void reduce_scatter(const at::Tensor& out, const std::vector<at::Tensor>& in,
                      const ReduceCallOptions& o) override;
  void all_to_all(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& in,
                  const CallOptions& o) override;
  void barrier(const CallOptions& o) override;

  Work isend(const at::Tensor& t, int dst, int tag) override;
  Work irecv(const at::Tensor& t, std::optional<int> src, int tag) override;

  /// Breaks the group for every member, as a failed wait does (StepBarrier::abort): their
  /// current and later operations throw "<name>: the group is broken: <message>" as
  /// `kind` says (RankLostError(failed_rank), TimeoutError or torchpar::Error); failed_rank
  /// is a rank of this group or -1. For a backend composed of this one (the hierarchical
  /// backend) that saw a failure elsewhere. No-op once destroyed; never throws; any thread.
  void abort(int failed_rank, const std::string& message,
             AbortKind kind = AbortKind::kLost) noexcept {
    if (data_) barrier_.abort(failed_rank, message, kind);
  }

 private:
  // ---- backend.cpp: segment and steps
  void attach(const c10::intrusive_ptr<c10d::Store>& store);
  /// Maps and touches every page of the segment (attach, before this rank publishes).
  void touch_pages();
  GroupBackend& p2p() const;
  /// Starts an operation: its metadata, limit, and (unless `ring_root`: the root of a tiny
  /// broadcast, which needs less, see ring_publish) ensure_writable.
  void begin(OpCode op, const at::Tensor& t, int root, ReduceOp rop,
             std::chrono::duration<double> timeout, bool ring_root = false);
  void begin_meta(OpCode op, int32_t dtype, int64_t numel, int root, ReduceOp rop,
                  std::chrono::duration<double> timeout, bool ring_root = false);
  /// A tiny broadcast's root: writes `bytes` (<= kInlineBytes) and its metadata into its ring
  /// entry for the next step and arrives; waits only when the ring is about to wrap (for
  /// every rank to have read the entry it reuses). segment_layout.h has the protocol.
  void ring_publish(const void* data, size_t bytes);
  /// The other ranks of a tiny broadcast: arrive, wait for root `src`'s entry for this step,
  /// check its metadata against ours and copy its `bytes` to `data`.
  void ring_read(int src, void* data, size_t bytes);
  /// Arrive at the next step and wait for every rank to arrive there too; the first step
  /// of an operation also checks that every rank runs the same one.
  void arrive_and_wait() {
    arrive_only();
    barrier_.arrive_and_wait(step_, wait_);
    synced_ = step_;
    if (meta_pending_) {
      meta_pending_ = false;
      check_meta();
    }
  }
  /// Publishes this rank's metadata (first step of an operation) and arrives at the next
  /// step without waiting for anyone. Callers first make sure the step's set is free
  /// (ensure_writable) before writing their data for it.
  void arrive_only() {
    const uint32_t next = step_ + 1;
    if (meta_pending_) {
      ctl_[rank()].meta[next & 1] = cur_;
      ctl_[rank()].inline_step[next & 1].sig = step_signature(cur_sig_, next);
    }
    step_ = next;
    barrier_.arrive(next);
  }
  /// A step that only rank `q` writes (a broadcast's root): arrives, waits for q alone and
  /// checks q's metadata. q checks ours later (arrive_and_go's deferred check).
  void arrive_and_wait_for(int q) {
    arrive_only();
    barrier_.wait_for(q, step_, wait_);
    if (size() == 2) synced_ = step_;
    if (meta_pending_) {
      meta_pending_ = false;
      check_meta_of(q, step_, cur_, cur_sig_);
    }
  }
  /// A step this rank writes and leaves at once (a broadcast's root): arrives without waiting;
  /// the others' arrival, liveness and metadata are checked by ensure_writable, at the start of
  /// this rank's next write to the segment (its next operation or chunk).
  void arrive_and_go() {
    const bool first = meta_pending_;
    arrive_only();
    if (first) {
      meta_pending_ = false;
      deferred_ = Deferred{step_, cur_, cur_sig_};
    }
  }
  /// Before writing anything for step step_+1 (slots, inline data, metadata), every rank must
  /// have finished reading the same set at step step_-1, that is arrived at step_. After a
  /// full step (arrive_and_wait) that is known; after arrive_and_go it is waited for here.
  /// A check left by arrive_and_go runs here too, before this rank arrives again (after that,
  /// the others may overwrite the metadata it reads).
  void ensure_writable() {
    if (deferred_.step != 0 || static_cast<int32_t>(synced_ - step_) < 0) catch_up(step_);
  }
  /// Waits for every other rank to arrive at `need`, records the lowest counter seen in
  /// synced_, and runs the metadata checks left for steps every rank has now reached
  /// (deferred_, ring_steps_).
  void catch_up(uint32_t need, int pauses = 1);
  /// Throws torchpar::Error on every rank (and aborts the segment) when the ranks' metadata
  /// of the current step differ (signatures first: they share the counters' cache lines).
  /// A signature that is not the step's (tagged with another step) differs too.
  void check_meta() {
    for (int q = 0; q < size(); ++q) check_meta_of(q, step_, cur_, cur_sig_);
  }
  /// The same for rank q's metadata at `step` against `mine` (whose signature is `sig`).
  void check_meta_of(int q, uint32_t step, const OpMeta& mine, uint64_t sig) {
    if (ctl_[q].inline_step[step & 1].sig != step_signature(sig, step)) {
      meta_mismatch(q, step, mine);
    }
  }
  /// Throws (and aborts) naming both calls unless q's metadata at `step` equals `mine`.
  void meta_mismatch(int q, uint32_t step, const OpMeta& mine);

  char* slot_of(uint32_t set, int q) const {
    return data_ + (static_cast<size_t>(set) * size() + q) * slot_;
  }
  /// This rank's slot for the step it is about to arrive at.
  char* my_slot() const { return slot_of((step_ + 1) & 1, rank()); }
  /// Rank q's slot of the step every rank arrived at.
  char* slot(int q) const { return slot_of(step_ & 1, q); }
  /// This rank's inline data (kInlineBytes) for the step it is about to arrive at.
  char* my_inline() const { return ctl_[rank()].inline_step[(step_ + 1) & 1].data; }
  /// Rank q's inline data of the step every rank arrived at.
  const char* inline_of(int q) const { return ctl_[q].inline_step[step_ & 1].data; }
  size_t piece_bytes(size_t es) const { return slot_ / size() / es * es; }

  // ---- single_copy.cpp
  /// At attach, after every rank published its pid and probe word (before the "attached"
  /// barrier): reads every other rank's probe word with process_vm_readv, publishes whether
  /// that worked, and once every rank did (a store barrier) sets single_copy_ when it worked
  /// for all. Errors: TimeoutError when a rank does not publish within the group's timeout.
  void probe_single_copy(c10d::Store& store, SteadyClock::time_point deadline);
  /// Whether an operation moving `bytes` per rank goes the single-copy way.
  bool single_copy(size_t bytes) const { return single_copy_ && bytes >= kSingleCopyBytes; }
  /// Copies `len` bytes between this process's `local` and rank q's `remote` (write: to q).
  /// A failure breaks the group: RankLostError when q's process is gone, the abort's own
  /// error when q gave up first, torchpar::Error naming the system call otherwise.
  void cma_copy(bool write, int q, char* local, uint64_t remote, size_t len);
  /// Publishes `addrs` (this rank's tensors' addresses) in its slot and runs the step;
  /// peer_addr(q, i) is then rank q's i-th address.
  void exchange_addresses(std::initializer_list<const void*> addrs);
  void exchange_addresses(const std::vector<at::Tensor>& tensors);
  uint64_t peer_addr(int q, size_t i) const {
    uint64_t a;
    std::memcpy(&a, slot(q) + i * sizeof(uint64_t), sizeof a);
    return a;
  }
  void broadcast_single_copy(char* data, size_t bytes, int src);
  void all_gather_single_copy(const at::Tensor& in, const std::vector<at::Tensor>& out);
  void reduce_scatter_single_copy(const at::Tensor& out, const std::vector<at::Tensor>& in,
                                  ReduceOp op);
  void all_to_all_single_copy(const std::vector<at::Tensor>& out,
                              const std::vector<at::Tensor>& in);
  /// Operations of at least this many bytes per rank copy straight between the tensors.
  static constexpr size_t kSingleCopyBytes = 128 << 10;

  // ---- algorithms.cpp
  void combine_all(char* dst, size_t byte_off, size_t n, at::ScalarType dtype, ReduceOp op);
  /// dst = op over ranks (in rank order) of their inline data (n elements).
  void combine_inline(char* dst, size_t n, at::ScalarType dtype, ReduceOp op);
  void small_reduce(char* data, size_t n, at::ScalarType dtype, ReduceOp op, bool to_all, int dst);
  void chunked_reduce(char* data, size_t n, at::ScalarType dtype, ReduceOp op, bool to_all,
                      int dst);
  void gather_impl(const at::Tensor& in, const std::vector<at::Tensor>& out, bool to_all, int dst);

  std::shared_ptr<GroupBackend> p2p_;
  ShmRegion region_;  // the mapping; empty once destroyed
  SegmentLayout layout_;
  char* data_ = nullptr;
  RankCtl* ctl_ = nullptr;
  StepBarrier barrier_;
  bool spin_ = true;          // busy-wait first (ranks <= cores)
  bool single_copy_ = false;  // every rank may read and write every other rank's memory
  uint64_t probe_word_ = 0;   // kMagic ^ pid: what the others read at attach
  size_t slot_ = 0;
  uint32_t step_ = 0;
  uint32_t synced_ = 0;            // every other rank is known to have arrived at this step
  std::vector<RingEntry*> rings_;  // by rank
  std::vector<std::atomic<uint32_t>*> root_steps_;  // by rank (SegmentLayout::root_steps)
  std::vector<uint32_t> ring_steps_;  // tiny broadcasts published as root, not yet checked
  /// A chunked reduction's result block (kReduceBlockBytes) before it is copied out.
  std::unique_ptr<char[]> reduce_block_;
  /// A single-copy reduce_scatter's two blocks of the others' data (single_copy.cpp).
  std::unique_ptr<char[]> single_copy_blocks_;
  /// The first step of an operation this rank left without waiting (arrive_and_go): the
  /// others' metadata at that step is checked against `meta` once they arrive there.
  struct Deferred {
    uint32_t step = 0;  // 0: none
    OpMeta meta{};
    uint64_t sig = 0;
  } deferred_;
  uint64_t calls_ = 0;
  OpMeta cur_{};
  uint64_t cur_sig_ = op_signature(OpMeta{});  // op_signature(cur_), always
  // cur_'s (op, dtype) and (root, reduce_op), each as one word (begin_meta): zero like OpMeta{}.
  uint64_t sig_key_a_ = 0;
  uint64_t sig_key_b_ = 0;
  bool meta_pending_ = false;
  StepWait wait_;  // the current operation's limit
};

}  // namespace shm_backend
}  // namespace torchpar::detail
