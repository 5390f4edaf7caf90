# NVSHMEM settings for megatron_deepep's internode transport on a Slurm cluster.
# Sourced by examples/slurm_*.sbatch on the batch host; srun passes the environment to every task.
# docs/multinode.md explains every setting and the failures each one prevents.
#
# Inputs (environment, all optional):
#   IB_TRANSPORT            ibrc (default: NVSHMEM's CPU proxy thread posts the transfers) or
#                           ibgda (the GPU posts them to the NIC itself)
#   NVSHMEM_HCA_PE_MAPPING  the NIC of each local rank, in local-rank order, as name:port:count,
#                           e.g. mlx5_0:1:1,mlx5_3:1:1,...  (one entry per GPU)
#   NVSHMEM_HCA_LIST        NICs to use, name:port, assigned to local ranks round-robin
#                           (neither: every GPU takes the NIC nearest to it on PCIe)
#   NVSHMEM_SYMMETRIC_SIZE  heap bytes per GPU; default from Buffer.size_hint of the limits below
#   MAX_TOKENS HIDDEN EP TOPK RANKS_PER_NODE  the Buffer's limits (tokens per rank per call,
#                           hidden size, EP size, top-k, GPUs per node) for that default
#   REPO                    the repository root (default: the current directory)

IB_TRANSPORT=${IB_TRANSPORT:-ibrc}
case "$IB_TRANSPORT" in
  ibrc)
    export NVSHMEM_REMOTE_TRANSPORT=ibrc NVSHMEM_IB_ENABLE_IBGDA=0 ;;
  ibgda)
    # IBGDA runs on top of the IB transports ("IBRC transport skipped in favor of: IBGDA").
    export NVSHMEM_REMOTE_TRANSPORT=ibrc NVSHMEM_IB_ENABLE_IBGDA=1 ;;
  *)
    echo "slurm_nvshmem_env.sh: IB_TRANSPORT must be ibrc or ibgda, got '$IB_TRANSPORT'" >&2
    return 1 ;;
esac

# Which NIC each GPU uses.
if [ -n "${NVSHMEM_HCA_PE_MAPPING:-}" ] && [ -n "${NVSHMEM_HCA_LIST:-}" ]; then
  echo "slurm_nvshmem_env.sh: set NVSHMEM_HCA_PE_MAPPING or NVSHMEM_HCA_LIST, not both" \
    "(NVSHMEM would ignore the mapping)" >&2
  return 1
fi
if [ -n "${NVSHMEM_HCA_PE_MAPPING:-}${NVSHMEM_HCA_LIST:-}" ]; then
  export NVSHMEM_ENABLE_NIC_PE_MAPPING=1
else
  export NVSHMEM_ENABLE_NIC_PE_MAPPING=0
fi
# torch copies NCCL_IB_HCA into an unset NVSHMEM_HCA_LIST (and turns the mapping on), but NCCL
# matches name prefixes ("mlx5") where NVSHMEM matches whole names: an empty list keeps them
# apart and filters nothing.
export NVSHMEM_HCA_LIST=${NVSHMEM_HCA_LIST:-}

# No NVLink multicast (NVLS): the transport does not use it, and it costs memory and set-up.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

# The symmetric heap: every GPU reserves NVSHMEM_SYMMETRIC_SIZE at start-up.
if [ -z "${NVSHMEM_SYMMETRIC_SIZE:-}" ]; then
  heap_err=$(mktemp)
  if heap=$(env PYTHONPATH="${REPO:-.}${PYTHONPATH:+:$PYTHONPATH}" \
      python3 -m megatron_deepep.tools.multinode_check --print-nvshmem-size \
      --max-tokens "${MAX_TOKENS:-4096}" --max-hidden "${HIDDEN:-7168}" --ranks "${EP:-16}" \
      --topk "${TOPK:-8}" --num-ranks-per-node "${RANKS_PER_NODE:-8}" 2>"$heap_err"); then
    export NVSHMEM_SYMMETRIC_SIZE=$heap
  else
    echo "slurm_nvshmem_env.sh: no heap size from Buffer.size_hint" \
      "($(tail -n 1 "$heap_err")); NVSHMEM keeps its default (1 GiB)" >&2
  fi
  rm -f "$heap_err"
fi
echo "slurm_nvshmem_env.sh: IB_TRANSPORT=$IB_TRANSPORT" \
  "NVSHMEM_ENABLE_NIC_PE_MAPPING=$NVSHMEM_ENABLE_NIC_PE_MAPPING" \
  "NVSHMEM_HCA_PE_MAPPING=${NVSHMEM_HCA_PE_MAPPING:-} NVSHMEM_HCA_LIST=$NVSHMEM_HCA_LIST" \
  "NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-default}"
