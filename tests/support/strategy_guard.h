#pragma once
// Test support: sets the process-wide sharing strategy for one scope and restores it.
#include <string>

#include "torchpar/shm/sharing_strategy.h"

namespace torchpar::testing {

class StrategyGuard {
 public:
  explicit StrategyGuard(const std::string& s) : old_(get_sharing_strategy()) {
    set_sharing_strategy(s);
  }
  ~StrategyGuard() { set_sharing_strategy(old_); }
  StrategyGuard(const StrategyGuard&) = delete;
  StrategyGuard& operator=(const StrategyGuard&) = delete;

 private:
  std::string old_;
};

}  // namespace torchpar::testing
