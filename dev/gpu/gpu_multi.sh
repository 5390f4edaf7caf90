#!/usr/bin/env bash
# The multi-GPU evidence on one host with 2, 4 or 8 GPUs: one process per GPU, NCCL as the control
# plane.
#   PIECES="bench" bash dev/gpu/gpu_multi.sh     # one piece, or several (run in the given order)
# Pieces (PIECES, default "bench tier main staging"), each under its time limit and never past
# BUDGET:
#   bench      python -m megatron_deepep.bench under torchrun at EP = #GPUs: 3 shapes, bf16 and
#              FP8 (blockwise, MXFP8), 24 SMs and all SMs, beside Megatron's alltoall, NCCL's
#              all_to_all_single of the same bytes and the peer-copy ceiling, in one run
#   tier       = tier2 tier4 tier8 (those that fit the GPUs), then internode
#   tierN      the GPU tier's EP > 1 tests at N ranks, one process per GPU over NCCL
#              (MDEEP_TEST_BACKEND=nccl MDEEP_TEST_PROCS=N): test_nvlink_gpu,
#              test_fp8_dispatch_gpu, test_parity_dtypes_gpu, test_parity_syncfree_gpu,
#              test_parity_ep_gpu (Megatron's MoELayer at EP = N against EP = 1)
#   internode  test_internode_gpu on virtual nodes 2 x #GPUs/2 over real GPUs
#              (MDEEP_TEST_NODES=2xL), and test_internode_leg_gpu (4 GPUs: 2 x 2)
#   staging    python -m megatron_deepep.tools.multinode_check's sweep on virtual nodes 2 x #GPUs/2
# over real GPUs
#              (NVSHMEM's P2P path between the "nodes"), once per internode staging: full,
#              ring, ring + the network ring (K = 8); DeepSeek-V3's shape (4096 tokens per rank,
#              hidden 7168, top-8): dispatch and combine µs of each side by side in staging.log
#              (GPUs that run at once: the comparison one GPU's time-sliced processes cannot make)
#   main       examples/run_gpt_moe.sh at EP = #GPUs, MAIN_STEPS steps, with deepep (metrics on)
#              and with alltoall: first/last loss, median step time, the largest loss
#              difference between the two, the metrics PNGs
# Outputs at the top level of OUT (the device tool brings back at most 8 files): progress (one
# line per step with the elapsed seconds, then the summary table, also printed),
# bench_epN.json, bench_epN.log (the bench's printed tables), tier.log (per run: its tests'
# PASSED/FAILED/SKIPPED lines, and errors), main.log (per run: its summary and iteration
# lines), metrics_expert_load_heatmap.png, metrics_comm_time_per_layer.png, and logs.tar.gz
# (every full log: pytest, torchrun's ranks, training, precompile, bench.png), remade after
# each piece so that a run cut short still leaves it.
# Needs the megatron-core 0.19.2 wheel in the WHEELS_DIR (default .whl/) (dev/gpu/wheels.sh
# installs "$WHEELS_DIR"/ in
# one pip command into SITE_DIR); Transformer Engine is not needed.
# Device tool (one call <= 10 minutes; the kind, carry [".whl"], timeout_s 600):
#   nvidia-h200-x8  call 1: PIECES=bench bash dev/gpu/gpu_multi.sh
#                   call 2: PIECES="tier2 tier4 tier8" bash dev/gpu/gpu_multi.sh
#                   call 3: PIECES="main internode staging" bash dev/gpu/gpu_multi.sh
#   nvidia-h200-x2  call 1: PIECES="bench main" bash dev/gpu/gpu_multi.sh
#                   call 2: PIECES="tier staging" bash dev/gpu/gpu_multi.sh  # tier2 + internode
#   without a GPU:  DRY_RUN=1 NGPU=8 bash dev/gpu/gpu_multi.sh   # prints what it would run
# A piece that does not fit the budget is skipped, saying so: name it in the next call.
# Knobs: BUDGET (seconds for the whole script, default 560), NGPU (default: the GPUs torch
# sees), OUT (default .bench_out/multi), MAIN_STEPS (50), MDEEP_TEST_CALLS (the long test's
# back-to-back calls, 1000), BENCH_ARGS, PYTEST_ARGS, limits per piece: PRECOMPILE_TIMEOUT (150),
# BENCH_TIMEOUT (450), TIER_TIMEOUT (240 per N), INTERNODE_TIMEOUT (300), MAIN_TIMEOUT (200 per
# dispatcher), STAGING_TIMEOUT (120 per staging). NVLink multicast stays off: NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# and NVSHMEM_DISABLE_NVLS=1 are exported here, so every process it starts has them.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1  # MDEEP_CACHE_DIR: the package's per-user cache unless set
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$(dirname "$HERE")" || exit 2  # the repository root: tests and examples are named from it
OUT=${OUT:-.bench_out/multi}
BUDGET_S=${BUDGET:-560}
DRY_RUN=${DRY_RUN:-0}
PIECES=${PIECES:-bench tier main staging}
MAIN_STEPS=${MAIN_STEPS:-50}
TIER_TESTS="tests/gpu/test_nvlink_gpu.py tests/gpu/test_fp8_dispatch_gpu.py
  tests/gpu/test_parity_dtypes_gpu.py tests/gpu/test_parity_syncfree_gpu.py
  tests/gpu/test_parity_ep_gpu.py"
