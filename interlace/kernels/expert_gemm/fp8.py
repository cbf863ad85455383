"""Block-scaled FP8 (W8A8) grouped GEMMs of the expert FFN, inference only.

The arithmetic is :mod:`interlace.fp8`'s: weights e4m3 with one fp32 scale per 128 × 128 block,
activations quantized per row and 128 columns. Three launches per expert block:

1. :func:`quantize_rows_kernel` — the T token rows (not the T·k dispatched rows: each token is
   quantized once) → e4m3 rows and their group scales;
2. :func:`fp8_gemm_kernel` GEMM0 — the up (and gate) projection of the gathered rows, the
   activation, and the activation's quantization in the epilogue: a column block of 128 is one
   scale group, so a tile holds its groups whole and writes e4m3 ``h`` with its scales;
3. :func:`fp8_gemm_kernel` GEMM1 — the down projection of ``h``, written in the output dtype.

Each k step is one 128-column block, so it meets one activation scale per row and one weight
scale per output column: ``acc += dot(a, b) · a_scale[:, None] · w_scale[None, :]`` (the e4m3
products are exact in the fp32 dot; the scales apply once per block, DeepGEMM's promotion).
Weight columns of a column block may fall in two scale blocks (the up rows of a SwiGLU weight
start at row K, which need not be a multiple of 128), so the weight scales are loaded per
column. Rows are expert-major with a device-built tile schedule (:mod:`.schedule`): no padding,
no host sync, graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from interlace.fp8 import E4M3_MAX, FP8_BLOCK, FP8_DTYPE, BlockFP8Weight, blocks, expert_ffn_fp8_reference
from interlace.kernels import alloc
from interlace.kernels.expert_gemm.configs import num_programs
from interlace.kernels.expert_gemm.schedule import tile_schedule, tile_work
from interlace.kernels.launch import cdiv, launch
from interlace.kernels.rows import use_triton

ACTIVATION_CODES = {"swiglu": 1, "gelu": 2, "relu": 3}
"""GEMM0's epilogue code of each activation (0: GEMM1's plain store)."""


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
def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, M, C, G, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """x (M, C) → q (M, C) e4m3, scale (M, G) fp32; program (row block, group)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    rows64 = rows.to(tl.int64)
    rmask = rows < M
    valid = rmask[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows64[:, None] * C + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    q, scale = _quantize_groups(x, valid)
    tl.store(q_ptr + rows64[:, None] * C + cols[None, :], q, mask=valid)
    tl.store(scale_ptr + rows64 * G + g, scale, mask=rmask)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, C) → (q (M, C) float8_e4m3fn, scale (M, ⌈C/128⌉) fp32): :func:`interlace.fp8.quantize_rows`
    on the device."""
    M, C = x.shape
    G = blocks(C)
    q = alloc.empty((M, C), FP8_DTYPE, x.device)
    scale = alloc.empty((M, G), torch.float32, x.device)
    if M:
        block_m = 16
        launch(quantize_rows_kernel, (cdiv(M, block_m), G), x.contiguous(), q, scale, M, C, G,
               BLOCK_M=block_m, GROUP=FP8_BLOCK, num_warps=4)
    return q, scale


@triton.jit
def _block_dot(a, w_ptr, w_scale_ptr, w_rows, kk, kmask, cmask, kb, RED, RB):
    """(a · W[w_rows, kk]ᵀ, the weight scales of w_rows at k block kb) for one k block."""
    b = tl.load(w_ptr + w_rows[None, :].to(tl.int64) * RED + kk[:, None], mask=kmask[:, None] & cmask[None, :],
                other=0.0)
    w_s = tl.load(w_scale_ptr + (w_rows // 128).to(tl.int64) * RB + kb, mask=cmask, other=0.0)
    return tl.dot(a, b), w_s


@triton.jit
def _load_a(a_ptr, a_scale_ptr, src, rmask, offs_k, kb, RED, RB, BLOCK_K: tl.constexpr):
    """The A block of k block kb (rows src) and its row scales; zeros past RED."""
    kk = kb * BLOCK_K + offs_k
    kmask = kk < RED
    a = tl.load(a_ptr + src[:, None] * RED + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    a_s = tl.load(a_scale_ptr + src * RB + kb, mask=rmask, other=0.0)
    return a, a_s, kk, kmask


@triton.jit
def fp8_gemm_kernel(
    a_ptr, a_scale_ptr, gather_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    COLS, RED, W_ROWS, num_programs, divisor,
    EPILOGUE: tl.constexpr,  # 0: out = acc in out's dtype; 1 SwiGLU, 2 GELU, 3 ReLU, then quantized
    GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Grouped W8A8 GEMM over expert-major rows: for a row r of expert e,
    ``out[r, c] = Σ_k a[src, k] · W_e[c, k]`` (dequantized), src = gather[r] // divisor (or r).

    a (·, RED) e4m3 with a_scale (·, ⌈RED/128⌉); W (E, W_ROWS, RED) e4m3 with w_scale (E,
    ⌈W_ROWS/128⌉, ⌈RED/128⌉). With an activation epilogue, SwiGLU reads gate rows c and up rows
    COLS + c of W_e (W_ROWS = 2·COLS), and the kernel writes e4m3 ``act`` (R, COLS) to out with
    its group scales (R, ⌈COLS/128⌉) to out_scale (BLOCK_N = 128: a tile holds whole groups)."""
    first = tl.program_id(0)
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(COLS, BLOCK_N)
    RB = tl.cdiv(RED, BLOCK_K)
    WB = tl.cdiv(W_ROWS, 128)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for work in tl.range(first, num_tiles * n_blocks, num_programs):
        e, row0, rows, rmask, nb, row_end = tile_work(work, n_blocks, num_tiles, tile_expert_ptr, tile_start_ptr,
                                                      tile_end_ptr, BLOCK_M, GROUP_M)
        rows64 = rows.to(tl.int64)
        if GATHER:
            src = (tl.load(gather_ptr + rows64, mask=rmask, other=0) // divisor).to(tl.int64)
        else:
            src = rows64
        cols = nb * BLOCK_N + offs_n
        cmask = cols < COLS
        w_base = w_ptr + e * W_ROWS * RED
        s_base = w_scale_ptr + e * WB * RB
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if EPILOGUE == 1:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in tl.range(0, RB):
            # Each k block's dot is scaled before it is added (per row and column: the
            # promotion cannot ride in the accumulator as a plain GEMM's does), so the tensor
            # cores wait for it each step: docs/fp8.md gives what that costs.
            a, a_s, kk, kmask = _load_a(a_ptr, a_scale_ptr, src, rmask, offs_k, kb, RED, RB, BLOCK_K)
            p, w_s = _block_dot(a, w_base, s_base, cols, kk, kmask, cmask, kb, RED, RB)
            acc += p * a_s[:, None] * w_s[None, :]
            if EPILOGUE == 1:
                p_up, w_s_up = _block_dot(a, w_base, s_base, COLS + cols, kk, kmask, cmask, kb, RED, RB)
                acc_up += p_up * a_s[:, None] * w_s_up[None, :]
        omask = rmask[:, None] & cmask[None, :]
        if EPILOGUE == 0:
            tl.store(out_ptr + rows64[:, None] * COLS + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            if EPILOGUE == 1:
                act = acc * tl.sigmoid(acc) * acc_up
            elif EPILOGUE == 2:
                act = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
            else:
                act = tl.maximum(acc, 0.0)
            q, scale = _quantize_groups(act, omask)
            tl.store(out_ptr + rows64[:, None] * COLS + cols[None, :], q, mask=omask)
            tl.store(out_scale_ptr + rows64 * n_blocks + nb, scale, mask=rmask)


@dataclass(frozen=True)
class FP8GemmConfig:
    """Tile sizes of :func:`fp8_gemm_kernel` (BLOCK_N and BLOCK_K are the 128 of the scale blocks)."""

    block_m: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def choose_configs(num_rows: int, num_experts: int) -> tuple[FP8GemmConfig, FP8GemmConfig]:
    """(GEMM0's, GEMM1's) tiles for the mean rows per expert, 8 warps each (on an H200 every
    4-warp form ran 1.1-4x slower). Up to 16 rows per expert: 16-row tiles (decode: no MMA rows
    wasted on padding). Above: GEMM0 takes 64-row tiles whatever the size (its gate and up
    accumulators at 128 rows ran 2-3x slower), GEMM1 64 rows up to 96 per expert, then 128."""
    mean = num_rows / max(num_experts, 1)
    if mean <= 16:
        return FP8GemmConfig(16, 8, 4), FP8GemmConfig(16, 8, 4)
    return FP8GemmConfig(64, 8, 4), FP8GemmConfig(64 if mean <= 96 else 128, 8, 4)


def launch_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, gather: torch.Tensor | None, divisor: int,
                    w: BlockFP8Weight, out: torch.Tensor, out_scale: torch.Tensor | None, cols: int, epilogue: int,
                    schedule, config: FP8GemmConfig) -> None:
    """One grouped GEMM of :func:`fp8_gemm_kernel` over ``schedule``'s tiles into ``out`` (R, cols)."""
    E, w_rows, red = w.weight.shape
    p = num_programs(a.device, schedule.max_tiles * cdiv(cols, FP8_BLOCK))
    launch(fp8_gemm_kernel, (p,),
        a, a_scale, gather if gather is not None else a_scale, w.weight, w.scale_inv, out,
        out_scale if out_scale is not None else a_scale,
        schedule.expert, schedule.start, schedule.end, schedule.count,
        cols, red, w_rows, p, divisor,
        EPILOGUE=epilogue, GATHER=gather is not None,
        BLOCK_M=config.block_m, BLOCK_N=FP8_BLOCK, BLOCK_K=FP8_BLOCK, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def check_fp8_weights(x: torch.Tensor, w_up: BlockFP8Weight, w_down: BlockFP8Weight, activation: str) -> None:
    """``ValueError`` unless the weights are an expert FFN's for x (T, N) and ``activation``."""
    N = x.shape[1]
    E, up_width, n_up = w_up.shape
    e_down, n_down, K = w_down.shape
    want_up = 2 * K if activation == "swiglu" else K
    if n_up != N or n_down != N or e_down != E or up_width != want_up:
        raise ValueError(f"FP8 expert weights w_up {tuple(w_up.shape)}, w_down {tuple(w_down.shape)} do not form "
                         f"an expert FFN ({activation}) of hidden size {N}: expected (E, {want_up}, {N}) and "
                         f"(E, {N}, {K})")


def expert_ffn_fp8(x: torch.Tensor, gather: torch.Tensor | None, divisor: int, num_rows: int, w_up: BlockFP8Weight,
                   w_down: BlockFP8Weight, ends: torch.Tensor, activation: str, return_act: bool = False):
    """y (num_rows, N) in x's dtype, expert-major: row r is the W8A8 FFN of expert e (rows
    ``[ends[e-1], ends[e])``, ``ends`` (E,) int32 inclusive) on ``x[gather[r] // divisor]``
    (``gather`` None: ``x[r]``). Without Triton (a CPU without the interpreter), the fp32
    reference of the same arithmetic. ``return_act``: (y, (act q (R, K), act scale (R, ⌈K/128⌉)))
    with GEMM0's quantized output, for checks."""
    check_fp8_weights(x, w_up, w_down, activation)
    if not use_triton(x):
        rows = x if gather is None else x[gather[:num_rows].long() // divisor]
        return expert_ffn_fp8_reference(rows, w_up, w_down, ends, activation, return_act=return_act)
    N = x.shape[1]
    K = w_down.shape[2]
    E = w_up.shape[0]
    y = alloc.empty((num_rows, N), x.dtype, x.device)
    h = alloc.empty((num_rows, K), FP8_DTYPE, x.device)
    h_scale = alloc.empty((num_rows, blocks(K)), torch.float32, x.device)
    if num_rows == 0:
        return (y, (h, h_scale)) if return_act else y
    config0, config1 = choose_configs(num_rows, E)
    sched0 = tile_schedule(ends, num_rows, config0.block_m)
    sched1 = sched0 if config1.block_m == config0.block_m else tile_schedule(ends, num_rows, config1.block_m)
    xq, x_scale = quantize_rows_fp8(x)
    launch_fp8_gemm(xq, x_scale, gather, divisor, w_up, h, h_scale, K, ACTIVATION_CODES[activation], sched0, config0)
    launch_fp8_gemm(h, h_scale, None, 1, w_down, y, None, N, 0, sched1, config1)
    return (y, (h, h_scale)) if return_act else y


__all__ = ["E4M3_MAX", "expert_ffn_fp8", "quantize_rows_fp8", "launch_fp8_gemm", "choose_configs"]
