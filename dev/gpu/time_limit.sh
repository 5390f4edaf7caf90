# Sourced by dev/gpu/gpu_*.sh (not run on its own): `run LIMIT_S LOG command...` runs one piece
# with its output in LOG, for at most LIMIT_S seconds and never past the script's budget
# (BUDGET_S, counted on bash's SECONDS); it prints "rc N, T s: command" and returns N (124: the
# limit ended it; 99: skipped, no budget left).
# A piece still running at its limit gets SIGABRT in every Python process of its tree, deepest
# first, so that each prints its threads' Python stacks into LOG (PYTHONFAULTHANDLER=1, exported
# here) before it ends: where a stalled step waits. The tree is walked by parent PID, since
# torchrun's workers run under setsid, in process groups of their own (out of reach of
# `timeout`'s process-group signal). Three seconds later whatever is left gets SIGTERM, ten
# more and SIGKILL.
export PYTHONFAULTHANDLER=1

# The PIDs below $1 (children before their parents), then $1.
_tree_pids() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do _tree_pids "$child"; done
  echo "$1"
}

# _signal_tree PID SIGNAL [python]: SIGNAL to PID's tree (only Python processes with "python").
_signal_tree() {
  local pid
  for pid in $(_tree_pids "$1"); do
    if [ "${3:-}" = python ] && ! grep -q python "/proc/$pid/comm" 2>/dev/null; then
      continue
    fi
    kill "-$2" "$pid" 2>/dev/null || true
  done
}

# _wait_gone PID SECONDS: waits until PID has exited, at most SECONDS.
_wait_gone() {
  local end=$((SECONDS + $2))
  while kill -0 "$1" 2>/dev/null && (( SECONDS < end )); do sleep 0.2; done
}

run() {
  local limit=$1 log=$2; shift 2
  local left=$((BUDGET_S - SECONDS))
  if (( left < 20 )); then echo "skipped (budget): $*"; return 99; fi
  (( limit > left )) && limit=$left
  local t0=$SECONDS rc
  : > "$log"
  "$@" >> "$log" 2>&1 &  # appending: the notice below lands after what the piece wrote
  local pid=$!
  _wait_gone "$pid" "$limit"
  if kill -0 "$pid" 2>/dev/null; then
    echo "time_limit.sh: $limit s limit reached: SIGABRT to its Python processes (their stacks" \
      "follow)" >> "$log"
    _signal_tree "$pid" ABRT python
    _wait_gone "$pid" 3
    _signal_tree "$pid" TERM
    _wait_gone "$pid" 10
    _signal_tree "$pid" KILL
    wait "$pid" 2>/dev/null
    rc=124
  else
    wait "$pid"
    rc=$?
  fi
  echo "rc $rc, $((SECONDS - t0)) s: $*"
  return $rc
}