INTERNODE_TESTS="tests/gpu/test_internode_gpu.py tests/gpu/test_internode_leg_gpu.py"
PYTEST=(python3 -m pytest -m gpu -q -rA -p no:cacheprovider)
mkdir -p "$OUT"
rm -f "$OUT/progress" "$OUT/tier.log" "$OUT/main.log" "$OUT/staging.log"  # appended to below
# run LIMIT_S LOG command... (time_limit.sh): at most LIMIT_S and never past BUDGET_S; a piece
# still running at its limit leaves its Python processes' stacks in LOG.
source "$HERE/time_limit.sh"
source "$HERE/wheels.sh"

progress() {
  echo "gpu_multi: [$SECONDS s] $*"
  echo "[$SECONDS s] $*" >> "$OUT/progress"
}

# A dry run prints and records; a real one runs the command and reports what it found.
is_dry() { [ "$DRY_RUN" = 1 ]; }

if [ -z "${NGPU:-}" ]; then
  if is_dry; then echo "gpu_multi: a dry run needs NGPU (2, 4 or 8)"; exit 2; fi
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
fi
if ! [[ "$NGPU" =~ ^[0-9]+$ ]] || (( NGPU < 2 )); then
  echo "gpu_multi: needs 2 or more GPUs, found NGPU=$NGPU (one GPU: dev/gpu/gpu_tier.sh)"
  exit 2
fi

# PIECES -> the steps, checked before anything runs.
plan=()
for name in $PIECES; do
  case $name in
    bench|internode|main|staging) plan+=("$name") ;;
    tier) for n in 2 4 8; do (( n <= NGPU )) && plan+=("tier$n"); done; plan+=(internode) ;;
    tier[0-9]|tier[0-9][0-9]) plan+=("$name") ;;
    *) echo "gpu_multi: unknown piece '$name' in PIECES (bench, tier, tier2, tier4, tier8," \
         "internode, main, staging)"; exit 2 ;;
  esac
done
if is_dry; then
  LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_multi.dry-run.XXXXXX")
else
  LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_multi.XXXXXX")
fi
progress "start: ${#plan[@]} steps (${plan[*]}) on $NGPU GPUs, budget $BUDGET_S s," \
  "OUT=$OUT, full logs $LOGS (-> $OUT/logs.tar.gz)"

SUMMARY=()
FAILED=0
# summary NAME RC SECONDS RESULT: one row of the table printed at the end.
summary() {
  local rc=$2
  case $rc in 99) rc="99 (skipped: budget)" ;; 124) rc="124 (time limit)" ;; esac
  SUMMARY+=("| $1 | $rc | $3 | $4 |")
  case $2 in 0|-) ;; *) FAILED=1 ;; esac
}

# piece NAME LIMIT_S LOG command...: runs one piece (time_limit.sh's run) or, in a dry run,
# prints it; sets PIECE_RC and PIECE_S.
piece() {
  local name=$1 limit=$2 log=$3 t0=$SECONDS
  shift 3
  if is_dry; then
    if (( BUDGET_S - SECONDS < 20 )); then
      echo "skipped (budget): $*"
      PIECE_RC=99
    else
      echo "dry run: $name (limit $limit s, log $log): $*"
      PIECE_RC=0
    fi
  else
    progress "$name: start (limit $limit s, log $log)"
    run "$limit" "$log" "$@"
    PIECE_RC=$?
  fi
  PIECE_S=$((SECONDS - t0))
  progress "$name: rc $PIECE_RC in $PIECE_S s"
}

report() {
  if is_dry; then echo "dry run"; else python3 "$HERE/gpu_multi_report.py" "$@"; fi
}

bundle_logs() {
  is_dry || tar czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
}

