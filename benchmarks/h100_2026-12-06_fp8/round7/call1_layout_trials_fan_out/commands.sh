set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MDEEP_CACHE_DIR=$PWD/.bench_out/kc
O=/tmp/w; mkdir -p $O; T0=$SECONDS; trap 'cp $O/*.md $O/queued.log $OUT/ 2>/dev/null; tar czf $OUT/all.tgz -C /tmp w' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > $O/versions.txt; cat $O/versions.txt
side_path() { case $1 in main) echo $PWD;; recv) echo $PWD/.recv;; l1024) echo $PWD/.mid;; both) echo $PWD/.both;; esac; }
SIDES="main recv l1024 both"
for s in $SIDES; do PYTHONPATH=$(side_path $s) python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 --fp8 blockwise_1x128 mxfp8_1x32 --bench -j 16 -q 2>&1 | tail -1; done
echo "precompiled at $((SECONDS-T0)) s"
for s in recv l1024 both; do
  PYTHONPATH=$(side_path $s) timeout 60 python3 dev/gpu/fp8_profile.py --check --fp8 blockwise_1x128,mxfp8_1x32 --check-hidden 7168,2880 > $O/check_$s.log 2>&1
  echo "check $s rc $? bit-exact $(grep -c bit-exact $O/check_$s.log) at $((SECONDS-T0)) s"
done
queued() { for s in $SIDES; do echo "== round $1 132 SMs $s"; PYTHONPATH=$(side_path $s) timeout 45 python3 dev/gpu/fp8_profile.py --queued --fp8 blockwise_1x128 --num-sms 132 2>&1 | grep -E "queued|Error|error"; done >> $O/queued.log 2>&1; echo "queued round $1 at $((SECONDS-T0)) s"; }
queued 1
PYTHONPATH=$PWD timeout 90 python3 -m megatron_deepep.bench --shapes 4096,7168,256,8 --num-sms 24,132 --fp8 blockwise_1x128,mxfp8_1x32 --no-megatron --out $O/bench_main > $O/bench_main.log 2>&1
echo "bench rc $? at $((SECONDS-T0)) s"; grep -E "bare fan-out|x0\.[0-9]+ of bf16" $O/bench_main.log | cut -c1-200
python3 -c "import json,sys; [print(k, {a: round(b, 1) for a, b in v.items()}) for k, v in json.load(open(sys.argv[1]))[0].get('sm_fan_out', {}).items()]" $O/bench_main/bench.json
queued 2
queued 3
python3 - $O/queued.log <<'PY' | tee $O/queued_table.md
import collections, re, sys
t = collections.defaultdict(list); side = None
for line in open(sys.argv[1]):
    m = re.match(r"== round \d+ (\d+) SMs (\w+)", line)
    if m: side = m.group(2); continue
    m = re.match(r"fp8_profile queued: (.+): GPU ([\d.]+)", line)
    if m: t[(m.group(1), side)].append(float(m.group(2)))
for call in sorted({c for c, _ in t}):
    print(f"| {call} | " + " | ".join(f"{s} {min(t[(call, s)], default=0)} {t[(call, s)]}" for s in ("main", "recv", "l1024", "both")) + " |")
PY
for s in recv l1024 both; do
  (( SECONDS - T0 > 470 )) && break
  d=$(side_path $s); cp -r tests dev pytest.ini $d/
  (cd $d && MDEEP_TEST_PROCS=1 timeout 60 python3 -m pytest -m gpu -q -x tests/gpu/test_layout_gpu.py > $O/layout_$s.log 2>&1; echo "layout tests $s rc $? $(tail -1 $O/layout_$s.log) at $((SECONDS-T0)) s")
done
echo "done at $((SECONDS-T0)) s"
