"""Renders a run's `deepep` dispatcher metrics into one self-contained HTML report.

    python -m megatron_deepep.tools.report METRICS_DIR [--out report.html] [--comm-share-limit 20]

The one command that turns any run's metrics folder into its report. Beside the HTML it also
writes the PNG figures of `tools/plot_metrics.py` (load heatmaps, communication per layer,
comm share / idle share / drops per step) where matplotlib is installed, and says so in one
line where it is not (`--no-png`: the HTML only).

Reads every `deepep_metrics_rank<N>.jsonl` in METRICS_DIR (a run with `--moe-mdeep-metrics
--moe-mdeep-metrics-dir METRICS_DIR`, or `MDEEP_METRICS=1 MDEEP_METRICS_DIR=...`, writes one per
EP group: rank 0 of each group; its values are already reduced over the group) and all of their
steps, and writes one HTML file that opens offline: charts are inline SVG and the heatmaps
inline PNG (base64), drawn with the standard library only (no matplotlib, no CDN, no script).

Sections: a summary table per MoE layer (median dispatch, combine and expert ms, comm share,
GB/s, load and idle shares, drops); comm share per layer over steps, with the warning limit;
the per-expert load heatmaps (tokens per expert over steps, one per layer); the idle share
over steps, from token counts and, where recorded, from time, with each EP rank's expert time
per layer, the steps where the expert map changed (re-placements) marked, and the idle share
before and after each; dispatch and combine GB/s over
steps (only when bytes cross ranks); tokens dropped per step. Metrics written before expert
timing existed (no `expert_ms`) get the sections they can: the report says what is missing.
Files of several EP groups that hold the same layer (data-parallel replicas) are averaged per
step; the sources table lists them.
"""

from __future__ import annotations

import argparse
import base64
import glob
import html
import json
import math
import os
import re
import statistics
import struct
import sys
import zlib


#: Most points per line (longer series are averaged into this many buckets).
MAX_POINTS = 400
#: Most heatmap rows (steps are averaged into this many buckets).
MAX_HEAT_ROWS = 200
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
# Viridis anchors (0, 0.25, 0.5, 0.75, 1).
VIRIDIS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------
def metric_files(metrics_dir: str):
    """The metrics files of a run, by rank."""
    files = glob.glob(os.path.join(metrics_dir, "deepep_metrics_rank*.jsonl"))
    files.sort(key=lambda p: int(re.search(r"rank(\d+)\.jsonl$", p).group(1)))
    if not files:
        raise FileNotFoundError(
            f"no deepep_metrics_rank*.jsonl in {metrics_dir} (a run writes them with "
            f"--moe-mdeep-metrics --moe-mdeep-metrics-dir {metrics_dir}, or MDEEP_METRICS=1 "
            f"MDEEP_METRICS_DIR={metrics_dir})")
    return files


def load_run(metrics_dir: str):
    """`(sources, series)`: per file `{path, steps, layers}`, and `{layer: {step: [records]}}`
    (one record per file holding that layer at that step)."""
    sources, series = [], {}
    for path in metric_files(metrics_dir):
        steps, layers = 0, set()
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number}: not JSON ({e})") from None
                steps += 1
                for name, record in entry.get("layers", {}).items():
                    layers.add(int(name))
                    series.setdefault(int(name), {}).setdefault(int(entry["step"]), []).append(
                        record)
        sources.append({"path": path, "steps": steps, "layers": sorted(layers)})
    if not series:
        raise ValueError(f"the metrics files in {metrics_dir} hold no steps")
    return sources, series


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def layer_values(series, layer: int, key: str):
    """`[(step, value)]` of one field of one layer (mean over files; None where missing)."""
    out = []
    for step in sorted(series[layer]):
        out.append((step, _mean([r.get(key) for r in series[layer][step]])))
    return out


def replacements(series, layer: int):
    """Steps at which a layer's expert map changed (a re-placement took effect there): the
    `physical_to_logical` of a step's records differs from the step before (None: no map)."""
    out, previous = [], None
    for i, step in enumerate(sorted(series[layer])):
        current = series[layer][step][0].get("physical_to_logical")
        if i and current != previous:
            out.append(step)
        previous = current
    return out


