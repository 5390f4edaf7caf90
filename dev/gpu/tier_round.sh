#!/usr/bin/env bash
# The whole GPU tier on one GPU in three device calls, each inside BUDGET (570 s):
#   CALL=1 bash dev/gpu/tier_round.sh WHEELS_DIR    # then CALL=2 and CALL=3, one device call each
#   DRY_RUN=1 bash dev/gpu/tier_round.sh WHEELS_DIR  # the plan: every call, pieces, limits, sums
#   PIECES="nvlink-8 ring" bash dev/gpu/tier_round.sh WHEELS_DIR   # any pieces (a rerun)
# WHEELS_DIR: the TE 2.20.2 set and megatron-core 0.19.2 (dev/gpu/README.md), installed when the
# call has a piece that needs them (megatron, te, graphs); the tests that need them skip without.
# A piece is pytest (-v -rA: every test's name and verdict, then pytest's summary) or a tool
# under time_limit.sh's limit. "a+b" in a call's list runs pieces a and b at once. Pieces of
# several ranks run under CUDA MPS (dev/gpu/evidence_lib.sh's daemon; each rank 100/R % of the
# SMs): time-sliced, a rank's spin-waits burn its slices while its peers wait for theirs (8 ranks
# took 158 s for 3 NVLink tests of 10 calls on an H100); under MPS the ranks run at once. MPS=0:
# everything time-sliced. Pieces (limit s, MPS ranks):
#   precompile      the NVLink, EP = 1 and FP8 kernels into the cache (-j nproc) (45, -)
#   precompile-internode  the same and the internode kernels of every staging (60, -)
#   nvlink-N        tests/gpu/test_nvlink_gpu.py at N = 2, 3, 4, 8 processes (120-160, N)
#   fp8             the FP8 tests at 1 and 2 processes (both expand paths at EP = 1) (130, 2)
#   kernels         layout, row dtypes, peer copies, Buffer properties at 1 and 2 (100, 2)
#   hazards         tests/gpu/test_hazards_gpu.py at 2 (its co-residency test needs the SMs) (80, -)
#   internode-NxL   tests/gpu/test_internode_gpu.py's matrix and graph replay on N x L virtual
#                   nodes, the README's shapes 2x1 2x2 3x2 2x3 4x2 2x4 (100-150, N x L)
#   ring            ring staging (2x1, 2x2) and the network ring (2x1, 2x2; 1 and 2 chunks) (180, 4)
#   net-ring-3x2    the network ring on 3 x 2 virtual nodes (180, 6)
#   megatron        Megatron's layer, checkpoints, EP parity, sync-free parity, expert copies,
#                   balance demo, multinode check, internode leg (180, 4)
#   te              parity with TE (Megatron's MoELayer, deepep vs alltoall), TE's quantizers,
#                   the FP8 experts, the sweep: timing asserts, so alone (100, -)
#   graphs          Megatron's --cuda-graph-impl choices and the sync-free layers' graphs (100, -)
#   fp8-crossover   optional: fp8_profile.py --queued at 24-132 SMs, each expand path, ROUNDS (2)
#                   rounds, then dev/gpu/fp8_crossover.py: the knob's default (100, -)
#   proxy           optional: dev/gpu/proxy.sh at 2x1 (P2P off, UCX over loopback, NVSHMEM_DEBUG
#                   =INFO) with the libucx wheel in UCX_WHEELS (default .whl_ucx) (150, -)
# Knobs: CALL (1, 2, 3), PIECES (replaces the call's list), EXTRA (pieces after it), CALLS
# (MDEEP_TEST_CALLS, 10), MPS (1), BUDGET (570), SETUP_S (the plan's allowance for the start,
# wheels and versions, 40), COMMIT (named in the logs; else git's). Outputs under $OUT (else
# .bench_out/tier_round): tier_callN_logs.tar.gz (callN/: pieces.tsv, versions.txt, one log per
# piece), remade after each step, and tier_callN_record.md (dev/gpu/tier_record.py on it).
set -u
[ $# -eq 1 ] && [ -d "$1" ] || { echo "usage: bash dev/gpu/tier_round.sh WHEELS_DIR"; exit 2; }
WHEELS=$(cd "$1" && pwd)
source "$(dirname "${BASH_SOURCE[0]}")/evidence_lib.sh"
ev_init tier_round
export MDEEP_TEST_CALLS=${CALLS:-10}
SETUP_S=${SETUP_S:-40}
USE_MPS=${MPS:-1}
OUT_DIR=${OUT:-.bench_out/tier_round}
PYTEST=(python3 -m pytest -m gpu -v -rA -p no:cacheprovider --durations=10)
PRECOMPILE=(python3 -m megatron_deepep.tools.precompile --topk 1 2 4 6 8 16 --index-dtype int64
            --fp8 blockwise_1x128 mxfp8_1x32 --row-dtype bf16 fp16 fp32 -j "$(nproc)" -q)
INTERNODE_T=tests/gpu/test_internode_gpu.py
SWEEP_SMS=24,32,40,48,56,64,80,96,132

# The calls: groups in order; "a+b" runs at once.
call_pieces() {
  case $1 in
    1) echo "precompile nvlink-2+nvlink-3+nvlink-4+fp8+nvlink-2-split nvlink-8 kernels" \
            "hazards" ;;
    2) echo "precompile-internode internode-2x1+internode-2x2+internode-3x2" \
            "internode-2x3+internode-4x2 internode-2x4" ;;
    3) echo "precompile-internode ring+net-ring-3x2+megatron te graphs" ;;
    *) echo "tier_round: CALL is 1, 2 or 3 (got '$1')" >&2; return 2 ;;
  esac
}

