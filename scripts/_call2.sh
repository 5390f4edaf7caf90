set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MEGATRON_DEEPEP_CACHE_DIR=/tmp/mdeep_cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
timeout 200 python3 -m pytest -m gpu -x -q tests/gpu/test_layout_dispatch_gpu.py tests/gpu/test_layout_gpu.py 2>&1 | tail -15
for v in "1 4" "0 4" "1 8"; do set -- $v
  echo "=== FUSED_LAYOUT=$1 SUM_LOADS=$2"
  MEGATRON_DEEPEP_FUSED_LAYOUT=$1 MEGATRON_DEEPEP_JIT_DEFINES=MDEEP_FUSED_SUM_LOADS=$2 timeout 120 \
    python3 -m megatron_deepep.bench --shapes "4096,7168,256,8;8192,4096,64,6" --no-megatron --fp8 '' --num-sms 132 --out $OUT/b$1$2 2>&1 | grep -E "^\(" 
done
MDEEP_TEST_PROCS=1 MDEEP_TEST_CALLS=200 timeout 200 python3 -m pytest -m gpu -x -q tests/gpu/test_nvlink_gpu.py tests/gpu/test_megatron_layer_gpu.py 2>&1 | tail -4
