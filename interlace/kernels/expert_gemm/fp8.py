"""Block-scaled FP8 (W8A8) grouped GEMMs of the expert FFN, inference only, and the entry point
:func:`expert_ffn_fp8` that picks between them and cuBLAS's per-expert GEMMs (:mod:`.fp8_blockwise`).

The arithmetic is :mod:`interlace.fp8`'s: weights e4m3 with one fp32 scale per 128 × 128 block,
activations quantized per row and 128 columns. Three launches per expert block:

1. :func:`~.fp8_quant.quantize_rows_kernel` — the T token rows (not the T·k dispatched rows: each token is
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

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from interlace.fp8 import (
    FP8_BLOCK, FP8_DTYPE, BlockFP8Weight, QuantizedRows, blocks, expert_ffn_fp8_reference, packed_scale_offset,
)
from interlace.kernels import alloc
from interlace.kernels.expert_gemm.configs import num_programs
from interlace.kernels.expert_gemm.schedule import tile_schedule, tile_work
from interlace.kernels.expert_gemm.fp8_blockwise import expert_ffn_fp8_blockwise, supports_blockwise
from interlace.kernels.expert_gemm.fp8_quant import (
    ACTIVATION_CODES, _quantize_groups, apply_activation, packed_parts, quantize_rows_fp8,
)
from interlace.kernels.launch import cdiv, launch
from interlace.kernels.rows import gather_rows, use_triton
from interlace.kernels.tma import ensure_allocator, tma_rows_ok, use_tma

@triton.jit
def _weight_block(w_ptr, w_desc, w_row0, w_rows, k0, kk, kmask, cmask, RED, W_TMA: tl.constexpr):
    """The (BLOCK_K × BLOCK_N) block Wᵀ[kk, w_rows] of one k step: through the descriptor over all
    experts' rows (W_TMA; ``w_row0`` the block's first row there: rows past the expert's feed only
    masked columns, rows past the tensor read as zeros), else a masked pointer load."""
    if W_TMA:
        b = w_desc.load([w_row0.to(tl.int32), k0]).T
    else:
        b = tl.load(w_ptr + w_rows[None, :].to(tl.int64) * RED + kk[:, None], mask=kmask[:, None] & cmask[None, :],
                    other=0.0)
    return b


@triton.jit
def _weight_scale(s_base, w_rows, first_row, cmask, kb, RB, SCALAR_SCALE: tl.constexpr):
    """The weight scales of a k step: one number where the tile's weight rows (``first_row ..``)
    lie in one 128-row scale block (SCALAR_SCALE), else one per row/column (BLOCK_N,)."""
    if SCALAR_SCALE:
        w_s = tl.load(s_base + (first_row // 128).to(tl.int64) * RB + kb)
    else:
        w_s = tl.load(s_base + (w_rows // 128).to(tl.int64) * RB + kb, mask=cmask, other=0.0)
    return w_s


@triton.jit
def _promote(acc, p, a_s, w_s, SCALAR_SCALE: tl.constexpr):
    """``acc + p · a_s[:, None] · w_s``: a k step's exact e4m3 product, scaled once (one
    multiply per element where the weight scale is one number)."""
    if SCALAR_SCALE:
        acc += p * (a_s * w_s)[:, None]
    else:
        acc += p * a_s[:, None] * w_s[None, :]
    return acc


@triton.jit
def fp8_gemm_kernel(
    a_ptr, a_scale_ptr, gather_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    COLS, RED, W_ROWS, num_programs, divisor, A_ROWS, E, A_STRIDE, AS_STRIDE, A_SCALE_OFFSET,
    EPILOGUE: tl.constexpr,  # 0: out = acc in out's dtype; 1 SwiGLU, 2 GELU, 3 ReLU, then quantized
    GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_TMA: tl.constexpr = False, A_TMA: tl.constexpr = False, SCALAR_SCALE: tl.constexpr = False,
    A_PACKED: tl.constexpr = False,
):
    """Grouped W8A8 GEMM over expert-major rows: for a row r of expert e,
    ``out[r, c] = Σ_k a[src, k] · W_e[c, k]`` (dequantized), src = gather[r] // divisor (or r).

    a (A_ROWS, RED) e4m3 with a_scale (·, ⌈RED/128⌉), their rows A_STRIDE and AS_STRIDE elements
    apart; A_PACKED: both in packed rows at a_ptr (``interlace.fp8.QuantizedRows``, the scales from
    byte A_SCALE_OFFSET of a row; a_scale_ptr unused); W (E, W_ROWS, RED) e4m3 with w_scale (E,
    ⌈W_ROWS/128⌉, ⌈RED/128⌉). With an activation epilogue, SwiGLU reads gate rows c and up rows
    COLS + c of W_e (W_ROWS = 2·COLS), and the kernel writes e4m3 ``act`` (R, COLS) to out with
    its group scales (R, ⌈COLS/128⌉) to out_scale (BLOCK_N = 128: a tile holds whole groups).

    W_TMA: weight blocks through a TMA descriptor (Hopper; 16-byte rows); A_TMA (not with GATHER):
    A rows too, the tile's rows past its expert's read but feeding only masked output rows.
    SCALAR_SCALE: the launcher's promise that a tile's weight rows lie in one scale block per
    k step (gate and up rows both: COLS a multiple of 128 where EPILOGUE is SwiGLU)."""
    if A_PACKED:
        a_ptr, a_scale_ptr = packed_parts(a_ptr, A_SCALE_OFFSET, tl.float8e4nv)
    first = tl.program_id(0)
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(COLS, BLOCK_N)
    RB = tl.cdiv(RED, BLOCK_K)
    WB = tl.cdiv(W_ROWS, 128)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_desc = w_ptr
    if W_TMA:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * W_ROWS, RED], strides=[RED, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    a_desc = a_ptr
    if A_TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[A_ROWS, RED], strides=[A_STRIDE, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
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
        w_row0 = e * W_ROWS + nb * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if EPILOGUE == 1:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in tl.range(0, RB):
            # Each k block's dot is scaled before it is added (per row, and per column unless
            # SCALAR_SCALE: the promotion cannot ride in the accumulator as a plain GEMM's
            # does), so the tensor cores wait for it each step: docs/fp8.md gives what that costs.
            k0 = kb * BLOCK_K
            kk = k0 + offs_k
            kmask = kk < RED
            if A_TMA:
                a = a_desc.load([row0, k0])
            else:
                a = tl.load(a_ptr + src[:, None] * A_STRIDE + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                            other=0.0)
            a_s = tl.load(a_scale_ptr + src * AS_STRIDE + kb, mask=rmask, other=0.0)
            b = _weight_block(w_base, w_desc, w_row0, cols, k0, kk, kmask, cmask, RED, W_TMA)
            w_s = _weight_scale(s_base, cols, nb * BLOCK_N, cmask, kb, RB, SCALAR_SCALE)
            acc = _promote(acc, tl.dot(a, b), a_s, w_s, SCALAR_SCALE)
            if EPILOGUE == 1:
                b = _weight_block(w_base, w_desc, w_row0 + COLS, COLS + cols, k0, kk, kmask, cmask, RED, W_TMA)
                w_s = _weight_scale(s_base, COLS + cols, COLS + nb * BLOCK_N, cmask, kb, RB, SCALAR_SCALE)
                acc_up = _promote(acc_up, tl.dot(a, b), a_s, w_s, SCALAR_SCALE)
        omask = rmask[:, None] & cmask[None, :]
        if EPILOGUE == 0:
            tl.store(out_ptr + rows64[:, None] * COLS + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            act = apply_activation(acc, acc_up if EPILOGUE == 1 else acc, EPILOGUE)
            q, scale = _quantize_groups(act, omask)
            tl.store(out_ptr + rows64[:, None] * COLS + cols[None, :], q, mask=omask)
            tl.store(out_scale_ptr + rows64 * n_blocks + nb, scale, mask=rmask)


@dataclass(frozen=True)
class FP8GemmConfig:
    """Tile sizes of :func:`fp8_gemm_kernel` (BLOCK_N and BLOCK_K are the 128 of the scale blocks)
    and programs per SM of its persistent grid."""

    block_m: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    per_sm: int = 1


def choose_configs(num_rows: int, num_experts: int, tma: bool = False) -> tuple[FP8GemmConfig, FP8GemmConfig]:
    """(GEMM0's, GEMM1's) tiles for the mean rows per expert. Up to 16 rows per expert: 16-row
    tiles, 8 warps (decode: no MMA rows wasted on padding). Above, with TMA: GEMM0 64-row tiles,
    8 warps, 3 stages; GEMM1 64 rows, 4 warps, 3 stages, 2 programs per SM (on an H200, 700-740
    and 760-920 TFLOP/s for dsv3-like and mixtral-8x7b at 4096-16384 tokens per GPU; 128-row tiles,
    4 stages, gate and up as one dot or two k blocks per step were 5-40% slower). Without TMA
    (pointer loads): GEMM0 64 rows, GEMM1 64 rows up to 96 per expert, then 128, 8 warps each
    (every 4-warp form ran 1.1-4x slower there)."""
    mean = num_rows / max(num_experts, 1)
    if mean <= 16:
        return FP8GemmConfig(16, 8, 4), FP8GemmConfig(16, 8, 4)
    if tma:
        return FP8GemmConfig(64, 8, 3), FP8GemmConfig(64, 4, 3, per_sm=2)
    return FP8GemmConfig(64, 8, 4), FP8GemmConfig(64 if mean <= 96 else 128, 8, 4)


def launch_fp8_gemm(a: torch.Tensor | QuantizedRows, a_scale: torch.Tensor | None, gather: torch.Tensor | None,
                    divisor: int, w: BlockFP8Weight, out: torch.Tensor, out_scale: torch.Tensor | None, cols: int,
                    epilogue: int, schedule, config: FP8GemmConfig, tma: bool | None = None) -> None:
    """One grouped GEMM of :func:`fp8_gemm_kernel` over ``schedule``'s tiles into ``out`` (R, cols).
    ``a``: e4m3 rows with their scales ``a_scale``, or packed rows (:class:`~interlace.fp8.
    QuantizedRows`, ``a_scale`` None). ``tma``: weights (and ungathered A rows) through
    descriptors where the tensors allow (:func:`~interlace.kernels.tma.use_tma`'s ``force``: None
    by the device, True wherever Triton runs, the interpreter included, False never)."""
    E, w_rows, red = w.weight.shape
    w_tma = use_tma(w.weight, force=tma)
    if isinstance(a, QuantizedRows):
        W = a.packed.shape[1]
        a_args, a_strides, packed, a_tma = (a.packed, a.packed), (4 * W, W, packed_scale_offset(a.cols)), True, False
    else:
        a_args, a_strides, packed = (a, a_scale), (a.stride(0), a_scale.stride(0), 0), False
        a_tma = w_tma and gather is None and tma_rows_ok(a)
    if w_tma:
        ensure_allocator()
    p = num_programs(out.device, schedule.max_tiles * cdiv(cols, FP8_BLOCK), config.per_sm)
    launch(fp8_gemm_kernel, (p,),
        a_args[0], a_args[1], gather if gather is not None else w.scale_inv, w.weight, w.scale_inv, out,
        out_scale if out_scale is not None else w.scale_inv,
        schedule.expert, schedule.start, schedule.end, schedule.count,
        cols, red, w_rows, p, divisor, a_args[0].shape[0], E, *a_strides,
        EPILOGUE=epilogue, GATHER=gather is not None,
        BLOCK_M=config.block_m, BLOCK_N=FP8_BLOCK, BLOCK_K=FP8_BLOCK, GROUP_M=config.group_m,
        W_TMA=w_tma, A_TMA=a_tma, SCALAR_SCALE=epilogue != ACTIVATION_CODES["swiglu"] or cols % FP8_BLOCK == 0,
        A_PACKED=packed, num_warps=config.num_warps, num_stages=config.num_stages,
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


FP8_BACKENDS = ("auto", "triton", "blockwise")
BLOCKWISE_GEMM_FLOPS = 0.96e15
"""cuBLAS's block-scaled GEMMs per expert on an H200, the rate their work runs at apart from
each GEMM's fixed part (a large GEMM alone 1.2e15). With :data:`BLOCKWISE_GPU_S_PER_GEMM` it fits
both measured ends: 925 TFLOP/s end to end for mixtral-8x7b's 4 experts per GPU (2048-8192 rows
each), 745 for dsv3-like's 128 at 16384 tokens per GPU (1024 rows each)."""
BLOCKWISE_GPU_S_PER_GEMM = 13.5e-6
"""GPU time each expert GEMM of the blockwise path costs beyond its FLOPs (its ramp and tail)."""
BLOCKWISE_HOST_S_PER_GEMM = 30e-6
"""Host time per expert GEMM of the blockwise path (the ``_scaled_mm`` call, 16 µs alone, and its
views): 24-45 µs measured where the host bound the call (dsv3-like's 256 GEMMs at 4096 tokens per
GPU, flashdmoe-cfg's 64), on an H200 machine's host."""
BLOCKWISE_FIXED_S = 0.25e-3
"""The blockwise path's fixed part: its host sync, the two quantize launches and the row gather."""
TRITON_FP8_GEMM_FLOPS = 0.70e15
"""The Triton W8A8 kernels at prefill sizes on an H200, end to end (quantize, both GEMMs):
700-740 TFLOP/s at 4096-16384 tokens per GPU on mixtral-8x7b, phi3.5-moe and dsv3-like; 560 on
qwen3-30b-a3b's narrow experts, where the blockwise path never pays anyway."""
BLOCKWISE_MARGIN = 1.1
"""``auto`` takes cuBLAS's per-expert GEMMs (:mod:`.fp8_blockwise`) where their predicted time,
times this margin, is below the Triton kernels' (:func:`blockwise_pays`)."""


