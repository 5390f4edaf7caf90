#!/usr/bin/env bash
# Tiny GPT-MoE on every local GPU with --moe-token-dispatcher-type deepep (EP = number of GPUs).
#   bash examples/run_gpt_moe.sh [extra Megatron flags]   # megatron-core >= 0.17 (Python >= 3.12)
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/run_gpt_moe.sh   # 0.16: a Megatron-LM checkout
# The local (non-TE) layers need --no-rope-fusion and --no-persist-layer-norm without TE / Apex.
# Env: DISPATCHER (default deepep; alltoall to compare), TRAIN_ITERS (50), METRICS=1 (per-layer
# comm/load metrics, JSON lines in $OUT/metrics -> python scripts/plot_metrics.py $OUT/metrics),
# OUT (run folder, default runs/gpt_moe_<dispatcher>).
# FP8 dispatch (README, "FP8 dispatch"; hidden size % 16 == 0): pass our flag through, e.g.
#   bash examples/run_gpt_moe.sh --moe-mdeep-fp8-dispatch blockwise   # or mxfp8, auto, off
# (auto follows the active TE FP8 recipe and dispatches bf16 without one; with no TE recipe
# matching the wire format, the receiver dequantizes to bf16 rows for the experts).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"

NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${NGPU}" -lt 1 ]; then
  cat >&2 <<MSG
run_gpt_moe.sh: no CUDA GPU found. This example trains on GPUs (EP = number of GPUs).
On a machine without a GPU, run the CPU tier instead:
    python -m pytest -q tests/test_megatron_dispatcher.py tests/test_register.py \
        tests/test_metrics.py
MSG
  exit 1
fi
if ! python3 -c "import megatron.training" 2>/dev/null; then
  if [ -n "${MEGATRON_LM:-}" ]; then
    export PYTHONPATH="${MEGATRON_LM}:${PYTHONPATH:-}"
  else
    echo "run_gpt_moe.sh: megatron.training not importable (megatron-core wheels ship it" \
      "from 0.17 on, Python >= 3.12; 0.16 does not)." >&2
    echo "pip install 'megatron-core>=0.17' pyyaml, or set MEGATRON_LM=/path/to/Megatron-LM" \
      "(0.16+), or run python examples/compare_dispatchers.py (megatron-core only)." >&2
    exit 1
  fi
fi

DISPATCHER=${DISPATCHER:-deepep}
OUT=${OUT:-runs/gpt_moe_${DISPATCHER}}
mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="${REPO}:${PYTHONPATH:-}"
METRIC_FLAGS=()
if [ "${METRICS:-0}" = 1 ]; then
  METRIC_FLAGS=(--moe-mdeep-metrics --moe-mdeep-metrics-dir "$OUT/metrics" --moe-per-layer-logging)
fi

torchrun --standalone --nproc-per-node "$NGPU" "$HERE/pretrain_gpt_moe.py" \
  --num-layers 4 --hidden-size 512 --ffn-hidden-size 2048 --num-attention-heads 8 \
  --seq-length 1024 --max-position-embeddings 1024 --position-embedding-type rope \
  --micro-batch-size 4 --global-batch-size $((4 * NGPU)) \
  --train-iters "${TRAIN_ITERS:-50}" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine \
  --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 \
  --eval-iters 0 --eval-interval 1000000 --log-interval 1 --log-throughput \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
  --bf16 --disable-bias-linear --untie-embeddings-and-output-weights \
  --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion \
  --no-rope-fusion --no-persist-layer-norm \
  --num-experts 8 --moe-ffn-hidden-size 1024 --moe-router-topk 2 \
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-router-dtype fp32 \
  --expert-model-parallel-size "$NGPU" --moe-token-dispatcher-type "$DISPATCHER" \
  --tensorboard-dir "$OUT/tensorboard" \
  "${METRIC_FLAGS[@]}" "$@" 2>&1 | tee "$OUT/train.log"
