#pragma once
// The shm backend's segment, as every rank of a group maps it (the on-segment protocol).
//
// Layout: a header page (geometry, the waiter count, the abort state), one 256-byte control
// block per rank (its step counter, pid, and per step parity the signature of its current
// operation and up to kInlineBytes of data in the counter's own cache line, then the full
// metadata of its current operation by parity), then per rank a ring of kRingDepth 64-byte
// entries (its tiny broadcasts as root), then per rank kRingDepth 32-bit words (the step of
// each of its ring entries again, 16 to a cache line), rounded up to whole pages, then 2 x nranks
// data slots of slot_bytes each: slot (set, rank) at data_offset + (set * nranks + rank) *
// slot_bytes.
//
// Steps: in step k a rank writes only its own slot of set k%2 (or its inline data of parity
// k%2), then arrives (stores k in its counter) and waits for every rank's counter to reach k,
// then reads any slot of set k%2 (any rank's inline data of parity k%2). Arriving at k+1 means
// having finished reading set k%2, so the set is free again at step k+2: one barrier per step,
// no second "done reading" barrier (step_barrier.h).
//
// Tiny broadcasts (at most kInlineBytes): the root writes its ring entry for step k
// (k % kRingDepth), arrives and returns; the others arrive and read the entry. The entry is
// written again at step k + kRingDepth, once every rank arrived at k + 1 (read it): the root
// runs up to kRingDepth calls ahead, and reads the others' counters only when its ring is
// about to wrap. It writes nothing beside its counter for such a step. It also writes the step
// into its root-step word k % kRingDepth: when it catches up it checks that no other rank
// published at its own root steps (both thought they were the root), reading those words, 16
// steps a cache line, rather than one ring entry (a line) per step: 256 lines took 2-2.6 us
// from memory, inside one call of a 4-byte broadcast's root every ~240 calls.
//
// Why inline data: a rank that sees a peer's counter reach k has that cache line already;
// data and signature in the same line cost no further transfer between cores, where a slot
// and the metadata block cost one more each (a 4-byte all_reduce on 2 ranks measured
// 0.66-0.71 us through a slot, 0.62-0.65 us inline).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace torchpar::detail::shm_backend {

inline constexpr uint64_t kMagic = 0x314c4c4f43524154ULL;  // "TPARCOLL" reversed-ish
inline constexpr size_t kHeaderBytes = 4096;
inline constexpr size_t kAbortMessageBytes = 512;

/// The operations, as recorded in OpMeta::op.
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

/// "all_reduce", ...; "?" for a value no rank should write.
inline const char* op_name(OpCode op) {
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
  int32_t op;     // OpCode
  int32_t dtype;  // at::ScalarType
  int64_t numel;  // per tensor (per list element for list operations)
  int32_t root;   // src/dst, -1 when none
  int32_t reduce_op;
  uint64_t call;  // operations issued so far on this group
};

/// Bytes of data a rank can publish in its counter's cache line (per step parity).
inline constexpr size_t kInlineBytes = 16;

/// memcpy of n <= kInlineBytes bytes without a call: two (possibly overlapping) loads and
/// stores of 8 or 4 bytes, or a byte loop below 4. memcpy with a size known only at run
/// time was a call into libc on every tiny collective (1% of a 4-byte broadcast's profile).
inline void copy_inline(void* dst, const void* src, size_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  if (n >= 8) {
    uint64_t head, tail;
    std::memcpy(&head, s, 8);
    std::memcpy(&tail, s + n - 8, 8);
    std::memcpy(d, &head, 8);
    std::memcpy(d + n - 8, &tail, 8);
  } else if (n >= 4) {
    uint32_t head, tail;
    std::memcpy(&head, s, 4);
    std::memcpy(&tail, s + n - 4, 4);
    std::memcpy(d, &head, 4);
    std::memcpy(d + n - 4, &tail, 4);
  } else {
    for (size_t i = 0; i < n; ++i) d[i] = s[i];
  }
}

/// What a rank publishes beside its counter for one step parity.
struct InlineStep {
  uint64_t sig;                        // op_signature of the operation's first step
  alignas(8) char data[kInlineBytes];  // a tiny operation's data
};

/// One rank's control block. Only its rank writes it (the pid once, at attach).
struct alignas(64) RankCtl {
  std::atomic<uint32_t> seq;  // last step this rank arrived at (a futex word)
  int32_t pid;                // 0 until the rank attached
  std::atomic<int32_t> cpu;   // the core it ran on when it last arrived (-1 unknown)
  uint32_t pad0;
  InlineStep inline_step[2];  // by step parity, in the counter's cache line
  OpMeta meta[2];             // by step parity: read only when signatures differ
  /// Single copies (single_copy.cpp): the address of a word of this process that holds
  /// kMagic ^ pid, which the others read with process_vm_readv once at attach; and whether
  /// this rank could read every other rank's word that way (kSingleCopyYes/No, 0 not yet).
  uint64_t probe_addr;
  std::atomic<int32_t> single_copy;
  uint8_t pad1[256 - 64 - 2 * sizeof(OpMeta) - 16];
};
static_assert(sizeof(RankCtl) == 256);
inline constexpr int32_t kSingleCopyYes = 1;
inline constexpr int32_t kSingleCopyNo = 2;
static_assert(offsetof(RankCtl, meta) == 64, "seq, signatures and inline data share one line");

/// How many tiny broadcasts a root may run ahead of the slowest rank (ring entries per rank).
inline constexpr uint32_t kRingDepth = 256;

