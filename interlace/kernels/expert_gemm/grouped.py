"""A grouped GEMM over expert-major rows with strided per-expert weights: the forward's down
projection ``act @ W_downᵀ`` (GEMM1), and in the backward ``dy @ W_down`` with the activation's
derivative in the epilogue (writing d(pre-activation) from the stored pre-activation) and
``d_h @ W_up`` (dx).

Two kernels, one launcher (:func:`launch_gemm`):

* :func:`gemm_kernel` — a persistent loop per work item (row tile × column block). On Hopper the
  weights come through a TMA descriptor, and as the config says the A rows too (``a_tma``) and
  full tiles of a plain-epilogue GEMM stored through a descriptor (``tma_store``: the store
  drains while the next tile's main loop starts; an expert's partial last tile takes a masked
  store, as a whole box would overwrite the next expert's first rows).
* :func:`gemm_flat_kernel` — ``persistent = 2``, the plain epilogue only: one flat loop over
  (tile, k step) steps, A, B and the output through TMA, so the pipeline runs across tiles (for
  short reductions, such as the down projection's K = ffn, the nested loop's per-tile pipeline
  fill and epilogue are a large share).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interlace.kernels.expert_gemm.configs import check_config, num_programs
from interlace.kernels.expert_gemm.schedule import TileSchedule, flat_items, flat_next, flat_start, tile_schedule, tile_work
from interlace.kernels.expert_gemm.tile import store_tile, window_map
from interlace.kernels.launch import cdiv, launch
from interlace.kernels.tma import tma_rows_ok
from interlace.tuning.tables import GemmConfig


@triton.jit
def _dswiglu_store(d_act, h_ptr, out_ptr, rows64, rmask, cols, COLS):
    """d(gate), d(up) of SwiGLU for a (rows × cols) block of d(act) from the stored pre-activation
    h = [gate | up] (R, 2·COLS), written to out in the same layout."""
    omask = rmask[:, None] & (cols < COLS)[None, :]
    gate = tl.load(h_ptr + rows64[:, None] * (2 * COLS) + cols[None, :], mask=omask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + rows64[:, None] * (2 * COLS) + COLS + cols[None, :], mask=omask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_gate = d_act * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(out_ptr + rows64[:, None] * (2 * COLS) + cols[None, :], d_gate.to(out_ptr.dtype.element_ty), mask=omask)
    tl.store(out_ptr + rows64[:, None] * (2 * COLS) + COLS + cols[None, :],
             (d_act * gate * sig).to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def gemm_kernel(
    a_ptr, w_ptr, out_ptr, h_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    COLS, RED, E, num_programs, num_rows,
    B_TRANS: tl.constexpr,  # B_e stored (COLS, RED) row-major (a weight used as Wᵀ); else (RED, COLS)
    EPILOGUE: tl.constexpr,  # 0 plain; 1 d(SwiGLU); 2 d(GELU); 3 d(ReLU) — backward of GEMM0's activation
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_TMA: tl.constexpr = False, TMA_STORE: tl.constexpr = False,
):
    """out[rows of e] = a[rows] (R, RED) @ B_e (RED, COLS) with B_e the e-th of E contiguous
    weight matrices, stored as B_eᵀ (COLS, RED) when B_TRANS else as B_e. With an
    activation-gradient epilogue, ``a`` is d(act), B_e the down projection, and the kernel
    writes d(pre-activation) from the stored pre-activation h.

    TMA_STORE (plain epilogue only): a full tile (BLOCK_M rows of one expert) is stored through a
    TMA descriptor, which drains while the next tile's main loop starts; a partial tile's box
    would overwrite the next expert's first rows, so those take the masked store."""
    first = tl.program_id(0)
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(COLS, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if B_TRANS:
        stride_bk = 1
        stride_bn = RED
    else:
        stride_bk = COLS
        stride_bn = 1
    if USE_TMA:
        # A block that runs past expert e's matrix reads the next expert's rows: they meet zero
        # A columns (RED) or land in masked output columns (COLS); past the last expert TMA reads 0.
        if B_TRANS:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * COLS, RED], strides=[RED, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * RED, COLS], strides=[COLS, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
    if A_TMA:
        # A block past the tile's end reads the next expert's rows into masked output rows.
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[num_rows, RED], strides=[RED, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    if TMA_STORE:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[num_rows, COLS], strides=[COLS, 1],
                                             block_shape=[BLOCK_M, BLOCK_N])
    for work in tl.range(first, num_tiles * n_blocks, num_programs):
        e, row0, rows, rmask, nb, row_end = tile_work(work, n_blocks, num_tiles, tile_expert_ptr, tile_start_ptr,
                                                      tile_end_ptr, BLOCK_M, GROUP_M)
        rows64 = rows.to(tl.int64)
        cols = nb * BLOCK_N + offs_n
        cmask = cols < COLS
        w_base = w_ptr + e * RED * COLS
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, RED, BLOCK_K):
            kk = k0 + offs_k
            kmask = kk < RED
            if A_TMA:
                a = a_desc.load([row0, k0])
            else:
                a = tl.load(a_ptr + rows64[:, None] * RED + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                            other=0.0)
            if USE_TMA:
                if B_TRANS:
                    b = w_desc.load([(e * COLS + nb * BLOCK_N).to(tl.int32), k0]).T
                else:
                    b = w_desc.load([(e * RED + k0).to(tl.int32), nb * BLOCK_N])
            else:
                b = tl.load(w_base + kk[:, None].to(tl.int64) * stride_bk + cols[None, :].to(tl.int64) * stride_bn,
                            mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
        omask = rmask[:, None] & cmask[None, :]
        if EPILOGUE == 0:
            if TMA_STORE:
                if row_end - row0 == BLOCK_M:
                    out_desc.store([row0, nb * BLOCK_N], acc.to(out_ptr.dtype.element_ty))
                else:
                    tl.store(out_ptr + rows64[:, None] * COLS + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                             mask=omask)
            else:
                tl.store(out_ptr + rows64[:, None] * COLS + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                         mask=omask)
        elif EPILOGUE == 1:
            _dswiglu_store(acc, h_ptr, out_ptr, rows64, rmask, cols, COLS)
        else:
            pre = tl.load(h_ptr + rows64[:, None] * COLS + cols[None, :], mask=omask, other=0.0).to(tl.float32)
            if EPILOGUE == 2:
                cdf = 0.5 * (1.0 + tl.erf(pre * 0.7071067811865476))
                deriv = cdf + pre * 0.3989422804014327 * tl.exp(-0.5 * pre * pre)
            else:
                deriv = tl.where(pre > 0, 1.0, 0.0)
            tl.store(out_ptr + rows64[:, None] * COLS + cols[None, :], (acc * deriv).to(out_ptr.dtype.element_ty),
                     mask=omask)


@triton.jit
def gemm_flat_kernel(
    a_ptr, w_ptr, out_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    COLS, RED, E, num_programs, num_rows,
    B_TRANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """:func:`gemm_kernel` with the plain epilogue as one flat loop over (tile, k step) steps
    (``persistent = 2``; the persistent matmul tutorial's form): the software pipeline runs
    across tiles, so the next tile's first A and B blocks load while this tile's last steps and
    its store run. A, B and the output all go through TMA descriptors. For short reductions (the
    down projection's K = ffn of 768–2048: 12–32 steps per tile) the per-tile pipeline fill and
    epilogue of the nested loop are a large share (Triton 3.6 cannot flatten that loop once it
    holds the TMA store: FuseNestedLoops fails on sm90)."""
    pid = tl.program_id(0)
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(COLS, BLOCK_N)
    k_steps = tl.cdiv(RED, BLOCK_K)
    my_items = flat_items(num_tiles, n_blocks, pid, num_programs)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[num_rows, RED], strides=[RED, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_TRANS:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * COLS, RED], strides=[RED, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * RED, COLS], strides=[COLS, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    out_win = window_map(out_ptr, num_rows, COLS, BLOCK_M, BLOCK_N)
    ki, work, e, row0, nb, row_end = flat_start(pid, num_programs, k_steps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, my_items * k_steps):
        ki, work, e, row0, nb, row_end = flat_next(ki, k_steps, work, e, row0, nb, row_end, num_programs, n_blocks,
                                                   num_tiles, tile_expert_ptr, tile_start_ptr, tile_end_ptr, GROUP_M)
        k0 = ki * BLOCK_K
        a = a_desc.load([row0, k0])
        if B_TRANS:
            b = w_desc.load([(e * COLS + nb * BLOCK_N).to(tl.int32), k0]).T
        else:
            b = w_desc.load([(e * RED + k0).to(tl.int32), nb * BLOCK_N])
        acc = tl.dot(a, b, acc)
        if ki == k_steps - 1:
            store_tile(out_win, out_ptr, acc, row0, row_end, nb, COLS, BLOCK_M, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


def plain_gemm_tma(config: GemmConfig, tma: bool, a: torch.Tensor, out: torch.Tensor) -> tuple[bool, bool]:
    """(A rows through a descriptor, full tiles stored through one) of a plain-epilogue GEMM's nested loop."""
    return bool(config.a_tma) and tma and tma_rows_ok(a), bool(config.tma_store) and tma and tma_rows_ok(out)


def launch_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, h: torch.Tensor | None, ends: torch.Tensor,
                num_rows: int, cols: int, red: int, b_trans: bool, epilogue: int, config: GemmConfig,
                schedule: TileSchedule | None = None, tma: bool = False) -> torch.Tensor:
    """out (num_rows, cols) = a (num_rows, red) @ B_e per expert, w (E, cols, red) with
    ``b_trans`` (B_e = w[e]ᵀ) else (E, red, cols); rows of expert e end at ``ends[e]``.
    ``epilogue``: 0 plain, else 1 + the activation's id (d(pre-activation) from ``h``).
    ``schedule``: a tile schedule of ``config.block_m`` rows to reuse (else one is built)."""
    check_config(config)
    if config.persistent == 2 and epilogue != 0:
        raise ValueError(f"GEMM config {config}: persistent = 2 (the flat loop) has the plain epilogue only; "
                         "with an activation-gradient epilogue use unfused_act = 1 or persistent = 0")
    sched = schedule or tile_schedule(ends, num_rows, config.block_m)
    p = num_programs(a.device, sched.max_tiles * cdiv(cols, config.block_n))
    if config.persistent == 2 and tma and tma_rows_ok(a) and tma_rows_ok(out):
        launch(gemm_flat_kernel, (p,),
            a, w, out, sched.expert, sched.start, sched.end, sched.count, cols, red, w.shape[0], p, num_rows,
            B_TRANS=b_trans, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return out
    a_tma, tma_store = plain_gemm_tma(config, tma, a, out)
    launch(gemm_kernel, (p,),
        a, w, out, h if h is not None else out, sched.expert, sched.start, sched.end, sched.count,
        cols, red, w.shape[0], p, num_rows, B_TRANS=b_trans, EPILOGUE=epilogue, USE_TMA=tma,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        A_TMA=a_tma, TMA_STORE=tma_store and epilogue == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
