"""Argument checks shared by every transport: each error names the argument and the limit."""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist

MAX_TOPK = 16
MAX_LOCAL_EXPERTS = 256
MAX_RANKS = 8
ROW_ALIGN_BYTES = 16
#: Row dtypes every transport moves (dispatch copies bytes; combine sums in fp32).
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROW_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def check_row_dtype(name: str, dtype) -> torch.dtype:
    """`dtype` if it is a row dtype (bf16, fp16, fp32), else ValueError naming `name`."""
    if dtype not in ROW_DTYPES:
        raise ValueError(f"{name} must be one of {[str(d) for d in ROW_DTYPES]}, got {dtype!r}")
    return dtype


def check_int(name: str, value, *, low: int, high: Optional[int] = None) -> int:
    """Raises ValueError unless `value` is an int (not a bool) in `[low, high]`; returns it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        limit = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {limit}, got {value!r}")
    return value


def check_bool(name: str, value) -> bool:
    """Raises ValueError unless `value` is a bool; returns it."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_timeout(name: str, value) -> float:
    """Raises ValueError unless `value` is a finite number of seconds > 0; returns it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def check_group(group):
    """The EP process group to use: `group`, or the default group for None.

    Raises:
        ValueError: torch.distributed is not initialized, or `group` is not a process group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "group: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first (one process on CPU: "
            "init_process_group('gloo', init_method='tcp://127.0.0.1:29500', rank=0, "
            "world_size=1)) and pass its EP group (None: the default group)")
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed.ProcessGroup (or None for the "
                         f"default group), got {type(group).__name__}")
    return group


def check_tensor(name: str, t, *, ndim: int, dtypes: Iterable[torch.dtype],
                 device: Optional[torch.device] = None) -> None:
    """Raises ValueError unless `t` is a contiguous tensor of the given rank, dtype and device."""
    dtypes = tuple(dtypes)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, but this Buffer lives on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()})")


def check_hidden(name: str, hidden: int, element_size: int, max_row_bytes: int,
                 buffer_rows: str = "") -> None:
    """Checks the row width against the 16-byte vector rule and the Buffer's row size.

    Args:
        name: the argument, for the message.
        hidden: elements per row.
        element_size: bytes per element (2 for bf16 / fp16, 4 for fp32).
        max_row_bytes: the bytes of the Buffer's rows (its `hidden` x its dtype's size).
        buffer_rows: how the Buffer was declared, e.g. "hidden=7168, dtype=torch.bfloat16",
            for the message.
    """
    if hidden * element_size % ROW_ALIGN_BYTES != 0:
        raise ValueError(
            f"{name}: hidden={hidden} gives rows of {hidden * element_size} bytes; rows must be a "
            f"multiple of {ROW_ALIGN_BYTES} bytes (hidden a multiple of "
            f"{ROW_ALIGN_BYTES // element_size})")
    if hidden * element_size > max_row_bytes:
        declared = f" ({buffer_rows})" if buffer_rows else ""
        raise ValueError(
            f"{name}: rows of {hidden} elements of {element_size} bytes are "
            f"{hidden * element_size} bytes, more than the Buffer's rows of {max_row_bytes} "
            f"bytes{declared}; build the Buffer with the dtype of these rows (dtype=) and a "
            f"hidden of at least {hidden}")


def check_fp8_input(x) -> None:
    """FP8 dispatch quantizes bf16 rows (TE's input rule): any other dtype is refused by name."""
    if isinstance(x, torch.Tensor) and x.dtype != torch.bfloat16:
        raise ValueError(
            f"x must have dtype torch.bfloat16 for FP8 dispatch (fp8=... quantizes bf16 rows), "
            f"got {x.dtype}; cast x to bfloat16 first, or dispatch without fp8 ({x.dtype} rows "
            f"travel as they are)")


def check_num_experts(num_experts, num_ranks: int) -> int:
    """Checks E against the rank count and the per-rank expert limit; returns E_local."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts={num_experts} must be a multiple of the EP size ({num_ranks})")
    num_local = num_experts // num_ranks
    if num_local > MAX_LOCAL_EXPERTS:
        raise ValueError(
            f"num_experts={num_experts} gives {num_local} experts per rank; the limit is "
            f"{MAX_LOCAL_EXPERTS}")
    return num_local


def check_num_tokens(name: str, num_tokens: int, max_tokens: int) -> None:
    """Refuses more tokens in one call than the Buffer was built for, naming `get_buffer`."""
    if num_tokens > max_tokens:
        raise ValueError(
            f"{name} has {num_tokens} tokens, more than the Buffer's num_max_tokens_per_rank="
            f"{max_tokens}: build the Buffer for the most tokens a call sends, or take it from "
            f"get_buffer(group, num_tokens, hidden, num_topk), which grows to each call")


def check_num_topk(num_topk: int, max_topk: int) -> None:
    """Refuses a top-k outside [1, the Buffer's num_topk] (and MAX_TOPK)."""
    if not 1 <= num_topk <= min(max_topk, MAX_TOPK):
        raise ValueError(
            f"topk_idx has top-k={num_topk}; the limit is {min(max_topk, MAX_TOPK)} (the Buffer "
            f"was declared with num_topk={max_topk})")


def check_routing(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                  max_topk: int, device: torch.device) -> None:
    """Checks the routing tensors against `x` and the Buffer's top-k (its token limit:
    `check_num_tokens` on `x`)."""
    check_tensor("topk_idx", topk_idx, ndim=2, dtypes=(torch.int32, torch.int64), device=device)
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,), device=device)
    num_tokens, num_topk = topk_idx.shape
    if num_tokens != x.shape[0]:
        raise ValueError(f"topk_idx has {num_tokens} rows but x has {x.shape[0]} tokens")
    if tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_idx shape "
            f"{tuple(topk_idx.shape)}")
    check_num_topk(num_topk, max_topk)


