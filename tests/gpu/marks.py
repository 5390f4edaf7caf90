"""pytest marks shared by the GPU tier's files."""

from __future__ import annotations

import pytest
import torch

from megatron_deepep.fp8 import te_bridge

#: A test of the GPU tier that needs Transformer Engine (run by dev/gpu/gpu_te.sh): skipped,
#: saying why, without a CUDA GPU or without TE.
TE_GPU = [
    pytest.mark.gpu,
    pytest.mark.te,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not te_bridge.te_available()[0],
                       reason=f"needs Transformer Engine: {te_bridge.te_available()[1]}"),
]
