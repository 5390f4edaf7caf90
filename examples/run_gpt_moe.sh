#!/usr/bin/env bash
# The main job: sets itself up, then trains the tiny GPT-MoE with --moe-token-dispatcher-type
# deepep on every local GPU (EP = number of GPUs), or, without a GPU, runs a short CPU
# demonstration. Run from anywhere, in the Python environment (a venv) to install into:
#   bash examples/run_gpt_moe.sh [--moe-token-dispatcher-type D] [extra Megatron flags]
#   bash examples/run_gpt_moe.sh -h        # this text
# D: deepep (default), alltoall or alltoall-fused (examples/megatron_flags.py DISPATCHERS); it
# wins over DISPATCHER. Flags take `--flag value` or `--flag=value`, and are checked first.
# First examples/prepare_env.py looks for GPUs (nvidia-smi) and says what it found and which path
# it takes, then installs only what is missing (torch pinned as for the tests, from PyTorch's
# CPU index without a GPU; megatron-core 0.16-0.19: 0.17+ ships megatron.training and needs
# Python >= 3.12; this package's GPU extra):
#   megatron-training  GPUs + megatron.training: examples/pretrain_gpt_moe.py (below)
#   megatron-core      GPUs, megatron-core alone (Python 3.10/3.11: 0.16):
#                      examples/compare_dispatchers.py, TRAIN_ITERS steps of DISPATCHER
#   cpu-demo           no GPU: examples/compare_dispatchers.py --cpu on 2 gloo ranks, deepep
#                      (reference transport) beside alltoall, losses side by side (~1 minute);
#                      Megatron flags given to this script build that model instead
#                      (examples/megatron_flags.py: what has no meaning on the CPU is dropped
#                      with one line, an unknown flag refused)
# Env: PYTHON (default python3), INSTALL=0 (install nothing), MEGATRON_LM (a Megatron-LM
# checkout, for megatron.training with megatron-core 0.16), DISPATCHER (default deepep;
# alltoall to compare, alltoall-fused for Megatron's alltoall with Transformer Engine's fused
# permute, --moe-permute-fusion, which needs TE), TRAIN_ITERS (50; the CPU demo: CPU_TRAIN_ITERS,
# else TRAIN_ITERS, else 20), METRICS=1 (per-layer comm/load metrics, JSON lines in
# $OUT/metrics, then the report: $OUT/metrics/report.html and its PNGs; `python -m
# megatron_deepep.tools.report DIR` renders any metrics folder, MDEEP_METRICS_DIR's too), OUT
# (run folder, default runs/gpt_moe_<dispatcher> or runs/cpu_demo in the repository: git
# ignores runs/).
# The local (non-TE) layers need --no-rope-fusion and --no-persist-layer-norm without TE / Apex.
# FP8 dispatch (README, "FP8 dispatch"; hidden size % 16 == 0): pass our flag through, e.g.
#   bash examples/run_gpt_moe.sh --moe-mdeep-fp8-dispatch blockwise   # or mxfp8, auto, off
# (auto follows the active TE FP8 recipe and dispatches bf16 without one; with no TE recipe
# matching the wire format, the receiver dequantizes to bf16 rows for the experts).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
PY=${PYTHON:-python3}
export PYTHONPATH="${REPO}:${MEGATRON_LM:+${MEGATRON_LM}:}${PYTHONPATH:-}"
TEST_COMMAND='pip install torch==2.13.0 -e ".[jit,test,megatron]" && python -m pytest -q -rs tests'

for arg in "$@"; do
  if [ "$arg" = -h ] || [ "$arg" = --help ]; then  # the header above, without its '#'
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit 0
  fi
done
# The flags, then every MDEEP_* variable set, are checked before anything is probed or
# installed (standard library only; the flags' fields too where megatron-core is there on a
# machine without a GPU): a bad one is one line. The names of unknown MDEEP_* variables
# warned about here are not warned about again by the job's processes.
FIELDS=$(mktemp)
trap 'rm -f "$FIELDS"' EXIT
"$PY" "$HERE/megatron_flags.py" --job -- "$@" > "$FIELDS" || exit 2
mapfile -d '' -t JOB_FIELDS < "$FIELDS"
if [ ${#JOB_FIELDS[@]} -lt 2 ]; then
  echo "run_gpt_moe.sh: examples/megatron_flags.py --job gave no dispatcher" >&2
  exit 1
fi
DISPATCHER=${JOB_FIELDS[0]} FLAGS_CHECKED=${JOB_FIELDS[1]}
set -- "${JOB_FIELDS[@]:2}"
MDEEP_KNOBS_WARNED=$("$PY" "$REPO/megatron_deepep/knobs.py") || exit 2
export MDEEP_KNOBS_WARNED
PLAN=$("$PY" "$HERE/prepare_env.py")
read -r JOB_PATH NGPU <<< "$(tail -n 1 <<< "$PLAN")"
case "$JOB_PATH" in
  cpu-demo|megatron-core|megatron-training) ;;
  *) echo "run_gpt_moe.sh: examples/prepare_env.py gave no path (got: $PLAN)" >&2; exit 1 ;;
