"""GPU tier with Transformer Engine: the parity options the CPU matrix cannot run.

`tests/megatron/test_parity_matrix.py` lists them in `GPU_ONLY`: grouped GEMM experts
(`TEGroupedMLP`),
MoE latent projections (`--moe-latent-size`, TE linears) and `--recompute-modules moe_act`
(grouped GEMM only), plus TE's `SequentialMLP`. For each, Megatron's MoELayer from its TE spec
with `deepep` (EP = 1, our kernels) and with `alltoall`, same weights and inputs (bf16, and fp32
once): outputs and the gradients of the input and of every parameter (router and experts),
compared by relative norm, must be within the dtype's rounding of `alltoall`'s, or no further
from them than a second `alltoall` layer's run (TE's GEMMs need not be bit-reproducible).

Needs megatron-core 0.19.2 and TE (`bash dev/gpu/gpu_te.sh` installs both and runs this file).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.marks import TE_GPU
from tests.gpu.test_te_experts_gpu import _rel, _run_layer

pytestmark = TE_GPU

H = 512
NUM_EXPERTS = 8

# name -> TransformerConfig overrides (on top of _config's)
CASES = {
    "grouped_gemm": dict(moe_grouped_gemm=True),
    "sequential_te": dict(moe_grouped_gemm=False),
    "moe_latent_size": dict(moe_grouped_gemm=True, moe_latent_size=H // 2),
    "recompute_moe_act": dict(moe_grouped_gemm=True, recompute_granularity="selective",
                              recompute_modules=["moe_act"]),
    "grouped_gemm_fp32": dict(moe_grouped_gemm=True, params_dtype=torch.float32, bf16=False),
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
    from megatron_deepep.bench.layer_variants import te_moe_layer

    config = _config(dispatcher, overrides)
    layer, _ = te_moe_layer(config, NUM_EXPERTS, fp8_experts=False,
                            grouped_gemm=config.moe_grouped_gemm)
    return layer.cuda().train()


def _no_fp8():
    """FP8 off explicitly: the layers run in their dtype whatever an earlier test left in TE's
    global FP8 state (a delayed-scaling history differs per layer instance)."""
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=False)
    return te.fp8_autocast(enabled=False)


@pytest.mark.parametrize("case", list(CASES))
def test_te_layer_deepep_matches_alltoall(megatron_env, case):
    from megatron_deepep.megatron import DeepEPTokenDispatcher
    from megatron_deepep.megatron.options import set_default_options

    set_default_options(transport="auto", fp8_dispatch="off")  # bf16 rows, as alltoall's
    overrides = CASES[case]
    ours = _layer("deepep", overrides)
    theirs = _layer("alltoall", overrides)
    control = _layer("alltoall", overrides)  # alltoall against itself: the noise floor
    theirs.load_state_dict(ours.state_dict())
    control.load_state_dict(ours.state_dict())
    assert isinstance(ours.token_dispatcher, DeepEPTokenDispatcher)
    dtype = torch.float32 if overrides.get("params_dtype") == torch.float32 else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(256, 2, H, device="cuda", generator=gen).to(dtype)
    grad = torch.randn(256, 2, H, device="cuda", generator=gen).to(dtype)
    runs = [_run_layer(layer, x, grad, _no_fp8) for layer in (ours, theirs, control)]
    (o1, g1, p1), (o2, g2, p2), (o3, g3, p3) = runs
    assert p1.keys() == p2.keys() == p3.keys() and p1, "the same parameters get gradients"
    names = ["output", "input grad"] + list(p1)
    ours_rel = dict(zip(names, [_rel(o1, o2), _rel(g1, g2)] + [_rel(p1[n], p2[n]) for n in p1]))
    floor = dict(zip(names, [_rel(o3, o2), _rel(g3, g2)] + [_rel(p3[n], p2[n]) for n in p1]))
    print(f"\n        {case}: rel. difference to alltoall (alltoall's own run-to-run in "
          "brackets): " + ", ".join(f"{k} {ours_rel[k]:.1e} ({floor[k]:.1e})" for k in names
                                    if k in ("output", "input grad", "router.weight")))
    # Within the dtype's rounding of alltoall, or no further from it than alltoall run twice.
    limit = 1e-5 if dtype == torch.float32 else 1e-2
    for k in names:
        assert ours_rel[k] <= max(limit, 2 * floor[k]), (k, ours_rel[k], floor[k])
    assert p1["router.weight"].abs().sum() > 0  # the router learns through the probs
    if overrides.get("moe_latent_size"):
        assert any("latent" in name for name in p1), "the latent projections are trained"
