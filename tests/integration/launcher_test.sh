#!/usr/bin/env bash
# `torchpar run`: 3 ranks all_reduce and print with rank prefixes; a rank exiting 3 makes the
# launcher exit 3 and stops the others; SIGINT is forwarded; killing the launcher with
# SIGKILL leaves no rank behind; the ranks get the job's key; a 50 MB line without a newline
# is forwarded in 64 KiB pieces with bounded launcher memory. usage: launcher_test.sh BIN_DIR
set -u
BIN=$1
fail() {
  echo "FAILED: $*"
  pkill -f "sleep 1000\.[0-9]" 2>/dev/null
  exit 1
}
# the ranks themselves (not the launcher, whose command line also names them)
count_ranks() { pgrep -fc "^sleep $1\$" || true; }
out=$(mktemp)
trap 'rm -f $out' EXIT

# 1. three ranks, prefixed output, exit 0
timeout 120 "$BIN/torchpar" run -n 3 -- "$BIN/example_all_reduce" >"$out" 2>&1
code=$?
cat "$out"
[ $code -eq 0 ] || fail "run -n 3 exited $code"
for r in 0 1 2; do
  grep -q "^\[$r\]: rank $r of 3 (shm): all_reduce sum = 6 (expected 6)" "$out" || fail "no line from rank $r"
done

# 2. rank 1 exits 3 before the all_reduce: the launcher exits 3, nobody is left
start=$(date +%s)
timeout 120 "$BIN/torchpar" run -n 3 -- "$BIN/example_all_reduce" --fail-rank 1 --exit-code 3 >"$out" 2>&1
code=$?
cat "$out"
[ $code -eq 3 ] || fail "a rank exiting 3 made the launcher exit $code"
grep -q "rank 1 (pid [0-9]*) exited with code 3" "$out" || fail "the launcher did not name rank 1"
[ $(( $(date +%s) - start )) -lt 60 ] || fail "stopping the others took too long"
sleep 0.2
pgrep -f "example_all_reduce --fail-rank" && fail "ranks left behind"

# 3. SIGINT to the launcher reaches every rank; exit code 130
"$BIN/torchpar" run -n 2 -- sleep 1000.25 >"$out" 2>&1 &
launcher=$!
for i in $(seq 100); do
  [ "$(count_ranks 1000.25)" -ge 2 ] && break
  sleep 0.1
done
[ "$(count_ranks 1000.25)" -ge 2 ] || fail "ranks did not start"
kill -INT $launcher
wait $launcher
code=$?
[ $code -eq 130 ] || fail "SIGINT: launcher exited $code, expected 130"
sleep 0.2
[ "$(count_ranks 1000.25)" -eq 0 ] || fail "SIGINT left ranks behind"

# 4. SIGKILL of the launcher: the ranks die with it (PDEATHSIG)
"$BIN/torchpar" run -n 2 -- sleep 1000.5 >/dev/null 2>&1 &
launcher=$!
for i in $(seq 100); do
  [ "$(count_ranks 1000.5)" -ge 2 ] && break
  sleep 0.1
done
kill -KILL $launcher
wait $launcher 2>/dev/null
for i in $(seq 20); do
  [ "$(count_ranks 1000.5)" -eq 0 ] && break
  sleep 0.1
done
[ "$(count_ranks 1000.5)" -eq 0 ] || fail "SIGKILL of the launcher left ranks behind"

# 5. bad use: no program
"$BIN/torchpar" run -n 2 >"$out" 2>&1 && fail "run without a program succeeded"
grep -q "program" "$out" || fail "no message naming the missing program"

