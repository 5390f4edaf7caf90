#!/usr/bin/env bash
# DeepEP V1 (tag v1.2.1, NVSHMEM era) built for sm_90 and run beside ours on one GPU:
#   bash dev/gpu/deepep.sh DEEPEP_SRC            # a DeepEP source folder or .tar.gz
#   DRY_RUN=1 bash dev/gpu/deepep.sh DEEPEP_SRC  # prints the pieces and commands, runs nothing
# Pieces (PIECES, default "build own-test side"), each under its limit, never past BUDGET
# (570 s):
#   build     copies the source into BUILD_DIR (default .bench_out/evidence/deepep_build, kept
#             between calls on a warm machine; skipped when built from the same source) and
#             runs `python3 setup.py build_ext --inplace` with TORCH_CUDA_ARCH_LIST=9.0: nvcc
#             and the nvidia-nvshmem-cu13 wheel of the image (setup.py finds it by import);
#             the build's seconds go into the record (BUILD_TIMEOUT, 480); DEEPEP_NVSHMEM=0
#             hides the NVSHMEM wheel from setup.py: intranode kernels only (-DDISABLE_NVSHMEM,
#             no internode.cu / internode_ll.cu), a shorter build when a call is short of time;
#             DEEPEP_FAST_DEBUG=1 builds with DeepEP's ENABLE_FAST_DEBUG (~10 s timeouts)
#   own-test  DeepEP's unmodified tests/test_intranode.py --num-processes 2, to record the
#             exact error its harness meets on one GPU (it puts rank r on cuda:r, with NCCL)
#             (OWN_TEST_TIMEOUT, 90)
#   side      dev/gpu/deepep_side_by_side.py at RANKS (2,4,8) on GPU 0: ours and DeepEP on
#             the same inputs and SM budget, checked against tests/helpers/oracle.py, timed; the
#             processes take turns on the GPU (no MPS: dev/gpu/mps.sh runs them at once)
#             (SIDE_TIMEOUT, 420, each EP size at most SIZE_TIMEOUT, 130; SIDE_ARGS passed
#             on); our kernels are precompiled into the cache first
# Writes benchmarks/<card>_<date>_deepep.md and .log (command, versions, build time, the exact
# errors, the table). NVLink multicast stays off (exported here).
set -u

