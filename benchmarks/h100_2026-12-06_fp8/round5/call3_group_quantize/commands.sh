set -u
mkdir -p .nowheels
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MDEEP_CACHE_DIR=$PWD/.bench_out/fp8_kernel_cache
O=$OUT; L=/tmp/fp8logs; F=blockwise_1x128,mxfp8_1x32,blockwise_1x128_fp32_scales
OUT=$L BUDGET=230 TEST_TIMEOUT=170 PIECES="check tests" bash dev/gpu/fp8.sh .nowheels .before > $O/fp8_sh.log 2>&1
tail -4 $O/fp8_sh.log
cat $L/fp8_check.log $L/fp8_tests.log $L/fp8_versions.txt > $O/check_tests.log
grep -c bit-exact $L/fp8_check.log; grep -iE "mismatch|FAIL" $L/fp8_check.log | head -5; tail -2 $L/fp8_tests.log
PYTHONPATH=$PWD/.before python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 --fp8 ${F//,/ } --bench -j 16 -q > /dev/null 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader -lms 200 > /tmp/smi.log 2>&1 &
SMI=$!
for i in 1 2 3; do for side in after before; do P=$PWD; [ $side = before ] && P=$PWD/.before
  echo "round $side$i $(date +%T.%N)" >> /tmp/smi_marks.log
  PYTHONPATH=$P timeout 70 python3 -m megatron_deepep.bench --shapes 4096,7168,256,8 --num-sms 24,132 --fp8 $F --no-megatron --out /tmp/b_$side$i 2>/dev/null | grep "^(4096" | awk -F'|' -v s=$side$i '{print s"|"$3"|"$4}'
done; done > $O/bench_repeats.log
kill $SMI; cat /tmp/smi_marks.log /tmp/smi.log > $O/smi.log
grep -E "fp8 (blockwise_1x128|mxfp8_1x32) |SMs (sync|nosync|cached) " $O/bench_repeats.log | sed 's/\[wire bytes x0.516, //' | head -40
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
M=breakdown:l1tex__throughput.avg.pct_of_peak_sustained_elapsed,gpc__cycles_elapsed.avg.per_second,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__m_l1tex2xbar_throughput.avg.pct_of_peak_sustained_elapsed
for S in 24 132; do
  PYTHONPATH=$PWD timeout 80 $NCU --clock-control none --kernel-name regex:dispatch_local --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --metrics $M python3 dev/gpu/fp8_profile.py --fp8 blockwise_1x128 --num-sms $S > /tmp/ncu_$S.log 2>&1
  echo "ncu $S rc $?"
done
cat /tmp/ncu_24.log /tmp/ncu_132.log > $O/ncu.log
grep -E "^  void dispatch_local|Duration" $O/ncu.log | sed 's/  */ /g' | paste - - | cut -c1-160
