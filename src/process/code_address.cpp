// Function addresses that survive exec of the same binary: (module name, offset from the
// module's load address). ASLR moves modules; offsets within them do not change.
#include <link.h>

#include <cstring>

#include <fmt/format.h>

#include "torchpar/core/error.h"
#include "torchpar/process/process.h"

namespace torchpar::detail {
namespace {

struct Search {
  uintptr_t addr = 0;
  const char* name = nullptr;  // for from_code_address
  bool found = false;
  std::string module;
  uintptr_t base = 0;
};

bool in_exec_segment(const dl_phdr_info* info, uintptr_t addr) {
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const auto& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD || (ph.p_flags & PF_X) == 0) continue;
    const uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
    if (addr >= lo && addr < lo + ph.p_memsz) return true;
  }
  return false;
}

}  // namespace

CodeAddress to_code_address(const void* p) {
  Search s;
  s.addr = reinterpret_cast<uintptr_t>(p);
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* q = static_cast<Search*>(data);
        if (!in_exec_segment(info, q->addr)) return 0;
        q->found = true;
        q->module = info->dlpi_name != nullptr ? info->dlpi_name : "";
        q->base = info->dlpi_addr;
        return 1;
      },
      &s);
  if (!s.found) throw Error(fmt::format("spawn: address {} is in no loaded module", p));
  return CodeAddress{s.module, s.addr - s.base};
}

void* from_code_address(const CodeAddress& a) {
  Search s;
  s.name = a.module.c_str();
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* q = static_cast<Search*>(data);
        const char* n = info->dlpi_name != nullptr ? info->dlpi_name : "";
        if (std::strcmp(n, q->name) != 0) return 0;
        q->found = true;
        q->base = info->dlpi_addr;
        return 1;
      },
      &s);
  if (!s.found)
    throw Error(
        fmt::format("spawned child: module '{}' of the target is not loaded here (was it "
                    "dlopen()ed by the parent?)",
                    a.module.empty() ? "<main program>" : a.module));
  return reinterpret_cast<void*>(s.base + a.offset);
}

}  // namespace torchpar::detail