def replacement_table(series, layers) -> str:
    """Idle share (counts; time where recorded) before and after each re-placement: the mean
    over the steps since the previous change and until the next one."""
    rows = []
    for layer in layers:
        changes = replacements(series, layer)
        steps = sorted(series[layer])
        bounds = [steps[0]] + changes + [steps[-1] + 1]
        for i, step in enumerate(changes):
            def mean(key, lo, hi):
                return _mean([v for s, v in layer_values(series, layer, key) if lo <= s < hi])
            cells = []
            for key in ("idle_share", "idle_share_time"):
                for lo, hi in ((bounds[i], step), (step, bounds[i + 2])):
                    cells.append(_pct(mean(key, lo, hi)))
            rows.append(f"<tr><td>{layer}</td><td>{step}</td>"
                        + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    if not rows:
        return ("<p class='note'>No re-placement recorded: the expert map "
                "(physical_to_logical) did not change during the run.</p>")
    return ("<table><tr><th>layer</th><th>re-placed at step</th><th>idle share (counts) "
            "before</th><th>after</th><th>idle share (time) before</th><th>after</th></tr>"
            + "".join(rows) + "</table>")


def has_field(series, key: str) -> bool:
    return any(key in r for steps in series.values() for recs in steps.values() for r in recs)


# ------------------------------------------------------------------------------------------------
# Drawing (stdlib only)
# ------------------------------------------------------------------------------------------------
def _bucket(points, limit: int):
    """At most `limit` points: consecutive steps averaged."""
    points = [(s, v) for s, v in points if v is not None]
    if len(points) <= limit:
        return points
    size = math.ceil(len(points) / limit)
    return [(points[i][0], sum(v for _, v in points[i:i + size]) / len(points[i:i + size]))
            for i in range(0, len(points), size)]


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for m in (1, 2, 2.5, 5, 10):
        if value <= m * exp:
            return m * exp
    return 10 * exp


def line_chart(lines, *, title: str, ylabel: str, limit=None, percent=False,
               width: int = 760, height: int = 260, marks=()) -> str:
    """An SVG line chart. `lines`: `[(label, [(step, value)])]`. The y range stops at the 98th
    percentile times 1.5 when a few points (the first step's compile) would flatten the rest;
    those points are drawn on the top edge and counted in the caption. `marks`: steps drawn as
    dashed vertical lines (re-placements)."""
    lines = [(label, _bucket(pts, MAX_POINTS)) for label, pts in lines]
    values = sorted(v for _, pts in lines for _, v in pts)
    steps = [s for _, pts in lines for s, _ in pts]
    if not values:
        return f"<p class='note'>{html.escape(title)}: no values recorded.</p>"
    top = values[-1]
    robust = values[min(len(values) - 1, int(0.98 * len(values)))] * 1.5
    clipped = 0
    if robust > 0 and top > robust:
        top = robust
        clipped = sum(v > top for v in values)
    if limit is not None:
        top = max(top, limit * 1.2)
    ymax = _nice_max(top)
    x0, x1 = min(steps), max(steps)
    left, right, up, down = 62, 150, 28, 36
    pw, ph = width - left - right, height - up - down

    def px(s):
        return left + (pw * (s - x0) / (x1 - x0) if x1 > x0 else pw / 2)

    def py(v):
        return up + ph * (1 - min(v, ymax) / ymax)

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
           f"role='img' aria-label='{html.escape(title)}'>",
           f"<text x='{left}' y='16' class='t'>{html.escape(title)}</text>"]
    for i in range(5):
        v = ymax * i / 4
        y = py(v)
        label = f"{100 * v:.0f}%" if percent else f"{v:.3g}"
        out.append(f"<line x1='{left}' x2='{left + pw}' y1='{y:.1f}' y2='{y:.1f}' class='g'/>"
                   f"<text x='{left - 4}' y='{y + 4:.1f}' class='a' text-anchor='end'>"
                   f"{label}</text>")
    for s in sorted({x0, x1, (x0 + x1) // 2}):
        out.append(f"<text x='{px(s):.1f}' y='{up + ph + 14}' class='a' "
                   f"text-anchor='middle'>{s}</text>")
    out.append(f"<text x='{left + pw / 2:.0f}' y='{height - 4}' class='a' "
               f"text-anchor='middle'>step</text>"
               f"<text x='12' y='{up + ph / 2:.0f}' class='a' text-anchor='middle' "
               f"transform='rotate(-90 12 {up + ph / 2:.0f})'>{html.escape(ylabel)}</text>")
    for m in sorted(set(marks)):
        if x0 <= m <= x1:
            out.append(f"<line x1='{px(m):.1f}' x2='{px(m):.1f}' y1='{up}' y2='{up + ph}' "
                       f"class='lim'/><text x='{px(m) + 3:.1f}' y='{up + 10}' class='a'>"
                       f"re-placed</text>")
    if limit is not None:
        y = py(limit)
        out.append(f"<line x1='{left}' x2='{left + pw}' y1='{y:.1f}' y2='{y:.1f}' class='lim'/>"
                   f"<text x='{left + pw - 2}' y='{y - 3:.1f}' class='a' text-anchor='end'>"
                   f"limit {100 * limit:.0f}%</text>")
    for i, (label, pts) in enumerate(lines):
        color = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in pts)
        if len(pts) == 1:
            out.append(f"<circle cx='{px(pts[0][0]):.1f}' cy='{py(pts[0][1]):.1f}' r='3' "
                       f"fill='{color}'/>")
        else:
            out.append(f"<polyline fill='none' stroke='{color}' stroke-width='1.5' "
                       f"points='{coords}'/>")
        if i < 16:
            ly = up + 12 * i + 6
            out.append(f"<line x1='{left + pw + 10}' x2='{left + pw + 26}' y1='{ly}' y2='{ly}' "
                       f"stroke='{color}' stroke-width='2'/><text x='{left + pw + 30}' "
                       f"y='{ly + 4}' class='a'>{html.escape(label)}</text>")
    if len(lines) > 16:
        out.append(f"<text x='{left + pw + 10}' y='{up + 12 * 16 + 10}' class='a'>"
                   f"+{len(lines) - 16} more</text>")
    out.append("</svg>")
    caption = ""
    if clipped:
        caption = (f"<p class='note'>{clipped} point(s) above {ymax:.3g} drawn on the top edge "
                   f"(typically the first step, which compiles the kernels).</p>")
    return "".join(out) + caption


def _viridis(t: float):
    t = min(max(t, 0.0), 1.0) * (len(VIRIDIS) - 1)
    i = min(int(t), len(VIRIDIS) - 2)
    f = t - i
    return tuple(int(a + (b - a) * f) for a, b in zip(VIRIDIS[i], VIRIDIS[i + 1]))


def png_data_uri(grid) -> str:
    """A base64 PNG (one pixel per cell, viridis over 0..max) of `grid` (rows of floats)."""
    top = max((v for row in grid for v in row), default=0.0) or 1.0
    raw = b"".join(b"\x00" + bytes(c for v in row for c in _viridis(v / top)) for row in grid)

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    height, width = len(grid), len(grid[0])
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0,
                                                             0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def heatmap(series, layer: int) -> str:
    """Tokens per expert (columns) over steps (rows, bucketed), as an inline PNG."""
    rows = [(s, v) for s, v in layer_values_vector(series, layer, "tokens_per_expert")]
    if not rows:
        return ""
    size = max(1, math.ceil(len(rows) / MAX_HEAT_ROWS))
    grid = []
    for i in range(0, len(rows), size):
        block = [v for _, v in rows[i:i + size]]
        grid.append([sum(col) / len(block) for col in zip(*block)])
    num_experts = len(grid[0])
    last = rows[-1][1]
    mean = sum(last) / len(last) if last else 0
    imbalance = max(last) / mean if mean else 1.0
    scale = max(1, min(8, 640 // max(num_experts, 1)))
    w, h = num_experts * scale, max(len(grid) * max(1, 160 // len(grid)), 40)
    return (f"<figure><img src='{png_data_uri(grid)}' width='{w}' height='{h}' "
            f"alt='layer {layer} tokens per expert over steps' class='heat'/>"
            f"<figcaption>layer {layer}: {num_experts} experts (x), steps {rows[0][0]}"
            f"&ndash;{rows[-1][0]} (y, down); max/mean at the last step {imbalance:.2f}; "
            f"color: 0 (dark) to {max(max(r) for r in grid):.0f} tokens (yellow)</figcaption>"
            f"</figure>")


def layer_values_vector(series, layer: int, key: str):
    """`[(step, vector)]` of a list field (element-wise mean over files)."""
    out = []
    for step in sorted(series[layer]):
        vectors = [r[key] for r in series[layer][step] if key in r]
        if vectors:
            out.append((step, [sum(col) / len(col) for col in zip(*vectors)]))
    return out


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------
def _median(points):
    values = [v for _, v in points if v is not None]
    return statistics.median(values) if values else None


def _fmt(value, spec=".3f", suffix=""):
    return "&ndash;" if value is None else f"{value:{spec}}{suffix}"


def _pct(value):
    return _fmt(None if value is None else 100 * value, ".1f", "%")


def summary_rows(series, limit: float):
    rows = []
    for layer in sorted(series):
        med = {k: _median(layer_values(series, layer, k)) for k in (
            "dispatch_ms", "combine_ms", "expert_ms", "comm_share", "dispatch_GBps",
            "combine_GBps", "load_imbalance", "idle_share", "idle_share_time")}
        dropped = [v for _, v in layer_values(series, layer, "tokens_dropped") if v is not None]
        high = med["comm_share"] is not None and med["comm_share"] > limit
        cells = [str(layer), _fmt(med["dispatch_ms"]), _fmt(med["combine_ms"]),
                 _fmt(med["expert_ms"]), _pct(med["comm_share"]),
                 _fmt(med["dispatch_GBps"], ".1f"), _fmt(med["combine_GBps"], ".1f"),
                 _fmt(med["load_imbalance"], ".2f"), _pct(med["idle_share"]),
                 _pct(med["idle_share_time"]),
                 str(int(sum(dropped))) if dropped else "&ndash;"]
        rows.append(f"<tr{' class=high' if high else ''}>"
                    + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "".join(rows)


CSS = """body{font-family:sans-serif;max-width:1100px;margin:1em auto;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;
text-align:right}th{background:#f0f0f0}tr.high td{background:#fde0dc}.note{color:#666;
font-size:13px}.t{font-size:13px;font-weight:bold}.a{font-size:11px;fill:#444}.g{stroke:#e5e5e5}
.lim{stroke:#d62728;stroke-dasharray:5 3}img.heat{image-rendering:pixelated;border:1px solid
#ccc}figure{display:inline-block;margin:6px 12px 6px 0;vertical-align:top}figcaption{font-size:
12px;color:#555;max-width:420px}"""


def render(metrics_dir: str, limit: float = 0.20, max_heatmaps: int = 64) -> str:
    """The report's HTML text."""
    sources, series = load_run(metrics_dir)
    layers = sorted(series)
    any_layer = series[layers[0]]
    first = any_layer[min(any_layer)][0]
    ep = len(first.get("tokens_per_rank", [])) or 1
    num_experts = len(first.get("tokens_per_expert", []))
    all_steps = sorted({s for l in layers for s in series[l]})
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>deepep metrics: "
             f"{html.escape(os.path.basename(os.path.abspath(metrics_dir)))}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>deepep dispatcher metrics</h1><p>{html.escape(os.path.normpath(metrics_dir))}"
             f": {len(sources)} file(s), {len(all_steps)} steps ({all_steps[0]}&ndash;"
             f"{all_steps[-1]}), {len(layers)} MoE layer(s), EP = {ep}, {num_experts} experts."
             f"</p>"]
    has_expert = has_field(series, "expert_ms")
    parts.append("<h2>Summary per layer (median over steps)</h2><table><tr><th>layer</th>"
                 "<th>dispatch ms</th><th>combine ms</th><th>expert ms</th><th>comm share</th>"
                 "<th>dispatch GB/s</th><th>combine GB/s</th><th>load max/mean</th>"
                 "<th>idle share (counts)</th><th>idle share (time)</th><th>tokens dropped "
                 f"(sum)</th></tr>{summary_rows(series, limit)}</table>"
                 f"<p class='note'>comm share = (dispatch + combine) / expert compute; rows "
                 f"above {100 * limit:.0f}% are shaded: EP scaling is at its limit there (FP8 "
                 f"dispatch, node-limited routing, a smaller EP group or more tokens per rank "
                 f"usually help). Times are per step, summed over micro-batches, mean over the "
                 f"EP ranks.</p>")

    parts.append("<h2>Comm share per layer over steps</h2>")
    if has_expert:
        parts.append(line_chart([(f"layer {l}", layer_values(series, l, "comm_share"))
                                 for l in layers], title="(dispatch + combine) / expert compute",
                                ylabel="comm share", limit=limit, percent=True))
    else:
        parts.append("<p class='note'>comm share not recorded: these metrics predate expert "
                     "timing (no expert_ms field). Dispatch + combine time instead:</p>")
    parts.append(line_chart(
        [(f"layer {l}", [(s, (d or 0) + (c or 0)) for (s, d), (_, c) in zip(
            layer_values(series, l, "dispatch_ms"), layer_values(series, l, "combine_ms"))])
         for l in layers], title="dispatch + combine ms per step", ylabel="ms"))

    parts.append("<h2>Per-expert load</h2>")
    shown = layers[:max_heatmaps]
    parts.extend(heatmap(series, l) for l in shown)
    if len(layers) > len(shown):
        parts.append(f"<p class='note'>{len(layers) - len(shown)} more layer(s) not drawn "
                     f"(--max-heatmaps).</p>")

    parts.append("<h2>Idle share of the expert phase</h2>")
    marks = sorted({s for l in layers for s in replacements(series, l)})
    parts.append(line_chart([(f"layer {l}", layer_values(series, l, "idle_share"))
                             for l in layers], title="from token counts: 1 - min/max rank load",
                            ylabel="idle share", percent=True, marks=marks))
    if has_field(series, "idle_share_time"):
        parts.append(line_chart([(f"layer {l}", layer_values(series, l, "idle_share_time"))
                                 for l in layers],
                                title="from time: 1 - min/max rank expert time (worst rank)",
                                ylabel="idle share", percent=True, marks=marks))
        parts.append(per_rank_table(series))
    else:
        parts.append("<p class='note'>idle share from time not recorded (no idle_share_time "
                     "field).</p>")

    parts.append("<h3>Before and after each re-placement</h3>")
    parts.append(replacement_table(series, layers))

    parts.append("<h2>Bandwidth</h2>")
    if has_field(series, "bytes_sent") and any(
            (v or 0) > 0 for l in layers for _, v in layer_values(series, l, "bytes_sent")):
        for key, name in (("dispatch_GBps", "dispatch"), ("combine_GBps", "combine")):
            parts.append(line_chart([(f"layer {l}", layer_values(series, l, key))
                                     for l in layers],
                                    title=f"{name} GB/s (bytes to/from other ranks / time)",
                                    ylabel="GB/s"))
    else:
        parts.append(f"<p class='note'>EP = {ep}: no bytes crossed ranks, so there is no "
                     f"GB/s to show.</p>")

    parts.append("<h2>Tokens dropped</h2>")
    if has_field(series, "tokens_dropped"):
        per_step = {}
        for l in layers:
            for s, v in layer_values(series, l, "tokens_dropped"):
                per_step[s] = per_step.get(s, 0) + (v or 0)
        total = sum(per_step.values())
        parts.append(f"<p>{int(total)} (token, expert) entries dropped over the run (router "
                     f"capacity and pad-to-capacity overflow), all layers.</p>")
        parts.append(line_chart([("all layers", sorted(per_step.items()))],
                                title="dropped entries per step", ylabel="entries"))
    else:
        parts.append("<p class='note'>drops not recorded (no tokens_dropped field).</p>")

    parts.append("<h2>Sources</h2><table><tr><th>file</th><th>steps</th><th>layers</th></tr>")
    for src in sources:
        parts.append(f"<tr><td>{html.escape(os.path.basename(src['path']))}</td>"
                     f"<td>{src['steps']}</td><td>{', '.join(map(str, src['layers']))}</td></tr>")
    parts.append("</table><p class='note'>Each file is written by rank 0 of one EP group; a "
                 "layer held by several files (data-parallel replicas) is averaged per step."
                 "</p></body></html>")
    return "\n".join(parts)


def per_rank_table(series) -> str:
    """Median expert ms of each EP rank per layer; the slowest rank of each layer in bold."""
    rows, width = [], 0
    for layer in sorted(series):
        vectors = [v for _, v in layer_values_vector(series, layer, "expert_ms_per_rank")]
        if not vectors:
            continue
        medians = [statistics.median(col) for col in zip(*vectors)]
        width = max(width, len(medians))
        top = max(medians)
        cells = "".join(f"<td>{'<b>' if m == top else ''}{m:.3f}{'</b>' if m == top else ''}"
                        f"</td>" for m in medians)
        rows.append(f"<tr><td>{layer}</td>{cells}</tr>")
    if not rows:
        return ""
    head = "".join(f"<th>rank {r}</th>" for r in range(width))
    return ("<p>Expert ms per EP rank (median over steps; the slowest in bold: the others wait "
            f"for it)</p><table><tr><th>layer</th>{head}</tr>{''.join(rows)}</table>")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_deepep.tools.report",
        description="Renders a run's deepep metrics (every deepep_metrics_rank*.jsonl, all "
                    "steps) into one self-contained HTML file that opens offline: inline SVG "
                    "charts and PNG heatmaps, standard library only (no extra packages).")
    parser.add_argument("metrics_dir", help="the folder the run wrote its metrics to "
                                            "(--moe-mdeep-metrics-dir / MDEEP_METRICS_DIR)")
    parser.add_argument("--out", default=None,
                        help="the HTML file to write (default: METRICS_DIR/report.html)")
    parser.add_argument("--comm-share-limit", type=float, default=None, metavar="PERCENT",
                        help="comm share above which a layer is flagged (default: "
                             "MDEEP_COMM_SHARE_WARN, which is 20 unset; a bad value is refused)")
    parser.add_argument("--max-heatmaps", type=int, default=64,
                        help="draw the load heatmaps of at most this many layers (default 64)")
    parser.add_argument("--no-png", action="store_true",
                        help="write the HTML only (by default the PNG figures of "
                             "plot_metrics.py go beside it where matplotlib is installed)")
    return parser


def main(argv=None) -> int:
    from megatron_deepep.tools import plot_metrics

    args = build_parser().parse_args(argv)
    try:
        limit = (args.comm_share_limit / 100.0 if args.comm_share_limit is not None
                 else plot_metrics.comm_share_limit())
        text = render(args.metrics_dir, limit, args.max_heatmaps)
    except (FileNotFoundError, ValueError) as e:
        print(f"report.py: {e}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.metrics_dir, "report.html")
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    print(out)
    if not args.no_png:
        write_pngs(args.metrics_dir, os.path.dirname(os.path.abspath(out)), limit)
    return 0


def write_pngs(metrics_dir: str, out_dir: str, limit: float) -> list:
    """The plot_metrics.py figures into `out_dir` (printed); without matplotlib, one line."""
    from megatron_deepep.tools import plot_metrics

    try:
        plt = plot_metrics._pyplot()
    except plot_metrics.MissingDependency:
        print("report.py: PNG figures not drawn: matplotlib is not installed (pip install "
              "matplotlib); the HTML report above has every chart")
        return []
    del plt
    _, steps = plot_metrics.load(metrics_dir)
    try:
        paths = list(plot_metrics.plot(steps, out_dir, limit))
    except (KeyError, ValueError) as exc:  # a file without a field every figure needs
        print(f"report.py: PNG figures not drawn: the metrics lack what they need "
              f"({type(exc).__name__}: {exc}); the HTML report above has every chart")
        return []
    for path in paths:
        print(path)
    return paths


if __name__ == "__main__":
    sys.exit(main())
