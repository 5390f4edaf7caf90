"""The runtime plugin: an unmodified pip megatron-core accepts `deepep` after one call.

Every check runs in a spawned interpreter (fresh imports, nothing registered before).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import typing
import warnings

import pytest
import torch

from tests.helpers.distributed import run_distributed

H = 32


def _config(dispatcher_type, **kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=H, ffn_hidden_size=64, num_attention_heads=4,
                num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type=dispatcher_type,
                use_cpu_initialization=True, add_bias_linear=False,
                gradient_accumulation_fusion=False)
    base.update(kwargs)
    return TransformerConfig(**base)


def _moe_layer(dispatcher_type, seed=0, **kwargs):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    submodules = MoESubmodules(experts=ModuleSpec(
        module=SequentialMLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)))
    torch.manual_seed(seed)
    return MoELayer(_config(dispatcher_type, **kwargs), submodules, layer_number=1)


def _cpu_router(layer):
    """Megatron's TopKRouter moves its weight to CUDA; this CPU stand-in keeps its math."""

    def forward(hidden, padding_mask=None):
        logits = hidden.reshape(-1, H) @ layer.router.weight.t()
        scores = torch.softmax(logits.float(), dim=-1)
        _, idx = torch.topk(scores, layer.config.moe_router_topk, dim=-1)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
        return scores * routing_map, routing_map

    layer.router.forward = forward


def _free_input_policy():
    """Megatron's A2A-overlap input-freeing policy as `policy(name, is_moe, config)`.

    Looked up where the schedule reads it: on 0.17+ `TransformerLayerNode._resolve_free_input`,
    over `should_free_input` of `models/common/utils.py`; on 0.16 `should_free_input` of
    `models/gpt/fine_grained_callables.py`. Four local experts: with one, 0.17+ keeps alltoall's
    mlp inputs too.
    """
    try:
        from megatron.core.models.common.utils import TransformerLayerNode
    except ImportError:
        from megatron.core.models.gpt import fine_grained_callables as fgc

        return lambda name, is_moe, config: fgc.should_free_input(name, is_moe, config)
    return lambda name, is_moe, config: TransformerLayerNode._resolve_free_input(
        name, is_moe, config, 4)


def _megatron_cli_dispatcher_type(value):
    """`--moe-token-dispatcher-type value` through megatron.training's parser, built now.

    Returns None where megatron.training is not installed (the 0.16 wheel lacks it); an invalid
    choice raises SystemExit.
    """
    if importlib.util.find_spec("megatron.training") is None:
        return None
    from megatron.training import arguments

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    with contextlib.redirect_stderr(io.StringIO()):
        args, _ = parser.parse_known_args(["--moe-token-dispatcher-type", value])
    return args.moe_token_dispatcher_type


_SHARED_OVERLAP = dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True)
_A2A_OVERLAP = dict(overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=2,
                    bf16=True)


