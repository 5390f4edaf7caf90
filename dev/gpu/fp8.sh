#!/usr/bin/env bash
# FP8 dispatch on one GPU, before and after a kernel change, in one call:
#   bash dev/gpu/fp8.sh WHEELS_DIR BEFORE_DIR
#   DRY_RUN=1 bash dev/gpu/fp8.sh WHEELS_DIR BEFORE_DIR   # the plan; runs nothing
# WHEELS_DIR: the TE 2.20.2 set and megatron-core 0.19.2 (the alltoall rows and the TE layer;
# an empty folder: neither).
# BEFORE_DIR: the package to compare with, as `git archive REV megatron_deepep cuda_src | tar x
# -C BEFORE_DIR` leaves it (its own kernels: the JIT finds BEFORE_DIR/cuda_src).
# Pieces (PIECES, default all, in this order; each under its limit, never past BUDGET, 570 s):
#   check   our FP8 kernels precompiled (-j nproc), then dev/gpu/fp8_profile.py --check: fresh
#           and cached FP8 dispatch bit-exact against quantize(bf16 dispatch), every format,
#           H 7168, 2880 and 4096 (CHECK_TIMEOUT, 90)
#   tests   the FP8 GPU tests at 1 process (EP = 1's kernels): bit-exact against the reference
#           quantizer, fresh and cached, every format, and TEST_FILES (default the standalone
#           quantizer's tests/gpu/test_fp8_gpu.py; '' for none) (TEST_TIMEOUT, 150)
#   after   python -m megatron_deepep.bench at DeepSeek-V3's shape, 24 and 132 SMs, bf16 and
#           the three FP8 formats, with Megatron's alltoall rows when WHEELS_DIR brings
#           megatron-core (AFTER_TIMEOUT, 170; AFTER_ARGS passed on, e.g. --no-megatron)
#   before  the same bench with BEFORE_DIR's package, no Megatron rows (BEFORE_TIMEOUT, 120)
#   ncu     Nsight Compute on dev/gpu/fp8_profile.py, after then before: per kernel duration,
#           DRAM throughput, occupancy, registers, warp stalls, at NCU_SMS blocks (default
#           132) (NCU_TIMEOUT, 90 each); NCU_EXTRA adds ncu arguments, e.g. "--metrics
#           l1tex__m_l1tex2xbar_throughput.avg.pct_of_peak_sustained_elapsed" (L1 to L2 writes)
#   host    dev/gpu/fp8_profile.py --host, after then before: host and CUDA-event µs per call of
#           sync, nosync and cached dispatch, bf16 and each format, and the bench's cProfile of
#           each mode with the first format (HOST_TIMEOUT, 60 each)
#   timeline  dev/gpu/fp8_profile.py --timeline at NUM_SMS's last value: the host's work per
#           sync and nosync call (before, in and after the wait) beside the GPU's µs per call,
#           bf16 and the first format (HOST_TIMEOUT, 60)
#   breakdown  dev/gpu/host_breakdown.py, after then before (BREAKDOWN_SIDES), at NUM_SMS's
#           last value: each function's host µs per call (sync, nosync, cached; bf16 and the
#           first format) and the raw cost of the CUDA entry points a call makes (HOST_TIMEOUT,
#           60 each)
#   layer   python -m megatron_deepep.bench.layer --te: table B's TE blockwise-FP8 layer rows,
#           alltoall with TE's fused permute beside ours with FP8 dispatch and FP8 experts
#           (LAYER_TIMEOUT, 150; LAYER_VARIANTS picks the variants, LAYER_ARGS is passed on,
#           e.g. "--profile 12")
#   tests2  the FP8 GPU tests at 2 processes (the NVLink kernels) (TEST_TIMEOUT, 150)
#   rounds  ROUNDS (default 2) alternating rounds of the bench, after then before, each with
#           --profile (the expand's kernel time inside the bench's back-to-back calls; a
#           BEFORE_DIR older than the FP8 kernel tables prints bf16's only), then
#           dev/gpu/bench_rounds.py's table of each row's least µs per side (ROUND_TIMEOUT, 100
#           each)
#   queued  ROUNDS alternating rounds of dev/gpu/fp8_profile.py --queued, after then before, at
#           each of NUM_SMS: the GPU's µs per call of the layout kernel and of each format's
#           no-sync and cached dispatch with the calls queued (no host time), then
#           bench_rounds.py's table of each call's least µs per side (QUEUED_TIMEOUT, 60 each)
# Each side's modules run as `python3 -P -m` under that side's PYTHONPATH: plain `-m` puts the
# working directory first on sys.path, so every side would import this tree's package.
# MORE_SIDES="NAME=DIR ..." adds packages laid out as BEFORE_DIR to rounds and queued, run
# between after and before in each round (two trials and their base in one call).
# Logs land in .bench_out/fp8, or, under the device tool ($OUT set), in a scratch folder packed
# at exit into $OUT/fp8_logs.tgz beside copies of the summary and the tables (the tool returns
# at most eight files).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
if [ $# -ne 2 ] || [ ! -d "$1" ] || [ ! -d "$2/megatron_deepep" ]; then
  echo "usage: bash dev/gpu/fp8.sh WHEELS_DIR BEFORE_DIR (BEFORE_DIR/megatron_deepep must exist)"
  exit 2
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
dry() { [ "${DRY_RUN:-0}" = 1 ]; }
WHEELS_DIR=$(cd "$1" && pwd)
BEFORE=$(cd "$2" && pwd)
if [ -n "${OUT:-}" ] && ! dry; then
  LOGS=$(mktemp -d)
  # Every log in one archive; the summary and the tables also as files of their own.
  trap 'tar czf "$OUT/fp8_logs.tgz" -C "$LOGS" . && cp "$LOGS"/fp8_summary.txt "$LOGS"/*.md \
    "$OUT"/ 2>/dev/null' EXIT
else
  LOGS=.bench_out/fp8
fi
mkdir -p "$LOGS"
BUDGET_S=${BUDGET:-570}
PIECES=${PIECES:-check tests after before ncu host layer tests2}
export MDEEP_CACHE_DIR=${MDEEP_CACHE_DIR:-$PWD/.bench_out/fp8_kernel_cache}
SHAPE=4096,7168,256,8
FORMATS=${FORMATS:-blockwise_1x128,mxfp8_1x32,blockwise_1x128_fp32_scales}
NUM_SMS=${NUM_SMS:-24,132}
source dev/gpu/time_limit.sh  # run LIMIT LOG command...: never past BUDGET_S

# piece NAME LIMIT LOG command...: time_limit.sh's `run` unless the budget is short of half the
# limit; one summary line.
SUMMARY=()
piece() {
  local name=$1 limit=$2 log=$3 t0=$SECONDS rc
  shift 3
  if dry; then echo "dry run: $name (limit $limit s, $log): $*"; return 0; fi
  if (( BUDGET_S - SECONDS < limit / 2 )); then
    SUMMARY+=("$name: skipped (budget)"); return 99
  fi
  echo "fp8.sh: [$SECONDS s] $name: start (limit $limit s)"
  run "$limit" "$LOGS/$log" "$@" > /dev/null
  rc=$?
  SUMMARY+=("$name: rc $rc in $((SECONDS - t0)) s ($log)")
  echo "fp8.sh: [$SECONDS s] $name: rc $rc"
  return $rc
}

if ! dry; then
  source dev/gpu/wheels.sh
  WHEELS_DIR=$WHEELS_DIR install_wheels_if_any fp8 || exit 2
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    | tee "$LOGS/fp8_versions.txt"
  python3 -c "import torch, megatron.core as m, transformer_engine as te; \
print('torch', torch.__version__, '| megatron-core', m.__version__, '| TE', te.__version__)" \
    2>&1 | tail -n 1 | tee -a "$LOGS/fp8_versions.txt"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo 'no .git here')" \
    >> "$LOGS/fp8_versions.txt"
