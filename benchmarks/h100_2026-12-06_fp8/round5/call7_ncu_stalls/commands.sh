set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MDEEP_CACHE_DIR=$PWD/.bench_out/lineinfo_cache MDEEP_JIT_LINEINFO=1 PYTHONPATH=$PWD
O=$OUT
python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 --fp8 blockwise_1x128 -j 16 -q 2>&1 | tail -1
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
$NCU --version | tail -1 > $O/ncu_version.txt
for S in 24 132; do
  timeout 70 $NCU --clock-control none --kernel-name regex:dispatch_local --section SourceCounters --section WarpStateStats --section SpeedOfLight python3 dev/gpu/fp8_profile.py --fp8 blockwise_1x128 --num-sms $S > $O/ncu_source_$S.log 2>&1
  echo "ncu $S rc $?"
done
grep -E "^  void|Duration|stall|Stall" $O/ncu_source_24.log | sed 's/  */ /g' | cut -c1-160 | head -60
