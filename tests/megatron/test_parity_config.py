"""CPU tier: what `deepep` refuses at configuration time (naming the flag), and the sync-free
pieces of the dispatcher on their own (the row bound, the counts fitted to it, the masks)."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_deepep.megatron import options

pytest.importorskip("megatron.core")


def _config(**kwargs):
    base = dict(num_moe_experts=8, moe_router_topk=2, cuda_graph_impl="none",
                cuda_graph_scope="full", moe_pad_expert_input_to_capacity=False,
                moe_expert_capacity_factor=None)
    return types.SimpleNamespace(**dict(base, **kwargs))


@pytest.mark.parametrize("impl, scope, captured", [
    ("local", "full", "whole-layer --cuda-graph-scope"),
    ("transformer_engine", [], "whole-layer --cuda-graph-scope"),
    ("local", None, "whole-layer --cuda-graph-scope"),
    ("local", ["attn"], "--cuda-graph-scope attn"),
    ("local", "full_iteration", "--cuda-graph-impl full_iteration"),
])
def test_graph_around_a_synchronizing_dispatch_is_refused(impl, scope, captured):
    config = _config(cuda_graph_impl=impl, cuda_graph_scope=scope)
    with pytest.raises(ValueError, match=f"{captured}.* captures the deepep dispatch.*"
                                         "--moe-expert-rank-capacity-factor"):
        options.check_config(config, options.DeepEPOptions())


@pytest.mark.parametrize("impl, scope", [
    ("local", ["moe_router"]), ("local", ["moe_preprocess"]),
    ("local", "moe_router,moe_preprocess"), ("transformer_engine", ["moe_router"]),
    ("transformer_engine", ["moe_router", "moe_preprocess"]), ("transformer_engine", ["attn"]),
    ("transformer_engine", "attn,moe_router"), ("none", "full"), ("none", "full_iteration"),
])
def test_graphs_that_end_before_the_dispatch_are_fine(impl, scope):
    options.check_config(_config(cuda_graph_impl=impl, cuda_graph_scope=scope),
                         options.DeepEPOptions())
    assert options.graph_captures_dispatch(_config(cuda_graph_impl=impl,
                                                   cuda_graph_scope=scope)) is None


@pytest.mark.parametrize("scope", [["moe"], "attn,moe", "moe"])
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_moe_scope_needs_drop_and_pad_even_with_a_row_bound(impl, scope):
    """Megatron graphs the MoE layer (`moe`) only for drop-and-pad layers, whatever bounds the
    dispatch; a rank capacity factor goes with whole-layer graphs."""
    config = _config(cuda_graph_impl=impl, cuda_graph_scope=scope)
    with pytest.raises(ValueError, match="--cuda-graph-scope moe captures the MoE layer.*"
                                         "--moe-pad-expert-input-to-capacity with "
                                         "--moe-expert-capacity-factor"):
        options.check_config(config, options.DeepEPOptions(rank_capacity_factor=2.0))
    padded = _config(cuda_graph_impl=impl, cuda_graph_scope=scope,
                     moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0)
    options.check_config(padded, options.DeepEPOptions())
    assert "moe" in options.graph_captures_dispatch(padded)


@pytest.mark.parametrize("impl, scope, match", [
    ("local", ["moe", "moe_router"], "moe .* and moe_router .* exclude each other"),
    ("local", ["moe", "moe_preprocess"], "exclude each other"),  # local adds moe_router
    ("transformer_engine", ["moe_preprocess"], "moe_preprocess needs moe_router"),
])
def test_megatrons_scope_pairing_rules(impl, scope, match):
    with pytest.raises(ValueError, match=match):
        options.check_config(_config(cuda_graph_impl=impl, cuda_graph_scope=scope,
                                     moe_pad_expert_input_to_capacity=True,
                                     moe_expert_capacity_factor=1.0), options.DeepEPOptions())


@pytest.mark.parametrize("impl, scope, cause", [
    ("local", ["moe_router"], dict(moe_expert_capacity_factor=1.0)),
    ("transformer_engine", ["moe_router", "moe_preprocess"], dict(moe_expert_capacity_factor=0.5)),
    ("transformer_engine", ["moe_router", "moe_preprocess"], dict(moe_router_padding_for_fp8=True)),
])
def test_plugin_refuses_alltoalls_preprocess_rule_by_name(impl, scope, cause):
    """The plugin validates deepep with alltoall's rules, one of which refuses a graphed
    preprocess with token dropping; check_config says so first (only under the plugin)."""
    config = _config(cuda_graph_impl=impl, cuda_graph_scope=scope, **cause)
    with pytest.raises(ValueError, match="moe_preprocess.* without "
                                         "--moe-pad-expert-input-to-capacity.*alltoall"):
        options.check_config(config, options.DeepEPOptions(), validated_as="alltoall")
    options.check_config(config, options.DeepEPOptions())  # a patched Megatron knows deepep
    options.check_config(_config(cuda_graph_impl=impl, cuda_graph_scope=scope,
                                 moe_pad_expert_input_to_capacity=True,
                                 moe_expert_capacity_factor=1.0),
                         options.DeepEPOptions(), validated_as="alltoall")
    if impl == "transformer_engine":  # the router alone ends before the preprocess
        options.check_config(_config(cuda_graph_impl=impl, cuda_graph_scope=["moe_router"],
                                     **cause), options.DeepEPOptions(), validated_as="alltoall")


def test_a_row_bound_makes_the_graph_fine(monkeypatch):
    graph = dict(cuda_graph_impl="local", cuda_graph_scope=[])
    options.check_config(_config(**graph), options.DeepEPOptions(rank_capacity_factor=1.5))
    # Any EP size: the kernels' epochs live on the device.
    options.check_config(_config(expert_model_parallel_size=8, **graph),
                         options.DeepEPOptions(rank_capacity_factor=1.5), ep_size=8)
    options.check_config(_config(moe_expert_rank_capacity_factor=2.0, **graph),
                         options.DeepEPOptions())
    options.check_config(_config(moe_pad_expert_input_to_capacity=True,
                                 moe_expert_capacity_factor=1.0, **graph),
                         options.DeepEPOptions())
    monkeypatch.setenv("MDEEP_RANK_CAPACITY_FACTOR", "2")
    options.check_config(_config(**graph))  # __post_init__'s path: resolved from the env
    monkeypatch.setenv("MDEEP_RANK_CAPACITY_FACTOR", "")
    with pytest.raises(ValueError, match="captures the deepep dispatch"):
        options.check_config(_config(**graph))


def test_newer_megatron_graph_field_is_read():
    config = _config(cuda_graph_impl="local", cuda_graph_modules=["moe"])
    del config.cuda_graph_scope
    with pytest.raises(ValueError, match="--cuda-graph-modules moe"):
        options.check_config(config, options.DeepEPOptions())
    config.cuda_graph_impl = "full_iteration"
    with pytest.raises(ValueError, match="--cuda-graph-impl full_iteration"):
        options.check_config(config, options.DeepEPOptions())
    # 0.19: the deprecated cuda_graph_scope (None by default) wins when set.
    config = _config(cuda_graph_impl="local", cuda_graph_modules="full",
                     cuda_graph_scope=["moe_router"])
    assert options.graph_scope(config).modules == {"moe_router", "moe_preprocess"}
    assert options.graph_scope(config).flag == "--cuda-graph-scope"
    config.cuda_graph_scope = None
    assert options.graph_scope(config) == options.GraphScope("local", frozenset(),
                                                             "--cuda-graph-modules")
    # 0.19 turns "full_iteration" into the impl, even from "none" (0.16 keeps "none").
    config = _config(cuda_graph_impl="none", cuda_graph_modules="full_iteration",
                     cuda_graph_scope=None)
    assert options.graph_scope(config).impl == "full_iteration"
    assert options.graph_scope(_config(cuda_graph_scope="full_iteration")).impl == "none"
    # The deprecated switches.
    assert options.graph_scope(_config(enable_cuda_graph=True)).impl == "local"
    assert options.graph_scope(_config(external_cuda_graph=True)).impl == "transformer_engine"


def test_expert_tensor_parallelism_is_accepted_with_the_synchronous_dispatch(monkeypatch):
    seen = []  # the expert-TP size each call's check saw: the accepted calls were judged
    check_expert_tp = options._check_expert_tp

    def recording(config, opts, etp):
        seen.append(etp)
        return check_expert_tp(config, opts, etp)

    monkeypatch.setattr(options, "_check_expert_tp", recording)
    padded = dict(moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0,
                  cuda_graph_impl="local", cuda_graph_scope=["moe"])  # sync-free without a bound
    accepted = [(_config(expert_tensor_parallel_size=2), {}), (_config(), dict(expert_tp_size=4)),
                (_config(**padded), dict(expert_tp_size=2))]
    for config, kwargs in accepted:
        assert options.check_config(config, options.DeepEPOptions(), **kwargs) is None
    assert seen == [2, 4, 2]
    # The same configurations with a row bound (the sync-free dispatch) are refused: what was
    # accepted above is the synchronous dispatch, not any configuration; pad-to-capacity (the
    # same capacity segments on every rank) stays accepted.
    bounded = options.DeepEPOptions(rank_capacity_factor=2.0)
    for config, kwargs in accepted[:2]:
        with pytest.raises(ValueError, match="--expert-tensor-parallel-size .* needs the "
                                             "synchronous dispatch"):
            options.check_config(config, bounded, **kwargs)
    assert options.check_config(accepted[2][0], bounded, **accepted[2][1]) is None


@pytest.mark.parametrize("fields, opts, flag", [
    ({}, dict(rank_capacity_factor=2.0), "--moe-mdeep-rank-capacity-factor"),
    (dict(moe_expert_rank_capacity_factor=2.0), {}, "--moe-expert-rank-capacity-factor"),
    (dict(cuda_graph_impl="local", cuda_graph_scope=[]), dict(rank_capacity_factor=2.0),
     "--moe-mdeep-rank-capacity-factor"),
])
def test_expert_tensor_parallelism_refuses_the_sync_free_dispatch(fields, opts, flag):
    config = _config(expert_tensor_parallel_size=2, **fields)
    with pytest.raises(ValueError, match=f"--expert-tensor-parallel-size 2 .*{flag}"):
        options.check_config(config, options.DeepEPOptions(**opts))
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size 2"):
        options.check_config(_config(**fields), options.DeepEPOptions(**opts), expert_tp_size=2)


@pytest.mark.parametrize("value", [0, -1.0, "abc", float("inf"), True])
def test_bad_rank_capacity_factor_names_the_flag(value, monkeypatch):
    with pytest.raises(ValueError, match="--moe-mdeep-rank-capacity-factor"):
        options.DeepEPOptions(rank_capacity_factor=value)
    with pytest.raises(ValueError, match="--moe-expert-rank-capacity-factor must be"):
        options.check_config(_config(moe_expert_rank_capacity_factor=value),
                             options.DeepEPOptions())
    monkeypatch.setenv("MDEEP_RANK_CAPACITY_FACTOR", str(value))
    with pytest.raises(ValueError, match="MDEEP_RANK_CAPACITY_FACTOR"):
        options.resolve_options(None)


def test_megatron_field_wins_over_ours(monkeypatch):
    monkeypatch.setenv("MDEEP_RANK_CAPACITY_FACTOR", "3")
    opts = options.resolve_options(None)
    assert opts.rank_capacity_factor == 3.0
    assert options.rank_capacity_factor(_config(), opts) == 3.0
    assert options.rank_capacity_factor(_config(moe_expert_rank_capacity_factor=1.25), opts) \
        == 1.25
    assert options.rank_capacity_factor(_config(), options.DeepEPOptions()) is None


def test_rank_capacity_rows():
    # HybridEP's budget ceil(factor * tokens * top-k), plus each local expert's padding.
    assert options.rank_capacity_rows(1.5, 100, 6, 8) == 900
    assert options.rank_capacity_rows(1.0, 7, 3, 4, alignment=16) == 21 + 4 * 15
    assert options.rank_capacity_rows(2.0, 0, 8, 2) == 1


def test_bounded_counts_fit_the_bound():
    from megatron_deepep.megatron.dispatcher import _bounded_counts

    counts, used = _bounded_counts(torch.tensor([3, 5, 0], dtype=torch.int32), 12)
    assert counts.tolist() == [3, 5, 4] and counts.dtype == torch.int64
    assert used.tolist() == [True] * 8 + [False] * 4
    # Overflow (more than the bound arrived: the Buffer raises at its next call): the counts
    # still describe the rows that exist.
    counts, used = _bounded_counts(torch.tensor([6, 9, 2]), 12)
    assert counts.tolist() == [6, 6, 0] and used.all()


def test_unused_rows_are_zero_forward_and_backward():
    from megatron_deepep.megatron.dispatcher import _ZeroUnusedRows

    rows = torch.full((4, 3), float("nan")).requires_grad_()
    used = torch.tensor([True, True, False, False])
    out = _ZeroUnusedRows.apply(rows, used)
    assert torch.isnan(out[:2]).all() and (out[2:] == 0).all()
    out.backward(torch.full((4, 3), float("inf")))
    assert torch.isinf(rows.grad[:2]).all() and (rows.grad[2:] == 0).all()


def test_fill_routes_of_pad_to_capacity_give_way_to_real_ones():
    """Pad-to-capacity routes tokens with prob 0 to fill each expert: a row may name more than
    top-k experts; the nonzero-prob ones are kept, in ascending expert order."""
    from megatron_deepep.megatron.dispatcher import routing_map_to_topk

    routing_map = torch.tensor([[1, 1, 0, 1, 1, 0], [0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    probs = torch.tensor([[0.0, 0.0, 0.0, 0.7, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    idx, weights = routing_map_to_topk(routing_map, probs, 2)
    assert idx.tolist() == [[3, 4], [2, -1]]
    assert torch.equal(weights, torch.tensor([[0.7, 0.3], [0.0, 0.0]]))


def test_patching_hides_the_rank_capacity_field_from_alltoall_rules():
    from megatron_deepep.megatron import patching

    config = types.SimpleNamespace(moe_expert_rank_capacity_factor=1.5)
    with patching._hidden_field(config, patching._RANK_CAPACITY):
        assert config.moe_expert_rank_capacity_factor is None
    assert config.moe_expert_rank_capacity_factor == 1.5
    bare = types.SimpleNamespace()
    with patching._hidden_field(bare, patching._RANK_CAPACITY):
        assert not hasattr(bare, patching._RANK_CAPACITY)


def test_transformer_config_refuses_a_graph_around_the_dispatch():
    """The refusal comes from TransformerConfig itself (argument validation), not the first
    forward."""
    import megatron_deepep.megatron as mdm
    from megatron.core.transformer.transformer_config import TransformerConfig

    mdm.register_deepep_dispatcher()
    try:
        with pytest.raises(ValueError,
                           match="whole-layer --cuda-graph-(scope|modules) captures the deepep"):
            TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                              num_moe_experts=8, moe_router_topk=2,
                              moe_token_dispatcher_type="deepep", cuda_graph_impl="local")
    finally:
        mdm.unregister_deepep_dispatcher()


def _scope_field():
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    return "cuda_graph_modules" if "cuda_graph_modules" in fields else "cuda_graph_scope"


# (cuda_graph_impl, scope, extra TransformerConfig fields) for the verdict parity below.
_PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
GRAPH_CASES = [
    ("local", ["moe"], {}),
    ("local", ["moe"], _PAD),
    ("transformer_engine", "moe", _PAD),
    ("local", ["moe_router"], {}),
    ("local", ["moe_router"], dict(moe_expert_capacity_factor=1.0)),
    ("local", ["moe_preprocess"], _PAD),
    ("local", ["moe", "moe_preprocess"], _PAD),
    ("transformer_engine", ["moe_router"], dict(moe_expert_capacity_factor=1.0)),
    ("transformer_engine", ["moe_preprocess"], {}),
    ("transformer_engine", ["moe_router", "moe_preprocess"], {}),
    ("transformer_engine", ["moe_router", "moe_preprocess"], dict(moe_expert_capacity_factor=1.0)),
    ("transformer_engine", ["moe_router", "moe_preprocess"], _PAD),
    ("transformer_engine", "attn,moe_router", {}),
    ("transformer_engine", ["moe", "moe_router"], _PAD),
]


@pytest.mark.parametrize("impl, scope, extra", GRAPH_CASES)
def test_deepep_refuses_exactly_what_megatron_refuses(impl, scope, extra):
    """Against the installed megatron-core's own TransformerConfig: a deepep config (plugin)
    is refused by check_config with a ValueError naming the flag exactly when Megatron refuses
    the same config for alltoall (whose rules the plugin applies); the scope deepep reads is the
    one Megatron normalized. Configurations whose graph ends before the dispatch, or that hold
    a bound, so no rule of ours adds to Megatron's."""
    import warnings

    import megatron_deepep.megatron as mdm
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=8,
                  moe_router_topk=2, cuda_graph_impl=impl, **{_scope_field(): scope}, **extra)
    warnings.filterwarnings("ignore")
    try:
        megatron = TransformerConfig(moe_token_dispatcher_type="alltoall", **fields)
    except AssertionError:
        megatron = None
    mdm.register_deepep_dispatcher()
    try:
        if megatron is None:
            with pytest.raises(ValueError, match="--cuda-graph-(modules|scope):? moe"):
                TransformerConfig(moe_token_dispatcher_type="deepep", **fields)
            return
        deepep = TransformerConfig(moe_token_dispatcher_type="deepep", **fields)
    finally:
        mdm.unregister_deepep_dispatcher()
    want = {getattr(m, "name", m) for m in getattr(megatron, _scope_field())}
    assert options.graph_scope(deepep).modules == want
    assert options.graph_scope(deepep).impl == megatron.cuda_graph_impl