def check_expert_ids_on_host(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Host-side range check of expert ids (synchronizes; used where a sync happens anyway)."""
    if topk_idx.numel() == 0:
        return
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"topk_idx holds expert id {bad}, outside [-1, num_experts={num_experts})")


def check_alignment(expert_alignment) -> None:
    check_int("expert_alignment", expert_alignment, low=1, high=1024)


def check_fp8_hidden(name: str, hidden: int, max_hidden: int) -> None:
    """FP8 rows are `hidden` e4m3 bytes: they must be a multiple of 16 bytes; FP8 dispatch
    takes bf16 rows, so `hidden` is at most the Buffer's rows in bf16 elements
    (`max_hidden`)."""
    if hidden % ROW_ALIGN_BYTES != 0:
        raise ValueError(
            f"{name}: FP8 dispatch needs hidden % {ROW_ALIGN_BYTES} == 0 (e4m3 rows of hidden "
            f"bytes must be a multiple of {ROW_ALIGN_BYTES} bytes), got hidden={hidden}")
    if hidden > max_hidden:
        raise ValueError(f"{name}: FP8 dispatch of bf16 rows of {hidden} elements; the Buffer's "
                         f"rows hold {max_hidden} bf16 elements ({2 * max_hidden} bytes)")


def check_fp8_pair(x, fmt, *, device: Optional[torch.device] = None):
    """Checks a pre-quantized `(x_fp8, x_scales)` pair against the wire format `fmt`.

    Args:
        x: a tuple or list `(x_fp8 [N, H] torch.float8_e4m3fn, x_scales [N, fmt.num_blocks(H)]
            fmt.scale_dtype)`.
        fmt: the `Fp8Format` that says how to read the scales.
        device: the Buffer's device (None: the data's own device).

    Returns:
        `(x_fp8, x_scales)`.
    """
    if len(x) != 2:
        raise ValueError(f"a pre-quantized x must be a pair (x_fp8, x_scales), got {len(x)} items")
    x_fp8, x_scales = x
    check_tensor("x_fp8", x_fp8, ndim=2, dtypes=(torch.float8_e4m3fn,), device=device)
    num_tokens, hidden = x_fp8.shape
    want = (num_tokens, fmt.num_blocks(hidden))
    if not isinstance(x_scales, torch.Tensor) or tuple(x_scales.shape) != want:
        got = tuple(x_scales.shape) if isinstance(x_scales, torch.Tensor) else type(x_scales)
        raise ValueError(
            f"x_scales must have shape [N, ceil(H / {fmt.block_size})] = {list(want)} for "
            f"{fmt.name}, got {got}")
    check_tensor("x_scales", x_scales, ndim=2, dtypes=(fmt.scale_dtype,),
                 device=x_fp8.device if device is None else device)
    return x_fp8, x_scales


def check_x_sequence(x, has_fp8: bool) -> None:
    """`x` given as a tuple or list must be a pre-quantized pair of tensors, with `fp8=` set."""
    items = list(x)
    if len(items) != 2 or not all(isinstance(t, torch.Tensor) for t in items):
        kinds = ", ".join(type(t).__name__ for t in items[:4]) + (", ..." if len(items) > 4 else "")
        raise ValueError(
            f"x must be a torch.Tensor [N, H] or, with fp8=, a pre-quantized x, which must be a "
            f"pair (x_fp8, x_scales) of 2 tensors; got a {type(x).__name__} of {len(items)} "
            f"items ({kinds})")
    if not has_fp8:
        raise ValueError(
            "x is a pair of tensors, i.e. a pre-quantized (x_fp8, x_scales): pass "
            "fp8=Fp8Dispatch(...) (e.g. fp8=Fp8Dispatch.named('blockwise')) so the scales can "
            "be read")


def check_handle(handle, *, hidden: int, num_topk: int, num_ranks: int,
                 max_tokens: int) -> None:
    """Checks a dispatch handle against the Buffer it is given to."""
    from megatron_deepep.handle import DispatchHandle

    if not isinstance(handle, DispatchHandle):
        raise ValueError(f"handle must be the DispatchHandle a dispatch returned, got "
                         f"{type(handle).__name__}")
    if handle.layout.num_ranks != num_ranks:
        raise ValueError(f"handle was made on an EP group of {handle.layout.num_ranks} ranks; "
                         f"this Buffer's group has {num_ranks}")
    for name, value, limit in (("hidden", handle.hidden, hidden),
                               ("num_topk", handle.num_topk, num_topk),
                               ("num_max_tokens_per_rank", handle.num_tokens, max_tokens)):
        if value > limit:
            raise ValueError(f"handle was made for {name}={value}, more than this Buffer's "
                             f"{name}={limit}")


def check_layout(layout, *, num_tokens: int, num_experts: int, num_ranks: int) -> None:
    """Checks a `get_dispatch_layout` result against the dispatch it is given to."""
    from megatron_deepep.layout import DispatchLayout

    if not isinstance(layout, DispatchLayout):
        raise ValueError(f"layout must be the DispatchLayout get_dispatch_layout returned, got "
                         f"{type(layout).__name__}")
    got = (layout.num_tokens, layout.shape_of("num_tokens_per_expert")[0], layout.num_ranks)
    if got != (num_tokens, num_experts, num_ranks):
        raise ValueError(
            f"layout was computed for (tokens, num_experts, ranks) = {got}, this dispatch has "
            f"{(num_tokens, num_experts, num_ranks)}")
