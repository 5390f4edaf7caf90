#!/usr/bin/env bash
# Every piece of evidence on one H200, in named pieces that fit the device's 10-minute calls:
#   PIECES="baselines main" bash dev/gpu/evidence.sh WHEELS_DIR DEEPEP_SRC
#   DRY_RUN=1 bash dev/gpu/evidence.sh WHEELS_DIR DEEPEP_SRC   # the plan; runs nothing
# WHEELS_DIR: wheels installed first, in one pip command (the TE 2.20.2 set and megatron-core
# 0.19.2 for baselines/main; the libucx-cu13 wheel for proxy; one folder may hold either set:
# 64 MiB travel per call). DEEPEP_SRC: DeepEP V1's source, a folder or .tar.gz (dev/gpu/README.md
# says how it is prepared).
# Pieces (PIECES, default all, in this order; each under its limit and never past BUDGET, 570 s;
# one that does not fit is skipped, saying so: name it in the next call):
#   baselines   EP=1 bench at DeepSeek-V3's shape (4096 tokens, hidden 7168, 256 experts, top-8;
#               24 and 132 SMs; bf16 and blockwise FP8) beside Megatron's alltoall with TE's
#               fused permute and without; bench.layer's table A rows (alltoall fused, unfused,
#               deepep sync and sync-free)                        -> <card>_<date>_baselines.md
#   main        examples/compare_dispatchers.py, MAIN_STEPS (40) steps of deepep, alltoall-fused
#               and alltoall from one seed: losses and median step times -> _main_job.md
#   deepep      dev/gpu/deepep.sh: build (timed), DeepEP's own intranode test (its exact error
#               on one GPU), ours and DeepEP side by side at R = 2, 4, 8 (time-sliced)
#               (deepep-build, deepep-own-test, deepep-side run one of them; the last two build
#               first unless this machine built the same source already) -> _deepep.md
#   mps         dev/gpu/mps.sh: the same side by side with the ranks at once (MPS), the NVLink
#               and internode tiers and the internode sweep at 2x2 / 2x4 (mps-side, mps-tier,
#               mps-sweep run one of them)                        -> _mps.md, mps_model.json
#   proxy       dev/gpu/proxy.sh: the internode tier and sweep at 2x1 / 2x2 with P2P off and
#               UCX over loopback through NVSHMEM's proxy (proxy-plugins, proxy-tier,
#               proxy-sweep)                                      -> _proxy.md, proxy_model.json
#   model       megatron_deepep.tools.internode_model on DeepSeek-V3's shape at 2x8 and 8x8 with the
#               measured inputs found (mps_model.json, proxy_model.json) -> _model.md
# Records go to benchmarks/<card>_<date>_<topic>.md with the raw log beside (.log); with the
# device tool's $OUT, they are packed into $OUT/evidence_records.tar.gz and the summary table
# (printed last) into $OUT/evidence_summary.md. Build and kernel caches: .bench_out/evidence/
# (kept between calls while the machine stays warm). NVLink multicast stays off.
# Device tool (one H200, calls of <= 10 minutes, one after another while the machine is warm;
# dev/gpu/README.md says how the carried folders are made; D=.deepep/DeepEP-v1.2.1.tar.gz):
#   call 1 (carry .evw_te .deepep): PIECES="baselines main" ... .evw_te $D
#   call 2 (carry .deepep): PIECES="deepep mps-side" ... .deepep $D
#   call 3 (carry .evw_ucx .deepep): PIECES="proxy mps-sweep model mps-tier" ... .evw_ucx $D
# (DEEPEP_NVSHMEM=0 before call 2 builds DeepEP's intranode kernels alone, if the full build
# does not leave time for the rest.)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/evidence_lib.sh"
ev_init evidence
if [ $# -ne 2 ]; then
  echo "usage: bash dev/gpu/evidence.sh WHEELS_DIR DEEPEP_SRC"
  exit 2
fi
ev_need_dir evidence WHEELS_DIR "$1"
WHEELS=$(cd "$1" && pwd)
if [ ! -d "$2" ] && [ ! -f "$2" ]; then
  echo "evidence: DEEPEP_SRC '$2' is not a folder or a tarball"
  exit 2
fi
DEEPEP_SRC=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
ALL="baselines main deepep mps proxy model"
PIECES=${PIECES:-$ALL}
plan=()
for name in $PIECES; do
  case $name in
    baselines|main|deepep|mps|proxy|model) plan+=("$name") ;;
    deepep-build|deepep-own-test|deepep-side|mps-side|mps-tier|mps-sweep) plan+=("$name") ;;
    proxy-plugins|proxy-tier|proxy-sweep) plan+=("$name") ;;
    *) echo "evidence: unknown piece '$name' in PIECES ($ALL, or deepep-build," \
         "deepep-own-test, deepep-side, mps-side, mps-tier, mps-sweep, proxy-plugins," \
         "proxy-tier, proxy-sweep)"; exit 2 ;;
  esac
