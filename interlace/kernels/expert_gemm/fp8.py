"""Block-scaled FP8 (W8A8) grouped GEMMs of the expert FFN, inference only."""

from __future__ import annotations

import torch

from interlace.fp8 import BlockFP8Weight, expert_ffn_fp8_reference


def expert_ffn_fp8(x: torch.Tensor, gather: torch.Tensor | None, divisor: int, num_rows: int, w_up: BlockFP8Weight,
                   w_down: BlockFP8Weight, ends: torch.Tensor, activation: str) -> torch.Tensor:
    """y (num_rows, N) in x's dtype, expert-major: row r is the FFN of expert e (rows
    ``[ends[e-1], ends[e])``) on ``x[gather[r] // divisor]`` (``gather`` None: ``x[r]``)."""
    rows = x if gather is None else x[gather[:num_rows].long() // divisor]
    return expert_ffn_fp8_reference(rows, w_up, w_down, ends, activation)
