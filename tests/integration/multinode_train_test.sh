#!/usr/bin/env bash
# Multi-node `torchpar train`: two "hosts" (network namespaces joined by a veth pair), two ranks
# each, every node started by `torchpar run --nnodes 2 --node-rank K` with the same fresh
# TORCHPAR_AUTHKEY in its environment. One epoch of ddp on a slice of Fashion-MNIST must reach
# the test accuracy of the same configuration on one host (`torchpar train --workers 4`,
# spawning its own workers: the same 4 shards, seeds and learning rate) within 2 points, and
# only rank 0 may print or write outputs.
# usage: multinode_train_test.sh BIN_DIR. Exits 77 (skipped) where the kernel or our rights
# refuse network namespaces.
set -u
BIN=$1
DATA=/usr/share/datasets/fashion-mnist
PORT=29591
TMP=$(mktemp -d /tmp/torchpar_multinode_train.XXXXXX)
. "$(dirname "$0")/two_hosts.sh"
cleanup() {
  two_hosts_down
  rm -rf "$TMP"
}
trap cleanup EXIT
two_hosts_up mn 10.213.9
A=$HOST_A
B=$HOST_B
IP_A=$ADDR_A
IP_B=$ADDR_B
set +e

failures=0
check() {  # check CONDITION-EXIT-CODE WHAT
  if [ "$1" -eq 0 ]; then echo "ok   $2"; else echo "FAIL $2"; failures=$((failures + 1)); fi
}

# The slice: 16,000 training samples, 4,000 a rank; about 10 s of training on 2 cores.
# --timeout bounds the rendezvous and every collective: a broken link fails, never hangs.
TRAIN=(--strategy ddp --epochs 1 --limit 16000 --batch-size 32 --lr 0.03 --seed 1
       --data "$DATA" --timeout 60 --no-plot)

# Both nodes' launchers get one fresh key in their environment (inherited through ip and
# env), never on a command line; rank 0's store, in A, listens on A's veth address only.
key=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
start=$(date +%s)
TORCHPAR_AUTHKEY=$key ip netns exec "$A" timeout 180 "$BIN/torchpar" run --nnodes 2 \
  --node-rank 0 --master-addr $IP_A --master-port $PORT -n 2 -- \
  "$BIN/torchpar" train "${TRAIN[@]}" --out "$TMP/a/out" >"$TMP/a.out" 2>"$TMP/a.err" &
pa=$!
TORCHPAR_AUTHKEY=$key ip netns exec "$B" timeout 180 "$BIN/torchpar" run --nnodes 2 \
  --node-rank 1 --master-addr $IP_A --master-port $PORT -n 2 -- \
  "$BIN/torchpar" train "${TRAIN[@]}" --out "$TMP/b/out" >"$TMP/b.out" 2>"$TMP/b.err" &
pb=$!
wait $pa; ca=$?
wait $pb; cb=$?
took=$(( $(date +%s) - start ))
for f in a.out a.err b.out b.err; do
  echo "---- node ${f%%.*} std${f#*.}"
  cat "$TMP/$f"
done
check $(( ca != 0 || cb != 0 )) "multi-node run: both launchers exit 0 (got $ca, $cb) in $took s"

# Only rank 0 reports and writes: its launcher prefixes its lines "[0]: "; ranks 1 (node A),
# 2 and 3 (node B) print nothing on stdout (stderr is for errors, and a library's warnings),
# and node B's --out is never created.
grep -q '^\[0\]: done: test accuracy' "$TMP/a.out"
check $? "rank 0 prints the summary"
! grep -q '^\[[123]\]: ' "$TMP/a.out" "$TMP/b.out"
check $? "ranks 1, 2 and 3 print nothing on stdout"
[ -s "$TMP/a/out/metrics.json" ] && [ -s "$TMP/a/out/model.pt" ]
check $? "rank 0 wrote metrics.json and model.pt"
[ ! -e "$TMP/b/out" ]
check $? "node B's ranks wrote nothing (no $TMP/b/out)"

# The same configuration on one host: 4 spawned ddp workers (the same shards and seeds).
"$BIN/torchpar" train "${TRAIN[@]}" --workers 4 --out "$TMP/single" >"$TMP/single.out" 2>&1
cs=$?
tail -n 2 "$TMP/single.out"
check $cs "single-host run (--workers 4): exit $cs"

python3 - "$TMP/a/out/metrics.json" "$TMP/single/metrics.json" <<'EOF'
import json, sys
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"FAIL cannot read {path}: {e}")
        sys.exit(1)
multi, single = load(sys.argv[1]), load(sys.argv[2])
ok = True
def check(cond, what):
    global ok
    print(("ok   " if cond else "FAIL ") + what)
    ok = ok and cond
check(multi.get("status") == "completed" and multi.get("workers") == 4
      and multi.get("launch") == "environment",
      f"multi-node metrics.json: completed, 4 ranks from the environment "
      f"(status {multi.get('status')}, workers {multi.get('workers')}, launch {multi.get('launch')})")
a = multi["epochs"][0]["test_accuracy"] if multi.get("epochs") else float("nan")
b = single["epochs"][0]["test_accuracy"] if single.get("epochs") else float("nan")
check(a > 50, f"multi-node accuracy {a:.2f}% is well above chance (10%)")
check(abs(a - b) <= 2, f"multi-node accuracy {a:.2f}% within 2 points of the single-host "
                       f"{b:.2f}% ({a - b:+.2f})")
sys.exit(0 if ok else 1)
EOF
check $? "accuracy and metrics"

if [ $failures -ne 0 ]; then
  echo "FAILED: multi-node torchpar train ($failures check(s))"
  exit 1
fi
echo "PASSED: multi-node torchpar train across two network namespaces"
