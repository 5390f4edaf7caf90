set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MDEEP_CACHE_DIR=$PWD/.bench_out/fp8_kernel_cache
O=$OUT; F=blockwise_1x128,mxfp8_1x32
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > $O/versions.txt
side_path() { case $1 in after) echo $PWD;; mid) echo $PWD/.mid;; before) echo $PWD/.before;; esac; }
for s in after mid before; do PYTHONPATH=$(side_path $s) python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 --fp8 blockwise_1x128 mxfp8_1x32 --bench -j 16 -q 2>&1 | tail -1; done
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
for S in 132 24; do for s in after mid before; do
  PYTHONPATH=$(side_path $s) timeout 50 $NCU --clock-control none --kernel-name regex:dispatch_local --section SpeedOfLight --section LaunchStats --metrics smsp__inst_executed.sum,l1tex__m_l1tex2xbar_req_cycles_active.max.pct_of_peak_sustained_elapsed python3 dev/gpu/fp8_profile.py --fp8 blockwise_1x128 --num-sms $S > /tmp/ncu_${s}_$S.log 2>&1
  echo "ncu $s $S rc $?"
done; done
for f in /tmp/ncu_*_*.log; do echo "== $f"; cat $f; done > $O/ncu.log
grep -E "^== |^  void dispatch_local<8, ., long long, 2|Duration" $O/ncu.log | sed 's/  */ /g' | sed 's/(DispatchLocalArgs<T3>).*//' | paste -s -d' ' | sed 's/ == /\n== /g'
echo
for i in 1 2; do for s in after mid before; do
  PYTHONPATH=$(side_path $s) timeout 90 python3 -m megatron_deepep.bench --shapes 4096,7168,256,8 --num-sms 24,132 --fp8 $F --no-megatron --profile --out /tmp/b_$s$i > /tmp/bp_$s$i.log 2>/dev/null
  grep "^(4096" /tmp/bp_$s$i.log | awk -F'|' -v s=$s$i '{print s"|"$3"|"$4}'
done; done > $O/bench_repeats.log
for f in /tmp/bp_*.log; do echo "== $f"; sed -n '/^profile, /,$p' $f; done > $O/bench_profiles.log
grep -E "^== |kernels of|dispatch_local|layout_kernel" $O/bench_profiles.log | sed 's/  */ /g' | cut -c1-150 | head -60
