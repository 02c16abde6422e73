#pragma once
// Lifetime of named (file_system) segments.
//
// Names are `/torchpar_<pid>_<pid-namespace inode>_<counter>`. The first time a process
// creates a named segment it starts a cleaner: a `sh -c 'tail --pid=<pid> ...; rm ...'`
// process (exec'd, so it holds none of our memory or fds) that waits for this process to
// exit, however it exits, SIGKILL included, and then unlinks `/dev/shm/torchpar_<pid>_<ns>_*`.
// An atexit handler does the same at a normal exit. At that first use the process also
// sweeps names of dead processes of its own pid namespace (left by a cleaner that was
// itself killed).

#include <cstddef>
#include <string>

namespace torchpar::detail {

/// A fresh segment name for this process: "/torchpar_<pid>_<ns>_<64-bit counter in hex>".
std::string make_segment_name();

/// Starts the cleaner for this process if it is not running yet. Thread-safe.
void ensure_cleaner();

/// Unlinks names of processes of this pid namespace that no longer exist; returns how many.
size_t sweep_dead_segments();

/// Unlinks every name this process created (what the atexit handler does).
void unlink_own_segments() noexcept;

/// "torchpar_<pid>_<ns>_": the prefix of the names `pid` (of our namespace) creates.
std::string segment_prefix(int pid);

}  // namespace torchpar::detail
