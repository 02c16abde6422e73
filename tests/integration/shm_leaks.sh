# Sourced by integration tests that must leave no shared memory behind, beside other tests.
#
#   leaked                 prints the torchpar names in /dev/shm whose creator
#                          (torchpar_<pid>_...) is dead: other tests may hold live names
#   no_shm_leak [SECONDS]  waits (default 10 s) for the cleaners; 0 when nothing leaked
leaked() {
  local f p
  for f in /dev/shm/torchpar_*; do
    [ -e "$f" ] || continue
    p=${f#/dev/shm/torchpar_}
    p=${p%%_*}
    kill -0 "$p" 2>/dev/null || echo "$f"
  done
}

no_shm_leak() {
  local i
  for ((i = 0; i < ${1:-10} * 10; i++)); do
    [ -z "$(leaked)" ] && return 0
    sleep 0.1
  done
  [ -z "$(leaked)" ]
}
