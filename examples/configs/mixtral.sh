#!/usr/bin/env bash
# Mixtral-like (8x7B shape) with --moe-token-dispatcher-type deepep (examples/configs/README.md).
#   bash examples/configs/mixtral.sh                  # scaled-down proxy on this machine
#   MODE=full NODES=4 bash examples/configs/mixtral.sh   # full size through Slurm
# Full size: 32 MoE layers, 8 large experts (FFN 14336), top-2, hidden 4096.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MOE_FLAGS=(
  --num-experts 8 --moe-router-topk 2  # few large experts: 2 of 8 per token
  # Softmax over the two selected logits (Megatron's default), load-balancing aux loss 1e-2.
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --moe-router-dtype fp32 --swiglu --normalization RMSNorm
  --group-query-attention --num-query-groups 8 --rotary-base 1000000
)
DEEPEP_FLAGS=(
  # bf16 dispatch: EP 4 (two experts per GPU; their weights, gradients and Adam states fit at
  # PP 4) stays inside a node and top-2 moves at most 2 rows per token, against experts 14336
  # wide: the sweep predicts a comm share under 10%.
  --moe-mdeep-fp8-dispatch off
  --moe-mdeep-num-sms 24
  --moe-mdeep-num-max-tokens-per-rank 4096  # sequence 4096 x micro-batch 1
)
PROXY_MODEL=(
  --num-layers 4 --hidden-size 512 --ffn-hidden-size 1792 --num-attention-heads 8
  --moe-ffn-hidden-size 1792
)
FULL_MODEL=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --moe-ffn-hidden-size 14336 --seq-length 4096 --max-position-embeddings 32768
)
FULL_PP_FLAGS=()  # 32 layers split evenly over PP 4
FULL_NODES=4 FULL_PP=4 FULL_EP=4 FULL_MBS=1 FULL_ACCUM=64 FULL_EXPERTS=8
launch_family mixtral "$@"
