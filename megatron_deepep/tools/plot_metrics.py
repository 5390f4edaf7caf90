"""Renders a run's `deepep` dispatcher metrics to PNG.

    python -m megatron_deepep.tools.plot_metrics METRICS_DIR [--out DIR] [--rank N]

Reads `deepep_metrics_rank<N>.jsonl` from METRICS_DIR (a run with `MDEEP_METRICS=1` and
`MDEEP_METRICS_DIR=METRICS_DIR` writes it, see `megatron_deepep/megatron/metrics.py`; default:
the lowest rank present) and writes:

* `expert_load_heatmap.png`: one panel per MoE layer, tokens per expert (x) over steps (y),
  with the load imbalance (max/mean) of the last step in the title;
* `comm_time_per_layer.png`: median dispatch and combine time per layer (bars) and their
  GB/s to and from other ranks (lines), over all steps. When no bytes cross ranks (EP = 1)
  the figure has no GB/s axis and says so;
* `monitoring.png`: per step, the comm share of each layer (with the `MDEEP_COMM_SHARE_WARN`
  limit), the idle share of the expert phase from time (solid) and from token counts
  (dashed), and the tokens dropped (all layers). A field the run did not record (metrics
  written before it existed) leaves its panel empty, saying so.

Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys

from megatron_deepep import knobs

INSTALL_HINT = "plot_metrics.py needs matplotlib to draw: pip install matplotlib"


class MissingDependency(RuntimeError):
    """An optional package the plots need is not installed."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MissingDependency(INSTALL_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load(metrics_dir: str, rank=None):
    files = sorted(glob.glob(os.path.join(metrics_dir, "deepep_metrics_rank*.jsonl")),
                   key=lambda p: int(re.search(r"rank(\d+)", p).group(1)))
    if rank is not None:
        files = [p for p in files if p.endswith(f"rank{rank}.jsonl")]
    if not files:
        which = "deepep_metrics_rank*.jsonl" if rank is None else f"deepep_metrics_rank{rank}.jsonl"
        raise FileNotFoundError(f"no {which} in {metrics_dir} (a run writes it with "
                                f"MDEEP_METRICS=1 MDEEP_METRICS_DIR={metrics_dir})")
    steps = []
    with open(files[0], encoding="utf-8") as f:
        for line in f:
            if line.strip():
                steps.append(json.loads(line))
    if not steps:
        raise ValueError(f"{files[0]} holds no steps")
    return files[0], steps


def _median(values):
    values = sorted(values)
    n = len(values)
    if n == 0:
        return 0.0
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def ep_size(steps) -> int:
    """The EP size of the run: the length of any layer's `tokens_per_rank`."""
    for step in steps:
        for layer in step["layers"].values():
            return len(layer.get("tokens_per_rank", [])) or 1
    return 1


def bytes_cross_ranks(steps) -> bool:
    """Whether any dispatch or combine moved bytes to or from another rank."""
    return any(layer.get("bytes_sent", 0) > 0 or layer.get("bytes_recv", 0) > 0
               for step in steps for layer in step["layers"].values())


def plot(steps, out_dir: str, limit: float = None):
    """Writes the three figures to `out_dir`; returns their paths."""
    plt = _pyplot()
    import numpy as np

    os.makedirs(out_dir, exist_ok=True)
    layers = sorted({int(k) for s in steps for k in s["layers"]})

    cols = min(4, len(layers))
    rows = math.ceil(len(layers) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    for ax, layer in zip(axes.flat, layers):
        rows_ = [s["layers"][str(layer)] for s in steps if str(layer) in s["layers"]]
        grid = np.array([r["tokens_per_expert"] for r in rows_], dtype=float)
        step_ids = [s["step"] for s in steps if str(layer) in s["layers"]]
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                       extent=(-0.5, grid.shape[1] - 0.5, step_ids[-1] + 0.5, step_ids[0] - 0.5))
        imbalance = rows_[-1].get("load_imbalance")
        ax.set_title(f"layer {layer}: imbalance "
                     + (f"{imbalance:.2f}" if imbalance is not None else "not recorded"))
        ax.set_xlabel("expert")
        ax.set_ylabel("step")
        fig.colorbar(im, ax=ax, label="tokens")
    fig.suptitle(f"deepep: tokens per expert (EP = {ep_size(steps)})")
    fig.tight_layout()
    heat = os.path.join(out_dir, "expert_load_heatmap.png")
    fig.savefig(heat, dpi=110)
    plt.close(fig)

    def med(layer, key):
        return _median([s["layers"][str(layer)].get(key, 0.0) for s in steps
                        if str(layer) in s["layers"]])

    disp = [med(l, "dispatch_ms") for l in layers]
    comb = [med(l, "combine_ms") for l in layers]
    x = np.arange(len(layers))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(layers) + 3), 4))
    ax.bar(x - 0.2, disp, 0.4, label="dispatch ms")
    ax.bar(x + 0.2, comb, 0.4, label="combine ms")
    ax.set_xticks(x, [str(l) for l in layers])
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("median ms per step (forward)")
    ax.set_ylim(0, 1.3 * max(disp + comb + [1e-6]))  # room for the legend and the note
    handles, labels = ax.get_legend_handles_labels()
    if bytes_cross_ranks(steps):
        disp_bw = [med(l, "dispatch_GBps") for l in layers]
        comb_bw = [med(l, "combine_GBps") for l in layers]
        ax2 = ax.twinx()
        ax2.plot(x, disp_bw, "o-", color="tab:red", label="dispatch GB/s")
        ax2.plot(x, comb_bw, "s--", color="tab:purple", label="combine GB/s")
        ax2.set_ylabel("GB/s (bytes to/from other ranks / time)")
        ax2.set_ylim(0, 1.6 * max(disp_bw + comb_bw))
        handles2, labels2 = ax2.get_legend_handles_labels()
        handles, labels = handles + handles2, labels + labels2
    else:
        # EP = 1 (or routing that kept every token local): a bandwidth would be 0 / time.
        ax.text(0.02, 0.97, f"EP = {ep_size(steps)}: no bytes cross ranks, so no GB/s is shown",
                transform=ax.transAxes, va="top", fontsize=8)
    ax.legend(handles, labels, loc="upper right", fontsize=8)
    ax.set_title(f"deepep: communication per layer, EP = {ep_size(steps)} "
                 f"(median over {len(steps)} steps)")
    fig.tight_layout()
    comm = os.path.join(out_dir, "comm_time_per_layer.png")
    fig.savefig(comm, dpi=110)
    plt.close(fig)
    return heat, comm, plot_monitoring(plt, steps, layers, out_dir, limit)


