#!/usr/bin/env python3
"""Trains the tiny GPT-MoE N steps with `deepep` and with `alltoall` from one seed; compares.

    python examples/compare_dispatchers.py --steps 50        # 1 GPU, EP=1; runs/compare_out
    torchrun --nproc-per-node 8 examples/compare_dispatchers.py --steps 50       # EP = 8
    python examples/compare_dispatchers.py --fp8-dispatch blockwise_1x128 --steps 200
    python examples/compare_dispatchers.py --plot-only runs/compare_out/step_times.json  # no GPU
    python examples/compare_dispatchers.py --steps 20 --profile-steps 3   # + torch.profiler tables
    torchrun --nproc-per-node 2 examples/compare_dispatchers.py --cpu     # no GPU: 2 gloo ranks
    torchrun --nproc-per-node 2 examples/compare_dispatchers.py --cpu --metrics-dir m -- \
        --num-experts 64 --moe-router-topk 8 --moe-router-num-groups 8 --moe-router-group-topk 4

Megatron flags after `--` build that model instead of the default one
(`examples/megatron_flags.py`: config fields, sizes, our `--moe-mdeep-*` options; what has no
meaning here is dropped with one line naming it, an unknown flag is refused). `--metrics-dir`
turns on the dispatcher's per-layer metrics for the deepep runs and writes their JSON lines
there (`python -m megatron_deepep.tools.report DIR` renders them), as do `MDEEP_METRICS=1
MDEEP_METRICS_DIR=DIR`.

`--cpu` (what `bash examples/run_gpt_moe.sh` runs on a machine without a GPU) trains a smaller
GPT-MoE (2 layers, hidden 128, 4 experts) on the CPU over gloo, `deepep` on the pure-torch
reference transport beside Megatron's `alltoall`, each in a fresh process per rank as on the GPU
(oneDNN's per-shape bf16 GEMM kernels play the part of cuBLAS's heuristics: a second run in the
same process found them built and ran ~25 ms per step faster), twice in alternating order
(`--rounds 2`: deepep, alltoall, alltoall, deepep; on a shared CPU a load that changes during
the comparison would otherwise weigh on one run alone), and prints the two loss curves side by
side. Megatron-core's modules put their buffers on
`torch.cuda.current_device()` and its `alltoall` dispatcher copies counts on a CUDA side stream:
`--cpu` maps both to the CPU in this process (`allow_megatron_on_cpu`).

Runs (`--dispatchers`, default `deepep,alltoall-fused,alltoall`): `deepep`, Megatron's `alltoall`
with Transformer Engine's fused permute (`alltoall-fused`: `moe_permute_fusion=True`, labelled
"alltoall (fused permute)") and without it (`alltoall`, "alltoall (unfused)"), so that deepep is
measured against the faster of Megatron's own two. Without TE (or without a GPU) the fused run
is skipped, and the summary says why (`skipped`).

`--fp8-dispatch FORMAT` compares `deepep` with FP8 dispatch (FORMAT on the wire; the local spec's
experts get bf16 rows dequantized on the receiver) against `deepep` with bf16 dispatch instead of
`deepep` against `alltoall`, and adds the max / mean relative loss difference per step (with
`--cpu` the reference transport quantizes and dequantizes the rows in torch).

Needs only megatron-core (not megatron.training, which 0.16's wheel lacks): GPTModel with the
local (non-TE) layer spec, 4 layers, hidden 512, 8 experts, top-2, aux loss, bf16, random
tokens from a fixed seed, AdamW. Both runs start from identical weights and see identical
batches, each in a fresh process (`--same-process` to share one): with one seed the expert GEMM
shapes repeat, and a second run in the same process would find cuBLAS's per-shape heuristics
already warm (that made whichever run came second ~25 ms per step faster). Writes (rank 0)
`loss_curves.png` (both curves) and `step_times.json` (median step time per run, the per-step
losses, and the max absolute / max and mean relative loss difference).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_flags  # noqa: E402  (examples/megatron_flags.py, beside this file)
from megatron_deepep.fp8.dispatch import names as fp8_names  # noqa: E402
from megatron_deepep.logs import quiet_known_noise  # noqa: E402

quiet_known_noise()  # before megatron-core is imported (megatron_deepep.logs.KNOWN_NOISE)


#: Sizes of the GPU runs and of the `--cpu` demonstration (an option left unset takes these).
GPU_DEFAULTS = dict(steps=50, seq_length=512, micro_batch_size=4, num_layers=4, hidden_size=512,
                    num_experts=8, vocab_size=8192, lr=3e-4, motifs=0, rounds=1)
CPU_DEFAULTS = dict(steps=20, seq_length=128, micro_batch_size=2, num_layers=2, hidden_size=128,
                    num_experts=4, vocab_size=1024, lr=3e-3, motifs=4, rounds=2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true",
                   help="train on the CPU over gloo (deepep on the reference transport); "
                        "smaller defaults: " + ", ".join(f"{k}={v}" for k, v in
                                                         CPU_DEFAULTS.items()))
    p.add_argument("--steps", type=int, default=None, help="training steps per run (50)")
    p.add_argument("--warmup-steps", type=int, default=5, help="left out of the median time")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="output folder (rank 0 writes there; default runs/compare_out in the "
                        "repository, which git ignores)")
    p.add_argument("--metrics-dir", default=None,
                   help="per-layer dispatcher metrics of the deepep runs, one JSON line per step "
                        "(a second deepep run writes into a subfolder named after it)")
    p.add_argument("--name", default=None,
                   help="what the run is called in its messages and plot (e.g. a model family)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per sequence (512)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per rank (4)")
    p.add_argument("--num-layers", type=int, default=None, help="transformer layers (4)")
    p.add_argument("--hidden-size", type=int, default=None, help="hidden size (512)")
    p.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (8)")
    p.add_argument("--topk", type=int, default=2, help="experts per token")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (8192)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (3e-4)")
    p.add_argument("--motifs", type=int, default=None,
                   help="distinct 16-token motifs the sequences repeat (0: a fresh random motif "
                        "per sequence, learned only in context; a few: learned within steps)")
    p.add_argument("--seed", type=int, default=1234, help="weights and data seed")
    p.add_argument("--dispatchers", default="deepep,alltoall-fused,alltoall",
                   help="runs to compare (ignored with --fp8-dispatch): deepep, alltoall-fused "
                        "(Megatron's alltoall with TE's fused permute), alltoall (unfused)")
    p.add_argument("--fp8-dispatch", default=None, choices=FP8_CHOICES,
                   help="compare deepep with this FP8 dispatch format against bf16 deepep")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the timed steps, profile this many more per run (torch.profiler; "
                        "writes profile_<run>.txt: top ops by host and by GPU time)")
    p.add_argument("--same-process", action="store_true",
                   help="train every run in this process (default: each in a fresh process, "
                        "so none inherits the kernel and GEMM-heuristic caches warmed by the "
                        "one before: with the same seed the expert GEMM shapes repeat)")
    p.add_argument("--rounds", type=int, default=None,
                   help="fresh-process rounds of every run, each round in the reverse order of "
                        "the one before (deepep, alltoall, alltoall, deepep: a load that drifts "
                        "during the comparison weighs on both); the median step pools every "
                        "round's timed steps, the losses are the first round's (1 on GPUs, 2 "
                        "with --cpu)")
    p.add_argument("--only-run", default=None, help=argparse.SUPPRESS)  # a child's one run
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)  # ... in this round
    p.add_argument("--plot-only", default=None, metavar="JSON",
                   help="redraw loss_curves.png from a step_times.json (no GPU needed)")
    argv = list(sys.argv[1:] if argv is None else argv)
    model_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    args.model_flags = model_flags
    args.flags = megatron_flags.MegatronFlags()
    if model_flags:
        try:
            args.flags = megatron_flags.parse(model_flags, cpu=args.cpu)
        except megatron_flags.FlagError as exc:
            if int(os.environ.get("RANK", "0")) != 0:  # one rank says it, not every rank
                raise SystemExit(2) from None
            p.error(str(exc))
        for key, value in args.flags.args.items():
            if key in ("topk", "seed") or getattr(args, key) is None:
                setattr(args, key, value)
    for key, value in (CPU_DEFAULTS if args.cpu else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "runs", "compare_out")
#: The FP8 formats and their flag names (`fp8.dispatch.names()`, less "off" and "auto").
FP8_CHOICES = [name for name in fp8_names() if name not in ("off", "auto")]
FP8_SUFFIX = "+fp8:"


def run_names(args):
    """The runs to compare: `deepep` and `deepep+fp8:<format>` with --fp8-dispatch."""
    if args.fp8_dispatch:
        return ["deepep", "deepep" + FP8_SUFFIX + args.fp8_dispatch]
    return args.dispatchers.split(",")


def plan_runs(args):
    """`(runs, skipped)`: the runs of `run_names` that can run here, and `{run: reason}` for
    those that cannot (the fused-permute alltoall without TE or a GPU)."""
    from megatron_deepep.megatron import baselines

    runs, skipped = [], {}
    for name in run_names(args):
        fused = baselines.split_run(name.partition(FP8_SUFFIX)[0])[1]
        reason = baselines.permute_fusion_reason("cpu" if args.cpu else "cuda") if fused else ""
        if reason:
            skipped[name] = reason
        else:
            runs.append(name)
    return runs, skipped


def run_label(name: str) -> str:
    """A run's label in the summary: the alltoall runs say whether TE's fused permute ran."""
    from megatron_deepep.megatron import baselines

    return baselines.ALLTOALL_RUNS.get(name, (name,))[0]


def init_distributed(cpu: bool = False):
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    if cpu:
        dist.init_process_group("gloo")
    else:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())


def allow_megatron_without_te() -> None:
    """megatron-core 0.16's router names `te_general_gemm` without defining it when Transformer
    Engine is missing (a NameError at the first MoE forward); defines it as None (unused)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _HostStream:
    """Stands in for `torch.cuda.Stream` in a process without CUDA: work is already ordered."""

    def __new__(cls, *args, **kwargs):
        return _HOST_STREAM

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _HostEvent()

    def synchronize(self):
        pass


