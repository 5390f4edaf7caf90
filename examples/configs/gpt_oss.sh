#!/usr/bin/env bash
# gpt-oss-like (gpt-oss-120b shape) with --moe-token-dispatcher-type deepep
# (examples/configs/README.md).
#   bash examples/configs/gpt_oss.sh                  # scaled-down proxy on this machine
#   MODE=full NODES=8 bash examples/configs/gpt_oss.sh   # full size through Slurm
# Full size: 36 MoE layers, 128 experts, top-4, hidden 2880, expert FFN 2880, 64 query heads of
# 64 and 8 KV heads. (Its alternating sliding-window attention, attention sinks, clamped SwiGLU
# and expert biases need their own layer spec; the dispatcher sees the same MoE layers.)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MOE_FLAGS=(
  --num-experts 128 --moe-router-topk 4  # 4 of 128 experts per token
  # Softmax over the selected top-4 logits (Megatron's default), aux loss 1e-2.
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --moe-router-dtype fp32 --swiglu --normalization RMSNorm
  --group-query-attention --num-query-groups 8 --kv-channels 64 --rotary-base 150000
)
DEEPEP_FLAGS=(
  # Hidden 2880 is narrow for its expert count, so the dispatch weighs more against the GEMMs
  # (the sweep's highest comm share of the four): FP8 dispatch, MXFP8 (1x32 blocks): 2880 is 90
  # blocks of 32, where 1x128 blocks would leave a partial one.
  --moe-mdeep-fp8-dispatch mxfp8
  --moe-mdeep-num-sms 24
  --moe-mdeep-num-max-tokens-per-rank 4096  # sequence 4096 x micro-batch 1
)
PROXY_MODEL=(  # hidden 288 = 2880 / 10 keeps the 1x32 block multiple
  --num-layers 4 --hidden-size 288 --ffn-hidden-size 288 --num-attention-heads 8
  --moe-ffn-hidden-size 144
)
FULL_MODEL=(
  --num-layers 36 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64
  --moe-ffn-hidden-size 2880 --seq-length 4096 --max-position-embeddings 131072
)
FULL_PP_FLAGS=()  # 36 layers split evenly over PP 2
FULL_NODES=8 FULL_PP=2 FULL_EP=16 FULL_MBS=1 FULL_ACCUM=16 FULL_EXPERTS=128
launch_family gpt_oss "$@"
