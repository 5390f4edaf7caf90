"""CPU tier: the Slurm templates parse (`bash -n`) and set the NVSHMEM settings a cluster needs.

`examples/slurm_nvshmem_env.sh` is sourced in a bash with a chosen environment and the exported
result read back; the two sbatch scripts run with stand-ins for `srun` and `scontrol` (and for
`python3 -c "import megatron.training"`), and the stand-in `srun` records the environment and
command line it was given.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from megatron_deepep.buffer import TRANSPORTS
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
EXAMPLES = os.path.join(ROOT, "examples")
ENV_SCRIPT = os.path.join(EXAMPLES, "slurm_nvshmem_env.sh")
SBATCH = ["slurm_gpt_moe.sbatch", "slurm_multinode_check.sbatch"]
CLEARED = ("IB_TRANSPORT", "NVSHMEM_", "NCCL_IB_HCA", "MAX_TOKENS", "HIDDEN", "EP", "TOPK")


def _base_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEARED)}
    python_dir = os.path.dirname(sys.executable)
    env.update(PATH=f"{tmp_path / 'bin'}{os.pathsep}{python_dir}{os.pathsep}{env['PATH']}",
               PYTHONPATH=ROOT, REPO=ROOT)
    env.update(extra)
    return env


def _source(tmp_path, **extra):
    """(exit status, exported NVSHMEM/NCCL/TORCH variables, stderr) after sourcing the script."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    done = subprocess.run(["bash", "-c", f'set -euo pipefail; source "{ENV_SCRIPT}"; env'],
                          env=_base_env(tmp_path, **extra), capture_output=True, text=True,
                          timeout=120)
    exported = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return done.returncode, exported, done.stderr


@pytest.mark.parametrize("name", SBATCH + ["slurm_nvshmem_env.sh"])
def test_templates_parse(name):
    done = subprocess.run(["bash", "-n", os.path.join(EXAMPLES, name)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def test_defaults_ibrc_nearest_nic_no_multicast(tmp_path):
    code, env, err = _source(tmp_path, NVSHMEM_SYMMETRIC_SIZE="3g", NCCL_IB_HCA="mlx5")
    assert code == 0, err
    assert env["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc" and env["NVSHMEM_IB_ENABLE_IBGDA"] == "0"
    assert env["NVSHMEM_ENABLE_NIC_PE_MAPPING"] == "0"
    # Exported empty, so torch does not copy NCCL_IB_HCA's prefix "mlx5" into it.
    assert env["NVSHMEM_HCA_LIST"] == ""
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_SYMMETRIC_SIZE"] == "3g"  # the user's value stays


def test_ibgda_and_nic_mapping(tmp_path):
    mapping = "mlx5_0:1:1,mlx5_3:1:1"
    code, env, err = _source(tmp_path, IB_TRANSPORT="ibgda", NVSHMEM_HCA_PE_MAPPING=mapping,
                             NVSHMEM_SYMMETRIC_SIZE="1g")
    assert code == 0, err
    assert env["NVSHMEM_IB_ENABLE_IBGDA"] == "1" and env["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc"
    assert env["NVSHMEM_ENABLE_NIC_PE_MAPPING"] == "1"
    assert env["NVSHMEM_HCA_PE_MAPPING"] == mapping and env["NVSHMEM_HCA_LIST"] == ""
    code, env, _ = _source(tmp_path, NVSHMEM_HCA_LIST="mlx5_0:1,mlx5_1:1",
                           NVSHMEM_SYMMETRIC_SIZE="1g")
    assert code == 0 and env["NVSHMEM_ENABLE_NIC_PE_MAPPING"] == "1"
    assert env["NVSHMEM_HCA_LIST"] == "mlx5_0:1,mlx5_1:1"


@pytest.mark.parametrize("extra, message", [
    ({"IB_TRANSPORT": "roce"}, "IB_TRANSPORT must be ibrc or ibgda, got 'roce'"),
    ({"NVSHMEM_HCA_LIST": "mlx5_0:1", "NVSHMEM_HCA_PE_MAPPING": "mlx5_0:1:8"}, "not both"),
])
def test_bad_settings_stop_the_job(tmp_path, extra, message):
    code, _, err = _source(tmp_path, NVSHMEM_SYMMETRIC_SIZE="1g", **extra)
    assert code != 0 and message in err


def test_heap_size_from_size_hint(tmp_path):
    code, env, err = _source(tmp_path, MAX_TOKENS="4096", HIDDEN="7168", EP="16", TOPK="8")
    assert code == 0, err
    if "internode" in TRANSPORTS:
        size = int(env["NVSHMEM_SYMMETRIC_SIZE"])
        assert size >= 1 << 30 and size % (512 << 20) == 0
    else:  # before the internode transport: NVSHMEM's default, said so
        assert "NVSHMEM_SYMMETRIC_SIZE" not in env
        assert "NVSHMEM keeps its default (1 GiB)" in err


def _stand_ins(tmp_path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scripts = {
        "srun": f'#!/bin/sh\nenv > "{tmp_path}/srun.env"\nprintf "%s\\n" "$@" > '
                f'"{tmp_path}/srun.args"\n',
        "scontrol": "#!/bin/sh\nprintf 'node-a\\nnode-b\\n'\n",
        "python3": f'#!/bin/sh\n[ "$1" = "-c" ] && [ "$2" = "import megatron.training" ] && '
                   f'exit 0\nexec "{sys.executable}" "$@"\n',
    }
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("name", SBATCH)
def test_sbatch_hands_srun_the_settings(tmp_path, name):
    _stand_ins(tmp_path)
    env = _base_env(tmp_path, SLURM_SUBMIT_DIR=ROOT, SLURM_JOB_ID="42", SLURM_JOB_NUM_NODES="2",
                    SLURM_NTASKS="16", SLURM_JOB_NODELIST="node-[a-b]",
                    OUT=str(tmp_path / "out"), NVSHMEM_SYMMETRIC_SIZE="2g",
                    IB_TRANSPORT="ibgda")
    done = subprocess.run(["bash", os.path.join(EXAMPLES, name), "--sweep-hidden", "4096"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = dict(line.split("=", 1) for line in (tmp_path / "srun.env").read_text().splitlines()
                if "=" in line)
    args = (tmp_path / "srun.args").read_text()
    for key, value in (("NVSHMEM_IB_ENABLE_IBGDA", "1"), ("NVSHMEM_REMOTE_TRANSPORT", "ibrc"),
                       ("NVSHMEM_ENABLE_NIC_PE_MAPPING", "0"), ("NVSHMEM_HCA_LIST", ""),
                       ("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0"),
                       ("NVSHMEM_SYMMETRIC_SIZE", "2g")):
        assert seen.get(key) == value, (key, seen.get(key))
    assert "NCCL_IB_HCA" not in seen
    if name == "slurm_multinode_check.sbatch":
        assert seen["MASTER_ADDR"] == "node-a" and seen["MASTER_PORT"] == "29500"
        assert "-m\nmegatron_deepep.tools.multinode_check\n" in args and "--json" in args
        assert "--sweep-hidden\n4096" in args  # the job's own arguments reach the check
    else:
        assert "--expert-model-parallel-size 16" in args and "--num-experts 32" in args
