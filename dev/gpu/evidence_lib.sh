# Sourced by dev/gpu/evidence.sh, deepep.sh, mps.sh and proxy.sh (not run on its own).
#
# ev_init NAME            the repository root as cwd, NVLink multicast off, a log folder
#                         (mktemp -d), EV_DATE (UTC), EV_OUT (records' staging folder), the
#                         kernel cache, DRY_RUN, BUDGET_S, and time_limit.sh's `run`
# ev_need_dir NAME WHAT PATH   one line and exit 2 when PATH is not a folder
# ev_install_wheels NAME DIR   every wheel of DIR into a fresh site folder (wheels.sh's
#                         install_wheels: one pip command), on PYTHONPATH with the repository
# ev_versions             device, driver, torch, CUDA, NCCL, NVSHMEM, nvcc, TE, megatron-core,
#                         the commit (COMMIT, else the copy's HEAD) and its modified paths: one
#                         line each, also kept in $EV_LOGS/versions for the records
# ev_piece NAME LIMIT LOG command...   one named piece under its limit (a dry run prints it);
#                         sets PIECE_RC and PIECE_S and adds a row to the summary
# ev_record TOPIC TITLE COMMAND LOG TABLE   benchmarks/<card>_<date>_<topic>.md (command,
#                         versions, device, the table, the raw log's name) and the raw log
#                         beside it (.log); with the device tool's $OUT set, copies go there
#                         at ev_finish
# ev_start_mps            `nvidia-cuda-mps-control -d` with pipe and log folders from mktemp -d
#                         (exported for the clients), stopped at exit (trap); a CUDA client
#                         probes it and FULL_SMS is the SM count it sees; on failure prints why
#                         (the daemon's control and server logs) and returns 3
# ev_finish               prints the summary table last; packs this run's records into
#                         $OUT/<name>_records.tar.gz when $OUT is a folder (not under
#                         evidence.sh, which packs the day's records once)

ev_init() {
  EV_NAME=$1
  EV_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  EV_REPO=$(cd "$EV_HERE/../.." && pwd)
  cd "$EV_REPO" || exit 2
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export PYTHONUNBUFFERED=1 PYTHONPATH="$EV_REPO${PYTHONPATH:+:$PYTHONPATH}"
  EV_OUT=${EV_OUT:-$EV_REPO/.bench_out/evidence}
  export MDEEP_CACHE_DIR=${MDEEP_CACHE_DIR:-$EV_OUT/kernel_cache}
  EV_DATE=${EV_DATE:-$(date -u +%Y-%m-%d)}
  DRY_RUN=${DRY_RUN:-0}
  BUDGET_S=${BUDGET:-570}
  EV_SUMMARY=()
  EV_RECORDS=()
  EV_FAILED=0
  if [ "$DRY_RUN" = 1 ]; then
    EV_LOGS=$(mktemp -d "${TMPDIR:-/tmp}/$EV_NAME.dry.XXXXXX")
  else
    mkdir -p "$EV_OUT"
    EV_LOGS=$(mktemp -d "${TMPDIR:-/tmp}/$EV_NAME.XXXXXX")
  fi
  # shellcheck source=/dev/null
  source "$EV_HERE/time_limit.sh"
  # shellcheck source=/dev/null
  source "$EV_HERE/wheels.sh"  # install_wheels: WHEELS_DIR into SITE_DIR, one pip command
}

ev_is_dry() { [ "$DRY_RUN" = 1 ]; }

# ev_card: the records' prefix, named after the card that ran them (h100, h200, ...; "gpu" when
# nvidia-smi names none of them, "dry" in a dry run).
ev_card() {
  local name
  ev_is_dry && { echo dry; return; }
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  case $name in
    *H200*) echo h200 ;; *H100*) echo h100 ;; *B200*) echo b200 ;; *) echo gpu ;;
  esac
}

ev_say() { echo "$EV_NAME: [$SECONDS s] $*"; }

ev_need_dir() {
  if [ -z "$3" ] || [ ! -d "$3" ]; then
    echo "$1: $2 '${3}' is not a folder"
    exit 2
  fi
}

