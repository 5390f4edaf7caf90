"""CPU tier: what Megatron's CUDA-graph machinery needs from the deepep dispatcher.

Megatron's partial MoE graphs end after the router (`moe_router`) or after the dispatch
preprocess (`moe_preprocess`); a replay then restores the dispatcher's `cudagraph_attrs` from
the graph's outputs and runs the rest eagerly, without running any Python of the captured part.
The contract is checked here on megatron-core's own code paths (0.19's `MoETransformerLayer`
router / expert-compute / postprocess split of the local impl; the capture signal and tensor
store of the transformer_engine impl), on one CPU rank with the reference transport: a "capture"
on input A, then one on input B (so every Python attribute of the dispatcher now describes B),
then a "replay" of A from A's graph outputs must equal an eager pass over A, output and
gradients. An attribute missing from `cudagraph_attrs` would make the replay use B's routing.

Also: the Buffer refuses a capture its transport cannot be replayed from, remembers one it can
(it may then never be replaced by a larger Buffer), and reports kernel errors at the step-end
report even when no eager call ran. The real graphs run in tests/gpu/test_megatron_graphs_gpu.py.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytest.importorskip("megatron.core")

H = 32
SHAPE = (6, 2, H)  # [S, B, H]


def _megatron_has_partial_graphs() -> bool:
    from megatron.core.transformer import transformer_layer

    layer = getattr(transformer_layer, "MoETransformerLayer", None)
    return layer is not None and hasattr(layer, "_get_token_dispatcher_attrs")


needs_019 = pytest.mark.skipif(
    not _megatron_has_partial_graphs(),
    reason="megatron-core < 0.19 has another partial-graph API (MoETransformerLayer keeps a "
           "copy of the attributes); the GPU tier runs 0.19.2")


def _config(**kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=1, hidden_size=H, ffn_hidden_size=2 * H, moe_ffn_hidden_size=2 * H,
                  num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
                  moe_token_dispatcher_type="deepep", moe_router_load_balancing_type="none",
                  moe_router_dtype="fp32", add_bias_linear=False,
                  gradient_accumulation_fusion=False, hidden_dropout=0.0,
                  attention_dropout=0.0, use_cpu_initialization=True)
    fields.update(kwargs)
    config = TransformerConfig(**fields)
    config.moe_mdeep_transport = "reference"
    return config


def _layer(config, metrics=False):
    """A MoETransformerLayer (no attention) with Megatron's SequentialMLP experts."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayerSubmodules,
    )

    if metrics:
        config.moe_mdeep_metrics = True
    experts = functools.partial(SequentialMLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    submodules = TransformerLayerSubmodules(
        pre_mlp_layernorm=LocalSpecProvider().layer_norm(has_residual=True),
        mlp=functools.partial(MoELayer, submodules=MoESubmodules(experts=experts)),
        mlp_bda=get_bias_dropout_add)
    return MoETransformerLayer(config, submodules, layer_number=1)


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _eager(layer, x, g):
    xi = x.clone().requires_grad_(True)
    out, _ = layer(xi)
    out.backward(g)
    grads = _grads(layer)
    layer.zero_grad(set_to_none=True)
    return out.detach(), xi.grad, grads


def _compare(got, want, what):
    torch.testing.assert_close(got[0], want[0], msg=f"{what}: output")
    torch.testing.assert_close(got[1], want[1], msg=f"{what}: input grad")
    assert got[2].keys() == want[2].keys(), what
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], msg=f"{what}: grad {name}")


@contextlib.contextmanager
def _megatron_on_cpu():
    import warnings

    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps
    from megatron_deepep.bench.layer_variants import cpu_stand_ins

    warnings.filterwarnings("ignore")
    ps.initialize_model_parallel()
    mdm.register_deepep_dispatcher()
    try:
        with cpu_stand_ins():
            yield
    finally:
        mdm.unregister_deepep_dispatcher()
        ps.destroy_model_parallel()


def _inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*SHAPE, generator=gen) for _ in range(4)]


