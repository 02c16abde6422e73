# -DTORCHPAR_SANITIZE=address,undefined or thread: applies to every target.
if(TORCHPAR_SANITIZE)
  add_compile_options(-fsanitize=${TORCHPAR_SANITIZE} -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${TORCHPAR_SANITIZE})
endif()
