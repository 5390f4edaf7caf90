"""The wheel carries every kernel source: setup.py's `CUDA_SRC_PATTERNS` (package_data globs,
relative to `cuda_src/`, where `*` stops at a `/`) match every `.cu` and `.cuh` under
`cuda_src/`, so a new folder of kernels cannot be left out of an install."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO_ROOT


def _patterns():
    tree = ast.parse((Path(REPO_ROOT) / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == \
                "CUDA_SRC_PATTERNS":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no CUDA_SRC_PATTERNS")


def test_package_data_covers_every_kernel_source():
    root = Path(REPO_ROOT) / "cuda_src"
    sources = {p.relative_to(root).as_posix() for p in root.rglob("*")
               if p.suffix in (".cu", ".cuh")}
    packaged = {p.relative_to(root).as_posix() for pattern in _patterns()
                for p in root.glob(pattern)}
    assert {"internode/full.cu", "internode/common.cuh", "bench/quantize.cu"} <= sources
    assert sources - packaged == set(), sorted(sources - packaged)
