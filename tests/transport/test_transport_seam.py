"""CPU tier: the transport seam (one interface, chosen once) and Buffer growth under autograd."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from megatron_deepep import buffer as buffer_module
from megatron_deepep import transport
from megatron_deepep.autograd import combine, dispatch
from megatron_deepep.buffer import Buffer, get_buffer
from megatron_deepep.transport.base import Transport
from tests.helpers.cases import make_inputs
from tests.helpers.distributed import run_distributed
from tests.helpers import REPO_ROOT

ROOT = Path(REPO_ROOT)


@pytest.mark.parametrize("name, num_ranks, cuda, expected", [
    ("auto", 1, False, "reference"), ("auto", 4, False, "reference"),
    ("auto", 1, True, "local"), ("auto", 2, True, "nvlink"), ("auto", 8, True, "nvlink"),
    ("nvlink", 1, True, "local"), ("local", 1, True, "local"),
    ("reference", 8, True, "reference"), ("reference", 64, False, "reference"),
])
def test_resolve(name, num_ranks, cuda, expected):
    assert transport.resolve(name, num_ranks, cuda) == expected


def test_a_group_across_nodes_gets_the_internode_transport_or_an_error():
    assert transport.resolve("auto", 16, True, num_nodes=2) == "internode"
    assert transport.resolve("internode", 16, True, num_nodes=2) == "internode"
    assert transport.resolve("auto", 16, False, num_nodes=2) == "reference"
    assert transport.resolve("reference", 16, True, num_nodes=2) == "reference"
    for name in ("nvlink", "local"):
        with pytest.raises(ValueError, match="spans 2 nodes.*transport='internode'"):
            transport.resolve(name, 8, True, num_nodes=2)
    with pytest.raises(ValueError, match="no CUDA device"):
        transport.resolve("internode", 16, False, num_nodes=2)
    with pytest.raises(ValueError, match="num_ranks_per_node to declare virtual nodes"):
        transport.resolve("internode", 8, True, num_nodes=1)


def test_internode_size_hint_counts_its_regions():
    """size_hint grows with the staging formula: about N_max (4 M + L M + R) row slots."""
    from megatron_deepep.transport.internode_regions import InternodeRegions
    small = transport.size_hint("internode", 16, 256, 7168, 8, cuda_available=True)
    assert small == InternodeRegions(16, 8, 256, 7168, 8).num_bytes
    rows = 256 * (4 * 2 + 8 * 2 + 16) * 7168 * 2
    assert rows <= small <= 1.2 * rows + (8 << 20)
    assert transport.size_hint("internode", 16, 256, 7168, 8, cuda_available=True,
                               num_ranks_per_node=4) > small  # more nodes, more net slots


@pytest.mark.parametrize("name, num_ranks, cuda, message", [
    ("nvl", 2, True, "transport must be one of"),
    ("nvlink", 2, False, "no CUDA device"),
    ("local", 1, False, "no CUDA device"),
    ("local", 2, True, "serves an EP group of 1 rank"),
    ("auto", 16, True, "more than 8"),
])
def test_resolve_errors_name_the_limit(name, num_ranks, cuda, message):
    with pytest.raises(ValueError, match=message):
        transport.resolve(name, num_ranks, cuda)


@pytest.mark.parametrize("name", ["local", "nvlink", "internode", "reference"])
def test_every_transport_implements_the_interface(name):
    cls = transport.transport_class(name)
    assert issubclass(cls, Transport) and cls.name == name
    assert not inspect.isabstract(cls), f"{cls.__name__} leaves abstract methods"
    init = inspect.signature(cls.__init__)
    assert list(init.parameters)[1:5] == ["group", "num_max_tokens_per_rank", "hidden",
                                          "num_topk"]
    assert {"num_sms", "timeout_s"} <= set(init.parameters)


def test_buffer_never_asks_the_transport_name():
    """No comparison in buffer.py mentions a transport's name (the seam decides once)."""
    tree = ast.parse((ROOT / "megatron_deepep" / "buffer.py").read_text())
    names = {"local", "nvlink", "reference", "internode"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            consts = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
            assert not consts & names, f"buffer.py:{node.lineno} compares with a transport name"


def test_size_hint():
    assert Buffer.size_hint(4096, 7168, 1, 8, transport="reference") == 0
    nvlink = transport.transport_class("nvlink")
    hint = nvlink.size_hint(8, 4096, 7168, 8)
    # Two [R][N_max] regions of rows plus their metadata, a few pages on top.
    assert 2 * 8 * 4096 * 7168 * 2 < hint < 2 * 8 * 4096 * (7168 * 2 + 256) + (8 << 20)
    assert transport.transport_class("local").size_hint(1, 4096, 7168, 8) == 0
    for kwargs, message in ((dict(num_max_tokens_per_rank=-1), "num_max_tokens_per_rank"),
                            (dict(hidden=12), "multiple of 8"),
                            (dict(num_topk=17), "exceeds the limit 16"),
                            (dict(num_ranks=0), "num_ranks")):
        args = dict(num_max_tokens_per_rank=64, hidden=64, num_ranks=2, num_topk=4)
        args.update(kwargs)
        with pytest.raises(ValueError, match=message):
            Buffer.size_hint(**args, transport="reference")


def test_size_hint_without_a_gpu_is_the_gpu_transports():
    """`auto` gives the bytes of the transport the group gets on GPUs, on any machine: the EP = 1
    kernels (none), NVLink within a node, internode across nodes (nodes of 8 unless given)."""
    nvlink = transport.transport_class("nvlink").size_hint(8, 4096, 7168, 8)
    assert nvlink > 0 and Buffer.size_hint(4096, 7168, 8, 8) == nvlink
    assert Buffer.size_hint(4096, 7168, 1, 8) == 0
    internode = transport.transport_class("internode")
    assert Buffer.size_hint(4096, 7168, 16, 8, num_ranks_per_node=8) == \
        internode.size_hint(16, 4096, 7168, 8, 8) > 0
    assert Buffer.size_hint(4096, 7168, 64, 8) == internode.size_hint(64, 4096, 7168, 8, 8)
    assert Buffer.size_hint(4096, 7168, 8, 8, num_ranks_per_node=4) == \
        internode.size_hint(8, 4096, 7168, 8, 4)
    # Rows in bytes: fp32 rows of H hold what bf16 rows of 2 H do.
    assert Buffer.size_hint(4096, 3584, 8, 8, dtype=torch.float32) == nvlink


def _step(buf, x, idx, w, num_experts, g):
    """A forward through dispatch, a stand-in expert and combine; returns the loss."""
    recv_x, recv_w, handle = dispatch(buf, x, idx, w, num_experts=num_experts)
    out = combine(buf, recv_x * recv_w.unsqueeze(1) * 1.5, handle)
    return (out * g).sum()


def _growth_during_pending_backward(rank, world):
    """Micro-batch 1 runs forward on a small Buffer; micro-batch 2 is larger and grows the
    Buffer before micro-batch 1's backward runs (pipeline schedules, packed sequences)."""
    num_experts, hidden = 4 * world, 16
    xs, idxs, ws = make_inputs(11, world, [6, 0, 9, 4][:world], hidden, num_experts, 3,
                               "skewed", dtype=torch.float32)
    big_xs, big_idxs, big_ws = make_inputs(12, world, [40, 33, 0, 21][:world], hidden,
                                           num_experts, 3, "dropped", dtype=torch.float32)
    g = torch.randn(xs[rank].shape[0], hidden, generator=torch.Generator().manual_seed(rank))
    big_g = torch.randn(big_xs[rank].shape[0], hidden)

    def leaves(x, w):
        return x.clone().requires_grad_(), w.clone().requires_grad_()

    # Expected: each micro-batch alone on a Buffer large enough for both.
    fresh = Buffer(None, 64, 2 * hidden, 3, transport="reference")  # fp32: 2-byte hidden x 2
    x_ref, w_ref = leaves(xs[rank], ws[rank])
    _step(fresh, x_ref, idxs[rank], w_ref, num_experts, g).backward()
    fresh.destroy()

    small = get_buffer(None, 16, 2 * hidden, 3, transport="reference")
    x1, w1 = leaves(xs[rank], ws[rank])
    loss1 = _step(small, x1, idxs[rank], w1, num_experts, g)
    large = get_buffer(None, 64, 2 * hidden, 3, transport="reference")
    assert large is not small and large.num_max_tokens_per_rank == 64
    x2, w2 = leaves(big_xs[rank], big_ws[rank])
    _step(large, x2, big_idxs[rank], w2, num_experts, big_g).backward()
    loss1.backward()  # micro-batch 1's backward, through the Buffer that was replaced
    torch.testing.assert_close(x1.grad, x_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(w1.grad, w_ref.grad, rtol=0, atol=0)
    assert w2.grad is not None
    assert small.transport_name == "reference" and small.num_bytes == 0
    small.destroy()  # the replaced Buffer frees nothing twice
    large.destroy()
    buffer_module._BUFFERS.clear()


@pytest.mark.parametrize("world_size", [1, 2])
def test_get_buffer_growth_keeps_pending_backward_valid(world_size):
    run_distributed(world_size, _growth_during_pending_backward)


def _virtual_nodes_worker(rank, world):
    import logging
    from megatron_deepep.buffer import Buffer
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_deepep.transport").addHandler(handler)
    logging.getLogger("megatron_deepep.transport").setLevel(logging.INFO)
    buf = Buffer(torch.distributed.group.WORLD, 16, 64, 2, num_ranks_per_node=1)
    assert buf.transport_name == "reference"  # no CUDA here: the reference, said in the log
    assert any("2 ranks on 2 nodes (torch sees no CUDA device)" in r.getMessage()
               for r in records)
    with pytest.raises(ValueError, match="no CUDA device"):
        Buffer(torch.distributed.group.WORLD, 16, 64, 2, transport="internode",
               num_ranks_per_node=1)
    with pytest.raises(ValueError, match="num_ranks_per_node=3 must divide"):
        Buffer(torch.distributed.group.WORLD, 16, 64, 2, num_ranks_per_node=3)


def test_declared_nodes_pick_the_internode_path_or_say_why_not():
    from tests.helpers.distributed import run_distributed
    run_distributed(2, _virtual_nodes_worker, backend="gloo", timeout_s=120)


def test_auto_logs_its_choice_once_per_process(caplog, monkeypatch):
    """`auto`'s choice at INFO, once per process however many Buffers are built."""
    import logging

    import torch.distributed as dist
    from tests.helpers.distributed import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(transport, "_LOGGED_CHOICES", set())
    with caplog.at_level(logging.INFO, logger=transport.logger.name):
        for _ in range(3):
            Buffer(dist.group.WORLD, 16, 64, 2)
    choices = [r for r in caplog.records if "transport='auto'" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in choices] == [(
        logging.INFO, "megatron_deepep: transport='auto' chose 'reference' for an EP group of "
                      "1 rank on 1 node (torch sees no CUDA device)")]


def test_a_fallback_to_the_reference_with_cuda_is_a_warning_naming_why(caplog, monkeypatch):
    import logging

    monkeypatch.setattr(transport, "_LOGGED_CHOICES", set())
    with caplog.at_level(logging.INFO, logger=transport.logger.name):
        transport.log_auto_choice("nvlink", 8, 1, True)
        for _ in range(2):
            transport.log_auto_choice("reference", 16, 2, True, "NVSHMEM cannot start: no lib")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "megatron_deepep: transport='auto' chose 'nvlink' for an EP group of 8 "
                       "ranks on 1 node"),
        (logging.WARNING, "megatron_deepep: transport='auto' falls back to the pure-torch "
                          "reference for an EP group of 16 ranks on 2 nodes on a machine with "
                          "CUDA (NVSHMEM cannot start: no lib); the dispatch runs through "
                          "all_to_all_single, not our kernels")]
