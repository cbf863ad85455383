"""TMA (Hopper tensor memory accelerator) on the host side: whether tensors may go through
descriptors, and the scratch allocator for descriptors made inside kernels.

Shared by the expert GEMMs (:mod:`interlace.kernels.expert_gemm`) and the fused COMET kernels
(:mod:`interlace.kernels.comet`); it imports neither.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton

from interlace.kernels.rows import use_triton


@lru_cache(maxsize=None)
def has_tma(index: int) -> bool:
    """Whether CUDA device ``index`` has TMA (compute capability 9 or newer)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def tma_rows_ok(a: torch.Tensor) -> bool:
    """A row matrix TMA can read: contiguous, 16-byte aligned base and row pitch."""
    return a.is_contiguous() and a.data_ptr() % 16 == 0 and a.shape[-1] * a.element_size() % 16 == 0


def use_tma(*weights: torch.Tensor, force: bool | None = None) -> bool:
    """Weights through TMA descriptors: contiguous weights on 16-byte aligned rows and bases, on
    Hopper or newer. ``force`` overrides the device check: False never, True wherever the
    weights allow it and Triton runs (the interpreter included: tests run the TMA path on the
    CPU that way); None decides by the device's capability."""
    if force is False:
        return False
    w = weights[0]
    ok = all(tma_rows_ok(t) for t in weights)
    if force:
        return ok and use_triton(w)
    return ok and w.is_cuda and has_tma(w.device.index if w.device.index is not None else torch.cuda.current_device())


_SCRATCH_DEVICE = None
_SCRATCH: dict[tuple[int, int], torch.Tensor] = {}  # (device, stream) -> descriptor scratch


def _tma_allocator(size: int, alignment: int, stream):
    """Scratch for in-kernel tensor descriptors (128 bytes per program), asked for on every launch
    of a kernel that makes descriptors. One buffer per device and stream, grown as needed: the
    kernels of a stream run one after another and a kernel reads its descriptors only while it
    runs, so the next kernel may reuse the bytes (an allocation per launch costs host time).
    A stream being captured into a CUDA graph gets fresh memory from the graph's pool instead."""
    global _SCRATCH_DEVICE
    if _SCRATCH_DEVICE is None:
        _SCRATCH_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    if _SCRATCH_DEVICE == "cpu" or torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.int8, device=_SCRATCH_DEVICE)
    key = (torch._C._cuda_getDevice(), stream)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < size:
        buf = _SCRATCH[key] = torch.empty(max(size, 1 << 16), dtype=torch.int8, device="cuda")
    return buf


def ensure_allocator() -> None:
    """Triton needs an allocator for in-kernel descriptors; install ours unless one is set."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_allocator)