/// One tiny broadcast as its root publishes it, in a cache line of the root's ring: entry
/// step % kRingDepth. Only the root writes it, `step` last (release); a reader that sees its
/// step there has the rest.
struct alignas(64) RingEntry {
  std::atomic<uint32_t> step;  // the step this entry holds (0: none yet)
  uint32_t pad;
  alignas(8) char data[kInlineBytes];
  OpMeta meta;   // the root's operation
  uint64_t sig;  // op_signature(meta)
};
static_assert(sizeof(RingEntry) == 64);

/// What a rank publishes as the signature of its operation's first step: the operation's
/// signature tagged with the step, so that a signature left from an older step never
/// matches (a broadcast's root publishes in its ring, not beside its counter).
inline uint64_t step_signature(uint64_t sig, uint32_t step) {
  return sig ^ (static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ULL);
}

/// A 64-bit digest of what ranks must agree on (every field of OpMeta but the call count):
/// equal metadata, equal signatures. Ranks compare signatures first and the full metadata
/// (for the message) only when they differ.
inline uint64_t op_signature(const OpMeta& m) {
  auto mix = [](uint64_t h, uint64_t x) {  // splitmix64's finalizer over h ^ x
    uint64_t z = (h ^ x) + 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  uint64_t h = mix(0, static_cast<uint32_t>(m.op));
  h = mix(h, static_cast<uint32_t>(m.dtype));
  h = mix(h, static_cast<uint64_t>(m.numel));
  h = mix(h, static_cast<uint32_t>(m.root));
  return mix(h, static_cast<uint32_t>(m.reduce_op));
}

/// The header page. Rank 0 writes the geometry before it publishes the segment's name.
/// Why a segment was aborted: what every rank raises for it (one error per event).
enum class AbortKind : int32_t {
  kLost = 0,     // a rank's process is gone: RankLostError naming it
  kTimeout = 1,  // a rank did not arrive in time (alive, stopped or slow): TimeoutError
  kError = 2,    // the ranks disagree on the operation: torchpar::Error
};

struct Header {
  uint64_t magic;
  uint32_t nranks;
  uint32_t pad;
  uint64_t slot_bytes;
  uint64_t data_offset;
  uint64_t total_bytes;
  alignas(64) std::atomic<uint32_t> waiters;  // ranks asleep on some counter's futex
  alignas(64) std::atomic<uint32_t> aborted;  // 0 ok; 1 being written; 2 aborted
  int32_t failed_rank;                        // valid once aborted == 2
  int32_t abort_kind;                         // AbortKind; valid once aborted == 2
  char abort_msg[kAbortMessageBytes];         // valid once aborted == 2
};
static_assert(sizeof(Header) <= kHeaderBytes);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

/// The geometry of a group's segment; every rank computes it from (nranks, slot_bytes).
struct SegmentLayout {
  int nranks = 0;
  size_t slot_bytes = 0;
  size_t data_offset = 0;  // after the header page and the control blocks, page-aligned
  size_t total_bytes = 0;

  static SegmentLayout of(int nranks, size_t slot_bytes) {
    SegmentLayout l;
    l.nranks = nranks;
    l.slot_bytes = slot_bytes;
    const size_t ctl_bytes =
        static_cast<size_t>(nranks) * (sizeof(RankCtl) + kRingBytes + kRootStepBytes);
    l.data_offset = kHeaderBytes + (ctl_bytes + kHeaderBytes - 1) / kHeaderBytes * kHeaderBytes;
    l.total_bytes = l.data_offset + 2 * static_cast<size_t>(nranks) * slot_bytes;
    return l;
  }

  static Header* header(char* base) { return reinterpret_cast<Header*>(base); }
  static constexpr size_t kRingBytes = kRingDepth * sizeof(RingEntry);
  static RankCtl* ctl(char* base) { return reinterpret_cast<RankCtl*>(base + kHeaderBytes); }
  /// Rank q's ring of tiny broadcasts (kRingDepth entries), after every control block.
  RingEntry* ring(char* base, int q) const {
    return reinterpret_cast<RingEntry*>(base + kHeaderBytes +
                                        static_cast<size_t>(nranks) * sizeof(RankCtl) +
                                        static_cast<size_t>(q) * kRingBytes);
  }
  static constexpr size_t kRootStepBytes = kRingDepth * sizeof(std::atomic<uint32_t>);
  /// Rank q's root-step words (kRingDepth), after every ring: word k % kRingDepth holds k once
  /// q published step k in its ring (only q writes them).
  std::atomic<uint32_t>* root_steps(char* base, int q) const {
    return reinterpret_cast<std::atomic<uint32_t>*>(
        base + kHeaderBytes + static_cast<size_t>(nranks) * (sizeof(RankCtl) + kRingBytes) +
        static_cast<size_t>(q) * kRootStepBytes);
  }
  char* data(char* base) const { return base + data_offset; }

  /// Writes the geometry into a fresh (zero-filled) segment.
  void init_header(char* base) const {
    Header* h = header(base);
    h->nranks = static_cast<uint32_t>(nranks);
    h->slot_bytes = slot_bytes;
    h->data_offset = data_offset;
    h->total_bytes = total_bytes;
    h->magic = kMagic;
  }
  /// True when a mapped segment has this geometry.
  bool matches(const char* base) const {
    const auto* h = reinterpret_cast<const Header*>(base);
    return h->magic == kMagic && h->nranks == static_cast<uint32_t>(nranks) &&
           h->total_bytes == total_bytes;
  }
};

}  // namespace torchpar::detail::shm_backend
