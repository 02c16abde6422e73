# torchpar: the two set-up commands are `make demo` and `make test`.
BUILD ?= build
JOBS ?= $(shell nproc)
# Release (-O3, no debug info) compiles a LibTorch translation unit about 30% faster than
# RelWithDebInfo here (ipc_test.cpp: 11.3 s against 16.6 s); for line-level profiles and
# debuggers pass CMAKE_FLAGS=-DCMAKE_BUILD_TYPE=RelWithDebInfo (and another BUILD).
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release

.PHONY: all deps deps-bench configure build build-cli build-bench test test-fast check-sanitizers demo bench bench-quick fuzz test-all bench-smoke format clean

all: build

deps:
	@bash scripts/install-deps.sh

deps-bench:
	@bash scripts/install-deps.sh --bench

configure: deps
	@cmake -S . -B $(BUILD) $(CMAKE_FLAGS) > $(BUILD).configure.log 2>&1 || (cat $(BUILD).configure.log; exit 1)

# The default target: the library, the CLI, the examples and the tests (not the benchmarks).
build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# What `make demo` needs: the library and the CLI (torchpar train), and the Python package
# (`import torchpar` with PYTHONPATH=build/python) where it is built.
build-cli: configure
	@cmake --build $(BUILD) -j $(JOBS) --target torchpar_cli \
	  $$(cmake --build $(BUILD) --target help | grep -q torchpar_python && echo torchpar_python)

# The benchmark programs (the CMake target `benchmarks`), built only by the bench targets.
build-bench: configure
	@cmake --build $(BUILD) -j $(JOBS) --target benchmarks

# Tests run side by side, one more at a time than there are cores: many of them wait on
# timeouts, sockets and child processes more than they compute (tests/CMakeLists.txt says which
# take two slots and which run alone).
TEST_JOBS ?= $(shell echo $$(( $$(nproc) + 1 )))

# What CI runs: every test but the fuzzer, the benchmark smoke runs and the over-2-GiB
# messages, that is the labels `fast` (the iteration set), `fault` (processes killed or
# stopped on purpose), `slow` (torchpar train and infer end to end) and `integration`
# (scripts, the installed package).
test: build
	@cd $(BUILD) && ctest -j $(TEST_JOBS) -LE 'fuzz|bench_smoke|big' --output-on-failure --timeout 900

# The iteration set while developing (CTest label `fast`): builds only the programs it runs
# (the CMake target `fast_tests`).
test-fast: configure
	@cmake --build $(BUILD) -j $(JOBS) --target fast_tests
	@cd $(BUILD) && ctest -j $(TEST_JOBS) -L fast --output-on-failure --timeout 600

# ASan+UBSan build running the fast set, then a ThreadSanitizer build running the ipc, pool
# and dist suites; each in its own tree (build-asan, build-tsan). Suppressions, each with its
# reason: tests/sanitizers/*.supp.
check-sanitizers: deps
	@bash tests/sanitizers/run.sh

# The main job: ddp training on Fashion-MNIST with the defaults (one epoch, every core).
demo: build-cli
	@$(BUILD)/bin/torchpar info
	@$(BUILD)/bin/torchpar train

# libFuzzer on loads, manager requests and RPC messages, 60 s each (gcc with ASan+UBSan; builds its own tree).
fuzz: build
	@cd $(BUILD) && ctest -L fuzz --output-on-failure

# Everything: fast, multiproc, fuzz, bench smoke.
test-all: build build-bench
	@cd $(BUILD) && ctest --output-on-failure --timeout 1800

# Every benchmark beside its peers (OpenMPI installed by deps-bench): bench/results/<date>/.
bench: deps-bench build-bench
	@$(BUILD)/bin/torchpar bench

bench-quick: deps-bench build-bench
	@$(BUILD)/bin/torchpar bench --quick

bench-smoke: build build-bench
	@cd $(BUILD) && ctest -L bench_smoke --output-on-failure

format:
	@find include src tests tools bench examples python -name '*.h' -o -name '*.cpp' | xargs clang-format -i

clean:
	@rm -rf $(BUILD) $(BUILD).configure.log build-asan build-tsan build-asan.configure.log build-tsan.configure.log
