#!/usr/bin/env python3
"""DeepEP's intranode dispatch/combine beside ours: R processes sharing one GPU.

    python3 dev/gpu/deepep_side_by_side.py --deepep BUILT_DEEPEP --ranks 2,4,8 --json OUT.json
    python3 dev/gpu/deepep_side_by_side.py --deepep BUILT_DEEPEP --concurrent ...   # under MPS
    python3 dev/gpu/deepep_side_by_side.py --deepep BUILT --concurrent --ranks 2 --num-sms 8,16
    python3 dev/gpu/deepep_side_by_side.py --skip-deepep ...                         # ours only
    python3 dev/gpu/deepep_side_by_side.py --deepep BUILT --skip-ours --check-only ...  # alone

For each R and SM budget, R processes (gloo control plane, every one on GPU 0: NCCL refuses two
ranks on one GPU) build our `Buffer` (transport "nvlink": CUDA IPC between the processes) and
DeepEP's V1 `deep_ep.Buffer` (intranode: `cudaIpcOpenMemHandle` of every peer's NVL buffer;
DeepEP checks neither device ids nor peer access, so processes of one GPU pass its set-up) on the
same inputs and SM budget. Three rows per R:
- `ours`: our dispatch, which writes the expert-major rows grouped GEMMs take, and combine;
- `deepep`: DeepEP's dispatch (token-major rows, one per (token, destination rank)) and combine;
- `deepep+permute`: what megatron-core's flex dispatcher runs with the DeepEP backend to feed
  grouped experts, through Megatron's own code (`_DeepepManager.dispatch`: layout and dispatch
  with the flex dispatcher's async defaults; `get_permuted_hidden_states_by_experts`: the routing
  map from the received top-k, then `moe_utils.permute(..., fused=True)`, TE's fused permute),
  and for combine `get_restored_hidden_states_by_experts` (`moe_utils.unpermute(...,
  fused=True)`) then `_DeepepManager.combine`. Needs megatron-core (0.19.2 on the GPU machine)
  and Transformer Engine; without them the row names the import error.
Per implementation:
- check: bf16 and FP8 (e4m3 + one fp32 scale per 128 values, DeepEP's own wire format, made by
  `fp8.formats` blockwise_1x128_fp32_scales) dispatch at `--check-tokens` tokens against
  `tests/helpers/oracle.py` (DeepEP's rows are expanded into the oracle's expert-major (source
  rank, token, k) order through its handle's rank prefix matrix and source indices; Megatron's
  permuted rows are compared in their own order first and, if that differs, as a multiset per
  expert segment, and the check says which), and combine against `oracle_combine`;
- time: at `--tokens` tokens, dispatch with its layout and host wait, cached dispatch, combine,
  FP8 dispatch: the slowest rank's median µs by CUDA events, calls back to back after a barrier,
  and the median host µs a call takes to return (no synchronization inside the timed loop).
With `--concurrent` (the ranks run at once under MPS, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE set to
100 / R by this script, or `--mps-percentage`), bandwidths per rank (see `BANDWIDTHS`): each
side's own rows, the algorithm's token rows (the same numerator for all three) and the HBM bytes
each side moves (`hbm_rows`), per rank and summed over the ranks (one HBM carries them all).
Without it the processes take turns on the GPU and the µs measure progress, not speed. The SM
budget is `--num-sms` (a list sweeps it), capped under `--concurrent` at the even number of SMs a
rank's share gives (132 x 100 / R % on an H200).

Each rank writes its results into a folder as it goes, with the seconds since it started at every
stage, so a rank that hangs or dies (DeepEP traps after ~100 s in a kernel; a CUDA error under MPS
reaches every client) leaves what it reached, when, and the exact error it met; a rank whose
DeepEP call raised a CUDA error leaves at once (exit 3: a faulted context can hang its teardown).
The parent merges them, prints the tables and writes `--json`. `--model-json OUT` writes what
`internode_model --measured-json` reads from a concurrent run (our worst rank's token-row GB/s as
`kernel_gbps`). Exit status: 0 every check that ran passed, 1 a check failed or a rank died,
2 bad arguments (one line).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
H200_SMS = 132
IMPLS = ("ours", "deepep", "deepep+permute")
PERMUTED = "deepep+permute"
FP8_FORMAT = "blockwise_1x128_fp32_scales"  # e4m3 + fp32 scale_inv per 128: DeepEP's format
TIMED = ("dispatch", "cached", "combine", "fp8_dispatch")
BANDWIDTHS = """GB/s per rank, worst rank: own = the rows the side itself writes (ours: expert-major
rows; deepep: token-major rows, one per (token, destination rank); deepep+permute: both) x row
bytes / its µs; alg = token rows x row bytes / µs (the same numerator for all three); HBM = the
rows the side reads and writes in HBM (`hbm_rows`: dispatch: deepep 4 per token row (read x,
write the peer's ring, read the ring, write recv_x), ours 3 per peer token row + 1 per own token
row + 1 per expert row, the permute 1 read per token row + 1 write per expert row; combine:
deepep 3 per token row + 1 per output row, ours 1 per expert row + 2 per peer token row + 1 per
output row, the unpermute 1 read per expert row + 1 write per token row) x row bytes / µs, as
`rank` (the worst rank) and `sum` (every rank's bytes over the slowest rank's µs: one HBM)"""
FP8_PERMUTE_NOTE = """deepep+permute fp8: megatron-core 0.19.2's flex dispatcher hands DeepEP bf16
hidden states only (fused_a2a's FusedDispatch takes one tensor and sizes the buffer from its
second dimension; FP8 runs quantize inside TE's GEMMs, after the bf16 dispatch and permute). Its
fp8 column is the closest path: DeepEP's FP8 dispatch, then the manager's permute of the e4m3
rows (with the probs) and `moe_utils.permute` of the fp32 scales with the same routing map"""
_DEVICE = {"name": "cuda"}  # set by each worker: "cpu" under --cpu (host timers)


class UsageError(Exception):
    """A bad argument or folder (exit status 2, one line)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dev/gpu/deepep_side_by_side.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("--deepep", metavar="DIR",
                   help="a built DeepEP V1 folder (deep_ep/ and deep_ep_cpp*.so: "
                        "dev/gpu/deepep.sh builds it)")
    p.add_argument("--skip-deepep", action="store_true", help="ours only")
    p.add_argument("--skip-ours", action="store_true",
                   help="DeepEP alone (its rows only): no kernel of ours in its processes")
    p.add_argument("--skip-permute", action="store_true",
                   help="no deepep+permute row (megatron-core and TE not installed)")
    p.add_argument("--permute-fused", choices=("auto", "on", "off"), default="auto",
                   help="Megatron's permute through TE's fused kernels (auto: on with a GPU)")
    p.add_argument("--ranks", default="2,4,8", help="EP sizes to run, comma-separated")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank, timed")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-sms", default="24",
                   help="SM budget of every side (even); a comma-separated list sweeps it")
    p.add_argument("--check-tokens", type=int, default=256, help="tokens per rank, checked")
    p.add_argument("--iters", type=int, default=20, help="timed calls per figure")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before them")
    p.add_argument("--concurrent", action="store_true",
                   help="the ranks run at once (MPS daemon up): sets "
                        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/R and reports GB/s")
    p.add_argument("--mps-percentage", type=int, default=0,
                   help="with --concurrent: every rank's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE "
                        "(default 100/R; 100: each rank may use the whole GPU)")
    p.add_argument("--check-only", action="store_true", help="the checks, no timing")
    p.add_argument("--timeout-s", type=float, default=240.0,
                   help="per EP size: the processes are stopped after it")
    p.add_argument("--json", metavar="OUT", help="every rank's results and the table rows")
    p.add_argument("--model-json", metavar="OUT",
                   help="with --concurrent: internode_model --measured-json input")
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    p.add_argument("--cpu", action="store_true",
                   help="smoke test of this script without a GPU: ours on the reference "
                        "transport, host timers, no DeepEP")
    return p


def parse_ints(text: str, flag: str) -> list:
    """Comma-separated integers; raises UsageError naming `flag`."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers")
    if not values:
        raise UsageError(f"{flag} {text!r}: no value")
    return values


def check_args(args) -> tuple:
    """`(ranks, sm_budgets)`: the EP sizes and SM budgets; raises UsageError naming the
    argument."""
    ranks = parse_ints(args.ranks, "--ranks")
    if any(r not in (2, 4, 8) for r in ranks):
        raise UsageError(f"--ranks {args.ranks!r}: DeepEP's intranode kernels take 2, 4 or 8")
    for r in ranks:
        if args.experts % r:
            raise UsageError(f"--experts {args.experts} is not a multiple of {r} ranks")
    budgets = parse_ints(args.num_sms, "--num-sms")
    for sms in budgets:
        if sms < 2 or sms % 2:
            raise UsageError(f"--num-sms {sms}: DeepEP needs an even count >= 2")
    if args.skip_ours and args.skip_deepep:
        raise UsageError("--skip-ours with --skip-deepep leaves nothing to run")
    if not 0 <= args.mps_percentage <= 100:
        raise UsageError(f"--mps-percentage {args.mps_percentage}: expected 1 to 100")
    if args.hidden % 128:
        raise UsageError(f"--hidden {args.hidden}: FP8 scales cover 128 values each")
    if args.cpu and not args.skip_deepep:
        raise UsageError("--cpu runs ours alone: add --skip-deepep")
    if not args.skip_deepep:
        if not args.deepep:
            raise UsageError("--deepep DIR is required (or --skip-deepep)")
        if not os.path.isdir(args.deepep):
            raise UsageError(f"--deepep {args.deepep}: no such folder")
        if not glob.glob(os.path.join(args.deepep, "deep_ep_cpp*.so")):
            raise UsageError(f"--deepep {args.deepep}: no deep_ep_cpp*.so in it (build it "
                             f"first: dev/gpu/deepep.sh)")
    if args.model_json and not args.concurrent:
        raise UsageError("--model-json needs --concurrent (speed only when the ranks run at "
                         "once)")
    return ranks, budgets


def mps_percentage(num_ranks: int, override: int = 0) -> int:
    """A rank's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: `override`, else 100 / R."""
    return override or 100 // num_ranks


def sm_budget(num_sms: int, num_ranks: int, concurrent: bool, device_sms: int,
              percentage: int = 0) -> int:
    """Every side's SM budget: `num_sms`, or under MPS the even SM count of one rank's share
    (`percentage`, default 100 / R, % of the device's SMs) when that is smaller."""
    if not concurrent:
        return num_sms
    share = device_sms * mps_percentage(num_ranks, percentage) // 100
    return max(2, min(num_sms, share - share % 2))


def row_bytes(hidden: int, wire: str) -> int:
    """Bytes of one token on the wire: bf16 2H; FP8 e4m3 H + one fp32 scale per 128."""
    return 2 * hidden if wire == "bf16" else hidden + 4 * (hidden // 128)


# ---------------------------------------------------------------------------------------------
# Inputs and the oracle (CPU; every rank makes every rank's inputs from the seeds)

def make_inputs(num_ranks: int, num_tokens: int, hidden: int, experts: int, topk: int,
                seed: int, rows_of=None):
    """`[R]` of (x [N, H] bf16, topk_idx [N, K] int64, topk_weights [N, K] fp32), on the CPU;
    with `rows_of` (a rank), x only for that rank (None for the others: routing is all a rank
    needs of its peers' inputs at the timed size)."""
    import torch

    out = []
    for r in range(num_ranks):
        x = None
        if rows_of is None or rows_of == r:
            gen = torch.Generator().manual_seed(seed * 1009 + r)
            x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
        gen = torch.Generator().manual_seed(seed * 1009 + r + 500009)
        scores = torch.rand(num_tokens, experts, generator=gen)
        weights, idx = scores.topk(topk, dim=1)
        out.append((x, idx.to(torch.int64), (weights / weights.sum(1, keepdim=True)).float()))
    return out


def oracle(inputs, experts: int, rows=None):
    """`tests.helpers.oracle.oracle_dispatch` of every rank (ids and weights as numpy: the oracle's
    Python loops index them ~30x faster than tensors); `rows` replaces each rank's x."""
    from tests.helpers.oracle import oracle_dispatch

    xs = [x for x, _, _ in inputs] if rows is None else rows
    return oracle_dispatch(xs, [i.numpy() for _, i, _ in inputs],
                           [w.numpy() for _, _, w in inputs], experts)


def received_tokens(inputs, rank: int, experts: int) -> int:
    """Tokens rank `rank` receives, its own included, once per token (DeepEP's recv rows)."""
    return row_counts(inputs, rank, experts)["token_rows"]


def row_counts(inputs, rank: int, experts: int) -> dict:
    """The rows rank `rank` handles in one call.

    Returns:
        `token_rows`: (source rank, token) pairs it receives, its own included (DeepEP's
        token-major rows); `self_rows`: those of its own tokens; `expert_rows`: (source, token,
        expert) entries on its experts (ours' and the permute's expert-major rows); `tokens_out`:
        its own tokens with an expert anywhere (the rows its combine writes).
    """
    per_rank = experts // len(inputs)
    counts = {"token_rows": 0, "self_rows": 0, "expert_rows": 0, "tokens_out": 0}
    for source, (_, idx, _) in enumerate(inputs):
        here = (idx >= 0) & ((idx // per_rank) == rank)
        tokens_here = int(here.any(1).sum())
        counts["token_rows"] += tokens_here
        counts["expert_rows"] += int(here.sum())
        if source == rank:
            counts["self_rows"] = tokens_here
            counts["tokens_out"] = int((idx >= 0).any(1).sum())
    return counts


def own_rows(impl: str, counts: dict) -> int:
    """The rows one side itself writes per call (its own GB/s numerator; `BANDWIDTHS`)."""
    if impl == "ours":
        return counts["expert_rows"]
    if impl == "deepep":
        return counts["token_rows"]
    return counts["token_rows"] + counts["expert_rows"]


def hbm_rows(impl: str, op: str, counts: dict) -> int:
    """Rows one side reads plus writes in HBM per call on one GPU (`BANDWIDTHS`): a "remote"
    write is an HBM write there. Upper bounds: a read that hits L2 counts as a read."""
    peer = counts["token_rows"] - counts["self_rows"]
    if op == "combine":
        deepep = 3 * counts["token_rows"] + counts["tokens_out"]
        if impl == "ours":
            return counts["expert_rows"] + 2 * peer + counts["tokens_out"]
        if impl == "deepep":
            return deepep
        return deepep + counts["expert_rows"] + counts["token_rows"]
    deepep = 4 * counts["token_rows"]
    if impl == "ours":
        return 3 * peer + counts["self_rows"] + counts["expert_rows"]
    if impl == "deepep":
        return deepep
    return deepep + counts["token_rows"] + counts["expert_rows"]


# ---------------------------------------------------------------------------------------------
# DeepEP's output in the oracle's order

def deepep_expert_major(recv_rows, recv_idx, recv_w, handle, inputs, rank: int, experts: int):
    """DeepEP's received rows (one per (source rank, token), grouped by source rank) expanded
    into expert-major rows, the oracle's order.

    Args:
        recv_rows: `[M_tok, C]` any dtype, DeepEP's `recv_x` (or its scales) on the CPU.
        recv_idx: `[M_tok, K]` int64 local expert ids (-1: not this rank's), or None.
        recv_w: `[M_tok, K]` fp32, or None.
        handle: DeepEP's intranode handle (rank_prefix_matrix, ..., recv_src_idx, ...).
        inputs: every rank's (x, topk_idx, topk_weights) (the routing names the entries).

    Returns:
        `(rows [M, C], weights [M] or None, ids_ok)`: ids_ok says whether every entry's
        `recv_idx` is its local expert id.
    """
    import torch

    num_ranks = len(inputs)
    per_rank = experts // num_ranks
    prefix = handle[0].cpu()[:, rank].long()  # tokens from ranks 0..s to this rank
    src_idx = handle[3].cpu().long()
    keys, rows_at, ks = [], [], []
    start = 0
    for s, (_, idx, _) in enumerate(inputs):
        end = int(prefix[s])
        row_of = torch.full((idx.shape[0],), -1, dtype=torch.long)
        row_of[src_idx[start:end]] = torch.arange(start, end)
        start = end
        n, k = torch.nonzero((idx // per_rank) == rank, as_tuple=True)
        local = idx[n, k] - rank * per_rank
        keys.append(((local * num_ranks + s) * idx.shape[0] + n) * idx.shape[1] + k)
        rows_at.append(row_of[n])
        ks.append(k)
    keys, rows_at, ks = torch.cat(keys), torch.cat(rows_at), torch.cat(ks)
    order = torch.argsort(keys)
    rows_at, ks = rows_at[order], ks[order]
    if (rows_at < 0).any():
        raise AssertionError(f"{int((rows_at < 0).sum())} routed entries have no received row")
    out_rows = recv_rows[rows_at]
    weights = recv_w[rows_at, ks] if recv_w is not None else None
    ids_ok = True
    if recv_idx is not None:
        local = (keys[order] // (num_ranks * inputs[0][1].shape[0] * inputs[0][1].shape[1]))
        ids_ok = bool(torch.equal(recv_idx[rows_at, ks], local))
    return out_rows, weights, ids_ok


def one_row_per_rank(oracle_rows, sources):
    """Oracle rows where a (source, token)'s first entry on a rank keeps its row and the others
    are zero: summing them per rank gives the one row DeepEP's combine sends back."""
    out = oracle_rows.clone()
    seen = set()
    for i, src in enumerate(sources):
        if src is None:
            continue
        key = src[:2]
        if key in seen:
            out[i] = 0
        seen.add(key)
    return out


def compare(name: str, got, want) -> str:
    """"" when `got` equals `want` bit for bit, else what differs."""
    import torch

    if tuple(got.shape) != tuple(want.shape):
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype in (torch.float8_e4m3fn,):
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if torch.equal(got, want):
        return ""
    diff = (got.float() - want.float()).abs()
    return f"{name}: {int((diff > 0).sum())} values differ (max {float(diff.max()):.3g})"


def _row_keys(rows, weights):
    """Each row's bytes (and its weight's), for comparing segments as multisets."""
    import torch

    raw = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1)
    if weights is not None:
        raw = torch.cat([raw, weights.contiguous().view(torch.uint8).reshape(rows.shape[0], -1)],
                        1)
    return sorted(bytes(r) for r in raw.numpy())


def compare_permuted(name: str, got, got_w, per_expert, want, want_w) -> tuple:
    """Megatron's permuted rows against the oracle's expert-major rows.

    Megatron groups the rows by local expert; within an expert its order is its own (TE's
    permute keeps the received order, source rank then token, which is the oracle's, but nothing
    promises it). So: in their own order first; if that differs, each expert segment as a
    multiset of (row, weight) pairs.

    Args:
        name: what is compared (named in the problem).
        got: `[M, C]` permuted rows (any dtype); `got_w`: `[M]` permuted probs, or None.
        per_expert: rows per local expert (Megatron's tokens_per_expert).
        want: `[M, C]` the oracle's rows; `want_w`: `[M]` its weights, or None.

    Returns:
        `(problem, how)`: problem "" when they match, how "same order" or "as sets per expert".
    """
    counts = [int(c) for c in per_expert]
    if tuple(got.shape) != tuple(want.shape) or sum(counts) != want.shape[0]:
        return (f"{name}: shape {tuple(got.shape)} (experts hold {sum(counts)} rows) != "
                f"{tuple(want.shape)}"), ""
    if not compare(name, got, want) and (got_w is None or not compare(name, got_w, want_w)):
        return "", "same order"
    start = 0
    for expert, count in enumerate(counts):
        end = start + count
        pick_w = (lambda w: None if w is None else w[start:end])
        if _row_keys(got[start:end], pick_w(got_w)) != _row_keys(want[start:end],
                                                                  pick_w(want_w)):
            return f"{name}: local expert {expert}: rows differ even as a set", ""
        start = end
    return "", "as sets per expert"


# ---------------------------------------------------------------------------------------------
# One rank

class Record:
    """This rank's results, rewritten to its file after every step (a dead rank keeps them),
    with the seconds since the rank started at every stage."""

    def __init__(self, folder: str, rank: int, meta: dict):
        self.path = os.path.join(folder, f"rank{rank}.json")
        self.rank = rank
        self.start = time.monotonic()
        self.data = dict(meta, rank=rank, errors={}, error_t_s={}, stages=[],
                         **{impl: {} for impl in IMPLS})
        self.save()

    def seconds(self) -> float:
        return round(time.monotonic() - self.start, 2)

    def stage(self, impl: str, name: str) -> None:
        """Notes that `impl` starts `name` (DeepEP's stages also go to stdout, beside whatever
        its kernels print)."""
        seconds = self.seconds()
        self.data["stages"].append([seconds, impl, name])
        self.save()
        if impl != "ours":
            print(f"rank {self.rank} [{seconds:.1f} s] {impl}: {name}", flush=True)

    def put(self, impl: str, key: str, value) -> None:
        self.data[impl][key] = value
        self.save()

    def error(self, impl: str, stage: str, exc: BaseException) -> None:
        text = f"{stage}: {type(exc).__name__}: {exc}".strip()
        self.data["errors"][impl] = text[:600]
        self.data["error_t_s"][impl] = self.seconds()
        self.data[impl]["traceback"] = traceback.format_exc()[-1500:]
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def time_us(fn, group, iters: int, warmup: int) -> tuple:
    """`(device µs, host µs)`: the median of `fn()` by CUDA events (host timer per call on the
    CPU), calls back to back after a barrier of every rank, and the median wall time of the
    Python call itself (issuing it: nothing synchronizes inside the loop)."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    if _DEVICE["name"] == "cpu":  # --cpu
        dist.barrier(group=group)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times), statistics.median(times)
    torch.cuda.synchronize()
    dist.barrier(group=group)
    pairs, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs), statistics.median(host)


def timed(rec: Record, impl: str, key: str, fn, group, cfg: dict) -> None:
    """Times `fn` (`time_us`) into `{key}_us` and `{key}_host_us` of `impl`."""
    rec.stage(impl, f"timing {key}")
    device_us, host_us = time_us(fn, group, cfg["iters"], cfg["warmup"])
    rec.put(impl, f"{key}_us", device_us)
    rec.put(impl, f"{key}_host_us", host_us)


def run_ours(rec: Record, cfg: dict, check, full, group) -> None:
    from megatron_deepep.buffer import Buffer
    from megatron_deepep.fp8 import Fp8Dispatch, formats
    from tests.helpers.oracle import oracle_combine

    rank, experts, num_sms = cfg["rank"], cfg["experts"], cfg["num_sms"]
    fmt = formats.FORMATS[FP8_FORMAT]
    device = cfg["device"]
    stage = "Buffer"
    try:
        buf = Buffer(group, cfg["tokens"], cfg["hidden"], cfg["topk"],
                     transport="reference" if device == "cpu" else "nvlink", num_sms=num_sms)
        stage = "check bf16"
        x, idx, w = (t.to(device) for t in check["inputs"][rank])
        recv_x, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=experts)
        want_x, want_w = check["oracle"][rank][:2]
        problems = [compare("rows", recv_x.cpu(), want_x),
                    compare("weights", recv_w.cpu(), want_w)]
        out, _, _ = buf.combine(recv_x, handle)
        want = oracle_combine([o[0] for o in check["oracle"]], [o[3] for o in check["oracle"]],
                              [len(i[0]) for i in check["inputs"]])[rank]
        problems.append(compare("combine", out.cpu(), want))
        rec.put("ours", "check_bf16", "; ".join(p for p in problems if p) or "passed")
        stage = "check fp8"
        pair = tuple(t.to(device) for t in check["fp8"][rank])
        (recv_q, recv_s), _, _, _ = buf.dispatch(pair, idx, w, num_experts=experts,
                                                 fp8=Fp8Dispatch(fmt))
        problems = [compare("e4m3 rows", recv_q.cpu(), check["oracle_q"][rank][0]),
                    compare("scales", recv_s.cpu(), check["oracle_s"][rank][0])]
        rec.put("ours", "check_fp8", "; ".join(p for p in problems if p) or "passed")
        if cfg["check_only"]:
            buf.destroy()
            return
        stage = "timing"
        x, idx, w = (t.to(device) for t in full["inputs"][rank])
        pair = tuple(t.to(device) for t in full["fp8"])
        state = {}

        def dispatch():
            state["out"] = buf.dispatch(x, idx, w, num_experts=experts)

        timed(rec, "ours", "dispatch", dispatch, group, cfg)
        recv_x, _, handle, _ = state["out"]
        timed(rec, "ours", "cached", lambda: buf.dispatch(x, handle=handle), group, cfg)
        y = recv_x.clone()
        timed(rec, "ours", "combine", lambda: buf.combine(y, handle), group, cfg)
        timed(rec, "ours", "fp8_dispatch", lambda: buf.dispatch(
            pair, idx, w, num_experts=experts, fp8=Fp8Dispatch(fmt)), group, cfg)
        buf.destroy()
    except Exception as exc:  # recorded with its stage; DeepEP's side still runs
        rec.error("ours", stage, exc)


class FlexConfig:
    """The TransformerConfig fields megatron-core's `_DeepepManager` reads, set as a bf16 run of
    `--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep --moe-permute-fusion
    --moe-router-dtype fp32` sets them (no capacity factor, no router padding); any other field
    reads None (off)."""

    def __init__(self, num_sms: int, fused: bool):
        self.moe_router_dtype = "fp32"
        self.moe_expert_capacity_factor = None
        self.moe_permute_fusion = fused
        self.moe_flex_dispatcher_num_sms = num_sms
        self.moe_deepep_num_sms = num_sms
        self.moe_router_padding_for_quantization = False
        self.use_transformer_engine_op_fuser = False
        self.fp8 = None
        self.fp4 = None

    def __getattr__(self, name):
        return None


def flex_manager(group, num_local_experts: int, topk: int, num_experts: int, num_sms: int,
                 fused: bool):
    """megatron-core's own `_DeepepManager` (the flex dispatcher's DeepEP backend); where
    megatron-core finds no DeepEP (the CPU tests), one with the attributes its constructor
    sets, so that its permute and unpermute helpers run unchanged."""
    from megatron.core.transformer.moe import token_dispatcher

    manager_class = token_dispatcher._DeepepManager
    config = FlexConfig(num_sms, fused)
    if getattr(token_dispatcher, "fused_dispatch", None) is not None:
        return manager_class(group=group, num_local_experts=num_local_experts, router_topk=topk,
                             num_experts=num_experts, config=config)
    manager = object.__new__(manager_class)
    manager.group, manager.num_local_experts, manager.config = group, num_local_experts, config
    manager.router_topk, manager.num_experts = topk, num_experts
    manager.router_dtype, manager.capacity_factor = "fp32", None
    manager.permute_fusion = fused
    manager.token_indices = manager.token_probs = manager.handle = None
    return manager


def megatron_permute(manager, rows, recv_idx, recv_w, per_expert_list):
    """What the flex dispatcher's `dispatch_postprocess` runs on DeepEP's received rows:
    `_DeepepManager.get_permuted_hidden_states_by_experts` (the routing map from the received
    top-k, then `moe_utils.permute`). Returns `(permuted rows, permuted probs, rows per local
    expert)`."""
    import torch

    manager.dispatched_indices, manager.dispatched_probs = recv_idx, recv_w
    manager.tokens_per_expert = torch.tensor(per_expert_list)
    permuted, probs = manager.get_permuted_hidden_states_by_experts(rows)
    return permuted, probs, manager.tokens_per_expert


def permute_fp8(manager, q, s, recv_idx, recv_w, per_expert_list, view_as):
    """The fp8 column's permute (`FP8_PERMUTE_NOTE`): the e4m3 rows (viewed as `view_as`)
    through the manager with the probs, the scales through `moe_utils.permute` with the same
    routing map."""
    from megatron.core.transformer.moe import moe_utils

    rows, probs, per_expert = megatron_permute(manager, q.view(view_as), recv_idx, recv_w,
                                               per_expert_list)
    scales = moe_utils.permute(s.contiguous(), manager.dispatched_routing_map,
                               num_out_tokens=rows.shape[0], fused=manager.permute_fusion)[0]
    return rows, scales, probs, per_expert


def run_permuted(rec: Record, cfg: dict, check, full, group, buf, dispatch, dispatch_cfg) -> None:
    """The `deepep+permute` row: DeepEP through megatron-core's flex dispatcher code, on the
    same Buffer (megatron-core's `fused_a2a.get_buffer` is handed it: same size rule)."""
    import torch

    rank, experts, num_ranks = cfg["rank"], cfg["experts"], cfg["num_ranks"]
    stage = "import megatron.core"
    try:
        import megatron.core
        from megatron.core.transformer.moe import fused_a2a
        from tests.helpers.oracle import oracle_combine

        rec.put(PERMUTED, "megatron_core", getattr(megatron.core, "__version__", "?"))
        fused = {"on": True, "off": False}.get(cfg["permute_fused"], cfg["device"] == "cuda")
        rec.put(PERMUTED, "fused", fused)
        fused_a2a._buffer = buf  # its get_buffer keeps a Buffer of the group that is big enough
        manager = flex_manager(group, experts // num_ranks, cfg["topk"], experts,
                               cfg["num_sms"], fused)

        def flex_dispatch(x, idx, w):
            """token_dispatch + dispatch_postprocess with the flex dispatcher's defaults."""
            manager.token_indices, manager.token_probs = idx, w
            recv = manager.dispatch(x, async_finish=True, allocate_on_comm_stream=True)
            saved = (manager.dispatched_indices, manager.dispatched_probs,
                     manager.tokens_per_expert, manager.handle)
            permuted, probs = manager.get_permuted_hidden_states_by_experts(recv)
            return permuted, probs, saved

        def flex_combine(y, handle):
            """combine_preprocess + token_combine with the flex dispatcher's defaults."""
            manager.handle = handle
            restored = manager.get_restored_hidden_states_by_experts(y)
            return manager.combine(restored, async_finish=True, allocate_on_comm_stream=True)

        stage = "check bf16"
        rec.stage(PERMUTED, stage)
        x, idx, w = (t.cuda() for t in check["inputs"][rank])
        permuted, probs, saved = flex_dispatch(x, idx, w)
        want_x, want_w = check["oracle"][rank][:2]
        problem, how = compare_permuted("rows", permuted.cpu(), probs.cpu(),
                                        manager.tokens_per_expert, want_x, want_w)
        combined = flex_combine(permuted, saved[3])
        want = oracle_combine([o[0] for o in check["oracle"]], [o[3] for o in check["oracle"]],
                              [len(i[0]) for i in check["inputs"]])[rank]
        problems = [problem, compare("combine", combined.cpu(), want)]
        rec.put(PERMUTED, "order", how)
        rec.put(PERMUTED, "check_bf16", "; ".join(p for p in problems if p) or f"passed ({how})")
        stage = "check fp8"
        rec.stage(PERMUTED, stage)
        pair = tuple(t.cuda() for t in check["fp8"][rank])
        (recv_q, recv_s), recv_idx, recv_w, per_expert_list, _, _ = dispatch(pair, idx, w)
        view_as = torch.float8_e4m3fn
        try:
            rows, scales, _, per_expert = permute_fp8(manager, recv_q, recv_s, recv_idx, recv_w,
                                                      per_expert_list, view_as)
        except (RuntimeError, TypeError, ValueError, KeyError):  # TE refuses e4m3: bytes
            view_as = torch.uint8
            rows, scales, _, per_expert = permute_fp8(manager, recv_q, recv_s, recv_idx, recv_w,
                                                      per_expert_list, view_as)
        rec.put(PERMUTED, "fp8_rows_as", str(view_as))
        problems = [compare_permuted("e4m3 rows", rows.cpu().view(torch.uint8), None,
                                     per_expert, check["oracle_q"][rank][0], None)[0],
                    compare_permuted("scales", scales.cpu(), None, per_expert,
                                     check["oracle_s"][rank][0], None)[0]]
        rec.put(PERMUTED, "check_fp8", "; ".join(p for p in problems if p) or "passed")
        if cfg["check_only"]:
            return
        stage = "timing"
        x, idx, w = (t.cuda() for t in full["inputs"][rank])
        pair = tuple(t.cuda() for t in full["fp8"])
        state = {}

        def fresh():
            state["out"] = flex_dispatch(x, idx, w)

        timed(rec, PERMUTED, "dispatch", fresh, group, cfg)
        permuted, _, (recv_idx, recv_w, per_expert, handle) = state["out"]

        def cached():
            recv = buf.dispatch(x, handle=handle, config=dispatch_cfg)[0]
            megatron_permute(manager, recv, recv_idx, recv_w, per_expert.tolist())

        timed(rec, PERMUTED, "cached", cached, group, cfg)
        y = permuted.clone()
        timed(rec, PERMUTED, "combine", lambda: flex_combine(y, handle), group, cfg)

        def fp8():
            (q, s), f_idx, f_w, f_list, _, _ = dispatch(pair, idx, w)
            permute_fp8(manager, q, s, f_idx, f_w, f_list, view_as)

        timed(rec, PERMUTED, "fp8_dispatch", fp8, group, cfg)
    except Exception as exc:  # Megatron's or TE's exact error, with the stage
        rec.error(PERMUTED, stage, exc)


def run_deepep(rec: Record, cfg: dict, check, full, group) -> None:
    import torch

    rank, experts, num_ranks = cfg["rank"], cfg["experts"], cfg["num_ranks"]
    stage = "import deep_ep"
    try:
        sys.path.insert(0, cfg["deepep"])
        import deep_ep

        rec.put("deepep", "module", getattr(deep_ep, "__file__", "?"))
        stage = "Buffer"
        rec.stage("deepep", stage)
        deep_ep.Buffer.set_num_sms(cfg["num_sms"])
        dispatch_cfg = deep_ep.Buffer.get_dispatch_config(num_ranks)
        combine_cfg = deep_ep.Buffer.get_combine_config(num_ranks)
        hidden_bytes = cfg["hidden"] * 2
        nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
                        for c in (dispatch_cfg, combine_cfg))
        buf = deep_ep.Buffer(group, nvl_bytes, 0, explicitly_destroy=True)
        rec.put("deepep", "nvl_bytes", nvl_bytes)
        # Its pybind Config exposes no fields: the tables of deep_ep/buffer.py at this SM count.
        rec.put("deepep", "configs", f"Buffer.get_dispatch_config / get_combine_config("
                                     f"{num_ranks}) at Buffer.num_sms = {cfg['num_sms']}")

        def dispatch(x, idx, w):
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
            return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=idx,
                                topk_weights=w, config=dispatch_cfg)

        stage = "check bf16"
        rec.stage("deepep", stage)
        x, idx, w = (t.cuda() for t in check["inputs"][rank])
        recv_x, recv_idx, recv_w, _, handle, _ = dispatch(x, idx, w)
        rows, weights, ids_ok = deepep_expert_major(recv_x.cpu(), recv_idx.cpu(), recv_w.cpu(),
                                                    handle, check["inputs"], rank, experts)
        want_x, want_w = check["oracle"][rank][:2]
        problems = [compare("rows", rows, want_x), compare("weights", weights, want_w),
                    "" if ids_ok else "recv_topk_idx: local expert ids differ"]
        rec.stage("deepep", "check bf16 combine")
        combined, _, _ = buf.combine(recv_x, handle, config=combine_cfg)
        from tests.helpers.oracle import oracle_combine

        ys = [one_row_per_rank(o[0], o[3]) for o in check["oracle"]]
        want = oracle_combine(ys, [o[3] for o in check["oracle"]],
                              [len(i[0]) for i in check["inputs"]])[rank]
        problems.append(compare("combine", combined.cpu(), want))
        rec.put("deepep", "check_bf16", "; ".join(p for p in problems if p) or "passed")
        stage = "check fp8"
        rec.stage("deepep", stage)
        pair = tuple(t.cuda() for t in check["fp8"][rank])
        (recv_q, recv_s), recv_idx, recv_w, _, handle, _ = dispatch(pair, idx, w)
        q_rows, _, _ = deepep_expert_major(recv_q.cpu().view(torch.uint8), None, None, handle,
                                           check["inputs"], rank, experts)
        s_rows, _, _ = deepep_expert_major(recv_s.cpu().contiguous(), None, None, handle,
                                           check["inputs"], rank, experts)
        problems = [compare("e4m3 rows", q_rows, check["oracle_q"][rank][0]),
                    compare("scales", s_rows, check["oracle_s"][rank][0])]
        rec.put("deepep", "check_fp8", "; ".join(p for p in problems if p) or "passed")
        if not cfg["check_only"]:
            stage = "timing"
            x, idx, w = (t.cuda() for t in full["inputs"][rank])
            pair = tuple(t.cuda() for t in full["fp8"])
            state = {}

            def fresh():
                state["out"] = dispatch(x, idx, w)

            timed(rec, "deepep", "dispatch", fresh, group, cfg)
            recv_x, _, _, _, handle, _ = state["out"]
            timed(rec, "deepep", "cached",
                  lambda: buf.dispatch(x, handle=handle, config=dispatch_cfg), group, cfg)
            y = recv_x.clone()
            timed(rec, "deepep", "combine", lambda: buf.combine(y, handle, config=combine_cfg),
                  group, cfg)
            timed(rec, "deepep", "fp8_dispatch", lambda: dispatch(pair, idx, w), group, cfg)
    except Exception as exc:  # DeepEP's exact error, with the stage it stopped at
        rec.error("deepep", stage, exc)
        return
    if not cfg["skip_permute"]:
        run_permuted(rec, cfg, check, full, group, buf, dispatch, dispatch_cfg)
    rec.stage("deepep", "destroy")
    buf.destroy()


def cuda_fault(text: str) -> bool:
    """Whether an error's text is a CUDA error (the context is then unusable)."""
    return any(word in text for word in ("CUDA error", "AcceleratorError", "CUDA_ERROR"))


def worker(rank: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    sys.path.insert(0, REPO)
    from megatron_deepep.fp8 import formats

    _DEVICE["name"] = cfg["device"]
    if cfg["device"] == "cuda":
        torch.cuda.set_device(0)
        props = torch.cuda.get_device_properties(0)
    else:  # --cpu smoke test
        torch.set_num_threads(1)
        props = type("Cpu", (), {"name": "cpu", "multi_processor_count": 0})
    num_ranks = cfg["num_ranks"]
    # The share of the SMs the parent saw (a client's own count may already be the MPS-limited
    # one; it is recorded as device_sms).
    num_sms = sm_budget(cfg["num_sms_arg"], num_ranks, cfg["concurrent"], cfg["full_sms"],
                        cfg["mps_percentage"])
    cfg = dict(cfg, rank=rank, num_sms=num_sms)
    rec = Record(cfg["folder"], rank, {
        "num_ranks": num_ranks, "device": props.name, "device_sms": props.multi_processor_count,
        "num_sms": num_sms, "concurrent": cfg["concurrent"], "pid": os.getpid(),
        "mps_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                            world_size=num_ranks,
                            timeout=datetime.timedelta(seconds=cfg["collective_timeout_s"]))
    group = dist.group.WORLD
    fmt = formats.FORMATS[FP8_FORMAT]
    check_inputs = make_inputs(num_ranks, cfg["check_tokens"], cfg["hidden"], cfg["experts"],
                               cfg["topk"], seed=11)
    fp8 = [fmt.quantize(x) for x, _, _ in check_inputs]
    check = {"inputs": check_inputs, "fp8": fp8, "oracle": oracle(check_inputs, cfg["experts"]),
             "oracle_q": oracle(check_inputs, cfg["experts"],
                                [q.view(torch.uint8) for q, _ in fp8]),
             "oracle_s": oracle(check_inputs, cfg["experts"], [s for _, s in fp8])}
    full_inputs = make_inputs(num_ranks, cfg["tokens"], cfg["hidden"], cfg["experts"],
                              cfg["topk"], seed=23, rows_of=rank)
    rec.data["rows"] = row_counts(full_inputs, rank, cfg["experts"])
    rec.data["received_tokens"] = rec.data["rows"]["token_rows"]
    full = {"inputs": full_inputs, "fp8": fmt.quantize(full_inputs[rank][0])}
    if not cfg["skip_ours"]:
        run_ours(rec, cfg, check, full, group)
    if not cfg["skip_deepep"]:
        if not cfg["skip_ours"]:
            dist.barrier(group=group)
        run_deepep(rec, cfg, check, full, group)
        if cuda_fault(rec.data["errors"].get("deepep", "")):
            rec.data["left_early"] = "DeepEP raised a CUDA error: this process left at once"
            rec.save()
            sys.stdout.flush()
            os._exit(3)
    rec.data["done"] = True
    rec.save()
    dist.barrier(group=group)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The parent

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_size(args, num_ranks: int, num_sms: int, full_sms: int) -> dict:
    """R processes for one EP size and SM budget; returns every rank's record and how each
    process ended."""
    import torch.multiprocessing as mp

    if args.concurrent:  # read by the MPS client at CUDA initialization
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(
            mps_percentage(num_ranks, args.mps_percentage))
    folder = tempfile.mkdtemp(prefix=f"side_by_side_r{num_ranks}.")
    cfg = {"num_ranks": num_ranks, "folder": folder, "port": free_port(),
           "device": "cpu" if args.cpu else "cuda",
           "tokens": args.tokens, "hidden": args.hidden, "experts": args.experts,
           "topk": args.topk, "num_sms_arg": num_sms, "check_tokens": args.check_tokens,
           "iters": args.iters, "warmup": args.warmup, "concurrent": args.concurrent,
           "mps_percentage": args.mps_percentage, "check_only": args.check_only,
           "skip_deepep": args.skip_deepep, "skip_ours": args.skip_ours,
           "skip_permute": args.skip_permute, "permute_fused": args.permute_fused,
           "deepep": os.path.abspath(args.deepep or "."),
           "collective_timeout_s": max(30.0, args.timeout_s / 2), "full_sms": full_sms}
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, cfg)) for r in range(num_ranks)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    deadline = t0 + args.timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    ended = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
            ended.append(f"stopped after {args.timeout_s:.0f} s")
        else:
            ended.append(f"exit {p.exitcode}")
    records = []
    for r in range(num_ranks):
        path = os.path.join(folder, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                records.append(json.load(f))
        else:
            records.append({"rank": r, "errors": {
                "ours": "the process wrote nothing (died before its first step)"}})
    return {"num_ranks": num_ranks, "num_sms_arg": num_sms,
            "seconds": time.monotonic() - t0, "ended": ended, "records": records}


def summarize(size: dict, impl: str, hidden: int, concurrent: bool) -> dict:
    """One table row: checks (all ranks), the slowest rank's µs and host µs, and under
    `concurrent` the bandwidths of `BANDWIDTHS` (worst rank; HBM also summed over ranks)."""
    recs = size["records"]
    row = {"num_ranks": size["num_ranks"], "impl": impl,
           "num_sms": recs[0].get("num_sms"),
           "errors": sorted({f"{r['errors'][impl]} (rank {r['rank']}, "
                             f"{r.get('error_t_s', {}).get(impl, '?')} s)"
                             for r in recs if impl in r.get("errors", {})})}
    row["check_failed"] = False
    for check in ("check_bf16", "check_fp8"):
        values = [r.get(impl, {}).get(check, "not run") for r in recs]
        bad = [f"rank {r['rank']}: {v}" for r, v in zip(recs, values)
               if not v.startswith("passed")]
        row[check] = (values[0] if not bad else "not run" if set(values) == {"not run"}
                      else "; ".join(bad)[:300])
        row["check_failed"] |= any(not v.startswith(("passed", "not run")) for v in values)
    for key in TIMED:
        for suffix in ("us", "host_us"):
            times = [r.get(impl, {}).get(f"{key}_{suffix}") for r in recs]
            row[f"{key}_{suffix}"] = max(times) if times and None not in times else None
        if not (concurrent and row[f"{key}_us"] and all(r.get("rows") for r in recs)):
            continue
        wire = "fp8" if key == "fp8_dispatch" else "bf16"
        op = "combine" if key == "combine" else "dispatch"
        size_b = row_bytes(hidden, wire)
        per_rank = [(r["rows"], r[impl][f"{key}_us"] * 1e3) for r in recs]  # ns: bytes/ns = GB/s
        row[f"{key}_gbps"] = min(own_rows(impl, c) * size_b / ns for c, ns in per_rank)
        row[f"{key}_algbw"] = min(c["token_rows"] * size_b / ns for c, ns in per_rank)
        row[f"{key}_hbm_rank"] = min(hbm_rows(impl, op, c) * size_b / ns for c, ns in per_rank)
        row[f"{key}_hbm_sum"] = (sum(hbm_rows(impl, op, c) for c, _ in per_rank) * size_b
                                 / (row[f"{key}_us"] * 1e3))
    return row


def _cell(value, digits: int = 0) -> str:
    return "-" if not value else f"{value:.{digits}f}"


def format_table(rows, args) -> str:
    """The µs table (with each side's own GB/s and host µs) and, under `--concurrent`, the
    bandwidth table (`BANDWIDTHS`)."""
    mode = ("concurrent (MPS, 100/R % of the SMs each)" if args.concurrent else
            "time-sliced (no MPS): µs show progress, not speed; no GB/s")
    lines = [f"side by side on one GPU, {mode}; {args.tokens} tokens/rank, hidden "
             f"{args.hidden}, {args.experts} experts, top-{args.topk}; µs: slowest rank's "
             f"median; GB/s: worst rank, the side's own rows x row bytes / time; host µs: "
             f"median wall time of one call's Python (dispatch / cached / combine / fp8)",
             "| R | impl | SMs | check bf16 | check fp8 | dispatch µs | cached µs | combine µs "
             "| fp8 dispatch µs | dispatch GB/s | combine GB/s | fp8 GB/s | host µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [_cell(row.get(f"{k}_us")) for k in TIMED]
        gbps = [_cell(row.get(f"{k}_gbps")) for k in ("dispatch", "combine", "fp8_dispatch")]
        host = "/".join(_cell(row.get(f"{k}_host_us")) for k in TIMED)
        lines.append(f"| {row['num_ranks']} | {row['impl']} | {row['num_sms']} | "
                     f"{row['check_bf16'][:60]} | {row['check_fp8'][:60]} | "
                     + " | ".join(cells + gbps + [host]) + " |")
    if args.concurrent:
        lines += ["", BANDWIDTHS.replace("\n", " "), "",
                  "| R | impl | SMs | alg dispatch GB/s | alg combine GB/s | HBM dispatch GB/s "
                  "rank / sum | HBM cached rank / sum | HBM combine rank / sum | HBM fp8 rank / "
                  "sum |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            hbm = [f"{_cell(row.get(f'{k}_hbm_rank'))} / {_cell(row.get(f'{k}_hbm_sum'))}"
                   for k in TIMED]
            lines.append(f"| {row['num_ranks']} | {row['impl']} | {row['num_sms']} | "
                         f"{_cell(row.get('dispatch_algbw'))} | "
                         f"{_cell(row.get('combine_algbw'))} | " + " | ".join(hbm) + " |")
    if any(row["impl"] == PERMUTED for row in rows):
        lines += ["", "note: " + FP8_PERMUTE_NOTE.replace("\n", " "),
                  "note: deepep+permute's dispatch and combine run as the flex dispatcher "
                  "calls them (async_finish and allocate_on_comm_stream on); deepep's rows call "
                  "DeepEP synchronously (its own test's default)"]
    for row in rows:
        for err in row["errors"]:
            lines.append(f"error R={row['num_ranks']} SMs={row['num_sms']} {row['impl']}: {err}")
    return "\n".join(lines)


def model_inputs(rows, args) -> dict:
    """`internode_model --measured-json`: our worst rank's token-row GB/s (`_algbw`) with the
    ranks at once, per phase, as `kernel_gbps` (what the kernels push per rank at a 1/R SM
    share; one GPU, so HBM-bound, not NVLink), from the largest EP size measured."""
    ours = [r for r in rows if r["impl"] == "ours" and r.get("dispatch_algbw")]
    if not ours:
        return {}
    best = max(ours, key=lambda r: r["num_ranks"])
    out = {"source": f"MPS on one GPU, ours at EP {best['num_ranks']}, {best['num_sms']} SMs "
                     f"per rank ({100 // best['num_ranks']}% share)"}
    for phase, key in (("dispatch", "dispatch_algbw"), ("combine", "combine_algbw")):
        if best.get(key):
            out[phase] = {"kernel_gbps": best[key]}
    return out


def impls_of(args) -> list:
    """The rows this run makes."""
    impls = [] if args.skip_ours else ["ours"]
    if not args.skip_deepep:
        impls += ["deepep"] + ([] if args.skip_permute else [PERMUTED])
    return impls


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        ranks, budgets = check_args(args)
    except UsageError as exc:
        print(f"deepep_side_by_side: {exc}", file=sys.stderr)
        return 2
    impls = impls_of(args)
    share = (f", MPS share {args.mps_percentage}%" if args.concurrent and args.mps_percentage
             else "")
    plan = (f"deepep_side_by_side: R = {ranks} on one GPU, {'+'.join(impls)}, "
            f"{'concurrent (MPS)' if args.concurrent else 'time-sliced'}{share}, {args.tokens} "
            f"tokens (checked at {args.check_tokens}{', checks only' if args.check_only else ''})"
            f", SM budget {','.join(map(str, budgets))}")
    print(plan, flush=True)
    if args.dry_run:
        return 0
    sys.path.insert(0, REPO)
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    import torch

    # Before any CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is set: the whole GPU's SM count.
    full_sms = (torch.cuda.get_device_properties(0).multi_processor_count
                if torch.cuda.is_available() else H200_SMS)
    sizes, rows = [], []
    for num_ranks in ranks:
        for num_sms in budgets:
            size = run_size(args, num_ranks, num_sms, full_sms)
            sizes.append(size)
            rows += [summarize(size, impl, args.hidden, args.concurrent) for impl in impls]
            print(f"R={num_ranks} SMs={num_sms}: {size['seconds']:.0f} s, processes: "
                  f"{', '.join(size['ended'])}", flush=True)
    table = format_table(rows, args)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "sizes": sizes}, f, indent=1)
    if args.model_json:
        with open(args.model_json, "w") as f:
            json.dump(model_inputs(rows, args), f, indent=1)
    failed = any(r["check_failed"] for r in rows)
    died = any(e != "exit 0" for s in sizes for e in s["ended"])
    return 1 if failed or died else 0


if __name__ == "__main__":
    sys.exit(main())
