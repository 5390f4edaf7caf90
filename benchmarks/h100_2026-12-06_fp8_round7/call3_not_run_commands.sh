# call 3 (prepared, not run): this tree (ROW_STAGE_MIN_SMS = 64, "after") against the row stage
# at every budget (.before) and the register path at every budget (.direct): bit-exactness at
# both paths, --queued at 24 and 132 SMs and the two pure paths at 40-96 SMs (the crossover),
# the bench (python3 -P -m: each side its own package), the FP8 GPU tests. The folders:
#   git archive 02cf9ce megatron_deepep cuda_src setup.py | tar -x -C .before
#   git archive HEAD megatron_deepep cuda_src setup.py | tar -x -C .direct
#   sed -i 's/^ROW_STAGE_MIN_SMS = 64$/ROW_STAGE_MIN_SMS = 1 << 30/' .direct/megatron_deepep/ops/dispatch.py
# run with carry [".before", ".direct"] and this file copied into the tree.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MDEEP_CACHE_DIR=$PWD/.bench_out/kc
O=/tmp/w; mkdir -p $O; T0=$SECONDS; trap 'cp $O/*.md $OUT/ 2>/dev/null; tar czf $OUT/all.tgz -C /tmp w' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > $O/versions.txt; cat $O/versions.txt
side_path() { case $1 in after) echo $PWD;; before) echo $PWD/.before;; direct) echo $PWD/.direct;; esac; }
PYTHONPATH=$PWD python3 -P -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 --fp8 blockwise_1x128 mxfp8_1x32 blockwise_1x128_fp32_scales --bench -j 16 -q 2>&1 | tail -1
echo "precompiled at $((SECONDS-T0)) s"
for S in 24 132; do PYTHONPATH=$PWD timeout 90 python3 dev/gpu/fp8_profile.py --check --num-sms $S --fp8 blockwise_1x128,mxfp8_1x32,blockwise_1x128_fp32_scales > $O/check_$S.log 2>&1; echo "check $S SMs rc $? bit-exact $(grep -c bit-exact $O/check_$S.log) at $((SECONDS-T0)) s"; done
q() { echo "== round $1 $2 SMs $3"; PYTHONPATH=$(side_path $3) timeout 45 python3 dev/gpu/fp8_profile.py --queued --fp8 blockwise_1x128,mxfp8_1x32 --num-sms $2 2>&1 | grep -E "queued|Error|error"; }
for r in 1 2; do
  for S in 24 132; do for s in after before; do q $r $S $s; done; done
  for S in 40 56 72 96; do for s in direct before; do q $r $S $s; done; done
  echo "queued round $r at $((SECONDS-T0)) s" >&2
done > $O/queued.log 2>&1
python3 - $O/queued.log <<'PY' | tee $O/queued_table.md
import collections, re, sys
t = collections.defaultdict(list); side = sms = None
for line in open(sys.argv[1]):
    m = re.match(r"== round \d+ (\d+) SMs (\w+)", line)
    if m: sms, side = m.groups(); continue
    m = re.match(r"fp8_profile queued: (.+): GPU ([\d.]+)", line)
    if m: t[(int(sms), m.group(1), side)].append(float(m.group(2)))
for key in sorted({(a, b) for a, b, _ in t}):
    print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{s} {min(t[key + (s,)])} {t[key + (s,)]}" for s in ("after", "direct", "before") if t.get(key + (s,))) + " |")
PY
for r in 1 2; do for s in after before; do
  PYTHONPATH=$(side_path $s) timeout 80 python3 -P -m megatron_deepep.bench --shapes 4096,7168,256,8 --num-sms 24,132 --fp8 blockwise_1x128,mxfp8_1x32 --no-megatron --out $O/bench${r}_$s > $O/bench${r}_$s.log 2>&1
  echo "bench $r $s rc $? at $((SECONDS-T0)) s"
done; done
args=(); for r in 1 2; do for s in after before; do args+=($s=$O/bench${r}_$s/bench.json); done; done
python3 dev/gpu/bench_rounds.py "${args[@]}" > $O/bench_rounds.md 2>&1; cut -c1-160 $O/bench_rounds.md
grep -h "bare fan-out" $O/bench1_after.log
rm -f $O/bench*_*/bench.png
left=$(( 550 - (SECONDS - T0) )); echo "tests with $left s left"
PYTHONPATH=$PWD MDEEP_TEST_PROCS=1 timeout $left python3 -m pytest -m gpu -q -rs tests/gpu/test_fp8_dispatch_gpu.py tests/gpu/test_fp8_gpu.py tests/gpu/test_layout_gpu.py tests/gpu/test_hazards_gpu.py > $O/tests1.log 2>&1; echo "tests1 rc $?"; tail -3 $O/tests1.log
echo "done at $((SECONDS-T0)) s"
