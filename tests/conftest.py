"""Session set-up shared by every test.

- Tests marked `gpu` are skipped without a CUDA GPU, with the reason and the command that runs
  them on a GPU machine: one skip, raised here, so `-rs` folds them into one summary line
  ("SKIPPED [count] tests/conftest.py: needs a CUDA GPU ...").
- Tests marked `nvrtc_job` (`test_kernels_compile.py`, the internode link of
  `test_nvshmem_link.py`) run last: once collection ends, their NVRTC compiles and nvJitLink
  links start in two low-priority background processes (`compile_jobs.py`), so they overlap the
  rest of the suite instead of adding to it.
- No CPU-tier test asserts on wall-clock times (the tier runs on shared, loaded machines);
  timings belong in the benchmarks.
"""

import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.lru_cache(maxsize=None)
def _no_gpu_reason():
    """None with a usable CUDA GPU, else why not and what runs the GPU tier."""
    run_there = "the GPU tier runs on a CUDA machine: `python -m pytest -m gpu tests/gpu`"
    try:
        import torch
    except ImportError:
        return f"needs torch with CUDA and a GPU (torch is not installed); {run_there}"
    if torch.version.cuda is None:
        return (f"needs a CUDA GPU (this torch {torch.__version__} is a CPU-only build); "
                f"{run_there}")
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU (none visible to torch {torch.__version__}); {run_there}"
    return None


@pytest.hookimpl(tryfirst=True)  # ahead of the files' own skipif marks: one reason for all
def pytest_runtest_setup(item):
    if "gpu" in item.keywords and _no_gpu_reason() is not None:
        pytest.skip(_no_gpu_reason())  # raised here: one location, one summary line


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(config, items):
    jobs = [item for item in items if item.get_closest_marker("nvrtc_job")]
    if jobs:
        others = [item for item in items if not item.get_closest_marker("nvrtc_job")]
        items[:] = others + jobs


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    job_ids = [item.callspec.params["job"] for item in session.items
               if item.get_closest_marker("nvrtc_job")]
    if job_ids:
        from tests.helpers import compile_jobs
        compile_jobs.start(job_ids)


def pytest_sessionfinish(session):
    if "tests.helpers.compile_jobs" in sys.modules:
        sys.modules["tests.helpers.compile_jobs"].stop()
