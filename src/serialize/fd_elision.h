#pragma once
// A Connection's memory of the shared-memory segments whose fds crossed it lately, so that a
// segment's fd crosses once rather than with every message (the ping-pong of one tensor, a
// stream of small tensors out of one slab).
//
// The sender passes a segment's fd, and remembers the segment, unless it passed that
// segment's fd within its last kSegments fd passes over this connection; then the handle
// travels without fd (as a Queue's do: /proc/<pid>/fd/<n>, dev, ino). The receiver pins
// (keeps mapped) every segment that arrived with its fd, the last kSegments of each sending
// process. Both sides apply the same rule to the same sequence of messages (one stream, in
// order), so a handle that comes without its fd finds its segment pinned: the tensor arrives
// even when its sender has exited meanwhile, as with an fd. No message of ours says so: the
// wire format is unchanged, and a receiver that lost track (a second reading process on the
// same end, a load that failed before it saw a handle, sends of two threads racing) reopens
// the segment through /proc/<pid>/fd while the sender lives, as a Queue does.
//
// Only segments of at most kMaxSegmentBytes (the allocator's slabs and small large segments)
// are remembered: a pin keeps a segment's memory alive after both sides dropped their
// tensors, so a receiver holds at most kSegments * kMaxSegmentBytes (64 MiB) per sending
// process and kSenders processes per connection. A forked child starts with a fresh memory.
//
// Safety: thread-safe (one mutex); shared by the copies of one Connection in a process.

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

namespace torchpar::detail {

class Segment;

class FdElision {
 public:
  static constexpr size_t kSegments = 16;
  static constexpr uint64_t kMaxSegmentBytes = uint64_t{4} << 20;
  static constexpr size_t kSenders = 16;

  /// Sender: true when the fd of segment (dev, ino) of `segment_bytes` may stay home (this
  /// process passed it over the connection within its last kSegments fd passes); otherwise
  /// remembers the segment (its fd is about to be passed) and returns false.
  bool elide(uint64_t dev, uint64_t ino, uint64_t segment_bytes);
  /// Receiver: a handle from process `pid` arrived with its fd and was imported: pins the
  /// segment (dev, ino), mapped in this process now, as the sender's elide remembered it.
  void pin(int32_t pid, uint64_t dev, uint64_t ino, uint64_t segment_bytes);
  /// Forgets every segment, sent or pinned (the connection was closed here).
  void forget();
  /// Segments pinned (for tests).
  size_t pinned() const;

 private:
  struct Id {
    uint64_t dev = 0;
    uint64_t ino = 0;
    bool operator==(const Id&) const = default;
  };
  struct Pin {
    Id id;
    std::shared_ptr<Segment> seg;
  };
  struct Sender {
    int32_t pid = 0;
    std::deque<Pin> pins;  // oldest first
  };
  void forget_if_forked();  // mu_ held

  mutable std::mutex mu_;
  int owner_ = 0;             // the process whose memory this is (0: none yet)
  std::deque<Id> sent_;       // oldest first
  std::vector<Sender> from_;  // most recently active last
};

}  // namespace torchpar::detail
