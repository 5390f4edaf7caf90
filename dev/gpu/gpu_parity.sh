#!/usr/bin/env bash
# The parity GPU tests in one call on a GPU machine:
#   bash dev/gpu/gpu_parity.sh
# 1. installs megatron-core from .whl/ into SITE_DIR (as dev/gpu/gpu_tier.sh does);
# 2. precompiles the kernels the tests use (top-k 1, 2, 4, 8; bf16, fp16 and fp32 combine) in
#    parallel into MDEEP_CACHE_DIR (default: the per-user cache);
# 3. runs tests/gpu/test_parity_*.py: fp16 / fp32 / bf16 rows on the local (N = 1) and NVLink
#    (N = 2-8 processes sharing the GPU) kernels against the reference; sync-free dispatch and
#    combine under torch.cuda.set_sync_debug_mode("error") and the overflow error; Megatron's
#    MoELayer at EP = N (NVLink) against EP = 1 (local kernels); the MoELayer captured in a
#    CUDA graph (forward + backward) and replayed against eager runs;
# 4. with GRAPHS=1, runs tests/gpu/test_megatron_graphs_gpu.py in a second pytest process
#    (Megatron's graph managers keep global state): the layer under Megatron's own CUDA graphs,
#    --cuda-graph-impl local and transformer_engine (the latter needs the TE wheels in $WHEELS_DIR/,
#    installed by the same single pip command; else those cases skip). Off by default, to keep
#    this call under 10 minutes: `bash dev/gpu/gpu_graphs.sh` runs only that, in about 4;
# 5. prints one line per test and a count.
# Knobs: MDEEP_TEST_PROCS (default 1,2,8; e.g. 3,4 in a second call), PYTEST_ARGS, TEST_TIMEOUT
# (default 480 s), GRAPHS=1 and GRAPHS_TIMEOUT (default 540 s), OUT (log folder; default
# .parity_out). About 5 to 8 minutes on one H200 (GRAPHS=1: about 4 more).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1  # MDEEP_CACHE_DIR: the package's per-user cache unless set
export MDEEP_TEST_PROCS=${MDEEP_TEST_PROCS:-1,2,8}
OUT=${OUT:-.parity_out}
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/wheels.sh"
install_wheels_if_any gpu_parity || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>/dev/null \
  || echo "megatron-core: not installed (the CUDA-graph layer test will skip)"
timeout 240 python3 -m megatron_deepep.tools.precompile --topk 1 2 4 8 --row-dtype bf16 fp16 fp32 \
  -q 2>&1 | tail -2
timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -m gpu tests/gpu/test_parity_dtypes_gpu.py \
  tests/gpu/test_parity_syncfree_gpu.py tests/gpu/test_parity_ep_gpu.py \
  tests/gpu/test_parity_graphs_gpu.py -q -rA \
  -p no:cacheprovider ${PYTEST_ARGS:-} > "$OUT/gpu_parity.log" 2>&1
rc=$?
graphs_rc=0
logs=gpu_parity
if [ "${GRAPHS:-0}" = 1 ]; then
  timeout "${GRAPHS_TIMEOUT:-540}" python3 -m pytest -m gpu \
    tests/gpu/test_megatron_graphs_gpu.py -q -rA -p no:cacheprovider ${PYTEST_ARGS:-} \
    > "$OUT/gpu_graphs.log" 2>&1
  graphs_rc=$?
  logs="gpu_parity gpu_graphs"
fi
for log in $logs; do
  echo "--- $log GPU tests (MDEEP_TEST_PROCS=$MDEEP_TEST_PROCS), log: $OUT/$log.log"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED) " "$OUT/$log.log" \
    | sed -E 's#tests/gpu/test_(parity_|megatron_)?##; s#_gpu\.py::test_# #' \
    | awk '{status=$1; $1=""; printf "%-8s %s\n", status, substr($0, 2)}'
  tail -1 "$OUT/$log.log"
done
if [ $rc -ne 0 ] || [ $graphs_rc -ne 0 ]; then
  for log in $logs; do grep -hE "Error|assert|Timeout" "$OUT/$log.log"; done | head -20
fi
[ $rc -ne 0 ] && exit $rc
exit $graphs_rc
