#pragma once
// Lifetime of named (file_system) segments.
//
// Names are `/torchpar_<pid>_<counter>`. A cleaner process, started the first time this
// process creates a named segment, waits for this process to exit (however it exits,
// SIGKILL included) and then unlinks every `/dev/shm/torchpar_<pid>_*`. An atexit handler
// does the same at a normal exit, and the first cleaner of any process sweeps names whose
// pid is no longer alive (left by a cleaner that was itself killed).

#include <cstddef>
#include <string>

namespace torchpar::detail {

/// A fresh segment name for this process: "/torchpar_<pid>_<64-bit counter in hex>".
std::string make_segment_name();

/// Starts the cleaner for this process if it is not running yet. Thread-safe.
void ensure_cleaner();

/// Unlinks /dev/shm/torchpar_<pid>_* of processes that no longer exist; returns how many.
size_t sweep_dead_segments();

/// Unlinks every /dev/shm/torchpar_<pid>_* of `pid`. Async-signal-safe.
void unlink_segments_of(int pid) noexcept;

}  // namespace torchpar::detail
