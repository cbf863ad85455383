"""The FP8 expert FFN at prefill sizes: per-expert block-scaled GEMMs of cuBLAS (``torch._scaled_mm``).

Each k block of a W8A8 GEMM must be scaled before it is summed, and Triton's Hopper GEMM waits
for each block's dot to scale it: :mod:`.fp8` runs its GEMMs at 430-670 TF/s on an H200, where
cuBLAS's block-scaled GEMM (1 × 128 activation scales, 128 × 128 weight scales, the layout of
:mod:`interlace.fp8`) runs a dense 8192 × 4096 × 14336 one at 1250 TF/s. cuBLAS has no grouped
form of it, so this path runs one GEMM per expert, which needs each expert's row count on the
host: one host sync per call, and one launch per expert and GEMM. It is for prefill (many rows
per expert), where those costs are small beside the GEMMs; decode stays on :mod:`.fp8`.

The same arithmetic as :func:`interlace.fp8.expert_ffn_fp8_reference` but for one rounding:
GEMM0's output reaches the activation as bf16 (cuBLAS's output type), not fp32.

Launches: a gather-and-quantize kernel (the token rows, expert-major), GEMM0 per expert into
(R, up_width) bf16, the activation-and-quantize kernel, GEMM1 per expert into the output.
cuBLAS wants each expert's activation scales column-major ((⌈C/128⌉, m_e) contiguous, viewed as
(m_e, ⌈C/128⌉)), so both quantize kernels write the scales expert-blocked: expert e's block
starts at ``start_e · G`` and holds scale (row r, group g) at ``g · m_e + (r − start_e)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from interlace.fp8 import FP8_BLOCK, FP8_DTYPE, BlockFP8Weight, QuantizedRows, blocks, packed_scale_offset
from interlace.kernels import alloc
from interlace.kernels.expert_gemm.fp8_quant import ACTIVATION_CODES, _quantize_groups, apply_activation, packed_parts
from interlace.kernels.launch import cdiv, launch, next_power_of_2
from interlace.kernels.rows import gather_rows


@triton.jit
def quantize_blocked_kernel(
    src_ptr, gather_ptr, ends_ptr, pad_ends_ptr, q_ptr, scale_ptr, pos_ptr,
    R, C, SRC_COLS, SRC_SCALE_COLS, SCALE_OFFSET, E, divisor,
    ACTIVATION: tl.constexpr,  # 0: rows as they are; 1 SwiGLU of [gate | up], 2 GELU, 3 ReLU
    QUANTIZED: tl.constexpr,  # src: packed rows quantized already (interlace.fp8.QuantizedRows), copied
    GATHER: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr, E_PAD: tl.constexpr,
):
    """Row r (expert-major, expert e's rows ``[ends[e-1], ends[e])``) = act(src[gather[r] //
    divisor]) (or src[r]), quantized per 128 columns into the padded layout: expert e's rows
    start at pad_ends[e-1], its q rows there, its scales expert-blocked (module doc), and
    pos[r] = its padded row. QUANTIZED: src holds packed rows quantized already (their e4m3 values
    SRC_COLS bytes apart, their scales from byte SCALE_OFFSET of a row, SRC_SCALE_COLS fp32 apart),
    which land in the layout as they are. Program (row block, column group)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    G = tl.cdiv(C, GROUP)
    cols = g * GROUP + tl.arange(0, GROUP)
    rmask = rows < R
    valid = rmask[:, None] & (cols < C)[None, :]
    # each row's expert: the number of experts whose rows end at or before it
    e = tl.arange(0, E_PAD)
    ends = tl.load(ends_ptr + e, mask=e < E, other=2147483647)
    expert = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
    start = tl.load(ends_ptr + expert - 1, mask=rmask & (expert > 0), other=0)
    pad_start = tl.load(pad_ends_ptr + expert - 1, mask=rmask & (expert > 0), other=0)
    pad_rows = tl.load(pad_ends_ptr + expert, mask=rmask, other=0) - pad_start
    pos = pad_start + rows - start
    if GATHER:
        src = (tl.load(gather_ptr + rows, mask=rmask, other=0) // divisor).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    if QUANTIZED:
        src_q, src_s = packed_parts(src_ptr, SCALE_OFFSET, tl.float8e4nv)
        q = tl.load(src_q + src[:, None] * SRC_COLS + cols[None, :], mask=valid, other=0.0)
        scale = tl.load(src_s + src * SRC_SCALE_COLS + g, mask=rmask, other=0.0)
    elif ACTIVATION == 0:
        x = tl.load(src_ptr + src[:, None] * SRC_COLS + cols[None, :], mask=valid, other=0.0).to(tl.float32)
        q, scale = _quantize_groups(x, valid)
    else:
        pre = tl.load(src_ptr + src[:, None] * SRC_COLS + cols[None, :], mask=valid, other=0.0).to(tl.float32)
        up = pre
        if ACTIVATION == 1:
            up = tl.load(src_ptr + src[:, None] * SRC_COLS + C + cols[None, :], mask=valid, other=0.0).to(tl.float32)
        x = apply_activation(pre, up, ACTIVATION)
        q, scale = _quantize_groups(x, valid)
    tl.store(q_ptr + pos.to(tl.int64)[:, None] * C + cols[None, :], q, mask=valid)
    tl.store(scale_ptr + pad_start.to(tl.int64) * G + g * pad_rows + (rows - start), scale, mask=rmask)
    if g == 0:
        tl.store(pos_ptr + rows, pos, mask=rmask)


def quantize_blocked(src: torch.Tensor | QuantizedRows, gather: torch.Tensor | None, divisor: int, num_rows: int,
                     cols: int, ends: torch.Tensor, pad_ends: torch.Tensor, padded_rows: int, activation: int):
    """(q (P, cols) e4m3, expert-blocked scales (P·⌈cols/128⌉,) fp32, pos (R,) int32) of the R
    rows ``act(src[gather[r] // divisor])`` in the padded layout of ``pad_ends`` (P rows; the
    padding rows are not written). ``activation`` 0: none, else :data:`ACTIVATION_CODES`
    (SwiGLU reads [gate | up] rows of 2·cols). ``src`` quantized already (:class:`QuantizedRows`,
    activation 0): its rows are copied into the layout as they are."""
    G = blocks(cols)
    quantized = isinstance(src, QuantizedRows)
    if quantized and activation:
        raise ValueError("quantize_blocked: rows quantized already take no activation")
    if quantized:
        W = src.packed.shape[1]
        src, strides = src.packed, (4 * W, W, packed_scale_offset(src.cols))
    else:
        strides = (src.stride(0), 0, 0)
    q = alloc.empty((padded_rows, cols), FP8_DTYPE, src.device)
    scale = alloc.empty((padded_rows * G,), torch.float32, src.device)
    pos = alloc.empty((num_rows,), torch.int32, src.device)
    if num_rows:
        E = ends.numel()
        block_r = 16
        launch(quantize_blocked_kernel, (cdiv(num_rows, block_r), G),
               src, gather if gather is not None else ends, ends, pad_ends, q, scale, pos, num_rows, cols,
               *strides, E, divisor, ACTIVATION=activation, QUANTIZED=quantized,
               GATHER=gather is not None, BLOCK_R=block_r,
               GROUP=FP8_BLOCK, E_PAD=next_power_of_2(max(E, 1)), num_warps=4)
    return q, scale, pos


def blockwise_mm(a: torch.Tensor, a_scale: torch.Tensor, w_t: torch.Tensor, w_scale_t: torch.Tensor,
                 out: torch.Tensor) -> None:
    """out (m, n) = a (m, k) e4m3 · w_t (w_t = wᵀ, w (n, k) e4m3 row-major), with a_scale (m, ⌈k/128⌉)
    column-major (strides (1, m)) and w_scale_t the transpose of w's (⌈n/128⌉, ⌈k/128⌉) scales:
    cuBLAS's block-scaled GEMM."""
    torch._scaled_mm(a, w_t, a_scale, w_scale_t, out_dtype=out.dtype, out=out)


ROW_ALIGN = 4
"""cuBLAS reads a scale matrix whose leading dimension is a multiple of 4 fp32 (16 bytes): an
expert's rows (the activation scales' leading dimension) are padded to it."""


def supports_blockwise(x: torch.Tensor, w_up: BlockFP8Weight, w_down: BlockFP8Weight) -> bool:
    """cuBLAS's block-scaled GEMM: CUDA, Hopper or newer, and each weight's scale rows a
    multiple of 16 bytes (``⌈C/128⌉`` a multiple of 4: hidden and ffn multiples of 512; others
    gave wrong results on an H200 with torch 2.11)."""
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    N, K = w_down.shape[1], w_down.shape[2]
    return N % (FP8_BLOCK * ROW_ALIGN) == 0 and K % (FP8_BLOCK * ROW_ALIGN) == 0


def expert_ffn_fp8_blockwise(x: torch.Tensor | QuantizedRows, gather: torch.Tensor | None, divisor: int,
                             num_rows: int, w_up: BlockFP8Weight, w_down: BlockFP8Weight, ends: torch.Tensor,
                             activation: str, mm=blockwise_mm, out_rows: torch.Tensor | None = None,
                             host_ends: Callable[[], list[int]] | None = None) -> torch.Tensor:
    """:func:`interlace.kernels.expert_gemm.fp8.expert_ffn_fp8`'s contract on cuBLAS's
    block-scaled GEMMs, one per expert (``mm``: the GEMM, replaceable for CPU tests). Each
    expert's rows are padded to :data:`ROW_ALIGN` in the GEMMs' buffers; the output rows are
    gathered back (the padding rows are never read), in the order of ``out_rows`` where given.
    ``host_ends``: a function giving ``ends`` as the host knows them already, else they are read
    back (a host sync)."""
    N, K = w_down.shape[1], w_down.shape[2]
    up_width = w_up.shape[1]
    if num_rows == 0:
        return alloc.empty((0, N), x.dtype, x.device)
    # NOTE: a host sync unless the caller has the row counts on the host: each expert's GEMM
    # takes its row count there.
    bounds = [0] + (host_ends() if host_ends is not None else ends.tolist())
    pad_bounds = [0]
    for s, t in zip(bounds[:-1], bounds[1:]):
        pad_bounds.append(pad_bounds[-1] + cdiv(t - s, ROW_ALIGN) * ROW_ALIGN)
    P = pad_bounds[-1]
    pad_ends = torch.tensor(pad_bounds[1:], dtype=torch.int32).to(x.device, non_blocking=True)
    xq, x_scale, pos = quantize_blocked(x, gather, divisor, num_rows, x.shape[1], ends, pad_ends, P, 0)
    h = alloc.empty((P, up_width), torch.bfloat16, x.device)
    Gx, Gh = blocks(x.shape[1]), blocks(K)
    # Every per-expert view is made by one call per tensor (split, unbind) or one as_strided: the
    # host issues two GEMMs per expert, and at many experts its time per GEMM is what binds the
    # call (Python view ops took as long as the GEMM call itself).
    sizes = [t - s for s, t in zip(pad_bounds[:-1], pad_bounds[1:])]
    live = [e for e, m in enumerate(sizes) if m > 0]
    up_w, up_s = w_up.weight.transpose(1, 2).unbind(0), w_up.scale_inv.transpose(1, 2).unbind(0)
    down_w, down_s = w_down.weight.transpose(1, 2).unbind(0), w_down.scale_inv.transpose(1, 2).unbind(0)

    def scales(flat: torch.Tensor, G: int, e: int) -> torch.Tensor:
        # expert e's (m_e, G) scales, column-major inside its block (the quantize kernels' layout)
        return flat.as_strided((sizes[e], G), (1, sizes[e]), flat.storage_offset() + pad_bounds[e] * G)

    xq_e, h_e = xq.split(sizes), h.split(sizes)
    for e in live:
        mm(xq_e[e], scales(x_scale, Gx, e), up_w[e], up_s[e], h_e[e])
    # (the padding rows of h are GEMM0 of unwritten rows: quantized and multiplied, never read)
    hq, h_scale, _ = quantize_blocked(h, None, 1, P, K, pad_ends, pad_ends, P, ACTIVATION_CODES[activation])
    del h, h_e
    y_padded = alloc.empty((P, N), x.dtype, x.device)
    hq_e, y_e = hq.split(sizes), y_padded.split(sizes)
    for e in live:
        mm(hq_e[e], scales(h_scale, Gh, e), down_w[e], down_s[e], y_e[e])
    return gather_rows(y_padded, pos if out_rows is None else pos[out_rows.long()])
