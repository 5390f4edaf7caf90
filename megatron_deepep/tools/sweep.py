"""Which configuration for my model family: predicted comm share per EP layout, wire and SM budget.

    python -m megatron_deepep.tools.sweep --family deepseek_v3 --nodes 1,2,4,8
    python -m megatron_deepep.tools.sweep --hidden 4096 --experts 64 --topk 6 --moe-ffn-hidden 1408
    python -m megatron_deepep.tools.sweep --family qwen3_moe --measurements sweep.json   # re-model

Three parts:

1. Kernel times on one GPU, at EP = 1 (`--out DIR` keeps them in `sweep.json`): per top-k, wire
   (bf16 / FP8 blockwise) and SM budget, the dispatch and combine of `tokens` rows, and of
   `tokens` / 2 and / 4 for the fit below (`megatron_deepep.bench` pieces: random routing, CUDA
   events, median of back-to-back calls); per top-k and EP size, the forward expert GEMMs of one
   layer on one rank (E / EP experts, `tokens x top-k` rows split evenly, fc1 then fc2 as
   batched GEMMs, bf16). Without a GPU (or with `--assume`), assumed constants stand in, and the
   output says so.
2. The model's constants. One EP = 1 call of B HBM bytes on S SMs (`KernelCost`):

       t = fixed + max(floor, B / min(cap, S x rate per SM))

   `fixed` is paid by every call (launches, layout, a synchronous dispatch's host wait),
   `floor` is what back-to-back calls of few bytes cost beyond it (the GPU waits for the host's
   work per call), the rate is HBM traffic. Expert GEMMs: `tflops x m / (m + m0)` for m rows
   per expert. On a GPU these are fitted to the measured calls (per phase and SM budget, least
   squares in relative error; the `check:` lines set every measured call against the fit, 1.00
   where it fits, and against the CPU defaults); without one they are `ASSUMED_KERNEL` and
   `--gemm-tflops`, m0 = 128 (H200 figures). The output names which constants are measured and
   which assumed (the link rates below always are: they need several GPUs).
3. A model of EP groups of several GPUs and nodes (`megatron_deepep.tools.internode_model`'s row
   counts from a routed layout: per rank, the busiest of send and receive over the network and
   over NVLink), at NVLink and NIC rates given as parameters (defaults: H100/H200 SXM NVLink 4,
   450 GB/s per direction; one 400 Gb/s NIC per GPU, 50 GB/s):

       t_phase = t_local + max(B_net / NIC rate, B_nvl / min(NVLink rate, SMs x link rate/SM))
       comm_share = (t_dispatch + t_combine) / t_expert

   where t_local is the EP = 1 kernel time at `tokens` (measured, or the assumed constants':
   each rank still expands and reduces its rows in HBM), B are the busiest rank's bytes (FP8
   rows: the format's e4m3 bytes plus scales; combine: bf16) and `--link-gbps-per-sm` bounds
   what a small SM budget can push. At EP = 1 the model is the measurement itself.
   Group-limited routing (a family's `node_limited`) is modeled beside uniform routing when the
   group spans more nodes than the limit.

Recommendation: the smallest EP size whose expert weights, gradients and Adam states (18 bytes
per parameter, `--gpu-mem-gb` x 0.6 for them, layers split over the pipeline stages) fit; there
the least intervention whose predicted comm share stays under `--limit` (default 20%: above it
EP scaling has reached its limit): bf16 before FP8, plain before node-limited routing, the
fewest SMs; when none does, the lowest comm share (the fewest SMs within 10% of it), and it says
what usually helps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

from megatron_deepep.fp8.dispatch import ALIASES
from megatron_deepep.fp8.formats import FORMATS
from megatron_deepep.tools.internode_model import bf16_row_bytes, rank_rows, route

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Shape:
    """An MoE model's layer shape.

    Attributes:
        hidden: H.
        experts: E, routed experts.
        topk: K.
        moe_ffn_hidden: F, one expert's FFN width.
        moe_layers: MoE layers (for the memory check).
        gated: SwiGLU experts (fc1 is 2F wide).
        node_limited: group-limited routing over nodes, M nodes per token (0: none).
        shared_ffn_hidden: shared experts' total FFN width (0: none); computed beside the
            routed experts, so it adds to the expert time.
    """

    hidden: int
    experts: int
    topk: int
    moe_ffn_hidden: int
    moe_layers: int
    gated: bool = True
    node_limited: int = 0
    shared_ffn_hidden: int = 0

    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        fc1 = self.moe_ffn_hidden * (2 if self.gated else 1)
        return self.hidden * fc1 + self.moe_ffn_hidden * self.hidden


#: The families of `examples/configs/` at full size (their public configurations).
FAMILIES: Dict[str, Shape] = {
    # DeepSeek-V3: 58 MoE layers of 256 experts (+1 shared), top-8, groups = nodes, 4 per token.
    "deepseek_v3": Shape(7168, 256, 8, 2048, 58, node_limited=4, shared_ffn_hidden=2048),
    # Qwen3-235B-A22B: 94 MoE layers of 128 experts, top-8, no shared expert.
    "qwen3_moe": Shape(4096, 128, 8, 1536, 94),
    # Mixtral 8x7B: 32 MoE layers of 8 experts, top-2.
    "mixtral": Shape(4096, 8, 2, 14336, 32),
    # gpt-oss-120b: 36 MoE layers of 128 experts, top-4, hidden 2880.
    "gpt_oss": Shape(2880, 128, 4, 2880, 36),
}

#: FP8 dispatch format of each family's template (the sweep's FP8 wire; default blockwise).
FAMILY_FP8 = {"gpt_oss": "mxfp8"}

#: Pipeline stages of each family's full-size template (`examples/configs/`).
FAMILY_PIPELINE_STAGES = {"deepseek_v3": 8, "qwen3_moe": 8, "mixtral": 4, "gpt_oss": 2}

@dataclasses.dataclass(frozen=True)
class KernelCost:
    """Time of one EP = 1 dispatch or combine call of `num_bytes` HBM bytes on `num_sms` SMs:

        t = fixed_us + max(floor_us, num_bytes / min(cap_gbps, gbps_per_sm x num_sms))

    `fixed_us`: paid by every call (launches, the layout kernel, a synchronous dispatch's host
    wait); `floor_us`: what back-to-back calls of few bytes cost beyond it (the host's work per
    call, which the GPU waits for when the copy is shorter); the rate: HBM traffic per SM, up
    to the cap.
    """

    fixed_us: float
    floor_us: float
    gbps_per_sm: float
    cap_gbps: float

    def us(self, num_bytes: float, num_sms: int) -> float:
        rate = min(self.cap_gbps, self.gbps_per_sm * num_sms)
        return self.fixed_us + max(self.floor_us, num_bytes / (rate * 1e3))


#: Assumed EP = 1 kernel costs (the CPU defaults), per phase. Rates: the H200 bench
#: (`docs/bench_h200_ep1.log`: bf16 dispatch 1398 GB/s at 24 SMs, 3272 at 132; combine 1685 and
#: 3920; FP8 blockwise dispatch 1188 and 1825). Fixed cost and floor: the H200 sweep of
#: `dev/gpu/gpu_ops.sh`, where Mixtral's shape (top-2, H 4096, 4096 tokens: 30-70 µs of bytes)
#: took 160-190 µs a synchronous dispatch and 70-90 µs a combine at 24 and 132 SMs, and
#: DeepSeek-V3's (top-8, H 7168: 135-380 µs of bytes) 1.00-1.32 times its bytes' time. A GPU
#: run fits its own (`fit_kernel_cost`).
ASSUMED_KERNEL = {"dispatch_bf16": KernelCost(25.0, 150.0, 58.0, 3300.0),
                  "dispatch_fp8": KernelCost(25.0, 160.0, 50.0, 1850.0),
                  "combine": KernelCost(10.0, 70.0, 70.0, 3900.0)}
#: Assumed expert GEMM rate: `--gemm-tflops` x m / (m + this), m rows per expert.
ASSUMED_GEMM_HALF_RATE_ROWS = 128.0
#: A kernel fit takes a floor only where a plain line misses the calls by more than this.
FLOOR_MIN_RMS = 0.02
#: The sweep measures each kernel at these fractions of `--tokens` too (the fit's points).
FIT_TOKEN_DIVISORS = (4, 2, 1)
WIRES = ("bf16", "fp8")


def wire_row_bytes(wire: str, hidden: int, fp8: str = "blockwise") -> int:
    """Bytes of one dispatched row: bf16 2 H, or the FP8 format's e4m3 bytes plus scales."""
    if wire == "bf16":
        return bf16_row_bytes(hidden)
    return FORMATS[ALIASES.get(fp8, fp8)].bytes_per_token(hidden)


