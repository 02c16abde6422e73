#pragma once
/// DeviceInfo and probe_devices(): the devices ModelAssigner may place models on, with their
/// memory and compute power (what machin reads from psutil and GPUtil). See docs/assign.md.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace torchpar {

/// One device of the table ModelAssigner places models on. Tests and callers who know
/// better than the probe (another process will take half a GPU) build these themselves
/// and pass them as ModelAssignerOptions::device_table.
///
/// ```cpp
/// torchpar::DeviceInfo gpu{.name = "cuda:0",
///                          .total_memory_bytes = 16LL << 30,
///                          .used_memory_bytes = 2LL << 30,
///                          .compute_power = 0.75};  // 25 % busy
/// ```
struct DeviceInfo {
  /// "cpu" or "cuda:<index>" (c10::Device syntax; "cuda" alone means "cuda:0").
  std::string name;
  /// Memory of the device in bytes (RAM for "cpu").
  int64_t total_memory_bytes = 0;
  /// Bytes in use; the assigner offers (total - used) * max_mem_ratio. For "cpu" the probe
  /// sets total - MemAvailable, so free is what can be allocated without swapping
  /// (psutil's `available`, which machin uses).
  int64_t used_memory_bytes = 0;
  /// Compute power relative to one idle GPU (machin's `1 - load` of GPUtil; an idle GPU is
  /// 1). nullopt: 1 for a GPU, ModelAssignerOptions::cpu_weight for "cpu" (as machin).
  std::optional<double> compute_power = std::nullopt;

  /// max(0, total - used), in bytes.
  int64_t free_memory_bytes() const {
    return total_memory_bytes > used_memory_bytes ? total_memory_bytes - used_memory_bytes : 0;
  }
};

/// The devices of this machine: "cpu" first (memory from /proc/meminfo, compute_power
/// nullopt), then "cuda:0", "cuda:1", ... as NVML reports them (total and used memory,
/// compute_power = 1 - GPU utilisation), numbered as CUDA_VISIBLE_DEVICES exposes them
/// when it lists indices or GPU UUIDs. Without libnvidia-ml.so.1 (no NVIDIA driver), the
/// list is "cpu" alone.
///
/// The probe never initialises CUDA (as torch.cuda.device_count's NVML path), so forking
/// after it is safe. NVML numbers devices in PCI bus order; CUDA does too only with
/// CUDA_DEVICE_ORDER=PCI_BUS_ID (GPUtil, which machin uses, has the same caveat).
///
/// Errors: Error if /proc/meminfo has no MemTotal or MemAvailable. NVML failures drop the
///         GPUs rather than throw.
/// Safety: thread-safe (NVML's init and shutdown are reference counted).
/// Source: machin's psutil.virtual_memory() and GPUtil.getGPUs().
std::vector<DeviceInfo> probe_devices();

}  // namespace torchpar
