"""GPU tier: the deepep MoE layer under Megatron's own CUDA-graph machinery.

megatron-core 0.19.2, one process at EP = 1 (the local kernels), and whole-layer graphs at
EP = 2 (two processes sharing the GPU, the NVLink kernels, whose protocol epochs live in device
words). Each case builds one Megatron transformer layer whose MLP is a `MoELayer` with
`--moe-token-dispatcher-type deepep` twice, with the same weights: once with a CUDA-graph
configuration, once without, and runs both for `STEPS` training steps on fresh inputs (the
eager twin's calls go through the same Buffer between the replays), driving the graphed one as
Megatron's training loop drives its graph managers:

* `--cuda-graph-impl local` (`CudaGraphManager`): the first step records (eager); the schedule's
  `create_cudagraphs()` at the end of each step captures after that first one (each graph after
  `cuda_graph_warmup_steps` warm-ups); later steps replay. Weight gradients are added to
  `param.main_grad` inside the graphs (Megatron's DDP buffers), so every parameter gets one
  here. The MoE scopes act on `MoETransformerLayer` (the local impl splits it into a router
  graph, which ends after the dispatch preprocess, the eager dispatch / experts / combine, and
  a postprocess graph; `moe` and whole-layer graphs capture all of it); `attn` is run on a GPT
  `TransformerLayer` with attention, which the local impl then graphs whole, its MoE included.
* `--cuda-graph-impl transformer_engine` (`TECudaGraphHelper` over a one-layer model chunk, TE's
  `make_graphed_callables`): `cuda_graph_warmup_steps` eager steps, `create_cudagraphs()`, then
  replays. Needs Transformer Engine (marked `te`; skipped without it).

Every case runs on a side stream, as megatron.training runs graphed training (the eager
steps' autograd nodes a capture reuses must not be on the legacy default stream), and builds its
norms from `tests/helpers/graph_norm.py` (they save the layer input where the local graphs see it;
with
`torch.nn.LayerNorm` the local impl, TE installed, frees the graph's input buffer before the
backward capture, and every replayed backward reads a clobbered input).

Dispatch modes: "pad" (capacity factor 1, `--moe-pad-expert-input-to-capacity`, Megatron's
SequentialMLP), "rank" (`--moe-expert-rank-capacity-factor 2`: sync-free with device counts, so
the experts are `megatron.grouped_experts.GroupedMMExperts`; SequentialMLP / TEGroupedMLP read the
counts
on the host), "sync" (no bound: only scopes that end before the dispatch). Every step compares
the output, the input gradient and every parameter's gradient (norm, router, experts) with the
eager layer. The test also checks that graphs were made and which dispatcher hooks still ran in
Python during replays: none that a graph holds, the dispatch exactly where
`options.graph_captures_dispatch` says it is not captured.

Run: `bash dev/gpu/gpu_graphs.sh` (installs the megatron-core and TE wheels from .whl/).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import pytest
import torch

pytestmark = pytest.mark.gpu

logger = logging.getLogger(__name__)

H, SEQ, MBS = 256, 64, 2
NUM_EXPERTS, TOPK = 8, 2
STEPS = 5
WARMUP_STEPS = 2  # cuda_graph_warmup_steps
TE_IMPL = "transformer_engine"

MODES = {
    "pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                moe_token_drop_policy="probs"),
    "rank": dict(moe_expert_rank_capacity_factor=2.0),
    "sync": {},
}

# (cuda_graph_modules, mode, layer): "moe" = MoETransformerLayer, "gpt" = TransformerLayer,
# both without attention; "gpt_attn" = TransformerLayer with Megatron's local attention;
# "gpt_te" = TransformerLayer with TENorm and TEGroupedMLP experts.
LOCAL_CASES = [
    ([], "rank", "moe"),
    ([], "pad", "moe"),
    (["moe"], "pad", "moe"),
    (["moe_router"], "sync", "moe"),
    (["moe_router", "moe_preprocess"], "rank", "moe"),
    (["attn"], "rank", "gpt_attn"),
]
TE_CASES = [
    ([], "rank", "gpt"),
    ([], "pad", "gpt"),
    (["moe"], "pad", "gpt"),
    (["moe"], "pad", "gpt_te"),
    (["moe_router"], "sync", "gpt"),
    (["moe_router", "moe_preprocess"], "sync", "gpt"),
    (["moe_router", "moe_preprocess"], "rank", "gpt"),
]


def _case_id(case):
    modules, mode, layer = case
    return f"{'+'.join(modules) or 'whole_layer'}-{mode}-{layer}"


def _te_reason() -> str:
    """Why the transformer_engine impl cannot run here ("" if it can)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # not installed, or its extension does not load
        return f"needs Transformer Engine ({type(exc).__name__}: {exc})"[:300]
    from megatron.core.transformer import cuda_graphs

    if not cuda_graphs.HAVE_TE_GRAPHS:
        return "megatron-core found no TE graph API (transformer_engine.pytorch.graph)"
    return ""


