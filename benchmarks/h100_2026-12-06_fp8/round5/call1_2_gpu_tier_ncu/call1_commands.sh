set -u
mkdir -p .nowheels
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
O=$OUT; L=/tmp/fp8logs
OUT=$L BUDGET=330 TEST_TIMEOUT=220 TEST_FILES="tests/gpu/test_fp8_gpu.py tests/gpu/test_nvlink_gpu.py tests/gpu/test_hazards_gpu.py" PIECES="check tests" bash dev/gpu/fp8.sh .nowheels .before > $O/fp8_sh.log 2>&1
tail -4 $O/fp8_sh.log
cat $L/fp8_check.log $L/fp8_tests.log $L/fp8_versions.txt > $O/check_tests1.log
grep -c bit-exact $L/fp8_check.log; tail -2 $L/fp8_tests.log
MDEEP_TEST_PROCS=2 timeout 150 python3 -m pytest -m gpu -q -rs tests/gpu/test_hazards_gpu.py tests/gpu/test_fp8_dispatch_gpu.py tests/gpu/test_nvlink_gpu.py -k "graph_replay or oracle or fp8" > $O/tests2.log 2>&1; tail -2 $O/tests2.log
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
M=l1tex__m_l1tex2xbar_throughput.avg.pct_of_peak_sustained_elapsed,l1tex__m_xbar2l1tex_throughput.avg.pct_of_peak_sustained_elapsed,gpc__cycles_elapsed.avg.per_second,dram__cycles_elapsed.avg.per_second,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_write.sum,sm__warps_active.avg.per_cycle_active
for S in 24 132; do
  timeout 120 $NCU --clock-control none --kernel-name regex:dispatch_local --section SpeedOfLight --section WarpStateStats --section SchedulerStats --metrics $M python3 dev/gpu/fp8_profile.py --fp8 blockwise_1x128 --num-sms $S > /tmp/ncu_$S.log 2>&1
  echo "ncu $S rc $?"
done
cat /tmp/ncu_24.log /tmp/ncu_132.log > $O/ncu.log
grep -E "dispatch_local|Duration|l1tex2xbar|gpc__cycles|inst_executed|issue_active|L1/TEX Cache Throughput" $O/ncu.log | head -80
