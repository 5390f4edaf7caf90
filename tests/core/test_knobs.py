"""CPU tier: every `MDEEP_*` knob is read where the README's table says, and a bad value is a
ValueError naming the variable wherever it is read (the Buffer API included)."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from megatron_deepep import knobs
from megatron_deepep.buffer import Buffer, get_buffer


@pytest.fixture
def world(monkeypatch):
    """A one-rank gloo group, a clean `MDEEP_*` environment and fresh once-only warnings."""
    from tests.helpers.distributed import free_port
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    for name in list(knobs.KNOBS):
        monkeypatch.delenv(knobs.PREFIX + name, raising=False)
    monkeypatch.setattr(knobs, "_warned_names", set())
    monkeypatch.setenv(knobs.WARNED_ENV, "")  # restored after the test: warnings may set it
    monkeypatch.setattr(knobs, "_dispatcher_built", False)


# The first contact's bad values (issue "First contact, round 3"), each refused by the Buffer.
@pytest.mark.parametrize("name, value, message", [
    ("TRANSPORT", "nvlnk", "MDEEP_TRANSPORT='nvlnk': expected one of auto, local, nvlink, "
     "internode, reference; did you mean 'nvlink'?"),
    ("NUM_SMS", "abc", "MDEEP_NUM_SMS='abc': expected an integer"),
    ("NUM_SMS", "-4", "MDEEP_NUM_SMS='-4': expected an integer >= 1"),
    ("FP8_DISPATCH", "bogus", "MDEEP_FP8_DISPATCH='bogus': expected one of off, blockwise, "
     "mxfp8, auto, blockwise_1x128, blockwise_1x128_fp32_scales, mxfp8_1x32"),
    ("NUM_MAX_TOKENS_PER_RANK", "-5", "MDEEP_NUM_MAX_TOKENS_PER_RANK='-5': expected an integer "
     ">= 1"),
    ("RANK_CAPACITY_FACTOR", "0", "MDEEP_RANK_CAPACITY_FACTOR='0': expected a finite number > 0"),
    ("ARCH", "90", "MDEEP_ARCH='90': expected an NVRTC target such as sm_90"),
    ("CACHE_TRUST", "alice", "MDEEP_CACHE_TRUST='alice': expected user:NAME, user:UID, "
     "group:NAME or group:GID"),
    ("PDL", "maybe", "MDEEP_PDL='maybe': expected one of"),
])
def test_a_bad_knob_is_refused_by_the_buffer_naming_the_variable(world, monkeypatch, name,
                                                                  value, message):
    monkeypatch.setenv(knobs.PREFIX + name, value)
    with pytest.raises(ValueError) as info:
        Buffer(None, 16, 64, 2, transport="reference")
    assert str(info.value).startswith(message), str(info.value)
    print(f"\n{knobs.PREFIX}{name}={value}: {info.value}")
    with pytest.raises(ValueError, match=f"^{knobs.PREFIX}{name}="):
        get_buffer(None, 16, 64, 2, transport="reference")


def test_the_buffer_reads_its_knobs_and_an_argument_wins(world, monkeypatch):
    monkeypatch.setenv("MDEEP_TRANSPORT", "reference")
    monkeypatch.setenv("MDEEP_NUM_SMS", "7")
    buf = Buffer(None, 16, 64, 2)
    assert (buf.transport_name, buf.num_sms) == ("reference", 7)
    assert Buffer(None, 16, 64, 2, num_sms=3).num_sms == 3
    monkeypatch.setenv("MDEEP_TRANSPORT", "local")  # the EP = 1 kernels: refused on a CPU
    assert Buffer(None, 16, 64, 2, transport="reference").transport_name == "reference"


def test_unknown_and_unread_knobs_warn_once(world, monkeypatch, caplog):
    monkeypatch.setenv("MDEEP_NUM_SM", "8")
    monkeypatch.setenv("MDEEP_FP8_DISPATCH", "blockwise")
    monkeypatch.setenv("MDEEP_TEST_PROCS", "2")  # the test harness's own: no warning
    with caplog.at_level(logging.WARNING, logger="megatron_deepep.knobs"):
        Buffer(None, 16, 64, 2, transport="reference")
        Buffer(None, 16, 64, 2, transport="reference")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "MDEEP_FP8_DISPATCH is set, but the Buffer API does not read it (read by: dispatcher)",
        "MDEEP_NUM_SM is set but is no megatron_deepep knob (README, \"Knobs\"); did you mean "
        "MDEEP_NUM_SMS?"], lines
    caplog.clear()
    knobs.check_environment("dispatcher")  # the dispatcher reads it: its Buffers stay quiet
    monkeypatch.setattr(knobs, "_warned_names", set())
    monkeypatch.setenv(knobs.WARNED_ENV, "")
    with caplog.at_level(logging.WARNING, logger="megatron_deepep.knobs"):
        Buffer(None, 16, 64, 2, transport="reference")
    assert [r.getMessage() for r in caplog.records] == [lines[1]]


def test_knob_choices_and_bounds_agree_with_the_code():
    from megatron_deepep.fp8 import FORMATS
    from megatron_deepep.fp8.dispatch import FLAG_NAMES
    from megatron_deepep.transport import TRANSPORT_NAMES
    from megatron_deepep.transport import internode_regions as regions

    table = knobs.KNOBS
    assert set(table["FP8_DISPATCH"].choices) == set(FLAG_NAMES) | set(FORMATS)
    assert table["TRANSPORT"].choices == TRANSPORT_NAMES
    assert set(table["INTERNODE_STAGING"].choices) == set(regions.STAGING_MODES)
    assert table["INTERNODE_RING_SLOTS"].high == regions.MAX_RING_SLOTS
    assert table["INTERNODE_NET_RING_CHUNKS"].high == regions.MAX_NET_CHUNKS
    assert table["FP8_COLUMNWISE"].choices == ("kernel", "dequantize")
    assert all(knob.read_by for knob in table.values()), "every knob says who reads it"


def _warnings_of_a_child(env) -> list:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "from megatron_deepep import knobs; "
                           "knobs.check_environment('dispatcher')"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stderr.splitlines() if "MDEEP_NUM_SMZ" in line]


def test_an_unknown_knob_warns_once_for_a_process_and_those_it_starts(world, monkeypatch):
    """The main job's processes (its pre-check, compare_dispatchers' parent and each run's
    children) inherit the names already warned about: one warning per job, not per process."""
    import os

    from tests.helpers import REPO_ROOT

    monkeypatch.setenv("MDEEP_NUM_SMZ", "8")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, RANK="0")
    assert len(_warnings_of_a_child(env)) == 1  # a fresh process warns
    knobs.check_environment("dispatcher")
    knobs.check_environment("dispatcher")
    assert os.environ[knobs.WARNED_ENV] == "MDEEP_NUM_SMZ"
    assert _warnings_of_a_child(dict(env, **{knobs.WARNED_ENV: os.environ[knobs.WARNED_ENV]})) \
        == []  # a child of a process that warned stays quiet


@pytest.mark.parametrize("contents", [None, "{not json"])
def test_an_unreadable_expert_map_is_one_line_naming_the_variable(world, monkeypatch, tmp_path,
                                                                  contents):
    path = tmp_path / "plan.json"
    if contents is not None:
        path.write_text(contents)
    monkeypatch.setenv("MDEEP_EXPERT_MAP", str(path))
    if contents is None:  # the knobs' pre-check: the file must be readable
        with pytest.raises(ValueError, match=rf"^MDEEP_EXPERT_MAP='{path}': cannot read that "
                                             rf"file \(No such file or directory\)$"):
            knobs.check_environment("dispatcher")
    pytest.importorskip("megatron.core")
    from megatron_deepep.megatron import options

    with pytest.raises(ValueError) as info:  # where the dispatcher reads it
        options.physical_slot_count(str(path))
    message = str(info.value)
    assert message.startswith(f"{options.EXPERT_MAP_FLAG} = {path}: ") and "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
