"""Multi-node check of an EP transport: correctness against the reference, then GB/s per NIC.

Every rank builds two Buffers on the same ranks: the transport under test (`--transport`, default
"internode") on its GPU, and the pure-torch reference on CPU copies over a gloo group. On fresh
random routing (uniform, uneven token counts, skewed, -1 ids, empty ranks, node-limited) it
compares dispatch (rows, weights, per-expert counts: bit-exact), the layout, cached dispatch and
the no-sync mode (bit-exact), and combine, plain and weighted (within the fp32-accumulation
tolerance: the stand-in expert scales rows by positive factors, so no sum cancels). Then it
sweeps token counts x hidden sizes: per-rank bytes that cross the network and NVLink come from
`megatron_deepep.transport.node_layout` (the rows the hierarchical path moves), the time from CUDA
events (the slowest rank's median), and rank 0 prints GB/s per rank and per NIC. It names the
transport that ran (the Buffer's, which `auto` may resolve to the reference) and gives no GB/s
for the reference transport: those times are torch's collectives, not a network or NVLink.

Launch, one process per GPU (the first node's address as the rendezvous), from any install
(`python -m megatron_deepep.tools.multinode_check` in a checkout is the same command):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m megatron_deepep.tools.multinode_check
    srun --ntasks-per-node 8 --gpus-per-node 8 python -m megatron_deepep.tools.multinode_check
        (with MASTER_ADDR and MASTER_PORT exported; examples/slurm_multinode_check.sbatch)
One machine, virtual nodes (processes sharing the GPUs; proves correctness, not speed):
    python -m megatron_deepep.tools.multinode_check --spawn 4 --num-ranks-per-node 2
Without a GPU (what CI runs): add `--transport reference --device cpu`.

Exit status: 0 all checks passed, 1 a check failed or a rank raised, 2 bad arguments or launch.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import secrets
import socket
import statistics
import sys
import time
import traceback
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

# No NVLink multicast (NVLS): several processes may share a GPU, and the transports do not use it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
CASES = ("uniform", "uneven", "skewed", "dropped", "empty", "node-limited")
COMBINE_RTOL = 2e-2  # the forwarder rounds its node's partial sum to bf16 once more


class UsageError(Exception):
    """Bad arguments or launch environment (exit status 2)."""


def _ints(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_deepep.tools.multinode_check",
        description="Checks an EP transport against the reference on 2+ nodes (torchrun, srun, "
                    "or --spawn on one machine), then sweeps its GB/s per NIC.",
        epilog="Exit status: 0 passed, 1 a check failed, 2 bad arguments or launch.")
    g = p.add_argument_group("what runs")
    g.add_argument("--transport", default="internode",
                   help="transport under test (Buffer's transport=, e.g. internode, auto, nvlink,"
                        " reference); default %(default)s")
    g.add_argument("--num-ranks-per-node", type=int, default=None, metavar="P",
                   help="declare nodes of P contiguous ranks (virtual nodes: several processes "
                        "on one machine model a cluster); default: ranks on one host form a node")
    g.add_argument("--nics-per-node", type=int, default=None,
                   help="NICs per node for the per-NIC GB/s (local rank l uses NIC "
                        "l * nics // P); default one per rank")
    g.add_argument("--skip-check", action="store_true", help="only the GB/s sweep")
    g.add_argument("--skip-sweep", action="store_true", help="only the correctness check")
    g.add_argument("--cases", type=lambda s: [c for c in s.split(",") if c],
                   default=list(CASES),
                   help=f"correctness cases, comma-separated, from {','.join(CASES)}")
    g.add_argument("--fp8", default=None, metavar="FORMAT",
                   help="also check FP8 dispatch in this format (e.g. blockwise_1x128) and "
                        "sweep with FP8 rows")
    g = p.add_argument_group("shapes")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts in all; default the smallest multiple of the rank count >= 256")
    g.add_argument("--topk", type=int, default=8, help="experts per token; default %(default)s")
    g.add_argument("--check-tokens", type=int, default=256,
                   help="tokens per rank in the correctness cases; default %(default)s")
    g.add_argument("--check-hidden", type=_ints, default=[2048, 7168],
                   help="hidden sizes of the correctness cases, comma-separated; default "
                        "2048,7168")
    g.add_argument("--sweep-tokens", type=_ints, default=[512, 1024, 2048, 4096],
                   help="tokens per rank of the sweep, comma-separated; default 512,1024,2048,4096")
    g.add_argument("--sweep-hidden", type=_ints, default=[2048, 4096, 7168],
                   help="hidden sizes of the sweep, comma-separated; default 2048,4096,7168")
    g.add_argument("--node-limited", type=int, default=0, metavar="M",
                   help="route the sweep with group-limited top-k, M nodes per token "
                        "(Megatron's --moe-router-group-topk); 0 (default): uniform top-k")
    g.add_argument("--warmup", type=int, default=3, help="untimed calls per sweep point")
    g.add_argument("--iters", type=int, default=10, help="timed calls per sweep point")
    g = p.add_argument_group("Buffer")
    g.add_argument("--num-sms", type=int, default=24, help="SM budget; default %(default)s")
    g.add_argument("--timeout-s", type=float, default=100.0,
                   help="the Buffer's cross-GPU wait timeout; default %(default)s")
    g = p.add_argument_group("launch")
    g.add_argument("--spawn", type=int, default=0, metavar="N",
                   help="start N local processes instead of reading torchrun/srun's environment")
    g.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="process group backend; auto: nccl with one process per GPU, else gloo")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where the tested transport runs; auto: cuda if present")
    g.add_argument("--seed", type=int, default=None,
                   help="routing seed; default random (printed, so a failure can be replayed)")
    g.add_argument("--json", default=None, metavar="OUT",
                   help="write the results as JSON; `python -m "
                        "megatron_deepep.tools.internode_model --measured-json OUT` takes its "
                        "measured rates")
    g.add_argument("--print-nvshmem-size", action="store_true",
                   help="print the NVSHMEM_SYMMETRIC_SIZE (bytes) for --max-tokens, "
                        "--max-hidden, --ranks, --topk and --num-ranks-per-node (default 8), "
                        "and exit (the Slurm templates use it)")
    g.add_argument("--max-tokens", type=int, default=4096,
                   help="with --print-nvshmem-size: tokens per rank per call; default %(default)s")
    g.add_argument("--max-hidden", type=int, default=7168,
                   help="with --print-nvshmem-size: widest hidden size; default %(default)s")
    g.add_argument("--ranks", type=int, default=16,
                   help="with --print-nvshmem-size: EP group size; default %(default)s")
    return p


def check_args(args) -> None:
    """Raises UsageError for arguments that cannot work, naming the flag."""
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        raise UsageError(f"--cases: unknown {bad}; choose from {','.join(CASES)}")
    positive = {"--topk": args.topk, "--iters": args.iters, "--num-sms": args.num_sms,
                "--max-tokens": args.max_tokens, "--max-hidden": args.max_hidden,
                "--ranks": args.ranks}
    for flag, value in positive.items():
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    for flag, values in (("--check-hidden", args.check_hidden),
                         ("--sweep-hidden", args.sweep_hidden)):
        if any(h < 8 or h % 8 for h in values):
            raise UsageError(f"{flag}: hidden sizes must be positive multiples of 8 (rows of "
                             f"16-byte vectors), got {values}")
    if args.check_tokens < 1:
        raise UsageError(f"--check-tokens must be >= 1, got {args.check_tokens}")
    if any(n < 1 for n in args.sweep_tokens):
        raise UsageError(f"--sweep-tokens must be >= 1, got {args.sweep_tokens}")
    if args.warmup < 0 or args.node_limited < 0 or args.spawn < 0:
        raise UsageError("--warmup, --node-limited and --spawn must be >= 0")
    if args.timeout_s <= 0:
        raise UsageError(f"--timeout-s must be > 0, got {args.timeout_s}")
    if args.fp8:
        from megatron_deepep.fp8.dispatch import Fp8Dispatch

        try:
            if Fp8Dispatch.named(args.fp8) is None:
                raise ValueError("it names no FP8 format")
        except ValueError as e:
            raise UsageError(f"--fp8 {args.fp8!r}: {e}") from None
        if any(h % 16 for h in args.check_hidden + args.sweep_hidden):
            raise UsageError("--fp8 needs hidden sizes that are multiples of 16")
    if args.skip_check and args.skip_sweep:
        raise UsageError("--skip-check and --skip-sweep together leave nothing to run")


# ---------------------------------------------------------------------------------------------
# Sizes

def nvshmem_heap_bytes(max_tokens: int, hidden: int, num_ranks: int, topk: int,
                       num_ranks_per_node: Optional[int] = None,
                       transport: str = "internode") -> int:
    """NVSHMEM_SYMMETRIC_SIZE for a Buffer of these limits: the transport's `size_hint` (for
    "internode": the symmetric heap one rank holds) plus headroom for NVSHMEM and torch, in
    whole 512 MiB granules, and never below NVSHMEM's 1 GiB default.

    Raises:
        UsageError: the limits or the transport are not valid for `Buffer.size_hint`.
    """
    from megatron_deepep.buffer import Buffer
    from megatron_deepep.transport.nvshmem_heap import heap_bytes_for

    try:
        hint = Buffer.size_hint(max_tokens, hidden, num_ranks, topk, transport=transport,
                                num_ranks_per_node=num_ranks_per_node)
    except ValueError as e:
        raise UsageError(f"Buffer.size_hint(transport={transport!r}) failed: {e}") from None
    return heap_bytes_for(hint)


# ---------------------------------------------------------------------------------------------
# Inputs

@dataclasses.dataclass
class Shape:
    """The group as this check sees it."""

    rank: int
    num_ranks: int
    num_ranks_per_node: int
    num_experts: int
    topk: int

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.num_ranks_per_node


def default_num_experts(num_ranks: int) -> int:
    """The smallest multiple of the rank count that is at least 256 (DeepSeek-V3's count)."""
    return num_ranks * math.ceil(256 / num_ranks)


def case_tokens(case: str, num_tokens: int, rank: int, num_ranks: int) -> int:
    """Tokens rank `rank` sends in `case`: uneven counts differ per rank, `empty` gives rank 0
    nothing to send."""
    if case == "uneven":
        return max(1, num_tokens * (rank + 1) // num_ranks) if rank % 3 != 2 else 1
    if case == "empty" and rank == 0:
        return 0
    return num_tokens


def make_routing(case: str, num_tokens: int, shape: Shape,
                 gen: torch.Generator) -> torch.Tensor:
    """`[num_tokens, topk]` int64 expert ids (-1 = none) for one correctness case.

    uniform/uneven: top-k of uniform scores; skewed: scores scaled by a decaying factor, so the
    first ranks' experts take most entries; dropped: a quarter of the entries and every 7th token
    entirely -1; empty: the experts of the last rank (the last node, if there are several) are
    never chosen, so those ranks receive nothing; node-limited: Megatron's group-limited top-k
    with groups = nodes and M = min(2, nodes) groups per token.
    """
    from megatron_deepep.transport.node_layout import node_limited_topk

    e = shape.num_experts
    scores = torch.rand(num_tokens, e, generator=gen)
    if case == "skewed":
        scores = scores * torch.exp(-torch.arange(e, dtype=torch.float32) / max(e / 16, 1.0))
    if case == "empty":
        per_rank = e // shape.num_ranks
        cut = e - per_rank * (shape.num_ranks_per_node if shape.num_nodes > 1 else 1)
        if cut >= shape.topk:
            scores[:, cut:] = -1.0
    if case == "node-limited" and shape.num_nodes > 1:
        group_topk = min(2, shape.num_nodes)
        topk = min(shape.topk, group_topk * e // shape.num_nodes)
        idx = node_limited_topk(scores, num_groups=shape.num_nodes, group_topk=group_topk,
                                topk=topk)[1]
        if topk < shape.topk:
            idx = torch.cat([idx, idx.new_full((num_tokens, shape.topk - topk), -1)], dim=1)
        return idx
    idx = torch.topk(scores, k=shape.topk, dim=1).indices
    if case == "dropped":
        drop = torch.rand(num_tokens, shape.topk, generator=gen) < 0.25
        drop[::7] = True
        idx = idx.masked_fill(drop, -1)
    return idx


def expert_scale(recv_x: torch.Tensor, tokens_per_expert: Sequence[int]) -> torch.Tensor:
    """A stand-in expert: the rows of local expert e times (e + 1); padding rows stay zero."""
    scales = torch.repeat_interleave(
        torch.arange(1, len(tokens_per_expert) + 1, dtype=torch.float32),
        torch.tensor(list(tokens_per_expert), dtype=torch.int64))
    scales = torch.nn.functional.pad(scales, (0, recv_x.shape[0] - scales.numel()))
    return (recv_x.float() * scales.unsqueeze(1)).to(recv_x.dtype)


# ---------------------------------------------------------------------------------------------
# Comparisons (each returns a list of failure messages)

def _same(name: str, got, want) -> List[str]:
    if isinstance(want, (tuple, list)) and want and isinstance(want[0], torch.Tensor):
        out = []
        for i, (g, w) in enumerate(zip(got, want)):
            out += _same(f"{name}[{i}]", g, w)
        return out
    if isinstance(want, torch.Tensor):
        got = got.cpu()
        if want.dtype.itemsize == 1 and want.is_floating_point():  # float8: compare bytes
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        if got.shape != want.shape:
            return [f"{name}: shape {tuple(got.shape)}, reference {tuple(want.shape)}"]
        if got.dtype != want.dtype:
            return [f"{name}: dtype {got.dtype}, reference {want.dtype}"]
        if not torch.equal(got, want):
            bad = (got != want).reshape(got.shape[0], -1).any(dim=1).nonzero().flatten()
            return [f"{name}: {bad.numel()} of {got.shape[0]} rows differ (first rows "
                    f"{bad[:5].tolist()})"]
        return []
    return [] if got == want else [f"{name}: {got}, reference {want}"]


def _close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> List[str]:
    """|got - want| <= rtol |want| + 1e-3 everywhere (values of one sign per element)."""
    got = got.cpu().float()
    want = want.float()
    if got.shape != want.shape:
        return [f"{name}: shape {tuple(got.shape)}, reference {tuple(want.shape)}"]
    err = (got - want).abs()
    bad = err > rtol * want.abs() + 1e-3
    if bad.any():
        worst = int(err.flatten().argmax())
        return [f"{name}: {int(bad.sum())} of {got.numel()} values outside rtol {rtol} (worst "
                f"{err.flatten()[worst]:.4g} at flat index {worst}, reference "
                f"{want.flatten()[worst]:.4g})"]
    return []


# ---------------------------------------------------------------------------------------------
# The correctness check

def check_case(case: str, hidden: int, tested, ref, shape: Shape, seed: int, args,
               device: torch.device, alignment: int) -> List[str]:
    """Runs one case on both Buffers; returns this rank's failures (empty: it passed)."""
    gen = torch.Generator().manual_seed(seed)
    n = case_tokens(case, args.check_tokens, shape.rank, shape.num_ranks)
    idx = make_routing(case, n, shape, gen)
    x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
    w = torch.rand(n, shape.topk, generator=gen)
    e = shape.num_experts
    fails: List[str] = []
    d_idx, d_w = idx.to(device), w.to(device)

    layout, _ = tested.get_dispatch_layout(d_idx, e)
    ref_layout, _ = ref.get_dispatch_layout(idx, e)
    for name in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"):
        fails += _same(f"layout.{name}", getattr(layout, name), getattr(ref_layout, name))

    got_x, got_w, handle, _ = tested.dispatch(x.to(device), d_idx, d_w, num_experts=e,
                                              expert_alignment=alignment)
    want_x, want_w, ref_handle, _ = ref.dispatch(x, idx, w, num_experts=e,
                                                 expert_alignment=alignment)
    fails += _same("dispatch recv_x", got_x, want_x)
    fails += _same("dispatch recv_weights", got_w, want_w)
    fails += _same("tokens_per_expert_list", handle.tokens_per_expert_list,
                   ref_handle.tokens_per_expert_list)
    sizes = ref_handle.tokens_per_expert_list

    y = expert_scale(want_x, sizes)
    grad_rows = torch.rand(y.shape[0], generator=gen)
    for weighted in (False, True):
        out, out_w, _ = tested.combine(y.to(device), handle, weighted=weighted,
                                       grad_row_weights=grad_rows.to(device))
        ref_out, ref_w, _ = ref.combine(y, ref_handle, weighted=weighted,
                                        grad_row_weights=grad_rows)
        tag = "weighted combine" if weighted else "combine"
        fails += _close(tag, out, ref_out, COMBINE_RTOL)
        fails += _same(f"{tag} grad_row_weights", out_w, ref_w)

    x3 = (x.float() * 3).to(torch.bfloat16)
    cached, _, _, _ = tested.dispatch(x3.to(device), handle=handle)
    fails += _same("cached dispatch", cached, ref.dispatch(x3, handle=ref_handle)[0])

    bound = sum(sizes) + 7
    free_x, _, free_handle, _ = tested.dispatch(x.to(device), d_idx, d_w, num_experts=e,
                                                expert_alignment=alignment,
                                                num_max_recv_rows=bound)
    fails += _same("no-sync dispatch row count", free_x.shape[0], bound)
    fails += _same("no-sync dispatch rows", free_x[:sum(sizes)], want_x)
    fails += _same("no-sync tokens_per_expert", free_handle.tokens_per_expert.cpu(),
                   ref_handle.tokens_per_expert.cpu())

    if args.fp8:
        spec = _fp8_spec(args.fp8)
        got8, _, _, _ = tested.dispatch(x.to(device), d_idx, d_w, num_experts=e,
                                        expert_alignment=alignment, fp8=spec)
        want8, _, _, _ = ref.dispatch(x, idx, w, num_experts=e, expert_alignment=alignment,
                                      fp8=spec)
        fails += _same(f"fp8 dispatch ({args.fp8})", list(got8), list(want8))
    return fails


def check_max_tokens(args, num_ranks: int) -> int:
    """Tokens per rank of the check's Buffer: the most any case gives a rank."""
    return max(case_tokens(c, args.check_tokens, r, num_ranks)
               for c in args.cases for r in range(num_ranks))


def run_check(ctx) -> bool:
    """All cases x hidden sizes; rank 0 prints a line per case. True when every rank passed."""
    from megatron_deepep.buffer import Buffer

    args, shape = ctx.args, ctx.shape
    n_max = check_max_tokens(args, shape.num_ranks)
    tested = ctx.make_buffer(n_max, max(args.check_hidden), shape.topk)
    if tested is None:
        return False
    ref = Buffer(ctx.ctrl, n_max, max(args.check_hidden), shape.topk, transport="reference")
    all_ok = True
    alignments = {"uniform": 1, "uneven": 8, "skewed": 16, "dropped": 1, "empty": 4,
                  "node-limited": 1}
    number = 0
    for hidden in args.check_hidden:
        for case in args.cases:
            number += 1
            seed = ctx.seed * 1000003 + number * 1009 + shape.rank
            try:
                fails = check_case(case, hidden, tested, ref, shape, seed, args, ctx.device,
                                   alignments[case])
                raised = False
            except Exception as e:  # reported by rank 0 with the rank that raised it
                fails = [f"raised {type(e).__name__}: {e}"]
                raised = True
                ctx.log_traceback(traceback.format_exc())
            results = ctx.gather((fails, raised))
            ok = not any(f for f, _ in results)
            all_ok &= ok
            if shape.rank == 0:
                status = "ok" if ok else "FAILED"
                ctx.say(f"  check {case:<13} H={hidden:<5} {status}")
                for r, (f, _) in enumerate(results):
                    for message in f[:3]:
                        ctx.say(f"    rank {r}: {message}")
            if any(raised for _, raised in results):
                if shape.rank == 0:
                    ctx.say("  a rank raised: the remaining cases and the sweep are skipped")
                tested.destroy()
                return False
    tested.destroy()
    return all_ok


# ---------------------------------------------------------------------------------------------
# The sweep

def nic_bytes(send: Sequence[int], recv: Sequence[int], num_ranks_per_node: int,
              nics_per_node: int) -> int:
    """The busiest NIC's bytes: ranks of a node share its NICs (local rank l uses NIC
    `l * nics_per_node // P`); a NIC's bytes are the larger of its send and receive sums."""
    totals: Dict[tuple, List[int]] = {}
    for r, (s, v) in enumerate(zip(send, recv)):
        node, local = divmod(r, num_ranks_per_node)
        key = (node, local * nics_per_node // num_ranks_per_node)
        acc = totals.setdefault(key, [0, 0])
        acc[0] += s
        acc[1] += v
    return max(max(a) for a in totals.values())


def sweep_point(rows: Dict[str, List[int]], row_bytes: int, us: float, num_ranks_per_node: int,
                nics_per_node: int) -> Dict[str, float]:
    """GB/s of one phase: bytes from the per-rank rows (`internode_model.accumulate_rank_rows`,
    in the dispatch direction; combine swaps send and receive, which changes no maximum)."""
    net_rank = max(max(s, r) for s, r in zip(rows["net_send"], rows["net_recv"])) * row_bytes
    nvl_rank = max(max(s, r) for s, r in zip(rows["nvl_send"], rows["nvl_recv"])) * row_bytes
    nic = nic_bytes([s * row_bytes for s in rows["net_send"]],
                    [r * row_bytes for r in rows["net_recv"]], num_ranks_per_node, nics_per_node)
    gbps = (lambda b: b / (us * 1e3) if us > 0 else 0.0)
    return {"us": us, "network_bytes_per_rank": net_rank, "nvlink_bytes_per_rank": nvl_rank,
            "network_bytes_per_nic": nic, "gbps_per_rank": gbps(net_rank),
            "gbps_per_nic": gbps(nic), "nvlink_gbps_per_rank": gbps(nvl_rank)}


def _fp8_spec(name: str):
    """The `Fp8Dispatch` that `--fp8 NAME` asks for (FP8 rows to the experts)."""
    from megatron_deepep.fp8.dispatch import Fp8Dispatch

    return Fp8Dispatch.named(name)


def _row_bytes(hidden: int, fp8: Optional[str]) -> int:
    if not fp8:
        return 2 * hidden
    return _fp8_spec(fp8).fmt.bytes_per_token(hidden)


def run_sweep(ctx) -> List[dict]:
    """Times dispatch and combine at every (tokens, hidden); rank 0 prints the table."""
    from megatron_deepep.tools import internode_model
    from megatron_deepep.transport import bandwidth_refusal
    from megatron_deepep.transport.node_layout import compute_node_layout, node_limited_topk
    from megatron_deepep.transport.topology import Topology

    args, shape = ctx.args, ctx.shape
    topo = Topology(shape.num_ranks, shape.num_ranks_per_node, shape.rank)
    tested = ctx.make_buffer(max(args.sweep_tokens), max(args.sweep_hidden), shape.topk)
    if tested is None:
        return []
    nics = args.nics_per_node or shape.num_ranks_per_node
    points = []
    for tokens in args.sweep_tokens:
        gen = torch.Generator().manual_seed(ctx.seed * 7919 + tokens * 31 + shape.rank)
        scores = torch.rand(tokens, shape.num_experts, generator=gen)
        if args.node_limited and shape.num_nodes > 1:
            idx = node_limited_topk(scores, num_groups=shape.num_nodes,
                                    group_topk=min(args.node_limited, shape.num_nodes),
                                    topk=shape.topk)[1]
        else:
            idx = torch.topk(scores, k=shape.topk, dim=1).indices
        w = torch.rand(tokens, shape.topk, generator=gen)
        mine = internode_model.source_counts(
            compute_node_layout(idx, shape.num_experts, topo))
        rows = internode_model.accumulate_rank_rows(ctx.gather(mine), shape.num_ranks_per_node)
        d_idx, d_w = idx.to(ctx.device), w.to(ctx.device)
        for hidden in args.sweep_hidden:
            x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(ctx.device)
            fp8 = {"fp8": _fp8_spec(args.fp8)} if args.fp8 else {}
            times = {"dispatch": [], "combine": []}
            for i in range(args.warmup + args.iters):
                us, (recv_x, _, handle, _) = ctx.timed(lambda: tested.dispatch(
                    x, d_idx, d_w, num_experts=shape.num_experts, **fp8))
                if args.fp8:
                    recv_x = torch.zeros(handle.num_recv_rows, hidden, dtype=torch.bfloat16,
                                         device=ctx.device)
                us_c, _ = ctx.timed(lambda: tested.combine(recv_x, handle))
                if i >= args.warmup:
                    times["dispatch"].append(us)
                    times["combine"].append(us_c)
            medians = ctx.gather({p: statistics.median(t) for p, t in times.items()})
            for phase in ("dispatch", "combine"):
                slowest = max(m[phase] for m in medians)
                row_bytes = _row_bytes(hidden, args.fp8) if phase == "dispatch" else 2 * hidden
                point = sweep_point(rows, row_bytes, slowest, shape.num_ranks_per_node, nics)
                point.update(tokens=tokens, hidden=hidden, phase=phase,
                             wire=(args.fp8 or "bf16") if phase == "dispatch" else "bf16")
                points.append(point)
    tested.destroy()
    refusal = bandwidth_refusal(ctx.transport_ran)
    if refusal:
        points = [refuse_bandwidth(p, refusal) for p in points]
    if shape.rank == 0:
        ctx.say(format_sweep(points))
    return points


_GBPS_FIELDS = ("gbps_per_rank", "gbps_per_nic", "nvlink_gbps_per_rank")


def refuse_bandwidth(point: dict, reason: str) -> dict:
    """A sweep point without its GB/s (the times and bytes stay), saying why."""
    out = {k: v for k, v in point.items() if k not in _GBPS_FIELDS}
    out["gbps_refused"] = reason
    return out


def format_sweep(points: Sequence[dict]) -> str:
    """The table rank 0 prints."""
    header = (f"  {'tokens':>6} {'hidden':>6} {'phase':<8} {'wire':<16} {'net MB':>7} "
              f"{'NVL MB':>7} {'us':>9} {'GB/s/rank':>9} {'GB/s/NIC':>9} {'NVL GB/s':>9}")
    lines = [header, "  " + "-" * (len(header) - 2)]
    for p in points:
        rates = (f"{'-':>9} {'-':>9} {'-':>9}" if "gbps_refused" in p else
                 f"{p['gbps_per_rank']:>9.2f} {p['gbps_per_nic']:>9.2f} "
                 f"{p['nvlink_gbps_per_rank']:>9.2f}")
        lines.append(
            f"  {p['tokens']:>6} {p['hidden']:>6} {p['phase']:<8} {p['wire']:<16} "
            f"{p['network_bytes_per_rank'] / 1e6:>7.2f} {p['nvlink_bytes_per_rank'] / 1e6:>7.2f}"
            f" {p['us']:>9.1f} {rates}")
    refused = next((p["gbps_refused"] for p in points if "gbps_refused" in p), None)
    if refused:
        lines.append(f"  GB/s: none, {refused}")
    lines.append("  MB: 1e6 bytes on the busiest rank (NIC), the larger of send and receive; "
                 "us: the slowest rank's median; GB/s = those bytes / us (DeepEP's bottleneck "
                 "bandwidth)")
    return "\n".join(lines)


def measured_rates(points: Sequence[dict], source: str) -> dict:
    """What `internode_model --measured-json` reads: per phase, the GB/s per NIC of the point
    with the most network bytes (the least dominated by fixed costs). Empty phases (one node: no
    network bytes) and points without GB/s (the reference transport's) are left out."""
    out = {"source": source}
    for phase in ("dispatch", "combine"):
        mine = [p for p in points if p["phase"] == phase and p["network_bytes_per_nic"] > 0
                and "gbps_refused" not in p]
        if mine:
            best = max(mine, key=lambda p: (p["network_bytes_per_nic"], -p["us"]))
            out[phase] = {"network_gbps": best["gbps_per_nic"]}
    return out


# ---------------------------------------------------------------------------------------------
# One rank

class Context:
    """One rank's process group, control group, device and output."""

    def __init__(self, args, device: torch.device, ctrl, shape: Shape, seed: int):
        self.args, self.device, self.ctrl, self.shape, self.seed = args, device, ctrl, shape, seed
        self.transport_ran: Optional[str] = None  # the tested Buffer's transport_name

    def say(self, text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def log_traceback(self, text: str) -> None:
        sys.stderr.write(f"[rank {self.shape.rank}] {text}")
        sys.stderr.flush()

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order (over the gloo control group)."""
        out = [None] * self.shape.num_ranks
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.ctrl)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn):
        """(µs, result) of `fn` started together on all ranks: CUDA events on a GPU."""
        self.barrier()
        if self.device.type != "cuda":
            start = time.perf_counter()
            result = fn()
            return (time.perf_counter() - start) * 1e6, result
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        result = fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e3, result

    def make_buffer(self, max_tokens: int, hidden: int, topk: int):
        """The tested Buffer, or None after rank 0 said why it could not be built."""
        from megatron_deepep.buffer import Buffer

        kwargs = dict(transport=self.args.transport, num_sms=self.args.num_sms,
                      timeout_s=self.args.timeout_s)
        if self.args.num_ranks_per_node is not None:
            kwargs["num_ranks_per_node"] = self.args.num_ranks_per_node
        try:
            buf = Buffer(dist.group.WORLD, max_tokens, hidden, topk, **kwargs)
            error = None
        except Exception as e:  # every rank reports; rank 0 prints them
            buf, error = None, f"{type(e).__name__}: {e}"
        errors = self.gather(error)
        if any(errors):
            if buf is not None:
                buf.destroy()
            if self.shape.rank == 0:
                for r, e in enumerate(errors):
                    if e:
                        self.say(f"  rank {r}: Buffer(transport={self.args.transport!r}) "
                                 f"failed: {e}")
            return None
        if buf.transport_name != self.transport_ran:
            self.transport_ran = buf.transport_name
            if self.shape.rank == 0:
                self.say(f"  transport that ran: {buf.transport_name} (--transport "
                         f"{self.args.transport})")
        return buf


def _pick_device(args) -> torch.device:
    want = args.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device here (use --device cpu "
                             "with --transport reference to check the harness)")
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
        index = local % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _pick_backend(args, device: torch.device) -> str:
    if args.backend != "auto":
        return args.backend
    if device.type != "cuda":
        return "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if local_world <= torch.cuda.device_count() else "gloo"


def _tested_buffers(args, num_ranks: int) -> List[tuple]:
    """(tokens per rank, hidden) of the tested Buffers this run builds, one after the other:
    the check's, then the sweep's."""
    return ([(check_max_tokens(args, num_ranks), max(args.check_hidden))] * (not args.skip_check)
            + [(max(args.sweep_tokens), max(args.sweep_hidden))] * (not args.skip_sweep))


def _size_heap(args, shape: Shape) -> Optional[int]:
    """Sets NVSHMEM_SYMMETRIC_SIZE for the largest block of the Buffers this run builds (with
    `auto` staging a larger Buffer may pick a smaller staging), unless it is set or the
    transport uses no NVSHMEM heap (NVSHMEM reads it when the first Buffer starts it)."""
    if os.environ.get("NVSHMEM_SYMMETRIC_SIZE") or shape.num_nodes < 2 or \
            args.transport not in ("internode", "auto"):
        return None
    try:
        heap = max(nvshmem_heap_bytes(tokens, hidden, shape.num_ranks, shape.topk,
                                      shape.num_ranks_per_node)
                   for tokens, hidden in _tested_buffers(args, shape.num_ranks))
    except UsageError:
        return None  # the Buffer itself will say what is wrong
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(heap)
    return heap


def _staging(args, shape: Shape) -> Optional[Dict[str, object]]:
    """The internode staging the knobs select for the Buffer the sweep times (the check's
    without a sweep), so reports name what they timed; None when the run has no internode
    transport or the knobs are invalid (the Buffer then says what is wrong)."""
    from megatron_deepep.transport import internode_regions as regions

    if shape.num_nodes < 2 or args.transport not in ("internode", "auto"):
        return None
    tokens, hidden = _tested_buffers(args, shape.num_ranks)[-1]
    try:
        staging, ring_slots, net_chunks = regions.choose_staging(
            shape.num_ranks, shape.num_ranks_per_node, tokens, hidden, shape.topk)
    except ValueError:
        return None
    return {"name": regions.describe_staging(staging, ring_slots, net_chunks),
            "mode": staging, "ring_slots": ring_slots, "net_chunks": net_chunks}


def run_rank(args) -> int:
    """Everything one rank does once the launch environment is set; returns the exit status."""
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    device = _pick_device(args)
    backend = _pick_backend(args, device)
    if backend == "gloo" and device.type == "cuda" and args.transport == "reference":
        device = torch.device("cpu")  # gloo's all-to-all takes CPU tensors only
    timeout = datetime.timedelta(seconds=max(600.0, 3 * args.timeout_s))
    dist.init_process_group(backend, init_method="env://", timeout=timeout)
    try:
        return _run_rank(args, device, backend)
    finally:
        dist.destroy_process_group()


def _run_rank(args, device: torch.device, backend: str) -> int:
    from megatron_deepep.transport.topology import detect_topology

    rank, world = dist.get_rank(), dist.get_world_size()
    ctrl = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    seed = torch.tensor([args.seed if args.seed is not None else secrets.randbelow(2**31)])
    dist.broadcast(seed, src=0, group=ctrl)
    try:
        topo = detect_topology(ctrl, args.num_ranks_per_node)
    except ValueError as e:
        if rank == 0:
            sys.stderr.write(f"multinode_check: {e}\n")
        return 2
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=ctrl)
    num_experts = args.num_experts or default_num_experts(world)
    problem = None
    if num_experts % world:
        problem = f"--num-experts {num_experts} must be a multiple of the rank count {world}"
    elif args.topk > num_experts:
        problem = f"--topk {args.topk} exceeds --num-experts {num_experts}"
    elif args.nics_per_node is not None and not 1 <= args.nics_per_node <= \
            topo.num_ranks_per_node:
        problem = (f"--nics-per-node must be in [1, {topo.num_ranks_per_node}] (ranks per "
                   f"node), got {args.nics_per_node}")
    if problem:
        if rank == 0:
            sys.stderr.write(f"multinode_check: {problem}\n")
        return 2
    shape = Shape(rank, world, topo.num_ranks_per_node, num_experts, args.topk)
    heap = _size_heap(args, shape)
    staging = _staging(args, shape)
    ctx = Context(args, device, ctrl, shape, int(seed))
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        ctx.say(f"multinode_check: transport {args.transport}, {world} ranks = "
                f"{topo.num_nodes} nodes x {topo.num_ranks_per_node} on {len(set(hosts))} "
                f"host(s), {name}, backend {backend}, {num_experts} experts, top-{args.topk}, "
                f"seed {int(seed)}")
        if staging:
            ctx.say(f"  internode staging: {staging['name']} (MDEEP_INTERNODE_STAGING, "
                    "MDEEP_INTERNODE_RING_SLOTS, MDEEP_INTERNODE_NET_RING_CHUNKS)")
        if heap:
            ctx.say(f"  NVSHMEM_SYMMETRIC_SIZE={heap} (from Buffer.size_hint; export it to "
                    f"choose)")
        if len(set(hosts)) == 1 and topo.num_nodes > 1:
            ctx.say("  virtual nodes on one host: the sweep times processes sharing one "
                    "machine (on a GPU: NVSHMEM's P2P path), not a network")
    ok = True
    if not args.skip_check:
        ok = run_check(ctx)
        if rank == 0:
            ctx.say(f"correctness: {'PASSED' if ok else 'FAILED'} (replay with --seed "
                    f"{int(seed)})")
    points = []
    if ok and not args.skip_sweep:
        points = run_sweep(ctx)
    if rank == 0 and args.json:
        source = (f"multinode_check {ctx.transport_ran or args.transport}, {topo.num_nodes} x "
                  f"{topo.num_ranks_per_node} on {len(set(hosts))} host(s), "
                  f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")
        doc = measured_rates(points, source)
        doc.update(passed=ok, seed=int(seed), sweep=points,
                   setup={"ranks": world, "nodes": topo.num_nodes,
                          "ranks_per_node": topo.num_ranks_per_node, "hosts": len(set(hosts)),
                          "transport": args.transport, "transport_ran": ctx.transport_ran,
                          "experts": num_experts,
                          "topk": args.topk, "fp8": args.fp8,
                          "nics_per_node": args.nics_per_node or topo.num_ranks_per_node,
                          "staging": staging})
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        ctx.say(f"written to {args.json}")
    dist.barrier(group=ctrl)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# Launch

def _launch_env() -> None:
    """Maps srun's variables to torch's env:// ones when torchrun did not set them."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    if "SLURM_PROCID" not in os.environ:
        raise UsageError("no launcher found: run under torchrun (RANK, WORLD_SIZE), under srun "
                         "(SLURM_PROCID, SLURM_NTASKS), or pass --spawn N for N local processes")
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if per_node.isdigit():
        os.environ.setdefault("LOCAL_WORLD_SIZE", per_node)
    if "MASTER_ADDR" not in os.environ:
        raise UsageError("under srun, export MASTER_ADDR (and MASTER_PORT) first, e.g. "
                         "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head "
                         "-n 1) MASTER_PORT=29500")
    os.environ.setdefault("MASTER_PORT", "29500")


def _spawned(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        results.put((rank, run_rank(args)))
    except BaseException:
        traceback.print_exc()
        results.put((rank, 1))


def spawn(args, timeout_s: float = 3600.0) -> int:
    """Runs `args.spawn` local ranks; the worst exit status."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_spawned, args=(r, args.spawn, port, args, results))
             for r in range(args.spawn)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    codes = {}
    while not results.empty():
        rank, code = results.get()
        codes[rank] = code
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            codes[r] = 1
        elif r not in codes:
            codes[r] = 1 if p.exitcode else 0
    return max(codes.values())


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
        if args.print_nvshmem_size:
            print(nvshmem_heap_bytes(args.max_tokens, args.max_hidden, args.ranks, args.topk,
                                     args.num_ranks_per_node))
            return 0
        if args.spawn:
            return spawn(args)
        _launch_env()
        return run_rank(args)
    except UsageError as e:
        sys.stderr.write(f"multinode_check: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
