# call 2: fp8-direct-quantize (working tree: the quantizing EP = 1 expand always quantizes in
# registers) against main (.before: row stages), bit-exactness, --queued and bench rounds.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MDEEP_CACHE_DIR=$PWD/.bench_out/kc
O=/tmp/w; mkdir -p $O; T0=$SECONDS; trap 'cp $O/*.md $O/queued.log $OUT/ 2>/dev/null; tar czf $OUT/all.tgz -C /tmp w' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > $O/versions.txt; cat $O/versions.txt
side_path() { case $1 in direct) echo $PWD;; main) echo $PWD/.before;; esac; }
SIDES="direct main"
for s in $SIDES; do PYTHONPATH=$(side_path $s) python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 --fp8 blockwise_1x128 mxfp8_1x32 blockwise_1x128_fp32_scales --bench -j 16 -q 2>&1 | tail -1; done
echo "precompiled at $((SECONDS-T0)) s"
PYTHONPATH=$PWD timeout 90 python3 dev/gpu/fp8_profile.py --check --fp8 blockwise_1x128,mxfp8_1x32,blockwise_1x128_fp32_scales > $O/check.log 2>&1; echo "check rc $? bit-exact $(grep -c bit-exact $O/check.log) at $((SECONDS-T0)) s"; grep -v bit-exact $O/check.log | tail -5
queued() { for S in 24 132; do for s in $SIDES; do echo "== round $1 $S SMs $s"; PYTHONPATH=$(side_path $s) timeout 45 python3 dev/gpu/fp8_profile.py --queued --fp8 blockwise_1x128,mxfp8_1x32 --num-sms $S 2>&1 | grep -E "queued|Error|error"; done; done >> $O/queued.log 2>&1; echo "queued round $1 at $((SECONDS-T0)) s"; }
queued 1
queued 2
python3 - $O/queued.log <<'PY' | tee $O/queued_table.md
import collections, re, sys
t = collections.defaultdict(list); side = None
for line in open(sys.argv[1]):
    m = re.match(r"== round \d+ (\d+) SMs (\w+)", line)
    if m: side = m.group(2); continue
    m = re.match(r"fp8_profile queued: (.+): GPU ([\d.]+)", line)
    if m: t[(m.group(1), side)].append(float(m.group(2)))
for call in sorted({c for c, _ in t}):
    print(f"| {call} | " + " | ".join(f"{s} {min(t[(call, s)], default=0)} {t[(call, s)]}" for s in ("direct", "main")) + " |")
PY
for s in $SIDES; do
  PYTHONPATH=$(side_path $s) timeout 80 python3 -m megatron_deepep.bench --shapes 4096,7168,256,8 --num-sms 24,132 --fp8 blockwise_1x128,mxfp8_1x32 --no-megatron --out $O/bench1_$s > $O/bench1_$s.log 2>&1
  echo "bench $s rc $? at $((SECONDS-T0)) s"
done
python3 dev/gpu/bench_rounds.py direct=$O/bench1_direct/bench.json main=$O/bench1_main/bench.json > $O/bench_rounds.md 2>&1; cut -c1-180 $O/bench_rounds.md
grep -h "bare fan-out" $O/bench1_main.log
rm -f $O/bench*_*/bench.png
left=$(( 540 - (SECONDS - T0) )); echo "tests with $left s left"
PYTHONPATH=$PWD MDEEP_TEST_PROCS=1 timeout $left python3 -m pytest -m gpu -q -rs tests/gpu/test_fp8_dispatch_gpu.py tests/gpu/test_fp8_gpu.py > $O/tests1.log 2>&1; echo "tests1 rc $?"; tail -3 $O/tests1.log
echo "done at $((SECONDS-T0)) s"