# The kernels the chosen pieces use, compiled in parallel first (each rank would else compile
# its own on first use).
precompile() {
  local topks=() fp8=0 row_dtypes=0 bench_kernels=0 internode=0 step
  for step in "${plan[@]}"; do
    case $step in
      bench) topks+=(4 6 8); fp8=1; bench_kernels=1 ;;
      tier*|internode) topks+=(1 2 4 6 8 16); fp8=1; row_dtypes=1 ;;
      staging) topks+=(8); internode=1 ;;
      main) topks+=(2) ;;
    esac
  done
  # At most 64 compilers: the host's memory grows as it is first used (about 3 s per 8 GiB).
  # int64 expert ids only: the tests', the bench's and Megatron's.
  local num_jobs=$(( $(nproc) < 64 ? $(nproc) : 64 ))
  local args=(--topk $(printf '%s\n' "${topks[@]}" | sort -nu) --index-dtype int64
              -j "$num_jobs" -q)
  (( fp8 )) && args+=(--fp8 blockwise_1x128 mxfp8_1x32)
  (( row_dtypes )) && args+=(--row-dtype bf16 fp16 fp32)
  (( bench_kernels )) && args+=(--bench)
  (( internode )) && args+=(--internode)  # under auto staging: the families of all three
  piece precompile "${PRECOMPILE_TIMEOUT:-150}" "$LOGS/precompile.log" \
    python3 -m megatron_deepep.tools.precompile "${args[@]}"
  local result="dry run"
  if ! is_dry; then
    result=$(grep "^precompile: " "$LOGS/precompile.log" | tail -n 1 | cut -c1-160)
    result=${result:-no summary line (cut short? see precompile.log in logs.tar.gz)}
    echo "$result"
  fi
  summary precompile "$PIECE_RC" "$PIECE_S" "$result"
}

run_bench() {
  local name="bench EP $NGPU" folder="$LOGS/bench_ep$NGPU" log="$OUT/bench_ep$NGPU.log"
  # shellcheck disable=SC2086
  piece "$name" "${BENCH_TIMEOUT:-450}" "$log" python3 -m torch.distributed.run --standalone \
    --nproc-per-node "$NGPU" -m megatron_deepep.bench --out "$folder" ${BENCH_ARGS:-}
  if ! is_dry; then
    [ -f "$folder/bench.json" ] && cp "$folder/bench.json" "$OUT/bench_ep$NGPU.json"
    # The NVLink table here (both tables are in the log): the summary must stay in the tail
    # of what the device tool shows.
    sed -n '/^NVLink, EP = /,$p' "$log" | grep -v "^INFO\|^WARNING" | cut -c1-200 | head -80
  fi
  summary "$name" "$PIECE_RC" "$PIECE_S" "$(report bench "$OUT/bench_ep$NGPU.json")"
}

# tier_lines NAME LOG: the run's test lines (and errors, stacks) into $OUT/tier.log.
tier_lines() {
  {
    echo "=== $1: rc $PIECE_RC in $PIECE_S s (full log: logs.tar.gz/$(basename "$2"))"
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED) " "$2"
    if [ "$PIECE_RC" != 0 ]; then
      grep -E "Error|assert|Timeout|rank [0-9]+ failed" "$2" | head -30
      sed -n '/limit reached/,$p' "$2" | grep -E "^  File|^Thread|^Current" | head -60
    fi
    tail -n 1 "$2"
  } >> "$OUT/tier.log"
}

run_tier() {
  local num_ranks=$1 name="tier N=$1 (nccl)" log="$LOGS/tier_n$1.log"
  if (( num_ranks > NGPU || num_ranks < 2 )); then
    summary "$name" - 0 "not run: $num_ranks ranks need $num_ranks GPUs (2 or more); $NGPU here"
    return
  fi
  # shellcheck disable=SC2086
  run_nccl_pytest "$name" "${TIER_TIMEOUT:-240}" "$log" MDEEP_TEST_PROCS="$num_ranks" \
    $TIER_TESTS
}

# run_nccl_pytest NAME LIMIT LOG VAR=VALUE TESTS...: one piece of the tier over NCCL, its
# per-test lines and its summary row.
run_nccl_pytest() {
  local name=$1 limit=$2 log=$3 var=$4
  shift 4
  # shellcheck disable=SC2086
  piece "$name" "$limit" "$log" env MDEEP_TEST_BACKEND=nccl "$var" "${PYTEST[@]}" "$@" \
    ${PYTEST_ARGS:-}
  is_dry || tier_lines "$name" "$log"
  summary "$name" "$PIECE_RC" "$PIECE_S" "$(report pytest "$log")"
}

run_internode() {
  local per_node=$((NGPU / 2)) log="$LOGS/internode.log"
  local name="internode 2x$per_node (nccl)"
  if (( NGPU % 2 )); then
    summary "internode" - 0 "not run: 2 virtual nodes need an even number of GPUs ($NGPU)"
    return
  fi
  # shellcheck disable=SC2086
  run_nccl_pytest "$name" "${INTERNODE_TIMEOUT:-300}" "$log" MDEEP_TEST_NODES="2x$per_node" \
    $INTERNODE_TESTS
}

