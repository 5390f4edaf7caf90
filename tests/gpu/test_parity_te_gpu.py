"""GPU tier with Transformer Engine: the parity options the CPU matrix cannot run.

`tests/test_parity_matrix.py` lists them in `GPU_ONLY`: grouped GEMM experts (`TEGroupedMLP`),
MoE latent projections (`--moe-latent-size`, TE linears) and `--recompute-modules moe_act`
(grouped GEMM only), plus TE's `SequentialMLP`. For each, Megatron's MoELayer from its TE spec
with `deepep` (EP = 1, our kernels) and with `alltoall`, same weights and inputs, bf16: outputs
and the gradients of the input and of every parameter (router and experts) must agree within
bf16 tolerance (the same rows reach the experts in the same order at EP = 1).

Needs megatron-core 0.19.2 and TE (`bash scripts/gpu_te.sh` installs both and runs this file).
"""

from __future__ import annotations

import pytest
import torch

from megatron_deepep.fp8 import te_bridge

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.te,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not te_bridge.te_available()[0],
                       reason=f"needs Transformer Engine: {te_bridge.te_available()[1]}"),
]

H = 512
NUM_EXPERTS = 8
TOL = dict(rtol=2e-2, atol=2e-2)

# name -> TransformerConfig overrides (on top of _config's)
CASES = {
    "grouped_gemm": dict(moe_grouped_gemm=True),
    "sequential_te": dict(moe_grouped_gemm=False),
    "moe_latent_size": dict(moe_grouped_gemm=True, moe_latent_size=H // 2),
    "recompute_moe_act": dict(moe_grouped_gemm=True, recompute_granularity="selective",
                              recompute_modules=["moe_act"]),
    "grouped_gemm_topk4_sigmoid": dict(moe_grouped_gemm=True, moe_router_topk=4,
                                       moe_router_score_function="sigmoid",
                                       moe_router_enable_expert_bias=True,
                                       moe_router_load_balancing_type="none"),
}


def _config(dispatcher: str, overrides: dict):
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    missing = sorted(set(overrides) - fields)
    if missing:
        pytest.skip(f"this megatron-core has no {missing}")
    kwargs = dict(num_layers=2, hidden_size=H, ffn_hidden_size=2 * H, moe_ffn_hidden_size=H,
                  num_attention_heads=4, num_moe_experts=NUM_EXPERTS, moe_router_topk=2,
                  moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="aux_loss",
                  moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32", add_bias_linear=False,
                  gradient_accumulation_fusion=False, params_dtype=torch.bfloat16, bf16=True,
                  gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _layer(dispatcher: str, overrides: dict):
    from megatron_deepep.layer_variants import te_moe_layer

    config = _config(dispatcher, overrides)
    layer, _ = te_moe_layer(config, NUM_EXPERTS, fp8_experts=False,
                            grouped_gemm=config.moe_grouped_gemm)
    return layer.cuda().train()


def _run(layer, x, grad):
    xi = x.clone().requires_grad_(True)
    out, _ = layer(xi)
    (out.float() * grad.float()).sum().backward()
    return out.detach(), xi.grad, {n: p.grad.detach().clone() for n, p in layer.named_parameters()
                                   if p.grad is not None}


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("case", list(CASES))
def test_te_layer_deepep_matches_alltoall(megatron_env, case):
    from megatron_deepep.megatron import DeepEPTokenDispatcher
    from megatron_deepep.megatron.options import set_default_options

    set_default_options(transport="auto")
    overrides = CASES[case]
    ours = _layer("deepep", overrides)
    theirs = _layer("alltoall", overrides)
    theirs.load_state_dict(ours.state_dict())
    assert isinstance(ours.token_dispatcher, DeepEPTokenDispatcher)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(256, 2, H, device="cuda", generator=gen).bfloat16()
    grad = torch.randn(256, 2, H, device="cuda", generator=gen).bfloat16()
    o1, g1, p1 = _run(ours, x, grad)
    o2, g2, p2 = _run(theirs, x, grad)
    worst = {"output": _rel(o1, o2), "input grad": _rel(g1, g2)}
    assert p1.keys() == p2.keys() and p1, "the same parameters get gradients"
    worst.update({name: _rel(p1[name], p2[name]) for name in p1})
    print(f"\n        {case}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()
                                             if k in ("output", "input grad") or v > 0))
    torch.testing.assert_close(o1.float(), o2.float(), **TOL)
    torch.testing.assert_close(g1.float(), g2.float(), **TOL)
    for name in p1:
        torch.testing.assert_close(p1[name].float(), p2[name].float(), **TOL, msg=name)
    assert p1["router.weight"].abs().sum() > 0  # the router learns through the probs
    if overrides.get("moe_latent_size"):
        assert any("latent" in name for name in p1), "the latent projections are trained"