# piece_spec NAME: sets LIMIT, RANKS (0: not under MPS), WHEELS_NEEDED and CMD (the command).
piece_spec() {
  local name=$1 shape
  WHEELS_NEEDED=0
  RANKS=0
  case $name in
    precompile) LIMIT=45; CMD=("${PRECOMPILE[@]}") ;;
    precompile-internode) LIMIT=60; CMD=("${PRECOMPILE[@]}" --internode) ;;
    nvlink-2-split) LIMIT=120; RANKS=2  # the earlier kernels (MDEEP_NVLINK_KERNELS=split)
      CMD=(env MDEEP_TEST_PROCS=2 MDEEP_NVLINK_KERNELS=split "${PYTEST[@]}"
           tests/gpu/test_nvlink_gpu.py) ;;
    nvlink-[2348])
      RANKS=${name#nvlink-}
      LIMIT=$(( RANKS == 8 ? 160 : RANKS == 4 ? 130 : 120 ))
      CMD=(env MDEEP_TEST_PROCS="$RANKS" "${PYTEST[@]}" tests/gpu/test_nvlink_gpu.py) ;;
    fp8) LIMIT=130; RANKS=2
      CMD=(env MDEEP_TEST_PROCS=1,2 "${PYTEST[@]}" tests/gpu/test_fp8_dispatch_gpu.py
           tests/gpu/test_fp8_gpu.py tests/gpu/test_fp8_columnwise_gpu.py) ;;
    kernels) LIMIT=100; RANKS=2
      CMD=(env MDEEP_TEST_PROCS=1,2 MDEEP_TEST_NODES=2x1 "${PYTEST[@]}"
           tests/gpu/test_layout_gpu.py tests/gpu/test_parity_dtypes_gpu.py
           tests/gpu/test_bench_peers_gpu.py tests/gpu/test_buffer_properties_gpu.py) ;;
    hazards) LIMIT=80
      CMD=(env MDEEP_TEST_PROCS=2 MDEEP_TEST_NODES=2x1 "${PYTEST[@]}"
           tests/gpu/test_hazards_gpu.py) ;;
    internode-[234]x[1234])
      shape=${name#internode-}
      RANKS=$(( ${shape%x*} * ${shape#*x} ))
      LIMIT=$(( RANKS <= 2 ? 100 : RANKS <= 4 ? 120 : RANKS <= 6 ? 140 : 150 ))
      CMD=(env MDEEP_TEST_NODES="$shape" "${PYTEST[@]}" "$INTERNODE_T"
           -k "matches_reference or graph_replay") ;;
    ring) LIMIT=180; RANKS=4
      CMD=(env MDEEP_TEST_NODES=2x1,2x2 "${PYTEST[@]}" "$INTERNODE_T"
           -k "small_ring or (small_net_ring and not 3x2)") ;;
    net-ring-3x2) LIMIT=180; RANKS=6
      CMD=("${PYTEST[@]}" "$INTERNODE_T" -k "small_net_ring and 3x2") ;;
    megatron) LIMIT=180; RANKS=4; WHEELS_NEEDED=1
      CMD=(env MDEEP_TEST_PROCS=1,2 MDEEP_TEST_NODES=2x1 "${PYTEST[@]}"
           tests/gpu/test_megatron_layer_gpu.py tests/gpu/test_grouped_checkpoint_gpu.py
           tests/gpu/test_parity_ep_gpu.py tests/gpu/test_parity_syncfree_gpu.py
           tests/gpu/test_replica_experts_gpu.py tests/gpu/test_balance_demo_gpu.py
           tests/gpu/test_multinode_check_gpu.py tests/gpu/test_internode_leg_gpu.py) ;;
    te) LIMIT=100; WHEELS_NEEDED=1
      CMD=("${PYTEST[@]}" tests/gpu/test_parity_te_gpu.py tests/gpu/test_te_gpu.py
           tests/gpu/test_te_experts_gpu.py tests/gpu/test_sweep_gpu.py) ;;
    graphs) LIMIT=100; WHEELS_NEEDED=1
      CMD=("${PYTEST[@]}" tests/gpu/test_megatron_graphs_gpu.py
           tests/gpu/test_parity_graphs_gpu.py) ;;
    fp8-crossover) LIMIT=100
      CMD=(python3 dev/gpu/fp8_crossover.py --sweep --rounds "${ROUNDS:-2}" --num-sms "$SWEEP_SMS"
           --log "$LOGS/fp8_crossover_runs.log") ;;
    proxy) LIMIT=150
      CMD=(env EV_OUT="$EV_OUT" PIECES="plugins tier" PROXY_SHAPES=2x1 BUDGET=150
           bash dev/gpu/proxy.sh "${UCX_WHEELS:-.whl_ucx}") ;;
    *) echo "tier_round: unknown piece '$name'"; return 2 ;;
  esac
}

