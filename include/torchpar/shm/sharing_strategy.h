#pragma once
/// Sharing strategies for CPU tensors in shared memory, as in torch.multiprocessing.
///
///  - "file_descriptor" (default): each segment is an anonymous memfd; the fd travels to
///    other processes out of band (SCM_RIGHTS). Nothing is named, so nothing can leak:
///    the memory is returned when the last process holding a mapping or fd exits.
///  - "file_system": each segment is a named POSIX shm object `/dev/shm/torchpar_<pid>_<n>`.
///    The name travels instead of an fd. Names are unlinked when the creating process
///    exits, however it exits (a cleaner process watches it, so SIGKILL is covered too),
///    and segments of dead torchpar processes are swept when a new one starts.

#include <string>
#include <vector>

namespace torchpar {

enum class SharingStrategy { kFileDescriptor, kFileSystem };

/// Names of the strategies this system supports, sorted ("file_descriptor", "file_system").
/// Source: torch.multiprocessing.get_all_sharing_strategies.
std::vector<std::string> get_all_sharing_strategies();

/// Name of the strategy new shared segments of this process use.
/// Safety: thread-safe. Source: torch.multiprocessing.get_sharing_strategy.
std::string get_sharing_strategy();

/// Selects the strategy for segments created from now on (existing ones keep theirs).
/// Errors: torchpar::ValueError naming the valid strategies for an unknown name.
/// Safety: thread-safe. Source: torch.multiprocessing.set_sharing_strategy.
void set_sharing_strategy(const std::string& name);

/// Strategy as an enum; name conversions. `sharing_strategy_from_string` throws
/// torchpar::ValueError like set_sharing_strategy.
SharingStrategy current_sharing_strategy();
std::string to_string(SharingStrategy s);
SharingStrategy sharing_strategy_from_string(const std::string& name);

}  // namespace torchpar