# build_step SRC BUILD_DIR: the build piece (run under time_limit.sh's limit through
# `deepep.sh --build-step`): the source into BUILD_DIR, then setup.py, timed.
build_step() {
  local src=$1 dir=$2 id t0
  set -e
  if [ -f "$src" ]; then id=$(sha256sum "$src" | cut -c1-16)
  else id=$(cd "$src" && find . -type f -not -path './.git/*' | sort | xargs cat | sha256sum \
    | cut -c1-16); fi
  id="$id nvshmem=${DEEPEP_NVSHMEM:-1} fast_debug=${DEEPEP_FAST_DEBUG:-0}"
  if ls "$dir"/deep_ep_cpp*.so >/dev/null 2>&1 \
      && [ "$(cat "$dir/.source_id" 2>/dev/null)" = "$id" ]; then
    echo "deepep build: already built from this source ($id): $dir"
    return 0
  fi
  rm -rf "$dir"
  mkdir -p "$dir"
  if [ -f "$src" ]; then tar xzf "$src" -C "$dir" --strip-components=1
  else cp -r "$src"/. "$dir"/; fi
  cd "$dir"
  t0=$(date +%s)
  if [ "${DEEPEP_FAST_DEBUG:-0}" = 1 ]; then
    # DeepEP's ENABLE_FAST_DEBUG (csrc/kernels/configs.cuh): its GPU and CPU timeouts become
    # ~10 s instead of ~100 s, so a stalled kernel prints its own timeout line (role, rank,
    # channel) well inside a device call's limits.
    sed -i "s/cxx_flags = \['-O3'/cxx_flags = ['-DENABLE_FAST_DEBUG', '-O3'/;
            s/nvcc_flags = \['-O3'/nvcc_flags = ['-DENABLE_FAST_DEBUG', '-O3'/" setup.py
    [ "$(grep -c ENABLE_FAST_DEBUG setup.py)" = 2 ] \
      || echo "deepep build: could not add -DENABLE_FAST_DEBUG" >&2
  fi
  if [ "${DEEPEP_NVSHMEM:-1}" = 0 ]; then
    # setup.py finds the NVSHMEM wheel by importlib; hidden, it builds with -DDISABLE_NVSHMEM
    # (no internode.cu / internode_ll.cu: the intranode kernels alone). Its sm_90 flags keep
    # -rdc=true, which without NVSHMEM's device-link step leaves the objects unlinked: dropped.
    sed -i "s/'-rdc=true', //" setup.py
    grep -q -- "-rdc=true" setup.py && echo "deepep build: could not drop -rdc=true" >&2
    TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$(nproc) python3 -c "import importlib.util as u, runpy, \
sys; f = u.find_spec; u.find_spec = lambda n, *a: None if n == 'nvidia.nvshmem' else f(n, *a); \
sys.argv = ['setup.py', 'build_ext', '--inplace']; runpy.run_path('setup.py', run_name='__main__')"
  else
    TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$(nproc) python3 setup.py build_ext --inplace
  fi
  echo "deepep build: $(( $(date +%s) - t0 )) s (nvshmem=${DEEPEP_NVSHMEM:-1}," \
    "fast_debug=${DEEPEP_FAST_DEBUG:-0});" \
    "$(ls deep_ep_cpp*.so)"
  echo "$id" > .source_id
}
if [ "${1:-}" = --build-step ]; then
  build_step "$2" "$3"
  exit $?
fi

source "$(dirname "${BASH_SOURCE[0]}")/evidence_lib.sh"
ev_init deepep
if [ $# -ne 1 ]; then
  echo "usage: bash dev/gpu/deepep.sh DEEPEP_SRC (a DeepEP V1 source folder or .tar.gz)"
  exit 2
fi
SRC=$1
if [ ! -d "$SRC" ] && [ ! -f "$SRC" ]; then
  echo "deepep: DEEPEP_SRC '$SRC' is not a folder or a tarball"
  exit 2
fi
SRC=$(cd "$(dirname "$SRC")" && pwd)/$(basename "$SRC")
BUILD_DIR=${BUILD_DIR:-$EV_OUT/deepep_build}
PIECES=${PIECES:-build own-test side}
RANKS=${RANKS:-2,4,8}
FP8_FORMAT=blockwise_1x128_fp32_scales  # e4m3 + fp32 scale per 128: DeepEP's own FP8 input
for piece in $PIECES; do
  case $piece in build|own-test|side) ;; *)
    echo "deepep: unknown piece '$piece' in PIECES (build, own-test, side)"; exit 2 ;;
  esac
done
ev_say "pieces: $PIECES; source $SRC; build folder $BUILD_DIR"
ev_versions
TABLE=$EV_LOGS/table.md
: > "$TABLE"

for piece in $PIECES; do
  case $piece in
    build)
      log=$EV_LOGS/build.log
      ev_piece build "${BUILD_TIMEOUT:-480}" "$log" bash "$EV_HERE/deepep.sh" --build-step \
        "$SRC" "$BUILD_DIR"
      result="dry run"
      if ! ev_is_dry; then
        result=$(grep -E "^deepep build:" "$log" | tail -n 1)
        if [ "$PIECE_RC" != 0 ]; then
          result="FAILED: $(grep -m 3 -E "error|Error" "$log" | cut -c1-200 | tr '\n' ' ')"
        fi
        {
          echo "- build (nvcc for sm_90, the image's NVSHMEM wheel): rc $PIECE_RC, $PIECE_S s"
          echo "  (this call's wall time, the copy and setup.py together): ${result:-see log}"
        } >> "$TABLE"
      fi
      ev_row "deepep build" "$PIECE_RC" "$PIECE_S" "${result:-see build.log}"
      ;;
    own-test)
      log=$EV_LOGS/own_test.log
      ev_piece own-test "${OWN_TEST_TIMEOUT:-90}" "$log" env -C "$BUILD_DIR/tests" \
        PYTHONPATH="$BUILD_DIR:$PYTHONPATH" python3 test_intranode.py --num-processes 2
      result="dry run"
      if ! ev_is_dry; then
        # The first error lines its ranks printed: what the one-GPU machine refuses.
        result=$(grep -m 4 -E "Error|error:|Exception|Assert|refus|invalid" "$log" \
          | cut -c1-240 | tr '\n' ' ')
        [ "$PIECE_RC" = 0 ] && result="passed (2 processes on one GPU)"
        {
          echo "- DeepEP's own test_intranode.py --num-processes 2, unmodified: rc"
          echo "  $PIECE_RC: ${result:-no error line; see the log}"
        } >> "$TABLE"
      fi
      ev_row "deepep own test, 2 processes" "$PIECE_RC" "$PIECE_S" "${result:0:160}"
      ;;
    side)
      # Our kernels into the cache first (else every rank compiles them on first use).
      ev_piece "precompile" 150 "$EV_LOGS/precompile.log" \
        python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 \
        --fp8 "$FP8_FORMAT" --fp8-output fp8 -j "$(nproc)" -q
      log=$EV_LOGS/side.log
      # shellcheck disable=SC2086
      ev_piece side "${SIDE_TIMEOUT:-420}" "$log" python3 dev/gpu/deepep_side_by_side.py \
        --deepep "$BUILD_DIR" --ranks "$RANKS" --timeout-s "${SIZE_TIMEOUT:-130}" \
        --json "$EV_LOGS/side.json" ${SIDE_ARGS:-}
      if ! ev_is_dry; then
        { echo; grep -E "^(side by side|\| |error R=|R=[0-9])" "$log"; } >> "$TABLE"
        grep -E "^(\| [0-9]|error R=)" "$log" | cut -c1-200
      fi
      ev_row "side by side R=$RANKS (time-sliced)" "$PIECE_RC" "$PIECE_S" "table in the record"
      ;;
  esac
done
ev_is_dry || cat "$EV_LOGS"/build.log "$EV_LOGS"/own_test.log "$EV_LOGS"/side.log \
  > "$EV_LOGS/all.txt" 2>/dev/null
ev_record deepep "DeepEP V1 intranode beside ours on one GPU" \
  "PIECES='$PIECES' RANKS=$RANKS bash dev/gpu/deepep.sh $(basename "$SRC")" \
  "$EV_LOGS/all.txt" "$TABLE"
ev_finish
