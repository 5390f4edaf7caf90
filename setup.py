"""Packaging for megatron_deepep.

The CUDA sources in the top-level ``cuda_src/`` are compiled at run time (NVRTC), so the wheel must
carry them: they are installed as the package ``megatron_deepep.cuda_src`` through ``package_dir``.
"""

from setuptools import find_packages, setup

CUDA_SRC_PATTERNS = ["*.cu", "common/*.cuh"]

setup(
    name="megatron_deepep",
    version="0.1.0",
    description="Megatron-LM MoE token dispatcher on CuPy-compiled NVLink kernels",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists(
        "README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_deepep", "megatron_deepep.*"])
    + ["megatron_deepep.cuda_src"],
    package_dir={"megatron_deepep.cuda_src": "cuda_src"},
    package_data={"megatron_deepep.cuda_src": CUDA_SRC_PATTERNS},
    include_package_data=False,
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        # NVRTC without a GPU (kernel compile checks in CI) and at run time.
        "jit": ["cuda-bindings>=12.8", "nvidia-cuda-nvrtc"],
        "gpu": ["cuda-bindings>=12.8", "nvidia-cuda-nvrtc"],
        # pyyaml: megatron.training (in the megatron-core wheels from 0.17) imports it.
        "megatron": ["megatron-core>=0.16", "pyyaml"],
        "test": ["pytest", "matplotlib"],
    },
)
