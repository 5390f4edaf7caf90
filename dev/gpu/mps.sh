#!/usr/bin/env bash
# The EP > 1 runs with their processes running AT ONCE on one GPU, through CUDA MPS:
#   bash dev/gpu/mps.sh [DEEPEP]            # DeepEP beside ours when DEEPEP is given
#   DRY_RUN=1 bash dev/gpu/mps.sh [DEEPEP]  # the commands and each piece's limit, runs nothing
# DEEPEP: a built DeepEP V1 folder (deep_ep_cpp*.so), or its source (a folder or .tar.gz, e.g.
# .whl/DeepEP-v1.2.1.tar.gz) for the `build` piece.
# Starts `nvidia-cuda-mps-control -d` with its pipe and log folders from `mktemp -d` (exported
# as CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY for every client) and always stops it
# (trap: `quit`); if the daemon or its server cannot start, prints why (its control and server
# logs) and exits 3. Every run of R processes gets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/R: the
# shares add up to <= 100, so NVSHMEM takes its full several-PEs-per-GPU mode (limited mode
# without MPS), and a rank's SM budget is its share (even, at most MAX_SMS: default 24, the
# budget DeepEP's V3 training uses; MAX_SMS=132 gives each rank its whole share, the most both
# implementations accept under it).
# Pieces (PIECES, default "side tier sweep"), in the order given, each under its limit, never
# past BUDGET (570 s; a piece gets at most what is left):
#   build   DeepEP from its source (DEEPEP_NVSHMEM=0 by default: intranode kernels only, ~27 s)
#           into $EV_OUT/deepep_build, by dev/gpu/deepep.sh's build step (BUILD_TIMEOUT, 120)
#   wheels  every wheel of WHEELS_DIR (default .whl: megatron-core 0.19.2 and the TE 2.20.2
#           set, for the deepep+permute rows) into a fresh site folder, on PYTHONPATH
#   side    dev/gpu/deepep_side_by_side.py --concurrent at R = 2, 4, 8 and SIDE_SMS (24) SMs
#           (R = 8: its share's most, 14): ours, deepep and deepep+permute checked against
#           tests/helpers/oracle.py, µs, host µs and GB/s per rank, and the internode model's
#           input (kernel_gbps) (SIDE_TIMEOUT, 330; each EP size SIZE_TIMEOUT, 150: past
#           DeepEP's own ~100 s timeouts)
#   split, fused  ours alone at R = 2, 4, 8 with MDEEP_NVLINK_KERNELS=split (the earlier send,
#           then receive, kernels) or =fused (both operations fused), beside the default `auto`
#           in the same run (KERNELS_TIMEOUT, 120 each)
#   sweep-sms  the same at R = 2 over SWEEP_SMS (8,16,24,48) SMs: where each side stops
#           scaling, in HBM bytes per second per rank and summed (SWEEP_SMS_TIMEOUT, 240)
#   faults  DeepEP's faults under MPS (illegal memory access at R = 2 with 64 SMs, R = 4 in
#           FP8, R = 8 in bf16, while it passes time-sliced), DeepEP alone, checks only, in this
#           order while time is left (each FAULT_TIMEOUT, 250; its processes' own limit too):
#           a build with DeepEP's ENABLE_FAST_DEBUG (its timeouts ~10 s, so a stall prints
#           DeepEP's own timeout line: role, rank, channel) when its source is given; R = 2 at
#           64 SMs under the 50% share with CUDA_LAUNCH_BLOCKING=1 (the failing launch raises
#           in the rank that ran it); R = 2/64, 4/24, 8/14 at a 100% MPS share (MPS without an
#           SM limit); R = 4/24, 8/14 at the 100/R share; compute-sanitizer memcheck of R = 2/64
#           under MPS (when on PATH); then, the MPS daemon stopped, R = 2/64, 4/24, 8/14
#           time-sliced. Each rank's stages carry their seconds, so a fault at ~10 s (fast
#           debug) or ~100 s is DeepEP's own timeout, an early one a bad access
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
  echo "usage: bash dev/gpu/mps.sh [DEEPEP_BUILD | DEEPEP_SRC]"
  exit 2
fi
DEEPEP_BUILD=
DEEPEP_SRC=
if [ -n "${1:-}" ]; then
  if [ -d "$1" ] && ls "$1"/deep_ep_cpp*.so >/dev/null 2>&1; then DEEPEP_BUILD=$1
  elif [ -d "$1" ] || [ -f "$1" ]; then
    DEEPEP_SRC=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
  else
    echo "mps: DEEPEP '$1' is not a built folder, a source folder or a .tar.gz"
    exit 2
  fi
fi
PIECES=${PIECES:-side tier sweep}
for piece in $PIECES; do
  case $piece in build|wheels|side|split|fused|sweep-sms|faults|tier|sweep) ;; *)
    echo "mps: unknown piece '$piece' in PIECES (build, wheels, side, split, fused, sweep-sms," \
      "faults, tier, sweep)"; exit 2 ;;
  esac
