"""CPU tier: the persistent internode kernels go out as cooperative grids, and a grid the GPU
cannot hold at once is refused before launch, naming the SM budget (`jit.check_co_resident`).

The ring and network-ring kernels' blocks wait for each other; a block left unscheduled (NCCL,
TE userbuffers, a second Buffer or an overlapped call holding SMs) used to show as a 100 s
timeout that broke the Buffer. The driver here is a fake with a chosen occupancy.
"""

from __future__ import annotations

import pytest
import torch

from megatron_deepep import ops
from megatron_deepep.kernels import jit, nvshmem_link

driver = pytest.importorskip("cuda.bindings.driver")


def test_a_grid_within_the_gpu_passes():
    jit.check_co_resident("k", grid=132, blocks_per_sm=1, num_device_sms=132)
    jit.check_co_resident("k", grid=200, blocks_per_sm=2, num_device_sms=132)


def test_a_grid_past_the_gpu_is_refused_naming_the_sm_budget():
    with pytest.raises(jit.CoResidencyError) as exc:
        jit.check_co_resident("internode_ring_dispatch<8>", grid=140, blocks_per_sm=1,
                              num_device_sms=132)
    message = str(exc.value)
    for part in ("internode_ring_dispatch<8>", "140 blocks", "at most 132", "1 per SM",
                 "132 SMs", "num_sms", "MDEEP_NUM_SMS"):
        assert part in message, (part, message)


class _FakeDriver:
    """The driver calls `Kernel.launch` makes, with `blocks_per_sm` occupancy on `sms` SMs."""

    def __init__(self, blocks_per_sm: int, sms: int):
        self.blocks_per_sm, self.sms = blocks_per_sm, sms
        self.launches = []  # (grid, attribute ids)
        self.occupancy_queries = 0

    def install(self, monkeypatch):
        monkeypatch.setattr(driver, "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                            self.occupancy)
        monkeypatch.setattr(driver, "cuDeviceGet", lambda index: (0, index))
        monkeypatch.setattr(driver, "cuDeviceGetAttribute", lambda attr, dev: (0, self.sms))
        monkeypatch.setattr(driver, "cuLaunchKernelEx", self.launch_ex)
        monkeypatch.setattr(driver, "cuLaunchKernel", self.launch)
        monkeypatch.setattr(jit._contexts_checked, "done", True, raising=False)

    def occupancy(self, function, block, shared_mem):
        self.occupancy_queries += 1
        return 0, self.blocks_per_sm

    def launch_ex(self, config, function, params, extra):
        self.launches.append((config.gridDimX, [int(a.id) for a in config.attrs[:config.numAttrs]]))
        return (0,)

    def launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.launches.append((gx, []))
        return (0,)


class _Args:
    kernel_params = 0


COOPERATIVE = int(driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE)


def test_cooperative_launch_carries_the_attribute_and_checks_occupancy(monkeypatch):
    fake = _FakeDriver(blocks_per_sm=1, sms=4)
    fake.install(monkeypatch)
    kernel = jit.Kernel("ring", function=0, device_index=0)
    stream = jit.RawStream(0, 0)
    kernel.launch(4, 512, _Args(), stream, cooperative=True)
    kernel.launch(3, 512, _Args(), stream, cooperative=True)
    assert fake.launches == [(4, [COOPERATIVE]), (3, [COOPERATIVE])]
    assert fake.occupancy_queries == 1  # cached per launch shape
    with pytest.raises(jit.CoResidencyError, match="at most 4"):
        kernel.launch(5, 512, _Args(), stream, cooperative=True)
    assert len(fake.launches) == 2  # refused before launch: nothing left spinning
    kernel.launch(5, 512, _Args(), stream)  # the same grid, not cooperative: a plain launch
    assert fake.launches[-1] == (5, [])


class _KernelLog:
    def __init__(self):
        self.launches = []

    def get_kernels(self, source, family, device):
        log = self

        class _Kernels(dict):
            def __missing__(self, expr):
                class _Kernel:
                    def launch(self, grid, block, args, stream, shared_mem=0,
                               programmatic=False, cooperative=False):
                        log.launches.append((expr.split("<")[0], cooperative))
                return _Kernel()
        return _Kernels()


def test_the_persistent_internode_kernels_launch_cooperatively(monkeypatch):
    log = _KernelLog()
    monkeypatch.setattr(nvshmem_link, "get_kernels", log.get_kernels)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(ops.internode.InternodeArgs, "fill", classmethod(lambda cls, **f: None))
    monkeypatch.setattr(ops.internode.args, "launch_stream", lambda: None)
    topk = torch.zeros(4, 8, dtype=torch.int64)
    y = torch.zeros(4, 16, dtype=torch.bfloat16)
    fields = {"ranks_per_node": 2}
    ops.internode_ring_dispatch(topk, False, None, 8, fields)
    ops.internode_ring_combine(topk, y, False, False, 8, fields)
    ops.internode_net_dispatch(topk, False, None, 8, fields)
    ops.internode_net_combine(topk, y, False, False, 8, fields)
    ops.internode_ring_count(topk, None, 2, fields)
    ops.internode_dispatch_send(topk, False, None, 8, fields)
    assert log.launches == [
        ("internode_ring_dispatch", True), ("internode_ring_combine", True),
        ("internode_net_dispatch", True), ("internode_net_combine", True),
        ("internode_ring_count", False), ("internode_dispatch_send", False)]
