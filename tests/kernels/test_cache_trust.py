"""CPU tier: a kernel cache entry is loaded only from a trusted owner, never just for its checksum.

A cubin runs with the job's rights, and an entry's checksum only proves it whole. These tests
plant entries and headers the way another account could (`os.chown` to uid 65534: the tests
run as root in CI) and check that each is refused with one warning and built again: an entry of
another owner with a valid checksum, a group- or world-writable entry, a symbolic link, a
world-writable cache folder, a tampered or foreign NVSHMEM shim header. The default folder is
made 0700 and entries 0600; a shared cache works only through the knob `MDEEP_CACHE_TRUST`.
"""

from __future__ import annotations

import logging
import os
import stat

import pytest

from megatron_deepep.kernels import cache_trust, jit
from tests.helpers.nvshmem_fakes import fake_nvshmem_link

pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC compile checks need cuda-bindings: "
                    "pip install cuda-bindings")

OTHER_UID = OTHER_GID = 65534  # "nobody": an account that is not the one running the tests
KERNEL = ("notify.cu", "notify_kernel")
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(cache_trust, "_warned", set())  # each test is a new process
    monkeypatch.delenv("MDEEP_JIT_NO_CACHE", raising=False)
    monkeypatch.delenv("MDEEP_CACHE_TRUST", raising=False)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "kernels"
    monkeypatch.setenv("MDEEP_CACHE_DIR", str(directory))
    return directory


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _trust_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "not trusted" in r.getMessage()]


def _plant(path, cubin=b"\x7fELF planted by someone else"):
    """A whole entry with a valid checksum for `KERNEL`, holding a cubin that is not ours."""
    path.write_bytes(jit.pack_entry(cubin, {KERNEL[1]: "_Z13notify_kernelv"}))
    return path


def test_the_default_folder_is_per_user_and_private(tmp_path, monkeypatch):
    monkeypatch.delenv("MDEEP_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    built = jit.build(*KERNEL, "sm_90")
    folder = tmp_path / "home" / ".cache" / "megatron_deepep"
    assert built.path.parent == folder and not built.from_cache
    assert _mode(folder) == 0o700 and _mode(built.path) == 0o600
    assert jit.build(*KERNEL, "sm_90").from_cache


def test_an_explicit_folder_is_created_private_too(cache):
    built = jit.build(*KERNEL, "sm_90")
    assert _mode(cache) == 0o700 and _mode(built.path) == 0o600


@needs_root
def test_a_planted_entry_of_another_owner_is_refused_and_rebuilt(cache, caplog):
    good = jit.build(*KERNEL, "sm_90")
    planted = _plant(good.path)
    os.chown(planted, OTHER_UID, OTHER_GID)
    os.chmod(planted, 0o644)
    assert jit.unpack_entry(planted.read_bytes(), [KERNEL[1]])  # its checksum is valid
    with caplog.at_level(logging.WARNING, logger="megatron_deepep.kernels.cache_trust"):
        rebuilt = jit.build(*KERNEL, "sm_90")
        again = jit.build(*KERNEL, "sm_90")
    warnings = _trust_warnings(caplog)
    print("\n".join(warnings))
    assert not rebuilt.from_cache and rebuilt.cubin == good.cubin
    assert len(warnings) == 1 and f"owned by uid {OTHER_UID}" in warnings[0]
    assert str(planted) in warnings[0] and "MDEEP_CACHE_TRUST" in warnings[0]
    info = os.stat(planted)  # replaced by our own entry, which is then used
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.getuid(), 0o600)
    assert again.from_cache and again.cubin == good.cubin


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_an_entry_others_may_write_is_refused_and_rebuilt(cache, caplog, mode):
    good = jit.build(*KERNEL, "sm_90")
    os.chmod(_plant(good.path), mode)
    with caplog.at_level(logging.WARNING, logger="megatron_deepep.kernels.cache_trust"):
        rebuilt = jit.build(*KERNEL, "sm_90")
    assert not rebuilt.from_cache and rebuilt.cubin == good.cubin
    assert "writable by" in _trust_warnings(caplog)[0] and _mode(good.path) == 0o600


