"""Megatron's MoELayer under an expert map with copies (`megatron.replica_experts`), CPU + gloo.

On 2 ranks with the reference transport: the layer builds the plan's slots per rank, its copies
start equal and every copy but the first is `shared` (grad norm); after the gradient sum every
copy holds the same gradient, so copies stay bit-identical over Adam steps; a checkpoint
(Megatron's `dist_checkpointing`) written by a layer with the map loads into a layer without
one, and back, expert for expert; the distributed optimizer over several expert data-parallel
ranks is refused with its reason.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_deepep.tools import balance
from tests.helpers.distributed import run_distributed

H, E, K = 16, 4, 2


def _layer(expert_map, seed):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=24,
                               num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
                               expert_model_parallel_size=2, moe_token_dispatcher_type="deepep",
                               use_cpu_initialization=True, add_bias_linear=False,
                               gradient_accumulation_fusion=False)
    config.moe_mdeep_expert_map = expert_map
    submodules = MoESubmodules(experts=ModuleSpec(
        module=SequentialMLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)))
    torch.manual_seed(seed + torch.distributed.get_rank())  # experts differ per rank
    layer = MoELayer(config, submodules, layer_number=1)
    torch.distributed.broadcast(layer.router.weight.data, 0)  # data parallel: one router

    layer.router.forward = cpu_router(layer)
    return layer


def cpu_router(layer, bias=None):
    """Megatron's router math on the CPU (its module moves to CUDA), plus an optional `[E]`
    logit bias."""
    def router(hidden, padding_mask=None):
        logits = hidden.reshape(-1, H) @ layer.router.weight.t()
        if bias is not None:
            logits = logits + bias
        scores = torch.softmax(logits.float(), dim=-1)
        _, idx = torch.topk(scores, K, dim=-1)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
        return scores * routing_map, routing_map

    return router


def _physical(layer):
    """Every rank's local expert weights, gathered: `[EP * S]` lists of tensors."""
    mine = [torch.cat([p.detach().reshape(-1) for p in m.parameters()])
            for m in layer.experts.local_experts]
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    return [t for part in parts for t in part]


def _save(layer, path):
    import os

    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # One writer thread: more spawn writer processes, which CPU test ranks do not need.
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dist_checkpointing.save(layer.sharded_state_dict(prefix="mlp."), path,
                            sharded_strategy=strategy)


def _load(layer, path):
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(layer.sharded_state_dict(prefix="mlp."), path)
    layer.load_state_dict({k[len("mlp."):]: v for k, v in state.items()}, strict=False)


def _step(layer, rank, step):
    from megatron_deepep.megatron import replica_experts

    gen = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(12, 1, H, generator=gen)
    out, _ = layer(x)
    (out.float() ** 2).sum().backward()
    replica_experts.sum_module_grads(layer)