done
export EV_PARENT=1 EV_DATE EV_OUT MDEEP_CACHE_DIR DRY_RUN
DEEPEP_BUILD=$EV_OUT/deepep_build
ev_say "pieces: ${plan[*]}; wheels $WHEELS; DeepEP source $DEEPEP_SRC; budget $BUDGET_S s"
ev_install_wheels evidence "$WHEELS" || ev_row wheels 2 "$SECONDS" "pip failed"
ev_versions >/dev/null
left() { echo $(( BUDGET_S - SECONDS )); }

# child NAME SCRIPT PIECES ARGS...: one of the dev scripts, its own pieces, the rest of the
# budget; its summary rows become ours.
child() {
  local name=$1 script=$2 pieces=$3 log t0=$SECONDS rc
  shift 3
  log=$EV_LOGS/$name.log
  if (( $(left) < 30 )); then
    ev_row "$name" 99 0 "skipped: budget (name it in the next call)"
    return
  fi
  PIECES="$pieces" BUDGET=$(left) bash "dev/gpu/$script" "$@" > "$log" 2>&1
  rc=$?
  grep -v "^dry run: \(versions\|pip\)" "$log" | grep -E "^(dry run|$name:)" | cut -c1-220
  while IFS= read -r row; do EV_SUMMARY+=("$row"); done < <(grep -E "^\| [a-z]" "$log" \
    | grep -v "^| piece |")
  [ "$rc" = 0 ] || EV_FAILED=1
  ev_say "$name ($pieces): rc $rc in $((SECONDS - t0)) s"
}

# A piece of this script: the baselines and the main-job comparison.
baselines() {
  local table=$EV_LOGS/baselines_table.md
  ev_piece precompile 150 "$EV_LOGS/precompile.log" python3 -m megatron_deepep.tools.precompile \
    --topk 2 6 8 --index-dtype int64 --fp8 blockwise_1x128 --bench -j "$(nproc)" -q
  local bench_args=(--shapes 4096,7168,256,8 --num-sms 24,132 --fp8 blockwise_1x128)
  local layer_args=(--variants alltoall-fused,alltoall,deepep-sync,deepep-syncfree --iters 20)
  ev_piece "bench EP=1" 240 "$EV_LOGS/bench.log" python3 -m megatron_deepep.bench \
    "${bench_args[@]}" --out "$EV_LOGS/bench"
  ev_row "bench EP=1 (both alltoall rows)" "$PIECE_RC" "$PIECE_S" "$(ev_is_dry && echo \
    "dry run" || grep -c "| megatron alltoall" "$EV_LOGS/bench.log") alltoall rows"
  ev_piece "bench layer" 240 "$EV_LOGS/bench_layer.log" python3 -m megatron_deepep.bench.layer \
    "${layer_args[@]}" --out "$EV_LOGS/bench_layer.json"
  ev_row "bench layer table A" "$PIECE_RC" "$PIECE_S" "see the record"
  if ! ev_is_dry; then
    {
      echo "EP=1 bench (\`python -m megatron_deepep.bench\`), DeepSeek-V3's shape:"
      echo
      grep -E "^\(4096, 7168, 256, 8\) \|" "$EV_LOGS/bench.log" | cut -c1-260
      echo
      echo "One MoE layer forward + backward (\`python -m megatron_deepep.bench.layer\`):"
      echo
      grep -E "^\| " "$EV_LOGS/bench_layer.log"
    } > "$table"
    cat "$EV_LOGS/bench.log" "$EV_LOGS/bench_layer.log" > "$EV_LOGS/baselines.txt"
    grep -E "megatron alltoall|^\| A \| alltoall" "$table" | cut -c1-200
  fi
  ev_record baselines \
    "Baselines on one GPU: Megatron's alltoall with and without TE's fused permute" \
    "python -m megatron_deepep.bench ${bench_args[*]}; python -m megatron_deepep.bench.layer \
${layer_args[*]}" "$EV_LOGS/baselines.txt" "$table"
}