# group_limit GROUP: the longest limit of its pieces (they run at once).
group_limit() {
  local most=0 name
  for name in ${1//+/ }; do
    piece_spec "$name" || return 2
    (( LIMIT > most )) && most=$LIMIT
  done
  echo "$most"
}

# call_groups CALL: the groups a call runs (PIECES, else the call's list; then EXTRA).
call_groups() {
  local groups
  groups=${PIECES:-$(call_pieces "$1")} || return 2
  echo $groups ${EXTRA:-}
}

# plan LABEL GROUPS: one line per group and piece, then the sum against the budget; returns 1
# if over it.
plan() {
  local label=$1 groups=$2 group name sum=$SETUP_S limit
  echo "$label (budget $BUDGET_S s; setup allowance $SETUP_S s: start, wheels, versions):"
  for group in $groups; do
    limit=$(group_limit "$group") || return 2
    sum=$((sum + limit))
    echo "  $group: limit $limit s$([[ $group == *+* ]] && echo " (at once)")"
    for name in ${group//+/ }; do
      piece_spec "$name"
      echo "    $name: limit $LIMIT s, MPS ranks $([ "$RANKS" = 0 ] && echo - || echo "$RANKS"):" \
        "${CMD[*]}"
    done
  done
  echo "  sum: $sum s of $BUDGET_S s$( (( sum > BUDGET_S )) && echo ": OVER the budget")"
  (( sum <= BUDGET_S ))
}

if ev_is_dry; then
  status=0
  LOGS='$LOGS'
  for call in ${CALL:-1 2 3}; do
    groups=$(call_groups "$call") || exit 2
    plan "call $call" "$groups" || status=1
  done
  exit $status
fi

# ---- one call on the device
CALL_NAME=call${CALL:-1}
[ -n "${PIECES:-}" ] && [ -z "${CALL:-}" ] && CALL_NAME=pieces
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/tier_round.XXXXXX")/$CALL_NAME
mkdir -p "$LOGS" "$OUT_DIR"
GROUPS_=$(call_groups "${CALL:-1}") || exit 2
plan "$CALL_NAME" "$GROUPS_" | tee "$LOGS/plan.txt"
need_wheels=0
for name in ${GROUPS_//+/ }; do
  piece_spec "$name" || exit 2
  (( WHEELS_NEEDED )) && need_wheels=1
done
if (( need_wheels )); then ev_install_wheels tier_round "$WHEELS" || exit 2; fi
ev_versions > /dev/null
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}
{ cat "$EV_LOGS/versions"; echo "commit: $commit"
  echo "MDEEP_TEST_CALLS=$MDEEP_TEST_CALLS MPS=$USE_MPS"; } > "$LOGS/versions.txt"
cat "$LOGS/versions.txt"
if [ "$USE_MPS" = 1 ]; then
  ev_start_mps || { echo "tier_round: MPS off (it did not start)"; USE_MPS=0; }
fi

bundle() { tar czf "$OUT_DIR/tier_${CALL_NAME}_logs.tar.gz" -C "$(dirname "$LOGS")" "$CALL_NAME"; }

# run_piece NAME: one piece under its limit, its row in pieces.tsv.
run_piece() {
  local name=$1 t0=$SECONDS rc mps_env=()
  piece_spec "$name"
  if [ "$USE_MPS" = 1 ] && (( RANKS > 0 )); then
    mps_env=(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / RANKS)))
  else  # not an MPS client: time-sliced beside the (idle) MPS server
    mps_env=(-u CUDA_MPS_PIPE_DIRECTORY -u CUDA_MPS_LOG_DIRECTORY)
  fi
  ev_say "$name: start (limit $LIMIT s, MPS ranks $RANKS)"
  run "$LIMIT" "$LOGS/tier_$name.log" env "${mps_env[@]}" "${CMD[@]}" > /dev/null
  rc=$?
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$LIMIT" \
    "$( [ "$USE_MPS" = 1 ] && echo "$RANKS" || echo 0)" "${CMD[*]}" >> "$LOGS/pieces.tsv"
  ev_say "$name: rc $rc in $((SECONDS - t0)) s: $(tail -n 1 "$LOGS/tier_$name.log" | cut -c1-120)"
}

for group in $GROUPS_; do
  for name in ${group//+/ }; do run_piece "$name" & done
  wait
  bundle
done
python3 dev/gpu/tier_record.py "$LOGS" --out "$OUT_DIR/tier_${CALL_NAME}_record.md" \
  --date "$EV_DATE ($CALL_NAME)"
sed -n '/^## Every tests/,/^## Pieces/p' "$OUT_DIR/tier_${CALL_NAME}_record.md" \
  | grep -v -e "| 0 | 0 | 0 | 0 | not run |" -e "^## Pieces"
sed -n '/^## Not run/,$p' "$OUT_DIR/tier_${CALL_NAME}_record.md"
bundle