ev_install_wheels() {
  local name=$1 dir=$2
  if ! ls "$dir"/*.whl >/dev/null 2>&1; then
    ev_say "no wheels in $dir: nothing installed"
    return 0
  fi
  if ev_is_dry; then
    echo "dry run: pip install $(ls "$dir"/*.whl | wc -l) wheels of $dir into a fresh site folder"
    return 0
  fi
  WHEELS_DIR=$dir SITE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/$name.site.XXXXXX") install_wheels \
    "$name" || return 2
  ev_say "wheels of $dir: $(cd "$dir" && ls *.whl | tr '\n' ' ')"
}

ev_versions() {
  ev_is_dry && { echo "dry run: versions"; return 0; }
  {
    echo "date (UTC): $(date -u '+%Y-%m-%d %H:%M')"
    echo "device: $(nvidia-smi --query-gpu=name,memory.total,driver_version \
      --format=csv,noheader 2>&1 | head -n 1)"
    echo "nvcc: $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'not on PATH')"
    python3 - <<'PY'
import importlib.metadata as md
import warnings

warnings.filterwarnings("ignore")
import torch

nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
print(f"torch: {torch.__version__} (CUDA {torch.version.cuda}, NCCL {nccl})")
for name in ("nvidia-nvshmem-cu13", "nvidia-nccl-cu13", "cuda-bindings", "megatron-core",
             "transformer-engine", "transformer-engine-torch", "libucx-cu13"):
    try:
        print(f"{name}: {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
PY
    # COMMIT: the tree that runs, where the copy's own .git is not it (a copied working tree
    # keeps the HEAD it was copied from; its uncommitted changes then show as "modified").
    echo "git: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}" \
      "($(git status --porcelain 2>/dev/null | grep -c . || true) paths modified)"
  } | tee "$EV_LOGS/versions"
}

ev_piece() {
  local name=$1 limit=$2 log=$3 t0=$SECONDS
  shift 3
  if ev_is_dry; then
    EV_PLANNED_S=$(( ${EV_PLANNED_S:-0} + limit ))
    echo "dry run: piece '$name' (limit $limit s, log $(basename "$log");" \
      "limits so far $EV_PLANNED_S s of $BUDGET_S):" "$(echo "$*" | tr '\n' ' ' | cut -c1-400)"
    PIECE_RC=0
  else
    ev_say "$name: start (limit $limit s)"
    run "$limit" "$log" "$@"
    PIECE_RC=$?
  fi
  PIECE_S=$((SECONDS - t0))
  ev_say "$name: rc $PIECE_RC in $PIECE_S s"
  case $PIECE_RC in 0) ;; *) EV_FAILED=1 ;; esac
}

# ev_precompile_tier: the kernels of the GPU tier's matrices (NVLink and internode: top-k 1-16,
# both FP8 formats, every row dtype, the NVSHMEM-linked ones) into the cache, once per cache.
ev_precompile_tier() {
  ev_piece "precompile (tier kernels)" "${PRECOMPILE_TIMEOUT:-200}" \
    "$EV_LOGS/precompile_tier.log" python3 -m megatron_deepep.tools.precompile \
    --topk 1 2 4 6 8 16 --index-dtype int64 \
    --fp8 blockwise_1x128 mxfp8_1x32 --row-dtype bf16 fp16 fp32 --internode -j "$(nproc)" -q
  ev_row "precompile (tier kernels)" "$PIECE_RC" "$PIECE_S" "$(ev_is_dry && echo "dry run" || \
    grep "^precompile: " "$EV_LOGS/precompile_tier.log" | tail -n 1 | cut -c1-120)"
}

ev_row() {  # ev_row NAME RC SECONDS RESULT
  EV_SUMMARY+=("| $1 | $2 | $3 | $4 |")
}

ev_record() {
  local topic=$1 title=$2 command=$3 log=$4 table=$5
  local stem="benchmarks/$(ev_card)_${EV_DATE}_${topic}"
  if ev_is_dry; then
    echo "dry run: record $stem.md (+ $stem.log)"
    return 0
  fi
  mkdir -p benchmarks
  {
    echo "# $title"
    echo
    echo "Recorded by \`dev/gpu/$EV_NAME.sh\` on $EV_DATE (UTC)."
    echo
    echo "## Command"
    echo
    echo '```'
    echo "$command"
    echo '```'
    echo
    echo "## Versions and device"
    echo
    echo '```'
    cat "$EV_LOGS/versions" 2>/dev/null || echo "(versions not read)"
    echo '```'
    echo
    echo "## Result"
    echo
    if [ -s "$table" ]; then cat "$table"; else echo "(no table: see the log)"; fi
    echo
    echo "Raw log: \`$(basename "$stem").log\`."
  } > "$stem.md"
  if [ -f "$log" ]; then
    # The whole log when small; else its head and tail (the raw log stays in the run's folder).
    if [ "$(wc -l < "$log")" -gt 4000 ]; then
      { head -n 1000 "$log"; echo "... ($(wc -l < "$log") lines; middle cut) ..."
        tail -n 2500 "$log"; } > "$stem.log"
    else
      cp "$log" "$stem.log"
    fi
  fi
  EV_RECORDS+=("$stem.md" "$stem.log")
  ev_say "record: $stem.md"
}

ev_finish() {
  {
    echo "$EV_NAME: summary ($SECONDS s of a $BUDGET_S s budget; logs $EV_LOGS)"
    if ev_is_dry; then
      echo "dry run: the pieces' limits add up to ${EV_PLANNED_S:-0} s; each piece gets at" \
        "most what is left of $BUDGET_S s, in order (skipped under 20 s)"
    fi
    echo "| piece | rc | s | result |"
    echo "|---|---|---|---|"
    printf '%s\n' "${EV_SUMMARY[@]}"
  } | tee "$EV_LOGS/summary.md"
  # Run by evidence.sh (EV_PARENT=1), the parent packs every record of the day at its end.
  if ! ev_is_dry && [ -z "${EV_PARENT:-}" ] && [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] \
      && [ ${#EV_RECORDS[@]} -gt 0 ]; then
    tar czf "$OUT/${EV_NAME}_records.tar.gz" "${EV_RECORDS[@]}" 2>/dev/null
    cp "$EV_LOGS/summary.md" "$OUT/${EV_NAME}_summary.md"
  fi
  return $EV_FAILED
}

ev_stop_mps() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
  ev_say "MPS daemon stopped"
}

ev_start_mps() {
  local probe
  if ! command -v nvidia-cuda-mps-control >/dev/null; then
    echo "$EV_NAME: MPS cannot start: nvidia-cuda-mps-control is not on PATH"
    return 3
  fi
  CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d "${TMPDIR:-/tmp}/mps_pipe.XXXXXX")
  CUDA_MPS_LOG_DIRECTORY=$(mktemp -d "${TMPDIR:-/tmp}/mps_log.XXXXXX")
  export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  trap ev_stop_mps EXIT INT TERM
  if ! nvidia-cuda-mps-control -d; then
    echo "$EV_NAME: MPS cannot start: nvidia-cuda-mps-control -d failed;" \
      "$(tail -n 3 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null | tr '\n' ' ')"
    return 3
  fi
  sleep 1
  # A client starts the server: one CUDA allocation, then the daemon's list of servers.
  if ! probe=$(python3 -c "import torch; torch.zeros(1, device='cuda'); \
print(torch.cuda.get_device_properties(0).multi_processor_count)" 2>&1); then
    echo "$EV_NAME: MPS cannot start a server for a CUDA client:" \
      "$(echo "$probe" | tail -n 2 | tr '\n' ' ') | control.log:" \
      "$(tail -n 3 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null | tr '\n' ' ')" \
      "| server.log: $(tail -n 3 "$CUDA_MPS_LOG_DIRECTORY/server.log" 2>/dev/null | \
      tr '\n' ' ')"
    return 3
  fi
  FULL_SMS=$(echo "$probe" | tail -n 1)
  MPS_SERVERS=$(echo get_server_list | nvidia-cuda-mps-control 2>&1 | tr '\n' ' ')
  ev_say "MPS up: server(s) $MPS_SERVERS; a client sees $FULL_SMS SMs"
}