def test_a_symbolic_link_entry_is_refused(cache, tmp_path, caplog):
    good = jit.build(*KERNEL, "sm_90")
    elsewhere = _plant(tmp_path / "elsewhere.kernel")
    good.path.unlink()
    good.path.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="megatron_deepep.kernels.cache_trust"):
        rebuilt = jit.build(*KERNEL, "sm_90")
    assert not rebuilt.from_cache and rebuilt.cubin == good.cubin
    assert "symbolic link" in _trust_warnings(caplog)[0] and not good.path.is_symlink()


def test_a_world_writable_folder_is_neither_read_nor_written(cache, caplog):
    good = jit.build(*KERNEL, "sm_90")
    _plant(good.path)  # ours, 0600, valid checksum: still not read from such a folder
    os.chmod(cache, 0o777)
    with caplog.at_level(logging.WARNING, logger="megatron_deepep.kernels.cache_trust"):
        first = jit.build(*KERNEL, "sm_90")
        second = jit.build(*KERNEL, "sm_90")
    warnings = _trust_warnings(caplog)
    print("\n".join(warnings))
    assert not first.from_cache and not second.from_cache and first.path is None
    assert first.cubin == second.cubin == good.cubin
    assert len(warnings) == 1 and "writable by others (mode 0777)" in warnings[0]
    assert jit.unpack_entry(good.path.read_bytes(), [KERNEL[1]])[0].endswith(b"someone else")
    os.chmod(cache, 0o700)  # fixed: read again (that entry is ours: we wrote it above)
    assert jit.build(*KERNEL, "sm_90").from_cache


@needs_root
def test_a_folder_of_another_owner_is_not_used(cache, caplog):
    jit.build(*KERNEL, "sm_90")
    os.chown(cache, OTHER_UID, OTHER_GID)
    with caplog.at_level(logging.WARNING, logger="megatron_deepep.kernels.cache_trust"):
        assert not jit.build(*KERNEL, "sm_90").from_cache
    assert f"owned by uid {OTHER_UID}" in _trust_warnings(caplog)[0]


@needs_root
def test_a_shared_cache_is_an_explicit_choice(cache, monkeypatch):
    good = jit.build(*KERNEL, "sm_90")
    os.chown(good.path, OTHER_UID, OTHER_GID)
    os.chmod(good.path, 0o644)
    assert not jit.build(*KERNEL, "sm_90").from_cache  # not by default
    os.chown(good.path, OTHER_UID, OTHER_GID)
    os.chmod(good.path, 0o644)
    monkeypatch.setenv("MDEEP_CACHE_TRUST", f"user:{OTHER_UID}")
    assert cache_trust.policy().file_mode == 0o644
    assert jit.build(*KERNEL, "sm_90").from_cache  # that account's entries are used
    os.chmod(good.path, 0o666)
    assert not jit.build(*KERNEL, "sm_90").from_cache  # never a world-writable one


@needs_root
def test_a_group_cache_trusts_its_group_and_no_one_else(tmp_path, monkeypatch):
    monkeypatch.setenv("MDEEP_CACHE_DIR", str(tmp_path / "team"))
    monkeypatch.setenv("MDEEP_CACHE_TRUST", f"group:{OTHER_GID}")
    built = jit.build(*KERNEL, "sm_90")
    folder = os.stat(tmp_path / "team")
    assert (folder.st_gid, stat.S_IMODE(folder.st_mode)) == (OTHER_GID, 0o2770)
    entry = os.stat(built.path)
    assert (entry.st_gid, stat.S_IMODE(entry.st_mode)) == (OTHER_GID, 0o640)
    os.chown(built.path, OTHER_UID + 1, OTHER_GID)  # another member wrote it, group-writable
    os.chmod(built.path, 0o660)
    assert jit.build(*KERNEL, "sm_90").from_cache
    os.chown(built.path, OTHER_UID + 1, 0)  # not the team's group
    assert not jit.build(*KERNEL, "sm_90").from_cache
    os.chmod(tmp_path / "team", 0o2777)
    assert jit.build(*KERNEL, "sm_90").path is None  # a world-writable team folder: not used


