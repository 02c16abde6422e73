#!/usr/bin/env bash
# The hierarchical backend across two "hosts": two network namespaces joined by a veth pair
# (the rendezvous's host key includes the network namespace, so each namespace is a host).
#   1. 2 + 2 ranks started by `torchpar run --nnodes 2` on each "host": every collective
#      against local results and against flat Gloo (hierarchical_rank check).
#   2. 2 + 1 ranks (hosts of different sizes): the same checks.
#   3. 2 + 2, a non-leader on host B SIGKILLed mid-all_reduce: every other rank, on both hosts,
#      raises RankLostError naming it within the group timeout.
#   4. The same with host B's leader.
# usage: hierarchical_test.sh BIN_DIR. Exits 77 (skipped) where the kernel or our rights
# refuse network namespaces.
set -u
BIN=$1
OUT=$(mktemp -d /tmp/tph_out.XXXXXX)
. "$(dirname "$0")/two_hosts.sh"
cleanup() {
  two_hosts_down
  rm -rf "$OUT"
}
trap cleanup EXIT
two_hosts_up hr 10.213.8
A=$HOST_A
B=$HOST_B
set +e
# One fresh job key for every rank, in the environment (never on a command line).
export TORCHPAR_AUTHKEY
TORCHPAR_AUTHKEY=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')

fail() {
  echo "FAILED: $*"
  for f in "$OUT"/*.out; do
    [ -e "$f" ] && { echo "--- $(basename "$f")"; cat "$f"; }
  done
  exit 1
}

# rank NS RANK WORLD PORT ARGS...: one rank in the background, its output in $OUT/rRANK.out
rank() {
  local ns=$1 r=$2 world=$3 port=$4
  shift 4
  ip netns exec "$ns" env RANK="$r" WORLD_SIZE="$world" MASTER_ADDR=$ADDR_A MASTER_PORT="$port" \
    timeout 240 "$BIN/hierarchical_rank" "$@" >"$OUT/r$r.out" 2>&1 &
  PIDS+=($!)
}

# 0. `torchpar info` names what Backend::kAuto picks for a job's shape (options, or the
#    environment `torchpar run` sets).
"$BIN/torchpar" info --nnodes 2 --nproc-per-node 2 | grep -q "2 node(s) x 2 rank(s): hierarchical" ||
  fail "torchpar info --nnodes 2 --nproc-per-node 2 does not say hierarchical"
"$BIN/torchpar" info --nnodes 2 --nproc-per-node 1 | grep -q ": gloo" ||
  fail "torchpar info --nnodes 2 --nproc-per-node 1 does not say gloo"
WORLD_SIZE=4 LOCAL_WORLD_SIZE=4 "$BIN/torchpar" info | grep -q "1 node(s) x 4 rank(s): shm" ||
  fail "torchpar info under WORLD_SIZE=LOCAL_WORLD_SIZE=4 does not say shm"
echo "PASSED: torchpar info names the backend auto picks"

# 1. 2 + 2 through the launcher, as a multi-node job is started.
rm -f "$OUT"/*.out
ip netns exec "$A" timeout 300 "$BIN/torchpar" run --nnodes 2 --node-rank 0 \
  --master-addr $ADDR_A --master-port 29581 -n 2 -- "$BIN/hierarchical_rank" check \
  >"$OUT/node0.out" 2>&1 &
n0=$!
ip netns exec "$B" timeout 300 "$BIN/torchpar" run --nnodes 2 --node-rank 1 \
  --master-addr $ADDR_A --master-port 29581 -n 2 -- "$BIN/hierarchical_rank" check \
  >"$OUT/node1.out" 2>&1 &
n1=$!
wait $n0 || fail "2 + 2 check: node 0 exited $?"
wait $n1 || fail "2 + 2 check: node 1 exited $?"
passed=$(cat "$OUT/node0.out" "$OUT/node1.out" | grep -c "hierarchical check passed")
[ "$passed" -eq 4 ] || fail "2 + 2 check: $passed of 4 ranks passed"
echo "PASSED: 2 + 2 ranks, every collective equal to local results and to flat gloo"

# 2. 2 + 1: hosts of different sizes (padded host blocks, a host without a shm level).
rm -f "$OUT"/*.out
PIDS=()
rank "$A" 0 3 29582 check
rank "$A" 1 3 29582 check
rank "$B" 2 3 29582 check
for i in 0 1 2; do wait "${PIDS[$i]}" || fail "2 + 1 check: rank $i exited $?"; done
passed=$(cat "$OUT"/r*.out | grep -c "hierarchical check passed")
[ "$passed" -eq 3 ] || fail "2 + 1 check: $passed of 3 ranks passed"
echo "PASSED: 2 + 1 ranks"

# 3, 4: a rank on host B killed; everyone else names it within the timeout.
for victim in 3 2; do
  rm -f "$OUT"/*.out
  PIDS=()
  rank "$A" 0 4 $((29583 + victim)) kill $victim
  rank "$A" 1 4 $((29583 + victim)) kill $victim
  rank "$B" 2 4 $((29583 + victim)) kill $victim
  rank "$B" 3 4 $((29583 + victim)) kill $victim
  for i in 0 1 2 3; do
    wait "${PIDS[$i]}"
    code=$?
    if [ "$i" -eq "$victim" ]; then
      [ $code -eq 137 ] || fail "kill $victim: the victim exited $code, not by SIGKILL"
    else
      [ $code -eq 0 ] || fail "kill $victim: rank $i exited $code"
      grep -q "lost $victim after" "$OUT/r$i.out" || fail "kill $victim: rank $i did not name it"
      # Leaving is prompt: rank 0 does not wait (10 s) for the rank its group found lost.
      secs=$(sed -n 's/.*left the world in \([0-9.]*\) s.*/\1/p' "$OUT/r$i.out")
      [ -n "$secs" ] && awk -v s="$secs" 'BEGIN { exit !(s < 5) }' ||
        fail "kill $victim: rank $i left the world in '${secs:-?}' s (not under 5 s)"
    fi
  done
  cat "$OUT"/r*.out
  echo "PASSED: rank $victim killed on host B; every other rank named it within the timeout"
done
exit 0
