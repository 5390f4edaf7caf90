"""The benchmark at EP > 1: NVLink bytes per rank, the peer-copy ceiling, NCCL's all-to-all.

`megatron_deepep.bench` calls `measure` for every shape when it runs on more than one rank, and
prints `format_table` under its own table. On an 8-GPU node, in one call:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --standalone --nproc-per-node 8 -m megatron_deepep.bench --out .bench_ep8

Definitions (R ranks; rows[s, d] = tokens rank s's dispatch sends to rank d, once per
destination rank, from the dispatch layout; the self part rows[r, r] is an HBM copy, not NVLink):
- NVLink bytes of rank r: dispatch sends sum_{d != r} rows[r, d] and receives
  sum_{s != r} rows[s, r] wire rows (bf16: H * 2 bytes; FP8: the format's e4m3 bytes plus its
  scales); combine sends one bf16 partial row back per row it received, so its send and receive
  bytes are dispatch's receive and send rows times H * 2. Row payload only (the per-row top-k
  metadata is not counted), averaged over the bench's rotating inputs.
- NVLink GB/s of rank r (per direction) = max(send bytes, receive bytes) / time: the busier
  direction of that rank's links. The table gives the worst rank's figure (and its µs the
  slowest rank's); ratios are also the worst rank's.
- Peer-copy ceiling (`peer_copy` in cuda_src/bench/ceiling.cu): every rank writes `bytes_per_peer`
  bytes into each other rank's slot of a symmetric IPC buffer at once (16-byte stores, blocks
  spread over the peers), with the same SM budgets as ours; all ranks are aligned before every
  call. GB/s per rank = bytes sent to peers / time (per direction). `bytes_per_peer`: the
  busiest rank's bf16 dispatch send bytes over R - 1. The bytes are checked after timing.
- NCCL: `dist.all_to_all_single` with the splits our dispatch sends (rows[r, :], self included,
  of wire rows: bf16 or FP8 bytes), and for combine the reverse splits of bf16 rows; timed back
  to back like ours. Skipped, saying why, when the group's backend is not NCCL (gloo cannot
  all-to-all CUDA tensors; processes sharing one GPU cannot use NCCL).
- Targets: NVLink GB/s >= 340 per direction with <= 24 SMs, for dispatch and for
  combine; dispatch and combine each >= 1.1x NCCL's all-to-all of the same bytes (NCCL µs / our
  µs). Marked met / not met per row ("n/a" above 24 SMs, "skipped" without NCCL).
- A row records the transport that ran (`transport`, the Buffer's); a row of the reference
  transport gets no GB/s (`transport.bandwidth_refusal`).
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_deepep.ops.bench import ceiling as ceiling_ops
from megatron_deepep.layout import compute_layout
from megatron_deepep.transport import bandwidth_refusal
from megatron_deepep.transport.ipc import SymmetricBuffer

logger = logging.getLogger(__name__)

TARGET_NVLINK_GBPS = 340.0
TARGET_NCCL_RATIO = 1.1
TARGET_MAX_SMS = 24

BF16 = "bf16"


# ---------------------------------------------------------------------------------------------
# Bytes: who sends how many rows to whom.

def rows_per_destination(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                         ) -> torch.Tensor:
    """Rows this rank's dispatch sends to each rank (a token once per destination rank).

    Args:
        topk_idx: `[N, K]`, int32 or int64, expert ids in `[-1, num_experts)`.
        num_experts: E, a multiple of `num_ranks`.
        num_ranks: R.

    Returns:
        `[R]`, torch.int64, on the CPU; entry r = tokens with at least one expert on rank r.
    """
    layout = compute_layout(topk_idx, num_experts, num_ranks)
    return layout.num_tokens_per_rank.long().cpu()


def gather_rows_matrix(topk_idx: torch.Tensor, num_experts: int, group=None) -> torch.Tensor:
    """`[R, R]` torch.int64 on the CPU: entry [s, d] = rows rank s sends to rank d (collective:
    every rank of `group` calls it with its own `topk_idx [N, K]`; any backend)."""
    num_ranks = dist.get_world_size(group)
    mine = rows_per_destination(topk_idx, num_experts, num_ranks).tolist()
    every = [None] * num_ranks
    dist.all_gather_object(every, mine, group=group)
    return torch.tensor(every, dtype=torch.int64)


def nvlink_rows(rows_matrix: torch.Tensor, rank: int) -> Dict[str, int]:
    """Dispatch rows rank `rank` sends to and receives from OTHER ranks.

    Args:
        rows_matrix: `[R, R]` int64, as `gather_rows_matrix` returns.
        rank: the rank.

    Returns:
        `{"send": rows to other ranks, "recv": rows from other ranks}`.
    """
    self_rows = int(rows_matrix[rank, rank])
    return {"send": int(rows_matrix[rank].sum()) - self_rows,
            "recv": int(rows_matrix[:, rank].sum()) - self_rows}


def nvlink_bytes(rows_matrices: Sequence[torch.Tensor], rank: int, dispatch_row_bytes: int,
                 combine_row_bytes: int) -> Dict[str, float]:
    """NVLink bytes of one rank's dispatch and combine, averaged over the inputs.

    Args:
        rows_matrices: one `[R, R]` int64 rows matrix per rotating input.
        rank: the rank.
        dispatch_row_bytes: wire bytes of one dispatched row (bf16: H * 2; FP8: its format's).
        combine_row_bytes: bytes of one combined partial row (bf16: H * 2).

    Returns:
        `dispatch_send`, `dispatch_recv`, `combine_send`, `combine_recv` (bytes, float: means).
    """
    counts = [nvlink_rows(m, rank) for m in rows_matrices]
    send = sum(c["send"] for c in counts) / len(counts)
    recv = sum(c["recv"] for c in counts) / len(counts)
    return {"dispatch_send": send * dispatch_row_bytes, "dispatch_recv": recv * dispatch_row_bytes,
            # combine returns one partial row per row received, to the rank it came from
            "combine_send": recv * combine_row_bytes, "combine_recv": send * combine_row_bytes}


def _wire_row_bytes(hidden: int, fp8_specs) -> Dict[str, int]:
    """Wire format name -> bytes of one dispatched row."""
    out = {BF16: 2 * hidden}
    for spec in fp8_specs:
        out[spec.fmt.name] = spec.fmt.bytes_per_token(hidden)
    return out


# ---------------------------------------------------------------------------------------------
# Measurements (collective: every rank calls them in the same order).

def _gather(obj, group=None) -> list:
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def nccl_skip_reason(group=None) -> Optional[str]:
    """None when NCCL's all-to-all can run on `group`, else why not."""
    backend = str(dist.get_backend(group))
    if backend != "nccl":
        return (f"backend is {backend}, not nccl: gloo cannot all-to-all CUDA tensors, and "
                "processes sharing one GPU cannot use NCCL")
    return None


def nccl_all_to_all_us(rows_matrices: Sequence[torch.Tensor], row_bytes: int, timer: Callable,
                       reverse: bool = False, group=None) -> float:
    """Median µs of `dist.all_to_all_single` moving the rows our dispatch moves.

    Args:
        rows_matrices: one `[R, R]` rows matrix per rotating input (the calls rotate likewise).
        row_bytes: bytes of one row (bf16 H * 2, or an FP8 wire row).
        timer: `bench.time_cuda`.
        reverse: combine's direction (rank r sends rows[:, r] back and receives rows[r, :]).
        group: an NCCL group.

    Returns:
        µs on this rank (rows of `torch.uint8 [rows, row_bytes]`, split along rows).
    """
    rank = dist.get_rank(group)
    splits = []
    for m in rows_matrices:
        to_peers, from_peers = m[rank].tolist(), m[:, rank].tolist()
        splits.append((from_peers, to_peers) if reverse else (to_peers, from_peers))
    max_in = max(sum(s[0]) for s in splits)
    max_out = max(sum(s[1]) for s in splits)
    send = torch.empty(max_in, row_bytes, dtype=torch.uint8, device="cuda")
    recv = torch.empty(max_out, row_bytes, dtype=torch.uint8, device="cuda")
    state = {"i": 0}

    def setup(i):
        state["i"] = i % len(splits)

    def run():
        in_splits, out_splits = splits[state["i"]]
        dist.all_to_all_single(recv[:sum(out_splits)], send[:sum(in_splits)], out_splits,
                               in_splits, group=group)

    return timer(run, setup)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _align(group, token: torch.Tensor) -> None:
    """Every rank's stream reaches this point together, so that the next copies overlap: with
    NCCL a one-element all-reduce the stream waits for (device side), else a host barrier after
    the device is idle."""
    if str(dist.get_backend(group)) == "nccl":
        dist.all_reduce(token, group=group)
    else:
        _synchronize(token.device)
        dist.barrier(group=group)


def peer_pattern(src_rank: int, dst_rank: int, salt: int, num_bytes: int,
                 device="cuda") -> torch.Tensor:
    """`[num_bytes]` torch.uint8 (num_bytes a multiple of 4): what rank `src_rank` writes into
    `dst_rank`'s slot; differs per (source, destination, salt), so a byte in the wrong slot, from
    the wrong row or from an earlier call is caught."""
    words = torch.arange(num_bytes // 4, dtype=torch.int64, device=device)
    key = ((src_rank * 131 + dst_rank) * 1009 + salt * 7 + 1) * 40503
    return ((words * 2654435761 + key) % (2 ** 31)).to(torch.int32).view(torch.uint8)


class _DeviceBytes:
    """A raw device range as an object torch.as_tensor takes (no copy, no ownership)."""

    def __init__(self, ptr: int, num_bytes: int):
        self.__cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


def _own_bytes(buffer: SymmetricBuffer, num_bytes: int) -> torch.Tensor:
    """`[num_bytes]` torch.uint8: this rank's symmetric buffer as a tensor (a view, no copy)."""
    return torch.as_tensor(_DeviceBytes(buffer.ptr, num_bytes), device=buffer.device)


def peer_copy_ceiling(bytes_per_peer: int, num_sms_list: Sequence[int], timer: Callable,
                      group=None, device: Optional[torch.device] = None) -> Dict[int, float]:
    """µs of `peer_copy` (ceiling.cu) on this rank per SM budget, all ranks copying at once.

    Args:
        bytes_per_peer: bytes each rank writes to each other rank (rounded up to 16).
        num_sms_list: block counts to run (one block per SM).
        timer: `bench.time_cuda` (its `setup` aligns the ranks before every call).
        group: the EP group (any backend; the buffer travels by CUDA IPC).
        device: where the pattern rows live (the current CUDA device by default; the CPU tier
            runs this with a fake buffer and copy on the CPU).

    Returns:
        `{num_sms: µs on this rank}`.

    Raises:
        RuntimeError: on every rank, if any rank found a wrong byte in its buffer after a budget's
            calls (the ceiling would not be valid).
    """
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    bytes_per_peer = max(16, -(-int(bytes_per_peer) // 16) * 16)
    buffer = SymmetricBuffer(group, num_ranks * bytes_per_peer)
    token = torch.zeros(1, device=device)
    mine = _own_bytes(buffer, num_ranks * bytes_per_peer)
    out = {}
    try:
        for salt, num_sms in enumerate(num_sms_list, start=1):
            src = torch.stack([peer_pattern(rank, d, salt, bytes_per_peer, device)
                               for d in range(num_ranks)])
            out[num_sms] = timer(
                lambda: ceiling_ops.peer_copy(src, buffer.peer_bases, rank, num_sms),
                lambda i: _align(group, token), iters=20)
            logger.debug("rank %d: peer_copy, %d blocks, %d bytes to each of %d peers: %.1f µs",
                         rank, num_sms, bytes_per_peer, num_ranks - 1, out[num_sms])
            _synchronize(device)
            dist.barrier(group=group)  # every peer's last copy has landed
            wrong = [s for s in range(num_ranks) if s != rank and not torch.equal(
                mine[s * bytes_per_peer:(s + 1) * bytes_per_peer],
                peer_pattern(s, rank, salt, bytes_per_peer, device))]
            failures = [(r, bad) for r, bad in enumerate(_gather(wrong, group)) if bad]
            if failures:
                raise RuntimeError(
                    f"peer_copy ({num_sms} blocks, {bytes_per_peer} bytes per peer) wrote wrong "
                    "bytes (receiving rank, sources): " + "; ".join(
                        f"{r}: {bad}" for r, bad in failures) + ": its ceiling is not valid")
            del src
    finally:
        del mine
        buffer.destroy()
    return out


def measure(entry: dict, idxs: Sequence[torch.Tensor], fp8_specs, num_sms_list: Sequence[int],
            timer: Callable, group=None, device: Optional[torch.device] = None) -> dict:
    """The EP > 1 figures of one bench shape (collective).

    Args:
        entry: the bench's row for the shape (`shape`, and `variants` with this rank's µs).
        idxs: the rotating inputs' `topk_idx [N, K]` of this rank.
        fp8_specs: the `Fp8Dispatch` specs the bench ran.
        num_sms_list: the SM budgets the bench ran.
        timer: `bench.time_cuda`.
        group: the EP group.
        device: the ceiling's device (see `peer_copy_ceiling`).

    Returns:
        The `peers` part of the row (JSON-able; every rank gets the same), see `summarize`.
    """
    _, hidden, num_experts, _ = entry["shape"]
    num_ranks = dist.get_world_size(group)
    matrices = [gather_rows_matrix(idx, num_experts, group) for idx in idxs]
    wire = _wire_row_bytes(hidden, fp8_specs)
    bytes_by_wire = {name: [nvlink_bytes(matrices, r, row_bytes, 2 * hidden)
                            for r in range(num_ranks)] for name, row_bytes in wire.items()}

    nccl: Dict[str, dict] = {}
    reason = nccl_skip_reason(group)
    if reason is None:
        for name, row_bytes in wire.items():
            nccl[name] = {"dispatch_us": nccl_all_to_all_us(matrices, row_bytes, timer,
                                                            group=group)}
        nccl[BF16]["combine_us"] = nccl_all_to_all_us(matrices, 2 * hidden, timer, reverse=True,
                                                      group=group)
    busiest_send = max(b["dispatch_send"] for b in bytes_by_wire[BF16])
    bytes_per_peer = max(16, -(-int(busiest_send / (num_ranks - 1)) // 16) * 16)
    ceiling = peer_copy_ceiling(bytes_per_peer, num_sms_list, timer, group, device)

    ours = {key: {op: res[f"{op}_us"] for op in ("dispatch", "combine") if f"{op}_us" in res}
            for key, res in entry["variants"].items() if key.startswith("ours")}
    per_rank = _gather({"ours": ours, "nccl": nccl, "ceiling": ceiling}, group)
    return summarize(per_rank, bytes_by_wire, bytes_per_peer, reason,
                     {key: res.get("fp8", BF16) for key, res in entry["variants"].items()
                      if key.startswith("ours")})


# ---------------------------------------------------------------------------------------------
# Summary and table (pure: the CPU tests feed them fake results).

def _num_sms_of(key: str) -> int:
    """The SM budget in a bench variant key such as "ours 24 SMs sync"."""
    return int(key.split(" SMs")[0].split()[-1])


def _met(value: Optional[float], target: float) -> Optional[bool]:
    return None if value is None else value >= target


def summarize(per_rank: List[dict], bytes_by_wire: Dict[str, List[dict]], bytes_per_peer: int,
              nccl_skipped: Optional[str], wire_of_variant: Dict[str, str]) -> dict:
    """The `peers` part of a bench row from every rank's raw figures.

    Args:
        per_rank: per rank, `{"ours": {variant: {"dispatch": µs, "combine": µs}}, "nccl":
            {wire: {"dispatch_us": µs, "combine_us": µs}} (empty when skipped), "ceiling":
            {num_sms: µs}}`.
        bytes_by_wire: wire name -> per rank `nvlink_bytes` dict.
        bytes_per_peer: what the ceiling wrote to each peer.
        nccl_skipped: why NCCL did not run, or None.
        wire_of_variant: variant key -> wire name ("bf16" or an FP8 format's name).

    Returns:
        `{"bytes": bytes_by_wire, "nccl": {wire: {op: {"us": per rank, "GBps_worst"}}} or
        {"skipped": reason}, "ceiling": {"bytes_per_peer", "by_sms": {num_sms: {"us", "GBps"
        (per rank), "GBps_worst"}}}, "variants": {variant: {"wire", "num_sms", op: figures}}}`;
        per op: `us` (per rank), `nvlink_bytes` (per
        rank, the busier direction), `GBps` (per rank), `GBps_worst`, `us_slowest`,
        `x_nccl` (worst rank's NCCL µs / our µs, or None), `x_ceiling` (worst rank's our GB/s /
        ceiling GB/s at the same SM budget), `target_GBps_met` (None above 24 SMs),
        `target_nccl_met` (None without NCCL).
    """
    num_ranks = len(per_rank)
    num_peers = num_ranks - 1
    sent_by_ceiling = bytes_per_peer * num_peers
    ceiling = {}
    for num_sms in per_rank[0]["ceiling"]:
        us = [p["ceiling"][num_sms] for p in per_rank]
        gbps = [sent_by_ceiling / u / 1e3 for u in us]
        ceiling[str(num_sms)] = {"us": us, "GBps": gbps, "GBps_worst": min(gbps)}
    out = {"bytes": bytes_by_wire, "ceiling": {"bytes_per_peer": bytes_per_peer,
                                               "by_sms": ceiling}}
    out["nccl"] = {"skipped": nccl_skipped} if nccl_skipped else {}
    for wire, timed in ({} if nccl_skipped else per_rank[0]["nccl"]).items():
        out["nccl"][wire] = {}
        for name in timed:  # "dispatch_us", "combine_us"
            op = name[:-len("_us")]
            us = [p["nccl"][wire][name] for p in per_rank]
            moved = [max(b[f"{op}_send"], b[f"{op}_recv"]) for b in bytes_by_wire[wire]]
            out["nccl"][wire][op] = {"us": us, "GBps_worst": min(
                m / u / 1e3 for m, u in zip(moved, us))}
    variants = {}
    for key in per_rank[0]["ours"]:
        wire, num_sms = wire_of_variant.get(key, BF16), _num_sms_of(key)
        figures = {}
        for op in per_rank[0]["ours"][key]:
            us = [p["ours"][key][op] for p in per_rank]
            moved = [max(b[f"{op}_send"], b[f"{op}_recv"])
                     for b in bytes_by_wire[BF16 if op == "combine" else wire]]
            gbps = [m / u / 1e3 for m, u in zip(moved, us)]
            nccl_us = out["nccl"].get(BF16 if op == "combine" else wire, {}).get(op, {}).get("us")
            x_nccl = None if nccl_us is None else min(n / u for n, u in zip(nccl_us, us))
            ceiling_gbps = ceiling.get(str(num_sms), {}).get("GBps")
            x_ceiling = None if ceiling_gbps is None else min(
                g / c for g, c in zip(gbps, ceiling_gbps))
            figures[op] = {
                "us": us, "nvlink_bytes": moved, "GBps": gbps, "GBps_worst": min(gbps),
                "us_slowest": max(us), "x_nccl": x_nccl, "x_ceiling": x_ceiling,
                "target_GBps_met": (_met(min(gbps), TARGET_NVLINK_GBPS)
                                    if num_sms <= TARGET_MAX_SMS else None),
                "target_nccl_met": _met(x_nccl, TARGET_NCCL_RATIO)}
        variants[key] = {"wire": wire, "num_sms": num_sms, **figures}
    out["variants"] = variants
    return out


def _verdict(met: Optional[bool], absent: str) -> str:
    return absent if met is None else ("met" if met else "NOT met")


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def _op_cells(fig: Optional[dict]) -> str:
    if fig is None:
        return "- | - | - | -"
    return (f"{fig['us_slowest']:.1f} | {fig['GBps_worst']:.0f} | {_ratio(fig['x_nccl'])} | "
            f"{_ratio(fig['x_ceiling'])}")


def _targets(figures: dict, nccl_absent: str) -> str:
    parts = []
    for op in ("dispatch", "combine"):
        if op in figures:
            fig = figures[op]
            bandwidth = _verdict(fig["target_GBps_met"], f"n/a (> {TARGET_MAX_SMS} SMs)")
            versus_nccl = _verdict(fig["target_nccl_met"], nccl_absent)
            parts.append(f"{op}: {TARGET_NVLINK_GBPS:.0f} GB/s {bandwidth}, "
                         f"{TARGET_NCCL_RATIO}x NCCL {versus_nccl}")
    return "; ".join(parts)


def _mb(values: List[float]) -> str:
    return f"{sum(values) / len(values) / 1e6:.1f} (max {max(values) / 1e6:.1f})"


def format_table(rows: List[dict]) -> List[str]:
    """The EP > 1 table's lines for the bench rows that have a `peers` part (none at EP = 1)."""
    rows = [e for e in rows if "peers" in e]
    if not rows:
        return []
    lines = [
        f"NVLink, EP = {rows[0]['ep']}: per rank and per direction, GB/s = max(bytes sent to, "
        "bytes received from other ranks) / time, the worst rank's; µs the slowest rank's; "
        "x NCCL = NCCL all_to_all_single µs (same bytes) / ours, x ceiling = ours / peer_copy "
        "GB/s at the same SMs (both the worst rank's). Targets: "
        f">= {TARGET_NVLINK_GBPS:.0f} GB/s with <= {TARGET_MAX_SMS} SMs, >= "
        f"{TARGET_NCCL_RATIO}x NCCL.",
        "shape (N,H,E,K) | variant | dispatch µs | NVLink GB/s | x NCCL | x ceiling | "
        "combine µs | NVLink GB/s | x NCCL | x ceiling | targets"]
    for e in rows:
        shape, peers = tuple(e["shape"]), e["peers"]
        refusal = bandwidth_refusal(e["transport"]) if "transport" in e else None
        if refusal:  # the transport that ran moved nothing over NVLink
            lines.append(f"{shape} | NVLink GB/s: none, {refusal}")
            continue
        skipped = peers["nccl"].get("skipped")
        nccl_absent = "skipped (no NCCL)" if skipped else "- (not measured)"
        for key, v in peers["variants"].items():
            lines.append(f"{shape} | {key} | {_op_cells(v.get('dispatch'))} | "
                         f"{_op_cells(v.get('combine'))} | {_targets(v, nccl_absent)}")
        by_bytes = []
        for wire, per_rank in peers["bytes"].items():
            ops_ = ("dispatch", "combine") if wire == BF16 else ("dispatch",)
            by_bytes += [f"{wire} {op} send {_mb([b[f'{op}_send'] for b in per_rank])} / recv "
                         f"{_mb([b[f'{op}_recv'] for b in per_rank])}" for op in ops_]
        lines.append(f"{shape} | NVLink MB per rank (mean of ranks, max): " + "; ".join(by_bytes))
        if skipped:
            lines.append(f"{shape} | NCCL all-to-all: skipped: {skipped}")
        else:
            cells = []
            for wire, figs in peers["nccl"].items():
                cells += [f"{wire} {op} {max(f['us']):.1f} µs ({f['GBps_worst']:.0f} GB/s)"
                          for op, f in figs.items()]
            lines.append(f"{shape} | NCCL all_to_all_single, same bytes (slowest rank's µs, "
                         "worst rank's GB/s as ours): " + "; ".join(cells))
        ceiling = peers["ceiling"]
        cells = [f"{num_sms} SMs {c['GBps_worst']:.0f} GB/s ({max(c['us']):.1f} µs)"
                 for num_sms, c in ceiling["by_sms"].items()]
        lines.append(f"{shape} | peer_copy ceiling, {ceiling['bytes_per_peer'] / 1e6:.1f} MB to "
                     f"each of {rows[0]['ep'] - 1} peers (worst rank): " + "; ".join(cells))
    return lines
