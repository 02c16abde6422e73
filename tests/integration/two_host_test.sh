#!/usr/bin/env bash
# Two "hosts": a 2-rank gloo all_reduce, then 2-rank RPC (our TCP transport: the host
# identity in each member's address names its network namespace, so neither chooses
# TensorPipe's shm), between two network namespaces joined by a veth pair.
# usage: two_host_test.sh BIN_DIR. Exits 77 (skipped) where the kernel or our rights refuse
# network namespaces.
set -u
BIN=$1
. "$(dirname "$0")/two_hosts.sh"
trap two_hosts_down EXIT
two_hosts_up th 10.213.7
A=$HOST_A
B=$HOST_B
set +e
# run_pair WHAT PORT "WANT0" "WANT1" PROGRAM ARGS...: rank 0 in A, rank 1 in B (each with its
# namespace's address as TORCHPAR_RPC_ADDR, where RPC listeners bind); both must exit 0 and
# print their WANT line. Both get one fresh job key, as a multi-node job's launchers must be
# given the same TORCHPAR_AUTHKEY (RPC refuses to start without one).
run_pair() {
  local what=$1 port=$2 want0=$3 want1=$4
  shift 4
  local key
  key=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
  local common=(WORLD_SIZE=2 MASTER_ADDR=10.213.7.1 MASTER_PORT=$port LOCAL_WORLD_SIZE=1 LOCAL_RANK=0)
  # The key goes in the environment (inherited through ip and env), never on a command line.
  TORCHPAR_AUTHKEY=$key ip netns exec "$A" env "${common[@]}" RANK=0 TORCHPAR_RPC_ADDR=10.213.7.1 timeout 120 "$@" >/tmp/tp_rank0.$$ 2>&1 &
  local p0=$!
  TORCHPAR_AUTHKEY=$key ip netns exec "$B" env "${common[@]}" RANK=1 TORCHPAR_RPC_ADDR=10.213.7.2 timeout 120 "$@" >/tmp/tp_rank1.$$ 2>&1 &
  local p1=$!
  wait $p0; local c0=$?
  wait $p1; local c1=$?
  cat /tmp/tp_rank0.$$ /tmp/tp_rank1.$$
  local ok=0
  grep -q "$want0" /tmp/tp_rank0.$$ || ok=1
  grep -q "$want1" /tmp/tp_rank1.$$ || ok=1
  rm -f /tmp/tp_rank0.$$ /tmp/tp_rank1.$$
  if [ $c0 -ne 0 ] || [ $c1 -ne 0 ] || [ $ok -ne 0 ]; then
    echo "FAILED ($what): exit codes $c0 $c1, expected output found: $([ $ok -eq 0 ] && echo yes || echo no)"
    exit 1
  fi
  echo "PASSED: $what across two network namespaces"
}
run_pair all_reduce 29577 "rank 0 of 2 (gloo): all_reduce sum = 3" \
  "rank 1 of 2 (gloo): all_reduce sum = 3" "$BIN/example_all_reduce" --backend gloo
# RPC: our TCP transport (shm is only chosen within one host and network namespace).
run_pair rpc 29578 "rank 0 (rank0): add on rank1 = 40, norm = 3, hello rank0 from rank1, remote = 2" \
  "rank 1 (rank1): add on rank0 = 41, norm = 3, hello rank1 from rank0, remote = 2" "$BIN/example_rpc"