fi
HERE_PATH=$PWD:${PYTHONPATH:-}
BEFORE_PATH=$BEFORE:${PYTHONPATH:-}
# MORE_SIDES="NAME=DIR ...": more packages for the rounds and queued pieces, run between after
# and before in each round (e.g. a second trial beside this tree).
declare -A SIDE_PATH=([after]=$HERE_PATH [before]=$BEFORE_PATH)
ROUND_SIDES=(after)
for pair in ${MORE_SIDES:-}; do
  name=${pair%%=*} dir=${pair#*=}
  if [ "$name" = "$pair" ] || [ ! -d "$dir/megatron_deepep" ]; then
    echo "fp8.sh: MORE_SIDES wants NAME=DIR with DIR/megatron_deepep, got '$pair'"; exit 2
  fi
  SIDE_PATH[$name]=$(cd "$dir" && pwd):${PYTHONPATH:-}
  ROUND_SIDES+=("$name")
done
ROUND_SIDES+=(before)
# The kernels of BEFORE_DIR and MORE_SIDES into the kernel cache (-j nproc) before their timed
# pieces.
precompile_other_sides() {
  local side
  for side in "${ROUND_SIDES[@]:1}"; do
    env PYTHONPATH="${SIDE_PATH[$side]}" python3 -P -m megatron_deepep.tools.precompile --topk 8 \
      --index-dtype int64 --fp8 ${FORMATS//,/ } --bench -j "$(nproc)" -q
  done
}
NCU_KERNELS="regex:dispatch_local|layout_kernel"
NCU_ARGS=(--clock-control none --kernel-name "$NCU_KERNELS" --section SpeedOfLight
  --section Occupancy --section LaunchStats --section WarpStateStats
  --section MemoryWorkloadAnalysis)
read -r -a NCU_EXTRA_ARGS <<< "${NCU_EXTRA:-}"
NCU_ARGS+=("${NCU_EXTRA_ARGS[@]}")
for name in $PIECES; do
  case $name in
    check)
      piece check "${CHECK_TIMEOUT:-90}" fp8_check.log env PYTHONPATH="$HERE_PATH" bash -c \
        "python3 -P -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 --fp8 \
        ${FORMATS//,/ } --bench -j $(nproc) -q \
        && python3 dev/gpu/fp8_profile.py --check --fp8 $FORMATS"
      dry || grep -E "precompile:|check " "$LOGS/fp8_check.log" ;;
    tests)
      piece tests "${TEST_TIMEOUT:-150}" fp8_tests.log env MDEEP_TEST_PROCS=1 \
        PYTHONPATH="$HERE_PATH" python3 -m pytest -m gpu -q -rs \
        tests/gpu/test_fp8_dispatch_gpu.py ${TEST_FILES-tests/gpu/test_fp8_gpu.py} ;;
    tests2)
      piece tests2 "${TEST_TIMEOUT:-150}" fp8_tests2.log env MDEEP_TEST_PROCS=2 \
        PYTHONPATH="$HERE_PATH" python3 -m pytest -m gpu -q -rs \
        tests/gpu/test_fp8_dispatch_gpu.py ;;
    after)
      piece after "${AFTER_TIMEOUT:-170}" fp8_bench_after.log env PYTHONPATH="$HERE_PATH" \
        python3 -P -m megatron_deepep.bench --shapes "$SHAPE" --num-sms "$NUM_SMS" \
        --fp8 "$FORMATS" --out "$LOGS/after" ${AFTER_ARGS:-} ;;
    before)
      dry || precompile_other_sides
      piece before "${BEFORE_TIMEOUT:-120}" fp8_bench_before.log env PYTHONPATH="$BEFORE_PATH" \
        python3 -P -m megatron_deepep.bench --shapes "$SHAPE" --num-sms "$NUM_SMS" \
        --fp8 "$FORMATS" --no-megatron --out "$LOGS/before" ;;
    ncu)
      NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu \
        2>/dev/null | head -n 1)
      if [ -z "$NCU" ] && dry; then NCU=ncu; fi  # the plan, wherever ncu is
      if [ -z "$NCU" ]; then
        SUMMARY+=("ncu: not found on PATH, in /usr/local/cuda/bin or /opt/nvidia"); continue
      fi
      piece "ncu after" "${NCU_TIMEOUT:-90}" fp8_ncu_after.log env PYTHONPATH="$HERE_PATH" \
        "$NCU" "${NCU_ARGS[@]}" python3 dev/gpu/fp8_profile.py --fp8 blockwise_1x128 \
        --num-sms "${NCU_SMS:-132}"
      piece "ncu before" "${NCU_TIMEOUT:-90}" fp8_ncu_before.log env PYTHONPATH="$BEFORE_PATH" \
        "$NCU" "${NCU_ARGS[@]}" python3 dev/gpu/fp8_profile.py --fp8 blockwise_1x128 \
        --num-sms "${NCU_SMS:-132}" ;;
    host)
      piece "host after" "${HOST_TIMEOUT:-60}" fp8_host_after.log env PYTHONPATH="$HERE_PATH" \
        python3 dev/gpu/fp8_profile.py --host --fp8 "$FORMATS"
      piece "host before" "${HOST_TIMEOUT:-60}" fp8_host_before.log \
        env PYTHONPATH="$BEFORE_PATH" python3 dev/gpu/fp8_profile.py --host --fp8 "$FORMATS"
      dry || grep -h "fp8_profile host:.*µs" "$LOGS"/fp8_host_after.log \
        "$LOGS"/fp8_host_before.log ;;
    timeline)
      piece timeline "${HOST_TIMEOUT:-60}" fp8_timeline.log env PYTHONPATH="$HERE_PATH" \
        python3 dev/gpu/fp8_profile.py --timeline --fp8 "${FORMATS%%,*}" \
        --num-sms "${NUM_SMS##*,}"
      dry || grep -h "fp8_profile timeline:" "$LOGS/fp8_timeline.log" ;;
    breakdown)
      for side in ${BREAKDOWN_SIDES:-after before}; do
        if [ -z "${SIDE_PATH[$side]:-}" ]; then
          SUMMARY+=("breakdown $side: no such side (after, before or MORE_SIDES)"); continue
        fi
        piece "breakdown $side" "${HOST_TIMEOUT:-60}" fp8_breakdown_$side.log \
          env PYTHONPATH="${SIDE_PATH[$side]}" python3 dev/gpu/host_breakdown.py \
          --fp8 "${FORMATS%%,*}" --num-sms "${NUM_SMS##*,}"
      done ;;
    layer)
      piece layer "${LAYER_TIMEOUT:-150}" fp8_layer.log env PYTHONPATH="$HERE_PATH" \
        python3 -P -m megatron_deepep.bench.layer --te --variants \
        "${LAYER_VARIANTS:-te-alltoall-fused,te-alltoall,te-deepep-bf16,te-deepep-fp8-dequant,\
te-deepep-fp8-experts}" \
        --iters 20 --out "$LOGS/fp8_layer.json" ${LAYER_ARGS:-} ;;
    rounds)
      dry || precompile_other_sides
      round_files=()
      for i in $(seq "${ROUNDS:-2}"); do
        for side in "${ROUND_SIDES[@]}"; do
          piece "round $i $side" "${ROUND_TIMEOUT:-100}" fp8_round${i}_$side.log \
            env PYTHONPATH="${SIDE_PATH[$side]}" python3 -P -m megatron_deepep.bench \
            --shapes "$SHAPE" --num-sms "$NUM_SMS" --fp8 "$FORMATS" --no-megatron --profile \
            --out "$LOGS/round${i}_$side"
          round_files+=("$side=$LOGS/round${i}_$side/bench.json")
        done
      done
      if dry; then echo "dry run: rounds table: python3 dev/gpu/bench_rounds.py ${round_files[*]}"
      else python3 dev/gpu/bench_rounds.py "${round_files[@]}" | tee "$LOGS/fp8_rounds.md"; fi ;;
    queued)
      dry || precompile_other_sides
      queued_logs=()
      for i in $(seq "${ROUNDS:-2}"); do
        for side in "${ROUND_SIDES[@]}"; do
          for sms in ${NUM_SMS//,/ }; do
            log=fp8_queued${i}_${side}_$sms.log
            piece "queued $i $side $sms" "${QUEUED_TIMEOUT:-60}" "$log" \
              env PYTHONPATH="${SIDE_PATH[$side]}" python3 dev/gpu/fp8_profile.py --queued \
              --fp8 "$FORMATS" --num-sms "$sms"
            queued_logs+=("$side=$LOGS/$log")
          done
        done
      done
      if dry; then echo "dry run: queued table: python3 dev/gpu/bench_rounds.py ${queued_logs[*]}"
      else python3 dev/gpu/bench_rounds.py "${queued_logs[@]}" | tee "$LOGS/fp8_queued.md"; fi ;;
    *) echo "fp8.sh: unknown piece '$name' (check tests after before ncu host timeline breakdown" \
         "layer tests2 rounds queued)"
       exit 2 ;;
  esac
done
printf '%s\n' "fp8.sh: summary ($SECONDS s)" "${SUMMARY[@]}" | tee "$LOGS/fp8_summary.txt"