def recorded(steps, key: str) -> bool:
    """Whether any layer of any step has `key` (older metrics files lack the newer fields)."""
    return any(key in layer for step in steps for layer in step["layers"].values())


def _series(steps, layer: int, key: str):
    rows = [(s["step"], s["layers"][str(layer)].get(key)) for s in steps
            if str(layer) in s["layers"]]
    return [x for x, _ in rows if _ is not None], [v for _, v in rows if v is not None]


def plot_monitoring(plt, steps, layers, out_dir: str, limit: float = None) -> str:
    """`monitoring.png`: comm share, idle share (time and counts) and drops per step."""
    limit = comm_share_limit() if limit is None else limit
    fig, (share, idle, drops) = plt.subplots(1, 3, figsize=(15, 3.8))

    def missing(ax, field):
        ax.text(0.5, 0.5, f"not recorded\n(no {field} field)", ha="center", va="center",
                transform=ax.transAxes, fontsize=9, color="0.4")

    if recorded(steps, "comm_share"):
        for layer in layers:
            share.plot(*_series(steps, layer, "comm_share"), label=f"layer {layer}")
        if limit > 0:
            share.axhline(limit, color="tab:red", linestyle="--", linewidth=1,
                          label=f"limit {100 * limit:.0f}%")
        share.legend(fontsize=7)
    else:
        missing(share, "comm_share")
    share.set_title("comm share: (dispatch + combine) / expert")
    for i, layer in enumerate(layers):
        color = f"C{i % 10}"
        if recorded(steps, "idle_share_time"):
            idle.plot(*_series(steps, layer, "idle_share_time"), color=color,
                      label=f"layer {layer} (time)")
        idle.plot(*_series(steps, layer, "idle_share"), color=color, linestyle="--",
                  label=f"layer {layer} (counts)")
    if not recorded(steps, "idle_share_time"):
        idle.text(0.02, 0.97, "from time: not recorded (no idle_share_time field)",
                  transform=idle.transAxes, va="top", fontsize=8, color="0.4")
    idle.legend(fontsize=7)
    idle.set_title("idle share of the expert phase (worst rank)")
    if recorded(steps, "tokens_dropped"):
        xs = [s["step"] for s in steps]
        drops.plot(xs, [sum(layer.get("tokens_dropped", 0) for layer in s["layers"].values())
                        for s in steps], color="tab:red")
        drops.set_ylim(bottom=0)
    else:
        missing(drops, "tokens_dropped")
    drops.set_title("tokens dropped per step (all layers)")
    for ax in (share, idle, drops):
        ax.set_xlabel("step")
    fig.suptitle(f"deepep: monitoring, EP = {ep_size(steps)}")
    fig.tight_layout()
    path = os.path.join(out_dir, "monitoring.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def comm_share_limit() -> float:
    """`MDEEP_COMM_SHARE_WARN`, the dispatcher's warning limit, as a fraction (0.2 unset).

    Raises:
        ValueError: a bad value, naming the variable (as the dispatcher refuses it).
    """
    return knobs.get("COMM_SHARE_WARN") / 100.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Plots the per-step metrics of the deepep dispatcher (expert load and "
                    "communication time per MoE layer). Needs matplotlib.")
    parser.add_argument("metrics_dir",
                        help="the folder a run wrote with MDEEP_METRICS=1 "
                             "MDEEP_METRICS_DIR=<folder> (holds deepep_metrics_rank<N>.jsonl)")
    parser.add_argument("--out", default=None,
                        help="folder for the PNG files (default: metrics_dir)")
    parser.add_argument("--rank", type=int, default=None,
                        help="which rank's file to plot (default: the lowest rank present; "
                             "rank 0 of each EP group writes one)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _path, steps = load(args.metrics_dir, args.rank)
        outputs = plot(steps, args.out or args.metrics_dir)
    except (FileNotFoundError, ValueError, MissingDependency) as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
