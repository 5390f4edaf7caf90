"""The internode transport: EP groups of 2-32 nodes x 1-8 ranks (docs/internode.md).

A token crosses the network once per destination node, to its rail peer there (the rank with the
sender's local index), which forwards it over NVLink to every rank of that node holding one of
its experts; that rank expands it into the expert-major rows. Combine runs backwards: each expert
rank sums a token's rows into one partial, the forwarder sums its node's partials, one row per
(token, node) crosses the network back, and the source sums its nodes' rows in node order.

Per dispatch (full staging's kernels, `cuda_src/internode/full.cu`, in stream order; ring staging
and the network ring have a source each beside it): layout (as every transport) -> node layout
-> notify (counts to every PE over NVSHMEM) -> send (network puts by chunks) -> forward (NVLink
copies into the node peers' staging) -> [one host wait for the row count, unless the caller
gave a row bound] -> receive (expand). Per combine: send -> forward -> reduce.
Epochs live in device words (`epochs.DeviceEpochs`), signals count on the device
(`chunks_seen`): with a row bound, the calls can be captured in a CUDA graph and replayed.

Ring staging (`MDEEP_INTERNODE_STAGING=ring`, docs/internode.md "Ring staging") bounds the node's
staging to L rings of C slots per rank: dispatch runs ... send -> ring count -> [host wait] ->
one kernel that forwards and expands at once; combine runs one kernel that sends the partials
and sums them on the forwarder at once -> reduce. The ring positions run on in device words
(`ring_seen`), so graphs replay these too.

The network ring (`MDEEP_INTERNODE_NET_RING_CHUNKS` = K > 0 on top of ring staging,
docs/internode.md "Network ring") bounds the network regions to K chunks per rail peer, with
credits returned by signal: dispatch runs layout -> node layout -> notify (which also gives each
forwarder its ring positions) -> [host wait] -> one kernel that sends, forwards and expands at
once; combine runs one kernel that sends the partials, sums them on the forwarder and reduces
them on the source at once. Chunk numbers run on in device words (`net_sent`, `chunks_seen`).

The network leg runs on NVSHMEM's device API; node peers are reached by load/store through
`nvshmem_ptr` (NVLink inside a node, or processes sharing one GPU). Everything lives in one block
of NVSHMEM's symmetric heap (`internode_regions.py`), allocated through torch's symmetric
memory, so NVSHMEM needs no install step beyond its wheel.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_deepep import ops
from megatron_deepep.arena import ArenaPlan
from megatron_deepep.handle import DispatchHandle, RecvLayout
from megatron_deepep.layout import DispatchLayout
from megatron_deepep.transport.base import Transport
from megatron_deepep.transport.epochs import DeviceEpochs
from megatron_deepep.transport.internode_regions import (CHUNK_TOKENS, MAX_NODES,
                                                         InternodeRegions, choose_staging,
                                                         describe_staging, net_ring_config,
                                                         staging_config)
from megatron_deepep.transport.nvshmem_heap import SymmetricHeap, heap_limit, size_heap_for
from megatron_deepep.transport.recv import (as_recv_x, dispatch_plan, empty_combine_out,
                                            empty_recv, regrow_slots)
from megatron_deepep.transport.status import KernelStatus
from megatron_deepep.transport.topology import MAX_RANKS_PER_NODE, detect_topology

logger = logging.getLogger(__name__)

# CHUNK_TOKENS (internode_regions): tokens per network chunk. Each chunk is one put with a
# signal, so a receiver starts on a node's data once its chunks have landed, and the sender's
# packing overlaps earlier puts.
# Local workspace words: 8 block counters (u32), the error claim (int32), padding.
_WORKSPACE_WORDS = 16
_CLAIM_WORD = 8


@functools.lru_cache(maxsize=256)
def node_plan(num_tokens: int, num_nodes: int, max_tokens: int,
              ranks_per_node: int, ring: bool = False) -> ArenaPlan:
    """The node-level arrays of one dispatch: the sender's node layout and the forwarder's
    state that combine replays; with `ring` staging also `ring_base [L, M + 1]` int32 (per node
    rank, where each source node's rows begin in the ring to it)."""
    fields = [("num_tokens_per_node", (num_nodes,), torch.int32),
              ("token_slot_in_node", (num_tokens, num_nodes), torch.int32),
              ("node_slot_token", (num_nodes, num_tokens), torch.int32),
              ("fwd_count", (num_nodes,), torch.int32),
              ("fwd_slots", (num_nodes, max_tokens, ranks_per_node), torch.int32)]
    if ring:
        fields.append(("ring_base", (ranks_per_node, num_nodes + 1), torch.int32))
    return ArenaPlan(fields)


class InternodeTransport(Transport):
    """Dispatch/combine across nodes: NVSHMEM puts between rail peers, NVLink inside a node.

    Args:
        group: the EP process group (any backend; it carries only the set-up's collectives).
        num_max_tokens_per_rank: N_max.
        hidden: the widest row in bf16 elements.
        num_topk: the largest top-k.
        num_sms: blocks of the communication kernels.
        timeout_s: limit of every cross-GPU wait.
        num_ranks_per_node: declares nodes of this many contiguous ranks (virtual nodes); by
            default the nodes are found from the ranks' host names.
        staging: "full", "ring" or "auto" (None: the knob `MDEEP_INTERNODE_STAGING`, "auto" by
            default: full staging while its block fits `MDEEP_INTERNODE_STAGING_MAX_GB`, else
            ring staging, else the network ring too; `choose_staging`); every rank must pass
            the same.
        ring_slots: C, the slots of each ring with "ring" (None: `MDEEP_INTERNODE_RING_SLOTS`).
        net_chunks: K > 0 turns the network ring on (with "ring" or "auto"): K chunks per rail
            peer and network region (None: `MDEEP_INTERNODE_NET_RING_CHUNKS`, 0 by default:
            off, unless "auto" needs it).

    Raises:
        NvshmemUnavailable: NVSHMEM cannot start here (the message says what to install, and
            that transport='reference' works without it).
        ValueError: a topology it does not serve (1 node, more than 32, more than 8 ranks per
            node, uneven nodes), a bad staging setting, or ranks that disagree on it.
    """

    name = "internode"
    # The flag epochs live in device words (`epochs.DeviceEpochs`): replays advance them.
    graph_capture_refusal = None
    row_dtypes = tuple(ops.ROW_DTYPE_CODES)  # dispatch copies bytes; combine sums in fp32

    def __init__(self, group, num_max_tokens_per_rank: int, hidden: int, num_topk: int, *,
                 num_sms: int, timeout_s: float, num_ranks_per_node: Optional[int] = None,
                 staging: Optional[str] = None, ring_slots: Optional[int] = None,
                 net_chunks: Optional[int] = None):
        # Bad knobs fail here, before any collective; "auto" is resolved once the shape is known.
        self.requested_staging = staging_config(staging, ring_slots)[0]
        net_ring_config(self.requested_staging, net_chunks)
        self.topology = detect_topology(group, num_ranks_per_node)
        self.topology.check_internode()
        topo = self.topology
        self.rank, self.num_ranks = topo.rank, topo.num_ranks
        self.ranks_per_node, self.num_nodes = topo.num_ranks_per_node, topo.num_nodes
        self.staging, self.ring_slots, self.net_chunks = choose_staging(
            self.num_ranks, self.ranks_per_node, num_max_tokens_per_rank, hidden, num_topk,
            staging, ring_slots, net_chunks)
        self.is_ring, self.is_net = self.staging == "ring", self.net_chunks > 0
        _check_same_staging(group, self.staging, self.ring_slots, self.net_chunks)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.regions = InternodeRegions(self.num_ranks, self.ranks_per_node,
                                        num_max_tokens_per_rank, hidden, num_topk,
                                        self.staging, self.ring_slots, self.net_chunks)
        heap_set = size_heap_for(self.regions.num_bytes)
        if heap_set is not None:
            logger.info("megatron_deepep internode: NVSHMEM_SYMMETRIC_SIZE was unset; set to %d "
                        "for this %d-byte block (export it to choose)", heap_set,
                        self.regions.num_bytes)
        limit = heap_limit()
        if self.regions.num_bytes > limit:
            raise ValueError(
                f"the internode transport needs {self.regions.num_bytes} bytes of NVSHMEM "
                f"symmetric heap per rank for num_max_tokens_per_rank={num_max_tokens_per_rank}, "
                f"hidden={hidden}, num_topk={num_topk} on {self.num_nodes} nodes x "
                f"{self.ranks_per_node} ({self.regions.formula()}), more than the heap "
                f"NVSHMEM gives ({limit} bytes): export NVSHMEM_SYMMETRIC_SIZE >= "
                f"{self.regions.num_bytes + (64 << 20)} before the first symmetric allocation "
                "(`Buffer.size_hint(..., transport='internode')` computes it), or lower "
                "num_max_tokens_per_rank")
        self.heap = SymmetricHeap(self.device)
        self.block = self.heap.empty(self.regions.num_bytes, torch.uint8)
        self.block[:self.regions.control_bytes()].zero_()
        self.num_bytes = self.regions.num_bytes
        self.pe_of_rank = torch.tensor([dist.get_global_rank(group, r)
                                        for r in range(self.num_ranks)], dtype=torch.int32,
                                       device=self.device)
        self.workspace = torch.zeros(_WORKSPACE_WORDS, dtype=torch.int32, device=self.device)
        self.chunks_seen = torch.zeros(2 * self.num_nodes, dtype=torch.int64, device=self.device)
        self.num_sms = num_sms
        # The ring kernels' grid must be co-resident (their warps wait for each other): at
        # most one block of 512 threads per SM.
        num_device_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.ring_blocks = max(1, min(num_sms, num_device_sms))
        # The network ring's kernels also need a warp for each of their 3 L roles.
        self.net_blocks = min(max(self.ring_blocks, ops.net_ring_min_blocks(
            self.ranks_per_node)), num_device_sms)
        # Ring positions so far (u64 [4][8], internode/ring_rows.cuh), advanced by the
        # ring kernels themselves, so graph replays advance them too.
        self.ring_seen = torch.zeros(32, dtype=torch.int64, device=self.device)
        # Network ring: chunks sent to each node so far (dispatch [M], combine [M]); the chunks
        # received count on in `chunks_seen`. Advanced by the kernels themselves (graphs).
        self.net_sent = torch.zeros(2 * self.num_nodes, dtype=torch.int64, device=self.device)
        self.timeout_ns = int(timeout_s * 1e9)
        self.status = KernelStatus(self.workspace.data_ptr() + 4 * _CLAIM_WORD, self.rank,
                                   timeout_s, locate=self.locate)
        self.epochs = DeviceEpochs(self.device)  # CUDA-graph safe: kernels read device words
        self.host_epoch = 0  # what a synchronous dispatch's notify publishes to the host
        self._static = self._static_fields()
        # Every PE's flags and signals are zero before any peer writes them.
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)
        logger.info("megatron_deepep internode: rank %d = node %d local %d of %d nodes x %d, "
                    "%d bytes of symmetric heap, %s staging%s", self.rank, topo.node,
                    topo.local_rank, self.num_nodes, self.ranks_per_node, self.num_bytes,
                    self.staging_name(), " (auto, MDEEP_INTERNODE_STAGING_MAX_GB)"
                    if self.requested_staging == "auto" else "")

    def staging_name(self) -> str:
        """The staging this transport runs, as logs and reports name it (`describe_staging`)."""
        return describe_staging(self.staging, self.ring_slots, self.net_chunks)

    @staticmethod
    def size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                  num_ranks_per_node: int = MAX_RANKS_PER_NODE, *,
                  staging: Optional[str] = None, ring_slots: Optional[int] = None,
                  net_chunks: Optional[int] = None) -> int:
        """Bytes of symmetric heap one rank holds (nodes of `num_ranks_per_node` ranks, 8 by
        default, fewer when the group is smaller), for `staging`, `ring_slots` and `net_chunks`
        (None: the knobs `MDEEP_INTERNODE_STAGING`, `MDEEP_INTERNODE_RING_SLOTS` and
        `MDEEP_INTERNODE_NET_RING_CHUNKS`)."""
        per_node = min(num_ranks_per_node, num_ranks)
        choice = choose_staging(num_ranks, per_node, num_max_tokens_per_rank, hidden, num_topk,
                                staging, ring_slots, net_chunks)
        return InternodeRegions(num_ranks, per_node, num_max_tokens_per_rank, hidden,
                                num_topk, *choice).num_bytes

    def check_errors(self) -> None:
        self.status.check_errors()

    def locate(self, rank: int) -> str:
        """Where `rank` sits (node and local index): timeouts name it, so that on a cluster the
        message says which machine to look at."""
        return f"node {rank // self.ranks_per_node} local {rank % self.ranks_per_node}"

    # ------------------------------------------------------------------ fields
    def _static_fields(self) -> dict:
        fields = dict.fromkeys(ops.INTERNODE_FIELDS, 0)
        fields.update(self.regions.as_args())
        ws = self.workspace.data_ptr()
        fields.update(heap=self.block.data_ptr(), chunk_tokens=CHUNK_TOKENS, rank=self.rank,
                      num_ranks=self.num_ranks, ranks_per_node=self.ranks_per_node,
                      num_nodes=self.num_nodes, pe_of_rank=self.pe_of_rank.data_ptr(),
                      timeout_ns=self.timeout_ns, error_claim=self.status.errors.claim,
                      error_record=self.status.errors.record, block_counters=ws,
                      chunks_seen=self.chunks_seen.data_ptr(), max_recv_rows=-1, alignment=1)
        if self.is_ring:
            fields.update(ring_seen=self.ring_seen.data_ptr())
        if self.is_net:
            fields.update(net_sent=self.net_sent.data_ptr())
        return fields

    def _fields(self, epoch_word: int, topk_idx: torch.Tensor, num_experts: int,
                layout: DispatchLayout, recv, nodes, hidden: int) -> dict:
        """The fields every kernel of one call reads: the layouts and the handle's state."""
        fields = dict(self._static)
        a, n, la = recv.address, nodes.address, layout.address
        fields.update(
            epoch_word=epoch_word, topk_idx=topk_idx.data_ptr(),
            pos_in_expert=la("pos_in_expert"), num_tokens_per_rank=la("num_tokens_per_rank"),
            num_tokens_per_expert=la("num_tokens_per_expert"),
            is_token_in_rank=la("is_token_in_rank"), token_slot_in_rank=la("token_slot_in_rank"),
            num_tokens_per_node=n("num_tokens_per_node"),
            token_slot_in_node=n("token_slot_in_node"), node_slot_token=n("node_slot_token"),
            num_tokens=topk_idx.shape[0], num_experts=num_experts,
            num_local=num_experts // self.num_ranks, hidden=hidden, num_topk=topk_idx.shape[1],
            num_recv_tokens_per_rank=a("num_recv_tokens_per_rank"),
            num_recv_tokens_per_expert=a("num_recv_tokens_per_expert"),
            tokens_per_expert=a("tokens_per_expert"), expert_row_start=a("expert_row_start"),
            src_expert_offset=a("src_expert_offset"), fwd_count=n("fwd_count"),
            fwd_slots=n("fwd_slots"), slot_rows=a("slot_rows"))
        if self.is_ring:
            if "ring_base" not in nodes.plan.fields:
                raise ValueError("this handle comes from a dispatch with full internode staging; "
                                 "a buffer with MDEEP_INTERNODE_STAGING=ring cannot replay it")
            fields.update(ring_base=n("ring_base"))
        return fields

    # ------------------------------------------------------------------ dispatch
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        self.check_errors()
        return ops.dispatch_layout(topk_idx.contiguous(), num_experts, self.num_ranks, self.rank,
                                   self.status.errors, timeout_ns=self.timeout_ns)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, expert_alignment: int = 1,
                 num_max_recv_rows: Optional[int] = None,
                 layout: Optional[DispatchLayout] = None, fp8=None,
                 x_scales: Optional[torch.Tensor] = None):
        self.check_errors()
        row_dtype, row_width = x.dtype, x.shape[1]  # the handle keeps the caller's width
        if fp8 is None:
            x = ops.as_wire_rows(x)  # fp16 / fp32 rows travel as the bf16 words of their bytes
        dev, num_ranks = x.device, self.num_ranks
        num_tokens, num_topk = topk_idx.shape
        hidden = x.shape[1]
        arena = dispatch_plan(num_tokens, num_topk, num_experts, num_ranks,
                              self.regions.max_tokens, layout is None).allocate(dev)
        nodes = node_plan(num_tokens, self.num_nodes, self.regions.max_tokens,
                          self.ranks_per_node, self.is_ring).allocate(dev)
        self.epochs.advance_dispatch()
        self.host_epoch += 1
        is_sync = num_max_recv_rows is None
        if layout is None:
            layout = ops.dispatch_layout(topk_idx, num_experts, num_ranks, self.rank,
                                         self.status.errors, timeout_ns=self.timeout_ns,
                                         arena=arena)
        fields = self._fields(self.epochs.dispatch, topk_idx, num_experts, layout, arena, nodes,
                              hidden)
        fields.update(x=x.data_ptr(), topk_weights=topk_weights.data_ptr(),
                      x_scales=ops.addr(x_scales), **ops.internode_wire(fp8, hidden))
        ring, net = self.is_ring, self.is_net
        ops.internode_node_layout(topk_idx, fp8, self.num_nodes, fields, ring=ring, net=net)
        notify = dict(fields, epoch_word=self.epochs.notify, alignment=expert_alignment,
                      max_recv_rows=-1 if is_sync else num_max_recv_rows,
                      host_info=self.status.host_info_ptr if is_sync else 0,
                      host_epoch=self.host_epoch & 0xFFFFFFFF)
        ops.internode_notify(topk_idx, fp8, notify, ring=ring, net=net)
        if not net:  # the network ring sends in its one kernel below
            ops.internode_dispatch_send(topk_idx, False, fp8, self.num_sms, fields, ring=ring)
            if ring:
                ops.internode_ring_count(topk_idx, fp8, self.num_nodes, fields)
            else:
                ops.internode_forward(topk_idx, fp8, self.num_sms, fields)
        num_rows = (self.status.wait_num_rows(self.host_epoch) if is_sync
                    else num_max_recv_rows)
        recv_x, recv_scales = empty_recv(num_rows, hidden, fp8, dev)
        recv_weights = torch.empty(num_rows, dtype=torch.float32, device=dev)
        fields.update(recv_x=recv_x.data_ptr(), recv_scales=ops.addr(recv_scales),
                      recv_weights=recv_weights.data_ptr(), max_rows=num_rows)
        if net:
            ops.internode_net_dispatch(topk_idx, False, fp8, self.net_blocks, fields)
        elif ring:
            ops.internode_ring_dispatch(topk_idx, False, fp8, self.ring_blocks, fields)
        else:
            ops.internode_dispatch_recv(topk_idx, False, fp8, self.num_sms, fields)
        num_local = num_experts // num_ranks
        handle = DispatchHandle.from_arena(
            arena, layout=layout, recv=RecvLayout.from_arena(arena), recv_weights=recv_weights,
            num_experts=num_experts, num_topk=num_topk, hidden=row_width,
            expert_alignment=expert_alignment, num_recv_rows=num_rows,
            tokens_per_expert_list=self.status.tokens_per_expert(num_local) if is_sync else None,
            transport_state=(topk_idx, arena, nodes))
        if fp8 is None:
            recv_x = recv_x.view(row_dtype)
        return as_recv_x(recv_x, recv_scales), recv_weights, handle

    def _adopt(self, handle: DispatchHandle) -> None:
        """Makes a handle of a smaller buffer (one `get_buffer` has since replaced) usable here:
        its per-slot arrays move into arrays of this buffer's N_max, the new slots unused."""
        topk_idx, arena, nodes = handle.transport_state
        slots = arena.view("slot_rows").shape[1]
        max_tokens = self.regions.max_tokens
        if slots == max_tokens:
            return
        num_tokens, num_topk = topk_idx.shape
        new = regrow_slots(arena, dispatch_plan(num_tokens, num_topk, handle.num_experts,
                                                self.num_ranks, max_tokens, False),
                           ("slot_rows",), self.device)
        new_nodes = regrow_slots(nodes, node_plan(num_tokens, self.num_nodes, max_tokens,
                                                  self.ranks_per_node, self.is_ring),
                                 ("fwd_slots",), self.device)
        for name in new.plan.fields:  # drop views of the old arena
            handle.__dict__.pop(name, None)
        handle.__dict__["_arena"] = new
        handle.recv = RecvLayout.from_arena(new)
        handle.transport_state = (topk_idx, new, new_nodes)

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle, fp8=None,
                        x_scales: Optional[torch.Tensor] = None):
        self.check_errors()
        row_dtype = x.dtype
        if fp8 is None:
            x = ops.as_wire_rows(x)
        self._adopt(handle)
        topk_idx, arena, nodes = handle.transport_state
        hidden = x.shape[1]
        self.epochs.advance_cached_dispatch()
        fields = self._fields(self.epochs.dispatch, topk_idx, handle.num_experts, handle.layout,
                              arena, nodes, hidden)
        recv_x, recv_scales = empty_recv(handle.num_recv_rows, hidden, fp8, x.device)
        fields.update(x=x.data_ptr(), x_scales=ops.addr(x_scales), recv_x=recv_x.data_ptr(),
                      recv_scales=ops.addr(recv_scales), max_rows=handle.num_recv_rows,
                      **ops.internode_wire(fp8, hidden))
        if self.is_net:  # ring_base is the handle's (notify's rail counts)
            ops.internode_net_dispatch(topk_idx, True, fp8, self.net_blocks, fields)
        elif self.is_ring:  # the count runs again (same rows): it also waits for the network
            ops.internode_dispatch_send(topk_idx, True, fp8, self.num_sms, fields, ring=True)
            ops.internode_ring_count(topk_idx, fp8, self.num_nodes, fields)
            ops.internode_ring_dispatch(topk_idx, True, fp8, self.ring_blocks, fields)
        else:
            ops.internode_dispatch_send(topk_idx, True, fp8, self.num_sms, fields)
            ops.internode_forward(topk_idx, fp8, self.num_sms, fields)
            ops.internode_dispatch_recv(topk_idx, True, fp8, self.num_sms, fields)
        if fp8 is None:
            recv_x = recv_x.view(row_dtype)
        return as_recv_x(recv_x, recv_scales)

    # ------------------------------------------------------------------ combine
    def combine(self, y: torch.Tensor, handle: DispatchHandle, weighted: bool = False,
                grad_row_weights: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        self.check_errors()
        self._adopt(handle)
        topk_idx, arena, nodes = handle.transport_state
        self.epochs.advance_combine()
        # Kernels count rows in 2-byte units (an fp32 row of H is 2 H of them).
        fields = self._fields(self.epochs.combine, topk_idx, handle.num_experts, handle.layout,
                              arena, nodes, y.shape[1] * y.element_size() // 2)
        with_weights = grad_row_weights is not None
        out, out_weights = empty_combine_out(handle, y, with_weights)
        fields.update(y=y.data_ptr(), out=out.data_ptr(), out_weights=ops.addr(out_weights),
                      recv_weights=handle.recv_weights.data_ptr(),
                      grad_row_weights=ops.addr(grad_row_weights))
        if self.is_net:
            ops.internode_net_combine(topk_idx, y, weighted, with_weights, self.net_blocks,
                                      fields)
        elif self.is_ring:
            ops.internode_ring_combine(topk_idx, y, weighted, with_weights, self.ring_blocks,
                                       fields)
            ops.internode_combine_reduce(topk_idx, y, with_weights, self.num_sms, fields,
                                         ring=True)
        else:
            ops.internode_combine_send(topk_idx, y, weighted, with_weights, self.num_sms, fields)
            ops.internode_combine_forward(topk_idx, y, with_weights, self.num_sms, fields)
            ops.internode_combine_reduce(topk_idx, y, with_weights, self.num_sms, fields)
        return out, out_weights

    def destroy(self) -> None:
        if self.status is None:
            return
        torch.cuda.synchronize(self.device)  # no kernel still writes the mailboxes or the heap
        self.heap.destroy()
        self.block = None
        self.status.destroy()
        self.status = None


def _check_same_staging(group, staging: str, ring_slots: int, net_chunks: int = 0) -> None:
    """Every rank must build the same symmetric layout and run the same kernels: compares the
    staging settings over the group (set-up only; any backend).

    Raises:
        ValueError: naming the ranks' settings when they differ.
    """
    settings = [None] * dist.get_world_size(group)
    dist.all_gather_object(settings, (staging, ring_slots, net_chunks), group=group)
    if len(set(settings)) > 1:
        seen = ", ".join(f"rank {r}: {s}" for r, s in enumerate(settings))
        raise ValueError(f"ranks disagree on the internode staging (MDEEP_INTERNODE_STAGING, "
                         f"MDEEP_INTERNODE_RING_SLOTS, MDEEP_INTERNODE_NET_RING_CHUNKS as "
                         f"(staging, ring slots, network chunks); with auto also "
                         f"MDEEP_INTERNODE_STAGING_MAX_GB and the Buffer's limits): {seen}")


__all__ = ["CHUNK_TOKENS", "InternodeTransport", "MAX_NODES", "node_plan"]
