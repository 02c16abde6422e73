#include "torchpar/shm/sharing_strategy.h"

#include <atomic>
#include <stdexcept>

#include "torchpar/core/error.h"

namespace torchpar {
namespace {
std::atomic<SharingStrategy> g_strategy{SharingStrategy::kFileDescriptor};
}  // namespace

std::vector<std::string> get_all_sharing_strategies() { return {"file_descriptor", "file_system"}; }

std::string get_sharing_strategy() { return to_string(g_strategy.load()); }

SharingStrategy current_sharing_strategy() { return g_strategy.load(); }

void set_sharing_strategy(const std::string& name) {
  g_strategy.store(sharing_strategy_from_string(name));
}

std::string to_string(SharingStrategy s) {
  return s == SharingStrategy::kFileDescriptor ? "file_descriptor" : "file_system";
}

SharingStrategy sharing_strategy_from_string(const std::string& name) {
  if (name == "file_descriptor") return SharingStrategy::kFileDescriptor;
  if (name == "file_system") return SharingStrategy::kFileSystem;
  throw ValueError("unknown sharing strategy '" + name +
                   "'; valid strategies are: file_descriptor, file_system");
}

}  // namespace torchpar
