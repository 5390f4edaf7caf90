"""The MoE layers `python -m megatron_deepep.bench.layer` compares, and their environment.

`VARIANTS` names every row kind (dispatcher, sync mode, CUDA graph, experts, FP8); `build_layer`
builds a variant's Megatron `MoELayer` (megatron-core 0.16 `ModuleSpec`s and the 0.17+ builders);
the sync-free rows use `megatron.grouped_experts.GroupedMMExperts` (no host counts: CUDA-graph
capturable); `init_megatron` sets up one rank at TP = EP = 1; `cpu_stand_ins` lets megatron-core
run on a CPU-only torch for `--cpu`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket

import torch
import torch.distributed as dist

from megatron_deepep.megatron.grouped_experts import (  # noqa: F401  (the layers' experts)
    GroupedMMExperts, grouped_mm_reason, with_grouped_mm_experts)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row kind.

    Attributes:
        name: the row's name (`--variants` takes these).
        table: "A" (bf16) or "B" (TE, blockwise FP8 recipe).
        dispatcher: `moe_token_dispatcher_type`.
        sync_free: the deepep row bound (`--rank-capacity-factor`).
        graph: forward + backward captured in one CUDA graph and replayed.
        grouped_mm: `GroupedMMExperts` instead of the table's experts.
        fp8_dispatch: the deepep `fp8_dispatch` option.
        fp8_experts: `te_experts.with_fp8_experts` on the TE layer spec.
        fp8_columnwise: with `fp8_experts`, how they make the wgrad's columnwise copy
            (`te_experts.COLUMNWISE_METHODS`; "": `MDEEP_FP8_COLUMNWISE`, the kernel by default).
        permute_fusion: Megatron's `moe_permute_fusion` (TE's fused permute kernels; the
            alltoall baselines run with and without it, `megatron.baselines`).
    """

    name: str
    table: str
    dispatcher: str
    sync_free: bool = False
    graph: bool = False
    grouped_mm: bool = False
    fp8_dispatch: str = "off"
    fp8_experts: bool = False
    fp8_columnwise: str = ""
    permute_fusion: bool = False

    @property
    def label(self) -> str:
        """The row's name in the table: the alltoall rows say whether TE's fused permute ran."""
        if self.dispatcher != "alltoall":
            return self.name
        from megatron_deepep.megatron import baselines

        return ("te-" if self.table == "B" else "") + baselines.label(self.permute_fusion)


VARIANTS = [
    Variant("alltoall-fused", "A", "alltoall", permute_fusion=True),
    Variant("alltoall", "A", "alltoall"),
    Variant("deepep-sync", "A", "deepep"),
    Variant("deepep-syncfree", "A", "deepep", sync_free=True),
    Variant("deepep-syncfree-gmm", "A", "deepep", sync_free=True, grouped_mm=True),
    Variant("deepep-syncfree-graph", "A", "deepep", sync_free=True, graph=True, grouped_mm=True),
    Variant("te-alltoall-fused", "B", "alltoall", permute_fusion=True),
    Variant("te-alltoall", "B", "alltoall"),
    Variant("te-deepep-bf16", "B", "deepep"),
    Variant("te-deepep-fp8-dequant", "B", "deepep", fp8_dispatch="blockwise"),
    Variant("te-deepep-fp8-experts", "B", "deepep", fp8_dispatch="blockwise", fp8_experts=True),
    Variant("te-deepep-fp8-experts-dequant-colwise", "B", "deepep", fp8_dispatch="blockwise",
            fp8_experts=True, fp8_columnwise="dequantize"),
]
BASELINE = {"A": "alltoall", "B": "te-alltoall"}
#: The fused-permute baselines, a second ratio column where they ran.
FUSED_BASELINE = {"A": "alltoall-fused", "B": "te-alltoall-fused"}


class Skip(Exception):
    """A variant that cannot run here; its message is the reason."""


# ---- environment ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_megatron(device: str) -> None:
    """One rank (world size 1), Megatron's model parallel state at TP = EP = 1, and `deepep`
    registered (the GPU tier's `megatron_env` fixture runs this too)."""
    from megatron.core import parallel_state as ps

    import megatron_deepep.megatron as mdm

    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    if device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(123)
    mdm.register_deepep_dispatcher()


def teardown() -> None:
    """Undoes `init_megatron`: Megatron's parallel state and the process group (as `bench`
    does, the deepep Buffer is left to the process's exit)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def cpu_stand_ins():
    """`--cpu` only: what megatron-core needs from CUDA on a CPU-only torch, stood in (no
    arithmetic changes; as tests/megatron/test_parity_matrix.py does): a no-op stream for the ones
    `alltoall` creates, "cpu" as the current device (the router moves its weight there), and
    megatron-core 0.16.1's unguarded `te_general_gemm` as None (through `patching`: recorded,
    so `unregister_deepep_dispatcher` undoes it). The torch stand-ins are undone on exit.
    """
    from megatron.core.transformer.moe import moe_utils

    from megatron_deepep.megatron import patching

    class _Stream:
        def wait_stream(self, other):
            pass

        def record_event(self, *args):
            return self

        def synchronize(self):
            pass

    stream = _Stream()
    saved = {k: getattr(torch.cuda, k) for k in ("Stream", "current_stream", "stream",
                                                 "current_device")}
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    if "te_general_gemm" not in vars(moe_utils):
        patching.patch_item(vars(moe_utils), "te_general_gemm", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(torch.cuda, key, value)


def autocast(enabled: bool):
    """TE's FP8 autocast under `Float8BlockScaling` (TE 2.x `autocast`, else `fp8_autocast`)."""
    if not enabled:
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8BlockScaling

    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=Float8BlockScaling())
    return te.fp8_autocast(enabled=True, fp8_recipe=Float8BlockScaling())


