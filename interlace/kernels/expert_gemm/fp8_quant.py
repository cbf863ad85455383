"""Quantizing activations to e4m3 per row and 128 columns on the device (:mod:`interlace.fp8`'s
:func:`~interlace.fp8.quantize_rows`), shared by the FP8 expert GEMMs' two backends."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interlace.fp8 import (
    FP8_BLOCK, FP8_DTYPE, QuantizedRows, blocks, packed_row_bytes, packed_scale_offset, quantize_rows,
)
from interlace.kernels import alloc
from interlace.kernels.launch import cdiv, launch
from interlace.kernels.rows import use_triton

ACTIVATION_CODES = {"swiglu": 1, "gelu": 2, "relu": 3}
"""GEMM0's epilogue code of each activation (0: GEMM1's plain store)."""


@triton.jit
def apply_activation(pre, up, ACTIVATION: tl.constexpr):
    """The activation's value in fp32 (:data:`ACTIVATION_CODES`): SwiGLU ``silu(pre) · up``, else
    GELU (erf) or ReLU of ``pre`` (``up`` unused)."""
    if ACTIVATION == 1:
        out = pre * tl.sigmoid(pre) * up
    elif ACTIVATION == 2:
        out = 0.5 * pre * (1.0 + tl.erf(pre * 0.7071067811865476))
    else:
        out = tl.maximum(pre, 0.0)
    return out


@triton.jit
def _quantize_groups(x, valid):
    """(rows, 128) fp32 → (e4m3 values, (rows,) fp32 scales) of one 128-column group per row:
    scale = amax / 448 (1 for an all-zero group, NaN for a group holding a NaN), IEEE divisions
    (torch's, in :func:`interlace.fp8.quantize_rows`), round to nearest even, saturated at ±448."""
    x = tl.where(valid, x, 0.0)
    amax = tl.max(tl.abs(x), axis=1)
    has_nan = tl.sum((x != x).to(tl.int32), axis=1) > 0
    scale = tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
    scale = tl.where(has_nan, float("nan"), scale)
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return q.to(tl.float8e4nv), scale


@triton.jit
def packed_parts(ptr, SCALE_OFFSET, FP8_TY: tl.constexpr):
    """Typed pointers to the two parts of a packed row buffer (an int32 pointer; ``interlace.fp8.
    QuantizedRows``): its e4m3 values, and its fp32 scales from byte SCALE_OFFSET of a row."""
    raw = ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    return ptr.to(tl.pointer_type(FP8_TY), bitcast=True), (raw + SCALE_OFFSET).to(tl.pointer_type(tl.float32),
                                                                                   bitcast=True)


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, M, C, G, Q_STRIDE, S_STRIDE, SCALE_OFFSET,
                         PACKED: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """x (M, C) → q (M, C) e4m3 (row stride Q_STRIDE), scale (M, G) fp32 (row stride S_STRIDE);
    PACKED: both into the packed rows at q_ptr (scale_ptr unused; the scales from byte
    SCALE_OFFSET of a row). Program (row block, group)."""
    if PACKED:
        q_ptr, scale_ptr = packed_parts(q_ptr, SCALE_OFFSET, tl.float8e4nv)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    rows64 = rows.to(tl.int64)
    rmask = rows < M
    valid = rmask[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows64[:, None] * C + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    q, scale = _quantize_groups(x, valid)
    tl.store(q_ptr + rows64[:, None] * Q_STRIDE + cols[None, :], q, mask=valid)
    tl.store(scale_ptr + rows64 * S_STRIDE + g, scale, mask=rmask)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, C) → (q (M, C) float8_e4m3fn, scale (M, ⌈C/128⌉) fp32): :func:`interlace.fp8.quantize_rows`
    on the device."""
    M, C = x.shape
    G = blocks(C)
    q = alloc.empty((M, C), FP8_DTYPE, x.device)
    scale = alloc.empty((M, G), torch.float32, x.device)
    if M:
        block_m = 16
        launch(quantize_rows_kernel, (cdiv(M, block_m), G), x.contiguous(), q, scale, M, C, G, C, G, 0,
               PACKED=False, BLOCK_M=block_m, GROUP=FP8_BLOCK, num_warps=4)
    return q, scale


def quantize_rows_packed(x: torch.Tensor) -> QuantizedRows:
    """x (M, C) → its rows quantized (:func:`quantize_rows_fp8`'s values, bitwise) and packed
    (:class:`~interlace.fp8.QuantizedRows`: a row gather and an all-to-all move them at once)."""
    M, C = x.shape
    rows = QuantizedRows(alloc.empty((M, packed_row_bytes(C) // 4), torch.int32, x.device), C, x.dtype)
    if not M:
        return rows
    if not use_triton(x):
        q, scale = quantize_rows(x)
        rows.q[:], rows.scale[:] = q, scale
        return rows
    block_m, W = 16, rows.packed.shape[1]
    launch(quantize_rows_kernel, (cdiv(M, block_m), blocks(C)), x.contiguous(), rows.packed, rows.packed, M, C,
           blocks(C), 4 * W, W, packed_scale_offset(C), PACKED=True, BLOCK_M=block_m, GROUP=FP8_BLOCK, num_warps=4)
    return rows
