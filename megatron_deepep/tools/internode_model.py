"""A model of the hierarchical internode dispatch and combine, computed from the layout.

`python -m megatron_deepep.tools.internode_model` routes N tokens on every rank of a simulated EP
group
(nodes x P ranks; no processes, no GPU), counts the rows every link carries with
`node_layout.compute_node_layout`, and turns them into time at assumed (or measured) link rates.
Every figure it prints is a model; the reported figures of DeepEP and HybridEP sit beside it.

Rows (for one dispatch; combine moves the same rows in the opposite direction). For a source rank
s = (node a, local index i) and a destination node b, `node_layout` gives the network rows s sends
to its rail peer (b, i) (tokens with an expert on node b, none for b = a) and the NVLink rows that
forwarder sends inside node b (one per (token, destination rank of b other than the forwarder)).
Summed over sources, per rank r = (b, i):

    net_send[r] = network rows r sends as a source
    net_recv[r] = network rows r receives as a forwarder  (sum over sources (a, i), a != b)
    nvl_send[r] = NVLink rows r sends as a forwarder       (sum over sources (a, i), any a)
    nvl_recv[r] = NVLink rows r receives as an expert rank (from forwarders (b, j), j != i)

Bytes: rows x row bytes: bf16 2 H; FP8 e4m3 with 1x128 fp32 scales H + 4 ceil(H / 128) (7392 B at
H = 7168); combine rows are bf16. Links are full duplex, so the busiest rank sets the time:

    B_net = max over r of max(net_send[r], net_recv[r]) x row bytes
    B_nvl = max over r of max(nvl_send[r], nvl_recv[r]) x row bytes
    t     = fixed + max(B_net / network rate, B_nvl / NVLink rate)     (legs pipelined)
    t_serial = fixed + B_net / network rate + B_nvl / NVLink rate    (no overlap: an upper bound)

where the NVLink rate is min(NVLink, kernel) when a kernel rate is measured (below).

Rates assumed by default (NVIDIA's H100/H200 SXM NVLink 4 and ConnectX-7 400 Gb/s figures):
50 GB/s per 400 Gb/s NIC, one NIC per GPU (DGX/HGX H100/H200 line rate; about 46-48 GB/s
practical); NVLink4 on H100/H200 SXM 450 GB/s per direction (18 links, 900 GB/s
bidirectional; NCCL reaches about 370 GB/s). `fixed` is 0 unless measured. `--measured-json
FILE` replaces them with measured costs: a JSON object with optional keys `network_gbps`,
`nvlink_gbps`, `fixed_us`, or per-byte costs `network_ns_per_byte`, `nvlink_ns_per_byte`
(1 / rate: 1 / (50 GB/s) = 0.02 ns per byte), and `kernel_gbps` (the GB/s per rank our
kernels reached with the ranks running at once, e.g. under CUDA MPS on one GPU at a 1/R share of
its SMs: a ceiling on the NVLink leg's rate that the link itself does not set), at the top
level (both phases) or inside `"dispatch"` / `"combine"` (one phase), and an optional
`"source"` string printed with the table. Several files may be given (`--measured-json A B`):
each key is taken from the last file that has it, and every rate names the file's source it
came from, e.g. the network rate measured through NVSHMEM's host proxy over loopback
(`dev/gpu/proxy.sh` writes `proxy_model.json`) beside the kernel rate measured under MPS
(`dev/gpu/mps.sh`: `mps_model.json`). `python -m megatron_deepep.bench.network` (the network
leg on one GPU) and `python -m megatron_deepep.tools.multinode_check --json` (dispatch and
combine GB/s per NIC on real nodes) write such files too.

Routing: "uniform" picks each token's top-k experts uniformly (top-k of uniform random scores);
"node-limited" runs Megatron's group-limited routing (`node_layout.node_limited_topk`, groups =
nodes, M groups per token) on the same scores, so the two differ only by the node limit. Seeded.

Reported figures (per GPU, one 400 Gb/s NIC each; the DeepEP README,
github.com/deepseek-ai/DeepEP, and NVIDIA's HybridEP notes):
DeepEP V1 (H800 + CX7, IBGDA, bottleneck bandwidth = network bytes / time) and HybridEP (H100, IB,
kernel only, algorithm bandwidth, which can exceed the line rate). Beside each model row, the time
those rates would take for the row's network bytes; the metrics differ, so read them as context.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from megatron_deepep.transport.node_layout import compute_node_layout, node_limited_topk
from megatron_deepep.transport.topology import Topology

PHASES = ("dispatch", "combine")

# (system, hardware, EP) -> {(phase, wire): (low GB/s, high GB/s)}.
REPORTED = {
    ("DeepEP", "H800+CX7", 16): {("dispatch", "any"): (43, 43), ("combine", "bf16"): (43, 43)},
    ("DeepEP", "H800+CX7", 32): {("dispatch", "any"): (58, 58), ("combine", "bf16"): (57, 57)},
    ("DeepEP", "H800+CX7", 64): {("dispatch", "any"): (51, 51), ("combine", "bf16"): (50, 50)},
    ("HybridEP", "H100", 16): {("dispatch", "fp8"): (62, 62), ("dispatch", "bf16"): (77, 77),
                               ("combine", "bf16"): (68, 68)},
    ("HybridEP", "H100", 64): {("dispatch", "any"): (47, 50), ("combine", "bf16"): (50, 50)},
}


@dataclasses.dataclass(frozen=True)
class Rates:
    """Link rates and a fixed cost for one phase.

    Attributes:
        kernel_gbps: a measured per-rank ceiling of the kernels on the NVLink leg (0: none).
        sources: `((key, source), ...)`: where each measured key came from (not compared).
    """

    network_gbps: float = 50.0
    nvlink_gbps: float = 450.0
    fixed_us: float = 0.0
    source: str = "assumed"
    kernel_gbps: float = 0.0
    sources: Tuple[Tuple[str, str], ...] = dataclasses.field(default=(), compare=False)

    @property
    def nvlink_effective_gbps(self) -> float:
        """The NVLink leg's rate: the link's, or the kernels' measured ceiling when lower."""
        if self.kernel_gbps > 0:
            return min(self.nvlink_gbps, self.kernel_gbps)
        return self.nvlink_gbps


