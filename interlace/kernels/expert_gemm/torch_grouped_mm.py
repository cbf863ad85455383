"""Grouped GEMM over experts: ``out[rows of group g] = a[rows of group g] @ w[g].T``.

Weights are stored like ``nn.Linear`` weights, ``w`` (G, out, in), so the fast path hands
``w.transpose(-2, -1)`` (column-major in its last two dims) to ``torch._grouped_mm``, which
needs bf16 on CUDA (Hopper runs it on CUTLASS grouped kernels). Everything else (fp32/fp64
CPU tests, fp16, strides that break its 16-byte rule) takes a per-group loop that is
obviously right but needs the group sizes on the host: that fallback syncs.
"""

from __future__ import annotations

import torch

_CPU_GROUPED_MM_OK: dict[torch.dtype, bool] = {}


def _fast_path_ok(a: torch.Tensor, w: torch.Tensor) -> bool:
    if a.dtype != w.dtype:
        return False
    in_dim = a.shape[1]
    if a.is_cuda:
        if a.dtype != torch.bfloat16:
            return False
        # 16-byte alignment of the row strides of a, w^T and the output.
        return in_dim % 8 == 0 and w.shape[1] % 8 == 0
    # torch's CPU implementation (fp32/bf16) exists in recent releases; probe once per dtype.
    if a.dtype not in (torch.float32, torch.bfloat16):
        return False
    if a.dtype not in _CPU_GROUPED_MM_OK:
        try:
            probe = torch._grouped_mm(
                torch.ones(2, 8, dtype=a.dtype), torch.ones(1, 8, 8, dtype=a.dtype).transpose(-2, -1),
                offs=torch.tensor([2], dtype=torch.int32),
            )
            _CPU_GROUPED_MM_OK[a.dtype] = bool(torch.all(probe == 8))
        except (RuntimeError, NotImplementedError):
            _CPU_GROUPED_MM_OK[a.dtype] = False
    return _CPU_GROUPED_MM_OK[a.dtype] and in_dim % 4 == 0 and w.shape[1] % 4 == 0


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a (M, in), w (G, out, in), offs (G,) int32 cumulative row ends (offs[-1] == M) → (M, out).

    Differentiable in a and w on both paths.
    """
    if a.shape[0] == 0:
        # An empty product that stays in the graph, so w still gets a (zero) gradient.
        return a @ w[0].t()
    if _fast_path_ok(a, w):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    return grouped_mm_loop(a, w, offs)


def grouped_mm_loop(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Reference grouped GEMM: one matmul per group. Host sync: reads ``offs``."""
    ends = offs.tolist()
    outs, start = [], 0
    for g, end in enumerate(ends):
        outs.append(a[start:end] @ w[g].t())
        start = end
    return torch.cat(outs, dim=0)
