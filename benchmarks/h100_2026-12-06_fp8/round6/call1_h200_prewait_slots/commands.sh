set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MDEEP_CACHE_DIR=$PWD/.bench_out/fp8_kernel_cache
O=$OUT; F=blockwise_1x128,mxfp8_1x32,blockwise_1x128_fp32_scales
T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > $O/versions.txt
cat $O/versions.txt
side_path() { case $1 in cached) echo $PWD;; slots) echo $PWD/.mid;; before) echo $PWD/.before;; esac; }
for s in cached slots before; do PYTHONPATH=$(side_path $s) python3 -m megatron_deepep.tools.precompile --topk 8 --index-dtype int64 --fp8 blockwise_1x128 mxfp8_1x32 blockwise_1x128_fp32_scales --bench -j 16 -q 2>&1 | tail -1; done
echo "precompiled at $((SECONDS-T0)) s"
for s in cached slots; do
  PYTHONPATH=$(side_path $s) timeout 80 python3 dev/gpu/fp8_profile.py --check --fp8 $F > $O/check_$s.log 2>&1; echo "check $s rc $?"; grep -E "check " $O/check_$s.log | tail -3
done
echo "checked at $((SECONDS-T0)) s"
PYTHONPATH=$PWD MDEEP_TEST_PROCS=1 timeout 120 python3 -m pytest -m gpu -q -rs tests/gpu/test_fp8_dispatch_gpu.py tests/gpu/test_fp8_gpu.py > $O/tests_cached.log 2>&1; echo "tests cached rc $?"; tail -2 $O/tests_cached.log
echo "tested at $((SECONDS-T0)) s"
for i in 1 2 3; do for s in cached slots before; do
  if (( SECONDS - T0 > 500 )); then echo "skip round $i $s (budget)"; continue; fi
  PYTHONPATH=$(side_path $s) timeout 75 python3 -m megatron_deepep.bench --shapes 4096,7168,256,8 --num-sms 24,132 --fp8 blockwise_1x128,mxfp8_1x32 --no-megatron --profile --out $O/round${i}_$s > $O/round${i}_$s.log 2>&1
  echo "round $i $s rc $? at $((SECONDS-T0)) s"
done; done
args=(); for i in 1 2 3; do for s in cached slots before; do args+=($s=$O/round${i}_$s/bench.json); done; done
python3 dev/gpu/bench_rounds.py "${args[@]}" | tee $O/rounds.md | cut -c1-200
for s in cached slots before; do grep -hE "dispatch_local|layout_kernel" $O/round1_$s.log | sed 's/  */ /g' | cut -c1-140 | head -8; done