def _accepts_worker(rank, world_size):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    import megatron_deepep.megatron as mdm
    from megatron.core.transformer.transformer_config import TransformerConfig

    # Before: Megatron refuses the type where it checks it.
    with pytest.raises(ValueError, match="alltoall"):
        _config("deepep", **_SHARED_OVERLAP)
    with pytest.raises(AssertionError, match="alltoall"):
        _config("deepep", **_A2A_OVERLAP)
    with pytest.raises(ValueError, match="Unsupported token dispatcher type"):
        _moe_layer("deepep")
    cli_checked = _megatron_cli_dispatcher_type("alltoall") == "alltoall"
    if cli_checked:
        with pytest.raises(SystemExit):
            _megatron_cli_dispatcher_type("deepep")

    mdm.register_deepep_dispatcher(transport="reference")
    mdm.register_deepep_dispatcher(transport="reference")  # idempotent
    assert mdm.is_registered()

    # TransformerConfig: the Literal (which megatron.training turns into CLI choices) and checks.
    field = {f.name: f for f in dataclasses.fields(TransformerConfig)}["moe_token_dispatcher_type"]
    choices = typing.get_args(field.type)
    assert "deepep" in choices and {"allgather", "alltoall", "flex"} <= set(choices)
    parser = argparse.ArgumentParser()
    parser.add_argument("--moe-token-dispatcher-type", type=str, choices=choices)
    assert parser.parse_args(["--moe-token-dispatcher-type", "deepep"]).moe_token_dispatcher_type \
        == "deepep"
    if cli_checked:  # megatron.training's own parser (0.17+ wheels ship megatron.training)
        assert _megatron_cli_dispatcher_type("deepep") == "deepep"
    assert _config("deepep").moe_token_dispatcher_type == "deepep"
    assert _config("deepep", **_SHARED_OVERLAP).moe_shared_expert_overlap
    assert _config("deepep", **_A2A_OVERLAP).overlap_moe_expert_parallel_comm
    # Other types keep Megatron's rules.
    with pytest.raises(ValueError, match="alltoall"):
        _config("allgather", **_SHARED_OVERLAP)
    # Our own checks name the flag.
    with pytest.raises(ValueError, match="moe-enable-deepep"):
        _config("deepep", moe_enable_deepep=True)

    # MoELayer builds our dispatcher and binds it to the layer.
    layer = _moe_layer("deepep")
    assert isinstance(layer.token_dispatcher, mdm.DeepEPTokenDispatcher)
    assert layer.token_dispatcher.layer_number == 1
    assert layer.config.moe_token_dispatcher_type == "deepep"

    # A2A-overlap memory policy: dispatched rows are kept for the experts' backward.
    free_input = _free_input_policy()
    cfg = _config("deepep")
    assert free_input("mlp", True, cfg) is False
    assert free_input("moe_dispatch", True, cfg) is False
    assert free_input("moe_combine", True, cfg) is True
    assert free_input("mlp", False, cfg) is False
    assert free_input("mlp", True, _config("alltoall")) is True
    # Without a policy to extend, the overlap is refused rather than freeing the experts' rows.
    from megatron_deepep.megatron import patching
    found = patching._STATE["should_free_input"]
    assert found and set(found) <= set(patching.SHOULD_FREE_INPUT_MODULES), found
    patching._STATE["should_free_input"] = []
    try:
        with pytest.raises(ValueError, match="should_free_input"):
            _config("deepep", **_A2A_OVERLAP)
    finally:
        patching._STATE["should_free_input"] = found

    # Option precedence: config field > register kwargs > environment.
    assert mdm.resolve_options(cfg).transport == "reference"
    cfg.moe_mdeep_num_sms = 7
    assert mdm.resolve_options(cfg).num_sms == 7
    with pytest.raises(ValueError, match="unknown megatron_deepep option"):
        mdm.register_deepep_dispatcher(not_an_option=1)

    # Undo restores Megatron's behaviour: every patched attribute is its original object again,
    # the metrics report hooks included.
    from megatron.core.transformer.moe import moe_utils
    from megatron_deepep.megatron import metrics
    records = list(patching._APPLIED)
    patched = {(getattr(r.owner, "__name__", type(r.owner).__name__), r.name) for r in records}
    assert {("TransformerConfig", "__post_init__"), ("MoELayer", "__init__")} <= patched, patched
    if hasattr(moe_utils, "track_moe_metrics"):
        assert metrics.is_report_hook(moe_utils.track_moe_metrics)
    mdm.unregister_deepep_dispatcher()
    assert not patching._APPLIED
    for r in records:
        now = r.owner.get(r.name, patching._MISSING) if r.item \
            else getattr(r.owner, r.name, patching._MISSING)
        if r.original is patching._MISSING and not r.item:  # inherited: the base's again
            assert r.name not in r.owner.__dict__, r
        else:
            assert now is r.original, r
    assert not metrics.is_report_hook(getattr(moe_utils, "track_moe_metrics", None))
    assert "deepep" not in typing.get_args(field.type)
    with pytest.raises(ValueError, match="Unsupported token dispatcher type"):
        _moe_layer("deepep")
    assert free_input("mlp", True, cfg) is True
    if cli_checked:
        with pytest.raises(SystemExit):
            _megatron_cli_dispatcher_type("deepep")
    # Registering again after the undo patches again.
    mdm.register_deepep_dispatcher(transport="reference")
    assert isinstance(_moe_layer("deepep").token_dispatcher, mdm.DeepEPTokenDispatcher)
    assert len(patching._APPLIED) == len(records)
    mdm.unregister_deepep_dispatcher()
    ps.destroy_model_parallel()


