#pragma once
// The spin-wait hint and a prefetch for writing, guarded per architecture (no-ops where
// there is none).

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

/// Asks for the cache line at `p` in exclusive state, so that a later store to it does not
/// wait for other cores to drop their copies (x86 PREFETCHW, a no-op before Broadwell;
/// GCC's builtin emits it only with -mprfchw). Never faults.
inline void prefetch_for_write(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetchw %0" ::"m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 1, 3);
#endif
}

}  // namespace torchpar::detail
