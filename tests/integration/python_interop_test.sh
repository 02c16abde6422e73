#!/usr/bin/env bash
# A C++ torchpar rank and a Python torch.distributed rank (Debian's python3-torch, same
# LibTorch) in one gloo group: all_reduce and broadcast, with C++ as rank 0 and as rank 1.
# usage: python_interop_test.sh BIN_DIR. Exits 77 (skipped) without python3-torch.
set -u
BIN=$1
HERE=$(cd "$(dirname "$0")" && pwd)
if ! /usr/bin/python3 -c "import torch.distributed" 2>/dev/null; then
  echo "SKIPPED: /usr/bin/python3 has no torch.distributed (install python3-torch)"
  exit 77
fi
export GLOO_SOCKET_IFNAME=lo MASTER_ADDR=127.0.0.1 WORLD_SIZE=2
fail=0
for cpp_rank in 0 1; do
  py_rank=$((1 - cpp_rank))
  export MASTER_PORT=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  RANK=$cpp_rank timeout 120 "$BIN/example_all_reduce" --python-compatible >/tmp/tp_cpp.$$ 2>&1 &
  pc=$!
  RANK=$py_rank timeout 120 /usr/bin/python3 "$HERE/python_rank.py" >/tmp/tp_py.$$ 2>&1 &
  pp=$!
  wait $pc; cc=$?
  wait $pp; cp=$?
  cat /tmp/tp_cpp.$$ /tmp/tp_py.$$
  grep -q "all_reduce sum = 3" /tmp/tp_cpp.$$ && grep -q "all_reduce sum = 3" /tmp/tp_py.$$ &&
    grep -q "broadcast from rank 0 = 4" /tmp/tp_cpp.$$ && grep -q "broadcast from rank 0 = 4" /tmp/tp_py.$$
  found=$?
  if [ $cc -ne 0 ] || [ $cp -ne 0 ] || [ $found -ne 0 ]; then
    echo "FAILED with C++ as rank $cpp_rank: exit codes C++ $cc, Python $cp"
    fail=1
  else
    echo "PASSED with C++ as rank $cpp_rank"
  fi
  rm -f /tmp/tp_cpp.$$ /tmp/tp_py.$$
done
exit $fail
