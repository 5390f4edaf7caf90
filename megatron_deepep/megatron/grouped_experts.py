"""Experts that read no token counts on the host: `GroupedMMExperts` runs a layer's experts as
two `torch._grouped_mm` GEMMs over the dispatcher's expert-major rows, so a forward and backward
can be captured in one CUDA graph with the sync-free dispatch; `with_grouped_mm_experts` puts
them into a Megatron layer spec (`examples/pretrain_gpt_moe.py`, `MDEEP_GROUPED_MM_EXPERTS`).
"""

from __future__ import annotations

import torch


class GroupedMMExperts(torch.nn.Module):
    """Experts as two grouped GEMMs (`torch._grouped_mm`) whose group offsets stay on the GPU.

    Takes `MoELayer`'s experts call: `(rows [M, H], tokens_per_expert [E_local] (CPU or GPU),
    permuted_probs [M])` -> `(out [M, H], None)`; fc1 `[E_local, H, F or 2F]` (gated: SwiGLU-style
    with `config.activation_func`), the probs applied after the activation (as Megatron's
    experts do), fc2 `[E_local, F, H]`. No host read of the counts, so a CUDA graph can hold it
    (Megatron's `TEGroupedMLP` / `SequentialMLP` call `tokens_per_expert.tolist()`).

    Args:
        num_local_experts: E_local.
        config: the TransformerConfig (hidden_size, moe_ffn_hidden_size, gated_linear_unit,
            activation_func, params_dtype, init_method_std, use_cpu_initialization).
        pg_collection, name: accepted for megatron-core's experts builders (unused).
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None, name=None, **unused):
        super().__init__()
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        self.gated = bool(config.gated_linear_unit)
        self.activation = config.activation_func
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() \
            else torch.cuda.current_device()
        std = config.init_method_std
        fc1 = torch.empty(num_local_experts, hidden, ffn * (2 if self.gated else 1),
                          dtype=config.params_dtype, device=device)
        fc2 = torch.empty(num_local_experts, ffn, hidden, dtype=config.params_dtype,
                          device=device)
        self.weight1 = torch.nn.Parameter(fc1.normal_(0, std))
        self.weight2 = torch.nn.Parameter(fc2.normal_(0, std))
        # As Megatron's expert linears: under EP > 1 each rank holds other experts, so their
        # gradients are reduced over the expert data-parallel group, not the whole DP group.
        expert_groups = (getattr(config, "expert_model_parallel_size", 1) > 1
                         or getattr(config, "expert_tensor_parallel_size", None)
                         not in (None, getattr(config, "tensor_model_parallel_size", 1)))
        for weight in (self.weight1, self.weight2):
            weight.allreduce = not expert_groups

    def forward(self, rows, tokens_per_expert, permuted_probs, *args, **kwargs):
        offs = torch.cumsum(tokens_per_expert.to(rows.device), 0).to(torch.int32)
        h = torch._grouped_mm(rows, self.weight1, offs=offs)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.activation(gate) * up
        else:
            h = self.activation(h)
        h = (h * permuted_probs.unsqueeze(-1)).to(rows.dtype)
        return torch._grouped_mm(h, self.weight2, offs=offs), None


def with_grouped_mm_experts(spec, device):
    """A layer spec whose `SequentialMLP` experts are `GroupedMMExperts`, where they can run.

    `SequentialMLP` runs each local expert's MLP in a Python loop (forward and backward), so a
    layer of many small experts is bound by the host (hundreds of kernel launches per layer);
    `GroupedMMExperts` makes it two grouped GEMMs. Same routed computation (SwiGLU or the
    config's activation, probs applied after it); its weights are two `[E_local, ...]`
    parameters, so checkpoints are not interchangeable with `SequentialMLP`'s.

    Args:
        spec: a layer, decoder block or MoE module spec (megatron-core 0.16 `ModuleSpec`s or
            the 0.17+ `functools.partial` builders).
        device: where the experts will run (`grouped_mm_reason` is checked there).

    Returns:
        `(spec, note)`: the new spec and what was done, or the spec unchanged and why (no
        `SequentialMLP` in it, or `torch._grouped_mm` fails here).
    """
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_deepep.megatron.te_experts import replace_classes

    new = replace_classes(spec, {SequentialMLP: GroupedMMExperts})
    if new is spec:
        return spec, "the spec has no SequentialMLP experts (already grouped): unchanged"
    reason = grouped_mm_reason(device)
    if reason:
        return spec, f"kept SequentialMLP: {reason}"
    return new, "SequentialMLP -> GroupedMMExperts (torch._grouped_mm)"


def grouped_mm_reason(device) -> str:
    """Why `GroupedMMExperts` cannot run on `device` ("" if it can): forward and backward of
    one small call with uneven groups (sizes 5, 0, 35: no alignment), checked against a loop
    over the groups."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        gen = torch.Generator(device=device).manual_seed(1)
        rows = torch.randn(40, 64, device=device, generator=gen).bfloat16().requires_grad_(True)
        weight = torch.randn(3, 64, 32, device=device, generator=gen).bfloat16()
        weight.requires_grad_(True)
        offs = torch.tensor([5, 5, 40], dtype=torch.int32, device=device)
        out = torch._grouped_mm(rows, weight, offs=offs)
        out.float().square().sum().backward()
        starts = [0, 5, 5]
        want = torch.cat([rows[a:b].float() @ weight[e].float()
                          for e, (a, b) in enumerate(zip(starts, offs.tolist()))])
        want_grad = torch.cat([2 * want[a:b] @ weight[e].float().t()
                               for e, (a, b) in enumerate(zip(starts, offs.tolist()))])
        want_wgrad = torch.stack([rows[a:b].float().t() @ (2 * want[a:b])
                                  for a, b in zip(starts, offs.tolist())])
        for name, got, ref in (("forward", out, want), ("input grad", rows.grad, want_grad),
                               ("weight grad", weight.grad, want_wgrad)):
            rel = ((got.float() - ref).norm() / ref.norm()).item()
            if not rel < 2e-2:
                return f"torch._grouped_mm {name} is off by {rel:.3g} (relative) here"
    except Exception as exc:  # e.g. no kernel for this GPU or for the CPU in this torch
        return f"torch._grouped_mm fails here: {type(exc).__name__}: {exc}"[:300]
    return ""
