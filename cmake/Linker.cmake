# Link with LLVM's lld when the compiler accepts it (scripts/install-deps.sh installs it).
# Every test, tool and benchmark links against libtorch_cpu; GNU ld takes ~1.7 CPU-seconds a
# program for that here, lld ~0.2 (ipc_test: 1.67 s against 0.19 s), which is about a minute of
# a fresh build's wall time on 2 cores. TORCHPAR_LINKER=default keeps the compiler's own linker.
set(TORCHPAR_LINKER "lld" CACHE STRING "Linker passed as -fuse-ld=<name>, or 'default'")
if(NOT TORCHPAR_LINKER STREQUAL "default")
  include(CheckLinkerFlag)
  check_linker_flag(CXX "-fuse-ld=${TORCHPAR_LINKER}" TORCHPAR_HAVE_LINKER_${TORCHPAR_LINKER})
  if(TORCHPAR_HAVE_LINKER_${TORCHPAR_LINKER})
    add_link_options("-fuse-ld=${TORCHPAR_LINKER}")
  else()
    message(STATUS "torchpar: -fuse-ld=${TORCHPAR_LINKER} not accepted, using the default linker")
  endif()
endif()