run_staging() {
  local per_node=$((NGPU / 2)) staging name log
  if (( NGPU % 2 )); then
    summary "staging" - 0 "not run: 2 virtual nodes need an even number of GPUs ($NGPU)"
    return
  fi
  local -A knobs=([full]="MDEEP_INTERNODE_STAGING=full"
                  [ring]="MDEEP_INTERNODE_STAGING=ring MDEEP_INTERNODE_NET_RING_CHUNKS=0"
                  [net]="MDEEP_INTERNODE_STAGING=ring MDEEP_INTERNODE_NET_RING_CHUNKS=8")
  for staging in full ring net; do
    name="staging $staging, 2 x $per_node" log="$LOGS/staging_$staging.log"
    # shellcheck disable=SC2086
    piece "$name" "${STAGING_TIMEOUT:-120}" "$log" env ${knobs[$staging]} python3 \
      python -m megatron_deepep.tools.multinode_check --spawn "$NGPU" \
        --num-ranks-per-node "$per_node" --skip-check \
      --sweep-tokens 4096 --sweep-hidden 7168 --json "$LOGS/staging_$staging.json"
    summary "$name" "$PIECE_RC" "$PIECE_S" "$(report staging "$LOGS/staging_$staging.json")"
    if ! is_dry; then
      {
        echo "=== $name: rc $PIECE_RC in $PIECE_S s (${knobs[$staging]})"
        grep -E "internode staging:|^ +[0-9]+ +[0-9]+ (dispatch|combine)|Error" "$log" | head -8
      } >> "$OUT/staging.log"
    fi
  done
}

run_main() {
  local dispatcher log png
  for dispatcher in deepep alltoall; do
    log="$LOGS/main_$dispatcher.log"
    piece "main $dispatcher" "${MAIN_TIMEOUT:-200}" "$log" env INSTALL=0 \
      DISPATCHER="$dispatcher" TRAIN_ITERS="$MAIN_STEPS" METRICS=1 \
      OUT="$LOGS/gpt_moe_$dispatcher" bash examples/run_gpt_moe.sh
    summary "main $dispatcher, EP $NGPU, $MAIN_STEPS steps" "$PIECE_RC" "$PIECE_S" \
      "$(report main "$log")"
    if ! is_dry; then
      {
        echo "=== main $dispatcher: rc $PIECE_RC in $PIECE_S s: $(report main "$log")"
        grep -E "iteration +[0-9]+/" "$log" | sed -n '1,3p;$p' | cut -c1-300
        [ "$PIECE_RC" != 0 ] && grep -E "Error|error:" "$log" | tail -8
      } >> "$OUT/main.log"
    fi
  done
  local compared
  compared=$(report main "$LOGS/main_deepep.log" "$LOGS/main_alltoall.log" | tail -n 1)
  summary "main deepep vs alltoall" - - "$compared"
  piece "metrics PNGs" 60 "$LOGS/plot_metrics.log" python -m megatron_deepep.tools.plot_metrics \
    "$LOGS/gpt_moe_deepep/metrics" --out "$LOGS/metrics_png"
  local pngs=""
  is_dry && pngs="dry run"
  if ! is_dry; then
    echo "=== deepep vs alltoall: $compared" >> "$OUT/main.log"
    for png in "$LOGS"/metrics_png/*.png; do
      [ -f "$png" ] || continue
      cp "$png" "$OUT/metrics_$(basename "$png")"
      pngs="$pngs $OUT/metrics_$(basename "$png")"
    done
  fi
  summary "metrics PNGs" "$PIECE_RC" "$PIECE_S" "${pngs:- none}"
}

if is_dry; then
  echo "dry run: install_wheels gpu_multi (.whl/*.whl into SITE_DIR, one pip command)"
else
  install_wheels gpu_multi || summary wheels 2 "$SECONDS" "pip could not install .whl/*.whl"
  print_versions gpu_multi
  nvidia-smi topo -m 2>/dev/null | head -n $((NGPU + 2))
fi
precompile
for step in "${plan[@]}"; do
  case $step in
    bench) run_bench ;;
    tier*) run_tier "${step#tier}" ;;
    internode) run_internode ;;
    main) run_main ;;
    staging) run_staging ;;
  esac
  bundle_logs
done

{
  echo "gpu_multi: summary ($NGPU GPUs, one process per GPU over NCCL; $SECONDS s of a" \
    "$BUDGET_S s budget)"
  echo "| step | rc | s | result |"
  echo "|---|---|---|---|"
  printf '%s\n' "${SUMMARY[@]}"
} | tee -a "$OUT/progress"
is_dry || ls -la "$OUT"
exit $FAILED
