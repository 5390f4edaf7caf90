#!/usr/bin/env bash
# The EP > 1 runs with their processes running AT ONCE on one GPU, through CUDA MPS:
#   bash dev/gpu/mps.sh [DEEPEP_BUILD]        # DeepEP beside ours when a built folder is given
#   DRY_RUN=1 bash dev/gpu/mps.sh [DEEPEP_BUILD]
# Starts `nvidia-cuda-mps-control -d` with its pipe and log folders from `mktemp -d` (exported
# as CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY for every client) and always stops it
# (trap: `quit`); if the daemon or its server cannot start, prints why (its control and server
# logs) and exits 3. Every run of R processes gets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/R: the
# shares add up to <= 100, so NVSHMEM takes its full several-PEs-per-GPU mode (limited mode
# without MPS), and a rank's SM budget is its share (even, at most MAX_SMS: default 24, the
# budget DeepEP's V3 training uses; MAX_SMS=132 gives each rank its whole share, the most both
# implementations accept under it).
# Pieces (PIECES, default "side tier sweep"), each under its limit, never past BUDGET (570 s):
#   side    dev/gpu/deepep_side_by_side.py --concurrent at R = 2, 4, 8: ours (and DeepEP with
#           DEEPEP_BUILD) checked against tests/helpers/oracle.py, µs and GB/s per rank, and the
#           internode model's input (kernel_gbps) (SIDE_TIMEOUT, 360)
#   tier    the NVLink tier's matrix at 4 and 8 processes and the internode tier's matrix on
#           virtual nodes 2x2 and 2x4 (MDEEP_TEST_CALLS, default 50) (TIER_TIMEOUT, 150 each)
#   sweep   megatron_deepep.tools.multinode_check's sweep on virtual nodes 2x2 and 2x4 at
#           DeepSeek-V3's shape (4096 tokens, hidden 7168, top-8): µs and GB/s per rank of the
#           network leg
#           (NVSHMEM's P2P path here) and the NVLink leg (SWEEP_TIMEOUT, 120 each)
# Writes benchmarks/<card>_<date>_mps.md and .log, and .bench_out/evidence/mps_model.json
# (internode_model --measured-json input).
set -u
source "$(dirname "${BASH_SOURCE[0]}")/evidence_lib.sh"
ev_init mps
if [ $# -gt 1 ]; then
  echo "usage: bash dev/gpu/mps.sh [DEEPEP_BUILD]"
  exit 2
fi
DEEPEP_BUILD=${1:-}
[ -n "$DEEPEP_BUILD" ] && ev_need_dir mps DEEPEP_BUILD "$DEEPEP_BUILD"
PIECES=${PIECES:-side tier sweep}
for piece in $PIECES; do
  case $piece in side|tier|sweep) ;; *)
    echo "mps: unknown piece '$piece' in PIECES (side, tier, sweep)"; exit 2 ;;
  esac
done
CALLS=${MDEEP_TEST_CALLS:-50}
ev_say "pieces: $PIECES; DeepEP: ${DEEPEP_BUILD:-not given (ours only)}"
TABLE=$EV_LOGS/table.md
: > "$TABLE"

if ev_is_dry; then
  echo "dry run: nvidia-cuda-mps-control -d (pipe and log folders from mktemp -d), stopped by trap"
else
  ev_start_mps || exit 3
  echo "- MPS daemon up (server pid(s): ${MPS_SERVERS:-none listed}); a client at 100% sees" \
    "$FULL_SMS SMs" >> "$TABLE"
fi
ev_versions

# sms_for R: a rank's SM budget at CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/R (even, <= MAX_SMS).
sms_for() {
  local share=$(( ${FULL_SMS:-132} * (100 / $1) / 100 ))
  share=$(( share - share % 2 ))
  local most=${MAX_SMS:-24}
  echo $(( share < most ? share : most ))
}

