#!/usr/bin/env bash
# Installs exactly what torchpar needs from Debian's packages.
# Idempotent: when every package is already installed it returns at once.
set -euo pipefail

PACKAGES=(
  build-essential cmake make pkg-config git
  libtorch-dev            # LibTorch (ATen, c10d, torch::nn)
  libopenblas0-openmp     # the BLAS behind Debian's LibTorch (libblas.so.3): without it the
                          # netlib reference BLAS runs matmuls ~15x slower; the OpenMP build
                          # obeys torch::set_num_threads (pthread OpenBLAS would not)
  libcereal-dev           # serialization of C++ values
  libfmt-dev              # formatting
  libcli11-dev            # command-line parsing
  nlohmann-json3-dev      # JSON
  libcpp-httplib-dev      # torchpar serve's HTTP server (the one llama.cpp's server uses)
  curl                    # torchpar serve's tests and README example
  zlib1g-dev              # .gz data files
  libgtest-dev libgmock-dev googletest   # tests
  libbenchmark-dev        # benchmarks
  ccache                  # faster rebuilds
  clang-format            # CI's layout check (scripts/check_format.sh, make format)
  lld                     # the linker (cmake/Linker.cmake): ~8x less CPU than GNU ld per program
  libclang-rt-14-dev      # libFuzzer runtime for the fuzz label
  dataset-fashion-mnist   # the data set of the main job
  fortunes                # English text for the GPT of torchpar train --model gpt
  libssl-dev              # OpenSSL libcrypto: HMAC of the auth handshake
  libgloo-dev             # headers of the Gloo that LibTorch's c10d links
  libtensorpipe-dev       # TensorPipe: the RPC transport (src/rpc/transport/tensorpipe/)
  iproute2                # ip netns for the two-host tests, ss for the elastic tests
  procps                  # pgrep / pkill in the launcher and elastic tests
  python3-torch           # interop test (torch.distributed rank) and benchmark peers
  python3-matplotlib      # curves.png of torchpar train, benchmark plots
  pybind11-dev python3-dev   # the Python package (python/): pybind11 2.10, whose internals
                          # id matches libtorch_python's, so torch.Tensor crosses as at::Tensor
  python3-pytest          # the Python package's tests
  libpython3.11-testsuite # CPython's own multiprocessing tests, run against torchpar
)

# --bench: also the peers only the benchmarks compare against (OpenMPI).
if [ "${1:-}" = "--bench" ]; then
  PACKAGES+=(openmpi-bin libopenmpi-dev)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
