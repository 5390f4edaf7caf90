#!/usr/bin/env bash
# The GPU tier and the benchmark on a GPU machine:
#   bash dev/gpu/gpu_tier.sh            # tests (N = 1,2,3,4,8 processes) then the benchmark
# Knobs: MDEEP_TEST_PROCS (default 1,2,3,4,8), MDEEP_TEST_CALLS (default 1000), SKIP_TESTS=1,
# SKIP_BENCH=1, OUT (log folder; default .bench_out), PYTEST_ARGS, BENCH_ARGS. Wheels in
# $WHEELS_DIR/
# (megatron-core) are installed into SITE_DIR first when present. Extras, off by default:
# NCU=1 (Nsight Compute speed-of-light of the dispatch and combine kernels), COMPARE_STEPS=N (the
# example trains N steps with deepep and alltoall; PROFILE_STEPS=M profiles M more per run),
# FP8_STEPS=N (FP8 vs bf16 dispatch, N steps), SANITIZE=1 (compute-sanitizer memcheck of
# dev/gpu/sanitize_ep1.py), MAIN_JOB=N (the README's main job, examples/run_gpt_moe.sh, N
# iterations with deepep and with alltoall, metrics on). On one H200 the 1000-call tier takes
# about 10 minutes (N = 8 alone ~170 s): to run it in shorter pieces, split it, e.g.
# MDEEP_TEST_PROCS=1,2,3, then MDEEP_TEST_PROCS=4,8.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1  # MDEEP_CACHE_DIR: the package's per-user cache unless set
OUT=${OUT:-.bench_out}
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/wheels.sh"
install_wheels_if_any gpu_tier || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, cuda.bindings as cb; print('torch', torch.__version__,
  'cuda-bindings', cb.__version__)"
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m gpu tests/gpu -x -q -rs ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/gpu_tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout ${BENCH_TIMEOUT:-240} python3 -m megatron_deepep.bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log"
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  timeout 240 "$sanitizer" --tool memcheck python3 dev/gpu/sanitize_ep1.py \
    > "$OUT/memcheck.log" 2>&1
  grep -E "sanitize_ep1:|Program hit|Invalid|ERROR SUMMARY" "$OUT/memcheck.log" | sort | uniq -c
fi
if [ "${MAIN_JOB:-0}" != 0 ]; then
  for dispatcher in deepep alltoall; do
    INSTALL=0 DISPATCHER=$dispatcher TRAIN_ITERS=$MAIN_JOB METRICS=1 \
      OUT="$OUT/gpt_moe_$dispatcher" \
      timeout 240 bash examples/run_gpt_moe.sh > "$OUT/main_job_$dispatcher.log" 2>&1
    echo "main job ($dispatcher): rc $?"
    grep -E "iteration +($MAIN_JOB|1)/|Error|error" "$OUT/main_job_$dispatcher.log" | tail -5
  done
  python -m megatron_deepep.tools.plot_metrics "$OUT/gpt_moe_deepep/metrics" \
    --out "$OUT/metrics_png" 2>&1 \
    | tail -3
fi
if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  kernels="dispatch_recv|dispatch_local|combine_reduce|combine_local"
  timeout 180 ncu --section SpeedOfLight --kernel-name regex:"$kernels" \
    --launch-skip 6 --launch-count 2 python3 -m megatron_deepep.bench --no-megatron --fp8 '' \
    --shapes 4096,7168,256,8 --num-sms 132 2>&1 \
    | grep -E "$kernels|Throughput|Duration" | tee "$OUT/ncu.log"
fi
if [ "${COMPARE_STEPS:-0}" != 0 ]; then
  timeout 300 python3 examples/compare_dispatchers.py --steps "$COMPARE_STEPS" \
    --profile-steps "${PROFILE_STEPS:-0}" --out "$OUT/compare" 2>&1 | tail -20
fi
if [ "${FP8_STEPS:-0}" != 0 ]; then
  timeout 400 python3 examples/compare_dispatchers.py --steps "$FP8_STEPS" \
    --fp8-dispatch blockwise --out "$OUT/compare_fp8" 2>&1 | tail -20
fi
exit $rc
