#!/usr/bin/env bash
# Elastic `torchpar run` on one host: two agents (two "nodes" of one rank each, on loopback)
# running tests/integration/elastic_rank.py (torch.distributed gloo ranks), and the faults:
#   1. a rank SIGKILLed: the job restarts once (both nodes) and finishes; a stranger agent
#      without the job's key is refused meanwhile and changes nothing;
#   2. a rank SIGSTOPped: the peer's collective times out, the job restarts and finishes;
#   3. no restart left: both agents exit with the killed rank's code, naming it;
#   4. a node lost (its agent SIGKILLed) under --nnodes 1:2: the survivor goes on alone (one
#      restart used); the node comes back, waits, and the job grows to two nodes again;
#   5. the rendezvous endpoint's node lost: the other agent stops with a clear error;
#   6. a node's agent SIGSTOPped: its heartbeat stands still, the job goes on without it;
#   7. MIN never met: the join timeout ends the agent with exit code 1.
# After each: no rank or agent left. usage: elastic_test.sh BIN_DIR [CASE...] (default: all)
set -u
BIN=$1
shift
CASES=" ${*:-1 2 3 4 5 6 7} "
want() { [[ $CASES == *" $1 "* ]]; }
RANK_PY=$(dirname "$0")/elastic_rank.py
TMP=$(mktemp -d /tmp/torchpar_elastic.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
  pkill -9 -f "$TMP" 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT
set +e
failures=0
check() {  # check STATUS WHAT: STATUS 0 passes
  if [ "$1" -eq 0 ]; then echo "ok   $2"; else echo "FAIL $2"; failures=$((failures + 1)); fi
}
wait_file() {  # wait_file PATH SECONDS
  local i
  for ((i = 0; i < $2 * 10; i++)); do [ -s "$1" ] && return 0; sleep 0.1; done
  return 1
}
no_leftovers() {  # no_leftovers WHAT: no process of this case's directory remains
  local i
  for ((i = 0; i < 50; i++)); do pgrep -f "$1" >/dev/null || return 0; sleep 0.1; done
  pgrep -af "$1"
  return 1
}
export TORCHPAR_AUTHKEY=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
export ELASTIC_TEST_TIMEOUT=5
# agent NAME PORT ARGS... -- RANK_ARGS...: starts one agent in the background (its output in
# $TMP/NAME.log; its job id NAME without the last letter); sets LAST_PID.
agent() {
  local name=$1 port=$2
  shift 2
  timeout 100 "$BIN/torchpar" run --rdzv-endpoint 127.0.0.1:$port --rdzv-id "${name%?}" \
    --monitor-interval 0.2 --heartbeat-timeout 3 --grace 2 -n 1 "$@" \
    >"$TMP/$name.log" 2>&1 &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}
hosting() {  # hosting PORT: waits until the case's first agent listens there (it hosts the store:
  # the test loses the others, and a stranger must not get there first)
  local i
  for ((i = 0; i < 100; i++)); do ss -ltn "sport = :$1" | grep -q LISTEN && return 0; sleep 0.1; done
  return 1
}
agent_pid() {  # agent_pid TIMEOUT_PID: the agent (timeout's child)
  pgrep -P "$1" | head -1
}

if want 1; then
# ---- 1. a rank SIGKILLed, a stranger refused
d=$TMP/c1 && mkdir -p "$d"
agent c1a 29631 --nnodes 2 --max-restarts 1 -- "$RANK_PY" "$d" 30 0.1; a=$LAST_PID
hosting 29631
agent c1b 29631 --nnodes 2 --max-restarts 1 -- "$RANK_PY" "$d" 30 0.1; b=$LAST_PID
# The stranger: the same endpoint and job, another key.
TORCHPAR_AUTHKEY=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n') timeout 30 "$BIN/torchpar" run \
  --rdzv-endpoint 127.0.0.1:29631 --rdzv-id c1 --rdzv-join-timeout 5 -n 1 --nnodes 2 -- \
  "$RANK_PY" "$d" 30 0.1 >"$TMP/stranger.log" 2>&1
sc=$?
wait_file "$d/pid.1.0" 30 && sleep 1 && kill -9 "$(cat "$d/pid.1.0")"
wait $a; ca=$?
wait $b; cb=$?
cat "$TMP/c1a.log" "$TMP/c1b.log"
check $(( ca != 0 || cb != 0 )) "rank SIGKILLed: both agents exit 0 after one restart (got $ca, $cb)"
grep -q "restart 1 of 1" "$TMP/c1a.log" && grep -q "restart 1 of 1" "$TMP/c1b.log"
check $? "both agents report restart 1 of 1"
[ "$(cat "$TMP/c1a.log" "$TMP/c1b.log" | grep -c 'done: restart 1')" = 2 ]
check $? "both ranks of the restarted round finish, with TORCHELASTIC_RESTART_COUNT=1"
grep -q "rank 1 (pid .*) on node .* was killed by signal 9" "$TMP/c1a.log" "$TMP/c1b.log"
check $? "the killed rank is named"
cat "$TMP/stranger.log"
[ $sc -ne 0 ] && grep -qi "key" "$TMP/stranger.log"
check $? "an agent without the job's key is refused (exit $sc) and says why"
no_leftovers "$d"; check $? "case 1: no process left"
fi

if want 2; then
# ---- 2. a rank SIGSTOPped: detected by the peer's collective timeout (5 s)
d=$TMP/c2 && mkdir -p "$d"
agent c2a 29632 --nnodes 2 --max-restarts 1 -- "$RANK_PY" "$d" 30 0.1; a=$LAST_PID
hosting 29632
agent c2b 29632 --nnodes 2 --max-restarts 1 -- "$RANK_PY" "$d" 30 0.1; b=$LAST_PID
wait_file "$d/pid.0.0" 30 && sleep 1 && kill -STOP "$(cat "$d/pid.0.0")"
t0=$(date +%s)
wait_file "$d/pid.0.1" 40
took=$(( $(date +%s) - t0 ))
wait $a; ca=$?
wait $b; cb=$?
cat "$TMP/c2a.log" "$TMP/c2b.log"
check $(( ca != 0 || cb != 0 )) "rank SIGSTOPped: both agents exit 0 after a restart (got $ca, $cb)"
[ $took -le 40 ]
check $? "the stopped rank's round ended and restarted within 40 s (5 s collective timeout, Python ranks starting at CI load) (took $took s)"
no_leftovers "$d"; check $? "case 2: no process left (the stopped rank was killed)"
fi

if want 3; then
# ---- 3. no restart left
d=$TMP/c3 && mkdir -p "$d"
agent c3a 29633 --nnodes 2 --max-restarts 0 -- "$RANK_PY" "$d" 100 0.1; a=$LAST_PID
hosting 29633
agent c3b 29633 --nnodes 2 --max-restarts 0 -- "$RANK_PY" "$d" 100 0.1; b=$LAST_PID
wait_file "$d/pid.1.0" 30 && sleep 1 && kill -9 "$(cat "$d/pid.1.0")"
wait $a; ca=$?
wait $b; cb=$?
cat "$TMP/c3a.log" "$TMP/c3b.log"
check $(( ca != 137 || cb != 137 )) "no restart left: both agents exit 137, the rank's code (got $ca, $cb)"
grep -q "rank 1 .* was killed by signal 9 (Killed); no restart left (0 of 0 used)" "$TMP/c3a.log" &&
  grep -q "no restart left" "$TMP/c3b.log"
check $? "both name the failing rank and say no restart is left"
no_leftovers "$d"; check $? "case 3: no process left"
fi

if want 4; then
# ---- 4. a node lost, the job shrinks; it comes back, the job grows
d=$TMP/c4 && mkdir -p "$d"
agent c4a 29634 --nnodes 1:2 --max-restarts 2 --rdzv-timeout 60 -- "$RANK_PY" "$d" 120 0.1; a=$LAST_PID
hosting 29634
agent c4b 29634 --nnodes 1:2 --max-restarts 2 --rdzv-timeout 60 -- "$RANK_PY" "$d" 120 0.1; b=$LAST_PID
wait_file "$d/pid.1.0" 30 && sleep 1
kill -9 "$(agent_pid $b)"
t0=$(date +%s)
wait_file "$d/pid.0.1" 30  # the survivor's rank of the next round (restart 1)
took=$(( $(date +%s) - t0 ))
# The survivor's own rank fails first (its peer died): the new round does not wait for the
# lost node past its heartbeat timeout (3 s), nor for the 60 s last call.
check $(( took > 30 )) "node lost: the survivor runs again within 30 s (took $took s)"
agent c4c 29634 --nnodes 1:2 --max-restarts 2 --rdzv-timeout 60 -- "$RANK_PY" "$d" 120 0.1; c=$LAST_PID
wait_file "$d/pid.1.1" 30
check $? "the node that came back runs rank 1 in a grown round (no restart used)"
wait $a; ca=$?
wait $c; cc=$?
cat "$TMP/c4a.log" "$TMP/c4c.log"
check $(( ca != 0 || cc != 0 )) "the job finishes on both nodes (got $ca, $cc)"
grep -q "round 0 ended: .*restart 1 of 2" "$TMP/c4a.log"
check $? "the survivor ends the round (the lost node, or its own rank the loss failed) with a restart"
grep -q "waits to join the next round" "$TMP/c4c.log"
check $? "the joining node is told it waits"
cat "$TMP/c4a.log" "$TMP/c4c.log" | grep -q "rank [01] of 2 done: restart 1"
check $? "the last round has world size 2 and one restart used"
no_leftovers "$d"; check $? "case 4: no process left"
fi

if want 5; then
# ---- 5. the rendezvous endpoint's node lost
d=$TMP/c5 && mkdir -p "$d"
agent c5a 29635 --nnodes 2 --max-restarts 2 -- "$RANK_PY" "$d" 200 0.1; a=$LAST_PID
hosting 29635
agent c5b 29635 --nnodes 2 --max-restarts 2 -- "$RANK_PY" "$d" 200 0.1; b=$LAST_PID
wait_file "$d/pid.1.0" 30 && sleep 1
kill -9 "$(agent_pid $a)"
t0=$(date +%s)
wait $b; cb=$?
took=$(( $(date +%s) - t0 ))
cat "$TMP/c5b.log"
check $(( cb != 1 )) "endpoint lost: the other agent exits 1 (got $cb) in $took s"
grep -q "rendezvous store" "$TMP/c5b.log"
check $? "and names the rendezvous store"
no_leftovers "$d"; check $? "case 5: no process left"
fi

if want 6; then
# ---- 6. a node's agent SIGSTOPped (its ranks run on): lost by its heartbeat
d=$TMP/c6 && mkdir -p "$d"
agent c6a 29636 --nnodes 1:2 --max-restarts 1 --rdzv-timeout 10 -- "$RANK_PY" "$d" 120 0.1; a=$LAST_PID
hosting 29636
agent c6b 29636 --nnodes 1:2 --max-restarts 1 --rdzv-timeout 10 -- "$RANK_PY" "$d" 120 0.1; b=$LAST_PID
wait_file "$d/pid.1.0" 30 && sleep 1
kill -STOP "$(agent_pid $b)"
t0=$(date +%s)
wait_file "$d/pid.0.1" 30
took=$(( $(date +%s) - t0 ))
check $(( took > 30 )) "agent stopped: the other node runs alone again within 30 s (took $took s)"
grep -q "node [01] (.*) lost: no heartbeat for 3 s" "$TMP/c6a.log"
check $? "the stopped node is named, lost by its heartbeat"
kill -CONT "$(agent_pid $b)"
wait $b; cb=$?
wait $a; ca=$?
cat "$TMP/c6a.log" "$TMP/c6b.log"
check $(( ca != 0 || cb != 1 )) "the job finishes on the survivor (exit $ca); the resumed node leaves with 1 (got $cb)"
grep -q "lost this node's heartbeat" "$TMP/c6b.log"
check $? "the resumed node says why it leaves"
no_leftovers "$d"; check $? "case 6: no process left"
fi

if want 7; then
# ---- 7. MIN never met: the join timeout ends the agent (exit 1), naming the shortfall
d=$TMP/c7 && mkdir -p "$d"
t0=$(date +%s)
agent c7a 29637 --nnodes 2 --rdzv-join-timeout 3 -- "$RANK_PY" "$d" 1 0; a=$LAST_PID
wait $a; ca=$?
took=$(( $(date +%s) - t0 ))
cat "$TMP/c7a.log"
check $(( ca != 1 || took > 20 )) "MIN never met: exit 1 after the 3 s join timeout (got $ca in $took s)"
grep -q "1 of at least 2 node(s) joined within 3 s (--rdzv-join-timeout); giving up" "$TMP/c7a.log"
check $? "and says how many joined"
no_leftovers "$d"; check $? "case 7: no process left"
fi

. "$(dirname "$0")/shm_leaks.sh"
no_shm_leak
check $? "no torchpar segment of a dead process left $(leaked | tr '\n' ' ')"
echo "$failures failure(s)"
[ $failures -eq 0 ]