main_job() {
  local steps=${MAIN_STEPS:-40} table=$EV_LOGS/main_table.md
  ev_piece "main job" 360 "$EV_LOGS/main.log" python3 examples/compare_dispatchers.py \
    --steps "$steps" --out "$EV_LOGS/compare"
  ev_row "main job, $steps steps x 3 runs" "$PIECE_RC" "$PIECE_S" "see the record"
  if ! ev_is_dry; then
    {
      echo "\`examples/compare_dispatchers.py --steps $steps\` (EP=1, one seed, each run in a"
      echo "fresh process):"
      echo
      echo '```'
      grep -E "skipped:|median_step_time_ms|\"(deepep|alltoall|alltoall-fused)\":|max_.*diff" \
        "$EV_LOGS/main.log" | head -20
      sed -n '/LM loss per step/,+3p' "$EV_LOGS/main.log"
      tail -n 2 "$EV_LOGS/main.log"
      echo '```'
    } > "$table"
  fi
  ev_record main_job \
    "Main-job comparison on one GPU: deepep, alltoall (fused permute), alltoall (unfused)" \
    "python3 examples/compare_dispatchers.py --steps $steps" "$EV_LOGS/main.log" "$table"
}

model() {
  local inputs=() table=$EV_LOGS/model_table.md f
  for f in "$EV_OUT/mps_model.json" "$EV_OUT/proxy_model.json"; do
    [ -s "$f" ] && inputs+=("$f")
  done
  if (( ${#inputs[@]} == 0 )) && ! ev_is_dry; then
    ev_row model - 0 "not run: no mps_model.json or proxy_model.json yet (run mps, proxy)"
    return
  fi
  ev_piece "internode model" 60 "$EV_LOGS/model.log" \
    python3 -m megatron_deepep.tools.internode_model \
    --tokens 4096 --hidden 7168 --experts 256 --topk 8 --nodes 2 8 --ranks-per-node 8 \
    --node-limited 4 --measured-json "${inputs[@]:-MEASURED.json}" --json "$EV_LOGS/model.json"
  ev_row "internode model with measured inputs" "$PIECE_RC" "$PIECE_S" "${#inputs[@]} input(s)"
  ev_is_dry || { echo '```'; cat "$EV_LOGS/model.log"; echo '```'; } > "$table"
  ev_record model "The internode model of DeepSeek-V3's shape with the measured inputs" \
    "python -m megatron_deepep.tools.internode_model --nodes 2 8 --ranks-per-node 8 \
--node-limited 4 --measured-json ${inputs[*]##*/}" \
    "$EV_LOGS/model.log" "$table"
}

for step in "${plan[@]}"; do
  if (( $(left) < 30 )) && ! ev_is_dry; then
    ev_row "$step" 99 0 "skipped: budget (name it in the next call)"
    continue
  fi
  case $step in
    baselines) baselines ;;
    main) main_job ;;
    deepep) child deepep deepep.sh "build own-test side" "$DEEPEP_SRC" ;;
    deepep-build) child deepep deepep.sh build "$DEEPEP_SRC" ;;
    # The build first: instant when this machine built the same source already.
    deepep-*) child deepep deepep.sh "build ${step#deepep-}" "$DEEPEP_SRC" ;;
    mps|mps-*)
      pieces="side tier sweep"
      [ "$step" = mps ] || pieces=${step#mps-}
      if ls "$DEEPEP_BUILD"/deep_ep_cpp*.so >/dev/null 2>&1; then
        child mps mps.sh "$pieces" "$DEEPEP_BUILD"
      else
        ev_say "mps: no DeepEP build in $DEEPEP_BUILD (run deepep-build in this call first):" \
          "ours only"
        child mps mps.sh "$pieces"
      fi
      ;;
    proxy|proxy-*)
      pieces="plugins tier sweep"
      [ "$step" = proxy ] || pieces=${step#proxy-}
      if ls "$WHEELS"/libucx*.whl >/dev/null 2>&1; then
        child proxy proxy.sh "$pieces" "$WHEELS"
      else
        ev_row "$step" - 0 "not run: no libucx*.whl in WHEELS_DIR (carry the UCX wheel folder)"
      fi
      ;;
    model) model ;;
  esac
done
if ! ev_is_dry && [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  ls benchmarks/"$(ev_card)_${EV_DATE}"_* >/dev/null 2>&1 && \
    tar czf "$OUT/evidence_records.tar.gz" benchmarks/"$(ev_card)_${EV_DATE}"_* 2>/dev/null
  for f in mps_model.json proxy_model.json; do
    [ -s "$EV_OUT/$f" ] && cp "$EV_OUT/$f" "$OUT/$f"
  done
fi
ev_finish
status=$?
if ! ev_is_dry && [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  cp "$EV_LOGS/summary.md" "$OUT/evidence_summary.md"
fi
exit $status
