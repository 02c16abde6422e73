#pragma once
// The spin-wait hint, guarded per architecture (a no-op where there is none).

namespace torchpar::detail {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  asm volatile("yield" ::: "memory");
#elif defined(__powerpc64__)
  asm volatile("or 27,27,27" ::: "memory");
#endif
}

}  // namespace torchpar::detail
