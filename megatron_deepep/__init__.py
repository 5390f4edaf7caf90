"""megatron_deepep: a Megatron-LM MoE token dispatcher on our own NVLink kernels."""
