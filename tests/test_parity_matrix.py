"""CPU tier: the parity matrix. The same Megatron `MoELayer` (same weights, same inputs) with
`alltoall` and with `deepep` (reference transport) gives equal outputs and equal gradients of the
input, the router and every expert weight, per Megatron option, on 2 gloo ranks (EP = 2).

Megatron-core runs on a CPU-only torch here with four stand-ins installed in the rank processes
only (none changes arithmetic): a no-op CUDA stream for the streams `alltoall` and the shared
experts create, `torch.cuda.current_device()` as "cpu" (the router moves its weight there), no
CUDA RNG state in the recompute checkpoints, and gloo's `all_to_all_single` taking split tensors
and 16-bit rows as int32 words (what NCCL takes directly).

All cases run in one 2-process job (`matrix_results`, module scope); each case is then its own
test, so the pass count is the matrix's. Options 0.16.1 cannot run on CPU (grouped GEMM and
latent projections need Transformer Engine; CUDA graphs need a GPU) are in `GPU_ONLY`.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from tests.distributed import run_distributed

pytest.importorskip("megatron.core")

H = 32
BASE = dict(num_moe_experts=8, moe_router_topk=2, moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32")
# Per rank, per micro-batch: sequence lengths (batch 2). Different per rank by default.
TOKENS = [[6, 9]]

# name -> (TransformerConfig overrides, options of the run)
CASES = {
    "fp32": ({}, {}),
    "bf16": ({}, dict(dtype="bf16")),
    "fp16": ({}, dict(dtype="fp16")),
    "topk1_pre_softmax": (dict(moe_router_topk=1, moe_router_pre_softmax=True), {}),
    "topk4": (dict(moe_router_topk=4), {}),
    "topk4_pre_softmax": (dict(moe_router_topk=4, moe_router_pre_softmax=True), {}),
    "topk8": (dict(moe_router_topk=8), {}),
    "topk8_pre_softmax": (dict(moe_router_topk=8, moe_router_pre_softmax=True), {}),
    "topk3_bf16": (dict(moe_router_topk=3), dict(dtype="bf16")),
    "sigmoid_expert_bias": (dict(moe_router_score_function="sigmoid",
                                 moe_router_enable_expert_bias=True, moe_router_topk=3,
                                 moe_router_load_balancing_type="none"), {}),
    "sigmoid_topk1": (dict(moe_router_score_function="sigmoid", moe_router_topk=1,
                           moe_router_pre_softmax=True), {}),
    "group_limited": (dict(moe_router_num_groups=4, moe_router_group_topk=2,
                           moe_router_topk=4), {}),
    "capacity_probs_drop": (dict(moe_expert_capacity_factor=1.0,
                                 moe_token_drop_policy="probs"), {}),
    "capacity_position_drop": (dict(moe_expert_capacity_factor=0.5,
                                    moe_token_drop_policy="position"), {}),
    "capacity_pad_probs": (dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs",
                                moe_pad_expert_input_to_capacity=True), dict(tokens=[[8, 8]])),
    "capacity_pad_position": (dict(moe_expert_capacity_factor=1.0,
                                   moe_token_drop_policy="position",
                                   moe_pad_expert_input_to_capacity=True),
                              dict(tokens=[[8, 8]])),
    "router_padding_for_quantization": ({}, dict(post=dict(
        moe_router_padding_for_quantization=True))),
    "shared_experts": (dict(moe_shared_expert_intermediate_size=48), {}),
    "shared_expert_overlap": (dict(moe_shared_expert_intermediate_size=48,
                                   moe_shared_expert_overlap=True), {}),
    "apply_probs_on_input": (dict(moe_apply_probs_on_input=True, moe_router_topk=1,
                                  moe_router_pre_softmax=True), {}),
    "recompute_moe": (dict(recompute_granularity="selective", recompute_modules=["moe"]), {}),
    "experts_per_rank_1": (dict(num_moe_experts=2, moe_router_topk=1,
                                moe_router_pre_softmax=True), {}),
    "micro_batches_in_flight": ({}, dict(tokens=[[6, 9], [3, 11], [7, 1]])),
    "equal_tokens": ({}, dict(tokens=[[8, 8]])),
}

# Options of the issue that need what this CPU tier lacks; tests/gpu covers the ones a GPU and
# megatron-core 0.19.2 can run.
GPU_ONLY = {
    "grouped_gemm": "TEGroupedMLP / GroupedMLP need Transformer Engine or grouped_gemm",
    "moe_latent_size": "MoELayer's latent projections are TELinear (Transformer Engine)",
    "recompute_moe_act": "Megatron allows --recompute-modules moe_act with grouped GEMM only",
    "cuda_graphs": "tests/gpu/test_parity_graphs_gpu.py",
}
# Options Megatron's own MoELayer refuses with alltoall too, so there is nothing to match; the
# dispatcher-level tests (test_megatron_dispatcher.py) cover them on the six hooks.
MEGATRON_REFUSES = {
    "zero_token_rank": "an empty micro-batch fails in MoELayer with alltoall too (a view of 0 "
                       "elements with -1); ranks with no tokens run the six hooks",
    "topk1_without_pre_softmax": "Megatron asks for --moe-router-pre-softmax at top-k 1",
}


def _install_cpu_stand_ins():
    import contextlib

    import torch.distributed as dist
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, shared_experts, token_dispatcher

    class _Stream:
        def wait_stream(self, other):
            pass

        def record_event(self):
            return self

        def synchronize(self):
            pass

    stream = _Stream()
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    shared_experts.SharedExpertMLP.stream = stream
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # 0.16.1 reads it unguarded without TE
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.zeros(1)
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    orig = dist.all_to_all_single

    def as_list(splits):
        return splits.tolist() if hasattr(splits, "tolist") else splits

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        if input.element_size() == 2:  # gloo has no 16-bit types: rows of even width
            output, input = output.view(torch.int32), input.contiguous().view(torch.int32)
        return orig(output, input, as_list(output_split_sizes), as_list(input_split_sizes),
                    group=group, async_op=async_op)

    dist.all_to_all_single = all_to_all_single


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _layer(dispatcher_type, world_size, overrides, dtype, post):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(BASE, **overrides)
    config = TransformerConfig(
        num_layers=2, hidden_size=H, ffn_hidden_size=48, moe_ffn_hidden_size=48,
        num_attention_heads=4, expert_model_parallel_size=world_size,
        moe_token_dispatcher_type=dispatcher_type, add_bias_linear=False,
        gradient_accumulation_fusion=False, params_dtype=dtype, use_cpu_initialization=True,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, **kwargs)
    for key, value in post.items():  # fields whose __post_init__ check needs TE
        setattr(config, key, value)
    mlp = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    shared = None
    if config.moe_shared_expert_intermediate_size:
        shared = ModuleSpec(module=SharedExpertMLP, submodules=mlp)
    submodules = MoESubmodules(experts=ModuleSpec(module=SequentialMLP, submodules=mlp),
                               shared_experts=shared)
    return MoELayer(config, submodules, layer_number=1)


def _run(layer, xs, grads):
    """Forwards every micro-batch, then backwards them in reverse (several in flight)."""
    outs, inputs = [], []
    for x in xs:
        xi = x.clone().requires_grad_(True)
        out, bias = layer(xi)
        assert bias is None
        outs.append(out)
        inputs.append(xi)
    for out, grad in reversed(list(zip(outs, grads))):
        (out.float() * grad.float()).sum().backward()
    params = {n: p.grad.detach().clone() for n, p in layer.named_parameters()
              if p.grad is not None}
    return [o.detach() for o in outs], [xi.grad for xi in inputs], params


def _compare(a, b, dtype):
    """(bit-equal, max abs diff, max tolerance ratio) of two tensors."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    a, b = a.float(), b.float()
    if a.numel() == 0:
        return True, 0.0, 0.0
    diff = (a - b).abs()
    ratio = (diff / (tol + tol * b.abs())).max().item()
    return torch.equal(a, b), diff.max().item(), ratio


