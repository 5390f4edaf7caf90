"""A stand-in for NVRTC and nvJitLink in `kernels.nvshmem_link`: the link cache's tests need the
NVSHMEM wheels' paths but no real compile or link."""

import pytest


def fake_nvshmem_link(monkeypatch) -> list:
    """Skips without the NVSHMEM link wheels; else replaces nvshmem_link's compile and link with
    fakes (a unit per source, a cubin per link context) and returns the list every link's
    context is appended to."""
    from megatron_deepep.kernels import nvshmem_link
    try:
        nvshmem_link.nvshmem_paths()
        nvshmem_link._bindings()
    except nvshmem_link.NvshmemUnavailable as exc:
        pytest.skip(f"NVSHMEM link wheels not installed ({str(exc).split('. ')[0]}); "
                    f"pip install {nvshmem_link.PIP_PACKAGES}")
    links = []

    def fake_compile(nvrtc, code, name, exprs, opts):
        return b"unit " + name.encode(), {e: f"_Z{len(e)}{e}" for e in exprs}

    def fake_link(nvjitlink, units, library, arch, context):
        links.append(context)
        return b"\x7fELF linked " + context.encode()

    monkeypatch.setattr(nvshmem_link, "_nvrtc_compile", fake_compile)
    monkeypatch.setattr(nvshmem_link, "_nvjitlink", fake_link)
    return links
