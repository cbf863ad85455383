"""Expert activations. SwiGLU reads gate and up straight out of the fused projection.

The first expert projection produces ``h`` (M, 2K): columns [0, K) are the gate, [K, 2K) the
up projection. ``_swiglu_kernel`` computes ``silu(gate) * up`` in fp32 from those two halves
without copying them apart; ``_swiglu_backward_kernel`` writes d(gate) and d(up) into one
(M, 2K) gradient. GELU (exact, erf) and ReLU have a single input and use torch's ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from interlace.kernels import alloc

from interlace.kernels.launch import cdiv, launch
from interlace.kernels.rows import use_triton

# Tuning: elements per program of the (M, K) output; 8 per thread with 4 warps.
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _gate_up_block(h_ptr, total, K, BLOCK: tl.constexpr):
    """This program's block of the (M, K) output: flat offsets, mask, (m, c), gate and up in fp32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    m = offs // K
    c = offs % K
    gate = tl.load(h_ptr + m * 2 * K + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + m * 2 * K + K + c, mask=mask, other=0.0).to(tl.float32)
    return offs, mask, m, c, gate, up


@triton.jit
def _swiglu_kernel(h_ptr, out_ptr, total, K, BLOCK: tl.constexpr):
    offs, mask, m, c, gate, up = _gate_up_block(h_ptr, total, K, BLOCK)
    act = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + offs, act.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_block(h_ptr, grad_ptr, dh_ptr, total, K, BLOCK: tl.constexpr):
    offs, mask, m, c, gate, up = _gate_up_block(h_ptr, total, K, BLOCK)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = g * silu
    tl.store(dh_ptr + m * 2 * K + c, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + m * 2 * K + K + c, d_up.to(dh_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(h_ptr, grad_ptr, dh_ptr, total, K, BLOCK: tl.constexpr):
    _swiglu_backward_block(h_ptr, grad_ptr, dh_ptr, total, K, BLOCK)


@triton.jit
def _swiglu_backward_regions_kernel(h_ptr, grad_ptr, dh_ptr, used_ptr, region_rows, K, BLOCK: tl.constexpr):
    """Program (b, r): block b of region r's first ``used[r]`` rows (the rest are not touched;
    programs past them return at once)."""
    r = tl.program_id(1)
    total = tl.load(used_ptr + r).to(tl.int64) * K
    if tl.program_id(0).to(tl.int64) * BLOCK < total:
        row0 = r.to(tl.int64) * region_rows
        _swiglu_backward_block(h_ptr + row0 * 2 * K, grad_ptr + row0 * K, dh_ptr + row0 * 2 * K, total, K, BLOCK)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """(M, 2K) → (M, K): ``silu(h[:, :K]) * h[:, K:]`` computed in fp32."""
    M, two_k = h.shape
    K = two_k // 2
    if not use_triton(h):
        hf = h.float()
        return (F.silu(hf[:, :K]) * hf[:, K:]).to(h.dtype)
    h = h.contiguous()
    out = alloc.empty((M, K), dtype=h.dtype, device=h.device)
    total = M * K
    if total:
        launch(_swiglu_kernel, (cdiv(total, BLOCK),), h, out, total, K, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


def swiglu_backward(h: torch.Tensor, grad: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """d(loss)/dh (M, 2K) from the (M, K) gradient of :func:`swiglu`'s output (into ``out``
    (M, 2K) contiguous when given; ``h`` may have more rows than ``grad``: the first M are used)."""
    M, K = grad.shape
    h = h[:M]
    if not use_triton(h):
        hf = h.float()
        g = grad.float()
        gate, up = hf[:, :K], hf[:, K:]
        sig = torch.sigmoid(gate)
        d_gate = g * up * sig * (1 + gate * (1 - sig))
        dh = torch.cat([d_gate, g * gate * sig], dim=1).to(h.dtype)
        return dh if out is None else out.copy_(dh)
    h = h.contiguous()
    grad = grad.contiguous()
    dh = alloc.empty(h.shape, h.dtype, h.device) if out is None else out
    total = M * K
    if total:
        launch(_swiglu_backward_kernel, (cdiv(total, BLOCK),),
            h, grad, dh, total, K, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
    return dh


def swiglu_backward_regions(h: torch.Tensor, grad: torch.Tensor, used: torch.Tensor, region_rows: int,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`swiglu_backward` over the first ``used[r]`` rows of each region ``r`` of
    ``region_rows`` rows (``used`` (R,) int32 on the device: no host sync). Rows past them in
    the returned (R·region_rows, 2K) gradient are unspecified (never read by the caller).
    ``out`` may be ``h`` itself: each element pair is read before it is written, by the same
    program."""
    M, K = grad.shape
    R = used.numel()
    if M != R * region_rows or h.shape[0] != M:
        raise ValueError(f"swiglu_backward_regions: {R} regions of {region_rows} rows, got h {tuple(h.shape)} "
                         f"and grad {tuple(grad.shape)}")
    if not (h.is_contiguous() and grad.is_contiguous() and (out is None or (out.is_contiguous()
                                                                           and out.shape == h.shape))):
        raise ValueError("swiglu_backward_regions: h, grad and out must be contiguous, out shaped like h")
    dh = alloc.empty(h.shape, h.dtype, h.device) if out is None else out
    if not use_triton(h):
        # (the plain-torch path, for CPU without the interpreter, may sync: nonzero)
        rows = torch.arange(region_rows, device=h.device)[None, :] < used.to(h.device).long()[:, None]
        rows = rows.reshape(-1).nonzero()[:, 0]
        dh[rows] = swiglu_backward(h[rows], grad[rows])  # h[rows] is a copy: safe when dh is h
        return dh
    if M and K:
        grid = (cdiv(region_rows * K, BLOCK), R)
        launch(_swiglu_backward_regions_kernel, grid, h, grad, dh, used, region_rows, K, BLOCK=BLOCK,
               num_warps=NUM_WARPS)
    return dh


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return swiglu(h)

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        return swiglu_backward(h, grad)


def activation_fused(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The fast-path activation of the first projection's output h (M, up_width) → (M, K)."""
    if activation == "swiglu":
        return SwiGLU.apply(h)
    return activation_reference(h, activation)


def activation_reference(h: torch.Tensor, activation: str) -> torch.Tensor:
    """Plain torch activations (SwiGLU splits h into gate and up halves)."""
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(h)
    if activation == "relu":
        return F.relu(h)
    raise ValueError(f"unsupported activation {activation!r}")
