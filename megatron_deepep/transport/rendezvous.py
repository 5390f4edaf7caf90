"""The host-side exchanges of a transport's set-up, each with the Buffer's timeout.

`dist.all_gather_object` waits as long as the backend lets it (gloo: until the peer's process
exits, or 30 minutes): a rank whose peer never builds its Buffer would hang there. Here every
rank puts its object into the default group's store under a key of its own and waits at most
`timeout_s` for the others' keys; a wait that expires raises `PeerTimeoutError` naming the
ranks whose keys never came. Ranks build their transports in the same order, so the i-th
exchange on a group has the same keys everywhere.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Dict, List

import torch.distributed as dist

from megatron_deepep.transport.errors import PeerTimeoutError

_calls: Dict[str, int] = {}  # group name -> exchanges made on it by this process


def gather_objects(obj, group, *, timeout_s: float, what: str) -> List[object]:
    """Every rank's `obj` (picklable), in rank order: `all_gather_object` with a timeout.

    Args:
        obj: this rank's object.
        group: the process group (None: the default group); every rank of it must call.
        timeout_s: how long to wait for the other ranks.
        what: the exchange, for the error ("the transport choice").

    Raises:
        PeerTimeoutError: a rank did not arrive within `timeout_s`; names it.
    """
    num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_ranks == 1:
        return [obj]
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no store (an unusual init): the collective, without a timeout
        gathered: List[object] = [None] * num_ranks
        dist.all_gather_object(gathered, obj, group=group)
        return gathered
    name = (group or dist.group.WORLD).group_name
    _calls[name] = _calls.get(name, 0) + 1
    keys = [f"megatron_deepep/rendezvous/{name}/{_calls[name]}/{r}" for r in range(num_ranks)]
    store.set(keys[rank], pickle.dumps(obj))
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError:  # the store's timeout (DistStoreError)
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        missing = [f"rank {r} (global {ranks[r]})" for r in range(num_ranks)
                   if not store.check([keys[r]])]
        raise PeerTimeoutError(
            f"megatron_deepep: rank {rank} of {num_ranks} waited {timeout_s:g} s (the Buffer's "
            f"timeout_s) in {what} for {', '.join(missing) or 'its peers'}: every rank of the "
            f"EP group must build the Buffer") from None
    return [pickle.loads(store.get(key)) for key in keys]
