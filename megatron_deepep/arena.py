"""Many small device arrays in one allocation, their tensor views made only when read.

A dispatch needs about fifteen small index arrays (layout, receive offsets, slot rows). Making
each one a torch tensor (allocation, split, view, reshape) cost more host time than the kernels
take at small shapes, and the kernels only need addresses. An `ArenaPlan` fixes the arrays'
names, shapes and offsets once per shape; `ArenaPlan.allocate` makes one int32 tensor; kernels
take `Arena.address(name)` (integer arithmetic) and Python code reads `Arena.view(name)`.

Dataclasses whose tensor fields live in an arena (`DispatchLayout`, `RecvLayout`,
`DispatchHandle`) inherit `ArenaFields`: built with `from_arena`, a field becomes a tensor the
first time it is read, and `address` gives its device address without making it.
"""

from __future__ import annotations

import math
from typing import Dict, Sequence, Tuple

import torch

_WORD = 4           # bytes of an int32 word
_ALIGN_WORDS = 4    # every array starts on a 16-byte boundary


class ArenaPlan:
    """Names, shapes and word offsets of the arrays of one arena.

    Args:
        fields: `(name, shape, dtype)` per array; dtype torch.int32 or torch.bool (one byte per
            element, rounded up to whole words).
    """

    def __init__(self, fields: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]]):
        self.fields: Dict[str, Tuple[int, Tuple[int, ...], torch.dtype]] = {}
        offset = 0
        for name, shape, dtype in fields:
            if dtype not in (torch.int32, torch.bool):
                raise TypeError(f"arena field {name}: dtype {dtype} is not int32 or bool")
            numel = math.prod(shape)
            num_words = numel if dtype == torch.int32 else -(-numel // _WORD)
            self.fields[name] = (offset, tuple(shape), dtype)
            offset += -(-num_words // _ALIGN_WORDS) * _ALIGN_WORDS
        self.num_words = max(offset, 1)
        self.byte_offsets = {name: off * _WORD for name, (off, _, _) in self.fields.items()}

    def allocate(self, device) -> "Arena":
        """One uninitialized int32 allocation holding every array (the kernels write them)."""
        return Arena(self, torch.empty(self.num_words, dtype=torch.int32, device=device))


class Arena:
    """One allocation of an `ArenaPlan`: addresses for kernels, views for Python."""

    __slots__ = ("plan", "tensor", "base")

    def __init__(self, plan: ArenaPlan, tensor: torch.Tensor):
        self.plan, self.tensor, self.base = plan, tensor, tensor.data_ptr()

    def __contains__(self, name: str) -> bool:
        return name in self.plan.fields

    def address(self, name: str) -> int:
        """The device address of array `name` (no tensor is made)."""
        return self.base + self.plan.byte_offsets[name]

    def view(self, name: str) -> torch.Tensor:
        """Array `name` as a tensor of its shape and dtype, sharing the arena's memory."""
        offset, shape, dtype = self.plan.fields[name]
        numel = math.prod(shape)
        if dtype == torch.int32:
            return self.tensor[offset:offset + numel].view(shape)
        data = self.tensor.view(torch.uint8)[offset * _WORD:offset * _WORD + numel]
        return data.view(dtype).view(shape)


class ArenaFields:
    """Mixin for dataclasses whose tensor fields may live in an `Arena` (see module doc)."""

    @classmethod
    def from_arena(cls, arena: Arena, **fields):
        """An instance whose fields named in `arena` are read from it on first access; the
        other fields come from `fields`."""
        obj = cls.__new__(cls)
        obj.__dict__.update(fields)
        obj.__dict__["_arena"] = arena
        return obj

    def __getattr__(self, name: str):
        # Reached only for attributes not set yet: an arena field read for the first time.
        arena = self.__dict__.get("_arena")
        if arena is None or name not in arena:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = arena.view(name)
        self.__dict__[name] = value
        return value

    def shape_of(self, name: str) -> Tuple[int, ...]:
        """The shape of tensor field `name`, read from the plan when no view exists yet."""
        arena = self.__dict__.get("_arena")
        if name not in self.__dict__ and arena is not None and name in arena:
            return arena.plan.fields[name][1]
        return tuple(getattr(self, name).shape)

    def address(self, name: str) -> int:
        """The device address of tensor field `name` (0 for None), made without a view when it
        lives in an arena."""
        value = self.__dict__.get(name)
        if value is None:
            arena = self.__dict__.get("_arena")
            if arena is not None and name in arena:
                return arena.address(name)
            value = getattr(self, name)
        return 0 if value is None else value.data_ptr()