# 6. the job's key: every rank of a one-node job gets the same fresh 32-byte TORCHPAR_AUTHKEY
# (64 hex digits), a new one per job; the caller's own key is passed on; a malformed one stops
# the launch (exit 2) without echoing it
job_key() {
  env -u TORCHPAR_AUTHKEY timeout 60 "$BIN/torchpar" run --no-prefix -n 2 -- printenv TORCHPAR_AUTHKEY
}
keys=$(job_key) || fail "run -n 2 -- printenv TORCHPAR_AUTHKEY failed"
[ "$(printf '%s\n' "$keys" | wc -l)" -eq 2 ] || fail "expected a key line from each of 2 ranks: $keys"
[ "$(printf '%s\n' "$keys" | sort -u | wc -l)" -eq 1 ] || fail "the ranks got different keys"
printf '%s\n' "$keys" | head -1 | grep -Eqx "[0-9a-f]{64}" || fail "the key is not 64 hex digits"
again=$(job_key | head -1)
[ "$again" != "$(printf '%s\n' "$keys" | head -1)" ] || fail "two jobs got the same key"
given=$(TORCHPAR_AUTHKEY=00ff10 timeout 60 "$BIN/torchpar" run --no-prefix -n 1 -- printenv TORCHPAR_AUTHKEY)
[ "$given" = "00ff10" ] || fail "the caller's TORCHPAR_AUTHKEY was not passed on (got '$given')"
TORCHPAR_AUTHKEY=notakey timeout 60 "$BIN/torchpar" run -n 1 -- true >"$out" 2>&1
code=$?
[ $code -eq 2 ] || fail "a malformed TORCHPAR_AUTHKEY made the launcher exit $code, expected 2"
grep -q "TORCHPAR_AUTHKEY" "$out" || fail "no message naming TORCHPAR_AUTHKEY: $(cat "$out")"
grep -q "notakey" "$out" && fail "the malformed key was echoed"
# 7. a rank writing 50 MB without a newline: the launcher forwards it in lines of at most
# 64 KiB, each with the rank's prefix, and its peak RSS stays near that of a job that prints
# nothing (before, it held the whole line, twice: +100 MB here, 598 MiB for a 300 MB line)
big=$(mktemp)
rss=$(mktemp)
trap 'rm -f $out $big $rss' EXIT
writer='head -c 50000000 /dev/zero | tr "\0" x'
timeout 120 /usr/bin/time -f %M -o "$rss" "$BIN/torchpar" run -n 1 -- true >/dev/null 2>&1 ||
  fail "run -n 1 -- true failed"
base_kb=$(tail -1 "$rss")
timeout 120 /usr/bin/time -f %M -o "$rss" "$BIN/torchpar" run -n 1 -- bash -c "$writer" >"$big" 2>&1 ||
  fail "run of a 50 MB line failed"
peak_kb=$(tail -1 "$rss")
echo "launcher peak RSS: ${base_kb} kB for an empty job, ${peak_kb} kB for a 50 MB line"
[ "$peak_kb" -le $((base_kb + 32768)) ] || fail "a 50 MB line took the launcher from ${base_kb} to ${peak_kb} kB"
[ "$(tr -cd x <"$big" | wc -c)" -eq 50000000 ] || fail "bytes of the 50 MB line were lost"
[ "$(grep -vc '^\[0\]: ' "$big")" -eq 0 ] || fail "a piece of the long line lacks the rank prefix"
longest=$(LC_ALL=C awk '{ if (length($0) > m) m = length($0) } END { print m }' "$big")
[ "$longest" -le $((65536 + 5)) ] || fail "an output line of $longest bytes: not split at 64 KiB"
# without a prefix the bytes pass unchanged (and the unterminated end gets its newline)
timeout 120 "$BIN/torchpar" run --no-prefix -n 1 -- bash -c "$writer" >"$big" 2>&1 ||
  fail "run --no-prefix of a 50 MB line failed"
[ "$(wc -c <"$big")" -eq 50000001 ] && [ "$(tr -d x <"$big" | wc -c)" -eq 1 ] ||
  fail "run --no-prefix changed the 50 MB line ($(wc -c <"$big") bytes)"

echo "PASSED: torchpar run"
