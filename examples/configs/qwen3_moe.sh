#!/usr/bin/env bash
# Qwen3-MoE-like (Qwen3-235B-A22B shape) with --moe-token-dispatcher-type deepep
# (examples/configs/README.md).
#   bash examples/configs/qwen3_moe.sh                 # scaled-down proxy on this machine
#   MODE=full NODES=16 bash examples/configs/qwen3_moe.sh   # full size through Slurm
# Full size: 94 MoE layers, 128 experts, top-8, hidden 4096, expert FFN 1536, no shared expert.
# (Qwen3's QK-norm needs a layer spec with q/k norms; examples/pretrain_gpt_moe.py builds the
# plain one.)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MOE_FLAGS=(
  --num-experts 128 --moe-router-topk 8  # 8 of 128 experts per token, every layer MoE
  # Softmax over the selected top-k (Megatron's default: the top-k weights sum to 1, as
  # Qwen3's norm_topk_prob), balanced by an auxiliary loss.
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
  --moe-router-dtype fp32 --swiglu --normalization RMSNorm
  --group-query-attention --num-query-groups 4 --rotary-base 1000000
)
DEEPEP_FLAGS=(
  # EP 8 stays inside one node (NVLink only); at top-8 the dispatch still moves ~5 rows per
  # token (the sweep predicts a comm share above 20% in bf16), so FP8 dispatch halves it.
  --moe-mdeep-fp8-dispatch blockwise
  --moe-mdeep-num-sms 24
  --moe-mdeep-num-max-tokens-per-rank 4096  # sequence 4096 x micro-batch 1
)
PROXY_MODEL=(
  --num-layers 4 --hidden-size 384 --ffn-hidden-size 1152 --num-attention-heads 8
  --moe-ffn-hidden-size 128
)
FULL_MODEL=(
  --num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 64
  --kv-channels 128 --moe-ffn-hidden-size 1536
  --seq-length 4096 --max-position-embeddings 4096
)
FULL_PP_FLAGS=(--decoder-first-pipeline-num-layers 11 --decoder-last-pipeline-num-layers 11)
FULL_NODES=16 FULL_PP=8 FULL_EP=8 FULL_MBS=1 FULL_ACCUM=64 FULL_EXPERTS=128
launch_family qwen3_moe "$@"
