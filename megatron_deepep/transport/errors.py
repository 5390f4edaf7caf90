"""Decoding of the kernels' error record (mirrors `cuda_src/common/error.cuh`)."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

ERROR_RECORD_WORDS = 10  # sizeof(ErrorRecord) = 40 bytes
CODE_TIMEOUT, CODE_BAD_EXPERT_ID, CODE_RANK_MISMATCH, CODE_RECV_OVERFLOW = 1, 2, 3, 4
CODE_PEER_UNREACHABLE, CODE_BAD_PEER_ROW, CODE_CONCURRENT_CALL = 5, 6, 7
PHASES = {0: "layout", 1: "notify", 2: "dispatch send (waiting for the peer to consume the "
          "previous dispatch)", 3: "dispatch receive", 4: "combine send (waiting for the peer to "
          "consume the previous combine)", 5: "combine reduce", 6: "network leg",
          7: "internode notify", 8: "internode dispatch send (waiting for the rail peer to "
          "consume the previous dispatch)", 9: "internode forward (waiting for the rail peer's "
          "rows or for node peers to consume the previous dispatch)", 10: "internode dispatch "
          "receive (waiting for this node's forwarders)", 11: "internode combine send (waiting "
          "for this node's forwarders to consume the previous combine)", 12: "internode combine "
          "forward (waiting for this node's partials or the source's acknowledgement)",
          13: "internode combine reduce (waiting for the rail peers' rows)",
          14: "internode ring count (waiting for the rail peer's rows)",
          15: "internode ring forward (waiting for ring space: the node peer has not consumed the "
          "rows this forwarder put ring_slots positions earlier)",
          16: "internode ring expand (waiting for the forwarder's next rows in its ring)",
          17: "internode ring combine send (waiting for ring space: the forwarder has not "
          "consumed the partials this rank put ring_slots positions earlier)",
          18: "internode ring combine forward (waiting for the node peer's next partials in its "
          "ring)", 19: "internode ring combine forward (waiting for the rail peer to acknowledge "
          "the previous combine)",
          20: "internode notify (waiting for the rail peer's per-rank token counts: network "
          "ring)", 21: "internode network ring send (waiting for a credit: the rail peer has not "
          "consumed the chunk this rank sent net_chunks chunks earlier)",
          22: "internode network ring forward (waiting for the rail peer's next chunk)",
          23: "internode network ring combine send (waiting for a credit: the source has not "
          "reduced the chunk this forwarder sent net_chunks chunks earlier)",
          24: "internode network ring reduce (waiting for the forwarder's next chunk)"}
# Phases whose waits are on ring positions (cuda_src/internode/ring.cuh), not epochs.
RING_PHASES = (15, 16, 17, 18)
# Phases whose waits are on network chunk numbers (cuda_src/internode/net_ring.cuh).
NET_RING_PHASES = (21, 22, 23, 24)
HEADER_FIELDS = {1: "hidden", 2: "top-k", 3: "num_experts", 4: "expert_alignment"}


class PeerTimeoutError(RuntimeError):
    """A cross-GPU wait expired: the named peer did not reach the same operation in time."""


def error_from_record(words: np.ndarray, timeout_s: float,
                      locate: Optional[Callable[[int], str]] = None):
    """Builds the exception for a non-zero record, or returns None.

    Args:
        words: the record as 10 int32 words (code, rank, peer, phase, detail, pad, expected lo/hi
            and seen lo/hi as int64 pairs).
        timeout_s: the Buffer's timeout (for the message).
        locate: where an EP rank sits (e.g. "node 1 local 2"), added to a timeout's message for
            the rank and its peer; None: nothing added.
    """
    code = int(words[0])
    if code == 0:
        return None
    rank, peer, phase, detail = (int(w) for w in words[1:5])
    expected, seen = (int(v) for v in words[6:10].view(np.int64))
    where = PHASES.get(phase, f"phase {phase}")
    if code == CODE_TIMEOUT and phase == 0:  # layout.cu: a chunk waits for earlier chunks
        return RuntimeError(
            f"megatron_deepep: rank {rank}'s layout kernel timed out after {timeout_s:g}s: its "
            f"token chunk {detail} never published its counts (waited for {expected}, saw "
            f"{seen}); another layout on the same stream workspace, or a scheduling fault")
    if code == CODE_TIMEOUT:
        # A ring wait waits for a word that counts ring positions (+ 1), a network ring wait
        # for one that counts chunks (+ 1); the others for epochs.
        what = ("ring word" if phase in RING_PHASES else
                "chunk word" if phase in NET_RING_PHASES else "epoch")
        return PeerTimeoutError(
            f"megatron_deepep: rank {rank} timed out after {timeout_s:g}s in {where}: peer {peer}"
            f" stalled (waited for {what} {expected}, saw {seen}). Every rank of the EP group must"
            " call the same operations in the same order."
            + (f" [rank {rank} is {locate(rank)}; peer {peer} is {locate(peer)}]"
               if locate is not None and peer >= 0 else ""))
    if code == CODE_BAD_EXPERT_ID:
        return ValueError(f"topk_idx holds expert id {seen} (token {detail}), outside "
                          f"[-1, num_experts={expected})")
    if code == CODE_RANK_MISMATCH:
        field = HEADER_FIELDS.get(detail, f"field {detail}")
        return ValueError(f"ranks disagree on {field}: rank {rank} has {expected}, rank {peer} "
                          f"has {seen}")
    if code == CODE_RECV_OVERFLOW:
        return ValueError(f"num_max_recv_rows={expected} is too small: rank {rank} receives "
                          f"{seen} rows (padding included)")
    if code == CODE_PEER_UNREACHABLE:
        return RuntimeError(
            f"megatron_deepep: rank {rank} cannot reach rank {peer} by load/store (NVLink P2P) "
            f"in {where}, though both are on one node of {detail} ranks: the node's GPUs must "
            "be NVLink peers; check num_ranks_per_node and the launch's ranks per node")
    if code == CODE_BAD_PEER_ROW:
        return RuntimeError(
            f"megatron_deepep: rank {rank} received from rank {peer} a slot record whose entry "
            f"{detail} names local expert {seen >> 32}, position {seen & 0xFFFFFFFF}: outside "
            f"the rows rank {peer} announced for that expert (of {expected} local experts); "
            "the ranks' routing or buffer state disagree, the rows were not written")
    if code == CODE_CONCURRENT_CALL:
        return RuntimeError(
            f"megatron_deepep: rank {rank} ran two calls of one Buffer at once, or two with the "
            f"same epoch ({seen}) in {where}: a CUDA-graph replay raced an eager call of the "
            "same Buffer. Launch replays on the stream of the eager calls, or order them with "
            "events (the graph's stream waits for the eager calls before replay() and they "
            "wait for it after)")
    return RuntimeError(f"megatron_deepep: kernel error code {code} on rank {rank}")
