"""FP8 wire formats for dispatch: TE's blockwise 1x128 and MXFP8 1x32 recipe formats.

`formats` holds the format descriptions and their pure-torch references (bit-exact with TE and
with the device code in `cuda_src/common/fp8.cuh`); `te_bridge` wraps received data as TE's own
quantized tensor types when Transformer Engine is importable; `columnwise` describes the 128x1
copy the FP8 experts' weight gradient needs (`cuda_src/fp8_columnwise.cu`) and its reference.
"""

from megatron_deepep.fp8.dispatch import Fp8Dispatch
from megatron_deepep.fp8.formats import (
    BLOCKWISE_1x128,
    BLOCKWISE_1x128_FP32_SCALES,
    FORMATS,
    MXFP8_1x32,
    Fp8Format,
    ScaleKind,
    dequantize,
    quantize,
)

__all__ = [
    "BLOCKWISE_1x128",
    "BLOCKWISE_1x128_FP32_SCALES",
    "FORMATS",
    "MXFP8_1x32",
    "Fp8Dispatch",
    "Fp8Format",
    "ScaleKind",
    "dequantize",
    "quantize",
]
