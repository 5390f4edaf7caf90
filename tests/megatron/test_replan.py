"""Re-plan at checkpoint save, apply at resume (`megatron.replan`), CPU + gloo on 2 EP ranks.

A MoELayer under `--moe-mdeep-replan 2` starts contiguous (no checkpoint yet), trains a few
steps on routing skewed towards experts 0 and 1, and saves through `dist_checkpointing.save`
(the call Megatron's `save_checkpoint` makes): the plan file lands in the iteration folder with
a lower predicted idle share. A new layer built with the resume directory set takes that plan
(3 slots per rank, copies of the hot experts), loads the logical checkpoint (weights and Adam
state) into the new placement, and computes what the old layer computes; copies are identical
and the metrics still count logical experts. An explicit map wins over the plan; a missing or
malformed plan is refused naming the option.
"""

from __future__ import annotations

import json
import logging
import os
import warnings

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.megatron import test_replica_experts as rx

H, E, K = rx.H, rx.E, rx.K
HOT = torch.tensor([4.0, 2.0, 0.0, 0.0])  # router bias: experts 0 and 1 are hot


def _skewed(layer):
    """Routing that prefers experts 0 and 1 (the same math on every rank and placement)."""
    layer.router.forward = rx.cpu_router(layer, HOT)
    return layer


def _logical(layer):
    """Every logical expert's weights `[E]` (its first copy), gathered from all ranks."""
    from megatron_deepep.megatron import replica_experts

    physical = rx._physical(layer)
    layout = replica_experts.layer_layout(layer)
    p2l = layout.physical_to_logical if layout is not None else tuple(range(E))
    return [physical[p2l.index(e)] for e in range(E)]


def _optimizer_state(layer, opt):
    from itertools import chain

    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model = layer.sharded_state_dict(prefix="mlp.")
    ids = get_param_id_to_sharded_param_map(
        model, chain.from_iterable(g["params"] for g in opt.param_groups))
    state = opt.state_dict()
    optim_state_to_sharding_state(state, ids, exclude_keys=("step",))  # as Megatron does
    return model, state


def _exp_avg(layer, opt):
    """Every local slot's Adam `exp_avg`, flattened, gathered: `[EP * S]`."""
    mine = [torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in m.parameters()])
            for m in layer.experts.local_experts]
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    return [t for part in parts for t in part]


