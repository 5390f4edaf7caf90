"""GPU tier: Megatron's MoELayer with the sync-free `deepep` dispatcher under CUDA graphs.

One process, EP = 1 (the local kernels). The layer's forward and backward are captured in one
`torch.cuda.CUDAGraph` (a capture fails on any host synchronization) and replayed on new inputs;
each replay must equal an eager run of an identical layer. Two sync-free modes:

* pad-to-capacity (capacity factor 1, drop policy "probs"): Megatron's SequentialMLP experts
  (their counts are static, on the CPU);
* dropless with a rank capacity factor: the counts stay on the GPU, so the experts are a
  stand-in that reads none on the host (Megatron's SequentialMLP / TEGroupedMLP call
  `tokens_per_expert.tolist()` themselves).

Without a row bound the dispatch waits for the host, so `check_config` refuses graphs around it
at configuration time (tests/megatron/test_parity_config.py). Needs megatron-core
(dev/gpu/gpu_parity.sh
installs the wheel from .whl/).
"""

from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.gpu

H = 256


@pytest.fixture(scope="module")
def megatron_env(megatron_env):
    """The shared one (tests/gpu/conftest.py), with the dispatcher's transport pinned to auto."""
    import megatron_deepep.megatron as mdm

    mdm.register_deepep_dispatcher(transport="auto")
    yield


class _DeviceCountExperts(torch.nn.Module):
    """Experts that never read the counts on the host: expert e's rows times `W[e]`, each
    row's expert found on the GPU from the device counts, times the permuted prob."""

    def __init__(self, num_local_experts, dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.weight = torch.nn.Parameter(
            (torch.randn(num_local_experts, H, H, generator=gen) / H ** 0.5).to(dtype).cuda())

    def forward(self, rows, tokens_per_expert, probs):
        ends = torch.cumsum(tokens_per_expert.to(rows.device), 0)
        rows_idx = torch.arange(rows.shape[0], device=rows.device)
        expert = torch.searchsorted(ends, rows_idx, right=True).clamp(max=len(ends) - 1)
        out = torch.bmm(rows.unsqueeze(1), self.weight[expert]).squeeze(1)
        return out * probs.unsqueeze(1).to(out.dtype), None


def _layer(dtype, stand_in=False, **kwargs):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=H, ffn_hidden_size=2 * H, moe_ffn_hidden_size=2 * H,
        num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
        moe_token_dispatcher_type="deepep", moe_router_load_balancing_type="none",
        moe_router_dtype="fp32", add_bias_linear=False, gradient_accumulation_fusion=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, **kwargs)
    submodules = MoESubmodules(experts=ModuleSpec(
        module=SequentialMLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)))
    layer = MoELayer(config, submodules, layer_number=1).cuda()
    if stand_in:  # Megatron's experts module stays; its forward is the stand-in's
        layer.experts.device_count_experts = _DeviceCountExperts(8, dtype)
        layer.experts.forward = layer.experts.device_count_experts.forward
    return layer


def _eager(layer, x, grad):
    xi = x.clone().requires_grad_(True)
    out, _ = layer(xi)
    out.backward(grad)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return out.detach(), xi.grad, grads


def _graphed(layer, inputs, grads_in):
    """Captures forward + backward once, replays on each input; returns the results."""
    from megatron_deepep.bench.layer_variants import capture_forward_backward

    static_x = inputs[0].clone().requires_grad_(True)
    static_g = grads_in[0].clone()
    graph, static_out = capture_forward_backward(layer, static_x, static_g)
    results = []
    for x, g in zip(inputs, grads_in):
        static_x.data.copy_(x)
        static_g.copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        results.append((static_out.detach().clone(), static_x.grad.clone(), grads))
    return results


def _check(layer_kwargs, dtype, stand_in=False):
    from megatron_deepep.megatron import DeepEPTokenDispatcher

    torch.manual_seed(3)
    graphed = _layer(dtype, stand_in, **layer_kwargs)
    eager = _layer(dtype, stand_in, **layer_kwargs)
    eager.load_state_dict(graphed.state_dict())
    assert isinstance(graphed.token_dispatcher, DeepEPTokenDispatcher)
    gen = torch.Generator(device="cuda").manual_seed(11)
    inputs = [torch.randn(64, 2, H, device="cuda", generator=gen).to(dtype) for _ in range(3)]
    grads = [torch.randn(64, 2, H, device="cuda", generator=gen).to(dtype) for _ in range(3)]
    replays = _graphed(graphed, inputs, grads)
    assert graphed.token_dispatcher._sync_free
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for i, (x, g) in enumerate(zip(inputs, grads)):
        want = _eager(eager, x, g)
        got = replays[i]
        torch.testing.assert_close(got[0], want[0], **tol, msg=f"replay {i}: output")
        torch.testing.assert_close(got[1], want[1], **tol, msg=f"replay {i}: input grad")
        assert got[2].keys() == want[2].keys()
        for name in want[2]:
            torch.testing.assert_close(got[2][name], want[2][name], **tol,
                                       msg=f"replay {i}: grad {name}")
    # Replays see their own inputs (not the capture's).
    assert not torch.equal(replays[0][0], replays[1][0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_pad_to_capacity_layer_replays_under_cuda_graph(megatron_env, dtype):
    _check(dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                moe_token_drop_policy="probs"), dtype)


def test_rank_capacity_layer_replays_under_cuda_graph(megatron_env, monkeypatch):
    monkeypatch.setenv("MDEEP_RANK_CAPACITY_FACTOR", "2")
    _check({}, torch.bfloat16, stand_in=True)
