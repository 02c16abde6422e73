#include "serialize/fd_elision.h"

#include <algorithm>

#include "shm/allocator.h"
#include "shm/segment.h"

namespace torchpar::detail {

void FdElision::forget_if_forked() {
  const int me = cached_pid();
  if (owner_ == me) return;
  // A forked child: what the parent sent and pinned is the parent's.
  owner_ = me;
  sent_.clear();
  from_.clear();
}

bool FdElision::elide(uint64_t dev, uint64_t ino, uint64_t segment_bytes) {
  if (segment_bytes > kMaxSegmentBytes) return false;
  const Id id{dev, ino};
  std::lock_guard<std::mutex> lock(mu_);
  forget_if_forked();
  if (std::find(sent_.begin(), sent_.end(), id) != sent_.end()) return true;
  sent_.push_back(id);
  if (sent_.size() > kSegments) sent_.pop_front();
  return false;
}

void FdElision::pin(int32_t pid, uint64_t dev, uint64_t ino, uint64_t segment_bytes) {
  if (segment_bytes > kMaxSegmentBytes) return;
  const Id id{dev, ino};
  std::shared_ptr<Segment> seg = mapped_fd_segment(dev, ino);
  std::shared_ptr<Segment> dropped;  // unmapped after the lock
  Sender gone;                       // likewise
  std::lock_guard<std::mutex> lock(mu_);
  forget_if_forked();
  auto from =
      std::find_if(from_.begin(), from_.end(), [&](const Sender& s) { return s.pid == pid; });
  Sender sender;
  if (from != from_.end()) {
    sender = std::move(*from);
    from_.erase(from);
  } else {
    sender.pid = pid;
    if (from_.size() >= kSenders) {  // the least recently active goes
      gone = std::move(from_.front());
      from_.erase(from_.begin());
    }
  }
  // The sender passed this fd again: it had forgotten the segment, so it is the newest of
  // its list now (on this side too, where it may linger after a missed message).
  auto same = std::find_if(sender.pins.begin(), sender.pins.end(),
                           [&](const Pin& p) { return p.id == id; });
  if (same != sender.pins.end()) sender.pins.erase(same);
  sender.pins.push_back(Pin{id, std::move(seg)});
  if (sender.pins.size() > kSegments) {
    dropped = std::move(sender.pins.front().seg);
    sender.pins.pop_front();
  }
  from_.push_back(std::move(sender));
}

void FdElision::forget() {
  std::vector<Sender> dropped;  // unmapped after the lock
  std::lock_guard<std::mutex> lock(mu_);
  sent_.clear();
  dropped.swap(from_);
}

size_t FdElision::pinned() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const Sender& s : from_) n += s.pins.size();
  return n;
}

}  // namespace torchpar::detail
