# call 3 (prepared, not run): the tree as one package, its budget switch at the default
# MDEEP_FP8_ROW_STAGE_MIN_SMS (48), beside the same package with the row stage forced at every
# budget (=0, main's path before round seven: "row") and the register path forced (=1000000:
# "reg"): bit-exactness of both paths at 24 and 132 SMs, --queued at 24-132 SMs (32-64 twice,
# alternating: the crossover), the bench of the default against "row", the FP8 GPU tests
# at 1 process, then at 2 with what time is left. Nothing to carry; run from the repository root
# with this file copied into the tree. DRY_RUN=1 prints the commands instead (on the CPU).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 MDEEP_CACHE_DIR=$PWD/.bench_out/kc PYTHONPATH=$PWD
# Everything under /tmp/w; $OUT gets its tables and one archive (few files come back).
O=/tmp/w; mkdir -p "$O"; T0=$SECONDS
trap 'cp $O/*.md "${OUT:-/tmp}"/ 2>/dev/null; tar czf "${OUT:-/tmp}"/all.tgz -C /tmp w' EXIT
x() { if [ "${DRY_RUN:-0}" = 1 ]; then echo "+ $*"; else eval "$@"; fi; }
knob() { case $1 in row) echo 0;; reg) echo 1000000;; after) echo "";; esac; }
P="python3 dev/gpu/fp8_profile.py"; F=blockwise_1x128,mxfp8_1x32; K=MDEEP_FP8_ROW_STAGE_MIN_SMS
x "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $O/versions.txt"
x "python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 --fp8 blockwise_1x128 \
mxfp8_1x32 blockwise_1x128_fp32_scales --bench -j 16 -q 2>&1 | tail -1"
echo "precompiled at $((SECONDS-T0)) s"
for side in row reg; do for S in 24 132; do
  x "$K=$(knob $side) timeout 90 $P --check --num-sms $S --fp8 $F,blockwise_1x128_fp32_scales \
> $O/check_${side}_$S.log 2>&1"
  echo "check $side $S SMs: $(grep -c bit-exact $O/check_${side}_$S.log 2>/dev/null) bit-exact"
done; done
budgets() { if [ "$1" = 1 ]; then echo 24 32 40 48 56 64 132; else echo 32 40 48 56 64; fi; }
for r in 1 2; do for S in $(budgets $r); do for side in row reg; do
  x "$K=$(knob $side) timeout 45 $P --queued --fp8 $F --num-sms $S 2>&1 \
| grep -E 'queued|Error|error' >> $O/queued_${side}$r.log"
done; done; echo "queued round $r at $((SECONDS-T0)) s"; done
x "python3 dev/gpu/bench_rounds.py row=$O/queued_row1.log reg=$O/queued_reg1.log \
row=$O/queued_row2.log reg=$O/queued_reg2.log > $O/queued_table.md 2>&1; cat $O/queued_table.md"
for side in after row; do
  x "$K=$(knob $side) timeout 120 python3 -m megatron_deepep.bench --shapes 4096,7168,256,8 \
--num-sms 24,48,132 --fp8 $F --no-megatron --out $O/bench_$side > $O/bench_$side.log 2>&1"
  echo "bench $side at $((SECONDS-T0)) s"
done
x "python3 dev/gpu/bench_rounds.py after=$O/bench_after/bench.json row=$O/bench_row/bench.json \
> $O/bench_rounds.md 2>&1; cut -c1-160 $O/bench_rounds.md; rm -f $O/bench_*/bench.png"
G=tests/gpu
left=$(( 420 - (SECONDS - T0) ))
x "MDEEP_TEST_PROCS=1 timeout $left python3 -m pytest -m gpu -q -rs $G/test_fp8_dispatch_gpu.py \
$G/test_fp8_gpu.py $G/test_layout_gpu.py $G/test_hazards_gpu.py > $O/tests1.log 2>&1; \
tail -3 $O/tests1.log"
left=$(( 550 - (SECONDS - T0) ))
x "MDEEP_TEST_PROCS=2 timeout $left python3 -m pytest -m gpu -q -rs $G/test_fp8_dispatch_gpu.py \
> $O/tests2.log 2>&1; tail -3 $O/tests2.log"
echo "done at $((SECONDS-T0)) s"
