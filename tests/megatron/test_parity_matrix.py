"""CPU tier: the parity matrix. The same Megatron `MoELayer` (same weights, same inputs) with
`alltoall` and with `deepep` (reference transport) gives equal outputs and equal gradients of the
input, the router and every expert weight, per Megatron option, on 2 gloo ranks (EP = 2), plus a
few other layouts (TP 2, expert TP 2 at EP 1 and at EP 2 on 4 ranks).

Megatron-core runs on a CPU-only torch here with four stand-ins installed in the rank processes
only (none changes arithmetic): a no-op CUDA stream for the streams `alltoall` and the shared
experts create, `torch.cuda.current_device()` as "cpu" (the router moves its weight there), no
CUDA RNG state in the recompute checkpoints, and gloo's `all_to_all_single` taking split tensors
and 16-bit rows as int32 words (what NCCL takes directly), and gloo's `all_gather` taking
uneven sizes and 16-bit rows (padded to the largest, as int32 words).

The cases of one layout run in one job (`matrix_results`, module scope); each case is then its
own test, so the pass count is the matrix's. Options 0.16.1 cannot run on CPU (grouped GEMM and
latent projections need Transformer Engine; CUDA graphs need a GPU) are in `GPU_ONLY`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import traceback
import warnings

import pytest
import torch

from tests.helpers.distributed import run_distributed

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
    # align: the padding an FP8 recipe asks for (get_fp8_align_size: 16). Without a recipe
    # megatron-core 0.16 pads to 16 and 0.19 to 0, where its alltoall divides by zero.
    "router_padding_for_quantization": ({}, dict(post=dict(
        moe_router_padding_for_quantization=True), align=16)),
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
    # Sync-free: a per-rank row bound (`rank_capacity_factor`), no host synchronization.
    "rank_capacity_factor": ({}, dict(post=dict(moe_mdeep_rank_capacity_factor=2.0))),
    "rank_capacity_factor_topk4_bf16": (dict(moe_router_topk=4), dict(
        dtype="bf16", post=dict(moe_mdeep_rank_capacity_factor=1.5))),
    "rank_capacity_factor_in_flight": ({}, dict(
        tokens=[[6, 9], [3, 11]], post=dict(moe_mdeep_rank_capacity_factor=4.0))),
    # A bound too small for what arrives: an error naming it (both ranks overflow).
    "rank_capacity_overflow": ({}, dict(
        tokens=[[8, 8]], post=dict(moe_mdeep_rank_capacity_factor=0.1),
        error="num_max_recv_rows=4 is too small")),
    # TP 2 with sequence parallelism, expert TP 1, EP 1: each TP rank dispatches its sequence
    # shard (a second 2-process job).
    "tp2_sequence_parallel": (dict(sequence_parallel=True, tensor_model_parallel_size=2,
                                   expert_tensor_parallel_size=1),
                              dict(parallel=(2, 2, 1, 1))),
    # Expert TP 2 (each expert's fc1/fc2 split over 2 ranks): the dispatched rows are
    # all-gathered over the expert-TP group and reduce-scattered back. EP 1 on 2 ranks (a job
    # with TP 2 and sequence parallelism, the usual expert TP = TP, and one with TP 1: each
    # rank has its own tokens), then EP 2 on 4 ranks (EP dispatch and expert TP together).
    "etp2_tp2_sequence_parallel": (dict(sequence_parallel=True, tensor_model_parallel_size=2,
                                        expert_tensor_parallel_size=2),
                                   dict(parallel=(2, 2, 1, 2))),
    "etp2_ep1": (dict(expert_tensor_parallel_size=2), dict(parallel=(2, 1, 1, 2))),
    "etp2_ep1_topk4_bf16": (dict(expert_tensor_parallel_size=2, moe_router_topk=4),
                            dict(dtype="bf16", parallel=(2, 1, 1, 2))),
    "etp2_ep1_capacity_pad": (dict(expert_tensor_parallel_size=2, moe_expert_capacity_factor=1.0,
                                   moe_token_drop_policy="probs",
                                   moe_pad_expert_input_to_capacity=True),
                              dict(parallel=(2, 1, 1, 2), tokens=[[8, 8]])),
    "etp2_ep2": (dict(expert_tensor_parallel_size=2), dict(parallel=(4, 1, 2, 2),
                                                           tokens=[[6, 9, 4, 7]])),
    "etp2_ep2_capacity_pad": (dict(expert_tensor_parallel_size=2, moe_expert_capacity_factor=1.0,
                                   moe_token_drop_policy="position",
                                   moe_pad_expert_input_to_capacity=True),
                              dict(parallel=(4, 1, 2, 2), tokens=[[8, 8, 8, 8]])),
    "etp2_ep2_shared_overlap_recompute": (
        dict(expert_tensor_parallel_size=2, moe_shared_expert_intermediate_size=48,
             moe_shared_expert_overlap=True, recompute_granularity="selective",
             recompute_modules=["moe"]),
        dict(parallel=(4, 1, 2, 2), tokens=[[6, 9, 4, 7], [3, 11, 5, 2]])),
}
# (world size, TP, EP, expert TP) of the cases without a `parallel` entry.
DEFAULT_PARALLEL = (2, 1, 2, 1)

EP_CASE = "ep2_matches_ep1"

# Options of the issue that need what this CPU tier lacks; tests/gpu covers them with a GPU,
# megatron-core 0.19.2 and TE (tests/gpu/test_parity_te_gpu.py, run by dev/gpu/gpu_te.sh).
GPU_ONLY = {
    "grouped_gemm": "TEGroupedMLP / GroupedMLP need Transformer Engine or grouped_gemm",
    "moe_latent_size": "MoELayer's latent projections are TELinear (Transformer Engine)",
    "recompute_moe_act": "Megatron allows --recompute-modules moe_act with grouped GEMM only",
    "cuda_graphs": "tests/gpu/test_parity_graphs_gpu.py, tests/gpu/test_megatron_graphs_gpu.py",
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

    if getattr(dist.all_to_all_single, "_parity_stand_in", False):
        return  # installed already in this process
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

    all_to_all_single._parity_stand_in = True
    dist.all_to_all_single = all_to_all_single
    orig_all_gather = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        rows = max(t.shape[0] for t in tensor_list)
        if all(t.shape == tensor.shape for t in tensor_list) and tensor.element_size() != 2:
            return orig_all_gather(tensor_list, tensor, group=group, async_op=async_op)

        def words(t):  # padded to `rows` rows, 16-bit rows as int32 words
            padded = t.new_zeros(rows, *t.shape[1:])
            padded[:t.shape[0]] = t
            return padded.view(torch.int32) if t.element_size() == 2 else padded

        padded = [words(t) for t in tensor_list]
        orig_all_gather(padded, words(tensor), group=group)
        for t, p in zip(tensor_list, padded):
            p = p.view(t.dtype) if t.element_size() == 2 else p
            t.copy_(p[:t.shape[0]])
        return None

    dist.all_gather = all_gather


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _layer(dispatcher_type, ep_size, overrides, dtype, post, device="cpu"):
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
        num_attention_heads=4, expert_model_parallel_size=ep_size,
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
    return MoELayer(config, submodules, layer_number=1).to(device)


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


class _BoundSpy:
    """Records the `num_max_recv_rows` every dispatch of a DeepEPTokenDispatcher passes."""

    def __init__(self, dispatcher):
        self.bounds = []
        original = dispatcher.num_max_recv_rows

        def num_max_recv_rows(num_tokens):
            bound = original(num_tokens)
            self.bounds.append(bound)
            return bound

        dispatcher.num_max_recv_rows = num_max_recv_rows


def _compare(a, b, dtype):
    """(bit-equal, max abs diff, max tolerance ratio) of two tensors."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    a, b = a.float(), b.float()
    if a.numel() == 0:
        return True, 0.0, 0.0
    diff = (a - b).abs()
    ratio = (diff / (tol + tol * b.abs())).max().item()
    return torch.equal(a, b), diff.max().item(), ratio