@pytest.fixture(scope="module")
def megatron_env(megatron_env):
    """The shared one (tests/gpu/conftest.py), on megatron-core 0.19+, transport auto."""
    from megatron.core.transformer import enums

    if not hasattr(enums, "CudaGraphModule"):
        pytest.skip("needs megatron-core 0.19+ (CudaGraphModule; dev/gpu/gpu_graphs.sh "
                    "installs the 0.19.2 wheel from .whl/)")
    import megatron_deepep.megatron as mdm

    mdm.register_deepep_dispatcher(transport="auto")
    yield


@contextlib.contextmanager
def _graph_state(impl):
    """Megatron's global graph state for one case: a side stream and a graph-safe RNG tracker
    (what megatron.training sets up for CUDA graphs), the micro-batch calculator
    TECudaGraphHelper reads; everything reset afterwards."""
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import cuda_graphs

    # A side stream, as megatron.training runs graphed training (initialize.py sets one for the
    # transformer_engine impl, CudaGraphManager.__init__ for the local one): the eager steps'
    # autograd nodes that a capture reuses (parameters' AccumulateGrad) must not be on the
    # legacy default stream ("operation would make the legacy stream depend on a capturing
    # blocking stream").
    torch.cuda.set_stream(torch.cuda.Stream())
    model_parallel_cuda_manual_seed(123, te_rng_tracker=impl == TE_IMPL,
                                    use_cudagraphable_rng=impl == "local", force_reset_rng=True)
    if impl == TE_IMPL:
        nmc.init_num_microbatches_calculator(0, None, MBS, MBS, 1)
    try:
        yield
    finally:
        torch.cuda.synchronize()
        cuda_graphs._set_capture_end()
        cuda_graphs._set_warmup_end()
        if impl == "local":
            cuda_graphs.delete_cuda_graphs()
        else:
            nmc.destroy_num_microbatches_calculator()
        torch.cuda.set_stream(torch.cuda.default_stream())
        model_parallel_cuda_manual_seed(123, force_reset_rng=True)


def _config(impl, modules, mode, layer_kind, ep=1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, ffn_hidden_size=2 * H, moe_ffn_hidden_size=2 * H,
        expert_model_parallel_size=ep,
        num_attention_heads=4, num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK,
        moe_token_dispatcher_type="deepep", moe_router_load_balancing_type="none",
        moe_router_dtype="fp32", add_bias_linear=False, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, bf16=True,
        moe_grouped_gemm=layer_kind == "gpt_te", cuda_graph_impl=impl,
        cuda_graph_modules=list(modules), cuda_graph_warmup_steps=WARMUP_STEPS, **MODES[mode])