def _worker(rank, world, plan_dict, tmp):
    warnings.filterwarnings("ignore")
    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps

    from megatron_deepep.megatron import replica_experts

    mdm.register_deepep_dispatcher(transport="reference")
    if not torch.cuda.is_available():  # Megatron's checkpoint code assumes CUDA; CPU here
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
    # The writer's result queue lives in a spawned manager process (a fresh interpreter per
    # rank, slow here); one writer thread in this process needs only a plain queue.
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    filesystem_async._results_queue = queue.Queue()
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        p2l = plan_dict["physical_to_logical"]
        mapped = _layer(plan_dict, seed=1)
        layout = replica_experts.layer_layout(mapped)
        slots = len(p2l) // world
        assert mapped.num_local_experts == slots and len(mapped.experts.local_experts) == slots
        assert layout is not None and bool(layout.replicated) == (slots > E // world)
        # Copies start equal; only first copies count in the grad norm.
        physical = _physical(mapped)
        for e in layout.replicated:
            slots = [p for p, x in enumerate(p2l) if x == e]
            assert all(torch.equal(physical[p], physical[slots[0]]) for p in slots)
        for i, m in enumerate(mapped.experts.local_experts):
            assert all(getattr(p, "shared", False) != layout.is_first_copy(i)
                       for p in m.parameters())

        # Checkpoint round trip: map -> no map -> map.
        plain = _layer(None, seed=2)
        _save(mapped, f"{tmp}/mapped")
        _load(plain, f"{tmp}/mapped")
        logical_plain = _physical(plain)  # contiguous: physical slot = logical expert
        physical = _physical(mapped)
        for e in range(E):
            assert torch.equal(logical_plain[e], physical[p2l.index(e)])
        torch.distributed.barrier()
        again = _layer(plan_dict, seed=3)
        _save(plain, f"{tmp}/plain")
        _load(again, f"{tmp}/plain")
        assert all(torch.equal(a, b) for a, b in zip(_physical(again), physical))

        # Gradients: summed copies match the plain layer's logical gradients; copies stay
        # bit-identical over Adam steps.
        opt = torch.optim.Adam(mapped.experts.parameters(), lr=1e-2)
        for step in range(4):
            opt.zero_grad()
            _step(mapped, rank, step)
            if step == 0:
                plain.zero_grad()
                gen = torch.Generator().manual_seed(rank)
                x = torch.randn(12, 1, H, generator=gen)
                out, _ = plain(x)
                (out.float() ** 2).sum().backward()
                grads = [torch.cat([p.grad.reshape(-1) for p in m.parameters()])
                         for m in mapped.experts.local_experts]
                plain_grads = [torch.cat([p.grad.reshape(-1) for p in m.parameters()])
                               for m in plain.experts.local_experts]
                every = [None] * world
                torch.distributed.all_gather_object(every, plain_grads)
                logical = [g for part in every for g in part]
                for i, g in enumerate(grads):
                    torch.testing.assert_close(g, logical[layout.local_logical[i]],
                                               rtol=1e-4, atol=1e-5)
            opt.step()
            physical = _physical(mapped)
            for e in layout.replicated:
                slots = [p for p, x in enumerate(p2l) if x == e]
                for p in slots[1:]:
                    assert torch.equal(physical[p], physical[slots[0]]), (step, e, p)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("num_redundant", [2, 0])
def test_moe_layer_copies_grads_and_checkpoints(tmp_path, num_redundant):
    pytest.importorskip("psutil", reason="Megatron's checkpoint writer needs psutil")
    loads = balance.synthetic_loads(f"zipf:{E}:1.5")
    plan = balance.plan_placement(loads, 2, num_redundant=num_redundant)
    assert plan.physical_to_logical != list(range(E))  # a real placement
    assert plan.slots_per_rank == 2 + num_redundant // 2
    assert any(len(s) > 1 for s in plan.logical_to_physical) == (num_redundant > 0)
    run_distributed(2, _worker, plan.to_dict(), str(tmp_path), timeout_s=240)


def test_distributed_optimizer_over_expert_dp_is_refused():
    from megatron_deepep.megatron.replica_experts import check_optimizer

    check_optimizer(True, 1)
    check_optimizer(False, 8)
    with pytest.raises(ValueError, match="use-distributed-optimizer.*2 expert data-parallel"):
        check_optimizer(True, 2)


def test_slot_parameters_refuses_one_tensor_experts():
    from megatron_deepep.megatron.replica_experts import slot_parameters

    class OneTensor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight1 = torch.nn.Parameter(torch.zeros(2, 6))

    with pytest.raises(ValueError, match="OneTensor keeps all local experts in one tensor"):
        slot_parameters(OneTensor(), 3)


def test_two_copies_of_one_expert_on_one_rank_are_refused():
    """They add no balance, and dist_checkpointing cannot load two shards of one tensor at one
    offset on one rank (seen on the GPU with TEGroupedMLP), so the map is refused when the
    layer is built."""
    from megatron_deepep.megatron.replica_experts import check_one_copy_per_rank
    from megatron_deepep.replicas import ReplicaLayout

    check_one_copy_per_rank(ReplicaLayout((0, 1, 2, 0, 3, 1), 2, 0))  # copies on two ranks
    with pytest.raises(ValueError, match=r"layer 3: EP rank 0 holds expert 0 more than once "
                                         r"\(slots \[0, 0, 1\]\); copies of an expert go on "
                                         r"different ranks"):
        check_one_copy_per_rank(ReplicaLayout((0, 0, 1, 2, 3, 1), 2, 1), 3)