def bf16_row_bytes(hidden: int) -> int:
    """Bytes of one bf16 row: 2 H."""
    return 2 * hidden


def fp8_row_bytes(hidden: int, block_size: int = 128, scale_bytes: int = 4) -> int:
    """Bytes of one FP8 e4m3 row with one scale per block: H + scale_bytes x ceil(H / block)."""
    return hidden + scale_bytes * math.ceil(hidden / block_size)


def route(num_tokens: int, num_experts: int, topk: int, num_ranks: int, *, seed: int,
          num_nodes: Optional[int] = None, group_topk: int = 0) -> List[torch.Tensor]:
    """`[num_ranks]` routings `[num_tokens, topk]` int64: uniform top-k of random scores, or with
    `group_topk` > 0 Megatron's group-limited top-k over `num_nodes` groups of the same scores."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_ranks):
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        if group_topk:
            out.append(node_limited_topk(scores, num_groups=num_nodes, group_topk=group_topk,
                                         topk=topk)[1])
        else:
            out.append(torch.topk(scores, k=topk, dim=1).indices)
    return out


def source_counts(layout) -> Dict[str, List[int]]:
    """What one source rank's `node_layout.NodeLayout` contributes to `accumulate_rank_rows`:
    `network` and `nvlink` `[num_nodes]` rows per destination node, `per_rank` `[R]` tokens per
    destination rank, and `tokens` (a one-element list: N). Small, so a multi-node check can
    all-gather it instead of every rank's routing."""
    return {"network": layout.num_network_rows_per_node.tolist(),
            "nvlink": layout.num_nvlink_rows_per_node.tolist(),
            "per_rank": layout.num_tokens_per_rank.tolist(),
            "tokens": [layout.num_tokens]}