def _local_partial_worker(rank, world_size, metrics):
    """0.19's local impl with moe_router / moe_preprocess, its Python path without graphs."""
    with _megatron_on_cpu():
        torch.manual_seed(7)
        graphed = _layer(_config(), metrics)
        eager = _layer(_config(), metrics)
        eager.load_state_dict(graphed.state_dict())
        dispatcher = graphed.mlp.token_dispatcher
        assert dispatcher.cudagraph_attrs == ["_topk_idx"] + (["_tokens_dropped"] if metrics
                                                               else [])
        x_a, g_a, x_b, _ = _inputs(3)
        graphed.use_partial_cudagraphs = True  # what transition_cudagraph_scope("partial") sets
        xi = x_a.clone().requires_grad_(True)
        captured_a = graphed._forward_mlp_router(xi)
        names = graphed._local_cudagraph_attr_names
        assert names == tuple(dispatcher.cudagraph_attrs), names
        graphed._forward_mlp_router(x_b.clone().requires_grad_(True))  # state now B's
        residual, hidden, probs, shared, *attrs = captured_a
        expert_out, bias = graphed._forward_mlp_expert_compute(hidden, probs, attrs)
        out = graphed._forward_mlp_postprocess(residual, expert_out, shared, bias)
        out.backward(g_a)
        got = (out.detach(), xi.grad, _grads(graphed))
        _compare(got, _eager(eager, x_a, g_a), "replay of A after B")


@needs_019
@pytest.mark.parametrize("metrics", [False, True], ids=["plain", "metrics"])
def test_local_partial_graph_replays_from_cudagraph_attrs(metrics):
    run_distributed(1, _local_partial_worker, metrics)


class _Chunk(torch.nn.Module):
    """The smallest model chunk `TECudaGraphHelper` takes: `decoder.layers`, and the DDP
    wrapper's `zero_grad_buffer` (here: the plain grads)."""

    def __init__(self, layer):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([layer])

    def zero_grad_buffer(self):
        self.zero_grad(set_to_none=True)


def _te_partial_worker(rank, world_size, modules):
    """0.19's transformer_engine impl through `TECudaGraphHelper` and `TransformerLayer`'s own
    capture / replay methods, with TE's `make_graphed_callables` stood in: its "graph" runs the
    captured region (`_te_cuda_graph_capture`, Megatron's capture flag set) on the replay's
    input, then once more on a decoy input, and returns the first outputs, as a replay returns
    outputs while the dispatcher's Python attributes still describe something else."""
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.module import GraphableMegatronModule
    from megatron.core.transformer.transformer_layer import TransformerLayer

    with _megatron_on_cpu():
        torch.manual_seed(7)
        config = _config(cuda_graph_impl="transformer_engine", cuda_graph_modules=modules)
        graphed = TransformerLayer(config, _layer(config).submodules_config, layer_number=1)
        eager = _layer(_config())
        eager.load_state_dict(graphed.state_dict())
        x_a, g_a, x_b, decoy = _inputs(5)
        captures = []

        def make_graphed_callables(callables, sample_args, **kwargs):
            (layer,), ((static_x,),) = callables, sample_args
            assert static_x.shape == SHAPE and kwargs["_order"] == [1, -1]

            def graph(x, **replay_kwargs):
                assert set(replay_kwargs) == {"is_first_microbatch"}
                cuda_graphs._set_capture_start()
                try:
                    outputs = layer._te_cuda_graph_capture(x)
                    layer._te_cuda_graph_capture(decoy.clone())
                finally:
                    cuda_graphs._set_capture_end()
                captures.append(len(outputs))
                return outputs
            return [graph]

        nmc.init_num_microbatches_calculator(0, None, SHAPE[1], SHAPE[1], 1)
        patched = dict(HAVE_TE_GRAPHS=True, make_graphed_callables=make_graphed_callables)
        saved = {k: getattr(cuda_graphs, k, None) for k in patched}
        saved_cuda = {k: getattr(torch.cuda, k) for k in ("synchronize", "empty_cache")}
        # TransformerLayer's replay-argument override only adds a zero attention mask (which
        # needs TE to import); this layer has no attention: the base class's is what runs.
        saved_args = TransformerLayer._get_te_cuda_graph_replay_args
        TransformerLayer._get_te_cuda_graph_replay_args = \
            GraphableMegatronModule._get_te_cuda_graph_replay_args
        try:
            for k, v in patched.items():
                setattr(cuda_graphs, k, v)
            torch.cuda.synchronize = torch.cuda.empty_cache = lambda *a, **k: None
            chunk = _Chunk(graphed)
            helper = cuda_graphs.TECudaGraphHelper(model=[chunk], config=config,
                                                   seq_length=SHAPE[0],
                                                   micro_batch_size=SHAPE[1])
            assert helper.flattened_callables == [graphed]
            helper.create_cudagraphs()
            assert len(graphed.cuda_graphs) == 1
            for step, (x, g) in enumerate([(x_a, g_a), (x_b, g_a)]):
                chunk.zero_grad_buffer()
                got = _eager(graphed, x, g)
                _compare(got, _eager(eager, x, g), f"{modules}: replay {step}")
        finally:
            TransformerLayer._get_te_cuda_graph_replay_args = saved_args
            for k, v in saved.items():
                setattr(cuda_graphs, k, v)
            for k, v in saved_cuda.items():
                setattr(torch.cuda, k, v)
            nmc.destroy_num_microbatches_calculator()
        # [hidden, probs, routing_map] / [hidden, probs, _topk_idx], then the residual
        assert captures == [4, 4], captures