esac

# The report of a run's metrics (HTML, and PNGs with matplotlib), when it wrote any.
report() {
  local dir=$1
  if compgen -G "$dir/deepep_metrics_rank*.jsonl" > /dev/null; then
    "$PY" -m megatron_deepep.tools.report "$dir" || true
  fi
}

# METRICS=1: the run's metrics in $OUT/metrics; else MDEEP_METRICS_DIR's, if set.
metrics_dir() {
  if [ "${METRICS:-0}" = 1 ]; then echo "$OUT/metrics"; else echo "${MDEEP_METRICS_DIR:-}"; fi
}

# compare_dispatchers.py's options for the metrics folder and the run's name (FAMILY).
compare_options() {
  COMPARE=()
  if [ -n "$MDIR" ]; then COMPARE+=(--metrics-dir "$MDIR"); fi
  if [ -n "${FAMILY:-}" ]; then COMPARE+=(--name "$FAMILY"); fi
}

# Flags for compare_dispatchers.py (the CPU demo, megatron-core alone): checked here, once, so a
# mistyped one is one line ("did you mean ..."), not every rank's traceback under torchrun.
if [ $# -gt 0 ] && [ "$JOB_PATH" != megatron-training ] && [ "$FLAGS_CHECKED" != 1 ]; then
  GPU_FLAG=(); if [ "$JOB_PATH" != cpu-demo ]; then GPU_FLAG=(--gpu); fi
  "$PY" "$HERE/megatron_flags.py" "${GPU_FLAG[@]}" -- "$@" || exit 2
fi

if [ "$JOB_PATH" = cpu-demo ]; then
  OUT=${OUT:-$REPO/runs/cpu_demo}
  MDIR=$(metrics_dir)
  compare_options
  # Another dispatcher than deepep (the flag or DISPATCHER) runs first, beside deepep.
  if [ "$DISPATCHER" != deepep ]; then COMPARE+=(--dispatchers "$DISPATCHER,deepep"); fi
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node 2 "$HERE/compare_dispatchers.py" --cpu \
    --steps "${CPU_TRAIN_ITERS:-${TRAIN_ITERS:-20}}" --out "$OUT" \
    "${COMPARE[@]}" -- "$@"
  if [ -n "$MDIR" ]; then report "$MDIR"; fi
  what="the CPU demonstration: the same model and seed"
  if [ $# -gt 0 ]; then what="the model of the flags above, on the CPU, from one seed"; fi
  cat >&2 <<MSG
run_gpt_moe.sh: that was $what with deepep (on the pure-torch reference transport, over gloo)
and with Megatron's alltoall. On a machine with NVIDIA GPUs the same command trains with the
deepep kernels. Redraw the loss plot: python examples/compare_dispatchers.py --plot-only
$OUT/step_times.json. Tests (from the repository root):
    $TEST_COMMAND
MSG
  exit 0
fi

OUT=${OUT:-$REPO/runs/gpt_moe_${DISPATCHER}}
mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0
MDIR=$(metrics_dir)
METRIC_FLAGS=()
if [ "${METRICS:-0}" = 1 ]; then
  METRIC_FLAGS=(--moe-mdeep-metrics --moe-mdeep-metrics-dir "$OUT/metrics" --moe-per-layer-logging)
fi

if [ "$JOB_PATH" = megatron-core ]; then
  compare_options
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
    "$HERE/compare_dispatchers.py" --steps "${TRAIN_ITERS:-50}" --dispatchers "$DISPATCHER" \
    --out "$OUT" "${COMPARE[@]}" -- "$@" \
    2>&1 | tee "$OUT/train.log"
  status=${PIPESTATUS[0]}
  if [ -n "$MDIR" ]; then report "$MDIR"; fi
  echo "run_gpt_moe.sh: loss plot: $OUT/loss_curves.png (redraw: python" \
    "examples/compare_dispatchers.py --plot-only $OUT/step_times.json)" >&2
  exit "$status"
fi
PERMUTE_FLAGS=()
if [ "$DISPATCHER" = alltoall-fused ]; then  # Megatron's alltoall on TE's fused permute kernels
  DISPATCHER=alltoall PERMUTE_FLAGS=(--moe-permute-fusion)
fi
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" "$HERE/pretrain_gpt_moe.py" \
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
  "${METRIC_FLAGS[@]}" "${PERMUTE_FLAGS[@]}" "$@" 2>&1 | tee "$OUT/train.log"
status=${PIPESTATUS[0]}
if [ -n "$MDIR" ]; then report "$MDIR"; fi
exit "$status"
