"""Packaging for megatron_deepep.

The CUDA sources in the top-level ``cuda_src/`` are compiled at run time (NVRTC), so the wheel must
carry them: they are installed as the package ``megatron_deepep.cuda_src`` through ``package_dir``.
"""

from setuptools import find_packages, setup

JIT_PACKAGES = ["cuda-bindings>=12.8", "nvidia-cuda-nvrtc", "nvidia-nvjitlink",
                "nvidia-nvshmem-cu13>=3.4.5,<3.9", "nvidia-cuda-runtime", "nvidia-cuda-cccl"]
# Every kernel source and header under cuda_src/ (tests/project/test_packaging.py checks).
CUDA_SRC_PATTERNS = ["*.cu", "common/*.cuh", "internode/*.cu", "internode/*.cuh", "bench/*.cu"]

setup(
    name="megatron_deepep",
    version="0.1.0",
    description="Megatron-LM MoE token dispatcher on run-time compiled CUDA kernels",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists(
        "README.md") else "",
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_deepep", "megatron_deepep.*"])
    + ["megatron_deepep.cuda_src"],
    package_dir={"megatron_deepep.cuda_src": "cuda_src"},
    package_data={"megatron_deepep.cuda_src": CUDA_SRC_PATTERNS},
    include_package_data=False,
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        # NVRTC and nvJitLink without a GPU (every kernel compiles and links in CI) and at run
        # time; NVSHMEM's device library and the CUDA / CCCL headers its headers need, for the
        # internode kernels.
        "jit": JIT_PACKAGES,
        "gpu": JIT_PACKAGES,
        # The supported releases (README; = examples/prepare_env.py MEGATRON_CORE, a test
        # checks). pyyaml: megatron.training (in the megatron-core wheels from 0.17) imports it;
        # psutil: dist_checkpointing's file writer (checkpoints with a placement plan).
        "megatron": ["megatron-core>=0.16,<0.20", "pyyaml", "psutil"],
        "test": ["pytest", "matplotlib", "hypothesis"],
    },
)
