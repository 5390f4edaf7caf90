import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `python -m pytest -m gpu tests/gpu` "
                                   "on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
