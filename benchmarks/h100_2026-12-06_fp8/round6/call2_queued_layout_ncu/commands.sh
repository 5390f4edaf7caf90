set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MDEEP_CACHE_DIR=$PWD/.bench_out/fp8_kernel_cache
O=$OUT; T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > $O/versions.txt
cat $O/versions.txt
side_path() { case $1 in main) echo $PWD;; slots) echo $PWD/.mid;; esac; }
for s in main slots; do PYTHONPATH=$(side_path $s) python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 --fp8 blockwise_1x128 mxfp8_1x32 --bench -j 16 -q 2>&1 | tail -1; done
echo "precompiled at $((SECONDS-T0)) s"
for r in 1 2; do for S in 132 24; do for s in main slots; do
  echo "== round $r $S SMs $s"
  PYTHONPATH=$(side_path $s) timeout 60 python3 dev/gpu/fp8_profile.py --queued --fp8 blockwise_1x128,mxfp8_1x32 --num-sms $S 2>&1 | grep -E "queued|Error|error"
done; done; done > $O/queued.log 2>&1
cat $O/queued.log
echo "queued at $((SECONDS-T0)) s"
PYTHONPATH=$PWD timeout 60 python3 dev/gpu/fp8_profile.py --timeline --fp8 blockwise_1x128 --num-sms 132 > $O/timeline.log 2>&1
grep "timeline:" $O/timeline.log
echo "timeline at $((SECONDS-T0)) s"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
export MDEEP_CACHE_DIR=$PWD/.bench_out/lineinfo_cache MDEEP_JIT_LINEINFO=1
PYTHONPATH=$PWD timeout 150 $NCU --clock-control none --kernel-name regex:layout_kernel --launch-count 3 --section SpeedOfLight --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section SchedulerStats python3 dev/gpu/fp8_profile.py --fp8 blockwise_1x128 --num-sms 132 > $O/ncu_layout.log 2>&1
echo "ncu rc $? at $((SECONDS-T0)) s"
grep -E "^  layout|Duration|Elapsed Cycles|Registers|Achieved Occupancy|Theoretical Occ|Stall|stall|Warp Cycles Per Issued|Issued Warp|No Eligible|Memory Throughput|DRAM Through|Block Limit" $O/ncu_layout.log | sed 's/  */ /g' | cut -c1-170 | head -70
