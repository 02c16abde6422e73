# Installs the build into a prefix and builds a tiny outside project against it with
# find_package(torchpar REQUIRED), then runs it.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR}/app)
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "cmake --install failed: ${rc}")
endif()
file(WRITE ${WORK_DIR}/app/CMakeLists.txt [=[
cmake_minimum_required(VERSION 3.25)
project(outside CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(torchpar REQUIRED)
add_executable(app main.cpp)
target_link_libraries(app torchpar::torchpar)
]=])
file(WRITE ${WORK_DIR}/app/main.cpp [=[
#include <torchpar/torchpar.h>
#include <cstdio>
int main() {
  at::Tensor t = at::ones({4});
  torchpar::share_memory_(t);
  auto back = torchpar::loads<at::Tensor>(torchpar::dumps(t, {.copy_tensor = false}));
  std::printf("outside app: torchpar %s shared=%d sum=%g\n", torchpar::version(),
              int(torchpar::is_shared(back)), back.sum().item<double>());
  return torchpar::is_shared(back) && back.sum().item<double>() == 4.0 ? 0 : 1;
}
]=])
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK_DIR}/app -B ${WORK_DIR}/app/build
                        -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the outside project failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/app/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the outside project failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/app/build/app RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the outside app failed: ${rc}")
endif()

# The installed program starts from its prefix (install RPATH), and its subcommands find what
# they need there: `info`, `run`, and `bench` (programs in libexec/torchpar, runner in share/).
execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH
                        ${WORK_DIR}/prefix/bin/torchpar info
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc)
  message(FATAL_ERROR "installed torchpar info failed (${rc}): ${out}${err}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH
                        ${WORK_DIR}/prefix/bin/torchpar run -n 2 -- /bin/sh -c "echo rank $RANK"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc OR NOT out MATCHES "rank 1")
  message(FATAL_ERROR "installed torchpar run failed (${rc}): ${out}${err}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH --unset=TORCHPAR_BENCH_DIR
                        ${WORK_DIR}/prefix/bin/torchpar bench --quick --only limits --rounds 1
                        --out ${WORK_DIR}/bench
                WORKING_DIRECTORY ${WORK_DIR}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc OR NOT EXISTS ${WORK_DIR}/bench/report.md)
  message(FATAL_ERROR "installed torchpar bench failed (${rc}): ${out}${err}")
endif()
message(STATUS "installed torchpar: info, run and bench work from ${WORK_DIR}/prefix")

# The Python package from the prefix (when it was built): `import torchpar.multiprocessing` by
# /usr/bin/python3 with the prefix's site directory on PYTHONPATH, a tensor through a Queue.
if(PY_SITE)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH
                          PYTHONPATH=${WORK_DIR}/prefix/${PY_SITE}
                          /usr/bin/python3 -c [=[
import torch, torchpar, torchpar.multiprocessing as mp
q = mp.Queue()
q.put(torch.ones(4))
t = q.get(timeout=10)
assert mp.is_shared(t) and t.sum().item() == 4.0
print("installed python package:", torchpar.__file__)
]=]
                  WORKING_DIRECTORY ${WORK_DIR}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc OR NOT out MATCHES "${WORK_DIR}/prefix/")
    message(FATAL_ERROR "installed Python package failed (${rc}): ${out}${err}")
  endif()
  message(STATUS "${out}")
endif()
