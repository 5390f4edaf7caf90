#!/usr/bin/env bash
# The deepep MoE layer under Megatron's own CUDA-graph managers, one GPU:
#   bash dev/gpu/gpu_graphs.sh
# Needs in the repo's WHEELS_DIR (default .whl/): the megatron-core 0.19.2 wheel and, for the
# --cuda-graph-impl transformer_engine cases, the TE wheel set of
# the TE 2.20.2 wheels built for the machine  (transformer_engine, transformer_engine_cu13,
# transformer_engine_torch, pydantic and its three dependencies). All wheels are installed
# together, in ONE pip command (one at a time with --target silently drops TE's extension .so),
# into SITE_DIR. Without the TE wheels the transformer_engine cases skip, saying why.
# Then: precompiles the kernels the cases use (top-k 2, bf16) into MDEEP_CACHE_DIR (default
# the per-user cache) and runs tests/gpu/test_megatron_graphs_gpu.py: `--cuda-graph-impl local`
# (CudaGraphManager; whole layer, moe, moe_router / moe_preprocess, attn) and
# `transformer_engine` (TECudaGraphHelper; whole layer, moe, moe_router, moe_preprocess), each
# against an eager twin over 5 steps, at EP = 1, and whole-layer graphs of both impls at EP = 2
# (two processes sharing the GPU, the NVLink kernels). Prints one line per test and a count;
# full log and JUnit XML in $OUT (default .graphs_out). Knobs: PYTEST_ARGS (e.g. -k local, or
# -k "not ep_2" to split the run), TEST_TIMEOUT (default 480 s). Exit status: pytest's. About
# 3 to 5 minutes on one H200.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1  # MDEEP_CACHE_DIR: the package's per-user cache unless set
OUT=${OUT:-.graphs_out}
mkdir -p "$OUT"
t0=$(date +%s)
if ! ls "$WHEELS_DIR"/megatron_core-*.whl >/dev/null 2>&1; then
  echo "gpu_graphs: FAIL no $WHEELS_DIR/megatron_core-*.whl (the tests need megatron-core 0.19.2)"
  exit 2
fi
if ! ls "$WHEELS_DIR"/transformer_engine_torch-*.whl >/dev/null 2>&1; then
  echo "gpu_graphs: note: no TE wheels in $WHEELS_DIR/ (copy the TE 2.20.2 wheels" \
    "built for the machine " \
    "*.whl there): the transformer_engine cases will skip"
fi
source "$(dirname "${BASH_SOURCE[0]}")/wheels.sh"
install_wheels gpu_graphs || exit 2
print_versions gpu_graphs
timeout 240 python3 -m megatron_deepep.tools.precompile --topk 2 --row-dtype bf16 \
  --index-dtype int64 \
  -q 2>&1 | tail -2
t1=$(date +%s)
# shellcheck disable=SC2086
timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -m gpu tests/gpu/test_megatron_graphs_gpu.py \
  -q -rA -p no:cacheprovider --junitxml="$OUT/graphs.xml" ${PYTEST_ARGS:-} \
  > "$OUT/graphs.log" 2>&1
rc=$?
echo "gpu_graphs: pytest rc $rc in $(( $(date +%s) - t1 )) s (log $OUT/graphs.log)"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED) " "$OUT/graphs.log" \
  | sed -E 's#tests/gpu/test_megatron_graphs_gpu\.py::test_##' \
  | awk '{status=$1; $1=""; printf "%-8s %s\n", status, substr($0, 2)}'
tail -1 "$OUT/graphs.log"
if [ $rc -ne 0 ]; then
  echo "gpu_graphs: errors in the log:"
  grep -E "^E |Error|assert" "$OUT/graphs.log" | head -30
fi
echo "gpu_graphs: total $(( $(date +%s) - t0 )) s"
exit $rc
