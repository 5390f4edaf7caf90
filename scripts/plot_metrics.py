#!/usr/bin/env python3
"""Renders a run's `deepep` dispatcher metrics to PNG.

    python scripts/plot_metrics.py RUN_METRICS_DIR [--out DIR] [--rank N]

Reads `deepep_metrics_rank<N>.jsonl` (written when metrics are on with a `metrics_dir`, see
`megatron_deepep/megatron/metrics.py`; default: the lowest rank present) and writes:

* `expert_load_heatmap.png`: one panel per MoE layer, tokens per expert (x) over steps (y),
  with the load imbalance (max/mean) of the last step in the title;
* `comm_time_per_layer.png`: median dispatch and combine time per layer (bars) and their
  GB/s (line), over all steps.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys


def load(metrics_dir: str, rank=None):
    files = sorted(glob.glob(os.path.join(metrics_dir, "deepep_metrics_rank*.jsonl")),
                   key=lambda p: int(re.search(r"rank(\d+)", p).group(1)))
    if rank is not None:
        files = [p for p in files if p.endswith(f"rank{rank}.jsonl")]
    if not files:
        raise FileNotFoundError(f"no deepep_metrics_rank*.jsonl in {metrics_dir} (run with "
                                f"metrics on and a metrics_dir, e.g. MDEEP_METRICS=1 "
                                f"MDEEP_METRICS_DIR=...)")
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


def plot(steps, out_dir: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
        ax.set_title(f"layer {layer}: imbalance {rows_[-1]['load_imbalance']:.2f}")
        ax.set_xlabel("expert")
        ax.set_ylabel("step")
        fig.colorbar(im, ax=ax, label="tokens")
    fig.suptitle("deepep: tokens per expert")
    fig.tight_layout()
    heat = os.path.join(out_dir, "expert_load_heatmap.png")
    fig.savefig(heat, dpi=110)
    plt.close(fig)

    def med(layer, key):
        return _median([s["layers"][str(layer)][key] for s in steps if str(layer) in s["layers"]])

    disp = [med(l, "dispatch_ms") for l in layers]
    comb = [med(l, "combine_ms") for l in layers]
    disp_bw = [med(l, "dispatch_GBps") for l in layers]
    comb_bw = [med(l, "combine_GBps") for l in layers]
    x = np.arange(len(layers))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(layers) + 3), 4))
    ax.bar(x - 0.2, disp, 0.4, label="dispatch ms")
    ax.bar(x + 0.2, comb, 0.4, label="combine ms")
    ax.set_xticks(x, [str(l) for l in layers])
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("median ms per step (forward)")
    ax2 = ax.twinx()
    ax2.plot(x, disp_bw, "o-", color="tab:red", label="dispatch GB/s")
    ax2.plot(x, comb_bw, "s--", color="tab:purple", label="combine GB/s")
    ax2.set_ylabel("GB/s (bytes to/from peers / time)")
    handles = ax.get_legend_handles_labels()
    handles2 = ax2.get_legend_handles_labels()
    ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], loc="upper right", fontsize=8)
    ax.set_title(f"deepep: communication per layer (median over {len(steps)} steps)")
    fig.tight_layout()
    comm = os.path.join(out_dir, "comm_time_per_layer.png")
    fig.savefig(comm, dpi=110)
    plt.close(fig)
    return heat, comm


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics_dir")
    parser.add_argument("--out", default=None, help="output folder (default: metrics_dir)")
    parser.add_argument("--rank", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        path, steps = load(args.metrics_dir, args.rank)
    except (FileNotFoundError, ValueError) as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 2
    for out in plot(steps, args.out or args.metrics_dir):
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
