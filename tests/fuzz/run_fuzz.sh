#!/usr/bin/env bash
# Builds the libFuzzer target for loads (address + undefined sanitizers, in a build tree
# of its own) and runs it for N seconds. Usage: run_fuzz.sh SRC_DIR BUILD_DIR SECONDS
set -euo pipefail
src=$1; build=$2; secs=${3:-60}
cmake -S "$src" -B "$build" -DCMAKE_CXX_COMPILER=g++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTORCHPAR_BUILD_TESTS=OFF -DTORCHPAR_BUILD_BENCH=OFF \
  -DTORCHPAR_FUZZ=ON >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
cmake --build "$build" --target loads_fuzz -j2
mkdir -p "$build/corpus"
# LLVMFuzzerInitialize writes valid payloads of each fuzzed type into an empty corpus.
ASAN_OPTIONS=detect_leaks=0 "$build/loads_fuzz" -max_total_time="$secs" -rss_limit_mb=4096 \
  -malloc_limit_mb=1024 -use_value_profile=1 -print_final_stats=1 "$build/corpus"