def _layer(config, mode, layer_kind):
    """The transformer layer of one case (see the module docstring), on the GPU."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from megatron_deepep.megatron.grouped_experts import GroupedMMExperts
    from tests.helpers.graph_norm import SavedInputLayerNorm

    if layer_kind == "gpt_te":
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

        submodules = TransformerLayerSubmodules(
            pre_mlp_layernorm=TENorm, mlp_bda=get_bias_dropout_add,
            mlp=get_moe_module_spec(use_te=True, num_experts=NUM_EXPERTS, moe_grouped_gemm=True))
    else:
        experts = GroupedMMExperts if mode == "rank" else functools.partial(
            SequentialMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                    linear_fc2=RowParallelLinear))
        mlp = functools.partial(MoELayer, submodules=MoESubmodules(experts=experts))
        if layer_kind == "gpt_attn":
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

            submodules = get_gpt_layer_local_submodules(num_experts=NUM_EXPERTS)
            submodules.mlp = mlp
            # The local spec's norms, saving their input where the local graphs see it (the
            # input norm reads the graph's input buffer in its backward;
            # tests/helpers/graph_norm.py).
            submodules.input_layernorm = SavedInputLayerNorm
            submodules.pre_mlp_layernorm = SavedInputLayerNorm
        else:
            submodules = TransformerLayerSubmodules(
                pre_mlp_layernorm=SavedInputLayerNorm, mlp=mlp, mlp_bda=get_bias_dropout_add)
    cls = MoETransformerLayer if layer_kind == "moe" else TransformerLayer
    # bf16 parameters everywhere (the local LayerNorm builds fp32 ones), as Megatron's
    # Float16Module casts the model in training.
    return cls(config, submodules, layer_number=1).cuda().bfloat16()


def _twins(impl, modules, mode, layer_kind, ep=1):
    """`(graphed layer, eager layer with the same weights, the graphed layer's config)`."""
    from megatron_deepep.megatron import DeepEPTokenDispatcher

    config = _config(impl, modules, mode, layer_kind, ep)
    graphed = _layer(config, mode, layer_kind)
    eager = _layer(_config("none", [], mode, layer_kind, ep), mode, layer_kind)
    eager.load_state_dict(graphed.state_dict())
    for layer in (graphed, eager):
        assert isinstance(layer.mlp.token_dispatcher, DeepEPTokenDispatcher)
    return graphed, eager, config


class _Chunk(torch.nn.Module):
    """The smallest model chunk TECudaGraphHelper takes: `decoder.layers`, and the DDP
    wrapper's `zero_grad_buffer` (here the plain grads: TE's warm-up leaves some)."""

    def __init__(self, layer):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([layer])

    def zero_grad_buffer(self):
        _zero_grads(self)


class _CallCounter:
    """Counts the Python calls of one dispatcher hook (an instance attribute shadows it)."""

    def __init__(self, dispatcher, name):
        self.calls = 0
        original = getattr(dispatcher, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        setattr(dispatcher, name, counted)


def _zero_grads(module):
    for p in module.parameters():
        p.grad = None
        if hasattr(p, "main_grad"):
            p.main_grad.zero_()


def _grads(module):
    """Every parameter's gradient in fp32: `main_grad` (what graphs accumulate into) plus
    `.grad` (what eager autograd and TE's graphs set); zeros for none."""
    grads = {}
    for name, p in module.named_parameters():
        g = torch.zeros_like(p, dtype=torch.float32)
        if hasattr(p, "main_grad"):
            g += p.main_grad
        if p.grad is not None:
            g += p.grad.float()
        grads[name] = g
    return grads


def _step(layer, x, grad_out):
    """One forward + backward; the output is read before the backward, as a training step
    reads its loss (a graph's output buffer may be another graph's memory afterwards)."""
    xi = x.clone().requires_grad_(True)
    out, _ = layer(xi)
    out_value = out.detach().float().clone()
    out.backward(grad_out)
    torch.cuda.synchronize()
    return out_value, xi.grad.float().clone(), _grads(layer)


def _close(got, want, what):
    """Within bf16 rounding of the eager result (same kernels; the combine's fp32 sums may add
    in another order)."""
    scale = max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= 2e-2 * scale, f"{what}: max |graphed - eager| = {err:.3g} (scale {scale:.3g})"


def _compare(got, want, step):
    _close(got[0], want[0], f"step {step}: output")
    _close(got[1], want[1], f"step {step}: input grad")
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        _close(got[2][name], want[2][name], f"step {step}: grad {name}")


def _inputs(seed=11):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(SEQ, MBS, H, device="cuda", generator=gen).bfloat16(),
             torch.randn(SEQ, MBS, H, device="cuda", generator=gen).bfloat16())
            for _ in range(STEPS)]


def _expected_python_calls(config):
    """`(token_dispatch, dispatch_preprocess)` Python calls per replayed step."""
    from megatron_deepep.megatron import options

    captured = options.graph_captures_dispatch(config) is not None
    preprocess_in_graph = captured or "moe_preprocess" in options.graph_scope(config).modules
    return int(not captured), int(not preprocess_in_graph)


def _grouped_mm_skip(mode, layer_kind):
    from megatron_deepep.megatron.grouped_experts import grouped_mm_reason

    if mode == "rank" and layer_kind != "gpt_te":
        reason = grouped_mm_reason("cuda")
        if reason:
            pytest.skip(reason)


