#!/usr/bin/env bash
# `torchpar run` ends the whole tree: the ranks' own children (here a `sleep` each rank
# starts in the background) are gone after the launcher is killed with SIGKILL or SIGTERM.
# Before, only the ranks died (PDEATHSIG) and their children ran on as orphans.
# usage: run_tree_test.sh BIN_DIR
set -u
BIN=$1
tag="torchpar_tree_$$"
out=$(mktemp)
cleanup() { pkill -f "sleep 1000 $tag" 2>/dev/null; rm -f "$out"; }
trap cleanup EXIT
fail() { echo "FAILED: $*"; cat "$out"; exit 1; }
# A rank: starts a grandchild that would outlive it, reports it, waits.
rank_prog=(/bin/bash -c "exec -a \"sleep 1000 $tag\" sleep 1000 & echo \"grandchild \$!\"; wait" rank)

for sig in KILL TERM; do
  : >"$out"
  "$BIN/torchpar" run --grace 2 -n 2 -- "${rank_prog[@]}" >"$out" 2>&1 &
  launcher=$!
  for _ in $(seq 1 300); do
    [ "$(grep -c grandchild "$out")" -ge 2 ] && break
    sleep 0.1
  done
  [ "$(grep -c grandchild "$out")" -ge 2 ] || fail "ranks did not start their children"
  pids=$(sed -n 's/.*grandchild \([0-9]*\).*/\1/p' "$out")
  kill -$sig $launcher
  wait $launcher 2>/dev/null
  # The group's keeper sends SIGTERM, then SIGKILL after --grace (2 s).
  left=""
  for _ in $(seq 1 100); do
    left=""
    for p in $pids; do kill -0 "$p" 2>/dev/null && left="$left $p"; done
    [ -z "$left" ] && break
    sleep 0.1
  done
  [ -z "$left" ] || fail "SIG$sig of the launcher left the ranks' children running:$left"
  echo "ok: SIG$sig of the launcher ended the ranks' children ($pids)"
done
echo "run_tree_test: passed"
