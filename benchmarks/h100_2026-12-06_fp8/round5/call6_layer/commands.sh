set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MDEEP_CACHE_DIR=$PWD/.bench_out/fp8_kernel_cache
O=$OUT
source dev/gpu/wheels.sh
WHEELS_DIR=.evw_te install_wheels_if_any layer
print_versions layer > $O/versions.txt 2>&1
for order in "te-alltoall-fused,te-deepep-fp8-experts" "te-deepep-fp8-experts,te-alltoall-fused" "te-alltoall-fused,te-deepep-fp8-experts"; do
  timeout 110 python3 -m megatron_deepep.bench.layer --te --te-shapes "4096,7168,256,8,2048" --variants $order --iters 20 --out /tmp/layer.json > /tmp/layer.log 2>&1
  echo "rc $? order $order"; grep "^| B" /tmp/layer.log
  cat /tmp/layer.log >> $O/layer_all.log
done