class _HostEvent:
    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


_HOST_STREAM = object.__new__(_HostStream)


def allow_megatron_on_cpu() -> None:
    """Lets megatron-core's GPT-MoE train on the CPU in this process (which uses no CUDA).

    Megatron-core allocates on `torch.cuda.current_device()`, forks the CUDA RNG tracker for
    dropout, and its `alltoall` dispatcher copies the split sizes to the host on a side stream
    (a no-op for CPU tensors, which it then hands to `all_to_all_single` as tensors, not
    numpy arrays). Maps the device to the CPU, the streams and the RNG fork to no-ops (dropout
    is 0 here), and the split sizes to numpy as on the GPU. The reference transport's times say
    nothing of the kernels', so the comm-share warning is off unless `MDEEP_COMM_SHARE_WARN` is
    set (this process and those it starts).
    """
    import contextlib

    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import token_dispatcher

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    tp_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host_numpy(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host_numpy
    os.environ.setdefault("MDEEP_COMM_SHARE_WARN", "0")


def _synchronize(args) -> None:
    if not args.cpu:
        torch.cuda.synchronize()


def build_model(args, dispatcher):
    from megatron_deepep.megatron import baselines
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_deepep import knobs

    dispatcher, permute_fusion = baselines.split_run(dispatcher)
    torch.manual_seed(args.seed)
    if not args.cpu:
        model_parallel_cuda_manual_seed(args.seed)
    fields = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=4 * args.hidden_size, moe_ffn_hidden_size=2 * args.hidden_size,
        num_attention_heads=8, num_moe_experts=args.num_experts, moe_router_topk=args.topk,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_router_dtype="fp32", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0)
    fields.update(args.flags.config)  # the Megatron flags after `--` win
    config = TransformerConfig(
        **fields, moe_token_dispatcher_type=dispatcher, moe_permute_fusion=permute_fusion,
        expert_model_parallel_size=dist.get_world_size(), gradient_accumulation_fusion=False,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=args.cpu)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    if knobs.get("GROUPED_MM_EXPERTS"):  # the examples/configs proxies: grouped experts
        from megatron_deepep.megatron.grouped_experts import with_grouped_mm_experts

        spec, note = with_grouped_mm_experts(spec, "cpu" if args.cpu else "cuda")
        if dist.get_rank() == 0 and dispatcher == run_names(args)[0]:
            print(f"MDEEP_GROUPED_MM_EXPERTS=1: {note}", flush=True)
    model_kwargs = dict(position_embedding_type="rope")
    model_kwargs.update(args.flags.model)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
                     max_sequence_length=args.seq_length, **model_kwargs)
    # As Megatron's Float16Module does: the local spec's norms are created in fp32.
    model = model.bfloat16()
    return model if args.cpu else model.cuda()