def te_reason() -> str:
    """Why table B cannot run here ("" if it can)."""
    from megatron_deepep.fp8 import te_bridge

    ok, reason = te_bridge.te_available()
    if not ok:
        return reason
    if not torch.cuda.is_available():
        return "TE's FP8 GEMMs need a GPU"
    import transformer_engine.pytorch as te

    block = te.is_fp8_block_scaling_available()
    if not (block[0] if isinstance(block, tuple) else block):
        return f"TE: FP8 block scaling unavailable on this GPU ({block})"
    return ""


# ---- layers --------------------------------------------------------------------------------------
def build_layer(variant: Variant, shape, device: str, experts: str, capacity_factor: float):
    """The `MoELayer` of one variant: `(layer, experts description)`."""
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    num_tokens, hidden, num_experts, topk, ffn = shape
    te_layer = variant.table == "B" or (experts == "te" and not variant.grouped_mm)
    fields = dict(
        num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn,
        num_attention_heads=8, num_moe_experts=num_experts, moe_router_topk=topk,
        moe_token_dispatcher_type=variant.dispatcher, moe_router_load_balancing_type="none",
        moe_router_dtype="fp32", add_bias_linear=False, gradient_accumulation_fusion=False,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=device == "cpu",
        moe_grouped_gemm=te_layer, moe_permute_fusion=variant.permute_fusion)
    if variant.table == "B":
        fields.update(fp8="e4m3", fp8_recipe="blockwise", moe_router_padding_for_quantization=True)
    config = TransformerConfig(**fields)
    # The deepep options of this layer, as a patched Megatron's config fields would carry them
    # (they outrank the registered defaults and MDEEP_* variables).
    config.moe_mdeep_transport = "reference" if device == "cpu" else "auto"
    config.moe_mdeep_fp8_dispatch = variant.fp8_dispatch
    if variant.sync_free:
        config.moe_mdeep_rank_capacity_factor = capacity_factor
    if te_layer:
        layer, name = te_moe_layer(config, num_experts, variant.fp8_experts)
        if variant.fp8_columnwise:  # read by FP8ColumnParallelGroupedLinear at each call
            layer.experts.linear_fc1.fp8_columnwise = variant.fp8_columnwise
            name += f" (columnwise copy: {variant.fp8_columnwise})"
    else:
        if variant.grouped_mm or experts == "grouped_mm":
            module, name = GroupedMMExperts, "GroupedMMExperts (torch._grouped_mm, device counts)"
        else:
            module, name = _sequential_experts(), "SequentialMLP"
        layer = MoELayer(config, MoESubmodules(experts=module), layer_number=1)
    layer = layer.to(device)
    _check_dispatcher(layer, variant)
    return layer, name


def te_moe_layer(config, num_experts: int, fp8_experts: bool, grouped_gemm: bool = True):
    """Megatron's MoELayer from its TE spec (TEGroupedMLP experts; `grouped_gemm=False`: TE's
    SequentialMLP), or with the FP8 experts of `te_experts.with_fp8_experts`; `(layer, experts
    class name)`, on the CPU."""
    import functools

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=True, num_experts=num_experts,
                               moe_grouped_gemm=grouped_gemm)
    if fp8_experts:
        from megatron_deepep.megatron import te_experts

        spec = te_experts.with_fp8_experts(spec)
    if isinstance(spec, functools.partial):  # megatron-core 0.17+: builders
        layer = spec(config=config, layer_number=1)
    else:
        from megatron.core.transformer.spec_utils import build_module

        layer = build_module(spec, config=config, layer_number=1)
    return layer, type(layer.experts).__name__


def _sequential_experts():
    """Megatron's `SequentialMLP` with plain parallel linears, as an experts spec."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))


def _check_dispatcher(layer, variant: Variant) -> None:
    """The layer got the dispatcher (and sync mode) the row claims."""
    dispatcher = layer.token_dispatcher
    if variant.dispatcher == "deepep":
        from megatron_deepep.megatron import DeepEPTokenDispatcher

        if not isinstance(dispatcher, DeepEPTokenDispatcher):
            raise RuntimeError(f"expected DeepEPTokenDispatcher, got {type(dispatcher).__name__}")
        sync_free = dispatcher.rank_capacity_factor is not None
        if sync_free != variant.sync_free:
            raise RuntimeError(f"dispatcher sync-free={sync_free}, row wants {variant.sync_free} "
                               f"(is MDEEP_RANK_CAPACITY_FACTOR set?)")
    elif variant.dispatcher not in type(dispatcher).__name__.lower():
        raise RuntimeError(f"expected the {variant.dispatcher} dispatcher, got "
                           f"{type(dispatcher).__name__}")


def capture_forward_backward(layer, static_x: torch.Tensor, static_g: torch.Tensor):
    """`(graph, static_out)`: `layer`'s forward on `static_x` `[N, B, H]` and the backward of
    `static_g` captured in one CUDA graph, after three warm-up runs on the capture stream
    (kernels compile, workspaces grow there); replays read `static_x`/`static_g` in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            out, _ = layer(static_x)
            out.backward(static_g)
            layer.zero_grad(set_to_none=True)
            static_x.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_out, _ = layer(static_x)
        static_out.backward(static_g)
    return graph, static_out