def _worker(rank, world, tmp):
    warnings.filterwarnings("ignore")
    import queue

    import megatron_deepep.megatron as mdm
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_deepep.megatron import metrics, replan, replica_experts

    mdm.register_deepep_dispatcher(transport="reference", replan=2)
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    filesystem_async._results_queue = queue.Queue()
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    ckpt = os.path.join(tmp, "ckpt")
    try:
        replan.reset()
        replan.set_resume_dir(ckpt)  # nothing there yet: a fresh start, contiguous
        old = _skewed(rx._layer(None, seed=1))
        assert old.num_local_experts == E // world
        assert replica_experts.layer_layout(old) is None
        opt = torch.optim.Adam(old.experts.parameters(), lr=1e-2)
        for step in range(3):
            opt.zero_grad()
            rx._step(old, rank, step)
            opt.step()

        # Save as Megatron does: the iteration folder, then the tracker.
        folder = os.path.join(ckpt, "iter_0000003")
        os.makedirs(folder, exist_ok=True)
        torch.distributed.barrier()
        model, state = _optimizer_state(old, opt)
        from megatron.core.dist_checkpointing.strategies.torch import (
            TorchDistSaveShardedStrategy,
        )
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
        dist_checkpointing.save({**model, "optimizer": state}, folder, sharded_strategy=strategy)
        if rank == 0:
            with open(os.path.join(ckpt, replan.TRACKER_FILE), "w") as f:
                f.write("3")
        torch.distributed.barrier()
        with open(os.path.join(folder, replan.PLAN_FILE)) as f:
            written = json.load(f)
        plan = written["layers"]["1"]
        assert plan["num_ranks"] == world and plan["slots_per_rank"] == (E + 2) // world
        assert plan["idle_share"] < plan["idle_share_before"] - replan.MIN_GAIN
        assert plan["previous_physical_to_logical"] == list(range(E))
        assert plan["loads"][0] > plan["loads"][2] and not plan["kept"]
        p2l = plan["physical_to_logical"]

        # Resume: the new layer takes the plan and loads the logical checkpoint into it.
        replan.reset()
        replan.set_resume_dir(ckpt)
        mdm.register_deepep_dispatcher(metrics=True)
        new = _skewed(rx._layer(None, seed=7))
        layout = replica_experts.layer_layout(new)
        assert new.num_local_experts == len(p2l) // world
        assert layout is not None and list(layout.physical_to_logical) == p2l
        assert new.token_dispatcher.physical_to_logical == p2l
        assert layout.replicated  # copies of the hot experts
        new_opt = torch.optim.Adam(new.experts.parameters(), lr=1e-2)
        for p in new.experts.parameters():  # Adam state to load into (lr 0: weights stay)
            p.grad = torch.zeros_like(p)
        new_opt.param_groups[0]["lr"] = 0.0
        new_opt.step()
        new_opt.param_groups[0]["lr"] = 1e-2
        model, state = _optimizer_state(new, new_opt)
        loaded = dist_checkpointing.load({**model, "optimizer": state}, folder)
        new.load_state_dict({k[len("mlp."):]: v for k, v in loaded.items()
                             if k != "optimizer"}, strict=False)
        optim = loaded["optimizer"]
        own = new_opt.state_dict()
        optim["param_groups"] = own["param_groups"]
        for pid, entry in optim["state"].items():  # Megatron keeps the step count apart
            entry["step"] = own["state"][pid]["step"]
        new_opt.load_state_dict(optim)

        before, after = _logical(old), _logical(new)
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        physical = rx._physical(new)
        old_avg, new_avg = _exp_avg(old, opt), _exp_avg(new, new_opt)
        for p, e in enumerate(p2l):
            assert torch.equal(physical[p], before[e]), (p, e)  # every copy: identical
            assert torch.equal(new_avg[p], old_avg[e]), (p, e)  # Adam state followed

        # The same input gives the same output; metrics count logical experts.
        metrics.get_collector().flush()
        old.token_dispatcher.options.metrics = True
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(16, 1, H, generator=gen)
        with torch.no_grad():
            out_old, _ = old(x)
            m_old = metrics.flush()
            metrics._COLLECTOR = None  # both layers are layer 1: a fresh collector for the new
            out_new, _ = new(x)
            m_new = metrics.flush()
        torch.testing.assert_close(out_new, out_old, rtol=1e-5, atol=1e-6)
        (m_old,), (m_new,) = m_old.values(), m_new.values()
        assert len(m_new["tokens_per_logical_expert"]) == E
        assert m_new["tokens_per_logical_expert"] == m_old["tokens_per_logical_expert"]
        assert m_new["physical_to_logical"] == p2l and len(m_new["tokens_per_expert"]) == len(p2l)
        assert m_new["idle_share"] < m_old["idle_share"]

        # A plan file with two copies of one expert on one rank (an older planner wrote such
        # files): the resume names the file and how to re-plan it.
        bad = os.path.join(tmp, "bad", "iter_0000001")
        if rank == 0:
            _plan_file(bad, {"1": {"physical_to_logical": [1, 1, 3, 0, 2, 2], "num_ranks": 2}})
        torch.distributed.barrier()
        replan.reset()
        replan.set_resume_dir(bad)
        with pytest.raises(ValueError) as info:
            rx._layer(None, seed=3)
        text = str(info.value)
        path = os.path.join(bad, replan.PLAN_FILE)
        assert f"expert map from the re-plan file {path}" in text
        assert "EP rank 0 holds expert 1 more than once" in text
        assert f"tools.balance --loads {path} --ranks 2 --redundant 2 --json {path}" in text
        if rank == 0:
            logging.getLogger(__name__).info("resume error: %s", text)
    finally:
        replan.reset()
        ps.destroy_model_parallel()


def test_save_writes_a_plan_and_resume_loads_into_it(tmp_path):
    pytest.importorskip("psutil", reason="Megatron's checkpoint writer needs psutil")
    run_distributed(2, _worker, str(tmp_path), timeout_s=300)


# ----------------------------------------------------------------------------------------------
def _plan_file(folder, layers):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "mdeep_expert_plan.json")
    with open(path, "w") as f:
        json.dump({"layers": layers}, f)
    return path


@pytest.fixture
def replan_state():
    from megatron_deepep.megatron import replan

    replan.reset()
    yield replan
    replan.reset()