def update_expert_bias(model) -> None:
    """What Megatron's `finalize_model_grads` does for aux-loss-free balancing: moves each
    router's expert bias by the step's token counts (summed over the data-parallel ranks),
    then starts the next step's counts from zero."""
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    config = model.config
    if not getattr(config, "moe_router_enable_expert_bias", False):
        return
    _update_router_expert_bias([model], config)
    for module in model.modules():
        if hasattr(module, "expert_bias"):
            module.local_tokens_per_expert.zero_()


def batches(args, rank):
    device = "cpu" if args.cpu else "cuda"
    gen = torch.Generator(device=device).manual_seed(args.seed * 7 + rank)
    s, b = args.seq_length, args.micro_batch_size
    mask = torch.tril(torch.ones(s, s, device=device)).view(1, 1, s, s) < 0.5
    pos = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
    pool = None
    if args.motifs:  # the same few motifs on every rank and step
        pool_gen = torch.Generator(device=device).manual_seed(args.seed)
        pool = torch.randint(0, args.vocab_size, (args.motifs, 16), device=device,
                             generator=pool_gen)
    for _ in range(args.steps + 2 * args.profile_steps):
        # A learnable signal: each sequence repeats a short motif (random, or one of the pool).
        if pool is None:
            motif = torch.randint(0, args.vocab_size, (b, 16), device=device, generator=gen)
        else:
            motif = pool[torch.randint(0, args.motifs, (b,), device=device, generator=gen)]
        tokens = motif.repeat(1, s // 16 + 2)[:, : s + 1]
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), pos, mask