@needs_019
@pytest.mark.parametrize("modules", [["moe_router"], ["moe_router", "moe_preprocess"]],
                         ids=["moe_router", "moe_preprocess"])
def test_te_partial_graph_replays_from_cudagraph_attrs(modules):
    run_distributed(1, _te_partial_worker, modules)


# ----------------------------------------------------------------------------------------------
# The Buffer under capture (reference transport on one gloo rank; capture stood in).

def _buffer_worker(rank, world_size):
    from megatron_deepep import buffer as buffer_module
    from megatron_deepep.buffer import check_buffers, get_buffer

    group = torch.distributed.group.WORLD
    buf = get_buffer(group, 16, 64, 2, transport="reference")
    x = torch.randn(4, 64).bfloat16()
    topk_idx = torch.tensor([[0, 1], [1, 2], [3, -1], [2, 0]])
    weights = torch.rand(4, 2)
    saved = buffer_module.is_capturing
    buffer_module.is_capturing = lambda: True
    try:
        try:
            buf.dispatch(x, topk_idx, weights, num_experts=4)
            raise AssertionError("the reference transport was captured")
        except RuntimeError as exc:
            assert "reference transport cannot run inside a CUDA-graph capture" in str(exc)
        assert not buf.captured
        try:
            get_buffer(torch.distributed.new_group([0]), 16, 64, 2, transport="reference")
            raise AssertionError("a Buffer was created inside a capture")
        except RuntimeError as exc:
            assert "cannot be created inside a CUDA-graph capture" in str(exc)
        # A transport that can be replayed: the Buffer remembers the capture.
        buf._transport.graph_capture_refusal = None
        buf.dispatch(x, topk_idx, weights, num_experts=4)
        assert buf.captured
    finally:
        buffer_module.is_capturing = saved
    assert get_buffer(group, 8, 64, 2, transport="reference") is buf  # fits: no growth
    try:
        get_buffer(group, 32, 64, 2, transport="reference")
        raise AssertionError("a captured Buffer grew")
    except ValueError as exc:
        assert "num_max_tokens_per_rank=32" in str(exc)
        assert "--moe-mdeep-num-max-tokens-per-rank" in str(exc)
    check_buffers()  # no kernel error recorded


def test_buffer_capture_guards():
    run_distributed(1, _buffer_worker)


def _kept_handle_worker(rank, world_size):
    import gc
    import weakref

    from megatron_deepep.autograd import combine, dispatch
    from megatron_deepep.buffer import Buffer

    buf = Buffer(None, 8, 32, 2, transport="reference")  # fp32 rows of 16
    x = torch.randn(4, 16, requires_grad=True)
    probs = torch.rand(4, 2, requires_grad=True)
    topk_idx = torch.tensor([[0, 1], [1, -1], [2, 3], [3, 0]])
    recv_x, recv_w, handle = dispatch(buf, x, topk_idx, probs * 1, num_experts=4)
    out = combine(buf, recv_x * recv_w.unsqueeze(1), handle)
    node = weakref.ref(recv_w.grad_fn)
    out.sum().backward()
    gc_enabled = gc.isenabled()
    gc.disable()  # as during Megatron's and TE's captures: only reference counts free it
    try:
        del recv_x, recv_w, out
        assert node() is None, "the kept handle keeps the step's autograd graph alive"
    finally:
        if gc_enabled:
            gc.enable()
    assert not handle.recv_weights.requires_grad
    assert x.grad is not None and probs.grad is not None