def phase_key(phase: str, wire: str) -> str:
    """"dispatch_bf16", "dispatch_fp8" or "combine" (combine is bf16 on every wire)."""
    return "combine" if phase == "combine" else f"dispatch_{wire}"


def kernel_bytes(phase: str, wire: str, tokens: int, topk: int, hidden: int,
                 fp8: str = "blockwise") -> int:
    """HBM bytes of one EP = 1 call (bench's definitions): read x, write the expanded rows."""
    if phase == "combine":
        return (tokens + tokens * topk) * hidden * 2
    return tokens * hidden * 2 + tokens * topk * wire_row_bytes(wire, hidden, fp8)


def assumed_kernel_us(phase: str, wire: str, tokens: int, topk: int, hidden: int,
                      num_sms: int, fp8: str = "blockwise") -> float:
    """Assumed EP = 1 time of one dispatch or combine (see `ASSUMED_KERNEL`)."""
    cost = ASSUMED_KERNEL[phase_key(phase, wire)]
    return cost.us(kernel_bytes(phase, wire, tokens, topk, hidden, fp8), num_sms)


def expert_flops(shape: Shape, rows: int, tokens: int) -> float:
    """Forward FLOPs of one layer's experts on one rank: `rows` routed rows, plus the shared
    experts on the rank's own `tokens`."""
    fc1 = shape.moe_ffn_hidden * (2 if shape.gated else 1)
    routed = 2.0 * rows * (shape.hidden * fc1 + shape.moe_ffn_hidden * shape.hidden)
    shared = 2.0 * tokens * 3 * shape.hidden * shape.shared_ffn_hidden
    return routed + shared


def rows_per_expert(shape: Shape, tokens: int, topk: int, ep: int) -> float:
    """m: routed rows per local expert of one rank (even routing)."""
    return tokens * topk / (shape.experts / ep)


def assumed_expert_us(shape: Shape, tokens: int, topk: int, ep: int, tflops: float,
                      half_rate_rows: float = ASSUMED_GEMM_HALF_RATE_ROWS) -> float:
    """Assumed expert time: `tflops` x m / (m + half_rate_rows) for m rows per expert (small
    GEMMs are less efficient)."""
    m = rows_per_expert(shape, tokens, topk, ep)
    rate = tflops * m / (m + half_rate_rows)
    return expert_flops(shape, tokens * topk, tokens) / (rate * 1e6)