def test_a_bad_trust_knob_names_itself(monkeypatch):
    for text in ("everyone", "user:", "group:no-such-group-mdeep"):
        monkeypatch.setenv("MDEEP_CACHE_TRUST", text)
        with pytest.raises(ValueError, match="MDEEP_CACHE_TRUST"):
            cache_trust.policy()


# The NVSHMEM shim header: pre-included into every internode compile, so checked like an entry
# and, beyond that, byte for byte against the one this version writes.

def _shim(cache):
    from megatron_deepep.kernels import nvshmem_link
    return nvshmem_link, nvshmem_link._shim_path()


def test_a_tampered_shim_is_rewritten(cache, caplog):
    nvshmem_link, path = _shim(cache)
    assert path.parent == cache / "nvshmem" and path.read_text() == nvshmem_link._SHIM
    assert _mode(path) == 0o600
    path.write_text(nvshmem_link._SHIM + "#define is_integral evil\n")
    with caplog.at_level(logging.WARNING, logger="megatron_deepep.kernels.cache_trust"):
        assert nvshmem_link._shim_path() == path
    assert path.read_text() == nvshmem_link._SHIM
    assert "differs from the shim" in _trust_warnings(caplog)[0]


@needs_root
def test_a_shim_of_another_owner_is_rewritten(cache, caplog):
    nvshmem_link, path = _shim(cache)
    os.chown(path, OTHER_UID, OTHER_GID)  # the right bytes, the wrong owner
    with caplog.at_level(logging.WARNING, logger="megatron_deepep.kernels.cache_trust"):
        assert nvshmem_link._shim_path() == path
    assert os.stat(path).st_uid == os.getuid() and path.read_text() == nvshmem_link._SHIM
    assert f"owned by uid {OTHER_UID}" in _trust_warnings(caplog)[0]


def test_a_shim_in_a_world_writable_folder_goes_to_a_private_one(cache, caplog, monkeypatch):
    nvshmem_link, path = _shim(cache)
    monkeypatch.setattr(nvshmem_link, "_private_shim_dir", [])
    os.chmod(path.parent, 0o777)
    with caplog.at_level(logging.WARNING, logger="megatron_deepep.kernels.cache_trust"):
        private = nvshmem_link._shim_path()
    assert private.parent != path.parent and private.read_text() == nvshmem_link._SHIM
    assert _mode(private.parent) == 0o700 and _mode(private) == 0o600
    assert "writable by others" in _trust_warnings(caplog)[0]


@needs_root
def test_a_planted_linked_entry_is_refused_and_relinked(cache, monkeypatch, caplog):
    from megatron_deepep.kernels import nvshmem_link
    links = fake_nvshmem_link(monkeypatch)
    names = ["internode_leg_send"]
    first = nvshmem_link.link_cubin("bench/internode_leg.cu", names, "sm_90")
    (entry,) = (cache / "nvshmem").glob("*.kernel")
    entry.write_bytes(jit.pack_entry(b"\x7fELF planted", first[1]))
    os.chown(entry, OTHER_UID, OTHER_GID)
    with caplog.at_level(logging.WARNING, logger="megatron_deepep.kernels.cache_trust"):
        again = nvshmem_link.link_cubin("bench/internode_leg.cu", names, "sm_90")
    assert again == first and len(links) == 2
    assert f"owned by uid {OTHER_UID}" in _trust_warnings(caplog)[0]
    assert nvshmem_link.link_cubin("bench/internode_leg.cu", names, "sm_90") == first
    assert len(links) == 2  # our own entry again