def test_kept_handle_holds_no_autograd_graph():
    """The dispatcher keeps the last handle past the step's backward: it must not keep that
    step's autograd graph (its parameters' AccumulateGrad nodes carry the stream they were made
    on; one made on the legacy default stream in an eager step fails a later capture with
    "operation would make the legacy stream depend on a capturing blocking stream")."""
    run_distributed(1, _kept_handle_worker)


def test_which_transports_a_graph_can_replay():
    """The kernel transports keep their epochs on the device (`transport/epochs.py`); the
    reference one exchanges split sizes on the host."""
    from megatron_deepep.transport import internode, local, nvlink, reference

    for cls in (local.LocalTransport, nvlink.NVLinkTransport, internode.InternodeTransport):
        assert cls.graph_capture_refusal is None, cls.__name__
    assert "host" in reference.ReferenceTransport.graph_capture_refusal


def test_step_end_report_checks_buffer_errors(monkeypatch):
    """Megatron's step-end MoE report (our hook) raises a kernel error recorded during graph
    replays, which make no eager call that would."""
    from megatron_deepep import buffer as buffer_module
    from megatron_deepep.megatron import metrics

    def broken():
        raise ValueError("num_max_recv_rows=4 is too small")

    monkeypatch.setattr(buffer_module, "check_buffers", broken)
    with pytest.raises(ValueError, match="num_max_recv_rows=4 is too small"):
        metrics._flush_collector([], (), {})


# ----------------------------------------------------------------------------------------------
# What the GPU graph tests rely on: their norm, and the stream our backward kernels go to.

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_norm_matches_torch_layer_norm(dtype):
    from tests.helpers.graph_norm import SavedInputLayerNorm

    torch.manual_seed(0)
    ours, want = SavedInputLayerNorm(None, H, eps=1e-5), torch.nn.LayerNorm(H, eps=1e-5)
    with torch.no_grad():
        for module in (ours, want):
            module.weight.copy_(torch.linspace(0.5, 1.5, H))
            module.bias.copy_(torch.linspace(-0.1, 0.1, H))
    ours, want = ours.to(dtype), want.to(dtype)
    x, g = torch.randn(*SHAPE).to(dtype), torch.randn(*SHAPE).to(dtype)
    results = []
    for module in (ours, want):
        xi = x.clone().requires_grad_(True)
        out = module(xi)
        out.backward(g)
        results.append((out, xi.grad, module.weight.grad, module.bias.grad))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, expected, what in zip(results[0], results[1], ("out", "x", "weight", "bias")):
        torch.testing.assert_close(got, expected, msg=what, **tol)


@needs_019
def test_graph_norm_input_is_kept_for_the_backward_capture():
    """Megatron's local graphs keep an input buffer until the backward capture only when a
    Python save_for_backward saw it (tests/helpers/graph_norm.py says why the GPU tests need
    that)."""
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    from tests.helpers.graph_norm import SavedInputLayerNorm

    x = torch.randn(*SHAPE, requires_grad=True)
    _CudagraphGlobalRecord._enable_saved_tensors_observer()
    try:
        SavedInputLayerNorm(None, H)(x)
    finally:
        _CudagraphGlobalRecord._disable_saved_tensors_observer()
    assert x.cg_buffer_metadata.is_saved_for_backward


def test_backward_thread_launches_on_its_own_current_stream(monkeypatch):
    """Autograd runs a CUDA backward in its own thread, whose current torch stream it sets to
    the forward's (the capture stream under a graph). Kernels launched there go on that
    thread's current torch stream, not on a stream another thread picked with `ops.launch_on`
    (thread-local) and not on the legacy default stream."""
    import threading

    from megatron_deepep import ops
    from megatron_deepep.kernels import jit

    def current_raw_stream(device):  # torch's per-thread current stream, stood in
        return 1000 + threading.get_ident() % 1000

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", current_raw_stream, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    seen = {}

    def backward_thread():
        seen["launch"] = ops.launch_stream().cuda_stream
        seen["want"] = current_raw_stream(0)

    with ops.launch_on(jit.RawStream(7, 0)):  # the forward thread's comm stream
        thread = threading.Thread(target=backward_thread)
        thread.start()
        thread.join()
        assert ops.launch_stream().cuda_stream == 7
    assert seen["launch"] == seen["want"] != 0
