add_library(torchpar_warnings INTERFACE)
target_compile_options(torchpar_warnings INTERFACE
  -Wall -Wextra -Wshadow -Wnon-virtual-dtor
  $<$<BOOL:${TORCHPAR_WERROR}>:-Werror>)
install(TARGETS torchpar_warnings EXPORT torchparTargets)