@pytest.mark.parametrize("impl, scope, extra, bound, match", [
    ("local", ["moe"], {}, True, "--cuda-graph-(modules|scope) moe captures the MoE layer"),
    ("local", [], {}, False, "captures the deepep dispatch, which then must not synchronize"),
    ("local", ["attn"], {}, False, "--cuda-graph-(modules|scope) attn .* captures the deepep"),
    ("local", ["moe_router"], dict(moe_expert_capacity_factor=1.0), False,
     "moe_preprocess .* without --moe-pad-expert-input-to-capacity"),
    ("transformer_engine", ["moe_preprocess"], {}, False, "moe_preprocess needs moe_router"),
])
def test_transformer_config_names_the_graph_flag(monkeypatch, impl, scope, extra, bound, match):
    """Under the plugin, TransformerConfig itself refuses (before Megatron's bare assertions or
    a failed capture) with a message naming the flag."""
    import megatron_deepep.megatron as mdm
    from megatron.core.transformer.transformer_config import TransformerConfig

    monkeypatch.setenv("MDEEP_RANK_CAPACITY_FACTOR", "2" if bound else "")
    mdm.register_deepep_dispatcher()
    try:
        with pytest.raises(ValueError, match=match):
            TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                              num_moe_experts=8, moe_router_topk=2,
                              moe_token_dispatcher_type="deepep", cuda_graph_impl=impl,
                              **{_scope_field(): scope}, **extra)
    finally:
        mdm.unregister_deepep_dispatcher()