def train(args, name):
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    import megatron_deepep.megatron as mdm

    from megatron_deepep.megatron import metrics
    from megatron_deepep.megatron.options import resolve_options

    dispatcher, _, fp8 = name.partition(FP8_SUFFIX)
    # Dispatchers read their options when built: set the FP8 switch for this model only.
    options = dict(args.flags.deepep)
    options["fp8_dispatch"] = fp8 or options.get("fp8_dispatch", "off")
    if args.cpu:
        options["transport"] = "reference"
    else:
        options.setdefault("transport", "auto")
    metrics_dir = run_metrics_dir(args, name) if args.round == 0 else None
    if metrics_dir:
        options.update(metrics=True, metrics_dir=metrics_dir)
    mdm.register_deepep_dispatcher(**options)
    record_metrics = dispatcher == "deepep" and bool(resolve_options(None).metrics)
    model = build_model(args, dispatcher)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.0)
    losses, times = [], []
    rank = dist.get_rank()
    profiler = host_profiler = None
    for step, (tokens, labels, pos, mask) in enumerate(batches(args, rank)):
        if step == args.steps:  # the extra steps: profiled, neither timed nor compared
            profiler = torch.profiler.profile(activities=[
                torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        if step == args.steps + args.profile_steps:  # then as many under cProfile (host only)
            profiler.__exit__(None, None, None)
            host_profiler = cProfile.Profile()
            host_profiler.enable()
        _synchronize(args)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        per_token = model(tokens, pos, mask, labels=labels)
        loss = per_token.float().mean()
        loss.backward()
        update_expert_bias(model)
        if dist.get_world_size() > 1:
            # Data-parallel average of the replicated grads (EP ranks are the DP ranks here);
            # Megatron marks expert weights `allreduce=False`: each rank owns its own.
            for p in params:
                if p.grad is not None and getattr(p, "allreduce", True):
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        _synchronize(args)
        if record_metrics:  # ends the step: one JSON line (collective over the EP group)
            metrics.flush(step)
        if profiler is not None:
            clear_tracker(clear_aux_losses_tracker)
            continue
        times.append(time.perf_counter() - t0)
        loss_avg = loss.detach().clone()
        dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
        losses.append(loss_avg.item())
        clear_tracker(clear_aux_losses_tracker)
        if rank == 0 and (step % (5 if args.cpu else 10) == 0 or step == args.steps - 1):
            print(f"[{name}] step {step:3d} loss {losses[-1]:.4f} "
                  f"time {times[-1] * 1e3:.1f} ms", flush=True)
    if host_profiler is not None:
        host_profiler.disable()
        if rank == 0:
            write_profile(args, name, profiler, host_profiler)
    del model, opt
    if not args.cpu:
        torch.cuda.empty_cache()
    return losses, times


def run_metrics_dir(args, name):
    """Where run `name` writes its metrics: `--metrics-dir` for the first deepep run, a
    subfolder named after any other deepep run, None for the rest (and without the option)."""
    deepep_runs = [n for n in run_names(args) if n.partition(FP8_SUFFIX)[0] == "deepep"]
    if not args.metrics_dir or name not in deepep_runs:
        return None
    if name == deepep_runs[0]:
        return args.metrics_dir
    return os.path.join(args.metrics_dir, _file_stem(name))


def clear_tracker(clear) -> None:
    """Resets Megatron's aux-loss tracker between steps (older versions may lack it)."""
    try:
        clear()
    except Exception:
        pass


def write_profile(args, name, profiler, host_profiler) -> None:
    """Top ops by host and by GPU time (torch.profiler), then the Python functions by own and
    cumulative time (cProfile, as many more steps), to `profile_<run>.txt`."""
    table = profiler.key_averages()
    text = "\n\n".join(table.table(sort_by=key, row_limit=25, max_name_column_width=60)
                       for key in ("self_cpu_time_total", "self_cuda_time_total"))
    for key in ("tottime", "cumulative"):
        stream = io.StringIO()
        pstats.Stats(host_profiler, stream=stream).sort_stats(key).print_stats(30)
        text += "\n\n" + stream.getvalue()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile_{_file_stem(name)}.txt")
    with open(path, "w") as f:
        f.write(f"{name}: {args.profile_steps} profiled steps\n{text}\n")
    print(f"[{name}] profile written to {path}", flush=True)


def loss_differences(a, b):
    """Max absolute, max relative and mean relative difference of two loss curves (vs `b`)."""
    pairs = list(zip(a, b))
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in pairs]
    return {"max_abs_loss_diff": max((abs(x - y) for x, y in pairs), default=0.0),
            "max_rel_loss_diff": max(rel, default=0.0),
            "mean_rel_loss_diff": statistics.fmean(rel) if rel else 0.0}


def summarize(results, steps, warmup_steps, world_size, device_name, skipped=None):
    """The JSON summary: per-step losses, median step times and the curve differences (of the
    second run from the first; with more runs, of each from the first, `loss_diff_vs_first`),
    each run's label, and the runs skipped here with the reason."""
    summary = {
        "world_size": world_size,
        "steps": steps,
        "warmup_steps_excluded": warmup_steps,
        "median_step_time_ms": {k: 1e3 * statistics.median(v[1][warmup_steps:] or v[1])
                                for k, v in results.items()},
        "losses": {k: v[0] for k, v in results.items()},
        "gpu": device_name,
    }
    summary["labels"] = {k: run_label(k) for k in list(results) + list(skipped or {})}
    summary["skipped"] = dict(skipped or {})
    names = list(results)
    if len(names) == 2:
        summary.update(loss_differences(results[names[1]][0], results[names[0]][0]))
    elif len(names) > 2:
        summary["loss_diff_vs_first"] = {n: loss_differences(results[n][0], results[names[0]][0])
                                         for n in names[1:]}
    return summary


def plot(out_dir, curves, steps, world_size):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, losses) in enumerate(curves.items()):
        ax.plot(range(len(losses)), losses, label=name, linestyle="-" if i == 0 else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("LM loss (mean over ranks)")
    ax.set_title(f"GPT-MoE, EP={world_size}, {steps} steps, one seed")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "loss_curves.png")
    fig.savefig(path, dpi=120)
    return path


