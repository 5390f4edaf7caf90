"""`python -m megatron_deepep.bench.network`: the network leg's own cost per byte, on this GPU.

Starts nodes x ranks-per-node processes that share the GPU as virtual nodes (gloo control plane,
NVSHMEM heap through torch's symmetric memory). Every round each PE in turn puts `size` bytes to
the PE with the same local index on the next node (`internode_leg.internode_leg_send`, the internode
transport's pattern: its CUDA-event time is what is measured, with no other process's kernel
beside it), then every PE waits for its own incoming slot (`internode_leg.internode_leg_wait`). The
median time at each size gives GB/s per PE, and the smallest size the fixed cost; both go to
a JSON file that `python -m megatron_deepep.tools.internode_model --measured-json` takes in place of
its assumed network rate.

On one GPU every put takes NVSHMEM's P2P path (a copy inside the GPU), so this measures our
kernels' per-byte cost, not InfiniBand: that needs two real nodes (one process per GPU there).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

logger = logging.getLogger(__name__)

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT_NS = 60 * 10**9


def _send_us(internode_leg, recv, send, signals, peer, blocks, errors) -> float:
    """CUDA-event µs of one send kernel (its puts and their completion)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    internode_leg.internode_leg_send(recv, send, signals, peer, blocks, errors)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def _worker(rank: int, args, port: int, queue) -> None:
    os.environ.update(MULTICAST_OFF)
    from megatron_deepep import ops
    from megatron_deepep.ops.bench import internode_leg
    from megatron_deepep.transport.errors import error_from_record
    from megatron_deepep.transport.nvshmem_heap import SymmetricHeap

    world = args.nodes * args.ranks_per_node
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.cuda.set_device(0)
    max_bytes = max(args.sizes_kib) * 1024
    heap = SymmetricHeap()
    recv = heap.zeros(world * max_bytes, torch.uint8)
    send_all = heap.empty(max_bytes, torch.uint8)
    signals = heap.zeros(world, torch.int64)
    claim = torch.zeros(1, dtype=torch.int32, device="cuda")
    record = torch.zeros(10, dtype=torch.int32, device="cuda")
    errors = ops.ErrorSink(claim.data_ptr(), record.data_ptr())
    info = torch.zeros(2, dtype=torch.int64, device="cuda")
    node, local = divmod(rank, args.ranks_per_node)
    peer = ((node + 1) % args.nodes) * args.ranks_per_node + local
    source = ((node - 1) % args.nodes) * args.ranks_per_node + local
    torch.cuda.synchronize()
    dist.barrier()
    rounds, results = 0, {}
    for size_kib in args.sizes_kib:
        send = send_all[:size_kib * 1024]  # PE p's slot in `recv` is [p * size, (p + 1) * size)
        times = []
        for i in range(args.warmup + args.rounds):
            rounds += 1
            # PEs take turns: the processes share one GPU, and a kernel of another process
            # running beside the timed one would be timed too.
            for turn in range(world):
                if turn == rank:
                    us = _send_us(internode_leg, recv, send, signals, peer, args.blocks, errors)
                dist.barrier()
            internode_leg.internode_leg_wait(signals, source, rounds * args.blocks, TIMEOUT_NS,
                                             errors,
                                   info)
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(us)
        error = error_from_record(record.cpu().numpy(), TIMEOUT_NS / 1e9)
        if error is not None:
            raise error
        results[size_kib] = statistics.median(times)
    dist.barrier()
    queue.put((rank, results))
    dist.destroy_process_group()


def run(args) -> dict:
    """Measures every size; returns the JSON document (see the module docstring)."""
    world = args.nodes * args.ranks_per_node
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, args, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    per_rank = {}
    while not queue.empty():
        rank, results = queue.get()
        per_rank[rank] = results
    if len(per_rank) != world:
        raise RuntimeError(f"{world - len(per_rank)} of {world} processes failed (exit codes "
                           f"{[p.exitcode for p in procs]})")
    return summarize(per_rank, args, torch.cuda.get_device_name(0))


# What ran: no Buffer and no fallback, the internode transport's network leg kernels alone.
TRANSPORT = "internode (network leg: NVSHMEM puts, ops.bench.internode_leg send / wait)"


def summarize(per_rank: dict, args, device_name: str) -> dict:
    """The JSON document from every rank's {size KiB: median µs}: per size the median rank's
    µs and GB/s, and the transport that ran."""
    world = args.nodes * args.ranks_per_node
    sizes = {}
    for size_kib in args.sizes_kib:
        us = statistics.median(per_rank[r][size_kib] for r in range(world))
        sizes[str(size_kib)] = {"us": us, "gbps": size_kib * 1024 / us / 1e3}
    largest, smallest = sizes[str(max(args.sizes_kib))], sizes[str(min(args.sizes_kib))]
    return {"source": f"bench_network on {device_name}, {args.nodes} x "
                      f"{args.ranks_per_node} virtual nodes (P2P path, one GPU)",
            "transport": TRANSPORT, "network_gbps": largest["gbps"],
            "fixed_us": smallest["us"], "sizes_kib": sizes}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="virtual nodes (processes / ranks"
                        " per node)")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="PEs per virtual node")
    parser.add_argument("--sizes-kib", default="4,256,4096,65536",
                        help="bytes per PE per round, in KiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds per size")
    parser.add_argument("--blocks", type=int, default=24, help="blocks of the send kernel "
                        "(its SM budget)")
    parser.add_argument("--out", default="bench_network.json", help="JSON file to write")
    args = parser.parse_args(argv)
    args.sizes_kib = [int(v) for v in args.sizes_kib.split(",") if v.strip()]
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        sys.stderr.write("megatron_deepep.bench.network needs a CUDA GPU with NVSHMEM (torch "
                         "built for CUDA 13); on a CPU machine run the tests instead (from the "
                         "repository root): pip install torch==2.13.0 -e \".[jit,test,megatron]\" "
                         "&& python -m pytest -q -rs tests\n")
        raise SystemExit(2)
    doc = run(args)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    lines = [f"{'KiB per PE':>10} {'µs per round':>13} {'GB/s per PE':>12}"]
    lines += [f"{k:>10} {v['us']:>13.1f} {v['gbps']:>12.1f}" for k, v in doc["sizes_kib"].items()]
    sys.stdout.write("\n".join(lines) + f"\n{doc['source']}; transport {doc['transport']}; "
                     f"written to {args.out}\n")


if __name__ == "__main__":
    main()