def test_explicit_map_wins_over_the_plan(tmp_path, replan_state):
    from megatron_deepep.megatron.options import DeepEPOptions

    _plan_file(tmp_path / "iter_0000001", {"1": {"physical_to_logical": [1, 0, 3, 2],
                                                 "num_ranks": 2}})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    replan_state.set_resume_dir(str(tmp_path))
    explicit = {"physical_to_logical": [2, 3, 0, 1]}
    assert replan_state.expert_map_in_force(
        DeepEPOptions(expert_map=explicit, replan=0), 2) is explicit
    taken = replan_state.expert_map_in_force(DeepEPOptions(replan=0), 2)
    assert taken["layers"]["1"]["physical_to_logical"] == [1, 0, 3, 2]
    assert replan_state.expert_map_in_force(DeepEPOptions(), 2) is None  # option off


def test_missing_plan_names_the_option(tmp_path, replan_state):
    from megatron_deepep.megatron.options import DeepEPOptions

    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    replan_state.set_resume_dir(str(tmp_path))
    with pytest.raises(ValueError, match=r"--moe-mdeep-replan.*iter_0000005.*no "
                                         r"mdeep_expert_plan.json.*--moe-mdeep-expert-map"):
        replan_state.expert_map_in_force(DeepEPOptions(replan=0), 2)
    replan_state.set_resume_dir(str(tmp_path / "absent"))  # no checkpoint: contiguous
    assert replan_state.expert_map_in_force(DeepEPOptions(replan=0), 2) is None


@pytest.mark.parametrize("layers, match", [
    ({}, "has no layers"),
    ({"1": {"physical_to_logical": [0, 1, "x", 3], "num_ranks": 2}}, "list of ints"),
    ({"1": {"physical_to_logical": [0, 1, 1, 3], "num_ranks": 2}}, "every expert 0 .. 3"),
    ({"1": {"physical_to_logical": [0, 1, 2, 3]}}, "num_ranks"),
])
def test_malformed_plan_names_the_option(tmp_path, replan_state, layers, match):
    from megatron_deepep.megatron.options import DeepEPOptions

    path = _plan_file(tmp_path, layers)
    replan_state.set_resume_dir(str(tmp_path))
    with pytest.raises(ValueError, match=r"--moe-mdeep-replan .*" + match) as info:
        replan_state.expert_map_in_force(DeepEPOptions(replan=0), 2)
    assert path in str(info.value) or "has no layers" in match


def test_unreadable_plan_and_other_ep_size_name_the_option(tmp_path, replan_state):
    from megatron_deepep.megatron.options import DeepEPOptions

    os.makedirs(tmp_path / "a")
    (tmp_path / "a" / "mdeep_expert_plan.json").write_text("{not json")
    replan_state.set_resume_dir(str(tmp_path / "a"))
    with pytest.raises(ValueError, match="--moe-mdeep-replan .*cannot read the plan"):
        replan_state.expert_map_in_force(DeepEPOptions(replan=0), 2)
    _plan_file(tmp_path / "b", {"1": {"physical_to_logical": [1, 0, 3, 2], "num_ranks": 2}})
    replan_state.set_resume_dir(str(tmp_path / "b"))
    with pytest.raises(ValueError, match="--moe-mdeep-replan .*for \\[2\\] EP ranks.*"
                                         "--expert-model-parallel-size 4"):
        replan_state.expert_map_in_force(DeepEPOptions(replan=0), 4)


def test_replan_option_checks():
    from megatron_deepep.megatron.options import DeepEPOptions, check_replan_option

    assert check_replan_option(4, 2) == 4
    with pytest.raises(ValueError, match="--moe-mdeep-replan .*integer >= 0, got -1"):
        DeepEPOptions(replan=-1)
    with pytest.raises(ValueError, match="--moe-mdeep-replan .* 3 with "
                                         "--expert-model-parallel-size 2: .*multiple of the 2 EP"):
        check_replan_option(3, 2)
    with pytest.raises(ValueError, match="--moe-mdeep-replan .* 8 with "
                                         "--expert-model-parallel-size 2: 8 extra slots exceed "
                                         "the 4 copies"):
        check_replan_option(8, 2, 4)


