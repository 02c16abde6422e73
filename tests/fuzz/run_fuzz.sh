#!/usr/bin/env bash
# Builds a libFuzzer target (address + undefined sanitizers, in a build tree of its own)
# and runs it for N seconds. Usage: run_fuzz.sh SRC_DIR BUILD_DIR SECONDS [TARGET]
# TARGET: loads_fuzz (the default), manager_request_fuzz, rpc_message_fuzz or pickle_fuzz.
set -euo pipefail
src=$1; build=$2; secs=${3:-60}; target=${4:-loads_fuzz}
cmake -S "$src" -B "$build" -DCMAKE_CXX_COMPILER=g++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTORCHPAR_BUILD_TESTS=OFF -DTORCHPAR_BUILD_BENCH=OFF \
  -DTORCHPAR_FUZZ=ON >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
cmake --build "$build" --target "$target" -j2
# loads_fuzz keeps its corpus where it always did; other targets get one of their own.
corpus="$build/corpus"
[[ "$target" == loads_fuzz ]] || corpus="$build/corpus_$target"
mkdir -p "$corpus"
# LLVMFuzzerInitialize writes valid inputs into an empty corpus.
ASAN_OPTIONS=detect_leaks=0 "$build/$target" -max_total_time="$secs" -rss_limit_mb=4096 \
  -malloc_limit_mb=1024 -use_value_profile=1 -print_final_stats=1 "$corpus"