# ----------------------------------------------------------------------------------------------
# Measurement on the local GPU
# ----------------------------------------------------------------------------------------------
def fit_token_counts(tokens: int) -> List[int]:
    """The token counts each kernel is measured at: `tokens` and its `FIT_TOKEN_DIVISORS`."""
    return sorted({max(1, tokens // d) for d in FIT_TOKEN_DIVISORS})


def measure_gpu(shape: Shape, tokens: int, topks: Sequence[int], sms_list: Sequence[int],
                eps: Sequence[int], fp8_format: str = "blockwise") -> dict:
    """EP = 1 kernel and expert-GEMM times on this GPU (see the module docstring).

    `kernels` holds the times at `tokens` (what the model uses); `points` every measured call
    (also at the smaller `fit_token_counts`), from which `fit_constants` fits the kernel costs.
    """
    import torch
    import torch.distributed as dist

    from megatron_deepep.bench import run as bench
    from megatron_deepep.buffer import Buffer
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    from megatron_deepep.transport import bandwidth_refusal

    own_group = not dist.is_initialized()
    if own_group:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    props = torch.cuda.get_device_properties(0)
    kernels, experts, points, ran = {}, {}, [], set()
    xs = [torch.randn(tokens, shape.hidden, device="cuda").to(torch.bfloat16) for _ in range(3)]
    fp8 = Fp8Dispatch.named(fp8_format, "fp8")
    for topk in topks:
        routing = [bench.make_routing(tokens, shape.experts, topk, 31 + i) for i in range(3)]
        for num_sms in sms_list:
            num_sms = min(num_sms, props.multi_processor_count)
            buf = Buffer(dist.group.WORLD, tokens, shape.hidden, topk, transport="auto",
                         num_sms=num_sms)
            ran.add(buf.transport_name)
            refusal = bandwidth_refusal(buf.transport_name)
            if refusal:  # its times would fit the kernel model to torch's collectives
                buf.destroy()
                raise RuntimeError(f"sweep: no kernel measurement: {refusal}")
            for n in fit_token_counts(tokens):
                x_n = [x[:n] for x in xs]
                idxs, ws = [r[0][:n] for r in routing], [r[1][:n] for r in routing]
                bf16 = bench.bench_ours(buf, x_n, idxs, ws, shape.experts)["sync"]
                f8 = bench.bench_ours(buf, x_n, idxs, ws, shape.experts, fp8=fp8)["sync"]
                for phase, wire, us in (("dispatch", "bf16", bf16["dispatch_us"]),
                                        ("dispatch", "fp8", f8["dispatch_us"]),
                                        ("combine", "bf16", bf16["combine_us"])):
                    points.append({"phase": phase_key(phase, wire), "topk": topk,
                                   "num_sms": num_sms, "tokens": n, "us": us,
                                   "bytes": kernel_bytes(phase, wire, n, topk, shape.hidden,
                                                         fp8.fmt.name)})
                if n == tokens:
                    for wire, dispatch_us in (("bf16", bf16["dispatch_us"]),
                                              ("fp8", f8["dispatch_us"])):
                        kernels[f"{topk},{wire},{num_sms}"] = {
                            "dispatch_us": dispatch_us, "combine_us": bf16["combine_us"]}
            buf.destroy()
        for ep in eps:
            experts[f"{topk},{ep}"] = _expert_gemm_us(shape, tokens, topk, ep)
        torch.cuda.empty_cache()
    if own_group:
        dist.destroy_process_group()
    return {"source": f"measured on {props.name} ({props.multi_processor_count} SMs)",
            "transport": ",".join(sorted(ran)), "fp8_format": fp8.fmt.name, "kernels": kernels,
            "experts": experts, "points": points}


def _expert_gemm_us(shape: Shape, tokens: int, topk: int, ep: int) -> float:
    """Median µs of one rank's forward expert GEMMs (batched, even rows per expert)."""
    import torch

    from megatron_deepep.bench.run import time_cuda

    num_local = shape.experts // ep
    per_expert = max(1, math.ceil(tokens * topk / num_local))
    fc1 = shape.moe_ffn_hidden * (2 if shape.gated else 1)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(num_local, per_expert, shape.hidden, **kw)
    w1 = torch.randn(num_local, shape.hidden, fc1, **kw).mul_(0.02)
    w2 = torch.randn(num_local, shape.moe_ffn_hidden, shape.hidden, **kw).mul_(0.02)
    shared = None
    if shape.shared_ffn_hidden:
        shared = (torch.randn(tokens, shape.hidden, **kw),
                  torch.randn(shape.hidden, 2 * shape.shared_ffn_hidden, **kw) * 0.02,
                  torch.randn(shape.shared_ffn_hidden, shape.hidden, **kw) * 0.02)

    def run():
        h = torch.bmm(x, w1)
        if shape.gated:
            a, b = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(a) * b
        else:
            h = torch.nn.functional.gelu(h)
        torch.bmm(h, w2)
        if shared is not None:
            s = shared[0] @ shared[1]
            a, b = s.chunk(2, dim=-1)
            (torch.nn.functional.silu(a) * b) @ shared[2]

    us = time_cuda(run, iters=10, warmup=3)
    del x, w1, w2, shared
    return us


def check_measured_transport(measured: dict, path: str) -> None:
    """Refuses measurements whose kernel times came from a transport that runs no kernels
    (`transport.bandwidth_refusal`); files without the field predate it and are read.

    Raises:
        ValueError: naming the file and the transport.
    """
    from megatron_deepep.transport import bandwidth_refusal

    for name in filter(None, measured.get("transport", "").split(",")):
        refusal = bandwidth_refusal(name)
        if refusal:
            raise ValueError(f"--measurements {path}: {refusal}")


def assumed_measurements(shape: Shape, tokens: int, topks: Sequence[int],
                         sms_list: Sequence[int], eps: Sequence[int], tflops: float,
                         fp8_format: str = "blockwise") -> dict:
    """The same table as `measure_gpu`, from assumed rates (no GPU)."""
    fmt = ALIASES.get(fp8_format, fp8_format)
    kernels, experts = {}, {}
    for topk in topks:
        for num_sms in sms_list:
            combine = assumed_kernel_us("combine", "bf16", tokens, topk, shape.hidden, num_sms)
            for wire in WIRES:
                kernels[f"{topk},{wire},{num_sms}"] = {
                    "dispatch_us": assumed_kernel_us("dispatch", wire, tokens, topk,
                                                     shape.hidden, num_sms, fmt),
                    "combine_us": combine}
        for ep in eps:
            experts[f"{topk},{ep}"] = assumed_expert_us(shape, tokens, topk, ep, tflops)
    return {"source": f"ASSUMED rates, no GPU measurement: EP = 1 kernels at the H200 "
                      f"constants of sweep.ASSUMED_KERNEL, expert GEMMs at {tflops:g} TFLOP/s x "
                      f"m / (m + {ASSUMED_GEMM_HALF_RATE_ROWS:g})",
            "fp8_format": fmt, "kernels": kernels, "experts": experts}


# ----------------------------------------------------------------------------------------------
# Calibration: the model's constants from one GPU's measurements
# ----------------------------------------------------------------------------------------------
def _weighted_line(xs: Sequence[float], ts: Sequence[float]):
    """`(c, k)` of t = c + k x by least squares in relative error (weights 1 / t), with c >= 0
    and k >= 0 (refitted through the origin or flat when one comes out negative)."""
    ws = [1.0 / t ** 2 for t in ts]
    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs))
    st = sum(w * t for w, t in zip(ws, ts))
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    sxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    det = sw * sxx - sx * sx
    c, k = (st / sw, 0.0) if det <= 1e-12 * sw * sxx else (
        (st * sxx - sx * sxt) / det, (sw * sxt - sx * st) / det)
    if c < 0:
        c, k = 0.0, sxt / sxx
    if k < 0:
        c, k = st / sw, 0.0
    return c, k


def _relative_sse(model_us, points) -> float:
    return sum((model_us(p) / p["us"] - 1.0) ** 2 for p in points)


#: The fastest rate a fitted EP = 1 kernel may have: no copy moves HBM bytes faster than the
#: fastest HBM (B200's HBM3e, 8 TB/s). Host-bound calls of few bytes fit a flat line (rate
#: near infinite); the cap keeps such a fit from predicting free bytes at larger shapes.
MAX_FIT_GBPS = 8000.0


def fit_kernel_cost(points: Sequence[dict], num_sms: int) -> KernelCost:
    """The `KernelCost` of one phase at one SM budget from its measured calls (`bytes`, `us`;
    any top-k and token count), least squares in relative error.

    Sorted by bytes, the first j calls sit on the floor and the rest on the line
    `fixed + bytes / rate`; every j is tried and the best fit kept. A floor is fitted only where
    the plain line (j = 0) misses the calls by more than `FLOOR_MIN_RMS` (relative, root mean
    square) and the floor halves its squared error: noise alone makes no floor. A rate above
    `MAX_FIT_GBPS` (a flat, host-bound line) is capped there, the fixed cost refitted.
    """
    pts = sorted(points, key=lambda p: p["bytes"])
    fits = []  # (relative squared error, cost) with the first j calls on the floor
    for j in range(len(pts) + 1):
        floor_pts, line_pts = pts[:j], pts[j:]
        if len({p["bytes"] for p in line_pts}) >= 2:
            c, k = _weighted_line([p["bytes"] for p in line_pts], [p["us"] for p in line_pts])
        elif line_pts:  # one call on the line: through it (no fixed cost)
            c, k = 0.0, line_pts[0]["us"] / line_pts[0]["bytes"]
        else:
            c, k = 0.0, 0.0
        floor_total = (sum(p["us"] for p in floor_pts) / len(floor_pts)) if floor_pts else 0.0
        rate = 1.0 / (k * 1e3) if k > 0 else float("inf")  # GB/s
        if rate > MAX_FIT_GBPS and line_pts:  # flat: the bytes at the cap, the rest fixed
            rate = MAX_FIT_GBPS
            c = max(0.0, sum(p["us"] - p["bytes"] / (rate * 1e3) for p in line_pts)
                    / len(line_pts))
        cost = KernelCost(fixed_us=c, floor_us=max(0.0, floor_total - c),
                          gbps_per_sm=rate / num_sms, cap_gbps=rate)
        fits.append((_relative_sse(lambda p, cost=cost: cost.us(p["bytes"], num_sms), pts),
                     cost))
    line_err, line_cost = fits[0]
    if line_err <= len(pts) * FLOOR_MIN_RMS ** 2 or len(fits) < 2:
        return line_cost
    err, cost = min(fits[1:], key=lambda fit: fit[0])
    return cost if err <= 0.5 * line_err else line_cost


def fit_gemm_rate(shape: Shape, tokens: int, experts_us: Dict[str, float]):
    """`(tflops, half_rate_rows)` of the expert-GEMM model `tflops x m / (m + half_rate_rows)`
    from measured times per "topk,ep" (least squares in relative error; None when fewer than
    two settings)."""
    if len(experts_us) < 2:
        return None
    # t = F / T + (F m0 / T) / m: linear in u = 1 / T and v = m0 / T.
    rows = []
    for key, us in experts_us.items():
        topk, ep = (int(v) for v in key.split(","))
        flops = expert_flops(shape, tokens * topk, tokens) / 1e6  # TFLOP x 1e6: µs at 1 TFLOP/s
        rows.append((flops, flops / rows_per_expert(shape, tokens, topk, ep), us))
    ws = [1.0 / t ** 2 for _, _, t in rows]
    a11 = sum(w * f * f for w, (f, _, _) in zip(ws, rows))
    a12 = sum(w * f * g for w, (f, g, _) in zip(ws, rows))
    a22 = sum(w * g * g for w, (_, g, _) in zip(ws, rows))
    b1 = sum(w * f * t for w, (f, _, t) in zip(ws, rows))
    b2 = sum(w * g * t for w, (_, g, t) in zip(ws, rows))
    det = a11 * a22 - a12 * a12
    u, v = ((b1 * a22 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det) if det > 1e-12 * a11 * a22 \
        else (b1 / a11, 0.0)
    if v < 0 or u <= 0:
        u, v = b1 / a11, 0.0
    return 1.0 / u, v / u


def fit_constants(shape: Shape, tokens: int, measured: dict) -> Optional[dict]:
    """The model's constants fitted to a GPU run's `points` and expert times: per phase and SM
    budget a `KernelCost` (as a dict), and the expert GEMMs' rate; None without points (an
    assumed run, or a `--measurements` file of an older sweep)."""
    points = measured.get("points")
    if not points:
        return None
    kernels: Dict[str, Dict[str, dict]] = {}
    for phase in sorted({p["phase"] for p in points}):
        for num_sms in sorted({p["num_sms"] for p in points if p["phase"] == phase}):
            mine = [p for p in points if p["phase"] == phase and p["num_sms"] == num_sms]
            kernels.setdefault(phase, {})[str(num_sms)] = dataclasses.asdict(
                fit_kernel_cost(mine, num_sms))
    gemm = fit_gemm_rate(shape, tokens, measured.get("experts", {}))
    return {"kernels": kernels,
            "gemm": None if gemm is None else {"tflops": gemm[0], "half_rate_rows": gemm[1]}}


def fitted_us(constants: dict, point: dict) -> float:
    """A measured call's time as the fitted constants model it."""
    cost = KernelCost(**constants["kernels"][point["phase"]][str(point["num_sms"])])
    return cost.us(point["bytes"], point["num_sms"])


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Cluster:
    """Link rates of the cluster being modeled."""

    ranks_per_node: int = 8
    nic_gbps: float = 50.0
    nvlink_gbps: float = 450.0
    link_gbps_per_sm: float = 15.0
    gpu_mem_gb: float = 141.0
    pipeline_stages: int = 1


def layouts(ep: int, ranks_per_node: int) -> Optional[tuple]:
    """`(nodes, ranks per node)` of an EP group, or None when it does not tile whole nodes."""
    if ep <= ranks_per_node:
        return 1, ep
    if ep % ranks_per_node:
        return None
    return ep // ranks_per_node, ranks_per_node


def link_rows(shape: Shape, topk: int, ep: int, cluster: Cluster, routing_m: int,
              sample_tokens: int, seed: int = 0) -> Dict[str, float]:
    """Busiest-rank rows per token over the network and over NVLink for one dispatch."""
    nodes, per_node = layouts(ep, cluster.ranks_per_node)
    if ep == 1:
        return {"net": 0.0, "nvl": 0.0}
    idxs = route(sample_tokens, shape.experts, topk, ep, seed=seed, num_nodes=nodes,
                 group_topk=routing_m)
    rows = rank_rows(idxs, shape.experts, per_node)
    net = max(max(s, r) for s, r in zip(rows["net_send"], rows["net_recv"]))
    nvl = max(max(s, r) for s, r in zip(rows["nvl_send"], rows["nvl_recv"]))
    return {"net": net / sample_tokens, "nvl": nvl / sample_tokens}


def model(shape: Shape, tokens: int, measured: dict, eps: Sequence[int], cluster: Cluster,
          sample_tokens: int = 256) -> List[dict]:
    """One row per (top-k, EP, routing, wire, SMs) setting with its predicted times."""
    out = []
    keys = [tuple(k.split(",")) for k in measured["kernels"]]
    topks = sorted({int(k[0]) for k in keys})
    sms_list = sorted({int(k[2]) for k in keys})
    for topk in topks:
        for ep in eps:
            layout = layouts(ep, cluster.ranks_per_node)
            if layout is None or shape.experts % ep:
                continue
            nodes = layout[0]
            routings = [("uniform", 0)]
            if shape.node_limited and nodes > shape.node_limited:
                routings.append((f"node-limited M={shape.node_limited}", shape.node_limited))
            expert_us = measured["experts"].get(f"{topk},{ep}")
            if expert_us is None:
                logger.warning("sweep: no expert time for top-%d at EP %d in the measurements: "
                               "skipped", topk, ep)
                continue
            for routing, m in routings:
                per_token = link_rows(shape, topk, ep, cluster, m, sample_tokens)
                for wire in WIRES:
                    row = wire_row_bytes(wire, shape.hidden,
                                         measured.get("fp8_format", "blockwise"))
                    for num_sms in sms_list:
                        k = measured["kernels"][f"{topk},{wire},{num_sms}"]
                        nvl_rate = min(cluster.nvlink_gbps, cluster.link_gbps_per_sm * num_sms)

                        def links(row_bytes):
                            net = per_token["net"] * tokens * row_bytes
                            nvl = per_token["nvl"] * tokens * row_bytes
                            return max(net / (cluster.nic_gbps * 1e3), nvl / (nvl_rate * 1e3))

                        dispatch = k["dispatch_us"] + links(row)
                        combine = k["combine_us"] + links(bf16_row_bytes(shape.hidden))
                        layers = math.ceil(shape.moe_layers / cluster.pipeline_stages)
                        params = shape.experts // ep * shape.expert_params() * layers
                        out.append({
                            "topk": topk, "ep": ep, "nodes": nodes, "routing": routing,
                            "wire": wire, "num_sms": num_sms, "dispatch_us": dispatch,
                            "combine_us": combine, "expert_us": expert_us,
                            "comm_share": (dispatch + combine) / expert_us,
                            "net_rows_per_token": per_token["net"],
                            "nvl_rows_per_token": per_token["nvl"],
                            "expert_state_gb": params * 18 / 1e9})
    return out


def recommend(rows: List[dict], topk: int, limit: float, cluster: Cluster) -> Optional[dict]:
    """The recommended setting (module docstring), with a `reason`."""
    budget = 0.6 * cluster.gpu_mem_gb
    mine = [r for r in rows if r["topk"] == topk]
    fitting = [r for r in mine if r["expert_state_gb"] <= budget]
    if not mine:
        return None
    note = ""
    if not fitting:
        fitting = [r for r in mine if r["ep"] == max(x["ep"] for x in mine)]
        note = (f"; even EP {fitting[0]['ep']} needs {fitting[0]['expert_state_gb']:.0f} GB of "
                f"expert state per GPU (> {budget:.0f} GB): add pipeline stages or nodes")
    ep = min(r["ep"] for r in fitting)
    candidates = [r for r in fitting if r["ep"] == ep]
    under = [r for r in candidates if r["comm_share"] <= limit]
    if under:  # the least intervention that stays under the limit
        pick = dict(min(under, key=lambda r: (r["wire"] != "bf16", r["routing"] != "uniform",
                                              r["num_sms"], r["comm_share"])))
        how = "bf16 before FP8, plain routing, fewest SMs under the limit"
    else:
        best = min(r["comm_share"] for r in candidates)
        close = [r for r in candidates if r["comm_share"] <= best * 1.1]
        pick = dict(min(close, key=lambda r: (r["num_sms"], r["comm_share"])))
        how = "lowest comm share there, fewest SMs within 10%"
    verdict = "under" if pick["comm_share"] <= limit else "ABOVE"
    if verdict == "ABOVE":
        helps = (["FP8 dispatch"] if pick["wire"] != "fp8" else []) + (
            ["node-limited routing"] if pick["nodes"] > 1 and pick["routing"] == "uniform"
            else []) + ["a smaller EP group (more pipeline stages)", "more tokens per rank"]
        note += "; what usually helps: " + ", ".join(helps)
    pick["reason"] = (f"smallest EP whose expert state ({pick['expert_state_gb']:.0f} GB) "
                      f"fits {budget:.0f} GB; {how}; {verdict} the {100 * limit:.0f}% "
                      f"limit{note}")
    return pick


def format_table(shape: Shape, tokens: int, measured: dict, rows: List[dict],
                 cluster: Cluster, limit: float, pick: Optional[dict]) -> str:
    lines = [f"sweep: H {shape.hidden}, E {shape.experts}, top-{shape.topk}, F "
             f"{shape.moe_ffn_hidden}{' (SwiGLU)' if shape.gated else ''}, {shape.moe_layers} MoE "
             f"layers, {tokens} tokens per rank per micro-batch (forward, one layer)",
             f"kernel times: {measured['source']}; fp8 = "
             f"{measured.get('fp8_format', 'blockwise_1x128')} dispatch (combine: bf16)",
             f"links (model): NIC {cluster.nic_gbps:g} GB/s per GPU, NVLink "
             f"{cluster.nvlink_gbps:g} GB/s per direction, at most {cluster.link_gbps_per_sm:g} "
             f"GB/s per SM, {cluster.ranks_per_node} GPUs per node; net/tok, nvl/tok: busiest "
             f"rank's rows per token; comm share = (dispatch + combine) / expert; '*' above the "
             f"{100 * limit:.0f}% limit; exp GB: expert weights, grads and Adam states per GPU "
             f"(18 B/param, {cluster.pipeline_stages} pipeline stage(s), no optimizer "
             f"sharding)"]
    header = (f"{'topk':>4} {'EP':>4} {'nodes':>5} {'routing':<18} {'wire':<4} {'SMs':>4} "
              f"{'net/tok':>7} {'nvl/tok':>7} {'disp us':>8} {'comb us':>8} {'expert us':>9} "
              f"{'share':>7} {'exp GB':>7}")
    lines += [header, "-" * len(header)]
    for r in rows:
        flag = "*" if r["comm_share"] > limit else " "
        lines.append(f"{r['topk']:>4} {r['ep']:>4} {r['nodes']:>5} {r['routing']:<18} "
                     f"{r['wire']:<4} {r['num_sms']:>4} {r['net_rows_per_token']:>7.2f} "
                     f"{r['nvl_rows_per_token']:>7.2f} "
                     f"{r['dispatch_us']:>8.1f} {r['combine_us']:>8.1f} {r['expert_us']:>9.1f} "
                     f"{100 * r['comm_share']:>6.1f}%{flag}{r['expert_state_gb']:>7.0f}")
    if pick is not None:
        lines.append(f"recommended (top-{pick['topk']}): EP {pick['ep']} over {pick['nodes']} "
                     f"node(s), {pick['routing']} routing, {pick['wire']} dispatch, "
                     f"{pick['num_sms']} SMs: predicted comm share "
                     f"{100 * pick['comm_share']:.1f}% ({pick['reason']})")
    if "ASSUMED" in measured["source"]:
        lines.append("NOTE: no GPU measurement here: the kernel and GEMM times are assumed "
                     "(run on a GPU, or pass --measurements from one)")
    return "\n".join(lines)


def _cost_text(cost: KernelCost, num_sms: int) -> str:
    rate = min(cost.cap_gbps, cost.gbps_per_sm * num_sms)
    rate_text = "inf" if math.isinf(rate) else f"{rate:.0f}"
    return (f"{cost.fixed_us:.1f} us + max({cost.floor_us:.1f} us, bytes / {rate_text} GB/s)")


def format_constants(measured: dict, constants: Optional[dict], cluster: Cluster,
                     tflops: float) -> str:
    """Which of the model's constants were measured on this GPU and which are assumed."""
    links = (f"links ASSUMED (parameters): NVLink {cluster.nvlink_gbps:g} GB/s, at most "
             f"{cluster.link_gbps_per_sm:g} GB/s per SM, NIC {cluster.nic_gbps:g} GB/s, "
             f"{cluster.ranks_per_node} GPUs per node")
    default_gemm = f"{tflops:g} TFLOP/s x m / (m + {ASSUMED_GEMM_HALF_RATE_ROWS:g})"
    sms_list = sorted({int(k.split(",")[2]) for k in measured["kernels"]})
    if constants is None:
        why = ("no GPU measurement" if "ASSUMED" in measured["source"]
               else "these measurements hold no calibration points")
        lines = [f"model constants: kernels and expert GEMMs ASSUMED ({why}; the CPU defaults, "
                 f"sweep.ASSUMED_KERNEL); {links}"]
        for phase, cost in ASSUMED_KERNEL.items():
            for num_sms in sms_list:
                lines.append(f"  {phase:<13} SMs {num_sms:>3}: {_cost_text(cost, num_sms)}")
        lines.append(f"  expert GEMMs: {default_gemm}")
        return "\n".join(lines)
    points = measured["points"]
    counts = sorted({p["tokens"] for p in points})
    topks = sorted({p["topk"] for p in points})
    gemm = constants.get("gemm")
    lines = [f"model constants: kernels MEASURED, {measured['source']} (fit per phase and SM "
             f"budget over {len(counts)} token counts {', '.join(map(str, counts))} x top-k "
             f"{', '.join(map(str, topks))}); expert GEMMs "
             f"{'MEASURED' if gemm else 'ASSUMED (fewer than 2 settings measured)'}; {links}; "
             f"[in brackets: the CPU defaults]"]
    for phase, by_sms in constants["kernels"].items():
        for key, fields in by_sms.items():
            num_sms = int(key)
            lines.append(f"  {phase:<13} SMs {num_sms:>3}: "
                         f"{_cost_text(KernelCost(**fields), num_sms)}  "
                         f"[{_cost_text(ASSUMED_KERNEL[phase], num_sms)}]")
    if gemm:
        lines.append(f"  expert GEMMs: {gemm['tflops']:.0f} TFLOP/s x m / (m + "
                     f"{gemm['half_rate_rows']:.0f})  [{default_gemm}]")
    return "\n".join(lines)


def format_check(shape: Shape, tokens: int, measured: dict, constants: dict,
                 tflops: float) -> str:
    """Measured against the model with the fitted constants at every measured setting (and,
    in brackets, against the CPU defaults)."""
    points = measured["points"]
    lines = ["check: measured / model time at each measured setting (1.00: the model with the "
             "measured constants fits; in brackets: with the CPU defaults)"]

    def ratios(mine):
        fit = " ".join(f"{p['us'] / fitted_us(constants, p):.2f}" for p in mine)
        default = " ".join(
            f"{p['us'] / ASSUMED_KERNEL[p['phase']].us(p['bytes'], p['num_sms']):.2f}"
            for p in mine)
        return f"{fit} [{default}]"

    def order(key):
        topk, wire, num_sms = key.split(",")
        return int(topk), wire, int(num_sms)

    for key in sorted(measured["kernels"], key=order):
        topk, wire, num_sms = key.split(",")
        pick = {phase: sorted((p for p in points if p["phase"] == phase
                               and p["topk"] == int(topk) and p["num_sms"] == int(num_sms)),
                              key=lambda p: p["tokens"])
                for phase in (phase_key("dispatch", wire), "combine")}
        if not all(pick.values()):
            continue
        counts = " ".join(str(p["tokens"]) for p in pick["combine"])
        lines.append(f"  top-{topk} {wire}, SMs {num_sms}: dispatch "
                     f"{ratios(pick[phase_key('dispatch', wire)])}, combine "
                     f"{ratios(pick['combine'])} (tokens {counts})")
    gemm = constants.get("gemm")
    fit, default = [], []
    for key, us in sorted(measured["experts"].items()):
        topk, ep = (int(v) for v in key.split(","))
        default.append(us / assumed_expert_us(shape, tokens, topk, ep, tflops))
        if gemm:
            fit.append(us / assumed_expert_us(shape, tokens, topk, ep, gemm["tflops"],
                                              gemm["half_rate_rows"]))
    if default:
        fitted = f"{min(fit):.2f}-{max(fit):.2f}" if fit else "(no fit)"
        lines.append(f"  expert GEMMs: {fitted} [{min(default):.2f}-{max(default):.2f}] over "
                     f"{len(default)} (top-k, EP) settings")
    return "\n".join(lines)


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_deepep.tools.sweep",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default=None,
                   help="a model family's full-size shape (the flags below override it)")
    for name, help_ in (("hidden", "hidden size H"), ("experts", "routed experts E"),
                        ("topk", "experts per token K"), ("moe-ffn-hidden", "expert FFN width"),
                        ("moe-layers", "MoE layers (memory check)"),
                        ("node-limited", "group-limited routing: nodes per token (0: none)")):
        p.add_argument(f"--{name}", type=int, default=None, help=help_)
    p.add_argument("--topks", default=None, help="top-k values to sweep (default: the model's)")
    p.add_argument("--tokens", type=int, default=4096,
                   help="tokens per rank per micro-batch (sequence x micro-batch / TP)")
    p.add_argument("--num-sms", default="24,48,132", help="SM budgets, comma-separated")
    p.add_argument("--nodes", default="1,2,4,8",
                   help="node counts of the cluster; EP sizes run up to nodes x GPUs per node")
    p.add_argument("--ranks-per-node", type=int, default=8, help="GPUs per node")
    p.add_argument("--nic-gbps", type=float, default=50.0,
                   help="GB/s per NIC per direction, one NIC per GPU (400 Gb/s: 50)")
    p.add_argument("--nvlink-gbps", type=float, default=450.0,
                   help="NVLink GB/s per direction (H100/H200 SXM: 450)")
    p.add_argument("--link-gbps-per-sm", type=float, default=15.0,
                   help="most NVLink GB/s one SM of the comm kernels pushes (assumed)")
    p.add_argument("--gpu-mem-gb", type=float, default=141.0, help="GPU memory (H200: 141)")
    p.add_argument("--pipeline-stages", type=int, default=None,
                   help="pipeline stages (split the layers for the memory check; default: the "
                        "family's template, else 1)")
    p.add_argument("--gemm-tflops", type=float, default=650.0,
                   help="assumed bf16 GEMM TFLOP/s without a GPU (H100/H200: ~650 of 989)")
    p.add_argument("--fp8", default=None, choices=sorted(ALIASES) + sorted(FORMATS),
                   help="FP8 wire format measured and modeled (default: the family's template, "
                        "else blockwise)")
    p.add_argument("--limit", type=float, default=20.0, help="comm share limit, percent")
    p.add_argument("--assume", action="store_true", help="assumed rates even with a GPU")
    p.add_argument("--measurements", metavar="JSON", default=None,
                   help="kernel times of an earlier run (its --out DIR/sweep.json)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write sweep.json (measurements, rows, recommendation) here")
    return p.parse_args(argv)


def shape_from_args(args) -> Shape:
    base = FAMILIES.get(args.family) if args.family else None
    fields = {}
    for name in ("hidden", "experts", "topk", "moe_ffn_hidden", "moe_layers", "node_limited"):
        value = getattr(args, name)
        if value is None and base is not None:
            value = getattr(base, name)
        if value is None:
            if name in ("moe_layers", "node_limited"):
                value = 1 if name == "moe_layers" else 0
            else:
                raise SystemExit(f"sweep: give --family or --{name.replace('_', '-')}")
        fields[name] = value
    if base is not None:
        fields.update(gated=base.gated, shared_ffn_hidden=base.shared_ffn_hidden)
    return Shape(**fields)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """The command line; returns `{"measurements", "rows", "recommended"}`."""
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO)
    shape = shape_from_args(args)
    topks = _ints(args.topks) if args.topks else [shape.topk]
    if shape.topk not in topks:
        topks.append(shape.topk)
    stages = args.pipeline_stages or FAMILY_PIPELINE_STAGES.get(args.family, 1)
    cluster = Cluster(args.ranks_per_node, args.nic_gbps, args.nvlink_gbps,
                      args.link_gbps_per_sm, args.gpu_mem_gb, stages)
    max_ep = max(_ints(args.nodes)) * args.ranks_per_node
    eps = [e for e in (2 ** i for i in range(20)) if e <= min(max_ep, shape.experts)
           and shape.experts % e == 0 and layouts(e, args.ranks_per_node) is not None]
    for n in _ints(args.nodes):  # node counts that are not powers of two
        e = n * args.ranks_per_node
        if e not in eps and e <= shape.experts and shape.experts % e == 0:
            eps.append(e)
    eps.sort()
    sms_list = _ints(args.num_sms)
    if args.measurements:
        with open(args.measurements, encoding="utf-8") as f:
            measured = json.load(f)["measurements"]
        check_measured_transport(measured, args.measurements)
    else:
        gpu = False
        fp8 = args.fp8 or FAMILY_FP8.get(args.family, "blockwise")
        if not args.assume:
            try:
                import torch
                gpu = torch.cuda.is_available()
            except ImportError:
                gpu = False
        if gpu:
            measured = measure_gpu(shape, args.tokens, topks, sms_list, eps, fp8)
        else:
            measured = assumed_measurements(shape, args.tokens, topks, sms_list, eps,
                                            args.gemm_tflops, fp8)
    constants = fit_constants(shape, args.tokens, measured)
    sys.stdout.write(format_constants(measured, constants, cluster, args.gemm_tflops) + "\n")
    if constants is not None:
        sys.stdout.write(format_check(shape, args.tokens, measured, constants,
                                      args.gemm_tflops) + "\n")
    rows = model(shape, args.tokens, measured, eps, cluster)
    pick = recommend(rows, shape.topk, args.limit / 100.0, cluster)
    sys.stdout.write(format_table(shape, args.tokens, measured, rows, cluster,
                                  args.limit / 100.0, pick) + "\n")
    result = {"shape": dataclasses.asdict(shape), "tokens": args.tokens,
              "cluster": dataclasses.asdict(cluster), "measurements": measured,
              "constants": constants, "rows": rows, "recommended": pick}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