def accumulate_rank_rows(counts: Sequence[Dict[str, List[int]]],
                         num_ranks_per_node: int) -> Dict[str, List[int]]:
    """Per-rank row counts of one dispatch from every source's `source_counts`.

    Args:
        counts: `[R]`, `source_counts` of every source rank, in rank order.
        num_ranks_per_node: P.

    Returns:
        As `rank_rows`.
    """
    num_ranks = len(counts)
    topo = Topology(num_ranks, num_ranks_per_node)
    per_node = num_ranks_per_node
    zeros = [0] * num_ranks
    rows = {k: list(zeros) for k in ("net_send", "net_recv", "nvl_send", "nvl_recv",
                                     "flat_net_send", "crossings", "tokens")}
    for src, c in enumerate(counts):
        node, local = divmod(src, per_node)
        network, nvlink, per_rank = c["network"], c["nvlink"], c["per_rank"]
        rows["net_send"][src] = sum(network)
        rows["crossings"][src] = rows["net_send"][src]  # one crossing per network row
        rows["tokens"][src] = c["tokens"][0]
        rows["flat_net_send"][src] = sum(n for d, n in enumerate(per_rank) if d // per_node != node)
        for b in range(topo.num_nodes):
            forwarder = b * per_node + local
            rows["net_recv"][forwarder] += network[b]
            rows["nvl_send"][forwarder] += nvlink[b]
            for j in range(per_node):
                if j != local:
                    rows["nvl_recv"][b * per_node + j] += per_rank[b * per_node + j]
    return rows


def rank_rows(topk_idxs: Sequence[torch.Tensor], num_experts: int,
              num_ranks_per_node: int) -> Dict[str, List[int]]:
    """Per-rank row counts of one dispatch over the whole group (see the module docstring).

    Args:
        topk_idxs: `[R]` routings `[N_r, K]`, one per source rank.
        num_experts: E.
        num_ranks_per_node: P.

    Returns:
        `[R]` lists: net_send, net_recv, nvl_send, nvl_recv (rows), flat_net_send (rows a flat,
        non-hierarchical all-to-all would send over the network: one per (token, rank on another
        node)), crossings (sum over tokens of network crossings), tokens.
    """
    topo = Topology(len(topk_idxs), num_ranks_per_node)
    counts = [source_counts(compute_node_layout(idx, num_experts, topo, rank=src))
              for src, idx in enumerate(topk_idxs)]
    return accumulate_rank_rows(counts, num_ranks_per_node)


def phase_model(rows: Dict[str, List[int]], row_bytes: int, rates: Rates) -> Dict[str, float]:
    """Bytes and modeled time of one phase moving `rows` at `row_bytes` each (module docstring).

    Combine moves the dispatch rows in reverse, so send and receive swap and the max of the two
    per rank is the same: pass the dispatch rows with the combine row bytes.
    """
    num_ranks = len(rows["net_send"])
    net = max(max(s, r) for s, r in zip(rows["net_send"], rows["net_recv"])) * row_bytes
    nvl = max(max(s, r) for s, r in zip(rows["nvl_send"], rows["nvl_recv"])) * row_bytes
    t_net = net / (rates.network_gbps * 1e3)  # bytes / (GB/s) -> µs: 1 GB/s = 1e3 bytes/µs
    t_nvl = nvl / (rates.nvlink_effective_gbps * 1e3)
    tokens = sum(rows["tokens"])
    return {
        "row_bytes": row_bytes,
        "network_bytes_max": net,
        "network_bytes_mean": sum(rows["net_send"]) * row_bytes / num_ranks,
        "nvlink_bytes_max": nvl,
        "nvlink_bytes_mean": sum(rows["nvl_send"]) * row_bytes / num_ranks,
        "flat_network_bytes_mean": sum(rows["flat_net_send"]) * row_bytes / num_ranks,
        "crossings_per_token": sum(rows["crossings"]) / tokens if tokens else 0.0,
        "network_us": t_net,
        "nvlink_us": t_nvl,
        "time_us": rates.fixed_us + max(t_net, t_nvl),
        "serial_time_us": rates.fixed_us + t_net + t_nvl,
        "network_gbps": rates.network_gbps,
        "nvlink_gbps": rates.nvlink_gbps,
        "kernel_gbps": rates.kernel_gbps,
        "nvlink_effective_gbps": rates.nvlink_effective_gbps,
        "fixed_us": rates.fixed_us,
        "rates_source": rates.source,
    }


def reported_times(ep: int, phase: str, wire: str, network_bytes: float) -> Dict[str, dict]:
    """The time each reported rate would take for `network_bytes`, per system, at this EP size."""
    out = {}
    for (system, hardware, rep_ep), figures in REPORTED.items():
        if rep_ep != ep:
            continue
        gbps = figures.get((phase, wire), figures.get((phase, "any")))
        if gbps is None:
            continue
        low, high = gbps
        out[system] = {"hardware": hardware, "gbps": [low, high],
                       "time_us": [network_bytes / (high * 1e3), network_bytes / (low * 1e3)]}
    return out


MEASURED_KEYS = ("network_gbps", "nvlink_gbps", "fixed_us", "kernel_gbps", "network_ns_per_byte",
                 "nvlink_ns_per_byte")


def _phase_values(measured: dict, phase: str) -> Dict[str, float]:
    """One measured-costs object's keys for `phase`, per-byte costs turned into rates."""
    values = {k: float(measured[k]) for k in MEASURED_KEYS if k in measured}
    values.update({k: float(v) for k, v in measured.get(phase, {}).items()
                   if k in MEASURED_KEYS})
    for k, v in values.items():
        if v < 0 or (k != "fixed_us" and v == 0):
            raise ValueError(f"measured {phase} {k}={v}: rates and costs per byte must be "
                             f"> 0, fixed_us >= 0")
    for link in ("network", "nvlink"):
        cost = values.pop(f"{link}_ns_per_byte", None)
        if cost is not None:  # 1 ns per byte = 1 GB/s
            values[f"{link}_gbps"] = 1.0 / cost
    return values


def load_rates(nic_gbps: float, nvlink_gbps: float,
               measured: Union[None, dict, Sequence[dict]]) -> Dict[str, Rates]:
    """Per-phase `Rates`: the flags, replaced by the keys of measured-costs JSON objects.

    Args:
        nic_gbps, nvlink_gbps: the assumed rates.
        measured: one object or several, in order: a key is taken from the last one holding it
            (each its own `source`, e.g. the network rate of the proxy path and the kernel rate
            under MPS).

    Returns:
        `{phase: Rates}`; `source` joins the sources that gave the phase a key ("assumed" when
        none did); `sources` says which key came from which.
    """
    base = Rates(network_gbps=nic_gbps, nvlink_gbps=nvlink_gbps)
    if not measured:
        return {p: base for p in PHASES}
    docs = [measured] if isinstance(measured, dict) else list(measured)
    out = {}
    for phase in PHASES:
        values, origin = {}, {}
        for doc in docs:
            found = _phase_values(doc, phase)
            values.update(found)
            origin.update({k: str(doc.get("source", "measured")) for k in found})
        given = set(origin.values())  # in file order
        used = list(dict.fromkeys(s for s in (str(d.get("source", "measured")) for d in docs)
                                  if s in given))
        out[phase] = dataclasses.replace(base, source="; ".join(used) or "assumed",
                                         sources=tuple(sorted(origin.items())), **values)
    return out


def run_model(*, tokens: int, hidden: int, experts: int, topk: int, nodes: Sequence[int],
              ranks_per_node: int, node_limited: int, seed: int,
              rates: Dict[str, Rates]) -> dict:
    """Every (EP, routing, phase, wire) case of the model, as one JSON-able dict."""
    cases = []
    skipped = []
    for num_nodes in nodes:
        num_ranks = num_nodes * ranks_per_node
        if experts % num_ranks:
            raise ValueError(f"--experts {experts} must be a multiple of the EP size {num_ranks} "
                             f"(--nodes {num_nodes} x --ranks-per-node {ranks_per_node})")
        routings = [("uniform", 0)]
        if node_limited and node_limited < num_nodes:
            routings.append((f"node-limited M={node_limited}", node_limited))
        elif node_limited:
            skipped.append(f"node-limited M={node_limited} at {num_nodes} nodes (M >= nodes: "
                           f"no limit)")
        for routing, group_topk in routings:
            idxs = route(tokens, experts, topk, num_ranks, seed=seed, num_nodes=num_nodes,
                         group_topk=group_topk)
            rows = rank_rows(idxs, experts, ranks_per_node)
            for phase, wire, row_bytes in (("dispatch", "bf16", bf16_row_bytes(hidden)),
                                           ("dispatch", "fp8", fp8_row_bytes(hidden)),
                                           ("combine", "bf16", bf16_row_bytes(hidden))):
                result = phase_model(rows, row_bytes, rates[phase])
                cases.append({"ep": num_ranks, "nodes": num_nodes,
                              "ranks_per_node": ranks_per_node, "routing": routing,
                              "phase": phase, "wire": wire, "model": result,
                              "reported": reported_times(num_ranks, phase, wire,
                                                         result["network_bytes_max"])})
    return {"inputs": {"tokens": tokens, "hidden": hidden, "experts": experts, "topk": topk,
                       "nodes": list(nodes), "ranks_per_node": ranks_per_node,
                       "node_limited": node_limited, "seed": seed,
                       "rates": {p: dataclasses.asdict(r) for p, r in rates.items()}},
            "cases": cases, "skipped": skipped}


def _range_us(times: Sequence[float]) -> str:
    low, high = times
    return f"{low:.0f}" if round(low) == round(high) else f"{low:.0f}-{high:.0f}"


def format_table(result: dict) -> str:
    """The compact table `main` prints."""
    inp = result["inputs"]
    lines = [f"internode model: {inp['tokens']} tokens/rank, hidden {inp['hidden']}, "
             f"{inp['experts']} experts, top-{inp['topk']}, seed {inp['seed']}; "
             f"bf16 row {bf16_row_bytes(inp['hidden'])} B, FP8 e4m3 + 1x128 fp32 scales "
             f"{fp8_row_bytes(inp['hidden'])} B"]
    for phase, rates in inp["rates"].items():
        kernel = (f", kernels {rates['kernel_gbps']:g} GB/s per rank (the NVLink leg runs at "
                  f"the lower of the two)" if rates.get("kernel_gbps") else "")
        lines.append(f"  {phase} rates ({rates['source']}): network {rates['network_gbps']:g} "
                     f"GB/s per NIC, NVLink {rates['nvlink_gbps']:g} GB/s per direction{kernel}, "
                     f"fixed {rates['fixed_us']:g} us")
        for key, source in rates.get("sources", ()):
            lines.append(f"    {key}: measured by {source}")
    lines.append("  MB = 1e6 bytes per rank, busiest rank (max of send and receive); "
                 "model us = fixed + max(net, NVLink) (pipelined); x/tok = network crossings "
                 "per token; DeepEP/HybridEP = their reported GB/s applied to the same network "
                 "bytes")
    header = (f"{'EP':>3} {'nodes':>7} {'routing':<18} {'phase':<8} {'wire':<4} {'x/tok':>5} "
              f"{'net MB':>7} {'NVL MB':>7} {'net us':>7} {'NVL us':>7} {'model us':>8} "
              f"{'DeepEP us (GB/s)':>17} {'HybridEP us (GB/s)':>19}")
    lines += [header, "-" * len(header)]
    for case in result["cases"]:
        m = case["model"]
        rep = []
        for system in ("DeepEP", "HybridEP"):
            r = case["reported"].get(system)
            if r is None:
                rep.append("-")
            else:
                low, high = r["gbps"]
                gbps = f"{low}" if low == high else f"{low}-{high}"
                rep.append(f"{_range_us(r['time_us'])} ({gbps})")
        lines.append(
            f"{case['ep']:>3} {case['nodes']:>3}x{case['ranks_per_node']:<3} "
            f"{case['routing']:<18} {case['phase']:<8} {case['wire']:<4} "
            f"{m['crossings_per_token']:>5.2f} {m['network_bytes_max'] / 1e6:>7.1f} "
            f"{m['nvlink_bytes_max'] / 1e6:>7.1f} {m['network_us']:>7.0f} {m['nvlink_us']:>7.0f} "
            f"{m['time_us']:>8.0f} {rep[0]:>17} {rep[1]:>19}")
    for note in result["skipped"]:
        lines.append(f"  skipped: {note}")
    lines.append("  all figures are a model from the layout (no kernel ran); reported: "
                 "DeepEP V1 H800+CX7 (bottleneck GB/s), HybridEP H100 kernel only (algorithm "
                 "GB/s), as their authors report them")
    return "\n".join(lines)


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_deepep.tools.internode_model",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size of a token")
    p.add_argument("--experts", type=int, default=256, help="experts in all")
    p.add_argument("--topk", type=int, default=8, help="experts per token")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 8],
                   help="node counts to model (EP = nodes x --ranks-per-node)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="GPUs per node")
    p.add_argument("--nic-gbps", type=float, default=50.0,
                   help="network GB/s per NIC per direction (400 Gb/s line rate: 50)")
    p.add_argument("--nvlink-gbps", type=float, default=450.0,
                   help="NVLink GB/s per direction (NVLink4 H100/H200 SXM: 450)")
    p.add_argument("--node-limited", type=int, default=4, metavar="M",
                   help="also model group-limited routing with M nodes per token (0: off)")
    p.add_argument("--seed", type=int, default=0, help="routing seed")
    p.add_argument("--json", metavar="OUT", help="write every figure and input as JSON")
    p.add_argument("--measured-json", metavar="IN", nargs="+",
                   help="measured rates replacing the assumed ones, one file or several (a key "
                        "from the last file holding it; see the module docstring)")
    args = p.parse_args(argv)
    for name in ("tokens", "hidden", "experts", "topk", "ranks_per_node"):
        if getattr(args, name) < 1 and not (name == "tokens" and args.tokens == 0):
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.nic_gbps <= 0 or args.nvlink_gbps <= 0:
        p.error("--nic-gbps and --nvlink-gbps must be > 0")
    if args.node_limited < 0:
        p.error(f"--node-limited must be >= 0, got {args.node_limited}")
    if any(n < 1 for n in args.nodes):
        p.error(f"--nodes must be >= 1, got {args.nodes}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """The CLI: prints the table, writes `--json`, returns the result dict."""
    args = _parse(argv)
    measured = []
    for path in args.measured_json or ():
        with open(path) as f:
            doc = json.load(f)
        if not isinstance(doc, dict):
            raise ValueError(f"--measured-json {path}: expected a JSON object, got "
                             f"{type(doc).__name__}")
        measured.append(doc)
    rates = load_rates(args.nic_gbps, args.nvlink_gbps, measured)
    result = run_model(tokens=args.tokens, hidden=args.hidden, experts=args.experts,
                       topk=args.topk, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                       node_limited=args.node_limited, seed=args.seed, rates=rates)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