def test_plugin_makes_deepep_accepted():
    run_distributed(1, _accepts_worker, timeout_s=120)


def _layer_parity_worker(rank, world_size):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    import megatron_deepep.megatron as mdm

    mdm.register_deepep_dispatcher(transport="reference")
    ours = _moe_layer("deepep", seed=3)
    theirs = _moe_layer("allgather", seed=4)
    theirs.load_state_dict(ours.state_dict())
    for layer in (ours, theirs):
        _cpu_router(layer)
    x = torch.randn(9, 2, H, generator=torch.Generator().manual_seed(5))
    grad = torch.randn(9, 2, H, generator=torch.Generator().manual_seed(6))
    results = []
    for layer in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        out, bias = layer(xi)
        assert bias is None
        (out * grad).sum().backward()
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (o1, g1, p1), (o2, g2, p2) = results
    torch.testing.assert_close(o1, o2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-6)
    assert p1.keys() == p2.keys()
    for name in p1:
        assert p1[name] is not None, name
        torch.testing.assert_close(p1[name], p2[name], rtol=1e-6, atol=1e-6)
    ps.destroy_model_parallel()


def test_moe_layer_matches_allgather_on_cpu():
    """A real MoELayer (SequentialMLP experts, router gradient through the probs), EP=1."""
    run_distributed(1, _layer_parity_worker, timeout_s=120)


def test_options_read_the_environment_through_knobs(monkeypatch):
    from megatron_deepep.megatron import options

    monkeypatch.setattr(options, "_REGISTERED_OPTIONS", {})
    for name in ("TRANSPORT", "NUM_SMS", "NUM_MAX_TOKENS_PER_RANK", "METRICS", "METRICS_DIR",
                 "FP8_DISPATCH"):
        monkeypatch.delenv("MDEEP_" + name, raising=False)
    assert options.resolve_options(None) == options.DeepEPOptions()
    monkeypatch.setenv("MDEEP_TRANSPORT", "local")
    monkeypatch.setenv("MDEEP_NUM_SMS", " 9 ")
    monkeypatch.setenv("MDEEP_METRICS", "Yes")
    monkeypatch.setenv("MDEEP_METRICS_DIR", "metrics/run1")  # read as given, not created
    monkeypatch.setenv("MDEEP_FP8_DISPATCH", "mxfp8")
    resolved = options.resolve_options(None)
    assert (resolved.transport, resolved.num_sms, resolved.metrics, resolved.metrics_dir,
            resolved.fp8_dispatch) == ("local", 9, True, "metrics/run1", "mxfp8")
    # Config field > registered default > environment.
    options.set_default_options(num_sms=11)
    assert options.resolve_options(None).num_sms == 11
    assert options.resolve_options(type("C", (), dict(moe_mdeep_num_sms=13))()).num_sms == 13
    # One boolean parser: anything else is refused, naming the variable.
    monkeypatch.setenv("MDEEP_METRICS", "maybe")
    with pytest.raises(ValueError, match="MDEEP_METRICS"):
        options.resolve_options(None)
    monkeypatch.setenv("MDEEP_METRICS", "0")
    monkeypatch.setenv("MDEEP_TRANSPORT", "pcie")
    with pytest.raises(ValueError, match="MDEEP_TRANSPORT='pcie': expected one of auto, local"):
        options.resolve_options(None)
    monkeypatch.setenv("MDEEP_TRANSPORT", "local")
    monkeypatch.setenv("MDEEP_NUM_SMS", "-4")  # the plugin's message names the variable too
    with pytest.raises(ValueError, match=r"MDEEP_NUM_SMS='-4': expected an integer >= 1"):
        options.resolve_options(None)
    for transport in options.TRANSPORT_CHOICES:
        assert options.DeepEPOptions(transport=transport).transport == transport
    with pytest.raises(ValueError, match="--moe-mdeep-transport"):
        options.set_default_options(transport="pcie")