done
case " $PIECES " in *" build "*)
  if [ -z "$DEEPEP_SRC" ]; then
    echo "mps: the build piece needs DeepEP's source (a folder or .tar.gz) as the argument"
    exit 2
  fi
  DEEPEP_BUILD=$EV_OUT/deepep_build ;;
esac
CALLS=${MDEEP_TEST_CALLS:-50}
SIZE_TIMEOUT=${SIZE_TIMEOUT:-150}
FAULT_TIMEOUT=${FAULT_TIMEOUT:-250}
ev_say "pieces: $PIECES; DeepEP: ${DEEPEP_BUILD:-${DEEPEP_SRC:-not given (ours only)}}"
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

# side_table LOG TITLE: the side-by-side's tables, notes and errors into the record.
side_table() {
  ev_is_dry && return 0
  { echo; echo "$2:"; echo
    grep -E "^(side by side|\| |GB/s per rank|note: |error R=|R=[0-9])" "$1"; } >> "$TABLE"
  grep -E "^(\| [0-9]|error R=)" "$1" | cut -c1-200
}

# fault_run NAME LOG args...: one faults run of DeepEP alone (checks only), its rows, errors,
# DeepEP's own prints and each rank's last stage into the record.
fault_run() {
  local name=$1 log=$2
  shift 2
  ev_piece "faults: $name" "$FAULT_TIMEOUT" "$log" "$@"
  ev_row "faults: $name" "$PIECE_RC" "$PIECE_S" "see the record"
  ev_is_dry && return 0
  { echo; echo "- faults, $name: rc $PIECE_RC in $PIECE_S s"
    grep -E "^(\| [0-9]|error R=|R=[0-9])|DeepEP|illegal|Xid|^========= |time_limit" "$log" \
      | cut -c1-240 | head -24
    grep -E "^rank [0-9]+ \[" "$log" | tail -n 8 | cut -c1-160; } >> "$TABLE"
}