case " $PIECES " in *" tier "*|*" sweep "*) ev_precompile_tier ;; esac
for piece in $PIECES; do
  case $piece in
    side)
      args=(--ranks 2,4,8 --concurrent --timeout-s 110 --json "$EV_LOGS/side.json"
            --model-json "$EV_OUT/mps_model.json")
      if [ -n "$DEEPEP_BUILD" ]; then args+=(--deepep "$DEEPEP_BUILD"); else
        args+=(--skip-deepep); fi
      ev_piece "precompile" 150 "$EV_LOGS/precompile.log" \
        python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 \
        --fp8 blockwise_1x128_fp32_scales --fp8-output fp8 -j "$(nproc)" -q
      ev_piece "side by side, concurrent" "${SIDE_TIMEOUT:-360}" "$EV_LOGS/side.log" \
        python3 dev/gpu/deepep_side_by_side.py "${args[@]}"
      if ! ev_is_dry; then
        { echo; grep -E "^(side by side|\| |error R=|R=[0-9])" "$EV_LOGS/side.log"; } >> "$TABLE"
        grep -E "^(\| [0-9]|error R=)" "$EV_LOGS/side.log" | cut -c1-200
      fi
      ev_row "side by side R=2,4,8 under MPS" "$PIECE_RC" "$PIECE_S" "table in the record"
      ;;
    tier)
      for n in 4 8; do
        log=$EV_LOGS/tier_nvlink_$n.log
        ev_piece "nvlink tier N=$n" "${TIER_TIMEOUT:-150}" "$log" env \
          CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / n)) MDEEP_TEST_PROCS=$n \
          MDEEP_TEST_CALLS="$CALLS" python3 -m pytest -m gpu -q -rA -p no:cacheprovider \
          tests/gpu/test_nvlink_gpu.py -k test_nvlink_matches_reference
        result=$(ev_is_dry && echo "dry run" || tail -n 1 "$log")
        ev_row "nvlink tier N=$n, $((100 / n))% each" "$PIECE_RC" "$PIECE_S" "$result"
        ev_is_dry || echo "- NVLink tier matrix, N=$n, $((100 / n))% each, $CALLS calls:" \
          "rc $PIECE_RC in $PIECE_S s: $result" >> "$TABLE"
      done
      for shape in 2x2 2x4; do
        ranks=$(( ${shape%x*} * ${shape#*x} ))
        log=$EV_LOGS/tier_internode_$shape.log
        ev_piece "internode tier $shape" "${TIER_TIMEOUT:-150}" "$log" env \
          CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / ranks)) MDEEP_TEST_NODES=$shape \
          MDEEP_TEST_CALLS="$CALLS" NVSHMEM_DEBUG=INFO python3 -m pytest -m gpu -q -rA \
          -p no:cacheprovider tests/gpu/test_internode_gpu.py \
          -k "test_internode_matches_reference and $shape"
        result=$(ev_is_dry && echo "dry run" || tail -n 1 "$log")
        # NVSHMEM says which several-PEs-per-GPU mode it took.
        mode=$(ev_is_dry || grep -m 1 -o "[a-z]* MPG support is available" "$log")
        ev_row "internode tier $shape, $((100 / ranks))% each" "$PIECE_RC" "$PIECE_S" \
          "$result ${mode:+($mode)}"
        ev_is_dry || echo "- internode tier matrix on $shape virtual nodes, $((100 / ranks))%" \
          "each, $CALLS calls: rc $PIECE_RC in $PIECE_S s: $result ${mode:+(NVSHMEM: $mode)}" \
          >> "$TABLE"
      done
      ;;
    sweep)
      for shape in 2x2 2x4; do
        per_node=${shape#*x}
        ranks=$(( ${shape%x*} * per_node ))
        sms=$(sms_for "$ranks")
        log=$EV_LOGS/sweep_$shape.log
        ev_piece "sweep $shape" "${SWEEP_TIMEOUT:-120}" "$log" env \
          CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / ranks)) \
          python3 -m megatron_deepep.tools.multinode_check --spawn "$ranks" \
          --num-ranks-per-node "$per_node" --skip-check --sweep-tokens 4096 \
          --sweep-hidden 7168 --num-sms "$sms" --json "$EV_LOGS/sweep_$shape.json"
        ev_row "sweep $shape, $((100 / ranks))% and $sms SMs each" "$PIECE_RC" "$PIECE_S" \
          "$(ev_is_dry && echo "dry run" || grep -c -E "dispatch|combine" "$log") lines"
        if ! ev_is_dry; then
          { echo; echo "multinode_check sweep on $shape virtual nodes under MPS," \
              "$((100 / ranks))% and $sms SMs per rank (GB/s per rank: network leg on" \
              "NVSHMEM's P2P path, NVLink leg):"
            grep -E "tokens|^ +[0-9]+ +[0-9]+ +(dispatch|combine)|GB/s" "$log" | head -12
          } >> "$TABLE"
        fi
      done
      ;;
  esac
done
ev_is_dry || cat "$EV_LOGS"/*.log > "$EV_LOGS/all.txt" 2>/dev/null
ev_record mps "EP > 1 on one GPU with the ranks at once (CUDA MPS)" \
  "PIECES='$PIECES' bash dev/gpu/mps.sh ${DEEPEP_BUILD:+DEEPEP_BUILD}" "$EV_LOGS/all.txt" "$TABLE"
ev_finish
