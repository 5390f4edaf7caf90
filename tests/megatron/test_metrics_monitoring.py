"""Monitoring in the metrics: expert time, comm share and its warning, idle share from time,
tokens dropped (CPU: spans on `perf_counter`, set by hand where the test needs exact times)."""

from __future__ import annotations

import logging
import types
import warnings

import pytest
import torch

from megatron_deepep.megatron import metrics
from tests.helpers.distributed import run_distributed


def _span(t0, t1):
    span = metrics.Span.__new__(metrics.Span)
    span._cuda, span.t0, span.t1 = False, t0, t1
    return span


def _dispatcher(layer_number, num_local=4):
    config = types.SimpleNamespace(num_layers=2, recompute_granularity=None)
    return types.SimpleNamespace(config=config, layer_number=layer_number, ep_group=None,
                                 ep_rank=0, ep_size=1, num_local_experts=num_local)


def _handle(counts):
    counts = torch.tensor(counts)
    return types.SimpleNamespace(num_recv_tokens_per_expert=counts,
                                 num_tokens_per_rank=torch.tensor([counts.sum()]),
                                 num_recv_tokens_per_rank=torch.tensor([counts.sum()]))


def _step(collector, layer, dispatch_s, expert_s, combine_s, dropped=0):
    """One micro-batch with the given phase lengths in seconds (back to back)."""
    d = _span(0.0, dispatch_s)
    c = _span(dispatch_s + expert_s, dispatch_s + expert_s + combine_s)
    collector.record(_dispatcher(layer), _handle([5, 3, 0, 2]), d, c, row_bytes=64,
                     tokens_dropped=torch.tensor(dropped))


def test_expert_time_comm_share_and_drops():
    collector = metrics.MetricsCollector()
    _step(collector, 1, 0.002, 0.010, 0.001, dropped=3)
    _step(collector, 1, 0.002, 0.010, 0.001, dropped=1)
    m = collector.flush()[1]
    assert m["expert_ms"] == pytest.approx(20.0)
    assert m["comm_share"] == pytest.approx((4.0 + 2.0) / 20.0)
    assert m["tokens_dropped"] == 4
    assert m["idle_share_time"] == 0.0  # one rank
    assert m["expert_ms_per_rank"] == [pytest.approx(20.0)]
    assert set(metrics.TRACKER_NAMES) >= {"deepep_expert_ms", "deepep_comm_share",
                                          "deepep_idle_share_time", "deepep_tokens_dropped"}


def test_idle_share_from_time_is_the_worst_ranks(monkeypatch):
    real = metrics._all_gather_rows

    def two_ranks(local, group, size):  # a second rank whose experts took a quarter as long
        other = local.clone()
        other[5] = local[5] / 4
        return torch.stack([real(local, group, size)[0], other])

    monkeypatch.setattr(metrics, "_all_gather_rows", two_ranks)
    collector = metrics.MetricsCollector()
    _step(collector, 1, 0.001, 0.008, 0.001)
    m = collector.flush()[1]
    assert m["idle_share_time"] == pytest.approx(0.75)
    assert m["expert_ms"] == pytest.approx((8.0 + 2.0) / 2)
    assert m["idle_share"] == 0.0  # the counts are equal: only time sees it


def test_comm_share_warning_once_per_layer_and_crossing(monkeypatch, caplog):
    monkeypatch.setenv("MDEEP_COMM_SHARE_WARN", "25")
    collector = metrics.MetricsCollector()
    caplog.set_level(logging.WARNING, logger=metrics.logger.name)

    def step(share_l1, share_l2):
        _step(collector, 1, 0.01 * share_l1 / 2, 0.01, 0.01 * share_l1 / 2)
        _step(collector, 2, 0.01 * share_l2 / 2, 0.01, 0.01 * share_l2 / 2)
        collector.flush()
        found = [r.getMessage() for r in caplog.records]
        caplog.clear()
        return found

    assert step(0.1, 0.1) == []
    first = step(0.4, 0.1)
    assert len(first) == 1 and "layer 1:" in first[0] and "MDEEP_COMM_SHARE_WARN=25%" in first[0]
    assert "FP8 dispatch" in first[0] and "smaller EP group" in first[0]
    second = step(0.5, 0.3)  # layer 1 still above: silent; layer 2 crosses
    assert len(second) == 1 and "layer 2:" in second[0]
    assert step(0.5, 0.3) == []
    assert step(0.1, 0.3) == []
    again = step(0.4, 0.3)  # layer 1 crosses again
    assert len(again) == 1 and "layer 1:" in again[0]
    monkeypatch.setenv("MDEEP_COMM_SHARE_WARN", "0")
    assert step(0.1, 0.1) == [] and step(0.9, 0.9) == []


def _drop_worker(rank, world_size):
    warnings.filterwarnings("ignore")
    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    mdm.register_deepep_dispatcher(transport="reference", metrics=True)
    ps.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4,
                                   num_moe_experts=4, moe_router_topk=2,
                                   moe_token_dispatcher_type="deepep",
                                   use_cpu_initialization=True)
        d = mdm.DeepEPTokenDispatcher(4, list(range(4)), config=config,
                                      pg_collection=get_default_pg_collection())
        routing_map = torch.zeros(10, 4, dtype=torch.bool)
        routing_map[:, :2] = True
        routing_map[:3, 1] = False  # 3 entries dropped for capacity
        probs = routing_map.float() * 0.5
        h, p = d.dispatch_preprocess(torch.randn(10, 1, 16), routing_map, probs)
        h, p = d.token_dispatch(h, p)
        rows, _, pp = d.dispatch_postprocess(h, p)
        d.combine_postprocess(d.token_combine(d.combine_preprocess(rows * pp[:, None])))
        m = metrics.flush()[1]
        assert m["tokens_dropped"] == 3
        assert m["expert_ms"] > 0 and m["comm_share"] > 0
    finally:
        ps.destroy_model_parallel()


def test_dispatcher_counts_capacity_drops():
    run_distributed(1, _drop_worker, timeout_s=120)


def test_an_expert_map_is_written_with_the_counts():
    collector = metrics.MetricsCollector()
    mapped = _dispatcher(1)
    mapped.physical_to_logical = [2, 0, 3, 1]
    collector.record(mapped, _handle([5, 3, 0, 2]), _span(0, 1e-3), _span(2e-3, 3e-3),
                     row_bytes=64)
    _step(collector, 2, 0.001, 0.002, 0.001)
    results = collector.flush()
    assert results[1]["physical_to_logical"] == [2, 0, 3, 1]
    assert "physical_to_logical" not in results[2]