@contextlib.contextmanager
def _align_size(align):
    """Pins Megatron's `get_align_size_for_quantization` (where both dispatchers look it up)
    to `align` (None: left alone)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    modules = [m for m in (moe_utils, token_dispatcher)
               if hasattr(m, "get_align_size_for_quantization")]
    saved = [m.get_align_size_for_quantization for m in modules]
    try:
        if align is not None:
            for m in modules:
                m.get_align_size_for_quantization = lambda config: align
        yield
    finally:
        for m, fn in zip(modules, saved):
            m.get_align_size_for_quantization = fn


def _case(rank, ep_size, name):
    with _align_size(CASES[name][1].get("align")):
        return _case_body(rank, ep_size, name)


def _case_body(rank, ep_size, name):
    overrides, run = CASES[name]
    dtype = _DTYPES[run.get("dtype", "fp32")]
    tokens = run.get("tokens", TOKENS)
    if rank >= len(tokens[0]):
        raise ValueError(f"case {name}: no tokens for rank {rank}")
    torch.manual_seed(1234)
    theirs = _layer("alltoall", ep_size, overrides, dtype, run.get("post", {}))
    ours = _layer("deepep", ep_size, overrides, dtype, run.get("post", {}))
    ours.load_state_dict(theirs.state_dict())
    gen = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(seq[rank], 2, H, generator=gen).to(dtype) for seq in tokens]
    grads = [torch.randn(seq[rank], 2, H, generator=gen).to(dtype) for seq in tokens]
    ours.train()
    theirs.train()
    result = {"checks": 0, "bit_equal": 0, "max_diff": 0.0, "max_ratio": 0.0, "worst": ""}
    if "error" in run:
        try:
            _run(ours, xs, grads)
        except ValueError as exc:
            assert run["error"] in str(exc), str(exc)
            return dict(result, refused=str(exc)[:200])
        raise AssertionError(f"expected an error with {run['error']!r}")
    spy = _BoundSpy(ours.token_dispatcher)
    got = _run(ours, xs, grads)
    result["bounds"] = spy.bounds
    result["expert_tp"] = ours.token_dispatcher.tp_size
    attrs = ours.token_dispatcher.cudagraph_attrs
    result["cudagraph_attrs"] = list(attrs)
    assert isinstance(ours.token_dispatcher._topk_idx, torch.Tensor) and "_topk_idx" in attrs
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


def _worker(rank, world_size, layouts, out_dir):
    """Runs the cases of each `(parallel, names)` layout of this world size in turn (one spawn,
    Megatron's groups rebuilt per layout)."""
    warnings.filterwarnings("ignore")
    _install_cpu_stand_ins()
    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps

    mdm.register_deepep_dispatcher(transport="reference")
    results = {}
    for parallel, names in layouts:
        _, tp_size, ep_size, etp_size = parallel
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                     expert_model_parallel_size=ep_size,
                                     expert_tensor_parallel_size=etp_size)
        try:
            for name in names:
                try:
                    results[name] = _case(rank, ep_size, name)
                except Exception as exc:  # recorded per case; every rank fails alike
                    results[name] = {"error": f"{type(exc).__name__}: {exc}\n"
                                      f"{traceback.format_exc()[-1500:]}"}
        finally:
            ps.destroy_model_parallel()
    if any(tuple(p) == DEFAULT_PARALLEL for p, _ in layouts):
        from tests.megatron.test_parity_ep import ep_worker  # the layer at EP 2 and at EP 1

        try:
            ep_worker(rank, world_size, "fp32", "cpu", "reference")
            results[EP_CASE] = {"checks": 1}
        except Exception as exc:
            results[EP_CASE] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    with open(f"{out_dir}/world{world_size}_rank{rank}.json", "w") as f:
        json.dump(results, f)


