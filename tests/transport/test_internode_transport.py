"""CPU tier: the internode transport's host side (no GPU): the symmetric block's layout, the
handle arrays, growth of a handle, the kernel families, timeout messages that name nodes."""

from __future__ import annotations

import pytest
import torch

from megatron_deepep import ops
from megatron_deepep.arena import ArenaPlan
from megatron_deepep.fp8.dispatch import Fp8Dispatch
from megatron_deepep.transport.errors import PeerTimeoutError
from megatron_deepep.transport.internode import InternodeTransport, node_plan
from megatron_deepep.transport.internode_regions import InternodeRegions
from megatron_deepep.transport.recv import regrow_slots
from megatron_deepep.transport.regions import PAGE


@pytest.mark.parametrize("R, L, N, H, K", [(4, 2, 64, 2048, 8), (16, 8, 4096, 7168, 8),
                                          (6, 3, 1, 16, 1), (64, 8, 4096, 7168, 16)])
def test_regions_are_disjoint_page_aligned_and_counted(R, L, N, H, K):
    rg = InternodeRegions(R, L, N, H, K)
    slot = check_region_spans(rg)
    M = R // L
    assert rg.num_bytes <= N * (4 * M + L * M + R) * slot + (4 << 20)


def check_region_spans(rg: InternodeRegions) -> int:
    """Asserts `rg`'s regions are disjoint, page-aligned and end inside its size (within the
    2 MiB rounding); returns the bytes of one slot (a row plus its largest side record)."""
    sizes = dict(rg._sizes())
    spans = sorted((rg.offsets[name], rg.offsets[name] + size) for name, size in sizes.items())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    assert all(off % PAGE == 0 for off in rg.offsets.values())
    assert spans[-1][1] <= rg.num_bytes < spans[-1][1] + (2 << 20)
    return rg.row_stride + max(rg.record_stride, rg.meta_stride, rg.weight_stride)
    # A NetRecord holds the token, 8 slots and K ids, positions and weights.
    assert rg.record_stride >= 4 * (1 + 8 + 3 * K) and rg.record_stride % 16 == 0
    assert rg.control_bytes() == rg.offsets["net_send"]
    args = rg.as_args()
    assert set(args) <= set(ops.INTERNODE_FIELDS)


def test_args_mirror_lists_every_field_once():
    assert len(set(ops.INTERNODE_FIELDS)) == len(ops.INTERNODE_FIELDS)
    assert {"heap", "wire_bytes", "fwd_slots", "chunks_seen"} <= set(ops.INTERNODE_FIELDS)


def test_regrow_slots_keeps_old_slots_and_marks_new_ones_unused():
    old = node_plan(5, 2, 8, 3).allocate("cpu")
    for name in old.plan.fields:
        old.view(name).copy_(torch.arange(old.view(name).numel()).view_as(old.view(name)))
    new = regrow_slots(old, node_plan(5, 2, 32, 3), ("fwd_slots",), "cpu")
    assert new.view("fwd_slots").shape == (2, 32, 3)
    assert torch.equal(new.view("fwd_slots")[:, :8], old.view("fwd_slots"))
    assert bool((new.view("fwd_slots")[:, 8:] == -1).all())
    for name in ("num_tokens_per_node", "token_slot_in_node", "node_slot_token", "fwd_count"):
        assert torch.equal(new.view(name), old.view(name))


def test_node_plan_fields():
    plan: ArenaPlan = node_plan(7, 3, 16, 2)
    shapes = {name: shape for name, (_, shape, _) in plan.fields.items()}
    assert shapes == {"num_tokens_per_node": (3,), "token_slot_in_node": (7, 3),
                      "node_slot_token": (3, 7), "fwd_count": (3,), "fwd_slots": (3, 16, 2)}


@pytest.mark.parametrize("fp8, fmt, dequant", [(None, 0, "false"),
                                               ("blockwise", None, "false"),
                                               ("mxfp8", None, "true")])
def test_kernel_family_names_every_kernel_once(fp8, fmt, dequant):
    spec = Fp8Dispatch.named(fp8, "bf16" if dequant == "true" else "fp8") if fp8 else None
    family = ops.internode_expressions(4, "long long", spec)
    combine = ops.internode_combine_expressions(4, 2)
    assert len(family) == len(set(family)) == 7 and len(set(combine)) == 8
    assert {expr.split("<")[0] for expr in family + combine} == set(ops.INTERNODE_KERNELS)
    assert "internode_combine_reduce<4, true, 2>" in combine
    code = fmt if fmt is not None else spec.wire_code
    assert f"internode_dispatch_send<4, true, long long, {code}>" in family
    assert f"internode_dispatch_recv<4, false, {code}, {dequant}>" in family


def test_wire_bytes_are_what_the_network_carries():
    assert ops.internode_wire(None, 7168)["wire_bytes"] == 2 * 7168
    blockwise = Fp8Dispatch.named("blockwise")
    assert ops.internode_wire(blockwise, 7168)["wire_bytes"] == 7168 + 4 * 56
    assert InternodeRegions(16, 8, 64, 7168, 8).row_stride >= 7168 + 4 * 56


def test_timeouts_name_the_node_of_rank_and_peer():
    import numpy as np
    from megatron_deepep.transport.errors import ERROR_RECORD_WORDS, error_from_record
    transport = InternodeTransport.__new__(InternodeTransport)
    transport.rank, transport.ranks_per_node = 5, 4
    words = np.zeros(ERROR_RECORD_WORDS, dtype=np.int32)
    words[:5] = (1, 5, 10, 7, 0)  # a timeout of rank 5 in internode notify, peer 10
    words[6:10] = np.array([1, 0], dtype=np.int64).view(np.int32)
    with pytest.raises(PeerTimeoutError, match=r"rank 5 is node 1 local 1; peer 10 is node 2 "
                                               r"local 2"):
        raise error_from_record(words, 3.0, transport.locate)


def test_size_hint_matches_the_regions():
    assert InternodeTransport.size_hint(16, 512, 4096, 8) == \
        InternodeRegions(16, 8, 512, 4096, 8).num_bytes
    assert InternodeTransport.size_hint(4, 512, 4096, 8, 2) == \
        InternodeRegions(4, 2, 512, 4096, 8).num_bytes


@pytest.mark.parametrize("text, size", [("1073741824", 1 << 30), ("2G", 2 << 30),
                                        ("512m", 512 << 20), ("1.5GB", 3 << 29),
                                        ("64KiB", 64 << 10)])
def test_heap_size_settings_parse(text, size):
    from megatron_deepep.transport.nvshmem_heap import parse_heap_size
    assert parse_heap_size(text) == size


def test_heap_limit_defaults_to_nvshmem_default(monkeypatch):
    from megatron_deepep.transport import nvshmem_heap
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    assert nvshmem_heap.heap_limit() == 1 << 30
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "3G")
    assert nvshmem_heap.heap_limit() == 3 << 30
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "lots")
    with pytest.raises(ValueError, match="is not a size"):
        nvshmem_heap.heap_limit()
