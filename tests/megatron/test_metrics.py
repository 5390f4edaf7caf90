"""Per-layer comm/load metrics: values, the Megatron tracker hook, the JSONL file and the plots."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed
from tests.helpers import REPO_ROOT

H = 16
E = 8
K = 2
ROOT = REPO_ROOT


class _Writer:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration):
        self.scalars[(name, iteration)] = float(value)


class _Layer:
    def __init__(self, number):
        self.layer_number = number


def _routing(num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.softmax(torch.randn(num_tokens, E, generator=gen) * 3, dim=-1)
    _, idx = torch.topk(scores, K, dim=1)
    routing_map = torch.zeros(num_tokens, E, dtype=torch.bool).scatter(1, idx, True)
    return scores * routing_map, routing_map


def _report(entry, iteration, writer, **kwargs):
    """Megatron's step-end MoE report through `entry`.

    "track_moe_metrics": `moe_utils.track_moe_metrics`, what megatron.training 0.16 calls (a
    deprecated wrapper around the tracker's report on 0.19). "tracker_report": the 0.17+
    tracker's `report`, called as megatron.training 0.19 does: an explicit `track_names` list
    (here without aux losses, which need a DP average that gloo lacks) and `force_initialize`.
    """
    common = dict(loss_scale=0.5, iteration=iteration, writer=writer, num_layers=3, **kwargs)
    if entry == "track_moe_metrics":
        from megatron.core.transformer.moe import moe_utils

        return moe_utils.track_moe_metrics(**common)
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return get_moe_metrics_tracker().report(track_names=[], force_initialize=True, **common)


def _worker(rank, world_size, out_dir, entry):
    warnings.filterwarnings("ignore")
    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_deepep.megatron import metrics

    mdm.register_deepep_dispatcher(transport="reference", metrics=True, metrics_dir=out_dir)
    ps.initialize_model_parallel(expert_model_parallel_size=world_size)
    pg = get_default_pg_collection()
    config = TransformerConfig(num_layers=3, hidden_size=H, num_attention_heads=4,
                               num_moe_experts=E, moe_router_topk=K,
                               expert_model_parallel_size=world_size,
                               moe_token_dispatcher_type="deepep", use_cpu_initialization=True)
    num_local = E // world_size
    local = list(range(rank * num_local, (rank + 1) * num_local))
    layers = {}
    for number in (1, 3):
        d = mdm.DeepEPTokenDispatcher(num_local, local, config=config, pg_collection=pg)
        layers[number] = _Layer(number)
        d.bind_layer(layers[number])
        layers[number].dispatcher = d

    tokens = [12, 0] if rank == 0 else [7, 20]  # two micro-batches; rank 0 has an empty one
    expect_counts = {1: torch.zeros(E, dtype=torch.long), 3: torch.zeros(E, dtype=torch.long)}
    sent_rows = {1: 0, 3: 0}
    for mb, n in enumerate(tokens):
        for number, layer in layers.items():
            d = layer.dispatcher
            probs, routing_map = _routing(n, seed=100 * number + 10 * mb + rank)
            x = torch.randn(n, 1, H).requires_grad_(True)
            h, p = d.dispatch_preprocess(x, routing_map, probs)
            h, p = d.token_dispatch(h, p)
            rows, tpe, pp = d.dispatch_postprocess(h, p)
            y = d.combine_postprocess(d.token_combine(d.combine_preprocess(rows * pp[:, None])))
            y.sum().backward()
            counts = routing_map.sum(0).long()
            dist.all_reduce(counts)
            expect_counts[number] += counts
            dest = torch.zeros(n, world_size, dtype=torch.bool)
            for r in range(world_size):
                dest[:, r] = routing_map[:, r * num_local:(r + 1) * num_local].any(1)
            sent_rows[number] += int(dest[:, [r for r in range(world_size) if r != rank]].sum())

    # Nothing was synchronized or reduced yet: the forward only accumulated.
    collector = metrics.get_collector()
    assert collector.last_results == {}

    writer = _Writer()
    _report(entry, 7, writer, per_layer_logging=True)
    results = collector.last_results
    assert sorted(results) == [1, 3]
    for number, m in results.items():
        counts = expect_counts[number].float()
        assert m["num_micro_batches"] == 2
        assert m["tokens_per_expert"] == expect_counts[number].tolist()
        per_rank = counts.view(world_size, num_local).sum(1)
        assert m["tokens_per_rank"] == per_rank.long().tolist()
        assert m["load_imbalance"] == pytest.approx((counts.max() / counts.mean()).item())
        assert m["idle_share"] == pytest.approx(1 - (per_rank.min() / per_rank.max()).item())
        assert m["dispatch_ms"] > 0 and m["combine_ms"] > 0
        mean_sent = torch.tensor(float(sent_rows[number] * H * 4))
        dist.all_reduce(mean_sent)
        assert m["bytes_sent"] == pytest.approx(mean_sent.item() / world_size)
        assert m["dispatch_GBps"] == pytest.approx(
            m["bytes_sent"] / (m["dispatch_ms"] * 1e-3) / 1e9)

    # Reached the Megatron tracker, hence the writer: mean over the 3 layers' slots (2 MoE
    # layers recorded; Megatron divides the sum by num_layers), per layer too, loss_scale undone.
    imb = {n: results[n]["load_imbalance"] for n in results}
    assert writer.scalars[("deepep_load_imbalance", 7)] == pytest.approx(sum(imb.values()) / 3,
                                                                         rel=1e-5)
    assert writer.scalars[("moe/deepep_load_imbalance_layer_0", 7)] == pytest.approx(imb[1],
                                                                                   rel=1e-5)
    assert writer.scalars[("moe/deepep_load_imbalance_layer_1", 7)] == 0.0
    assert writer.scalars[("moe/deepep_idle_share_layer_2", 7)] == pytest.approx(
        results[3]["idle_share"], rel=1e-5)
    for name in metrics.TRACKER_NAMES:
        assert (name, 7) in writer.scalars, name

    # The next report has nothing new: no stale values.
    writer2 = _Writer()
    _report(entry, 8, writer2)
    assert writer2.scalars.get(("deepep_load_imbalance", 8), 0.0) == 0.0
    ps.destroy_model_parallel()


@pytest.mark.parametrize("entry", ["track_moe_metrics", "tracker_report"])
def test_metrics_through_megatron_tracker(tmp_path, entry):
    if entry == "tracker_report" and importlib.util.find_spec(
            "megatron.core.transformer.moe.moe_logging") is None:
        pytest.skip("megatron-core < 0.17 has no MoEMetricsTracker")
    out_dir = str(tmp_path / "metrics")
    run_distributed(2, _worker, out_dir, entry, timeout_s=150)
    path = os.path.join(out_dir, "deepep_metrics_rank0.jsonl")
    lines = [json.loads(l) for l in open(path, encoding="utf-8")]
    assert [l["step"] for l in lines] == [7]
    assert sorted(lines[0]["layers"]) == ["1", "3"]
    assert not os.path.exists(os.path.join(out_dir, "deepep_metrics_rank1.jsonl"))

    plots = tmp_path / "plots"
    proc = subprocess.run([sys.executable, "-m", "megatron_deepep.tools.plot_metrics",
                           out_dir, "--out", str(plots)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("expert_load_heatmap.png", "comm_time_per_layer.png"):
        assert (plots / name).stat().st_size > 1000, name


def _pipeline_worker(rank, world_size):
    """PP = 2: stage 0 has the one MoE layer (a deepep dispatcher), stage 1 none."""
    warnings.filterwarnings("ignore")
    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_deepep.megatron import metrics

    mdm.register_deepep_dispatcher(transport="reference", metrics=True)
    ps.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    if rank == 0:
        config = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4,
                                   num_moe_experts=E, moe_router_topk=K,
                                   moe_token_dispatcher_type="deepep",
                                   use_cpu_initialization=True, pipeline_dtype=torch.float32,
                                   pipeline_model_parallel_size=world_size)
        d = mdm.DeepEPTokenDispatcher(E, list(range(E)), config=config,
                                      pg_collection=get_default_pg_collection())
        d.bind_layer(_Layer(1))
        probs, routing_map = _routing(16, seed=5)
        h, p = d.dispatch_preprocess(torch.randn(16, 1, H), routing_map, probs)
        h, p = d.token_dispatch(h, p)
        rows, _, pp = d.dispatch_postprocess(h, p)
        d.combine_postprocess(d.token_combine(d.combine_preprocess(rows * pp[:, None])))
    else:
        assert metrics._COLLECTOR is None  # no MoE layer on this stage: nothing recorded
    writer = _Writer()
    # As megatron.training 0.19 calls it on every stage; before the fix stage 0 all-reduced
    # our names over the pipeline group alone and hung.
    get_moe_metrics_tracker().report(loss_scale=1.0, iteration=3, writer=writer,
                                     track_names=[], force_initialize=True, num_layers=2)
    value = writer.scalars[("deepep_load_imbalance", 3)]
    assert value > 0.5  # stage 0's value (summed over the stages), seen by both
    ps.destroy_model_parallel()


def test_metrics_with_a_pipeline_stage_without_moe_layers():
    if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None:
        pytest.skip("megatron-core < 0.17 has no MoEMetricsTracker")
    run_distributed(2, _pipeline_worker, timeout_s=120)


def test_plot_script_rejects_empty_dir(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_deepep.tools.plot_metrics",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "deepep_metrics" in proc.stderr
