"""The same MoELayer at EP = R equals it at EP = 1 on the same tokens and weights (a worker).

Each of R gloo ranks first runs the layer at EP = 1 (all experts local) on its own tokens, then
at EP = R (its block of experts, the same weights), and compares the outputs, the input and
router gradients (per rank) and each expert's weight gradient (at EP = 1 summed over the ranks:
at EP = R the expert's owner sees every rank's tokens). tests/megatron/test_parity_matrix.py runs
it on
2 gloo ranks with the reference transport; tests/gpu/test_parity_ep_gpu.py on the kernels (local
at EP = 1, NVLink at EP = R, R processes sharing the GPU).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch


pytest.importorskip("megatron.core")

NUM_EXPERTS = 24  # divisible by every EP size tested (1, 2, 3, 4, 6, 8)
OVERRIDES = dict(num_moe_experts=NUM_EXPERTS, moe_router_topk=4)
_EXPERT = re.compile(r"(experts\.local_experts\.)(\d+)(\..*)")


def _global_state(state, rank, num_local):
    """An EP = 1 state dict as EP rank `rank` holds it: its block of experts, renumbered."""
    out = {}
    for key, value in state.items():
        m = _EXPERT.match(key)
        if m is None:
            out[key] = value
            continue
        e = int(m.group(2))
        if rank * num_local <= e < (rank + 1) * num_local:
            out[f"{m.group(1)}{e - rank * num_local}{m.group(3)}"] = value
    return out


def _drop_buffers():
    """Frees every `get_buffer` Buffer of this process (collective for NVLink ones)."""
    from megatron_deepep import buffer as buffer_module

    for buf in buffer_module._BUFFERS.values():
        buf.destroy()
    buffer_module._BUFFERS.clear()


def ep_worker(rank, world, dtype_name, device, transport):
    """Runs EP = 1 then EP = world on this rank's tokens; asserts they agree."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from tests.megatron import test_parity_matrix as matrix
    from tests.helpers.distributed import cpu_group

    if device == "cpu":
        matrix._install_cpu_stand_ins()
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps

    mdm.register_deepep_dispatcher(transport=transport)
    dtype = matrix._DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(300 + rank)
    tokens = 5 + 4 * rank
    x = torch.randn(tokens, 2, matrix.H, generator=gen).to(dtype).to(device)
    grad = torch.randn(tokens, 2, matrix.H, generator=gen).to(dtype).to(device)

    _drop_buffers()  # Buffers of earlier groups in this process
    ps.initialize_model_parallel(expert_model_parallel_size=1)
    torch.manual_seed(1234)  # the same weights on every rank
    single = matrix._layer("deepep", 1, OVERRIDES, dtype, {}, device)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v
             for k, v in single.state_dict().items()}
    out1, gx1, grads1 = matrix._run(single, [x], [grad])
    ps.destroy_model_parallel()
    _drop_buffers()  # a new group object may reuse an old one's id()
    num_local = NUM_EXPERTS // world
    for name in list(grads1):  # each expert's gradient over every rank's tokens
        if name.startswith("experts."):
            total = grads1[name].float().cpu()  # gloo: fp32 on the host
            dist.all_reduce(total, group=cpu_group())
            grads1[name] = total.to(device=device, dtype=grads1[name].dtype)

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    layer = matrix._layer("deepep", world, OVERRIDES, dtype, {}, device)
    layer.load_state_dict(_global_state(state, rank, num_local))
    outr, gxr, gradsr = matrix._run(layer, [x], [grad])
    ps.destroy_model_parallel()
    _drop_buffers()

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outr[0], out1[0], **tol, msg="output")
    torch.testing.assert_close(gxr[0], gx1[0], **tol, msg="input grad")
    checked = 0
    for name, got in gradsr.items():
        m = _EXPERT.match(name)  # local expert j of this rank is expert rank * E_local + j
        ref_name = name if m is None else (
            f"{m.group(1)}{int(m.group(2)) + rank * num_local}{m.group(3)}")
        torch.testing.assert_close(got, grads1[ref_name], **tol, msg=name)
        checked += 1
    assert checked == len(gradsr) and any("router" in n for n in gradsr)
