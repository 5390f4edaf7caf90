#!/usr/bin/env bash
# The GPU tier in pieces that fit one 10-minute call, each under its own limit, logs to $OUT:
#   bash dev/gpu/tier_round.sh WHEELS_DIR  # PIECES="precompile nvlink internode parity-te ring"
#   DRY_RUN=1 bash dev/gpu/tier_round.sh WHEELS_DIR  # the plan; runs nothing
# WHEELS_DIR: the TE 2.20.2 set and megatron-core 0.19.2 (the parity piece needs them).
# Pieces (PIECES, in the order given; never past BUDGET, 570 s):
#   precompile the NVLink kernels of every top-k, FP8 format and row dtype into the kernel
#              cache (-j nproc), before the multi-process pieces: else each test process
#              compiles its own, all at once
#   nvlink     tests/gpu/test_nvlink_gpu.py at 3, 4 and 8 processes (NVLINK_PROCS), CALLS calls
#   internode  tests/gpu/test_internode_gpu.py -k matches_reference on the virtual node shapes
#              NODES (default 2x2,3x2,2x3,4x2,2x4), CALLS calls
#   parity-te  tests/gpu/test_parity_te_gpu.py (Megatron's MoELayer with TE, deepep vs alltoall)
#   ring       tests/gpu/test_internode_gpu.py -k "small_ring or small_net_ring" (the ring and
#              network-ring stagings)
#   graphs     tests/gpu/test_megatron_graphs_gpu.py (Megatron's --cuda-graph-impl choices)
#   files      every other tests/gpu file at 1 and 2 processes
# CALLS (default 30) is MDEEP_TEST_CALLS. One summary line per piece, last.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
[ $# -eq 1 ] && [ -d "$1" ] || { echo "usage: bash dev/gpu/tier_round.sh WHEELS_DIR"; exit 2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 MDEEP_TEST_CALLS=${CALLS:-30}
export MDEEP_CACHE_DIR=${MDEEP_CACHE_DIR:-$PWD/.bench_out/tier_kernel_cache}
LOGS=${OUT:-.bench_out/tier_round}
mkdir -p "$LOGS"
BUDGET_S=${BUDGET:-570}
PIECES=${PIECES:-precompile nvlink internode parity-te ring}
SUMMARY=()
source dev/gpu/time_limit.sh  # run LIMIT LOG command...
if [ "${DRY_RUN:-0}" != 1 ]; then
  source dev/gpu/wheels.sh
  WHEELS_DIR=$(cd "$1" && pwd) install_wheels_if_any tier || exit 2
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    | tee "$LOGS/tier_versions.txt"
fi
# piece NAME LIMIT command...: pytest under time_limit.sh's `run` (its limit, never past
# BUDGET_S); the counts line into the summary.
piece() {
  local name=$1 limit=$2 t0=$SECONDS rc log="$LOGS/tier_$1.log"
  shift 2
  if [ "${DRY_RUN:-0}" = 1 ]; then echo "dry run: $name (limit $limit s): $*"; return; fi
  (( BUDGET_S - SECONDS < 45 )) && { SUMMARY+=("$name: skipped (budget)"); return; }
  echo "tier_round: [$SECONDS s] $name: start (limit $limit s)"
  run "$limit" "$log" "$@" > /dev/null
  rc=$?
  SUMMARY+=("$name: rc $rc in $((SECONDS - t0)) s: $(grep -E "passed|failed|error|skipped" "$log" \
    | tail -n 1 | cut -c1-160)")
  echo "tier_round: [$SECONDS s] $name: rc $rc"
}
PYTEST=(python3 -m pytest -m gpu -q -rs --durations=5)
for name in $PIECES; do
  case $name in
    precompile) piece precompile 150 python3 -m megatron_deepep.tools.precompile \
      --topk 1 2 4 6 8 16 --index-dtype int64 --fp8 blockwise_1x128 mxfp8_1x32 \
      --row-dtype bf16 fp16 fp32 -j "$(nproc)" -q ;;
    nvlink) piece nvlink 180 env MDEEP_TEST_PROCS=${NVLINK_PROCS:-3,4,8} "${PYTEST[@]}" \
      tests/gpu/test_nvlink_gpu.py ;;
    internode) piece internode 200 env MDEEP_TEST_NODES=${NODES:-2x2,3x2,2x3,4x2,2x4} \
      "${PYTEST[@]}" tests/gpu/test_internode_gpu.py -k matches_reference ;;
    parity-te) piece parity-te 180 "${PYTEST[@]}" tests/gpu/test_parity_te_gpu.py ;;
    ring) piece ring 200 env MDEEP_TEST_NODES=2x1,2x2 "${PYTEST[@]}" \
      tests/gpu/test_internode_gpu.py -k "small_ring or small_net_ring" ;;
    graphs) piece graphs 240 "${PYTEST[@]}" tests/gpu/test_megatron_graphs_gpu.py ;;
    files) piece files 300 env MDEEP_TEST_PROCS=1,2 MDEEP_TEST_NODES=2x1 "${PYTEST[@]}" \
      tests/gpu --ignore=tests/gpu/test_nvlink_gpu.py --ignore=tests/gpu/test_internode_gpu.py ;;
    *) echo "tier_round: unknown piece '$name'"; exit 2 ;;
  esac
done
printf '%s\n' "tier_round: summary ($SECONDS s)" "${SUMMARY[@]}" | tee "$LOGS/tier_summary.txt"