def plot_only(args):
    with open(args.plot_only) as f:
        summary = json.load(f)
    out_dir = args.out if args.out != DEFAULT_OUT else os.path.dirname(args.plot_only) or "."
    os.makedirs(out_dir, exist_ok=True)
    path = plot(out_dir, summary["losses"], summary.get("steps"), summary.get("world_size", "?"))
    print(path)
    return 0


def side_by_side(curves) -> str:
    """The loss curves as a table: one row per step, one column per run, and, for two runs,
    the absolute difference of the second from the first."""
    names = list(curves)
    head = f"{'step':>4}  " + "  ".join(f"{n:>12}" for n in names)
    if len(names) == 2:
        head += f"  {'|diff|':>9}"
    rows = [head]
    for step, values in enumerate(zip(*curves.values())):
        row = f"{step:>4}  " + "  ".join(f"{v:>12.4f}" for v in values)
        if len(values) == 2:
            row += f"  {abs(values[1] - values[0]):>9.2e}"
        rows.append(row)
    return "\n".join(rows)


def main(argv=None):
    warnings.filterwarnings("ignore")
    try:  # every MDEEP_* variable set, before any process starts: one line if one is bad
        from megatron_deepep import knobs
        knobs.check_environment("dispatcher")
    except ValueError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"compare_dispatchers.py: {exc}", file=sys.stderr)
        return 2
    args = parse_args(argv)
    if args.plot_only:
        return plot_only(args)
    if not args.cpu and not torch.cuda.is_available():
        # Before any run's process starts; rank 0 alone says it and fails, so that torchrun
        # reports one failed rank, not every rank's.
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
        print("compare_dispatchers.py: no CUDA GPU. Without one, train on the CPU over 2 gloo "
              "ranks: torchrun --nproc-per-node 2 examples/compare_dispatchers.py --cpu "
              "(or bash examples/run_gpt_moe.sh, which does that on a machine without a GPU)",
              file=sys.stderr)
        return 2
    if args.cpu:
        allow_megatron_on_cpu()
    allow_megatron_without_te()
    if args.only_run is not None:
        return train_one_run(args)
    runs, skipped = plan_runs(args)
    if int(os.environ.get("RANK", "0")) == 0:
        for line in describe(args):
            print(f"compare_dispatchers.py: {line}", flush=True)
    if args.same_process:
        init_distributed(cpu=args.cpu)
        results = {name: train_with_plugin(args, name) for name in runs}
        rank, world_size = dist.get_rank(), dist.get_world_size()
        dist.destroy_process_group()
    else:
        results = train_in_fresh_processes(args, argv, runs)
        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        curves = {k: v[0] for k, v in results.items()}
        summary = summarize(results, args.steps, args.warmup_steps, world_size,
                            "cpu" if args.cpu else torch.cuda.get_device_name(), skipped)
        summary["fresh_process_per_run"] = not args.same_process
        summary["rounds"] = 1 if args.same_process else args.rounds
        if args.fp8_dispatch:
            summary["fp8_dispatch"] = args.fp8_dispatch
        with open(os.path.join(args.out, "step_times.json"), "w") as f:
            json.dump(summary, f, indent=1)
        for name, reason in skipped.items():
            print(f"{run_label(name)}: skipped: {reason}")
        print("LM loss per step (mean over ranks):\n" + side_by_side(curves))
        if args.cpu:
            times = " / ".join(f"{v:.0f}" for v in summary["median_step_time_ms"].values())
            fresh = ("one process for all runs" if args.same_process
                     else f"each run in a fresh process, {args.rounds} rounds pooled"
                     if args.rounds > 1 else "each run in a fresh process")
            print(f"{' and '.join(curves)}: max |loss difference| "
                  f"{summary.get('max_abs_loss_diff', 0.0):.2e} over {args.steps} steps; "
                  f"median step {times} ms on the CPU ({fresh}; deepep on the pure-torch "
                  f"reference transport)"
                  + ("; FP8 dispatch rounds deepep's rows, so its curve parts from the other"
                     if args.flags.deepep.get("fp8_dispatch", "off") != "off" else ""))
        else:
            print(json.dumps({k: summary[k] for k in summary if k != "losses"}, indent=1))
        try:
            print(plot(args.out, curves, args.steps, world_size))
        except ImportError:
            print(f"(no matplotlib: loss_curves.png not drawn; the losses are in "
                  f"{os.path.join(args.out, 'step_times.json')})")
    return 0