def _parallel(name):
    """`(world size, TP, EP, expert TP)` of a case."""
    return tuple(CASES[name][1].get("parallel", DEFAULT_PARALLEL))


@pytest.fixture(scope="module")
def matrix_results(tmp_path_factory):
    """Per rank (up to the largest world): case name -> result, from one job per world size
    (its layouts in turn); a rank outside a case's world has no entry for it."""
    out_dir = tmp_path_factory.mktemp("parity_matrix")
    layouts = sorted({_parallel(n) for n in CASES}, key=lambda p: (p != DEFAULT_PARALLEL, p))
    merged = [{} for _ in range(max(p[0] for p in layouts))]
    for world in sorted({p[0] for p in layouts}):
        jobs = [(p, [n for n in CASES if _parallel(n) == p]) for p in layouts if p[0] == world]
        run_distributed(world, _worker, jobs, str(out_dir), timeout_s=240)
        for rank in range(world):
            merged[rank].update(json.loads((out_dir / f"world{world}_rank{rank}.json").read_text()))
    return merged


def _ranks_of(matrix_results, name):
    """The results of the ranks that ran `name`."""
    return [results[name] for results in matrix_results if name in results]


@pytest.mark.parametrize("name", list(CASES))
def test_deepep_matches_alltoall(matrix_results, name):
    per_rank = _ranks_of(matrix_results, name)
    assert len(per_rank) == _parallel(name)[0], (name, len(per_rank))
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}: {result['error']}"
        if "error" in CASES[name][1]:
            assert "refused" in result
            continue
        assert result["expert_tp"] == _parallel(name)[3], (name, result["expert_tp"])
        assert result["max_ratio"] < 1.0, (
            f"rank {rank}: {result['worst']} differs by {result['max_diff']:.3g} "
            f"({result['max_ratio']:.3g} x the tolerance)")
    sync_free_rows = "moe_mdeep_rank_capacity_factor" in CASES[name][1].get("post", {})
    if dict(BASE, **CASES[name][0])["moe_router_topk"] <= 2 and not sync_free_rows:
        # The same arithmetic in the same order (an expert's rows arrive ordered by source rank
        # and token with both dispatchers; a token's two terms summed once): bit-equal. With 3
        # or more terms alltoall sums them one by one in the row dtype, deepep in fp32 per EP
        # rank and then over ranks, so those agree within the dtype's tolerance. Sync-free, the
        # last expert also runs the zero rows of the bound's unused tail: its weight gradient
        # is the same sum plus zeros, blocked differently by the GEMM.
        for result in per_rank:
            assert result["bit_equal"] == result["checks"], (name, result)


