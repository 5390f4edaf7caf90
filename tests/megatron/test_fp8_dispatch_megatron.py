"""CPU tier: `--moe-mdeep-fp8-dispatch` in the Megatron dispatcher over the reference transport.

On 2 gloo ranks the six hooks run forward and backward with FP8 dispatch; without TE the
experts get bf16 rows dequantized on the receiver, so the output must match the communication-
free oracle evaluated on `dequantize(quantize(x))`, and the input gradient (straight-through)
the oracle's. The option itself: plugin kwargs, config field, CLI flags, errors naming the flag.
"""

from __future__ import annotations

import argparse
import warnings

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.megatron.test_megatron_dispatcher import (H, _config, _expert_weights, _hooks,
                                                     _make_routing, _oracle)


def _fp8_case(rank, world, pg, option, fmt_name, seed, align=None):
    from megatron_deepep.fp8 import FORMATS, dequantize, quantize
    from megatron_deepep.megatron import DeepEPTokenDispatcher

    num_experts, topk = 8, 2
    tokens = [13, 0][rank] if seed % 2 else [9, 17][rank]
    config = _config(world, num_experts, topk)
    config.moe_mdeep_fp8_dispatch = option  # the config field a patched Megatron carries
    if align is not None:
        config.moe_router_padding_for_quantization = True
        # Megatron sizes the padding from the fp8 recipe (0.19 gives 0 without fp8).
        config.fp8 = "e4m3"
    num_local = num_experts // world
    local_ids = list(range(rank * num_local, (rank + 1) * num_local))
    dispatcher = DeepEPTokenDispatcher(num_local, local_ids, config=config, pg_collection=pg)
    assert dispatcher.options.fp8_dispatch == option
    probs, routing_map = _make_routing(tokens, num_experts, topk, seed * 10 + rank)
    gen = torch.Generator().manual_seed(seed * 10 + rank + 5)
    x = torch.randn(tokens, 1, H, generator=gen).to(torch.bfloat16)
    grad_out = torch.randn(tokens, 1, H, generator=gen)
    weights = _expert_weights(num_experts)

    x_a = x.clone().requires_grad_(True)
    probs_a = probs.clone().requires_grad_(True)
    log = {}
    out = _hooks(dispatcher, x_a, routing_map, probs_a, weights, log)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    (out.float() * grad_out).sum().backward()
    if align is not None:
        assert (log["tokens_per_expert"] % align == 0).all()

    if fmt_name is None:
        x_seen = x.view(-1, H).float()
    else:
        fmt = FORMATS[fmt_name]
        x_seen = dequantize(*quantize(x.view(-1, H), fmt), fmt).float()
    x_b = x_seen.clone().requires_grad_(True)
    probs_b = probs.clone().requires_grad_(True)
    ref = _oracle(x_b, probs_b, routing_map, weights)
    (ref * grad_out.view(-1, H)).sum().backward()
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float().view(-1, H), ref, **tol)
    torch.testing.assert_close(x_a.grad.float().view(-1, H), x_b.grad, **tol)
    torch.testing.assert_close(probs_a.grad, probs_b.grad, **tol)
    return out.detach()


def _worker(rank, world):
    warnings.filterwarnings("ignore")
    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    # The plugin accepts the option (and rejects a bad one, naming the flag).
    with pytest.raises(ValueError, match="--moe-mdeep-fp8-dispatch"):
        mdm.register_deepep_dispatcher(transport="reference", fp8_dispatch="fp4")
    mdm.register_deepep_dispatcher(transport="reference", fp8_dispatch="blockwise")
    cfg = _config(world, 8, 2)
    assert mdm.resolve_options(cfg).fp8_dispatch == "blockwise"
    cfg.moe_mdeep_fp8_dispatch = "mxfp8"  # config field > plugin kwargs
    assert mdm.resolve_options(cfg).fp8_dispatch == "mxfp8"
    with pytest.raises(ValueError, match="--moe-mdeep-fp8-dispatch"):
        mdm.check_config(type("C", (), dict(num_moe_experts=8, moe_mdeep_fp8_dispatch="e5m2"))())
    with pytest.raises(ValueError, match="hidden-size % 16"):
        mdm.check_config(type("C", (), dict(num_moe_experts=8, hidden_size=40,
                                            moe_mdeep_fp8_dispatch="auto"))())
    fmt, reason = mdm.fp8_format_for_option("auto")  # no TE recipe active here
    assert fmt is None and reason
    assert mdm.fp8_format_for_option("mxfp8")[0].name == "mxfp8_1x32"

    # CLI flags: `add_arguments` is an extra_args_provider; `apply_arguments` sets the defaults.
    parser = mdm.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--moe-mdeep-fp8-dispatch", "mxfp8", "--moe-mdeep-num-sms", "12"])
    mdm.apply_arguments(args)
    assert mdm.resolve_options(_config(world, 8, 2)).fp8_dispatch == "mxfp8"
    assert mdm.resolve_options(_config(world, 8, 2)).num_sms == 12
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-mdeep-fp8-dispatch", "e5m2"])
    mdm.register_deepep_dispatcher(fp8_dispatch="off", num_sms=24)

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        pg = get_default_pg_collection()
        plain = _fp8_case(rank, world, pg, "off", None, seed=2)
        for option, fmt_name, seed, align in (("blockwise", "blockwise_1x128", 1, None),
                                              ("mxfp8", "mxfp8_1x32", 2, 16),
                                              ("blockwise_1x128_fp32_scales",
                                               "blockwise_1x128_fp32_scales", 3, None)):
            out = _fp8_case(rank, world, pg, option, fmt_name, seed, align)
            if seed == 2:  # same inputs as the bf16 run: FP8 changes the output, a little
                assert out.shape[0] == 0 or not torch.equal(out, plain)
        # "auto" without an active TE recipe dispatches bf16: identical to "off".
        assert torch.equal(_fp8_case(rank, world, pg, "auto", None, seed=2), plain)
        # Hidden sizes FP8 cannot carry are refused when the dispatcher is built.
        config = _config(world, 8, 2)
        config.moe_mdeep_fp8_dispatch = "blockwise"
        config.hidden_size = 40
        with pytest.raises(ValueError, match="hidden_size % 16"):
            mdm.DeepEPTokenDispatcher(4, list(range(rank * 4, rank * 4 + 4)), config=config,
                                      pg_collection=pg)
    finally:
        ps.destroy_model_parallel()


def test_megatron_fp8_dispatch_on_two_ranks():
    run_distributed(2, _worker, timeout_s=170)


def test_handoff_needs_matching_recipe_and_no_capacity_padding():
    from megatron_deepep.fp8 import FORMATS
    from megatron_deepep.megatron.dispatcher import fp8_handoff

    fmt = FORMATS["blockwise_1x128"]
    ok, reason = fp8_handoff(fmt, training=False, drop_and_pad=True)
    assert not ok and "capacity" in reason
    ok, reason = fp8_handoff(fmt, training=True)
    assert not ok and reason  # no TE here, or no recipe active
