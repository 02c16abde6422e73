#pragma once
// LostRanks: the world ranks this process's groups have found lost (RankLostError), so that
// rank 0, leaving the rendezvous, does not wait for a rank that will never leave.

#include <atomic>
#include <cstddef>
#include <vector>

namespace torchpar::detail {

/// Safety: thread-safe (one flag per world rank; ranks out of range are ignored).
class LostRanks {
 public:
  explicit LostRanks(int world_size)
      : lost_(static_cast<size_t>(world_size > 0 ? world_size : 0)) {}
  void mark(int world_rank) noexcept {
    if (world_rank >= 0 && static_cast<size_t>(world_rank) < lost_.size())
      lost_[static_cast<size_t>(world_rank)].store(true, std::memory_order_release);
  }
  bool contains(int world_rank) const noexcept {
    return world_rank >= 0 && static_cast<size_t>(world_rank) < lost_.size() &&
           lost_[static_cast<size_t>(world_rank)].load(std::memory_order_acquire);
  }

 private:
  std::vector<std::atomic<bool>> lost_;
};

}  // namespace torchpar::detail
