# Use ccache when present. PCH needs the sloppiness below to get cache hits.
find_program(TORCHPAR_CCACHE ccache)
if(TORCHPAR_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER
      ${CMAKE_COMMAND} -E env "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
      ${TORCHPAR_CCACHE})
endif()
