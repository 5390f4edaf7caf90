"""CPU tier: the NVSHMEM release scripts. `dev/nvshmem_releases.sh` plans the link tests per
release; `dev/gpu/nvshmem_newest.sh` packs only the wheel files the device needs and runs the
internode tier at 2x1 and 2x2 with them (host library preloaded, the releases checked first),
then with the image's NVSHMEM."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile

from tests.helpers import REPO_ROOT

NEWEST = os.path.join(REPO_ROOT, "dev", "gpu", "nvshmem_newest.sh")
RELEASES = os.path.join(REPO_ROOT, "dev", "nvshmem_releases.sh")
NEEDED = ["nvidia/nvshmem/include/nvshmem.h", "nvidia/nvshmem/lib/libnvshmem_device.a",
          "nvidia/nvshmem/lib/libnvshmem_host.so.3",
          "nvidia/nvshmem/lib/nvshmem_bootstrap_uid.so.3"]
NOT_NEEDED = ["nvidia/nvshmem/lib/libnvshmem_device_sm_90.bc",
              "nvidia/nvshmem/lib/nvshmem_transport_ibrc.so.7",
              "nvidia/nvshmem/lib/nvshmem_bootstrap_mpi.so.3"]


def _bash(script, *args, **env):
    full_env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
                    + os.environ.get("PATH", ""))
    for name in ("DRY_RUN", "PIECES", "VERSIONS", "CARRY", "OUT"):
        full_env.pop(name, None)
    full_env.update(env)
    done = subprocess.run(["bash", script, *args], env=full_env, capture_output=True, text=True,
                          timeout=120)
    return done.returncode, done.stdout + done.stderr


def test_prepare_packs_only_what_the_device_needs(tmp_path):
    wheel = tmp_path / "nvidia_nvshmem_cu13-9.1.0-py3-none-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in NEEDED + NOT_NEEDED + ["nvidia_nvshmem_cu13-9.1.0.dist-info/METADATA"]:
            archive.writestr(name, b"x" * 1000)
    carry = tmp_path / "carry"
    rc, out = _bash(NEWEST, "prepare", str(wheel), CARRY=str(carry))
    assert rc == 0, out
    with tarfile.open(carry / "nvshmem-9.1.0.tar.xz") as packed:
        names = {m.name for m in packed.getmembers() if m.isfile()}
    assert names == set(NEEDED) | {"nvidia_nvshmem_cu13-9.1.0.dist-info/METADATA"}
    assert "MiB of the 64 MiB carry limit" in out and "OVER" not in out
    assert f'carry ["{carry}"]' in out


def test_run_plans_the_newest_release_then_the_image(tmp_path):
    carry = tmp_path / "carry"
    carry.mkdir()
    (carry / "nvshmem-9.1.0.tar.xz").write_bytes(b"")
    rc, out = _bash(NEWEST, "run", DRY_RUN="1", CARRY=str(carry), OUT=str(tmp_path / "out"))
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith("dry run: ")]
    assert [line.split(" (")[0] for line in lines] == [
        "dry run: unpack", "dry run: check-9.1.0", "dry run: tier-9.1.0", "dry run: tier-image"]
    check, newest, image = lines[1], lines[2], lines[3]
    for line in (check, newest):
        assert "LD_PRELOAD=/tmp/mdeep-nvshmem-9.1.0" in line
        assert "libnvshmem_host.so.3" in line and "PYTHONPATH=/tmp/mdeep-nvshmem-9.1.0" in line
    assert "9.1.0" in check and "check_host_library" in check
    for line in (newest, image):
        assert "MDEEP_TEST_NODES=2x1\\,2x2" in line and "tests/gpu/test_internode_gpu.py" in line
    assert "LD_PRELOAD" not in image


def test_run_without_a_tarball_says_what_to_carry(tmp_path):
    rc, out = _bash(NEWEST, "run", CARRY=str(tmp_path / "empty"), OUT=str(tmp_path / "out"))
    assert rc == 2 and "prepare it, carry" in out


def test_releases_plan_one_link_run_per_release(tmp_path):
    rc, out = _bash(RELEASES, DRY_RUN="1", VERSIONS="3.4.5 3.8.0", WHEELS=str(tmp_path))
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith("dry run: ")]
    assert len(lines) == 2
    assert "nvidia-nvshmem-cu13==3.4.5" in lines[0] and "nvidia-nvshmem-cu13==3.8.0" in lines[1]
    assert all("tests/kernels/test_nvshmem_link.py" in line for line in lines)
