# -DTORCHPAR_SANITIZE=address,undefined or thread: applies to every target.
if(TORCHPAR_SANITIZE)
  add_compile_options(-fsanitize=${TORCHPAR_SANITIZE} -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${TORCHPAR_SANITIZE})
  # GCC's -Warray-bounds misfires on LibTorch's IValue tuple accessors (ivalue_inl.h,
  # elementsInline_[idx] behind a size check) once ASan's instrumentation changes inlining;
  # the normal build keeps the warning.
  add_compile_options(-Wno-array-bounds)
endif()