DEEPEP_ARGS=()
[ -n "$DEEPEP_BUILD" ] && DEEPEP_ARGS=(--deepep "$DEEPEP_BUILD")
case " $PIECES " in *" tier "*|*" sweep "*) ev_precompile_tier ;; esac
# precompile_once: our side-by-side kernels into the cache, before the first piece that runs them.
precompile_once() {
  [ -n "${PRECOMPILED:-}" ] && return 0
  PRECOMPILED=1
  ev_piece "precompile" 150 "$EV_LOGS/precompile.log" \
    python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 \
    --fp8 blockwise_1x128_fp32_scales --fp8-output fp8 -j "$(nproc)" -q
}
for piece in $PIECES; do
  case $piece in
    build)
      ev_piece "deepep build" "${BUILD_TIMEOUT:-120}" "$EV_LOGS/build.log" env \
        DEEPEP_NVSHMEM="${DEEPEP_NVSHMEM:-0}" bash "$EV_HERE/deepep.sh" --build-step \
        "$DEEPEP_SRC" "$DEEPEP_BUILD"
      result=$(ev_is_dry && echo "dry run" || grep -E "^deepep build:" "$EV_LOGS/build.log" \
        | tail -n 1)
      ev_is_dry || echo "- DeepEP build: rc $PIECE_RC in $PIECE_S s: $result" >> "$TABLE"
      ev_row "deepep build" "$PIECE_RC" "$PIECE_S" "${result:-see build.log}"
      ;;
    wheels)
      t0=$SECONDS
      ev_install_wheels mps "$WHEELS_DIR"
      rc=$?
      ev_is_dry || echo "- wheels of $WHEELS_DIR: rc $rc in $((SECONDS - t0)) s" >> "$TABLE"
      ev_row "wheels ($WHEELS_DIR)" "$rc" "$((SECONDS - t0))" "megatron-core, TE"
      ;;
    side)
      args=(--ranks 2,4,8 --num-sms "${SIDE_SMS:-24}" --concurrent --timeout-s "$SIZE_TIMEOUT"
            --json "$EV_LOGS/side.json" --model-json "$EV_OUT/mps_model.json")
      if [ -n "$DEEPEP_BUILD" ]; then args+=("${DEEPEP_ARGS[@]}"); else
        args+=(--skip-deepep); fi
      precompile_once
      ev_piece "side by side, concurrent" "${SIDE_TIMEOUT:-330}" "$EV_LOGS/side.log" \
        python3 dev/gpu/deepep_side_by_side.py "${args[@]}"
      side_table "$EV_LOGS/side.log" "Side by side at R = 2, 4, 8 under MPS"
      ev_row "side by side R=2,4,8 under MPS" "$PIECE_RC" "$PIECE_S" "table in the record"
      ;;
    split|fused)
      args=(--ranks 2,4,8 --num-sms "${SIDE_SMS:-24}" --concurrent --timeout-s "$SIZE_TIMEOUT"
            --json "$EV_LOGS/$piece.json" --skip-deepep)
      precompile_once
      ev_piece "ours with MDEEP_NVLINK_KERNELS=$piece, concurrent" "${KERNELS_TIMEOUT:-120}" \
        "$EV_LOGS/$piece.log" env MDEEP_NVLINK_KERNELS="$piece" python3 \
        dev/gpu/deepep_side_by_side.py "${args[@]}"
      side_table "$EV_LOGS/$piece.log" "Ours with MDEEP_NVLINK_KERNELS=$piece, same run"
      ev_row "ours, $piece kernels, R=2,4,8 under MPS" "$PIECE_RC" "$PIECE_S" "in the record"
      ;;
    sweep-sms)
      args=(--ranks 2 --num-sms "${SWEEP_SMS:-8,16,24,48}" --concurrent --timeout-s
            "$SIZE_TIMEOUT" --json "$EV_LOGS/sweep_sms.json")
      if [ -n "$DEEPEP_BUILD" ]; then args+=("${DEEPEP_ARGS[@]}"); else
        args+=(--skip-deepep); fi
      precompile_once
      ev_piece "SM sweep at R=2" "${SWEEP_SMS_TIMEOUT:-240}" "$EV_LOGS/sweep_sms.log" \
        python3 dev/gpu/deepep_side_by_side.py "${args[@]}"
      side_table "$EV_LOGS/sweep_sms.log" "SM sweep at R = 2 under MPS (50% share each)"
      ev_row "SM sweep R=2 (${SWEEP_SMS:-8,16,24,48})" "$PIECE_RC" "$PIECE_S" "in the record"
      ;;
    faults)
      if [ -z "$DEEPEP_BUILD" ] && [ -z "$DEEPEP_SRC" ]; then
        ev_row "faults" 99 0 "skipped: no DeepEP given"
        continue
      fi
      build=$DEEPEP_BUILD
      if [ -n "$DEEPEP_SRC" ]; then
        build=$EV_OUT/deepep_build_debug
        ev_piece "faults: DeepEP build, fast debug" "${BUILD_TIMEOUT:-120}" \
          "$EV_LOGS/build_debug.log" env DEEPEP_NVSHMEM="${DEEPEP_NVSHMEM:-0}" \
          DEEPEP_FAST_DEBUG=1 bash "$EV_HERE/deepep.sh" --build-step "$DEEPEP_SRC" "$build"
        [ "$PIECE_RC" = 0 ] || build=$DEEPEP_BUILD
      fi
      alone=(python3 dev/gpu/deepep_side_by_side.py --deepep "$build" --skip-ours
             --check-only --timeout-s "$FAULT_TIMEOUT")
      fault_run "R=2 64 SMs, MPS 50%, CUDA_LAUNCH_BLOCKING=1" "$EV_LOGS/fault_blocking.log" \
        env CUDA_LAUNCH_BLOCKING=1 "${alone[@]}" --ranks 2 --num-sms 64 --concurrent
      for spec in 2:64 4:24 8:14; do
        fault_run "R=${spec%:*} ${spec#*:} SMs, MPS 100% share" \
          "$EV_LOGS/fault_full_${spec%:*}.log" "${alone[@]}" --ranks "${spec%:*}" \
          --num-sms "${spec#*:}" --concurrent --mps-percentage 100
      done
      for spec in 4:24 8:14; do
        fault_run "R=${spec%:*} ${spec#*:} SMs, MPS 100/R share" \
          "$EV_LOGS/fault_share_${spec%:*}.log" "${alone[@]}" --ranks "${spec%:*}" \
          --num-sms "${spec#*:}" --concurrent
      done
      if command -v compute-sanitizer >/dev/null || ev_is_dry; then
        fault_run "R=2 64 SMs, MPS 50%, compute-sanitizer memcheck" \
          "$EV_LOGS/fault_sanitizer.log" compute-sanitizer --tool memcheck \
          --target-processes all --print-limit 20 "${alone[@]}" --skip-permute --ranks 2 \
          --num-sms 64 --concurrent --check-tokens 64
      else
        ev_row "faults: compute-sanitizer" 99 0 "skipped: compute-sanitizer not on PATH"
      fi
      # Time-sliced: the MPS daemon stopped, so the clients take turns on the GPU.
      if ev_is_dry; then echo "dry run: MPS daemon stopped for the time-sliced runs"; else
        ev_stop_mps
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        echo "- MPS daemon stopped: the runs below are time-sliced" >> "$TABLE"
      fi
      for spec in 2:64 4:24 8:14; do
        fault_run "R=${spec%:*} ${spec#*:} SMs, time-sliced" \
          "$EV_LOGS/fault_sliced_${spec%:*}.log" "${alone[@]}" --ranks "${spec%:*}" \
          --num-sms "${spec#*:}"
      done
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
deepep_arg=${DEEPEP_SRC:+$(basename "$DEEPEP_SRC")}
[ -z "$deepep_arg" ] && [ -n "$DEEPEP_BUILD" ] && deepep_arg=DEEPEP_BUILD
ev_record mps "EP > 1 on one GPU with the ranks at once (CUDA MPS)" \
  "PIECES='$PIECES' bash dev/gpu/mps.sh $deepep_arg" "$EV_LOGS/all.txt" "$TABLE"
ev_finish