def _run(impl, modules, mode, layer_kind, ep=1, seed=11):
    """Runs one case; returns the graphed layer's dispatcher."""
    from megatron.core.transformer import cuda_graphs

    from megatron_deepep.buffer import check_buffers

    torch.manual_seed(3)
    graphed, eager, config = _twins(impl, modules, mode, layer_kind, ep)
    dispatcher = graphed.mlp.token_dispatcher
    if impl == "local":
        for p in graphed.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        managers = [m for m in graphed.modules() if isinstance(m, cuda_graphs.CudaGraphManager)]
        assert managers, f"local impl with {modules}: the layer made no CudaGraphManager"
        first_replay = 1
    else:
        chunk = _Chunk(graphed)
        helper = cuda_graphs.TECudaGraphHelper(model=[chunk], config=config, seq_length=SEQ,
                                               micro_batch_size=MBS)
        assert helper.flattened_callables == [graphed]
        first_replay = WARMUP_STEPS
    want_dispatch, want_preprocess = _expected_python_calls(config)
    outputs = []
    try:
        for step, (x, grad_out) in enumerate(_inputs(seed)):
            if impl == TE_IMPL and step == WARMUP_STEPS:  # as megatron.training's train()
                helper.create_cudagraphs()
                assert len(graphed.cuda_graphs) == 1
            if step == first_replay:
                dispatch_calls = _CallCounter(dispatcher, "token_dispatch")
                preprocess_calls = _CallCounter(dispatcher, "dispatch_preprocess")
            if impl == TE_IMPL:  # the schedule's forward_step: which graph replays
                cuda_graphs.set_current_microbatch(chunk, 0)
            _zero_grads(graphed)
            got = _step(graphed, x, grad_out)
            if impl == "local":
                cuda_graphs.create_cudagraphs()  # the end of every forward_backward_* schedule
            want = _step(eager, x, grad_out)
            _zero_grads(eager)
            _compare(got, want, step)
            outputs.append(got[0])
            logger.info("%s %s %s %s step %d matches eager", impl, modules, mode, layer_kind,
                        step)
        replays = STEPS - first_replay
        assert dispatch_calls.calls == want_dispatch * replays, (
            f"token_dispatch ran {dispatch_calls.calls} times in Python over {replays} "
            f"replayed steps, expected {want_dispatch} a step")
        assert preprocess_calls.calls == want_preprocess * replays, (
            f"dispatch_preprocess ran {preprocess_calls.calls} times in Python over {replays} "
            f"replayed steps, expected {want_preprocess} a step")
        if impl == "local":
            assert cuda_graphs._CudagraphGlobalRecord.cudagraph_created
            for manager in managers:
                assert manager.cudagraph_runners
                for runner in manager.cudagraph_runners:
                    assert runner.fwd_graph is not None and runner.bwd_graph is not None
        if want_dispatch == 0:
            assert dispatcher._sync_free and dispatcher._buffer.captured
        assert not torch.equal(outputs[-1], outputs[-2])  # replays read their own inputs
        check_buffers()  # no kernel error (e.g. a row bound overflow) during the replays
    finally:
        if impl == TE_IMPL and helper.graphs_created():
            helper.delete_cuda_graphs()
    return dispatcher


@pytest.mark.parametrize("case", LOCAL_CASES, ids=_case_id)
def test_local_cuda_graphs_replay_like_eager(megatron_env, case):
    modules, mode, layer_kind = case
    _grouped_mm_skip(mode, layer_kind)
    with _graph_state("local"):
        _run("local", modules, mode, layer_kind)


@pytest.mark.te
@pytest.mark.parametrize("case", TE_CASES, ids=_case_id)
def test_transformer_engine_cuda_graphs_replay_like_eager(megatron_env, case):
    reason = _te_reason()
    if reason:
        pytest.skip(reason)
    modules, mode, layer_kind = case
    _grouped_mm_skip(mode, layer_kind)
    with _graph_state(TE_IMPL):
        _run(TE_IMPL, modules, mode, layer_kind)


def _ep_worker(rank, world, impl):
    """One EP rank (all ranks share GPU 0; gloo is the control plane, the NVLink kernels move
    the rows): a whole-layer graph with a rank capacity factor against its eager twin."""
    import warnings

    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps

    from tests.megatron.test_parity_ep import _drop_buffers

    warnings.filterwarnings("ignore")
    torch.cuda.set_device(0)
    mdm.register_deepep_dispatcher(transport="auto")
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        with _graph_state(impl):
            dispatcher = _run(impl, [], "rank", "gpt", ep=world, seed=11 + rank)
        assert dispatcher._buffer.transport_name == "nvlink", dispatcher._buffer.transport_name
    finally:
        _drop_buffers()  # collective: every rank frees its NVLink buffer
        ps.destroy_model_parallel()


@pytest.mark.parametrize("impl", ["local", TE_IMPL])
def test_whole_layer_graphs_at_ep_2(megatron_env, impl):
    """Two processes sharing the GPU: the whole layer (dispatch and combine over the NVLink
    kernels) captured by Megatron's manager, replayed with the eager twin's calls between."""
    from tests.helpers.distributed import run_distributed

    _grouped_mm_skip("rank", "gpt")
    if impl == TE_IMPL and _te_reason():
        pytest.skip(_te_reason())
    run_distributed(2, _ep_worker, impl, timeout_s=300)
