#!/usr/bin/env bash
# One GPU call for the operations tooling, on a machine with one or more GPUs:
#   bash dev/gpu/gpu_ops.sh
# 0. python -m megatron_deepep.tools.precompile: the kernels below, compiled in parallel;
# 1. tests/gpu/test_sweep_gpu.py (the sweep's measurements on a small shape);
# 2. python -m megatron_deepep.tools.sweep for the four families of examples/configs/ (their
# full-size
#    shapes, measured at EP = 1 on this GPU, modeled for 1-8 nodes): $OUT/sweep_<family>/sweep.json,
#    the model's constants fitted to the measurements, the check of the model against every
#    measured call (1.00: it fits) and the recommendation;
# 3. each family's scaled-down proxy (bash examples/configs/<family>.sh, TRAIN_ITERS steps,
#    metrics on): wall time, the first and last iteration lines, $OUT/<family>/metrics/report.html.
# Every piece has a time limit, and the whole stays under BUDGET_S (default 560) seconds: pieces
# that no longer fit are skipped and say so. A piece still running at its limit gets SIGABRT in
# its Python processes (torchrun's workers included), which print their Python stacks into its
# log first (dev/gpu/time_limit.sh): the lines after "limit reached" say where it waited. Wheels
# in $WHEELS_DIR/ (megatron-core) are installed into SITE_DIR first when present. Knobs: OUT
# (default
# .bench_out/ops), TRAIN_ITERS (default 20), FAMILIES (default "deepseek_v3 qwen3_moe mixtral
# gpt_oss"), SWEEP_ARGS, SWEEP=0 (proxies only), MDEEP_GROUPED_MM_EXPERTS (default 1: the
# proxies' grouped experts; 0: Megatron's SequentialMLP).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1  # MDEEP_CACHE_DIR: the package's per-user cache unless set
OUT=${OUT:-.bench_out/ops}
BUDGET_S=${BUDGET_S:-560}
FAMILIES=${FAMILIES:-"deepseek_v3 qwen3_moe mixtral gpt_oss"}
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/wheels.sh"
install_wheels_if_any gpu_ops || exit 2
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

# run LIMIT_S LOG command... (time_limit.sh): a piece that outlives its limit prints the Python
# stacks of its processes into its log (where a stalled step waits), then ends.
source "$(dirname "${BASH_SOURCE[0]}")/time_limit.sh"

# The kernels every piece below needs, compiled in parallel into the cache first.
run 120 "$OUT/precompile.log" python3 -m megatron_deepep.tools.precompile --topk 2 4 8 \
  --fp8 blockwise_1x128 mxfp8_1x32 --index-dtype int64 -j "$(nproc)" -q
tail -n 1 "$OUT/precompile.log"
if [ "${SWEEP:-1}" = 1 ]; then
run 90 "$OUT/test_sweep_gpu.log" python3 -m pytest -m gpu tests/gpu/test_sweep_gpu.py -x -q -rs
tail -n 3 "$OUT/test_sweep_gpu.log"
fi
for family in $([ "${SWEEP:-1}" = 1 ] && echo "$FAMILIES"); do
  run 80 "$OUT/sweep_$family.log" python3 -m megatron_deepep.tools.sweep --family "$family" \
    --num-sms 24,132 --nodes 1,2,4,8 --out "$OUT/sweep_$family" ${SWEEP_ARGS:-}
  grep -E "^model const|^  (dispatch|combine)|^check|^  top-|^  expert GEMMs|^recommended|Error" \
    "$OUT/sweep_$family.log" | cut -c1-240 | head -24
done
for family in $FAMILIES; do
  run 110 "$OUT/proxy_$family.log" env INSTALL=0 TRAIN_ITERS="${TRAIN_ITERS:-20}" \
    OUT="$OUT/$family" bash "examples/configs/$family.sh"
  grep -E "iteration +1/|iteration +${TRAIN_ITERS:-20}/|Error|error:|report.html|GROUPED_MM" \
    "$OUT/proxy_$family.log" | cut -c1-300 | tail -7
  python3 - "$OUT/proxy_$family.log" <<'PY'
import re, sys
from datetime import datetime
stamps = [datetime.fromisoformat(m.group(1)) for m in re.finditer(
    r"\[([0-9-]+ [0-9:.]+)\] iteration +\d+/", open(sys.argv[1], errors="replace").read())]
steps = sorted((b - a).total_seconds() for a, b in zip(stamps, stamps[1:]))
if steps:
    print(f"training: {len(stamps)} iterations, {sum(steps):.1f} s after the first, median "
          f"{1e3 * steps[len(steps) // 2]:.0f} ms/step, slowest {1e3 * steps[-1]:.0f} ms")
PY
  if grep -q "limit reached" "$OUT/proxy_$family.log"; then  # the last iteration and the stack
    grep -E "iteration +[0-9]+/" "$OUT/proxy_$family.log" | tail -1 | cut -c1-200
    sed -n '/limit reached/,$p' "$OUT/proxy_$family.log" | grep -E "^  File|^Thread|^Current" \
      | head -60
  fi
done
echo "total $SECONDS s"
