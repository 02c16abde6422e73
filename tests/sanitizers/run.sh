#!/usr/bin/env bash
# make check-sanitizers: builds torchpar twice more, each in its own tree, and runs
# (argument: all (default), asan, asan-fast (CI: the fast set's programs only, their tests), tsan)
#   build-asan (-DTORCHPAR_SANITIZE=address,undefined): the `fast` set,
#   build-tsan (-DTORCHPAR_SANITIZE=thread):            the core, ipc, pool, shm-backend,
#                                                       rpc-transport and DDP suites and the
#                                                       background release (see the filters
#                                                       below),
# both without the tests labelled `notsan` (scripts and installed-program checks that run
# uninstrumented programs or time out under the sanitizers' slow-down).
# Any report fails the run: halt_on_error=1, and every suppression lives in
# tests/sanitizers/*.supp with its reason beside it.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=$PWD
supp=$src/tests/sanitizers
jobs=${JOBS:-$(nproc)}
which=${1:-all}

build() {  # build <dir> <sanitizers> [targets...] (none: everything)
  local dir=$1 sanitizers=$2
  shift 2
  cmake -S "$src" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTORCHPAR_SANITIZE="$sanitizers" \
        -DTORCHPAR_BUILD_BENCH=OFF -DTORCHPAR_BUILD_PYTHON=OFF > "$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; exit 1; }
  cmake --build "$dir" -j "$jobs" ${1:+--target "$@"}
}

if [[ $which == all || $which == asan || $which == asan-fast ]]; then
  if [[ $which == asan-fast ]]; then
    # CI's run (.ci/run): only the library and the programs of the `fast` set are built.
    cmake -S "$src" -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
          -DTORCHPAR_SANITIZE=address,undefined -DTORCHPAR_BUILD_BENCH=OFF -DTORCHPAR_BUILD_PYTHON=OFF \
          > build-asan.configure.log 2>&1 || { cat build-asan.configure.log; exit 1; }
    cmake --build build-asan -j "$jobs" --target fast_tests  # tests/CMakeLists.txt
  else
    build build-asan address,undefined
  fi
  # LibTorch is not instrumented: ASan's container-overflow checks would misfire across the
  # boundary; leaks are checked (detect_leaks=1) with LibTorch's process-lifetime singletons
  # suppressed in lsan.supp.
  export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:detect_container_overflow=0:abort_on_error=0:suppressions=$supp/asan.supp"
  export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$supp/ubsan.supp"
  labels='fast|multiproc'
  [[ $which == asan-fast ]] && labels=fast
  (cd build-asan && ctest -L "$labels" -LE notsan --output-on-failure --timeout 900)
fi

if [[ $which == all || $which == tsan ]]; then
  build build-tsan thread core_test thread_pool_test parallel_test sync_test shm_queue_test \
        shm_backend_test ipc_test pool_test listener_test manager_test collective_test \
        rendezvous_test rpc_transport_test shm_test distributed_data_parallel_test
  # LibTorch's OpenMP threads are not instrumented, so TSan cannot see their
  # synchronisation: run at:: kernels on the calling thread (OMP_NUM_THREADS=1).
  # die_after_fork=0: pool workers and forked ranks start threads after fork(); the child
  # runs them, as without TSan (TSan only warns that it cannot check that child fully).
  export OMP_NUM_THREADS=1
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:die_after_fork=0:suppressions=$supp/tsan.supp"
  # Each suite with the cases TSan can follow (gtest filters; the binaries run directly):
  # - pool_test without its fork-start-method cases: a worker forked from the multi-threaded
  #   test process that starts a thread dies in TSan's runtime ("dup thread with used id",
  #   TSan keeps the parent's thread registry across fork); spawn and forkserver run.
  # - ipc_test without HundredProducerProcesses: 100 forked TSan processes exhaust the
  #   machine and the producers stall in TSan's post-fork runtime.
  # - collective_test, rendezvous_test and rpc_transport_test start their ranks with spawn
  #   (TORCHPAR_TEST_RANKS_START_METHOD, tests/support/ranks.h): a rank forked from the
  #   threaded test process inherits TSan's thread registry and the state of mutexes other
  #   threads held, so TSan reports its own bookkeeping there; a spawned rank is a fresh,
  #   fully instrumented process.
  failed=0
  run() {  # run <test> [gtest filter]
    echo "== tsan: $1 ${2:-}"
    (cd build-tsan/tests && timeout 900 "./$1" ${2:+--gtest_filter=$2}) || { echo "FAILED: $1"; failed=1; }
  }
  run core_test
  run thread_pool_test
  run parallel_test
  run sync_test
  run shm_queue_test
  run shm_backend_test
  run ipc_test '-*HundredProducerProcesses*'
  run pool_test '-*/fork'
  run listener_test
  run manager_test
  TORCHPAR_TEST_RANKS_START_METHOD=spawn run collective_test
  TORCHPAR_TEST_RANKS_START_METHOD=spawn run rendezvous_test
  TORCHPAR_TEST_RANKS_START_METHOD=spawn run rpc_transport_test
  # The background release of share_memory_'s old buffers (without its cases that start
  # the thread in a forked child: "dup thread with used id", as pool_test's fork cases), and
  # DistributedDataParallel's autograd hooks starting all_reduces on the executor thread.
  run shm_test 'ShareMemoryRelease*-*ForkedChild*:*ExitWith*'
  TORCHPAR_TEST_RANKS_START_METHOD=spawn run distributed_data_parallel_test
  exit $failed
fi