def describe(args):
    """What this run trains, in a few lines: the model (the routing the flags after `--` give),
    where it runs, and each flag it dropped with the reason."""
    config = dict(moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss")
    config.update(args.flags.config)
    routing = [f"{config['moe_router_score_function']} scores"]
    if config.get("moe_router_enable_expert_bias"):
        routing.append("expert bias")
    if config.get("moe_router_num_groups"):
        routing.append(f"a token's experts in {config.get('moe_router_group_topk')} of "
                       f"{config['moe_router_num_groups']} groups")
    routing.append(config["moe_router_load_balancing_type"])
    if config.get("moe_shared_expert_intermediate_size"):
        routing.append("a shared expert")
    fp8 = args.fp8_dispatch or args.flags.deepep.get("fp8_dispatch", "off")
    where = ("the CPU: gloo ranks, deepep on the pure-torch reference transport"
             if args.cpu else "the GPUs")
    lines = [f"{args.name or 'GPT-MoE'}: {args.num_layers} MoE layers, hidden "
             f"{args.hidden_size}, {args.num_experts} experts, top-{args.topk}, "
             f"{', '.join(routing)}; {args.steps} steps of {args.micro_batch_size} x "
             f"{args.seq_length} tokens per rank on {where}"]
    if fp8 != "off":
        lines.append(f"FP8 dispatch {fp8}" + (
            ": quantized and dequantized in torch by the reference transport (the wire "
            "format's numerics; its speed needs the kernels)" if args.cpu else ""))
    if args.flags.dropped:
        lines.append("dropped (no meaning in this run): " + "; ".join(
            f"{flag} ({why})" for flag, why in args.flags.dropped))
    return lines


def train_with_plugin(args, name):
    import megatron_deepep.megatron as mdm

    mdm.register_deepep_dispatcher()
    return train(args, name)


def _file_stem(name: str) -> str:
    """A run name as a file-name part: `deepep+fp8:mxfp8` -> `deepep_fp8_mxfp8`."""
    return name.replace(":", "_").replace("+", "_")


def _run_file(args, name, round_index=0) -> str:
    suffix = f"_round{round_index}" if round_index else ""
    return os.path.join(args.out, f"run_{_file_stem(name)}{suffix}.json")


def train_one_run(args) -> int:
    """A child process: trains `--only-run` and (rank 0) writes its losses and step times."""
    init_distributed(cpu=args.cpu)
    losses, times = train_with_plugin(args, args.only_run)
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(_run_file(args, args.only_run, args.round), "w") as f:
            json.dump({"losses": losses, "times": times}, f)
    dist.destroy_process_group()
    return 0


def round_orders(runs, rounds):
    """The order of the runs in each round: as given, then reversed, and so on (ABBA)."""
    return [list(runs) if i % 2 == 0 else list(reversed(runs)) for i in range(rounds)]


def pool_rounds(per_round, warmup_steps):
    """One run's `(losses, times)` from its rounds' `[(losses, times), ...]`: the first round's
    losses, and its times followed by every later round's timed steps (their first
    `warmup_steps` left out, as `summarize` leaves out the first round's)."""
    losses, times = per_round[0]
    times = list(times)
    for _, later in per_round[1:]:
        times.extend(later[warmup_steps:])
    return losses, times


class ChildRendezvous:
    """A fresh TCP store per child launch, served by rank 0's parent, which binds it to a free port
    before any child starts (a fixed port above MASTER_PORT could be taken by another process by
    then: "address already in use" in one child, a failed run).

    The parents share the port through torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE), or,
    under another launcher, through a store rank 0's parent serves on MASTER_PORT. Every child
    connects as a client (TORCHELASTIC_USE_AGENT_STORE=True tells `env://` to).
    """

    def __init__(self, timeout_s: float = 600.0):
        import datetime

        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.parents = None
        if self.world_size > 1:
            on_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            self.parents = dist.TCPStore(self.host, int(os.environ["MASTER_PORT"]),
                                         self.world_size,
                                         is_master=self.rank == 0 and not on_agent_store,
                                         timeout=self.timeout)
        self.server = None

    def open(self, launch: int) -> dict:
        """Starts (rank 0) or looks up launch `launch`'s store; returns the child's environment."""
        key = f"mdeep_compare/child_port/{launch}"
        if self.rank == 0:
            self.server = dist.TCPStore(self.host, 0, self.world_size, is_master=True,
                                        timeout=self.timeout, wait_for_workers=False)
            port = self.server.port
            if self.parents is not None:
                self.parents.set(key, str(port))
        else:
            port = int(self.parents.get(key))
        return {"MASTER_ADDR": self.host, "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "True"}

    def close(self, launch: int, child_failed: bool) -> None:
        """Stops launch `launch`'s store once every rank's child has ended (at once where rank
        0's child failed: torchrun then ends the others).

        Raises:
            SystemExit: naming the ranks whose children still run after the timeout.
        """
        if self.parents is not None:
            self.parents.set(f"mdeep_compare/ended/{launch}/{self.rank}", "1")
            deadline = time.monotonic() + self.timeout.total_seconds()
            running = list(range(1, self.world_size)) if self.rank == 0 and not child_failed \
                else []
            while running:
                running = [r for r in running
                           if not self.parents.check([f"mdeep_compare/ended/{launch}/{r}"])]
                if not running:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"launch {launch}: the children of rank(s) {running} still "
                                     f"run after {self.timeout}")
                time.sleep(0.05)
        self.server = None


def train_in_fresh_processes(args, argv, runs=None):
    """Runs each dispatcher in a child process of every rank, `args.rounds` times in
    `round_orders`; returns {run: (losses, times)} pooled by `pool_rounds`.

    Under torchrun every rank starts its child for one run of one round at once; the children
    meet on a fresh store per launch (`ChildRendezvous`), so no two runs share a rendezvous.
    Rounds after the first record no metrics (the first round's are the run's).
    """
    import subprocess

    argv = list(sys.argv[1:] if argv is None else argv)
    rendezvous = ChildRendezvous()
    runs = run_names(args) if runs is None else runs
    per_run = {name: [] for name in runs}
    # Our options go before `--` (what follows it are the model's Megatron flags).
    split = argv.index("--") if "--" in argv else len(argv)
    launch = 0
    for round_index, order in enumerate(round_orders(runs, args.rounds)):
        for name in order:
            launch += 1
            env = dict(os.environ, **rendezvous.open(launch))
            if round_index:
                env["MDEEP_METRICS"] = "0"
            cmd = [sys.executable, os.path.abspath(__file__), *argv[:split], "--only-run", name,
                   "--round", str(round_index), *argv[split:]]
            done = subprocess.run(cmd, env=env)
            rendezvous.close(launch, child_failed=done.returncode != 0)
            if done.returncode != 0:
                raise SystemExit(f"run {name!r} failed (exit {done.returncode}): {' '.join(cmd)}")
            if int(os.environ.get("RANK", "0")) == 0:
                with open(_run_file(args, name, round_index)) as f:
                    run = json.load(f)
                per_run[name].append((run["losses"], run["times"]))
    if int(os.environ.get("RANK", "0")) != 0:
        return {}
    for name, rounds in per_run.items():
        drift = max((abs(a - b) for later, _ in rounds[1:] for a, b in zip(later, rounds[0][0])),
                    default=0.0)
        if drift:
            print(f"{run_label(name)}: the rounds' losses differ by up to {drift:.2e} (the "
                  "first round's are compared)", flush=True)
    return {name: pool_rounds(rounds, args.warmup_steps) for name, rounds in per_run.items()}


if __name__ == "__main__":
    sys.exit(main())
