#!/usr/bin/env bash
# The Transformer Engine tier on a GPU machine (one H200 is enough):
#   bash dev/gpu/gpu_te.sh
# Needs in the repo's WHEELS_DIR (default .whl/): the TE wheel set of the TE 2.20.2 wheels built
# for the machine 
# (transformer_engine, transformer_engine_cu13, transformer_engine_torch, pydantic and its three
# dependencies) and the megatron-core wheel. They are installed together, in ONE pip command
# (one at a time with --target silently drops the extension's .so), into SITE_DIR.
# Runs the TE tests (tests/gpu/test_te_gpu.py, tests/gpu/test_te_experts_gpu.py,
# tests/gpu/test_parity_te_gpu.py, the columnwise kernel's tests/gpu/test_fp8_columnwise_gpu.py
# and the TE checks of the CPU files) and prints one PASS/FAIL/SKIP line per test with its
# time, the measured numbers the tests print, and a summary line. Full log and JUnit XML in
# $OUT (default .bench_out). Exit status: pytest's.
# MAIN_JOB=N (off by default; about 1-2 minutes a run): the main job (examples/run_gpt_moe.sh)
# with TE layers, --moe-grouped-gemm and the blockwise FP8 recipe, N steps each, for alltoall,
# deepep bf16 dispatch, deepep FP8 dispatch dequantized for TEGroupedMLP, and deepep FP8 dispatch
# into the FP8 experts (MDEEP_FP8_EXPERTS=1); prints rc, first/last loss and the median step
# time. SKIP_TESTS=1 runs only that: SKIP_TESTS=1 MAIN_JOB=50 bash dev/gpu/gpu_te.sh
# MAIN_JOB_RUNS picks runs (dispatcher:fp8-dispatch:fp8-experts), e.g. to split them over two
# calls: MAIN_JOB_RUNS="deepep:blockwise:1 deepep:blockwise:0"; MAIN_JOB_TIMEOUT (200 s a run).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1  # MDEEP_CACHE_DIR: the package's per-user cache unless set
OUT=${OUT:-.bench_out}
mkdir -p "$OUT"
t0=$(date +%s)
if ! ls "$WHEELS_DIR"/transformer_engine_torch-*.whl >/dev/null 2>&1; then
  echo "gpu_te: FAIL no $WHEELS_DIR/transformer_engine_torch-*.whl" \
    "(copy the TE 2.20.2 wheels built for the machine *.whl into $WHEELS_DIR/)"
  exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/wheels.sh"
install_wheels gpu_te || exit 2
print_versions gpu_te
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
TESTS="tests/gpu/test_te_gpu.py tests/gpu/test_te_experts_gpu.py tests/gpu/test_parity_te_gpu.py
  tests/gpu/test_fp8_columnwise_gpu.py tests/fp8/test_te_bridge.py tests/megatron/test_te_experts.py
  tests/fp8/test_fp8_columnwise.py
  tests/fp8/test_fp8_formats.py::test_format_for_recipe
  tests/fp8/test_fp8_formats.py::test_te_tensor_dequantizes_like_reference
  tests/fp8/test_fp8_dispatch.py::test_fp8_output_falls_back_without_te
  tests/fp8/test_fp8_dispatch.py::test_te_handoff_wraps_received_rows
  tests/megatron/test_fp8_dispatch_megatron.py::\
test_handoff_needs_matching_recipe_and_no_capacity_padding"
t1=$(date +%s)
rm -f "$OUT/te_tests.xml"
# shellcheck disable=SC2086
timeout ${TEST_TIMEOUT:-450} python3 -m pytest -q -p no:cacheprovider -o junit_logging=system-out \
  --junitxml="$OUT/te_tests.xml" $TESTS ${PYTEST_ARGS:-} > "$OUT/te_tests.log" 2>&1
rc=$?
echo "gpu_te: pytest rc $rc in $(( $(date +%s) - t1 )) s (log $OUT/te_tests.log)"
python3 - "$OUT/te_tests.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as exc:
    print(f"gpu_te: FAIL no JUnit XML ({exc}); see the log")
    sys.exit(0)
counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
for case in root.iter("testcase"):
    classname = case.get("classname", "")
    name = classname.split(".")[-1] + "::" + case.get("name", "")
    status, why = "PASS", ""
    for tag, label in (("failure", "FAIL"), ("error", "FAIL"), ("skipped", "SKIP")):
        node = case.find(tag)
        if node is not None:
            status = label
            why = (node.get("message") or node.text or "").strip().splitlines()
            why = why[0][:140] if why else ""
            break
    counts[status] += 1
    if status == "PASS" and ".gpu." not in classname:
        continue  # CPU-file checks: only their failures and skips are listed
    print(f"{status} {float(case.get('time', 0)):7.2f}s {name}" + (f"  -- {why}" if why else ""))
    out = case.find("system-out")
    if out is not None and out.text:
        for line in out.text.strip().splitlines():
            if line.strip() and not line.startswith("---"):
                print(f"        {line.strip()[:150]}")
print(f"gpu_te: SUMMARY {counts['PASS']} passed, {counts['FAIL']} failed, "
      f"{counts['SKIP']} skipped")
EOF
if [ $rc -ne 0 ]; then
  echo "gpu_te: errors in the log, then its last lines:"
  grep -E "Error|error|assert|FAILED" "$OUT/te_tests.log" | tail -20
  tail -n 8 "$OUT/te_tests.log"
fi
fi
if [ "${MAIN_JOB:-0}" != 0 ]; then
  TE_FLAGS="--transformer-impl transformer_engine --moe-grouped-gemm --fp8-format e4m3
    --fp8-recipe blockwise --moe-router-padding-for-quantization"
  for run in ${MAIN_JOB_RUNS:-alltoall:off:0 deepep:off:0 deepep:blockwise:0 deepep:blockwise:1}
  do
    IFS=: read -r dispatcher fp8 experts <<< "$run"
    name="${dispatcher}_fp8-${fp8}_experts-${experts}"
    t2=$(date +%s)
    extra=()
    [ "$dispatcher" = deepep ] && extra=(--moe-mdeep-fp8-dispatch "$fp8")
    # shellcheck disable=SC2086
    MDEEP_FP8_EXPERTS=$experts INSTALL=0 DISPATCHER=$dispatcher TRAIN_ITERS=$MAIN_JOB \
      OUT="$OUT/te_$name" timeout "${MAIN_JOB_TIMEOUT:-200}" bash examples/run_gpt_moe.sh \
      $TE_FLAGS "${extra[@]}" > "$OUT/te_main_job_$name.log" 2>&1
    job_rc=$?
    python3 - "$OUT/te_main_job_$name.log" "$name" "$job_rc" "$(( $(date +%s) - t2 ))" <<'PY'
import re
import statistics
import sys

path, name, rc, wall = sys.argv[1:]
losses, times = {}, []
for line in open(path, errors="replace"):
    it = re.search(r"iteration\s+(\d+)/", line)
    loss = re.search(r"lm loss: ([0-9.Ee+-]+)", line)
    ms = re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", line)
    if it and loss:
        losses[int(it.group(1))] = float(loss.group(1))
        if ms and int(it.group(1)) > 3:
            times.append(float(ms.group(1)))
status = "PASS" if rc == "0" and losses else "FAIL"
first, last = (min(losses), max(losses)) if losses else (0, 0)
nan = float("nan")
print(f"{status} main job {name:34s} rc {rc} wall {wall} s, loss it{first} "
      f"{losses.get(first, nan):.4f} it{last} {losses.get(last, nan):.4f}, median step "
      f"{statistics.median(times) if times else nan:.1f} ms")
if status == "FAIL":
    for line in [l.rstrip() for l in open(path, errors="replace") if "rror" in l][-4:]:
        print("        " + line[:160])
PY
  done
fi
echo "gpu_te: total $(( $(date +%s) - t0 )) s"
exit $rc
