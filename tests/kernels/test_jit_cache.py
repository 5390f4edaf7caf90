"""CPU tier: the kernel disk cache is safe for many ranks on one shared directory.

Entries are one self-checking file each, written through a temporary file and a rename; a
short, corrupt or foreign entry is recompiled and replaced, never loaded; processes racing to
compile the same kernels into a fresh directory all get valid cubins and leave no temporary
files. The first use of each kernel is logged (INFO) with its time and where it came from.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing

import pytest

from megatron_deepep.kernels import cache_trust, jit
from tests.helpers.nvshmem_fakes import fake_nvshmem_link

pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC compile checks need NVRTC: "
                    "pip install -e '.[jit]'")

# Cheap kernels (well under a second each to compile).
KERNELS = [("notify.cu", "notify_kernel"), ("bench/ceiling.cu", "fill_kernel"),
           ("bench/ceiling.cu", "fan_in_sum")]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "kernels"
    monkeypatch.setenv("MDEEP_CACHE_DIR", str(directory))
    monkeypatch.delenv("MDEEP_JIT_NO_CACHE", raising=False)
    return directory


def _entries(directory):
    return sorted(p.name for p in directory.iterdir())


def test_entry_round_trip_and_every_kind_of_damage():
    cubin, names = b"\x7fELF" + bytes(range(256)) * 4, {"k<1>": "_Z1kILi1EEvv"}
    blob = jit.pack_entry(cubin, names)
    assert jit.unpack_entry(blob, ["k<1>"]) == (cubin, names)
    damaged = {
        "empty": b"",
        "truncated cubin": blob[:-7],
        "truncated header": blob[:20],
        "flipped byte": blob[:-1] + bytes([blob[-1] ^ 1]),
        "not an entry": cubin,
        "bad json": blob.replace(b'"names"', b'"names', 1),
    }
    for what, data in damaged.items():
        try:
            jit.unpack_entry(data, ["k<1>"])
        except ValueError:
            continue
        pytest.fail(f"{what}: accepted")
    with pytest.raises(ValueError, match="other kernels"):
        jit.unpack_entry(blob, ["k<2>"])


def test_an_empty_compile_log_leaves_the_interpreter_alone():
    """NVRTC writes the log into the buffer it is given; an empty log is 1 byte, and a 1-byte
    `b" " * n` is the interpreter's own b" " object. Written into, it broke code compiled later
    in the process: under Python 3.12 an f-string lost the space between two fields (Python 3.11
    shows nothing either way)."""
    cubin, _ = jit.compile_code('extern "C" __global__ void empty_log_kernel() {}', "empty.cu")
    assert cubin[:4] == b"\x7fELF"
    compiled_after = compile('f"{first} {second}"', "<after an NVRTC compile>", "eval")
    assert eval(compiled_after, {}, {"first": 1, "second": "x"}) == "1 x"


def test_build_caches_one_file_per_kernel_and_reads_it_back(cache):
    first = jit.build("notify.cu", "notify_kernel", "sm_90")
    assert not first.from_cache and first.cubin[:4] == b"\x7fELF"
    assert first.path.parent == cache and _entries(cache) == [first.path.name]
    again = jit.build("notify.cu", "notify_kernel", "sm_90")
    assert again.from_cache and (again.cubin, again.lowered) == (first.cubin, first.lowered)
    other_arch = jit.build("notify.cu", "notify_kernel", "sm_100")
    assert not other_arch.from_cache and len(_entries(cache)) == 2


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "foreign"])
def test_a_damaged_entry_is_recompiled_not_loaded(cache, damage, caplog):
    good = jit.build("notify.cu", "notify_kernel", "sm_90")
    data = good.path.read_bytes()
    if damage == "truncate":  # a writer that died mid-file on a filesystem without rename
        good.path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        good.path.write_bytes(b"\0" * len(data))
    elif damage == "empty":
        good.path.write_bytes(b"")
    else:  # a whole, valid entry of another kernel under this key
        good.path.write_bytes(jit.pack_entry(b"\x7fELF other", {"fill_kernel": "x"}))
    with caplog.at_level(logging.WARNING, logger="megatron_deepep.kernels.jit"):
        rebuilt = jit.build("notify.cu", "notify_kernel", "sm_90")
    assert not rebuilt.from_cache
    assert (rebuilt.cubin, rebuilt.lowered) == (good.cubin, good.lowered)
    assert "unusable" in caplog.text and "recompiling" in caplog.text
    assert good.path.read_bytes() == data  # replaced by a whole entry
    assert jit.build("notify.cu", "notify_kernel", "sm_90").from_cache


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "entry.kernel"

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(cache_trust.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        jit.write_atomic(target, b"data")
    assert list(tmp_path.iterdir()) == []


def test_first_use_logs_compile_then_cache(cache, caplog, monkeypatch):
    monkeypatch.setattr(jit, "_logged_builds", set())
    with caplog.at_level(logging.INFO, logger="megatron_deepep.kernels.jit"):
        jit._cached_cubin("bench/ceiling.cu", "fill_kernel", "sm_90")
        jit._cached_cubin("bench/ceiling.cu", "fill_kernel", "sm_90")  # logged once per kernel
    compiled = [r.getMessage() for r in caplog.records]
    assert len(compiled) == 1
    assert "compiled bench/ceiling.cu fill_kernel for sm_90 in" in compiled[0]
    assert str(cache) in compiled[0] and "megatron_deepep.tools.precompile" in compiled[0]
    caplog.clear()
    monkeypatch.setattr(jit, "_logged_builds", set())  # a new process
    with caplog.at_level(logging.INFO, logger="megatron_deepep.kernels.jit"):
        jit._cached_cubin("bench/ceiling.cu", "fill_kernel", "sm_90")
    assert "loaded bench/ceiling.cu fill_kernel (sm_90) from the disk cache" in caplog.text


def _race(cache_dir: str, barrier, results) -> None:
    """One 'rank': compiles KERNELS into `cache_dir` as soon as every rank is ready."""
    import os
    os.environ["MDEEP_CACHE_DIR"] = cache_dir
    from megatron_deepep.kernels import jit as rank_jit
    barrier.wait()
    out = []
    for source, expr in KERNELS:
        built = rank_jit.build(source, expr, "sm_90")
        out.append((source, expr, hashlib.sha256(built.cubin).hexdigest(), built.lowered,
                    built.cubin[:4], built.from_cache))
    # Read every entry while the other ranks may still be replacing them: never torn.
    for _ in range(20):
        for source, expr in KERNELS:
            assert rank_jit.read_entry(rank_jit.cache_path(source, expr, "sm_90"), [expr])
    results.put(out)


def test_processes_racing_on_one_fresh_cache_directory(tmp_path):
    cache_dir = tmp_path / "shared_cache"  # not created yet: the ranks race to create it too
    num_procs = 4
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(num_procs), context.Queue()
    procs = [context.Process(target=_race, args=(str(cache_dir), barrier, results))
             for _ in range(num_procs)]
    for p in procs:
        p.start()
    outs = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for out in outs:
        for source, expr, digest, lowered, magic, _ in out:
            assert magic == b"\x7fELF", (source, expr)
            assert (digest, lowered) == next((d, name) for s, e, d, name, _, _ in outs[0]
                                             if (s, e) == (source, expr))
    # Exactly one whole entry per kernel, each loadable, and no temporary files left.
    names = _entries(cache_dir)
    assert len(names) == len(KERNELS) and all(n.endswith(".kernel") for n in names), names
    for source, expr in KERNELS:
        path = jit.cache_path(source, expr, "sm_90", cache_dir)
        cubin, lowered = jit.unpack_entry(path.read_bytes(), [expr])
        assert hashlib.sha256(cubin).hexdigest() == next(
            d for s, e, d, _, _, _ in outs[0] if (s, e) == (source, expr))


def test_nvshmem_link_cache_is_one_checked_file(tmp_path, monkeypatch):
    """nvshmem_link's cache: names and cubin in one entry; a damaged one is relinked."""
    from megatron_deepep.kernels import nvshmem_link
    monkeypatch.setenv("MDEEP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MDEEP_JIT_NO_CACHE", raising=False)
    links = fake_nvshmem_link(monkeypatch)
    names = ["internode_leg_send", "internode_leg_wait"]
    first = nvshmem_link.link_cubin("bench/internode_leg.cu", names, "sm_90")
    (entry,) = (tmp_path / "nvshmem").glob("*.kernel")
    assert jit.unpack_entry(entry.read_bytes(), names) == first
    assert nvshmem_link.link_cubin("bench/internode_leg.cu", names, "sm_90") == first
    assert len(links) == 1
    entry.write_bytes(entry.read_bytes()[:-3])  # torn
    assert nvshmem_link.link_cubin("bench/internode_leg.cu", names, "sm_90") == first
    assert len(links) == 2
    assert jit.unpack_entry(entry.read_bytes(), names) == first
    leftovers = [p.name for p in (tmp_path / "nvshmem").iterdir()
                 if p.name.startswith(jit.TEMP_PREFIX)]
    assert not leftovers
