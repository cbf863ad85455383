"""Output allocation for the kernels, with an opt-in poison mode for tests.

With ``poison(True)`` every output buffer a launcher allocates is filled with NaN (floats) or
a large negative sentinel (ints) before the kernel runs, so a row the kernel forgot to write
shows up in the comparison against the reference instead of passing as stale memory.
"""

from __future__ import annotations

import weakref

import torch

_POISON = False
INT_SENTINEL = -(2**31) + 7


def poison(enabled: bool) -> None:
    global _POISON
    _POISON = enabled


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if _POISON:
        out.fill_(float("nan") if dtype.is_floating_point else INT_SENTINEL)
    return out


_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared(name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A buffer that every holder asking for (name, shape, dtype, device) gets, while one holds
    it (poisoned like :func:`empty` when made). For scratch that a call writes before it reads
    and leaves no data in for the next call, and for graphs' static inputs and outputs: the layers
    of a process run one at a time in stream order, so one buffer serves all of them where each
    would otherwise keep its own."""
    key = (name, tuple(shape), dtype, torch.device(device))
    buf = _SHARED.get(key)
    if buf is None:
        buf = _SHARED[key] = empty(key[1], dtype, device)
    return buf
