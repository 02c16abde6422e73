#pragma once
// Writing a whole file so that readers see the old file or the new one, never a part.

#include <string>
#include <string_view>

namespace torchpar::detail {

/// Writes `bytes` to `path` (mode 0644 before the umask): to "<path>.tmp.<pid>" beside it,
/// fsync, then rename over `path`. Errors: SystemError naming the file and the failed
/// syscall (open, write, fsync, rename); the temporary file is removed then.
void write_file_atomically(const std::string& path, std::string_view bytes);

}  // namespace torchpar::detail
