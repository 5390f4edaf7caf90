set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MDEEP_CACHE_DIR=$PWD/.bench_out/fp8_kernel_cache
O=/tmp/w; mkdir -p $O; T0=$SECONDS; trap 'tar czf $OUT/all.tgz -C /tmp w' EXIT
F3=blockwise_1x128,mxfp8_1x32,blockwise_1x128_fp32_scales
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > $O/versions.txt
cat $O/versions.txt
side_path() { case $1 in v3) echo $PWD;; v1) echo $PWD/.mid;; main) echo $PWD/.before;; esac; }
for s in v3 v1 main; do PYTHONPATH=$(side_path $s) python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 --fp8 blockwise_1x128 mxfp8_1x32 blockwise_1x128_fp32_scales --bench -j 16 -q 2>&1 | tail -1; done
echo "precompiled at $((SECONDS-T0)) s"
PYTHONPATH=$PWD timeout 90 python3 dev/gpu/fp8_profile.py --check --fp8 $F3 > $O/check.log 2>&1; echo "check rc $?"; grep -c "bit-exact" $O/check.log
echo "checked at $((SECONDS-T0)) s"
for r in 1 2; do for S in 24 132; do for s in v3 v1 main; do
  echo "== round $r $S SMs $s"
  PYTHONPATH=$(side_path $s) timeout 60 python3 dev/gpu/fp8_profile.py --queued --fp8 blockwise_1x128,mxfp8_1x32 --num-sms $S 2>&1 | grep -E "queued|Error|error"
done; done; done > $O/queued.log 2>&1
echo "queued at $((SECONDS-T0)) s"
for r in 1 2; do for s in v3 v1 main; do
  PYTHONPATH=$(side_path $s) timeout 75 python3 -m megatron_deepep.bench --shapes 4096,7168,256,8 --num-sms 24,132 --fp8 blockwise_1x128,mxfp8_1x32 --no-megatron --out $O/bench${r}_$s > $O/bench${r}_$s.log 2>&1
  echo "bench $r $s rc $? at $((SECONDS-T0)) s"
done; done
args=(); for r in 1 2; do for s in v3 v1 main; do args+=($s=$O/bench${r}_$s/bench.json); done; done
python3 dev/gpu/bench_rounds.py "${args[@]}" > $O/bench_rounds.md 2>&1
cut -c1-190 $O/bench_rounds.md
python3 - $O/queued.log <<'PY'
import collections, re, sys
t = collections.defaultdict(list); side = sms = None
for line in open(sys.argv[1]):
    m = re.match(r"== round \d+ (\d+) SMs (\w+)", line)
    if m: sms, side = m.groups(); continue
    m = re.match(r"fp8_profile queued: (.+): GPU ([\d.]+)", line)
    if m: t[(sms, m.group(1), side)].append(float(m.group(2)))
for key in sorted({(a, b) for a, b, _ in t}):
    print(key[0], "SMs", key[1], " | ".join(f"{s} {min(t[key + (s,)], default=0)} {t[key + (s,)]}" for s in ("v3", "v1", "main")))
PY
rm -rf $O/bench*_*/bench.png
cp $O/bench_rounds.md $O/queued.log $OUT/
if (( SECONDS - T0 < 400 )); then
PYTHONPATH=$PWD MDEEP_TEST_PROCS=1 timeout 170 python3 -m pytest -m gpu -q -rs tests/gpu/test_fp8_dispatch_gpu.py tests/gpu/test_fp8_gpu.py tests/gpu/test_nvlink_gpu.py tests/gpu/test_hazards_gpu.py tests/gpu/test_parity_dtypes_gpu.py > $O/tests1.log 2>&1; echo "tests1 rc $?"; tail -4 $O/tests1.log
fi
echo "done at $((SECONDS-T0)) s"
