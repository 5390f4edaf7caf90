#!/usr/bin/env bash
# DeepSeek-V3-like MoE with --moe-token-dispatcher-type deepep (examples/configs/README.md).
#   bash examples/configs/deepseek_v3.sh                 # scaled-down proxy on this machine
#   MODE=full NODES=64 bash examples/configs/deepseek_v3.sh   # full size through Slurm
# Full size: 61 layers of which 58 are MoE: 256 routed experts + 1 shared, top-8, hidden 7168.
# examples/pretrain_gpt_moe.py builds every layer from one MoE spec, so the template keeps the
# 58 MoE layers (the 3 leading dense layers, --moe-layer-freq '([0]*3+[1]*58)', need a decoder
# block spec) and standard attention (MLA needs TE): the dispatcher sees the same MoE layers.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MOE_FLAGS=(
  --num-experts 256 --moe-router-topk 8  # fine-grained experts: 8 of 256 per token
  # Sigmoid affinity scores, top-k weights renormalized and scaled by 2.5.
  --moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5
  # Aux-loss-free balancing: a per-expert bias steers selection (updated each step), plus a
  # tiny sequence-wise aux loss as DeepSeek-V3 does.
  --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
  # Node-limited routing: 8 expert groups (one per node of an EP-64 group), a token's experts
  # in at most 4 of them, so it crosses the network at most 4 times.
  --moe-router-num-groups 8 --moe-router-group-topk 4
  --moe-router-dtype fp32 --swiglu --normalization RMSNorm
)
DEEPEP_FLAGS=(
  # FP8 1x128 blockwise dispatch, as DeepSeek-V3 trains: about half the bytes of bf16.
  --moe-mdeep-fp8-dispatch blockwise
  --moe-mdeep-num-sms 24  # the comm kernels' SMs; the other 108 of an H100/H200 keep computing
  # Buffer size: tokens per rank per micro-batch = sequence x micro-batch (TP 1) = 4096.
  --moe-mdeep-num-max-tokens-per-rank 4096
)
PROXY_MODEL=(  # 4 MoE layers, hidden 256: E, K, routing and FP8 dispatch as at full size
  --num-layers 4 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 4
  --moe-ffn-hidden-size 64 --moe-shared-expert-intermediate-size 64
)
FULL_MODEL=(
  --num-layers 58 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
  --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048
  --seq-length 4096 --max-position-embeddings 4096
)
# PP 8: first and last stages carry the embedding and the loss, so fewer layers (6 + 6x8 + 4).
FULL_PP_FLAGS=(--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 4)
FULL_NODES=64 FULL_PP=8 FULL_EP=64 FULL_MBS=1 FULL_ACCUM=24 FULL_EXPERTS=256
launch_family deepseek_v3 "$@"
