"""`examples/replan_resume.py` end to end on the CPU: train, save (the plan is written), and
resume in fresh processes with and without the re-plan, each a `torchrun` of 2 gloo ranks.

The resume under `--moe-mdeep-replan 2` is built with the plan's placement (copies of the two
hot experts on both ranks), loads the logical checkpoint (weights and Adam state) into it, and
trains the same batches as the resume without the option (contiguous placement): the losses
agree to fp32 rounding, both equal the run that went on after the save, and the idle share
falls from the contiguous placement's to the plan's.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT
from tests.helpers.distributed import free_port

logger = logging.getLogger(__name__)

SCRIPT = os.path.join(REPO_ROOT, "examples", "replan_resume.py")
#: fp32 rounding of a 2-layer model's mean loss over a few steps (summation orders differ:
#: copies split their expert's tokens, and their gradients are summed over ranks).
LOSS_TOLERANCE = 1e-5


def _phase(out, *argv):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    env.pop("MDEEP_COMM_SHARE_WARN", None)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), SCRIPT, "--out", str(out), *argv],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stderr


def test_resume_applies_the_plan_and_trains_on_as_without_it(tmp_path):
    pytest.importorskip("psutil", reason="Megatron's checkpoint writer needs psutil")
    _phase(tmp_path, "--phase", "train")
    log = _phase(tmp_path, "--phase", "resume")
    _phase(tmp_path, "--phase", "resume", "--no-replan")
    train, replanned, plain = (json.loads((tmp_path / f"{name}.json").read_text())
                               for name in ("train", "resume", "resume_no_replan"))

    plan = json.loads(open(train["plan_file"]).read())
    for layer, entry in plan["layers"].items():
        assert not entry["kept"] and entry["idle_share"] < entry["idle_share_before"]
        assert replanned["placement"][layer] == entry["physical_to_logical"]
        assert len(entry["physical_to_logical"]) == 6  # 4 experts + 2 extra slots
    assert "expert placement from " + train["plan_file"] in log
    # The reference transport's times say nothing of the kernels': no comm-share warning.
    assert "of expert compute" not in log, log
    assert all(p is None for p in plain["placement"].values())  # contiguous

    assert replanned["first_step"] == plain["first_step"] == 4
    rows = list(zip(train["continued_losses"], replanned["losses"], plain["losses"]))
    logger.info("step  went on      re-planned  no re-plan")
    for step, (went_on, a, b) in enumerate(rows, start=4):
        logger.info("%4d  %.7f  %.7f  %.7f", step, went_on, a, b)
        assert abs(a - b) <= LOSS_TOLERANCE and abs(a - went_on) <= LOSS_TOLERANCE
    before, after = max(plain["idle_share"]), max(replanned["idle_share"])
    logger.info("idle share (1 - mean/max): before %s, no re-plan %s, re-planned %s",
                train["idle_share"], plain["idle_share"], replanned["idle_share"])
    assert min(train["idle_share"]) >= 0.3 and after <= before - 0.3
