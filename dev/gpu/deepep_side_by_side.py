#!/usr/bin/env python3
"""DeepEP's intranode dispatch/combine beside ours: R processes sharing one GPU.

    python3 dev/gpu/deepep_side_by_side.py --deepep BUILT_DEEPEP --ranks 2,4,8 --json OUT.json
    python3 dev/gpu/deepep_side_by_side.py --deepep BUILT_DEEPEP --concurrent ...   # under MPS
    python3 dev/gpu/deepep_side_by_side.py --skip-deepep ...                         # ours only

For each R, R processes (gloo control plane, every one on GPU 0: NCCL refuses two ranks on one
GPU) build our `Buffer` (transport "nvlink": CUDA IPC between the processes) and DeepEP's V1
`deep_ep.Buffer` (intranode: `cudaIpcOpenMemHandle` of every peer's NVL buffer; DeepEP checks
neither device ids nor peer access, so processes of one GPU pass its set-up) on the same inputs
and SM budget, then per implementation:
- check: bf16 and FP8 (e4m3 + one fp32 scale per 128 values, DeepEP's own wire format, made by
  `fp8.formats` blockwise_1x128_fp32_scales) dispatch at `--check-tokens` tokens against
  `tests/helpers/oracle.py` (DeepEP's rows, one per (token, destination rank) grouped by source rank,
  are expanded into the oracle's expert-major (source rank, token, k) order through its handle's
  rank prefix matrix and source indices; rows, weights and local expert ids must match bit for
  bit), and combine against `oracle_combine` (for DeepEP, which sums one row per rank, the
  oracle is given each rank's row once);
- time: at `--tokens` tokens, dispatch with its layout and host wait, cached dispatch, combine,
  FP8 dispatch: the slowest rank's median µs by CUDA events, calls back to back after a barrier.
GB/s per rank (DeepEP's test metric: the tokens a rank receives, its own included, once per
token, times the row bytes, over the time; the same bytes for both) are printed only with
`--concurrent`, i.e. when the ranks run at once (MPS, with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
set to 100 / R by this script); without it the processes take turns on the GPU and the µs
measure correctness of progress, not speed. The SM budget is `--num-sms`, capped under
`--concurrent` at the even number of SMs a rank's share gives (132 x 100 / R % on an H200).

Each rank writes its results into a folder as it goes, so a rank that hangs or dies (DeepEP
traps after ~100 s in a kernel) leaves what it reached and the exact error it met; the parent
merges them, prints one table and writes `--json`. `--model-json OUT` writes what
`internode_model --measured-json` reads from a concurrent run (our worst rank's GB/s as
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
IMPLS = ("ours", "deepep")
FP8_FORMAT = "blockwise_1x128_fp32_scales"  # e4m3 + fp32 scale_inv per 128: DeepEP's format
TIMED = ("dispatch", "cached", "combine", "fp8_dispatch")
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
    p.add_argument("--ranks", default="2,4,8", help="EP sizes to run, comma-separated")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank, timed")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-sms", type=int, default=24, help="SM budget of both (even)")
    p.add_argument("--check-tokens", type=int, default=256, help="tokens per rank, checked")
    p.add_argument("--iters", type=int, default=20, help="timed calls per figure")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before them")
    p.add_argument("--concurrent", action="store_true",
                   help="the ranks run at once (MPS daemon up): sets "
                        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/R and reports GB/s")
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


def check_args(args) -> list:
    """The EP sizes; raises UsageError naming the argument."""
    try:
        ranks = [int(v) for v in args.ranks.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--ranks {args.ranks!r}: expected comma-separated integers")
    if not ranks or any(r not in (2, 4, 8) for r in ranks):
        raise UsageError(f"--ranks {args.ranks!r}: DeepEP's intranode kernels take 2, 4 or 8")
    for r in ranks:
        if args.experts % r:
            raise UsageError(f"--experts {args.experts} is not a multiple of {r} ranks")
    if args.num_sms < 2 or args.num_sms % 2:
        raise UsageError(f"--num-sms {args.num_sms}: DeepEP needs an even count >= 2")
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
    return ranks


def sm_budget(num_sms: int, num_ranks: int, concurrent: bool, device_sms: int) -> int:
    """Both implementations' SM budget: `num_sms`, or under MPS the even SM count of one rank's
    share (100 / R % of the device's SMs) when that is smaller."""
    if not concurrent:
        return num_sms
    share = device_sms * (100 // num_ranks) // 100
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
    per_rank = experts // len(inputs)
    return sum(int(((idx // per_rank) == rank).any(1).sum()) for _, idx, _ in inputs)


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


# ---------------------------------------------------------------------------------------------
# One rank

class Record:
    """This rank's results, rewritten to its file after every step (a dead rank keeps them)."""

    def __init__(self, folder: str, rank: int, meta: dict):
        self.path = os.path.join(folder, f"rank{rank}.json")
        self.data = dict(meta, rank=rank, ours={}, deepep={}, errors={})
        self.save()

    def put(self, impl: str, key: str, value) -> None:
        self.data[impl][key] = value
        self.save()

    def error(self, impl: str, stage: str, exc: BaseException) -> None:
        text = f"{stage}: {type(exc).__name__}: {exc}".strip()
        self.data["errors"][impl] = text[:600]
        self.data[impl]["traceback"] = traceback.format_exc()[-1500:]
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def time_us(fn, group, iters: int, warmup: int) -> float:
    """Median µs of `fn()` by CUDA events, calls back to back after a barrier of every rank
    (host timer per call on the CPU)."""
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
        return statistics.median(times)
    torch.cuda.synchronize()
    dist.barrier(group=group)
    pairs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)


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
        stage = "timing"
        x, idx, w = (t.to(device) for t in full["inputs"][rank])
        pair = tuple(t.to(device) for t in full["fp8"])
        state = {}

        def dispatch():
            state["out"] = buf.dispatch(x, idx, w, num_experts=experts)

        rec.put("ours", "dispatch_us", time_us(dispatch, group, cfg["iters"], cfg["warmup"]))
        recv_x, _, handle, _ = state["out"]
        rec.put("ours", "cached_us", time_us(lambda: buf.dispatch(x, handle=handle), group,
                                             cfg["iters"], cfg["warmup"]))
        y = recv_x.clone()
        rec.put("ours", "combine_us", time_us(lambda: buf.combine(y, handle), group,
                                              cfg["iters"], cfg["warmup"]))
        rec.put("ours", "fp8_dispatch_us", time_us(
            lambda: buf.dispatch(pair, idx, w, num_experts=experts, fp8=Fp8Dispatch(fmt)), group,
            cfg["iters"], cfg["warmup"]))
        buf.destroy()
    except Exception as exc:  # recorded with its stage; DeepEP's side still runs
        rec.error("ours", stage, exc)


def run_deepep(rec: Record, cfg: dict, check, full, group) -> None:
    import torch

    rank, experts, num_ranks = cfg["rank"], cfg["experts"], cfg["num_ranks"]
    stage = "import deep_ep"
    try:
        sys.path.insert(0, cfg["deepep"])
        import deep_ep

        rec.put("deepep", "module", getattr(deep_ep, "__file__", "?"))
        stage = "Buffer"
        deep_ep.Buffer.set_num_sms(cfg["num_sms"])
        dispatch_cfg = deep_ep.Buffer.get_dispatch_config(num_ranks)
        combine_cfg = deep_ep.Buffer.get_combine_config(num_ranks)
        hidden_bytes = cfg["hidden"] * 2
        nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
                        for c in (dispatch_cfg, combine_cfg))
        buf = deep_ep.Buffer(group, nvl_bytes, 0, explicitly_destroy=True)
        rec.put("deepep", "nvl_bytes", nvl_bytes)

        def dispatch(x, idx, w):
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
            return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=idx,
                                topk_weights=w, config=dispatch_cfg)

        stage = "check bf16"
        x, idx, w = (t.cuda() for t in check["inputs"][rank])
        recv_x, recv_idx, recv_w, _, handle, _ = dispatch(x, idx, w)
        rows, weights, ids_ok = deepep_expert_major(recv_x.cpu(), recv_idx.cpu(), recv_w.cpu(),
                                                    handle, check["inputs"], rank, experts)
        want_x, want_w = check["oracle"][rank][:2]
        problems = [compare("rows", rows, want_x), compare("weights", weights, want_w),
                    "" if ids_ok else "recv_topk_idx: local expert ids differ"]
        combined, _, _ = buf.combine(recv_x, handle, config=combine_cfg)
        from tests.helpers.oracle import oracle_combine

        ys = [one_row_per_rank(o[0], o[3]) for o in check["oracle"]]
        want = oracle_combine(ys, [o[3] for o in check["oracle"]],
                              [len(i[0]) for i in check["inputs"]])[rank]
        problems.append(compare("combine", combined.cpu(), want))
        rec.put("deepep", "check_bf16", "; ".join(p for p in problems if p) or "passed")
        stage = "check fp8"
        pair = tuple(t.cuda() for t in check["fp8"][rank])
        (recv_q, recv_s), recv_idx, recv_w, _, handle, _ = dispatch(pair, idx, w)
        q_rows, _, _ = deepep_expert_major(recv_q.cpu().view(torch.uint8), None, None, handle,
                                           check["inputs"], rank, experts)
        s_rows, _, _ = deepep_expert_major(recv_s.cpu().contiguous(), None, None, handle,
                                           check["inputs"], rank, experts)
        problems = [compare("e4m3 rows", q_rows, check["oracle_q"][rank][0]),
                    compare("scales", s_rows, check["oracle_s"][rank][0])]
        rec.put("deepep", "check_fp8", "; ".join(p for p in problems if p) or "passed")
        stage = "timing"
        x, idx, w = (t.cuda() for t in full["inputs"][rank])
        pair = tuple(t.cuda() for t in full["fp8"])
        state = {}

        def fresh():
            state["out"] = dispatch(x, idx, w)

        rec.put("deepep", "dispatch_us", time_us(fresh, group, cfg["iters"], cfg["warmup"]))
        recv_x, _, _, _, handle, _ = state["out"]
        rec.put("deepep", "cached_us", time_us(
            lambda: buf.dispatch(x, handle=handle, config=dispatch_cfg), group, cfg["iters"],
            cfg["warmup"]))
        y = recv_x.clone()
        rec.put("deepep", "combine_us", time_us(
            lambda: buf.combine(y, handle, config=combine_cfg), group, cfg["iters"],
            cfg["warmup"]))
        rec.put("deepep", "fp8_dispatch_us", time_us(lambda: dispatch(pair, idx, w), group,
                                                     cfg["iters"], cfg["warmup"]))
        buf.destroy()
    except Exception as exc:  # DeepEP's exact error, with the stage it stopped at
        rec.error("deepep", stage, exc)


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
    num_sms = sm_budget(cfg["num_sms_arg"], num_ranks, cfg["concurrent"], cfg["full_sms"])
    cfg = dict(cfg, rank=rank, num_sms=num_sms)
    rec = Record(cfg["folder"], rank, {
        "num_ranks": num_ranks, "device": props.name, "device_sms": props.multi_processor_count,
        "num_sms": num_sms, "concurrent": cfg["concurrent"],
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
    rec.data["received_tokens"] = received_tokens(full_inputs, rank, cfg["experts"])
    full = {"inputs": full_inputs, "fp8": fmt.quantize(full_inputs[rank][0])}
    run_ours(rec, cfg, check, full, group)
    if not cfg["skip_deepep"]:
        dist.barrier(group=group)
        run_deepep(rec, cfg, check, full, group)
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


def run_size(args, num_ranks: int, full_sms: int) -> dict:
    """R processes for one EP size; returns every rank's record and how each process ended."""
    import torch.multiprocessing as mp

    if args.concurrent:  # read by the MPS client at CUDA initialization
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // num_ranks)
    folder = tempfile.mkdtemp(prefix=f"side_by_side_r{num_ranks}.")
    cfg = {"num_ranks": num_ranks, "folder": folder, "port": free_port(),
           "device": "cpu" if args.cpu else "cuda",
           "tokens": args.tokens, "hidden": args.hidden, "experts": args.experts,
           "topk": args.topk, "num_sms_arg": args.num_sms, "check_tokens": args.check_tokens,
           "iters": args.iters, "warmup": args.warmup, "concurrent": args.concurrent,
           "skip_deepep": args.skip_deepep, "deepep": os.path.abspath(args.deepep or "."),
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
            records.append({"rank": r, "ours": {}, "deepep": {}, "errors": {
                "ours": "the process wrote nothing (died before its first step)"}})
    return {"num_ranks": num_ranks, "seconds": time.monotonic() - t0, "ended": ended,
            "records": records}


def summarize(size: dict, impl: str, hidden: int, concurrent: bool) -> dict:
    """One table row: checks (all ranks), the slowest rank's µs, the worst rank's GB/s."""
    recs = size["records"]
    row = {"num_ranks": size["num_ranks"], "impl": impl,
           "num_sms": recs[0].get("num_sms"), "errors": sorted({r["errors"][impl]
                                                                 for r in recs
                                                                 if impl in r["errors"]})}
    row["check_failed"] = False
    for check in ("check_bf16", "check_fp8"):
        values = [r[impl].get(check, "not run") for r in recs]
        bad = [f"rank {r['rank']}: {v}" for r, v in zip(recs, values) if v != "passed"]
        row[check] = ("passed" if not bad else "not run" if set(values) == {"not run"}
                      else "; ".join(bad)[:300])
        row["check_failed"] |= any(v not in ("passed", "not run") for v in values)
    for key in TIMED:
        times = [r[impl].get(f"{key}_us") for r in recs]
        row[f"{key}_us"] = max(times) if times and None not in times else None
        if concurrent and row[f"{key}_us"] and all(r.get("received_tokens") for r in recs):
            wire = "fp8" if key == "fp8_dispatch" else "bf16"
            row[f"{key}_gbps"] = min(r["received_tokens"] * row_bytes(hidden, wire)
                                     / (r[impl][f"{key}_us"] * 1e3) for r in recs)
    return row


def format_table(rows, args) -> str:
    mode = ("concurrent (MPS, 100/R % of the SMs each)" if args.concurrent else
            "time-sliced (no MPS): µs show progress, not speed; no GB/s")
    lines = [f"side by side on one GPU, {mode}; {args.tokens} tokens/rank, hidden "
             f"{args.hidden}, {args.experts} experts, top-{args.topk}; µs: slowest rank's "
             f"median; GB/s: worst rank, received tokens x row bytes / time",
             "| R | impl | SMs | check bf16 | check fp8 | dispatch µs | cached µs | combine µs "
             "| fp8 dispatch µs | dispatch GB/s | combine GB/s | fp8 GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [f"{row[f'{k}_us']:.0f}" if row.get(f"{k}_us") else "-" for k in TIMED]
        gbps = [f"{row[f'{k}_gbps']:.0f}" if row.get(f"{k}_gbps") else "-"
                for k in ("dispatch", "combine", "fp8_dispatch")]
        lines.append(f"| {row['num_ranks']} | {row['impl']} | {row['num_sms']} | "
                     f"{row['check_bf16'][:60]} | {row['check_fp8'][:60]} | "
                     + " | ".join(cells + gbps) + " |")
    for row in rows:
        for err in row["errors"]:
            lines.append(f"error R={row['num_ranks']} {row['impl']}: {err}")
    return "\n".join(lines)


def model_inputs(rows, args) -> dict:
    """`internode_model --measured-json`: our worst rank's GB/s with the ranks at once, per
    phase, as `kernel_gbps` (what the kernels push per rank at a 1/R SM share; one GPU, so
    HBM-bound, not NVLink), from the largest EP size measured."""
    ours = [r for r in rows if r["impl"] == "ours" and r.get("dispatch_gbps")]
    if not ours:
        return {}
    best = max(ours, key=lambda r: r["num_ranks"])
    out = {"source": f"MPS on one GPU, ours at EP {best['num_ranks']}, {best['num_sms']} SMs "
                     f"per rank ({100 // best['num_ranks']}% share)"}
    for phase, key in (("dispatch", "dispatch_gbps"), ("combine", "combine_gbps")):
        if best.get(key):
            out[phase] = {"kernel_gbps": best[key]}
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        ranks = check_args(args)
    except UsageError as exc:
        print(f"deepep_side_by_side: {exc}", file=sys.stderr)
        return 2
    impls = ["ours"] + ([] if args.skip_deepep else ["deepep"])
    plan = (f"deepep_side_by_side: R = {ranks} on one GPU, {'+'.join(impls)}, "
            f"{'concurrent (MPS)' if args.concurrent else 'time-sliced'}, {args.tokens} tokens "
            f"(checked at {args.check_tokens}), SM budget {args.num_sms}")
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
        size = run_size(args, num_ranks, full_sms)
        sizes.append(size)
        rows += [summarize(size, impl, args.hidden, args.concurrent) for impl in impls]
        print(f"R={num_ranks}: {size['seconds']:.0f} s, processes: {', '.join(size['ended'])}",
              flush=True)
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
