#pragma once
// Whole small files: written so that readers see the old file or the new one, never a part;
// read with a bound, from regular files only.

#include <string>
#include <string_view>

namespace torchpar::detail {

/// Writes `bytes` to `path` (mode 0644 before the umask): to "<path>.tmp.<pid>" beside it,
/// fsync, then rename over `path`. Errors: SystemError naming the file and the failed
/// syscall (open, write, fsync, rename); the temporary file is removed then.
void write_file_atomically(const std::string& path, std::string_view bytes);

/// The bytes of the regular file `path` (a metadata file: a sidecar's JSON), at most
/// `max_bytes`. Opened non-blocking, so that a FIFO never waits for a writer; anything but a
/// regular file (FIFO, device such as /dev/zero, directory, socket) is refused before a byte is
/// read, and so is a file larger than `max_bytes` (also one that grows past it while read).
/// Errors: SystemError naming the path and syscall (open, fstat, read); SerializationError
/// naming the path, prefixed by `what`, for a file that is not regular or is too large.
std::string read_small_file(const std::string& path, size_t max_bytes, std::string_view what);

}  // namespace torchpar::detail