def _case(rank, world_size, name):
    overrides, run = CASES[name]
    dtype = _DTYPES[run.get("dtype", "fp32")]
    tokens = run.get("tokens", TOKENS)
    torch.manual_seed(1234)
    theirs = _layer("alltoall", world_size, overrides, dtype, run.get("post", {}))
    ours = _layer("deepep", world_size, overrides, dtype, run.get("post", {}))
    ours.load_state_dict(theirs.state_dict())
    gen = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(seq[rank], 2, H, generator=gen).to(dtype) for seq in tokens]
    grads = [torch.randn(seq[rank], 2, H, generator=gen).to(dtype) for seq in tokens]
    ours.train()
    theirs.train()
    result = {"checks": 0, "bit_equal": 0, "max_diff": 0.0, "max_ratio": 0.0, "worst": ""}
    got = _run(ours, xs, grads)
    want = _run(theirs, xs, grads)
    pairs = [(f"out[{i}]", o, w) for i, (o, w) in enumerate(zip(got[0], want[0]))]
    pairs += [(f"input_grad[{i}]", o, w) for i, (o, w) in enumerate(zip(got[1], want[1]))]
    assert sorted(got[2]) == sorted(want[2]), (sorted(got[2]), sorted(want[2]))
    pairs += [(f"grad {n}", got[2][n], want[2][n]) for n in sorted(got[2])]
    assert any("router" in n for n in got[2]), "the router gets a gradient"
    for label, o, w in pairs:
        assert o.shape == w.shape and o.dtype == w.dtype, (label, o.shape, w.shape)
        equal, diff, ratio = _compare(o, w, dtype)
        result["checks"] += 1
        result["bit_equal"] += int(equal)
        if ratio >= result["max_ratio"]:
            result["max_ratio"], result["worst"] = ratio, label
        result["max_diff"] = max(result["max_diff"], diff)
    return result


