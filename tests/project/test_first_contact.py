"""CPU tier: what a new user meets first. The Buffer quickstart runs as the README shows it, the
examples fail with one line and the command to run instead, and known noise is dropped."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import WarningCapture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
QUICKSTART = os.path.join(EXAMPLES, "buffer_quickstart.py")
BEGIN, END = "the README's snippet starts here", "the README's snippet ends here"


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", **extra)
    for name in list(env):
        if name.startswith("MDEEP_") and not name.startswith("MDEEP_TEST_"):
            del env[name]
    env.update(extra)
    return env


def test_the_readmes_buffer_snippet_is_the_quickstarts():
    """The README's Buffer snippet is the quickstart's marked block, line for line."""
    with open(QUICKSTART, encoding="utf-8") as f:
        text = f.read()
    block = text[text.index(BEGIN):text.index(END)]
    block = textwrap.dedent(block[block.index("\n") + 1:block.rindex("\n")])
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("## Use the Buffer"):]
    snippet = section[section.index("```python\n") + len("```python\n"):]
    snippet = snippet[:snippet.index("```")]
    assert snippet.strip() == block.strip(), "paste examples/buffer_quickstart.py's block"


def test_the_quickstart_runs_on_two_gloo_ranks():
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         QUICKSTART], env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print("\n" + done.stdout)
    for rank in (0, 1):
        assert f"rank {rank}/2 (reference transport): 512 tokens x top-4 ->" in done.stdout
        for check in ("combine == K * x", "combine(weighted=True) == sum_k w_k * x",
                      "cached dispatch == dispatch of the same rows",
                      "autograd: x.grad == (sum_k w_k) * dloss/dy"):
            assert f"rank {rank}: ok   {check}" in done.stdout, done.stdout
    assert "FAIL" not in done.stdout


def test_balance_demo_without_torchrun_says_the_command():
    env = _env()
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, "balance_demo.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "balance_demo.py runs one process per EP rank under torchrun: "
        "torchrun --nproc-per-node 4 examples/balance_demo.py"], done.stderr


@pytest.mark.parametrize("name, value, line", [
    ("MDEEP_TRANSPORT", "nvlnk", "megatron_deepep: MDEEP_TRANSPORT='nvlnk': expected one of "
     "auto, local, nvlink, internode, reference; did you mean 'nvlink'?"),
    ("MDEEP_NUM_SMS", "-4", "megatron_deepep: MDEEP_NUM_SMS='-4': expected an integer >= 1"),
])
def test_the_main_job_refuses_a_bad_knob_in_one_line(name, value, line):
    """Checked before anything is installed or started (the demo sets its transport itself,
    so a bad MDEEP_TRANSPORT was once ignored)."""
    done = subprocess.run(["bash", os.path.join(EXAMPLES, "run_gpt_moe.sh")],
                          env=_env(**{name: value}, INSTALL="0"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [line], done.stderr


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_a_mistyped_megatron_flag_is_one_line_with_the_flag_it_meant():
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, "megatron_flags.py"), "--",
                           "--num-expert", "8"], env=_env(), capture_output=True, text=True,
                          timeout=120)
    line = ("run_gpt_moe.sh: --num-expert is no TransformerConfig field and no flag this run "
            "knows (examples/megatron_flags.py lists those); did you mean --num-experts?")
    assert done.returncode == 2
    # The last line, once (a megatron-core release may log at import, before it).
    assert done.stderr.strip().splitlines()[-1] == line and done.stderr.count(line) == 1, \
        done.stderr
    with open(os.path.join(EXAMPLES, "run_gpt_moe.sh")) as f:  # checked before torchrun
        script = f.read()
    assert script.index('"$HERE/megatron_flags.py"') < script.index("torch.distributed.run")


def test_known_noise_of_other_libraries_is_dropped():
    from megatron_deepep import logs

    logs.quiet_known_noise()
    logs.quiet_known_noise()  # idempotent
    # A handler on each logger itself: torch's logging may stop its loggers' propagation.
    collect = WarningCapture()
    for name, prefix in logs.KNOWN_NOISE.items():
        log = logging.getLogger(name)
        assert len(log.filters) == 1
        log.addHandler(collect)
        try:
            log.warning(prefix + " (the rest of the message)")
            log.warning("another message")
        finally:
            log.removeHandler(collect)
    assert collect.messages == ["another message"] * len(logs.KNOWN_NOISE)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_compare_dispatchers_without_a_gpu_advises_once():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here")
    from tests.helpers.distributed import free_port

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()),
                           os.path.join(EXAMPLES, "compare_dispatchers.py"), "--steps", "2"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert (done.stdout + done.stderr).count("compare_dispatchers.py: no CUDA GPU.") == 1, \
        done.stderr
