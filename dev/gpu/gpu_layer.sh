#!/usr/bin/env bash
# One Megatron MoE layer, forward + backward, per dispatcher variant, on one GPU (EP = 1):
#   bash dev/gpu/gpu_layer.sh
# 1. installs "$WHEELS_DIR"/*.whl (the megatron-core 0.19.2 wheel; for table B also the TE 2.20.2
# wheel
#    set built for the machine) into SITE_DIR in ONE pip command (one at a
#    time with --target silently drops TE's extension .so), as dev/gpu/gpu_te.sh does;
# 2. precompiles the dispatch/combine kernels of top-k 6 and 8 (bf16 and blockwise FP8) into
#    MDEEP_CACHE_DIR (default: the per-user cache);
# 3. table A: python3 -m megatron_deepep.bench.layer: a bf16 layer (H 4096, 64
#    experts, top-6, 8192 tokens) with alltoall, deepep synchronizing, deepep sync-free, and
#    deepep sync-free in a CUDA graph (its experts: GroupedMMExperts, also run eagerly);
# 4. table B: the same with --te: TE layers under the blockwise FP8 recipe, H 4096 /
#    64 experts / top-6 / 8192 tokens and H 7168 / 256 experts / top-8 / 4096 tokens: alltoall,
#    deepep bf16 dispatch, deepep FP8 dispatch dequantized into TEGroupedMLP, deepep FP8
#    dispatch into the FP8 experts (skipped, with the reason, when TE does not import);
#    VARIANTS_B picks its rows, e.g. adding te-deepep-fp8-experts-dequant-colwise (the FP8
#    experts making their wgrad's columnwise copy by dequantize + TE instead of the kernel).
# Prints both markdown tables; logs and JSON (layer_a.json, layer_b.json) in $OUT (default
# .bench_out). Knobs: TABLES ("A B"; "A" or "B" runs one: under a 10-minute limit per command,
# run them in two calls), ITERS (20), TIMEOUT_PRECOMPILE (180 s), TIMEOUT_A (380 s),
# TIMEOUT_B (400 s), ARGS_A / ARGS_B (more bench_layer arguments). Exit status: the first
# failing step's (a failed variant is a row, not a failure).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1  # MDEEP_CACHE_DIR: the package's per-user cache unless set
OUT=${OUT:-.bench_out}
ITERS=${ITERS:-20}
mkdir -p "$OUT"
t0=$(date +%s)
if ! ls "$WHEELS_DIR"/*.whl >/dev/null 2>&1; then
  echo "gpu_layer: FAIL no $WHEELS_DIR/*.whl (copy the megatron-core 0.19.2 wheel" \
    "and, for table B," \
    "the TE 2.20.2 wheels built for the machine *.whl into $WHEELS_DIR/)"
  exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/wheels.sh"
install_wheels gpu_layer || exit 2
print_versions gpu_layer
timeout "${TIMEOUT_PRECOMPILE:-180}" python3 -m megatron_deepep.tools.precompile --topk 6 8 \
  --row-dtype bf16 --fp8 blockwise_1x128 --index-dtype int64 -q 2>&1 | tail -2
rc=0
TABLES=${TABLES:-A B}
if [[ " $TABLES " == *" A "* ]]; then
t1=$(date +%s)
# shellcheck disable=SC2086
timeout "${TIMEOUT_A:-380}" python3 -m megatron_deepep.bench.layer --iters "$ITERS" \
  --out "$OUT/layer_a.json" ${ARGS_A:-} > "$OUT/layer_a.log" 2>&1
rc_a=$?
echo "gpu_layer: table A rc $rc_a in $(( $(date +%s) - t1 )) s (log $OUT/layer_a.log)"
grep -E "^\|" "$OUT/layer_a.log"
if [ $rc_a -ne 0 ]; then
  rc=$rc_a
  grep -E "Error|error|Traceback" "$OUT/layer_a.log" | tail -8
  tail -n 5 "$OUT/layer_a.log"
fi
fi
if [[ " $TABLES " == *" B "* ]]; then
t2=$(date +%s)
DEFAULT_VARIANTS_B=te-alltoall,te-deepep-bf16,te-deepep-fp8-dequant,te-deepep-fp8-experts
# shellcheck disable=SC2086
timeout "${TIMEOUT_B:-400}" python3 -m megatron_deepep.bench.layer --te --iters "$ITERS" \
  --variants "${VARIANTS_B:-$DEFAULT_VARIANTS_B}" \
  --out "$OUT/layer_b.json" ${ARGS_B:-} > "$OUT/layer_b.log" 2>&1
rc_b=$?
echo "gpu_layer: table B rc $rc_b in $(( $(date +%s) - t2 )) s (log $OUT/layer_b.log)"
grep -E "^\|" "$OUT/layer_b.log"
if [ $rc_b -ne 0 ]; then
  [ $rc -eq 0 ] && rc=$rc_b
  grep -E "Error|error|Traceback" "$OUT/layer_b.log" | tail -8
  tail -n 5 "$OUT/layer_b.log"
fi
fi
echo "gpu_layer: total $(( $(date +%s) - t0 )) s"
exit $rc
