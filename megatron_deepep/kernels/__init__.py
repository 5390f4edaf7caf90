"""The run-time compiler: NVRTC compiles, nvJitLink links against NVSHMEM, the cubin cache and
the launch path. It knows no kernel; `megatron_deepep.ops` is its only caller."""