def test_sync_free_cases_pass_a_row_bound(matrix_results):
    """Rank capacity factor and pad-to-capacity dispatch with a row bound (no host sync);
    the others synchronize (bound None)."""
    for name, (overrides, run) in CASES.items():
        if "error" in run or "bounds" not in matrix_results[0].get(name, {}):
            continue
        sync_free = ("moe_mdeep_rank_capacity_factor" in run.get("post", {})
                     or overrides.get("moe_pad_expert_input_to_capacity", False))
        for result in _ranks_of(matrix_results, name):
            bounds = result["bounds"]
            assert bounds and all((b is not None) == sync_free for b in bounds), (name, bounds)
    # factor 2, 12 tokens (6 x batch 2) on rank 0, top-2: ceil(2 * 12 * 2) rows.
    assert matrix_results[0]["rank_capacity_factor"]["bounds"] == [48]


def test_cudagraph_attrs_name_what_preprocess_leaves(matrix_results):
    """Megatron's `moe_preprocess` CUDA graph returns these as graph outputs."""
    assert matrix_results[0]["fp32"]["cudagraph_attrs"] == ["_topk_idx"]
    assert matrix_results[0]["shared_expert_overlap"]["cudagraph_attrs"] == [
        "_topk_idx", "shared_experts.cached_fc1_input"]


def test_layer_at_ep_2_matches_ep_1(matrix_results):
    """The deepep layer at EP = 2 equals it at EP = 1 on the same tokens and weights."""
    assert len(_ranks_of(matrix_results, EP_CASE)) == DEFAULT_PARALLEL[0]
    for rank, result in enumerate(_ranks_of(matrix_results, EP_CASE)):
        assert "error" not in result, f"rank {rank}: {result['error']}"


def test_matrix_covers_the_options_without_a_gpu(matrix_results):
    """Every case ran on some rank; an option left out is no case and says why, and the GPU
    tests GPU_ONLY points to exist."""
    ran = set().union(*matrix_results)
    assert set(CASES) <= ran, f"cases that no rank ran: {sorted(set(CASES) - ran)}"
    left_out = {**GPU_ONLY, **MEGATRON_REFUSES}
    assert len(left_out) == len(GPU_ONLY) + len(MEGATRON_REFUSES), "listed twice"
    assert set(left_out).isdisjoint(CASES), sorted(set(left_out) & set(CASES))
    assert all(reason.strip() for reason in left_out.values()), left_out
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    named = re.findall(r"tests/gpu/\w+\.py", " ".join(GPU_ONLY.values()))
    assert named and all(os.path.exists(os.path.join(root, path)) for path in named), named