def test_plan_keeps_the_placement_when_it_gains_little_or_the_optimizer_is_physical():
    from megatron_deepep.megatron import replan

    flat = replan.plan_layer([5.0, 5.0, 5.0, 5.0], [0, 1, 2, 3], 2, 0)
    assert flat["kept"] and flat["physical_to_logical"] == [0, 1, 2, 3]
    skewed = replan.plan_layer([9.0, 7.0, 1.0, 1.0], [0, 1, 2, 3], 2, 0)
    assert not skewed["kept"] and skewed["idle_share"] < skewed["idle_share_before"]
    kept = replan.plan_layer([9.0, 7.0, 1.0, 1.0], [0, 1, 2, 3], 2, 0, keep=True)
    assert kept["kept"] and kept["physical_to_logical"] == [0, 1, 2, 3]
    assert replan.physical_order_optimizer(
        {"optimizer": {"param_state_sharding_type": "dp_reshardable"}}) == "dp_reshardable"
    assert replan.physical_order_optimizer(
        {"optimizer": {"param_state_sharding_type": "fully_sharded_model_space"}}) is None


def test_distributed_optimizer_needs_the_fully_reshardable_format():
    """Refused when Megatron's arguments are applied: the default 'dp_reshardable' optimizer
    checkpoint keeps expert moments in physical order, so a resume could not move them."""
    import argparse

    from megatron_deepep.megatron.register import check_replan_arguments

    def args(**kw):
        base = dict(moe_mdeep_replan=0, use_distributed_optimizer=True, ckpt_format="torch_dist",
                    dist_ckpt_optim_fully_reshardable=False)
        base.update(kw)
        return argparse.Namespace(**base)

    with pytest.raises(ValueError, match=r"'dp_reshardable'.*Add "
                                         r"--dist-ckpt-optim-fully-reshardable"):
        check_replan_arguments(args())
    older = args()
    del older.dist_ckpt_optim_fully_reshardable
    with pytest.raises(ValueError, match=r"has no --dist-ckpt-optim-fully-reshardable"):
        check_replan_arguments(older)
    with pytest.raises(ValueError, match=r"needs --ckpt-format torch_dist.*got --ckpt-format "
                                         r"torch"):
        check_replan_arguments(args(ckpt_format="torch"))
    check_replan_arguments(args(dist_ckpt_optim_fully_reshardable=True))
    check_replan_arguments(args(use_distributed_optimizer=False))
    check_replan_arguments(args(moe_mdeep_replan=None))


def test_map_origin_names_the_option_or_the_plan_file(tmp_path, replan_state, monkeypatch):
    from megatron_deepep.megatron.options import DeepEPOptions

    monkeypatch.delenv("MDEEP_EXPERT_MAP", raising=False)
    (tmp_path / "map.json").write_text("[0, 1]")  # the variable must name a readable file
    explicit = DeepEPOptions(expert_map=str(tmp_path / "map.json"))
    assert replan_state.map_origin(explicit) == f"--moe-mdeep-expert-map = {tmp_path}/map.json"
    monkeypatch.setenv("MDEEP_EXPERT_MAP", str(tmp_path / "map.json"))
    assert replan_state.map_origin(explicit).startswith("the environment variable "
                                                        "MDEEP_EXPERT_MAP = ")
    monkeypatch.delenv("MDEEP_EXPERT_MAP")
    path = _plan_file(tmp_path / "iter_0000002", {"1": {"physical_to_logical": [1, 1, 0, 2],
                                                        "num_ranks": 2}})
    replan_state.set_resume_dir(str(tmp_path / "iter_0000002"))
    options = DeepEPOptions(replan=2)
    replan_state.expert_map_in_force(options, 2)
    assert replan_state.map_origin(options) == (
        f"the re-plan file {path} (written at checkpoint save by {replan_state.FLAG})")
    assert f"--loads {path} --ranks 2 --redundant 0 --json {path}" in \
        replan_state.map_fix(options, 2, 4, 4)


def test_a_plan_file_re_planned_by_the_command_line_is_loadable(tmp_path, replan_state):
    """The fix the resume error gives: `balance --loads <plan file> ... --json <plan file>`."""
    from megatron_deepep.tools import balance

    path = _plan_file(tmp_path, {"1": {"physical_to_logical": [1, 1, 3, 0, 2, 2],
                                       "num_ranks": 2, "loads": [66, 83, 82, 44]}})
    balance.main(["--loads", path, "--ranks", "2", "--redundant", "2", "--json", path])
    plan = replan_state.read_plan(path)["layers"]["1"]
    p2l = plan["physical_to_logical"]
    assert len(p2l) == 6 and set(p2l) == {0, 1, 2, 3}
    assert len(set(p2l[:3])) == 3 and len(set(p2l[3:])) == 3
