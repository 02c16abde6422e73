#!/usr/bin/env bash
# `torchpar train` under a launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
# as torchrun and `torchpar run` set them), on one host and without namespaces: what cannot
# run as one rank of a job is refused with exit 2 and a message naming the variables, before
# anything is trained or written; so are (without a launcher) a data set smaller than the
# trainers and options that are NaN, infinite or out of range; then a 1-rank job (RANK=0
# WORLD_SIZE=1) trains a slice and writes its outputs as rank 0.
# usage: train_env_test.sh BIN_DIR
set -u
BIN=$1
TMP=$(mktemp -d /tmp/torchpar_train_env.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
failures=0
n=0

# refused WANT ENV... -- ARGS...: `env ENV... torchpar train --limit $LIMIT ARGS...` (LIMIT:
# 600) exits $CODE (2; CLI11 exits 105 for an option its check refuses) within 30 s, its
# stderr holds WANT, and it neither prints on stdout nor creates --out.
refused() {
  local want=$1
  shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  n=$((n + 1))
  local out="$TMP/out$n"
  # -u: nothing of the caller's own launcher environment leaks in. OMP_WAIT_POLICY saves
  # each refusal the re-exec of tools/torchpar/main.cpp; the 1-rank job below takes it.
  env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT OMP_WAIT_POLICY=passive "${envs[@]}" \
    timeout 30 "$BIN/torchpar" train --limit "${LIMIT:-600}" --out "$out" "$@" >"$TMP/so" 2>"$TMP/se"
  local code=$?
  local what="${envs[*]} train --limit ${LIMIT:-600} $*"
  if [ $code -eq "${CODE:-2}" ] && grep -q -- "$want" "$TMP/se" && [ ! -s "$TMP/so" ] && [ ! -e "$out" ]; then
    echo "ok   $what: exit $code: $(head -c 200 "$TMP/se")"
  else
    echo "FAIL $what: exit $code (want ${CODE:-2}), stderr: $(head -c 300 "$TMP/se"), stdout: $(head -c 200 "$TMP/so"), --out created: $([ -e "$out" ] && echo yes || echo no)"
    failures=$((failures + 1))
  fi
}

MASTER=(MASTER_ADDR=127.0.0.1 MASTER_PORT=29599)
refused "WORLD_SIZE is not" RANK=0 -- --strategy ddp
refused "RANK is not" WORLD_SIZE=2 -- --strategy ddp
refused "whole numbers" RANK=zero WORLD_SIZE=2 "${MASTER[@]}" -- --strategy ddp
refused "whole numbers" RANK=0 WORLD_SIZE=2x "${MASTER[@]}" -- --strategy ddp
refused "0 <= RANK < WORLD_SIZE" RANK=2 WORLD_SIZE=2 "${MASTER[@]}" -- --strategy ddp
refused "MASTER_ADDR and MASTER_PORT" RANK=0 WORLD_SIZE=2 -- --strategy ddp
refused "RANK and WORLD_SIZE are set" RANK=0 WORLD_SIZE=2 "${MASTER[@]}" -- --strategy hogwild
refused "RANK and WORLD_SIZE are set" RANK=1 WORLD_SIZE=2 "${MASTER[@]}" -- --strategy single
refused "RANK and WORLD_SIZE are set" RANK=0 WORLD_SIZE=2 "${MASTER[@]}" -- --strategy pserver
refused "RANK and WORLD_SIZE are set" RANK=0 WORLD_SIZE=2 "${MASTER[@]}" -- --model gpt \
  --strategy single
refused "does not match WORLD_SIZE=2" RANK=0 WORLD_SIZE=2 "${MASTER[@]}" -- --strategy ddp \
  --workers 3

# Fewer training samples than trainers: some trainer would get none, and the run waited for
# its first report until --timeout (120 s), then blamed "no word from any worker".
LIMIT=1 refused "every trainer needs at least one" -- --strategy ddp --workers 2
LIMIT=1 refused "every trainer needs at least one" -- --strategy hogwild --workers 2
LIMIT=2 refused "every trainer needs at least one" -- --strategy pserver --workers 4
LIMIT=1 refused "every trainer needs at least one" RANK=0 WORLD_SIZE=2 "${MASTER[@]}" -- \
  --strategy ddp
# NaN passed CLI::PositiveNumber; --timeout 1e10 overflowed the deadlines; --seed saturated.
for bad in "--lr nan" "--lr inf" "--momentum nan" "--timeout nan" "--timeout 1e10" \
           "--seed 99999999999999999999"; do
  # shellcheck disable=SC2086
  CODE=105 refused "${bad%% *}: ${bad#* }" -- $bad
done

# A job of one rank: this process is rank 0 (no workers spawned), trains and writes.
# The key as `torchpar run` would give it (in the environment, never on a command line).
TORCHPAR_AUTHKEY=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
export TORCHPAR_AUTHKEY
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
env -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u OMP_WAIT_POLICY RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
  timeout 120 "$BIN/torchpar" train --strategy ddp --limit 2000 --timeout 30 --out "$TMP/one" \
  >"$TMP/so" 2>"$TMP/se"
code=$?
if [ $code -eq 0 ] && grep -q "1 rank (RANK/WORLD_SIZE from the environment" "$TMP/so" &&
   grep -q "done: test accuracy" "$TMP/so" &&
   python3 -c 'import json, sys; m = json.load(open(sys.argv[1]));
sys.exit(0 if m["launch"] == "environment" and m["workers"] == 1 and m["status"] == "completed" else 1)' \
     "$TMP/one/metrics.json"; then
  echo "ok   RANK=0 WORLD_SIZE=1: trains as the only rank and writes metrics.json"
else
  echo "FAIL RANK=0 WORLD_SIZE=1: exit $code; stdout: $(tail -c 300 "$TMP/so"); stderr: $(tail -c 300 "$TMP/se")"
  failures=$((failures + 1))
fi

if [ $failures -ne 0 ]; then
  echo "FAILED: torchpar train under a launcher's environment ($failures check(s))"
  exit 1
fi
echo "PASSED: torchpar train under a launcher's environment"
