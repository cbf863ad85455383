"""Output allocation for the kernels, with an opt-in poison mode for tests.

With ``poison(True)`` every output buffer a launcher allocates is filled with NaN (floats) or
a large negative sentinel (ints) before the kernel runs, so a row the kernel forgot to write
shows up in the comparison against the reference instead of passing as stale memory.
"""

from __future__ import annotations

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
