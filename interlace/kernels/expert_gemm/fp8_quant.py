"""Quantizing activations to e4m3 per row and 128 columns on the device (:mod:`interlace.fp8`'s
:func:`~interlace.fp8.quantize_rows`), shared by the FP8 expert GEMMs' two backends."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interlace.fp8 import FP8_BLOCK, FP8_DTYPE, QuantizedRows, blocks, quantize_rows
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
def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, M, C, G, Q_STRIDE, S_STRIDE,
                         BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """x (M, C) → q (M, C) e4m3 (row stride Q_STRIDE), scale (M, G) fp32 (row stride S_STRIDE);
    program (row block, group)."""
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


def _quantize_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """:func:`interlace.fp8.quantize_rows` of x (M, C) into q (M, C) and scale (M, G), which may be
    row-strided views (unit column strides)."""
    M, C = x.shape
    if not M:
        return
    if not use_triton(x):
        q[:], scale[:] = quantize_rows(x)
        return
    block_m = 16
    launch(quantize_rows_kernel, (cdiv(M, block_m), scale.shape[1]), x.contiguous(), q, scale, M, C,
           scale.shape[1], q.stride(0), scale.stride(0), BLOCK_M=block_m, GROUP=FP8_BLOCK, num_warps=4)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, C) → (q (M, C) float8_e4m3fn, scale (M, ⌈C/128⌉) fp32): :func:`interlace.fp8.quantize_rows`
    on the device."""
    M, C = x.shape
    q = alloc.empty((M, C), FP8_DTYPE, x.device)
    scale = alloc.empty((M, blocks(C)), torch.float32, x.device)
    _quantize_into(x, q, scale)
    return q, scale


# ----------------------------------------------------------------------------- packed rows
# A token row on the wire: its C e4m3 values, then its ⌈C/128⌉ fp32 scales, each part starting on
# 16 bytes (one buffer, so one all-to-all moves both; 16-byte rows, so a row moves as int32 words).


def _scale_offset(C: int) -> int:
    return cdiv(C, 16) * 16


def packed_row_bytes(C: int) -> int:
    """Bytes of one packed row of C columns: C e4m3 values and ⌈C/128⌉ fp32 scales, each part
    padded to 16 bytes (hidden 7168: 7392 bytes, against 14336 in bf16)."""
    return _scale_offset(C) + cdiv(4 * blocks(C), 16) * 16


def quantize_rows_packed(x: torch.Tensor) -> torch.Tensor:
    """x (M, C) → packed rows (M, packed_row_bytes(C) / 4) int32: each row's e4m3 values and
    scales (:func:`quantize_rows_fp8`'s, bitwise) in one row of words, for a row gather and an
    all-to-all that move both at once. :func:`unpack_rows` reads them back."""
    M, C = x.shape
    packed = alloc.empty((M, packed_row_bytes(C) // 4), torch.int32, x.device)
    rows = unpack_rows(packed, C, x.dtype)
    _quantize_into(x, rows.q, rows.scale)
    return packed


def unpack_rows(packed: torch.Tensor, C: int, dtype: torch.dtype) -> QuantizedRows:
    """Packed rows (M, packed_row_bytes(C) / 4) int32 (:func:`quantize_rows_packed`) → their
    :class:`~interlace.fp8.QuantizedRows` (views into ``packed``, no copy) of activations in ``dtype``."""
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] * 4 != packed_row_bytes(C):
        raise ValueError(f"packed rows of {C} columns are (M, {packed_row_bytes(C) // 4}) int32, got "
                         f"{tuple(packed.shape)} {packed.dtype}")
    raw = packed.view(torch.uint8)
    s0 = _scale_offset(C)
    return QuantizedRows(raw[:, :C].view(FP8_DTYPE), raw[:, s0:s0 + 4 * blocks(C)].view(torch.float32), dtype)
