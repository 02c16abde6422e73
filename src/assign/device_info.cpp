#include "torchpar/assign/device_info.h"

#include <dlfcn.h>

#include <cctype>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/meminfo.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"

namespace torchpar {
namespace {

// The few NVML declarations the probe needs (nvml.h is not on every machine; the ABI of
// these _v2 entry points and structs is stable).
struct NvmlDevice;
using NvmlDeviceHandle = NvmlDevice*;
struct NvmlMemory {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
struct NvmlUtilization {
  unsigned int gpu;
  unsigned int memory;
};
constexpr int kNvmlSuccess = 0;
constexpr unsigned kNvmlUuidLength = 96;  // NVML_DEVICE_UUID_V2_BUFFER_SIZE

struct Nvml {
  int (*init)() = nullptr;
  int (*shutdown)() = nullptr;
  int (*count)(unsigned*) = nullptr;
  int (*by_index)(unsigned, NvmlDeviceHandle*) = nullptr;
  int (*uuid)(NvmlDeviceHandle, char*, unsigned) = nullptr;
  int (*memory)(NvmlDeviceHandle, NvmlMemory*) = nullptr;
  int (*utilization)(NvmlDeviceHandle, NvmlUtilization*) = nullptr;
  bool loaded = false;
};

// Loaded once and never unloaded (dlclose of a driver library at exit is asking for trouble).
const Nvml& nvml() {
  static const Nvml lib = [] {
    Nvml l;
    void* h = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) return l;
    auto sym = [h](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(h, name));
      return fn != nullptr;
    };
    l.loaded = sym(l.init, "nvmlInit_v2") && sym(l.shutdown, "nvmlShutdown") &&
               sym(l.count, "nvmlDeviceGetCount_v2") &&
               sym(l.by_index, "nvmlDeviceGetHandleByIndex_v2") &&
               sym(l.uuid, "nvmlDeviceGetUUID") && sym(l.memory, "nvmlDeviceGetMemoryInfo") &&
               sym(l.utilization, "nvmlDeviceGetUtilizationRates");
    return l;
  }();
  return lib;
}

// Leading decimal digits of `s` as CUDA's strtoul reads them ("1gpu" -> 1), -1 if none or
// negative: the rules of torch.cuda._parse_visible_devices.
long leading_ordinal(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  if (s.empty() || s.front() == '-') return -1;
  if (s.front() == '+') s.remove_prefix(1);
  long v = 0;
  size_t n = 0;
  for (; n < s.size() && std::isdigit(static_cast<unsigned char>(s[n])) && v < 1'000'000; ++n) {
    v = v * 10 + (s[n] - '0');
  }
  return n == 0 ? -1 : v;
}

std::vector<std::string_view> split_commas(std::string_view s) {
  std::vector<std::string_view> out;
  for (;;) {
    const auto comma = s.find(',');
    out.push_back(s.substr(0, comma));
    if (comma == std::string_view::npos) return out;
    s.remove_prefix(comma + 1);
  }
}

// The NVML indices of cuda:0, cuda:1, ... under CUDA_VISIBLE_DEVICES (all of them if unset).
// A repeated entry hides every device, a bad one ends the list (CUDA's rules); MIG instances
// are not probed (their memory is not the device's).
std::vector<unsigned> visible_nvml_indices(const Nvml& lib, unsigned count) {
  std::vector<unsigned> out;
  const std::optional<std::string> env = env_value("CUDA_VISIBLE_DEVICES");
  if (!env) {
    for (unsigned i = 0; i < count; ++i) out.push_back(i);
    return out;
  }
  const std::string_view var(*env);
  if (var.starts_with("MIG-")) return {};
  const bool by_uuid = var.starts_with("GPU-");
  for (const auto elem : split_commas(var)) {
    long index = -1;
    if (by_uuid) {
      if (!elem.starts_with("GPU-")) break;
      // A unique prefix of a device's UUID names it.
      for (unsigned i = 0; i < count; ++i) {
        NvmlDeviceHandle dev = nullptr;
        char uuid[kNvmlUuidLength] = {};
        if (lib.by_index(i, &dev) != kNvmlSuccess ||
            lib.uuid(dev, uuid, kNvmlUuidLength) != kNvmlSuccess ||
            !std::string_view(uuid).starts_with(elem)) {
          continue;
        }
        if (index >= 0) return out;  // ambiguous prefix
        index = i;
      }
    } else {
      index = leading_ordinal(elem);
    }
    if (index < 0 || index >= static_cast<long>(count)) break;
    for (const unsigned seen : out) {
      if (seen == static_cast<unsigned>(index)) return {};
    }
    out.push_back(static_cast<unsigned>(index));
  }
  return out;
}

void probe_nvml(std::vector<DeviceInfo>& devices) {
  const Nvml& lib = nvml();
  if (!lib.loaded || lib.init() != kNvmlSuccess) return;
  unsigned count = 0;
  if (lib.count(&count) == kNvmlSuccess) {
    const auto visible = visible_nvml_indices(lib, count);
    for (size_t cuda = 0; cuda < visible.size(); ++cuda) {
      NvmlDeviceHandle dev = nullptr;
      NvmlMemory mem{};
      NvmlUtilization util{};
      if (lib.by_index(visible[cuda], &dev) != kNvmlSuccess ||
          lib.memory(dev, &mem) != kNvmlSuccess) {
        break;  // keep cuda:N numbering dense: a hole would misname the devices after it
      }
      DeviceInfo info{.name = "cuda:" + std::to_string(cuda),
                      .total_memory_bytes = static_cast<int64_t>(mem.total),
                      .used_memory_bytes = static_cast<int64_t>(mem.used),
                      .compute_power = 1.0};
      if (lib.utilization(dev, &util) == kNvmlSuccess) {
        info.compute_power = 1.0 - static_cast<double>(util.gpu) / 100.0;
      }
      devices.push_back(std::move(info));
    }
  }
  lib.shutdown();
}

}  // namespace

std::vector<DeviceInfo> probe_devices() {
  const auto mem = detail::read_meminfo();
  if (!mem) throw Error("probe_devices: /proc/meminfo has no MemTotal or MemAvailable");
  std::vector<DeviceInfo> devices;
  devices.push_back(
      DeviceInfo{.name = "cpu",
                 .total_memory_bytes = static_cast<int64_t>(mem->total_bytes),
                 .used_memory_bytes = static_cast<int64_t>(mem->total_bytes - mem->available_bytes),
                 .compute_power = std::nullopt});
  probe_nvml(devices);
  return devices;
}

}  // namespace torchpar
