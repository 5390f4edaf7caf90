set -u
mkdir -p .nowheels
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MDEEP_CACHE_DIR=$PWD/.bench_out/fp8_kernel_cache
O=$OUT; F=blockwise_1x128,mxfp8_1x32,blockwise_1x128_fp32_scales
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > $O/versions.txt
L0=/tmp/fp8logs0
OUT=$L0 BUDGET=200 TEST_TIMEOUT=150 PIECES="check tests" bash dev/gpu/fp8.sh .nowheels .before > /tmp/fp8_sh0.log 2>&1
cat /tmp/fp8_sh0.log $L0/fp8_check.log $L0/fp8_tests.log > $O/check_tests.log
grep -c bit-exact $L0/fp8_check.log; grep -iE "mismatch|FAIL" $L0/fp8_check.log | head -5; tail -1 $L0/fp8_tests.log
for P in $PWD $PWD/.before; do PYTHONPATH=$P python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 --fp8 ${F//,/ } --bench -j 16 -q 2>&1 | tail -1; done
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
M=gpc__cycles_elapsed.avg.per_second,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__m_l1tex2xbar_req_cycles_active.max.pct_of_peak_sustained_elapsed
for S in 24 132; do for side in after before; do P=$PWD; [ $side = before ] && P=$PWD/.before
  PYTHONPATH=$P timeout 60 $NCU --clock-control none --kernel-name regex:dispatch_local --section SpeedOfLight --section WarpStateStats --metrics $M python3 dev/gpu/fp8_profile.py --fp8 blockwise_1x128 --num-sms $S > /tmp/ncu_${side}_$S.log 2>&1
  echo "ncu $side $S rc $?"
done; done
for f in /tmp/ncu_*_*.log; do echo "== $f"; cat $f; done > $O/ncu.log
grep -E "^== |^  void dispatch_local|Duration" $O/ncu.log | sed 's/  */ /g' | sed 's/(DispatchLocalArgs<T3>)//; s/Context 1, Stream 7, Device 0, CC 9.0//' | paste -s -d' ' | sed 's/ == /\n== /g; s/ void /\n void /g'
echo
for i in 1 2 3; do for side in after before; do P=$PWD; [ $side = before ] && P=$PWD/.before
  PYTHONPATH=$P timeout 70 python3 -m megatron_deepep.bench --shapes 4096,7168,256,8 --num-sms 24,132 --fp8 $F --no-megatron --out /tmp/b_$side$i 2>/dev/null | grep "^(4096" | awk -F'|' -v s=$side$i '{print s"|"$3"|"$4}'
done; done > $O/bench_repeats.log
cp /tmp/b_after1* $O/ 2>/dev/null; ls /tmp/b_after1* | head -3
L=/tmp/fp8logs
OUT=$L BUDGET=260 LAYER_TIMEOUT=220 LAYER_VARIANTS=te-alltoall-fused,te-deepep-fp8-experts,te-deepep-bf16 PIECES="layer" bash dev/gpu/fp8.sh .evw_te .before > $O/layer_sh.log 2>&1
cat $L/fp8_layer.log $L/fp8_versions.txt >> $O/layer_sh.log; tail -25 $L/fp8_layer.log
