"""GEMM0 of the expert FFN: ``act(x[g] @ W_gateᵀ) * (x[g] @ W_upᵀ)`` for SwiGLU (one projection
for GELU/ReLU), with the row gather fused into the A load.

The A rows are read through the gather index ``g`` (``rows // divisor``), so the permuted token
matrix is never written; gate and up accumulate in the same tile and the activation runs in
the epilogue; the pre-activation h is stored only when asked (training).

Two kernels, one launcher (:func:`launch_gemm0`), chosen by the config (:func:`gemm0_form`):

* :func:`gemm0_kernel` — a persistent loop per work item (row tile × column block). On Hopper the
  weights come through a TMA descriptor over the (E·up_width, N) weight matrix, and as the
  config says: the A rows too (``a_tma``: a gathered A is first copied contiguous, Hopper has no
  TMA gather), gate and up as one 3-D block and one double-width dot (``joint``), full tiles
  stored through a descriptor (``tma_store``; an expert's partial last tile is stored masked, as
  a whole box would write into the next expert's rows). Without TMA (the interpreter, older GPUs)
  the same kernel loads through pointers.
* :func:`gemm0_flat_kernel` — ``persistent = 2``: one flat loop over (tile, k step) steps, x rows,
  weights and activations through TMA, so the pipeline runs across tiles: the next tile's loads
  go under this tile's last steps and its store.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from interlace.kernels.expert_gemm.configs import check_config, num_programs
from interlace.kernels.expert_gemm.schedule import TileSchedule, flat_items, flat_next, flat_start, tile_work
from interlace.kernels.expert_gemm.tile import (ACTIVATION_ID, activation_epilogue, gate_up_desc, gate_up_tile,
                                                store_tile, window_map)
from interlace.kernels.launch import cdiv, launch
from interlace.kernels.tma import tma_rows_ok
from interlace.tuning.tables import GemmConfig


@triton.jit
def gemm0_kernel(
    x_ptr, gather_ptr, w_ptr, out_ptr, h_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    N, K, E, divisor, num_programs, num_rows,
    ACTIVATION: tl.constexpr,  # 0 swiglu, 1 gelu, 2 relu
    HAS_GATHER: tl.constexpr, STORE_H: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_TMA: tl.constexpr = False, JOINT: tl.constexpr = False, TMA_STORE: tl.constexpr = False,
):
    """act(x[g] @ W_gate[e]ᵀ) (· x[g] @ W_up[e]ᵀ) for each (row tile, column block); w (E, up_width, N),
    x (·, N), out (num_rows, K), h (num_rows, up_width).
    JOINT (SwiGLU with USE_TMA only): gate and up in one 2·BLOCK_N-wide dot (:func:`gate_up_tile`).
    TMA_STORE: full tiles' activations stored through a descriptor."""
    pid = tl.program_id(0)
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(K, BLOCK_N)
    up_width = 2 * K if ACTIVATION == 0 else K
    offs_n = tl.arange(0, BLOCK_N)
    w_desc = w_ptr  # the pointer path ignores it
    if USE_TMA:
        w_desc = gate_up_desc(w_ptr, E, up_width, N, K, BLOCK_N, BLOCK_K, JOINT)
    a_desc = x_ptr
    if A_TMA:
        # Contiguous rows (no gather): a block past the tile's end reads the next expert's
        # rows into masked output rows; past the last row TMA reads zeros.
        a_desc = tl.make_tensor_descriptor(x_ptr, shape=[num_rows, N], strides=[N, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    if TMA_STORE:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[num_rows, K], strides=[K, 1],
                                             block_shape=[BLOCK_M, BLOCK_N])
    for work in tl.range(pid, num_tiles * n_blocks, num_programs):
        e, row0, rows, rmask, nb, row_end = tile_work(work, n_blocks, num_tiles, tile_expert_ptr, tile_start_ptr,
                                                      tile_end_ptr, BLOCK_M, GROUP_M)
        if HAS_GATHER:
            src = (tl.load(gather_ptr + rows, mask=rmask, other=0) // divisor).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        cols = nb * BLOCK_N + offs_n
        cmask = cols < K
        acc_g, acc_u = gate_up_tile(x_ptr + src * N, rmask, w_ptr + e * up_width * N, w_desc,
                                    (e * up_width + nb * BLOCK_N).to(tl.int32), cols, cmask, N, K, ACTIVATION,
                                    BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, a_desc, row0, A_TMA,
                                    JOINT, e.to(tl.int32), nb * BLOCK_N)
        act = activation_epilogue(acc_g, acc_u, ACTIVATION)
        omask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        if TMA_STORE:
            if row_end - row0 == BLOCK_M:
                out_desc.store([row0, nb * BLOCK_N], act.to(out_ptr.dtype.element_ty))
            else:
                tl.store(out_ptr + rows64[:, None] * K + cols[None, :], act.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            tl.store(out_ptr + rows64[:, None] * K + cols[None, :], act.to(out_ptr.dtype.element_ty), mask=omask)
        if STORE_H:
            tl.store(h_ptr + rows64[:, None] * up_width + cols[None, :], acc_g.to(h_ptr.dtype.element_ty), mask=omask)
            if ACTIVATION == 0:
                tl.store(h_ptr + rows64[:, None] * up_width + K + cols[None, :], acc_u.to(h_ptr.dtype.element_ty),
                         mask=omask)


@triton.jit
def gemm0_flat_kernel(
    x_ptr, w_ptr, out_ptr, h_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    N, K, E, num_programs, num_rows,
    ACTIVATION: tl.constexpr, STORE_H: tl.constexpr, JOINT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """:func:`gemm0_kernel` over contiguous rows as one flat loop over (tile, k step) steps
    (``persistent = 2``, as :func:`interlace.kernels.expert_gemm.grouped.gemm_flat_kernel`): x rows,
    weights and the activations through TMA descriptors; SwiGLU's gate and up in one double-width
    dot (JOINT) or two dots, GELU/ReLU one. The pre-activation h, when stored, takes masked stores."""
    pid = tl.program_id(0)
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(K, BLOCK_N)
    k_steps = tl.cdiv(N, BLOCK_K)
    my_items = flat_items(num_tiles, n_blocks, pid, num_programs)
    up_width = 2 * K if ACTIVATION == 0 else K
    a_desc = tl.make_tensor_descriptor(x_ptr, shape=[num_rows, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = gate_up_desc(w_ptr, E, up_width, N, K, BLOCK_N, BLOCK_K, JOINT)
    out_win = window_map(out_ptr, num_rows, K, BLOCK_M, BLOCK_N)
    ki, work, e, row0, nb, row_end = flat_start(pid, num_programs, k_steps)
    W: tl.constexpr = 2 * BLOCK_N if JOINT else BLOCK_N
    acc = tl.zeros((BLOCK_M, W), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in tl.range(0, my_items * k_steps):
        ki, work, e, row0, nb, row_end = flat_next(ki, k_steps, work, e, row0, nb, row_end, num_programs, n_blocks,
                                                   num_tiles, tile_expert_ptr, tile_start_ptr, tile_end_ptr, GROUP_M)
        k0 = ki * BLOCK_K
        a = a_desc.load([row0, k0])
        if JOINT:
            b = tl.reshape(w_desc.load([(2 * e).to(tl.int32), nb * BLOCK_N, k0]), (2 * BLOCK_N, BLOCK_K))
            acc = tl.dot(a, b.T, acc)
        else:
            w_row = (e * up_width + nb * BLOCK_N).to(tl.int32)
            acc = tl.dot(a, w_desc.load([w_row, k0]).T, acc)
            if ACTIVATION == 0:
                acc_u = tl.dot(a, w_desc.load([w_row + K, k0]).T, acc_u)
        if ki == k_steps - 1:
            if JOINT:
                acc_g, acc_up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
            else:
                acc_g, acc_up = acc, acc_u
            store_tile(out_win, out_ptr, activation_epilogue(acc_g, acc_up, ACTIVATION), row0, row_end, nb, K,
                       BLOCK_M, BLOCK_N)
            if STORE_H:
                rows = row0 + tl.arange(0, BLOCK_M)
                cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
                hmask = (rows < row_end)[:, None] & (cols < K)[None, :]
                h_rows = h_ptr + rows.to(tl.int64)[:, None] * up_width
                tl.store(h_rows + cols[None, :], acc_g.to(h_ptr.dtype.element_ty), mask=hmask)
                if ACTIVATION == 0:
                    tl.store(h_rows + K + cols[None, :], acc_up.to(h_ptr.dtype.element_ty), mask=hmask)
            acc = tl.zeros((BLOCK_M, W), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


def gemm0_flat_stages(c0: GemmConfig, store_h: bool) -> int:
    """Pipeline stages of the flat GEMM0 (:func:`gemm0_flat_kernel`). Storing h takes masked
    stores, whose layout-conversion buffer leaves room for at most 3 stages of 128 × 2·128 tiles
    on Hopper (sm90 compile: 4 stages need 229.5 KB without it; a test compiles the tables'
    configs both ways)."""
    return min(c0.num_stages, 3) if store_h else c0.num_stages


class Gemm0Form(NamedTuple):
    """How GEMM0 runs a config on these operands (:func:`gemm0_form`)."""
    x: torch.Tensor  # the rows it reads: x, or their contiguous copy
    gather: torch.Tensor | None
    divisor: int
    a_tma: bool  # A rows through a descriptor
    flat: bool  # the flat loop (:func:`gemm0_flat_kernel`)
    joint: bool  # gate and up in one double-width dot
    tma_store: bool  # the nested loop's full tiles stored through a descriptor
    stages: int


def gemm0_form(x, gather, divisor, num_rows, act, store_h: bool, activation: str, c0: GemmConfig,
               tma: bool) -> Gemm0Form:
    """GEMM0's operands and flags as ``c0`` runs on them. With ``a_tma`` and a gather, the rows
    are first copied contiguous (Hopper has no TMA gather: the permuted token matrix is written
    once, R·N elements; the table picks it only where it measured faster than the gather fused
    into the A load)."""
    a_tma = bool(c0.a_tma) and tma
    if a_tma and gather is not None:
        from interlace.kernels.rows import gather_rows

        x, gather, divisor = gather_rows(x, gather[:num_rows], divisor), None, 1
    a_tma = a_tma and tma_rows_ok(x)
    flat = c0.persistent == 2 and a_tma and tma_rows_ok(act)
    return Gemm0Form(x, gather, divisor, a_tma, flat, bool(c0.joint) and tma and activation == "swiglu",
                     bool(c0.tma_store) and tma and tma_rows_ok(act) and not flat,
                     gemm0_flat_stages(c0, store_h) if flat else c0.num_stages)


def launch_gemm0(x: torch.Tensor, gather: torch.Tensor | None, divisor: int, w_up: torch.Tensor, act: torch.Tensor,
                 h: torch.Tensor | None, sched0: TileSchedule, num_rows: int, activation: str, c0: GemmConfig,
                 tma: bool) -> torch.Tensor:
    """act (num_rows, K) (and h (num_rows, up_width) when not None) = GEMM0 of the rows
    ``x[gather // divisor]`` (or x) over ``sched0``; w_up (E, up_width, N). ``tma``: the
    weights may go through descriptors (:func:`interlace.kernels.tma.use_tma`, allocator set)."""
    check_config(c0)
    E, K = w_up.shape[0], act.shape[1]
    p0 = num_programs(x.device, sched0.max_tiles * cdiv(K, c0.block_n))
    f = gemm0_form(x, gather, divisor, num_rows, act, h is not None, activation, c0, tma)
    N = f.x.shape[1]
    if f.flat:
        launch(gemm0_flat_kernel, (p0,),
            f.x, w_up, act, h if h is not None else act, sched0.expert, sched0.start, sched0.end, sched0.count,
            N, K, E, p0, num_rows,
            ACTIVATION=ACTIVATION_ID[activation], STORE_H=h is not None, JOINT=f.joint,
            BLOCK_M=c0.block_m, BLOCK_N=c0.block_n, BLOCK_K=c0.block_k, GROUP_M=c0.group_m,
            num_warps=c0.num_warps, num_stages=f.stages,
        )
        return act
    launch(gemm0_kernel, (p0,),
        f.x, f.gather if f.gather is not None else sched0.start, w_up, act, h if h is not None else act,
        sched0.expert, sched0.start, sched0.end, sched0.count, N, K, E, f.divisor, p0, num_rows,
        ACTIVATION=ACTIVATION_ID[activation], HAS_GATHER=f.gather is not None, STORE_H=h is not None, USE_TMA=tma,
        BLOCK_M=c0.block_m, BLOCK_N=c0.block_n, BLOCK_K=c0.block_k, GROUP_M=c0.group_m,
        A_TMA=f.a_tma, JOINT=f.joint, TMA_STORE=f.tma_store, num_warps=c0.num_warps, num_stages=f.stages,
    )
    return act