def blockwise_pays(num_rows: int, num_experts: int, hidden: int, ffn: int, up_width: int) -> bool:
    """Whether ``auto`` takes the blockwise backend for this call (host-known sizes: no sync).

    Blockwise: after its sync the host issues two GEMMs per expert while the GPU runs them, so
    the call takes the longer of the GEMMs' GPU time (FLOPs at cuBLAS's rate plus each GEMM's
    fixed part) and the host's issue time, plus its fixed part; Triton: the FLOPs at its rate.
    Blockwise wins for few large experts (mixtral-8x7b at 4096 tokens per GPU and more), ties
    with Triton for dsv3-like's 128 experts per GPU at 16384 and loses below, and never pays at
    decode sizes."""
    flops = 2 * num_rows * hidden * (up_width + ffn)
    gemms = 2 * num_experts
    blockwise_s = (max(flops / BLOCKWISE_GEMM_FLOPS + gemms * BLOCKWISE_GPU_S_PER_GEMM,
                       gemms * BLOCKWISE_HOST_S_PER_GEMM) + BLOCKWISE_FIXED_S)
    return BLOCKWISE_MARGIN * blockwise_s <= flops / TRITON_FP8_GEMM_FLOPS


def expert_ffn_fp8(x: torch.Tensor | QuantizedRows, gather: torch.Tensor | None, divisor: int, num_rows: int,
                   w_up: BlockFP8Weight, w_down: BlockFP8Weight, ends: torch.Tensor, activation: str,
                   return_act: bool = False, backend: str = "auto", tma: bool | None = None,
                   out_rows: torch.Tensor | None = None, host_ends: Callable[[], list[int]] | None = None):
    """y (num_rows, N) in x's dtype, expert-major: row r is the W8A8 FFN of expert e (rows
    ``[ends[e-1], ends[e])``, ``ends`` (E,) int32 inclusive) on ``x[gather[r] // divisor]``
    (``gather`` None: ``x[r]``). ``x``: the activations (T, N), or rows already quantized
    (:class:`~interlace.fp8.QuantizedRows`, taken as they are: what quantizing x here would
    give, so the result is the same bitwise). Without Triton (a CPU without the interpreter), the fp32
    reference of the same arithmetic. ``return_act``: (y, (act q (R, K), act scale (R, ⌈K/128⌉)))
    with GEMM0's quantized output, for checks (Triton kernels only).

    ``backend``: ``"triton"`` (these kernels: no host sync, graph-capturable), ``"blockwise"``
    (cuBLAS's block-scaled GEMM per expert, :mod:`.fp8_blockwise`: one host sync; CUDA, Hopper,
    hidden and ffn multiples of 512), or ``"auto"``: blockwise where it runs and
    :func:`blockwise_pays`, else triton. ``tma``: the Triton kernels' weights (and GEMM1's rows)
    through TMA descriptors (:func:`launch_fp8_gemm`; None: where the device has TMA).
    ``out_rows`` (num_rows,) int32, a permutation: return ``y[out_rows]`` (the blockwise backend
    folds it into the gather it makes anyway). ``host_ends``: a function that gives ``ends`` on the
    host, where the caller has them already (only the blockwise backend calls it, and then makes
    no host sync of its own)."""
    check_fp8_weights(x, w_up, w_down, activation)
    if backend not in FP8_BACKENDS:
        raise ValueError(f"FP8 expert backend must be one of {FP8_BACKENDS}, got {backend!r}")
    if return_act and out_rows is not None:
        raise ValueError("expert_ffn_fp8: return_act gives expert-major rows: no out_rows with it")
    E = w_up.shape[0]
    if backend != "triton" and not return_act:
        runs = supports_blockwise(x, w_up, w_down)
        if backend == "blockwise" and not runs:
            raise ValueError("the blockwise FP8 backend needs a CUDA device of compute capability 9.0 or newer and "
                             "hidden and ffn sizes that are multiples of 512")
        if backend == "blockwise" or (runs and blockwise_pays(num_rows, E, x.shape[1], w_down.shape[2],
                                                                w_up.shape[1])):
            return expert_ffn_fp8_blockwise(x, gather, divisor, num_rows, w_up, w_down, ends, activation,
                                            out_rows=out_rows, host_ends=host_ends)
    quantized = isinstance(x, QuantizedRows)
    if not use_triton(x.packed if quantized else x):
        if gather is None:
            rows = x
        else:
            index = gather[:num_rows].long() // divisor
            rows = x.take(index) if quantized else x[index]
        out = expert_ffn_fp8_reference(rows, w_up, w_down, ends, activation, return_act=return_act)
        return out if out_rows is None else gather_rows(out, out_rows)
    N = x.shape[1]
    K = w_down.shape[2]
    y = alloc.empty((num_rows, N), x.dtype, x.device)
    h = alloc.empty((num_rows, K), FP8_DTYPE, x.device)
    h_scale = alloc.empty((num_rows, blocks(K)), torch.float32, x.device)
    if num_rows == 0:
        return (y, (h, h_scale)) if return_act else y  # (no rows for out_rows to order)
    on_tma = use_tma(w_up.weight, w_down.weight, force=tma)
    config0, config1 = choose_configs(num_rows, E, on_tma)
    sched0 = tile_schedule(ends, num_rows, config0.block_m)
    sched1 = sched0 if config1.block_m == config0.block_m else tile_schedule(ends, num_rows, config1.block_m)
    xq, x_scale = (x, None) if quantized else quantize_rows_fp8(x)
    launch_fp8_gemm(xq, x_scale, gather, divisor, w_up, h, h_scale, K, ACTIVATION_CODES[activation], sched0, config0,
                    tma=on_tma)
    launch_fp8_gemm(h, h_scale, None, 1, w_down, y, None, N, 0, sched1, config1, tma=on_tma)
    if return_act:
        return y, (h, h_scale)
    return y if out_rows is None else gather_rows(y, out_rows)


__all__ = ["expert_ffn_fp8", "quantize_rows_fp8", "launch_fp8_gemm", "choose_configs", "FP8_BACKENDS"]