def _worker(rank, world_size, names, out_dir):
    warnings.filterwarnings("ignore")
    _install_cpu_stand_ins()
    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps

    mdm.register_deepep_dispatcher(transport="reference")
    ps.initialize_model_parallel(expert_model_parallel_size=world_size)
    results = {}
    try:
        for name in names:
            try:
                results[name] = _case(rank, world_size, name)
            except Exception as exc:  # recorded per case; both ranks fail alike
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    finally:
        ps.destroy_model_parallel()
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def matrix_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("parity_matrix")
    run_distributed(2, _worker, list(CASES), str(out_dir), timeout_s=240)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_deepep_matches_alltoall(matrix_results, name):
    for rank, results in enumerate(matrix_results):
        result = results[name]
        assert "error" not in result, f"rank {rank}: {result['error']}"
        assert result["max_ratio"] < 1.0, (
            f"rank {rank}: {result['worst']} differs by {result['max_diff']:.3g} "
            f"({result['max_ratio']:.3g} x the tolerance)")
    if dict(BASE, **CASES[name][0])["moe_router_topk"] <= 2:
        # The same arithmetic in the same order (an expert's rows arrive ordered by source rank
        # and token with both dispatchers; a token's two terms summed once): bit-equal. With 3
        # or more terms alltoall sums them one by one in the row dtype, deepep in fp32 per EP
        # rank and then over ranks, so those agree within the dtype's tolerance.
        for results in matrix_results:
            assert results[name]["bit_equal"] == results[name]["checks"], results[name]


def test_matrix_covers_the_options_without_a_gpu():
    assert math.isfinite(len(CASES)) and set(GPU_ONLY).isdisjoint(CASES)
