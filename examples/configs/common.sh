# Shared by the model-family templates in this folder (sourced by them, not run on its own).
#
# A template sets the family's flags in arrays, then calls `launch_family NAME "$@"`:
#   MOE_FLAGS     the MoE flags of the family (the same at both sizes)
#   DEEPEP_FLAGS  the dispatcher's flags (FP8 dispatch, SM budget, buffer size)
#   PROXY_MODEL   the scaled-down shape trained on one machine's GPUs
#   FULL_MODEL    the full-size shape; FULL_PP_FLAGS its pipeline layer split
#   FULL_NODES FULL_PP FULL_EP FULL_MBS FULL_ACCUM FULL_EXPERTS  the full-size layout
# Modes (environment):
#   MODE=proxy (default)  bash examples/run_gpt_moe.sh with the proxy flags appended (they
#                         override its defaults), TRAIN_ITERS (default 30) steps, metrics on,
#                         grouped experts (MDEEP_GROUPED_MM_EXPERTS, default 1: two grouped GEMMs
#                         instead of a Python loop over the experts); run_gpt_moe.sh renders
#                         $OUT/metrics/report.html. Without a GPU run_gpt_moe.sh trains the same
#                         flags on 2 CPU processes (CPU_TRAIN_ITERS, default 10 steps): the
#                         family's experts, top-k and routing, deepep beside alltoall; what has
#                         no meaning on the CPU is dropped with one line naming it
#   MODE=full             sbatch examples/slurm_gpt_moe.sbatch on NODES nodes; the family's
#                         flags reach examples/pretrain_gpt_moe.py through GPT_MOE_ARGS (Slurm
#                         passes the environment), appended after the template's own flags
#   DRY_RUN=1             print the command instead of running it
# Full-size knobs: NODES, GPUS_PER_NODE (8), PP, EP (default: the family's, halved until it
# divides the data-parallel size and the experts), GBS (default DP x micro-batch x FULL_ACCUM),
# TRAIN_ITERS, OUT, MEGATRON_LM.
set -euo pipefail
CONFIGS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$CONFIGS_DIR/../.." && pwd)"

_die() { echo "$1" >&2; exit 2; }

_print_command() {  # one shell-quoted line
  printf '%q' "$1"; shift
  for arg in "$@"; do printf ' %q' "$arg"; done
  printf '\n'
}

_proxy() {
  local name=$1; shift
  local out=${OUT:-$REPO_DIR/runs/${name}_proxy}
  local args=("${PROXY_MODEL[@]}" "${MOE_FLAGS[@]}" "${DEEPEP_FLAGS[@]}" "$@")
  local grouped=${MDEEP_GROUPED_MM_EXPERTS:-1}
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "TRAIN_ITERS=${TRAIN_ITERS:-30} CPU_TRAIN_ITERS=${CPU_TRAIN_ITERS:-10}" \
      "METRICS=${METRICS:-1} OUT=$out MDEEP_GROUPED_MM_EXPERTS=$grouped FAMILY=$name"
    _print_command bash "$REPO_DIR/examples/run_gpt_moe.sh" "${args[@]}"
    return 0
  fi
  echo "$name.sh: scaled-down proxy (${TRAIN_ITERS:-30} steps, EP = GPUs of this machine;" \
    "without a GPU ${CPU_TRAIN_ITERS:-10} steps on 2 CPU processes), run folder $out" >&2
  TRAIN_ITERS=${TRAIN_ITERS:-30} CPU_TRAIN_ITERS=${CPU_TRAIN_ITERS:-10} METRICS=${METRICS:-1} \
    OUT=$out MDEEP_GROUPED_MM_EXPERTS=$grouped FAMILY=$name \
    bash "$REPO_DIR/examples/run_gpt_moe.sh" "${args[@]}"
}

_full() {
  local name=$1; shift
  local nodes=${NODES:-$FULL_NODES} gpn=${GPUS_PER_NODE:-8} pp=${PP:-$FULL_PP}
  local world=$((nodes * gpn))
  (( world % pp == 0 )) || _die "$name.sh: $nodes nodes x $gpn GPUs do not split into PP=$pp"
  local dp=$((world / pp)) ep
  if [ -n "${EP:-}" ]; then
    ep=$EP
  else
    ep=$FULL_EP
    while (( ep > 1 && (ep > dp || dp % ep != 0 || FULL_EXPERTS % ep != 0) )); do
      ep=$((ep / 2))
    done
  fi
  (( dp % ep == 0 )) || _die "$name.sh: EP=$ep must divide the data-parallel size $dp" \
    "($nodes nodes x $gpn GPUs / PP $pp)"
  (( FULL_EXPERTS % ep == 0 )) || _die "$name.sh: EP=$ep must divide $FULL_EXPERTS experts"
  local gbs=${GBS:-$((dp * FULL_MBS * FULL_ACCUM))}
  (( gbs % (dp * FULL_MBS) == 0 )) || _die "$name.sh: GBS=$gbs must be a multiple of DP x" \
    "micro-batch = $((dp * FULL_MBS))"
  local args=("${FULL_MODEL[@]}" "${MOE_FLAGS[@]}" "${DEEPEP_FLAGS[@]}"
              --pipeline-model-parallel-size "$pp")
  if (( pp > 1 )); then args+=("${FULL_PP_FLAGS[@]}"); fi
  args+=(--micro-batch-size "$FULL_MBS" --global-batch-size "$gbs" "$@")
  local extra
  extra=$(_print_command "${args[@]}")
  echo "$name.sh: full size on $nodes nodes x $gpn GPUs: PP $pp, DP $dp, EP $ep" \
    "($((ep > gpn ? ep / gpn : 1)) node(s) per EP group), global batch $gbs" >&2
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "EP=$ep GPUS_PER_NODE=$gpn REPO=$REPO_DIR TRAIN_ITERS=${TRAIN_ITERS:-1000}"
    echo "GPT_MOE_ARGS=$extra"
    _print_command sbatch --nodes "$nodes" --gpus-per-node "$gpn" --job-name "$name" \
      "$REPO_DIR/examples/slurm_gpt_moe.sbatch"
    return 0
  fi
  EP=$ep GPUS_PER_NODE=$gpn REPO=$REPO_DIR TRAIN_ITERS=${TRAIN_ITERS:-1000} \
    GPT_MOE_ARGS=$extra sbatch --nodes "$nodes" --gpus-per-node "$gpn" --job-name "$name" \
    "$REPO_DIR/examples/slurm_gpt_moe.sbatch"
}

launch_family() {
  local name=$1; shift
  case "${MODE:-proxy}" in
    proxy) _proxy "$name" "$@" ;;
    full) _full "$name" "$@" ;;
    *) _die "$name.sh: MODE must be proxy or full, got ${MODE}" ;;
  esac
}
