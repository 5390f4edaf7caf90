"""The internode transport's kernels (`cuda_src/internode/`; NVSHMEM-linked by
`kernels.nvshmem_link`), one module per kernel source as `ops` mirrors `cuda_src/`: `full`
(`internode/full.cu`), `ring` (`internode/ring.cu`) and `net_ring` (`internode/net_ring.cu`),
one per node staging; `common` launches the kernels several stagings share (node layout,
notify, send, reduce) from the staging in use and holds the table of stagings; `args` the one
argument struct and launch. The names below are re-exported by `ops`."""

from megatron_deepep.ops.internode.args import (  # noqa: F401
    INTERNODE_FIELDS, INTERNODE_NOTIFY_THREADS, INTERNODE_THREADS, InternodeArgs,
    internode_wire)
from megatron_deepep.ops.internode.common import (  # noqa: F401
    INTERNODE_SOURCES, INTERNODE_STAGING_KERNELS, internode_combine_reduce,
    internode_dispatch_send, internode_families, internode_node_layout, internode_notify)
from megatron_deepep.ops.internode.full import (  # noqa: F401
    INTERNODE_KERNELS, internode_combine_expressions, internode_combine_forward,
    internode_combine_send, internode_dispatch_recv, internode_expressions, internode_forward)
from megatron_deepep.ops.internode.net_ring import (  # noqa: F401
    INTERNODE_NET_KERNELS, NET_ROLE_GROUPS_PER_RANK, internode_net_combine,
    internode_net_combine_expressions, internode_net_dispatch, internode_net_expressions,
    net_ring_min_blocks)
from megatron_deepep.ops.internode.ring import (  # noqa: F401
    INTERNODE_RING_KERNELS, internode_ring_combine, internode_ring_combine_expressions,
    internode_ring_count, internode_ring_dispatch, internode_ring_expressions)

# Sources whose kernels call NVSHMEM's device API: nvshmem_link builds them
# (tests/kernels/test_nvshmem_link.py links them in the CPU tier), not the plain NVRTC path.
NVSHMEM_SOURCES = ("bench/internode_leg.cu",) + tuple(INTERNODE_SOURCES.values())
