#pragma once
// The machine's memory as /proc/meminfo reports it: what the shm layer checks before it
// reserves a segment, and what the model assigner offers as the CPU's capacity.

#include <cstdint>
#include <cstdio>
#include <optional>

namespace torchpar::detail {

struct MemInfo {
  uint64_t total_bytes = 0;      // MemTotal
  uint64_t available_bytes = 0;  // MemAvailable: what can be allocated without swapping
};

/// MemTotal and MemAvailable of `path` (a /proc/meminfo-format file) in bytes; nullopt
/// when the file cannot be read or lacks either line (kernels before 3.14 have no
/// MemAvailable). Safety: thread-safe.
inline std::optional<MemInfo> read_meminfo(const char* path = "/proc/meminfo") {
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return std::nullopt;
  char line[256];
  unsigned long long kb = 0;
  std::optional<uint64_t> total, available;
  while ((!total || !available) && std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "MemTotal: %llu kB", &kb) == 1) total = kb * 1024;
    if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) available = kb * 1024;
  }
  std::fclose(f);
  if (!total || !available) return std::nullopt;
  return MemInfo{*total, *available};
}

}  // namespace torchpar::detail
