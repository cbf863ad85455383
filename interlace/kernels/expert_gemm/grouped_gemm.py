"""Grouped GEMMs for the expert FFN in Triton, with the row gather fused into the A load.

Rows are expert-major: expert e owns rows ``[offs[e-1], offs[e])``. Three kernels:

* ``_tile_schedule_kernel`` — from the per-expert row ends, on the device, the list of
  (expert, first row, end row) tiles of height BLOCK_M in expert-major order and their count.
  Nothing is padded and nothing is read back by the host, so the whole expert block stays
  free of host syncs (and CUDA-graph capturable: grids are sized from host-known bounds).
* ``_gemm0_kernel`` — ``act(x[g] @ W_gate^T) * (x[g] @ W_up^T)`` for SwiGLU (one projection
  for GELU/ReLU): the A rows are read through the gather index ``g`` (``rows // divisor``), so
  the permuted token matrix is never written; gate and up accumulate in the same tile and the
  activation runs in the epilogue; the pre-activation is stored only when asked (backward).
* ``_gemm_kernel`` — a grouped GEMM with strided weights: the down projection
  ``act @ W_down^T`` forward; in backward ``dy @ W_down`` with the activation's derivative in
  the epilogue (writing d(pre-activation) from the stored pre-activation) and ``d_h @ W_up``.
* ``_gemm0_flat_kernel`` and ``_gemm_flat_kernel`` — GEMM0 and the plain-epilogue GEMM as one
  flat loop over (tile, k step) steps (``persistent = 2`` in the tables), A, B and the outputs
  through TMA, so the pipeline runs across tiles: the next tile's loads go under this tile's
  last steps and its store (1–9% faster on most tables' entries, runs 113–114).
* ``_wgrad_kernel`` — per-expert weight gradients ``aᵀ b`` over the expert's rows, with the
  same gather fused into the load of b; ``_wgrad_persistent_kernel`` and ``_wgrad_flat_kernel``
  the persistent forms over TMA-fed rows (the flat one pipelines across output blocks, which
  short reductions and ragged experts need: runs 89, 91).

Both GEMM kernels are persistent: a grid of at most (SM count × programs per SM) programs walks
the (tile, column block) work items, so no launch depends on the data. The SM count is read
from the device, never assumed. Work items are visited in groups of ``group_m`` row tiles
(an L2 swizzle over the column blocks): the programs running at one time share a few column
blocks of one expert's weights instead of streaming all of them once per row tile.

On Hopper and newer the weights (the B operand) are read through TMA tensor descriptors
(``tl.make_tensor_descriptor`` over the (E·rows, cols) weight matrix; Triton's allocator holds
their scratch). The A operand is a pipelined ``tl.load`` (GEMM0 gathers its rows in that load),
or, where the tuning table says ``a_tma`` (measured faster on the larger shapes, run 38), a TMA
descriptor too: GEMM0 then reads a contiguous copy of the gathered rows (Hopper has no TMA
gather). The pointer path (the same kernels with ``USE_TMA=False``) serves the interpreter and
older GPUs; ``INTERLACE_TMA=0/1`` forces either.

With ``joint`` (SwiGLU, TMA weights) GEMM0 loads a tile's gate and up weight rows as one 3-D
TMA block and runs one double-width dot instead of two (1–3% faster forward on most presets,
runs 84–85). With ``tma_store`` the nested-loop kernels store a full tile of GEMM0's
activations or of a plain-epilogue GEMM through a TMA descriptor, which drains under the next
tile's main loop. An expert's partial last tile is stored masked: a whole box would write into
the next expert's rows.

The d(pre-activation) GEMM applies the activation's derivative in its epilogue, or (SwiGLU,
``unfused_act`` in the table) stores d(act) and leaves the derivative to one elementwise pass:
the epilogue's two h loads and two stores after a short main loop cost more (run 31).

:class:`TritonExpertFFN` runs forward and backward on these kernels; gradients of the gathered
rows are returned to the caller's rows by a gather (bijection) or a fixed-order sum (a token's
k rows): deterministic, no atomics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from interlace.kernels import alloc
from interlace.kernels.expert_gemm.tile import activation_epilogue, gate_up_tile, joint_gate_up_desc
from interlace.kernels.comet.flags import count_done, fence_proxy_async, wait_count
from interlace.kernels.launch import cdiv, launch, next_power_of_2
from interlace.kernels.rows import use_triton
from interlace.tuning.tables import GemmConfig, ShapeClass, lookup, rows_bucket
from interlace.tuning.tables import generation as tuning_generation


def _config_from_env(name: str) -> GemmConfig | None:
    """``INTERLACE_GEMM0=bm,bn,bk,warps,stages[,group_m,flatten,unfused_act,a_tma,persistent,joint,tma_store,chain]``
    (any prefix of the :class:`GemmConfig` fields, in order) forces a config."""
    value = os.environ.get(name)
    return GemmConfig(*(int(v) for v in value.split(","))) if value else None


# Defaults where no tuning table covers the device (lookup warns once): chosen from a handful
# tried on an H100 (docs/benchmarks.md, run 9); 5 stages of GEMM0 failed there.
GEMM0_DEFAULT = GemmConfig(128, 128, 64, 8, 4)
GEMM1_DEFAULT = GemmConfig(128, 256, 64, 8, 3)
# Backward: the d(pre-activation) GEMM (its epilogue reads both halves of h), the dx GEMM, the
# per-expert weight-gradient kernel. Untuned guesses until a table covers the device.
BWD_ACT_DEFAULT = GemmConfig(128, 128, 64, 8, 4)
BWD_DX_DEFAULT = GemmConfig(128, 256, 64, 8, 4)
WGRAD_DEFAULT = GemmConfig(128, 128, 64, 8, 4)
INTERPRETER_CONFIG = GemmConfig(16, 16, 16, 4, 1)
PROGRAMS_PER_SM = 1


@triton.jit
def _tile_schedule_kernel(
    ends_ptr,  # (E,) int32 inclusive row ends per expert
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,  # (max_tiles,) int32 each, out
    num_tiles_ptr,  # (1,) int32, out
    ready_ptr,  # (max_tiles + 1,) int32, out (zeroed) with ZERO_READY
    E, max_tiles,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, ZERO_READY: tl.constexpr = False,
):
    pid = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    ends = tl.load(ends_ptr + e, mask=e < E, other=0)
    starts = tl.load(ends_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    counts = tl.where(e < E, ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    first_tile = tl.cumsum(tiles, axis=0) - tiles
    total = tl.sum(tiles, axis=0)
    if pid == 0:
        tl.store(num_tiles_ptr, total)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    owns = (first_tile[None, :] <= t[:, None]) & (t[:, None] < (first_tile + tiles)[None, :])
    expert = tl.sum(tl.where(owns, e[None, :], 0), axis=1)
    local = t - tl.sum(tl.where(owns, first_tile[None, :], 0), axis=1)
    row0 = tl.sum(tl.where(owns, starts[None, :], 0), axis=1) + local * BLOCK_M
    row_end = tl.minimum(row0 + BLOCK_M, tl.sum(tl.where(owns, ends[None, :], 0), axis=1))
    valid = (t < total) & (t < max_tiles)
    tl.store(tile_expert_ptr + t, expert, mask=valid)
    tl.store(tile_start_ptr + t, row0, mask=valid)
    tl.store(tile_end_ptr + t, row_end, mask=valid)
    if ZERO_READY:
        tl.store(ready_ptr + t, 0, mask=t < max_tiles)
        if pid == 0:
            tl.store(ready_ptr + max_tiles, 0)


@dataclass
class TileSchedule:
    expert: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    count: torch.Tensor  # (1,) int32 on the device
    max_tiles: int
    block_m: int
    # with_ready: (max_tiles + 1,) int32 zeroed on the device — finished GEMM0 items per row tile,
    # then all of them (the chained forward's counts, interlace.kernels.expert_gemm.chain)
    ready: torch.Tensor | None = None


def tile_schedule(ends: torch.Tensor, num_rows: int, block_m: int, with_ready: bool = False) -> TileSchedule:
    """Tiles of ``block_m`` rows per expert from the inclusive row ends (device, no sync);
    ``with_ready``: zeroed readiness counts too, in the same launch."""
    E = ends.numel()
    max_tiles = cdiv(num_rows, block_m) + E
    # One allocation (host time per call); each list starts 16-byte aligned, as the kernels'
    # specializations assume of a fresh tensor.
    stride = cdiv(max_tiles, 4) * 4
    lists = alloc.empty((3 * stride + 4 + (stride + 4 if with_ready else 0),), torch.int32, ends.device)
    sched = TileSchedule(lists[:max_tiles], lists[stride:stride + max_tiles], lists[2 * stride:2 * stride + max_tiles],
                         lists[3 * stride:3 * stride + 1], max_tiles, block_m)
    if with_ready:
        sched.ready = lists[3 * stride + 4:3 * stride + 5 + max_tiles]
    e_pad = next_power_of_2(max(E, 1))
    block_t = max(1, min(64, 8192 // e_pad))
    launch(_tile_schedule_kernel, (cdiv(max_tiles, block_t),),
        ends, sched.expert, sched.start, sched.end, sched.count, sched.count if sched.ready is None else sched.ready,
        E, max_tiles, BLOCK_M=block_m, E_PAD=e_pad, BLOCK_T=block_t, ZERO_READY=with_ready, num_warps=4,
    )
    return sched


@triton.jit
def _tile_work(work, n_blocks, num_tiles, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
               BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """Work item → (expert, its rows, their mask, column block) of the tile schedule.

    Items come in groups of GROUP_M consecutive row tiles × all column blocks, column block
    major inside a group (the Triton tutorials' L2 swizzle), so concurrent programs share the
    weight column blocks they read."""
    per_group = GROUP_M * n_blocks
    first_tile = (work // per_group) * GROUP_M
    group_size = tl.minimum(num_tiles - first_tile, GROUP_M)
    tile = first_tile + (work % per_group) % group_size
    nb = (work % per_group) // group_size
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    row0 = tl.load(tile_start_ptr + tile)
    row_end = tl.load(tile_end_ptr + tile)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    return e, row0, rows, rmask, nb, row_end


@triton.jit
def _tile_coords(work, n_blocks, num_tiles, tile_expert_ptr, tile_start_ptr, tile_end_ptr, GROUP_M: tl.constexpr):
    """:func:`_tile_work`'s scalars only: (expert, first row, column block, end row)."""
    per_group = GROUP_M * n_blocks
    first_tile = (work // per_group) * GROUP_M
    group_size = tl.minimum(num_tiles - first_tile, GROUP_M)
    tile = first_tile + (work % per_group) % group_size
    nb = (work % per_group) // group_size
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    return e, tl.load(tile_start_ptr + tile), nb, tl.load(tile_end_ptr + tile)


@triton.jit
def _tile_of(work, n_blocks, num_tiles, GROUP_M: tl.constexpr):
    """The row tile (index into the tile schedule) of work item ``work`` (:func:`_tile_work`'s order)."""
    per_group = GROUP_M * n_blocks
    first_tile = (work // per_group) * GROUP_M
    return first_tile + (work % per_group) % tl.minimum(num_tiles - first_tile, GROUP_M)


@triton.jit
def _window_map(ptr, rows, cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """A **window map** over a row-major (rows, cols) matrix: the 3-D view (s, i, c) ↦ row s + i,
    column c, whose middle dimension has BLOCK_ROWS entries, loaded or stored in boxes of
    (1, BLOCK_ROWS, BLOCK_COLS). Moving a box's middle coordinate below 0 (loads) or past
    BLOCK_ROWS - 1 (stores) puts some of its rows outside that dimension: TMA reads those as
    zeros and drops their stores, while the other rows are rows of the matrix. So one map made
    before a loop bounds every step at a step-dependent row, where a 2-D map would have to be
    made again per step (a global write and a proxy fence each). Boxes never reach before row 0
    or past ``rows``; TMA stores take no negative coordinate (an illegal instruction on H200,
    run 141)."""
    return tl.make_tensor_descriptor(ptr, shape=[rows, BLOCK_ROWS, cols], strides=[cols, cols, 1],
                                     block_shape=[1, BLOCK_ROWS, BLOCK_COLS])


@triton.jit
def _flat_items(num_tiles, n_blocks, pid, num_programs):
    """Work items (tile, column block) of program ``pid`` in a persistent grid of ``num_programs``."""
    return tl.maximum(tl.cdiv(num_tiles * n_blocks - pid, num_programs), 0)


@triton.jit
def _flat_start(pid, num_programs, k_steps):
    """The state :func:`_flat_next` starts from: (ki, work, expert, first row, column block, end row)."""
    return k_steps - 1, pid - num_programs, tl.full([], 0, tl.int64), 0, 0, 0


@triton.jit
def _flat_next(ki, k_steps, work, e, row0, nb, row_end, num_programs, n_blocks, num_tiles,
               tile_expert_ptr, tile_start_ptr, tile_end_ptr, GROUP_M: tl.constexpr):
    """One step of a flat (tile, k step) loop: the next k step, and at a tile's first step the
    program's next work item and its coordinates (from :func:`_flat_start`)."""
    ki = tl.where(ki == k_steps - 1, 0, ki + 1)
    if ki == 0:
        work += num_programs
        e, row0, nb, row_end = _tile_coords(work, n_blocks, num_tiles, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                                            GROUP_M)
    return ki, work, e, row0, nb, row_end


@triton.jit
def _gemm0_kernel(
    x_ptr, gather_ptr, w_ptr, out_ptr, h_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    N, K, E, divisor, num_programs, num_rows,
    ACTIVATION: tl.constexpr,  # 0 swiglu, 1 gelu, 2 relu
    HAS_GATHER: tl.constexpr, STORE_H: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, A_TMA: tl.constexpr = False, JOINT: tl.constexpr = False,
    TMA_STORE: tl.constexpr = False,
):
    """act(x[g] @ W_gate[e]ᵀ) (· x[g] @ W_up[e]ᵀ) for each (row tile, column block); w (E, up_width, N).
    JOINT (SwiGLU with USE_TMA only): gate and up in one 2·BLOCK_N-wide dot (:func:`gate_up_tile`).
    TMA_STORE: full tiles' activations stored through a descriptor (as in :func:`_gemm_kernel`)."""
    _gemm0_loop(tl.program_id(0), num_programs, x_ptr, gather_ptr, w_ptr, out_ptr, h_ptr, tile_expert_ptr,
                tile_start_ptr, tile_end_ptr, tl.load(num_tiles_ptr), N, K, E, divisor, num_rows, num_tiles_ptr,
                num_tiles_ptr, ACTIVATION, HAS_GATHER, STORE_H, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, FLATTEN,
                A_TMA, JOINT, TMA_STORE, SIGNAL=False, FENCE=False)


@triton.jit
def _gemm0_loop(
    pid, num_programs, x_ptr, gather_ptr, w_ptr, out_ptr, h_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    num_tiles, N, K, E, divisor, num_rows, ready_ptr, done_ptr,
    ACTIVATION: tl.constexpr, HAS_GATHER: tl.constexpr, STORE_H: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, A_TMA: tl.constexpr, JOINT: tl.constexpr, TMA_STORE: tl.constexpr,
    SIGNAL: tl.constexpr, FENCE: tl.constexpr, ASM: tl.constexpr = False,
):
    """:func:`_gemm0_kernel`'s work, program ``pid`` of ``num_programs``. SIGNAL (the chained
    forward, :mod:`interlace.kernels.expert_gemm.chain`): each item is counted in ``ready_ptr[row tile]`` and
    ``done_ptr`` once its stores have landed — at the next item's epilogue (long landed by then,
    so no wait) or after the loop for the last, through :func:`count_done` (FENCE: TMA stores;
    ASM: its barrier in inline assembly, off in the interpreter)."""
    n_blocks = tl.cdiv(K, BLOCK_N)
    up_width = 2 * K if ACTIVATION == 0 else K
    offs_n = tl.arange(0, BLOCK_N)
    w_desc = w_ptr  # the pointer path ignores it
    if USE_TMA:
        if JOINT:
            w_desc = joint_gate_up_desc(w_ptr, E, N, K, BLOCK_N, BLOCK_K)
        else:
            # Block rows past an expert's K gate (or up) rows belong to masked output columns.
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * up_width, N], strides=[N, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
    a_desc = x_ptr
    if A_TMA:
        # Contiguous rows (no gather): a block past the tile's end reads the next expert's
        # rows into masked output rows; past the last row TMA reads zeros.
        a_desc = tl.make_tensor_descriptor(x_ptr, shape=[num_rows, N], strides=[N, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    if TMA_STORE:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[num_rows, K], strides=[K, 1],
                                             block_shape=[BLOCK_M, BLOCK_N])
    prev = -1  # SIGNAL: the row tile of this program's previous item, not yet counted
    # FLATTEN lets the software pipeline run across work items (next tile's loads under this epilogue).
    for work in tl.range(pid, num_tiles * n_blocks, num_programs, flatten=FLATTEN):
        e, row0, rows, rmask, nb, row_end = _tile_work(work, n_blocks, num_tiles, tile_expert_ptr, tile_start_ptr,
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
        if SIGNAL:
            if prev >= 0:
                count_done(ready_ptr + prev, done_ptr, FENCE, ASM)
            prev = _tile_of(work, n_blocks, num_tiles, GROUP_M)
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
    if SIGNAL:
        if prev >= 0:
            count_done(ready_ptr + prev, done_ptr, FENCE, ASM)


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
def _gemm_kernel(
    a_ptr, w_ptr, out_ptr, h_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    COLS, RED, E, num_programs, num_rows,
    B_TRANS: tl.constexpr,  # B_e stored (COLS, RED) row-major (a weight used as Wᵀ); else (RED, COLS)
    EPILOGUE: tl.constexpr,  # 0 plain; 1 d(SwiGLU); 2 d(GELU); 3 d(ReLU) — backward of GEMM0's activation
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, A_TMA: tl.constexpr = False, TMA_STORE: tl.constexpr = False,
):
    """out[rows of e] = a[rows] (R, RED) @ B_e (RED, COLS) with B_e the e-th of E contiguous
    weight matrices, stored as B_eᵀ (COLS, RED) when B_TRANS else as B_e. With an
    activation-gradient epilogue, ``a`` is d(act), B_e the down projection, and the kernel
    writes d(pre-activation) from the stored pre-activation h.

    TMA_STORE (plain epilogue only): a full tile (BLOCK_M rows of one expert) is stored through a
    TMA descriptor, which drains while the next tile's main loop starts; a partial tile's box
    would overwrite the next expert's first rows, so those take the masked store."""
    _gemm_loop(tl.program_id(0), num_programs, a_ptr, w_ptr, out_ptr, h_ptr, tile_expert_ptr, tile_start_ptr,
               tile_end_ptr, tl.load(num_tiles_ptr), COLS, RED, E, num_rows, B_TRANS, EPILOGUE, USE_TMA, BLOCK_M,
               BLOCK_N, BLOCK_K, GROUP_M, FLATTEN, A_TMA, TMA_STORE)


@triton.jit
def _gemm_loop(
    first, num_programs, a_ptr, w_ptr, out_ptr, h_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles,
    COLS, RED, E, num_rows,
    B_TRANS: tl.constexpr, EPILOGUE: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, A_TMA: tl.constexpr, TMA_STORE: tl.constexpr,
    WAIT: tl.constexpr = False, ready_ptr=None, done_ptr=None, need=0, total_done=0, max_spins=0, error_ptr=None,
    rank=0, FENCE: tl.constexpr = False, STAGES: tl.constexpr = None,
):
    """:func:`_gemm_kernel`'s work items ``first``, ``first + num_programs``, .... WAIT (the chained
    forward, :mod:`interlace.kernels.expert_gemm.chain`): before an item, wait until ``ready_ptr[row tile]``
    counts ``need`` items of GEMM0 (:func:`wait_count`, bounded), until ``done_ptr`` shows all
    ``total_done`` counted, after which no item waits; FENCE: then a proxy fence, as A may come
    through TMA. STAGES: the main loop's pipeline depth (default: the launch's)."""
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
    # FLATTEN lets the software pipeline run across work items (next tile's loads under this epilogue).
    all_done = 0  # WAIT: every GEMM0 item counted (seen once: no more waits)
    for work in tl.range(first, num_tiles * n_blocks, num_programs, flatten=FLATTEN):
        e, row0, rows, rmask, nb, row_end = _tile_work(work, n_blocks, num_tiles, tile_expert_ptr, tile_start_ptr,
                                                       tile_end_ptr, BLOCK_M, GROUP_M)
        if WAIT:
            if all_done == 0:
                tile = _tile_of(work, n_blocks, num_tiles, GROUP_M)
                wait_count(ready_ptr + tile, need, max_spins, error_ptr, rank, e.to(tl.int32), tile)
                all_done = (tl.atomic_add(done_ptr, 0, sem="acquire", scope="gpu") >= total_done).to(tl.int32)
                if FENCE:
                    fence_proxy_async(0)
        rows64 = rows.to(tl.int64)
        cols = nb * BLOCK_N + offs_n
        cmask = cols < COLS
        w_base = w_ptr + e * RED * COLS
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, RED, BLOCK_K, num_stages=STAGES):
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
def _store_tile(out_win, out_ptr, val, row0, row_end, nb, COLS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A (BLOCK_M × BLOCK_N) output tile at rows ``row0 ..`` (valid below ``row_end``), column
    block ``nb``, through TMA (the store drains under the next tile's loads). A partial tile's
    box must not reach the next expert's first rows. ``out_win`` is the output's
    :func:`_window_map` (BLOCK_M rows), made once per program: the box at s = row_end - BLOCK_M,
    i = BLOCK_M - v (v valid rows) puts the tile's rows on rows row0 .. row_end-1 and its other
    rows past the middle dimension's end, where TMA drops them. Only a tile ending before row
    BLOCK_M (s would be negative) takes a map made here, ending at ``row_end``. (A map per partial tile costs a global write and a proxy fence in the loop; a
    masked store instead needs a layout-conversion buffer on top of the TMA store's, which the
    flat kernels' pipelines leave no shared memory for.)"""
    box = tl.reshape(val.to(out_ptr.dtype.element_ty), (1, BLOCK_M, BLOCK_N))
    if row_end >= BLOCK_M:
        out_win.store([row_end - BLOCK_M, BLOCK_M - (row_end - row0), nb * BLOCK_N], box)
    else:  # (a 3-D box too, so both stores share one staging buffer)
        part = tl.make_tensor_descriptor(out_ptr, shape=[1, row_end, COLS], strides=[COLS, COLS, 1],
                                         block_shape=[1, BLOCK_M, BLOCK_N])
        part.store([0, row0, nb * BLOCK_N], box)


@triton.jit
def _gemm_flat_kernel(
    a_ptr, w_ptr, out_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    COLS, RED, E, num_programs, num_rows,
    B_TRANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """:func:`_gemm_kernel` with the plain epilogue as one flat loop over (tile, k step) steps
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
    my_items = _flat_items(num_tiles, n_blocks, pid, num_programs)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[num_rows, RED], strides=[RED, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_TRANS:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * COLS, RED], strides=[RED, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * RED, COLS], strides=[COLS, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    out_win = _window_map(out_ptr, num_rows, COLS, BLOCK_M, BLOCK_N)
    ki, work, e, row0, nb, row_end = _flat_start(pid, num_programs, k_steps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, my_items * k_steps):
        ki, work, e, row0, nb, row_end = _flat_next(ki, k_steps, work, e, row0, nb, row_end, num_programs, n_blocks,
                                                    num_tiles, tile_expert_ptr, tile_start_ptr, tile_end_ptr, GROUP_M)
        k0 = ki * BLOCK_K
        a = a_desc.load([row0, k0])
        if B_TRANS:
            b = w_desc.load([(e * COLS + nb * BLOCK_N).to(tl.int32), k0]).T
        else:
            b = w_desc.load([(e * RED + k0).to(tl.int32), nb * BLOCK_N])
        acc = tl.dot(a, b, acc)
        if ki == k_steps - 1:
            _store_tile(out_win, out_ptr, acc, row0, row_end, nb, COLS, BLOCK_M, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _gemm0_flat_kernel(
    x_ptr, w_ptr, out_ptr, h_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    N, K, E, num_programs, num_rows,
    ACTIVATION: tl.constexpr, STORE_H: tl.constexpr, JOINT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """:func:`_gemm0_kernel` over contiguous rows as one flat loop over (tile, k step) steps
    (``persistent = 2``, as :func:`_gemm_flat_kernel`): x rows, weights and the activations
    through TMA descriptors; SwiGLU's gate and up in one double-width dot (JOINT) or two dots,
    GELU/ReLU one. The pre-activation h, when stored, takes masked stores."""
    _gemm0_flat_loop(tl.program_id(0), num_programs, x_ptr, w_ptr, out_ptr, h_ptr, tile_expert_ptr, tile_start_ptr,
                     tile_end_ptr, tl.load(num_tiles_ptr), N, K, E, num_rows, num_tiles_ptr, num_tiles_ptr,
                     ACTIVATION, STORE_H, JOINT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SIGNAL=False, FENCE=False)


@triton.jit
def _gemm0_flat_loop(
    pid, num_programs, x_ptr, w_ptr, out_ptr, h_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles,
    N, K, E, num_rows, ready_ptr, done_ptr,
    ACTIVATION: tl.constexpr, STORE_H: tl.constexpr, JOINT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SIGNAL: tl.constexpr, FENCE: tl.constexpr, ASM: tl.constexpr = False, STAGES: tl.constexpr = None,
):
    """:func:`_gemm0_flat_kernel`'s loop for program ``pid`` of ``num_programs``; SIGNAL and FENCE
    as in :func:`_gemm0_loop` (an item is counted at the next item's epilogue, before that
    item's store; the last after the loop). STAGES: the loop's pipeline depth (default: the launch's)."""
    n_blocks = tl.cdiv(K, BLOCK_N)
    k_steps = tl.cdiv(N, BLOCK_K)
    my_items = _flat_items(num_tiles, n_blocks, pid, num_programs)
    up_width = 2 * K if ACTIVATION == 0 else K
    a_desc = tl.make_tensor_descriptor(x_ptr, shape=[num_rows, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_K])
    if JOINT:
        w_desc = joint_gate_up_desc(w_ptr, E, N, K, BLOCK_N, BLOCK_K)
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * up_width, N], strides=[N, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    out_win = _window_map(out_ptr, num_rows, K, BLOCK_M, BLOCK_N)
    ki, work, e, row0, nb, row_end = _flat_start(pid, num_programs, k_steps)
    W: tl.constexpr = 2 * BLOCK_N if JOINT else BLOCK_N
    acc = tl.zeros((BLOCK_M, W), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    prev = -1  # SIGNAL: the row tile of this program's previous item, not yet counted
    for step in tl.range(0, my_items * k_steps, num_stages=STAGES):
        ki, work, e, row0, nb, row_end = _flat_next(ki, k_steps, work, e, row0, nb, row_end, num_programs, n_blocks,
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
            if SIGNAL:
                if prev >= 0:
                    count_done(ready_ptr + prev, done_ptr, FENCE, ASM)
                prev = _tile_of(work, n_blocks, num_tiles, GROUP_M)
            if JOINT:
                acc_g, acc_up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
            else:
                acc_g, acc_up = acc, acc_u
            _store_tile(out_win, out_ptr, activation_epilogue(acc_g, acc_up, ACTIVATION), row0, row_end, nb, K,
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
    if SIGNAL:
        if prev >= 0:
            count_done(ready_ptr + prev, done_ptr, FENCE, ASM)


@triton.jit
def _wgrad_rows(acc, a_ptr, b_ptr, gather_ptr, start, end, ps, qs, P, Q, divisor,
                HAS_GATHER: tl.constexpr, BLOCK_R: tl.constexpr):
    """acc += a[start:end, ps]ᵀ b[src(start:end), qs] (the reduction of one run of rows)."""
    offs_r = tl.arange(0, BLOCK_R)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + offs_r
        rmask = rows < end
        rows64 = rows.to(tl.int64)
        if HAS_GATHER:
            src = (tl.load(gather_ptr + rows, mask=rmask, other=0) // divisor).to(tl.int64)
        else:
            src = rows64
        a = tl.load(a_ptr + rows64[:, None] * P + ps[None, :], mask=rmask[:, None] & (ps < P)[None, :], other=0.0)
        b = tl.load(b_ptr + src[:, None] * Q + qs[None, :], mask=rmask[:, None] & (qs < Q)[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    return acc


@triton.jit
def _wgrad_rows_tma(acc, a_desc, b_desc, a_ptr, b_ptr, start, end, ps, qs, p0, q0, P, Q, BLOCK_R: tl.constexpr):
    """:func:`_wgrad_rows` (no gather) with the whole blocks of rows through TMA descriptors and
    the last, partial block through masked loads: a descriptor block cannot stop at ``end``, and
    the rows after it (the next expert's, or unwritten ones) must not enter the sum."""
    n_full = (end - start) // BLOCK_R
    for i in range(n_full):
        r0 = start + i * BLOCK_R
        a = a_desc.load([r0, p0])
        b = b_desc.load([r0, q0])
        acc = tl.dot(a.T, b, acc)
    return _wgrad_rows(acc, a_ptr, b_ptr, a_ptr, start + n_full * BLOCK_R, end, ps, qs, P, Q, 1, False, BLOCK_R)


@triton.jit
def _wgrad_coords(item, P, Q, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP_P: tl.constexpr):
    """Output block ``item`` of the weight gradient → its expert, P block and Q block. Items are
    expert-major, and inside an expert grouped by GROUP_P P blocks (L2 swizzle) so that running
    programs share the a and b column blocks they stream."""
    n_p = tl.cdiv(P, BLOCK_P)
    n_q = tl.cdiv(Q, BLOCK_Q)
    e = item // (n_p * n_q)
    r = item % (n_p * n_q)
    per_group = GROUP_P * n_q
    first_p = (r // per_group) * GROUP_P
    group_size = tl.minimum(n_p - first_p, GROUP_P)
    pb = first_p + (r % per_group) % group_size
    qb = (r % per_group) // group_size
    return e, pb, qb


@triton.jit
def _wgrad_item(item, a_ptr, b_ptr, gather_ptr, ends_ptr, a_desc, b_desc, P, Q, divisor, E,
                HAS_GATHER: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
                GROUP_P: tl.constexpr, NUM_SEG: tl.constexpr, ROWS_TMA: tl.constexpr):
    """One output block of :func:`_wgrad_kernel`: item → (fp32 block, expert, P block, Q block)
    (the order of :func:`_wgrad_coords`)."""
    e, pb, qb = _wgrad_coords(item, P, Q, BLOCK_P, BLOCK_Q, GROUP_P)
    ps = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    if NUM_SEG == 0:
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        if ROWS_TMA:
            acc = _wgrad_rows_tma(acc, a_desc, b_desc, a_ptr, b_ptr, start, tl.load(ends_ptr + e), ps, qs,
                                  pb * BLOCK_P, qb * BLOCK_Q, P, Q, BLOCK_R)
        else:
            acc = _wgrad_rows(acc, a_ptr, b_ptr, gather_ptr, start, tl.load(ends_ptr + e), ps, qs, P, Q, divisor,
                              HAS_GATHER, BLOCK_R)
    else:
        for sg in tl.static_range(NUM_SEG):
            start = tl.load(ends_ptr + sg * E + e)
            count = tl.load(ends_ptr + (NUM_SEG + sg) * E + e)
            if ROWS_TMA:
                acc = _wgrad_rows_tma(acc, a_desc, b_desc, a_ptr, b_ptr, start, start + count, ps, qs,
                                      pb * BLOCK_P, qb * BLOCK_Q, P, Q, BLOCK_R)
            else:
                acc = _wgrad_rows(acc, a_ptr, b_ptr, gather_ptr, start, start + count, ps, qs, P, Q, divisor,
                                  HAS_GATHER, BLOCK_R)
    return acc, e, pb, qb


@triton.jit
def _wgrad_kernel(
    a_ptr, b_ptr, gather_ptr, out_ptr, ends_ptr, a_desc, b_desc,
    P, Q, divisor, E,
    HAS_GATHER: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_P: tl.constexpr, NUM_SEG: tl.constexpr = 0, ROWS_TMA: tl.constexpr = False,
):
    """out[e] (P, Q) = Σ_{rows r of e} a[r, :P]ᵀ b[src(r), :Q], src(r) = gather[r] // divisor.

    The rows of expert e: ``[ends[e-1], ends[e])`` (``NUM_SEG == 0``), or NUM_SEG runs
    ``[start, start + count)`` with ``ends_ptr`` a (2, NUM_SEG, E) int32 table of starts then
    counts (the fused training path: an expert's rows from each source rank).

    One program per (expert, P block, Q block) (:func:`_wgrad_item`); the rows of the expert
    are the reduction. ``ROWS_TMA`` (no gather): a and b read through the host-built TMA
    descriptors ``a_desc`` (blocks BLOCK_R × BLOCK_P) and ``b_desc`` (BLOCK_R × BLOCK_Q), but for
    each run's last partial block (else those arguments are unused)."""
    acc, e, pb, qb = _wgrad_item(tl.program_id(0), a_ptr, b_ptr, gather_ptr, ends_ptr, a_desc, b_desc, P, Q,
                                 divisor, E, HAS_GATHER, BLOCK_P, BLOCK_Q, BLOCK_R, GROUP_P, NUM_SEG, ROWS_TMA)
    ps = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    out = out_ptr + e.to(tl.int64) * P * Q
    tl.store(out + ps[:, None].to(tl.int64) * Q + qs[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(ps < P)[:, None] & (qs < Q)[None, :])


@triton.jit
def _wgrad_persistent_kernel(
    a_ptr, b_ptr, out_ptr, ends_ptr, a_desc, b_desc, out_desc,
    P, Q, E, num_programs,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_P: tl.constexpr, NUM_SEG: tl.constexpr = 0,
):
    """:func:`_wgrad_kernel` (rows through TMA, no gather) with one program per SM looping over
    the output blocks, each stored through the TMA descriptor ``out_desc`` over out viewed as
    (E·P, Q) (P a multiple of BLOCK_P, so a block never reaches into the next expert). The
    store is asynchronous: it drains while the program starts its next block (in the sm90 PTX
    the wait for its shared-memory read sits just before the next block's store). Measured
    0–7% faster than one program per block, and chosen by the tuner on 9 of 12 H200 entries
    (docs/benchmarks.md, run 69); since runs 89–91 the H200 table uses :func:`_wgrad_flat_kernel`."""
    n_items = E * tl.cdiv(P, BLOCK_P) * tl.cdiv(Q, BLOCK_Q)
    for item in tl.range(tl.program_id(0), n_items, num_programs):
        acc, e, pb, qb = _wgrad_item(item, a_ptr, b_ptr, a_ptr, ends_ptr, a_desc, b_desc, P, Q, 1, E, False,
                                     BLOCK_P, BLOCK_Q, BLOCK_R, GROUP_P, NUM_SEG, True)
        out_desc.store([(e * P + pb * BLOCK_P).to(tl.int32), qb * BLOCK_Q], acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _wgrad_run(ends_ptr, e, sg, E, NUM_SEG: tl.constexpr):
    """First and end row of run ``sg`` of expert e's rows: its whole range from the inclusive
    ``ends`` (NUM_SEG = 0), or the run's start and count from the (2, NUM_SEG, E) table."""
    if NUM_SEG == 0:
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(ends_ptr + e)
    else:
        start = tl.load(ends_ptr + sg * E + e)
        end = start + tl.load(ends_ptr + (NUM_SEG + sg) * E + e)
    return start, end


@triton.jit
def _wgrad_flat_kernel(
    a_ptr, b_ptr, out_ptr, ends_ptr,
    P, Q, E, R, Rb, num_programs,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_P: tl.constexpr,
    NUM_SEG: tl.constexpr = 0, BLOCK_I: tl.constexpr = 256,
):
    """:func:`_wgrad_persistent_kernel` as one flat loop over (output block, run of rows, row
    block) steps, so the software pipeline runs across output blocks: the next block's first
    rows load while this block's last steps and its store run. For short reductions (a few
    hundred rows per expert, 4 row blocks per output block) and ragged experts (a partial last
    row block each) the per-block pipeline fill is otherwise a large share of the time (runs 89, 91).

    An expert's rows are one run (``NUM_SEG = 0``: from ``ends``) or NUM_SEG runs (the fused
    training path: one per source rank). Every step reads a whole BLOCK_R block of rows through
    TMA, and the rows of a step past its run's end must read as zeros, so that the rows paired
    with them add nothing (zeroing them in registers instead fed the dot from registers: 14-52%
    slower, run 88). a and b come through one :func:`_window_map` each (BLOCK_R rows), made once
    per program: (s, i, column) ↦ a[s + i, column]. A step at
    row r0 with v ≤ BLOCK_R rows of its run left loads the box at s = r0, i = v - BLOCK_R: its
    last v rows are the run's rows r0 .. r0+v-1, and its first BLOCK_R - v rows fall before the
    middle dimension's start, which TMA fills with zeros in both operands alike (the order of the
    rows in a step does not matter to the reduction). Only a run's own rows are ever read, and no
    map depends on a run's end. Maps made per run instead (one whenever a program's next block
    had another expert, nearly every block at 4096 tokens) cost each program a global write and
    a proxy fence in the loop: 5-10% of these kernels at 4096 tokens on the small-expert configs
    (run 138). (A window whose zeros came past the middle dimension's end needed a base pointer
    BLOCK_R rows before a; gpu_check once hit an illegal address with it, run 139.) Runs
    may leave unwritten rows between them that hold NaN (0 · NaN is NaN); no step reads them. An
    empty run still takes one step (all zeros), so every block is stored once. The output's map
    is made in the kernel too, not on the host: a host descriptor costs ~10 µs of host time per
    launch to build and encode (run 105). R and Rb are a's and b's row counts, at least 1."""
    RUNS: tl.constexpr = 1 if NUM_SEG == 0 else NUM_SEG
    pid = tl.program_id(0)
    per_expert = tl.cdiv(P, BLOCK_P) * tl.cdiv(Q, BLOCK_Q)
    n_items = E * per_expert
    # this program's steps: over its blocks and their runs, max(row blocks of the run, 1)
    total = 0
    for i0 in range(pid, n_items, num_programs * BLOCK_I):
        its = i0 + num_programs * tl.arange(0, BLOCK_I)
        valid = its < n_items
        ex = its // per_expert
        if NUM_SEG == 0:
            hi = tl.load(ends_ptr + ex, mask=valid, other=0)
            lo = tl.load(ends_ptr + ex - 1, mask=valid & (ex > 0), other=0)
            total += tl.sum(tl.where(valid, tl.maximum(tl.cdiv(hi - lo, BLOCK_R), 1), 0))
        else:
            for sg in tl.static_range(NUM_SEG):
                count = tl.load(ends_ptr + (NUM_SEG + sg) * E + ex, mask=valid, other=0)
                total += tl.sum(tl.where(valid, tl.maximum(tl.cdiv(count, BLOCK_R), 1), 0))
    item = pid - num_programs
    sg = RUNS - 1
    ki = -1
    n_k = 0
    e = 0
    pb = 0
    qb = 0
    start = 0
    end = 0
    a_win = _window_map(a_ptr, R, P, BLOCK_R, BLOCK_P)
    b_win = _window_map(b_ptr, Rb, Q, BLOCK_R, BLOCK_Q)
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[E * P, Q], strides=[Q, 1], block_shape=[BLOCK_P, BLOCK_Q])
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for _ in range(0, total):
        ki += 1
        if ki == n_k:  # the next run, or the next output block (the persistent matmul tutorial's flat loop)
            sg += 1
            next_block = sg == RUNS
            item = tl.where(next_block, item + num_programs, item)
            sg = tl.where(next_block, 0, sg)
            e, pb, qb = _wgrad_coords(item, P, Q, BLOCK_P, BLOCK_Q, GROUP_P)
            start, end = _wgrad_run(ends_ptr, e, sg, E, NUM_SEG)
            n_k = tl.maximum(tl.cdiv(end - start, BLOCK_R), 1)
            ki = 0
            start = tl.minimum(start, end)  # an empty run: its one step reads no row of the run
        r0 = start + ki * BLOCK_R
        i0 = tl.minimum(end - r0, BLOCK_R) - BLOCK_R  # -(rows of the step past the run): zeros first
        a = tl.reshape(a_win.load([r0, i0, pb * BLOCK_P]), (BLOCK_R, BLOCK_P))
        b = tl.reshape(b_win.load([r0, i0, qb * BLOCK_Q]), (BLOCK_R, BLOCK_Q))
        acc = tl.dot(a.T, b, acc)
        if (ki == n_k - 1) & (sg == RUNS - 1):
            out_desc.store([(e * P + pb * BLOCK_P).to(tl.int32), qb * BLOCK_Q], acc.to(out_ptr.dtype.element_ty))
            acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)


_ACTIVATION_ID = {"swiglu": 0, "gelu": 1, "relu": 2}


def _num_programs(device: torch.device, work_bound: int) -> int:
    if device.type != "cuda":
        return max(1, min(work_bound, 4))
    sms = _device_identity(device.index if device.index is not None else torch.cuda.current_device())[1]
    return max(1, min(work_bound, sms * PROGRAMS_PER_SM))


@lru_cache(maxsize=None)
def _device_identity(index: int) -> tuple[str, int, tuple[int, int]]:
    """(name, SM count, compute capability): what the tuning tables are keyed and borrowed by."""
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count, (props.major, props.minor)


@lru_cache(maxsize=None)
def _has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


_SCRATCH_DEVICE = None
_SCRATCH: dict[tuple[int, int], torch.Tensor] = {}  # (device, stream) -> descriptor scratch


def _tma_allocator(size: int, alignment: int, stream):
    """Scratch for in-kernel tensor descriptors (128 bytes per program), asked for on every launch
    of a kernel that makes descriptors. One buffer per device and stream, grown as needed: the
    kernels of a stream run one after another and a kernel reads its descriptors only while it
    runs, so the next kernel may reuse the bytes (an allocation is ~5 µs of host time, run 101).
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


def use_tma(*weights: torch.Tensor) -> bool:
    """Weights through TMA descriptors: Hopper or newer (``INTERLACE_TMA=0/1`` forces it off or
    on, the interpreter included), contiguous weights on 16-byte aligned rows and bases."""
    forced = os.environ.get("INTERLACE_TMA")
    if forced == "0":
        return False
    w = weights[0]
    ok = all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0
             for t in weights)
    if forced == "1":
        return ok and use_triton(w)
    return ok and w.is_cuda and _has_tma(w.device.index if w.device.index is not None else torch.cuda.current_device())


def tma_rows_ok(a: torch.Tensor) -> bool:
    """A row matrix TMA can read: contiguous, 16-byte aligned base and row pitch."""
    return a.is_contiguous() and a.data_ptr() % 16 == 0 and a.shape[-1] * a.element_size() % 16 == 0


def _ensure_allocator() -> None:
    """Triton needs an allocator for in-kernel descriptors; install ours unless one is set."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_allocator)


# _choose's answers by (kernels, device, weight shape, activation, rows bucket, env overrides,
# tuning generation): each expert-block call chooses five configs, ~55 µs of host time on H200's
# host without this memo (run 101).
_CHOICES: dict[tuple, tuple[tuple[GemmConfig, ...], str]] = {}


def _choose(kernels, x: torch.Tensor, w_down: torch.Tensor, num_rows: int, activation: str):
    """Configs of ``kernels`` ((table name, env override, default) each) for this call's shape,
    and where they came from: the env override, the tuning table, or the warned default."""
    forced = tuple(_config_from_env(env) for _, env, _ in kernels)
    if not x.is_cuda:
        return [f or INTERPRETER_CONFIG for f in forced], "interpreter"
    E, N, K = w_down.shape
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    per_expert = num_rows / max(E, 1)
    memo = (kernels, index, E, N, K, activation, rows_bucket(per_expert), forced, tuning_generation())
    hit = _CHOICES.get(memo)
    if hit is not None:
        return hit
    name, sms, capability = _device_identity(index)
    shape = ShapeClass(N, K, E, activation)
    configs, sources = [], []
    for (table, _, default), f in zip(kernels, forced):
        c, src = (f, "env") if f else lookup(table, name, sms, shape, per_expert, default, capability,
                                             FALLBACK_TABLES.get(table))
        configs.append(c)
        sources.append(f"{table.removeprefix('expert_')} {src}")
    if len(_CHOICES) > 1024:
        _CHOICES.clear()
    _CHOICES[memo] = tuple(configs), "; ".join(sources)
    return _CHOICES[memo]


FORWARD_KERNELS = (("expert_gemm0", "INTERLACE_GEMM0", GEMM0_DEFAULT), ("expert_gemm1", "INTERLACE_GEMM1", GEMM1_DEFAULT))
# GEMM0 in a training forward, which also stores the pre-activation h: the flat loop then runs at
# most 3 stages with masked h stores, so its best config can differ from the inference forward's.
# Where a device has no such table (nor a kin's), the inference table's config serves.
TRAIN_GEMM0_KERNEL = (("expert_gemm0_train", "INTERLACE_GEMM0", GEMM0_DEFAULT),)
TRAIN_FORWARD_KERNELS = TRAIN_GEMM0_KERNEL + FORWARD_KERNELS[1:]
FALLBACK_TABLES = {"expert_gemm0_train": "expert_gemm0"}
BACKWARD_KERNELS = (("expert_bwd_act", "INTERLACE_BWD_ACT", BWD_ACT_DEFAULT),
                    ("expert_bwd_dx", "INTERLACE_BWD_DX", BWD_DX_DEFAULT),
                    ("expert_wgrad", "INTERLACE_WGRAD", WGRAD_DEFAULT))


def choose_configs(x: torch.Tensor, w_down: torch.Tensor, num_rows: int, activation: str, store_h: bool = False):
    """(GEMM0 config, GEMM1 config, where they came from) for this call's shape.

    ``store_h`` (a training forward): GEMM0 from the ``expert_gemm0_train`` table, which the tuner
    times storing h, as that forward runs it. On an H100, phi3.5-moe 4096's GEMM0 was 1.09× faster
    alone with the flat joint loop without h, while storing h the block's forward+backward was level
    and its backward 2% slower (run 182). Where this device has no such table (nor a kin's), the
    inference table's config serves (source ``gemm0_train from expert_gemm0, …``)."""
    (c0, c1), source = _choose(TRAIN_FORWARD_KERNELS if store_h else FORWARD_KERNELS, x, w_down, num_rows,
                               activation)
    return c0, c1, source


def choose_backward_configs(dy: torch.Tensor, w_down: torch.Tensor, num_rows: int, activation: str):
    """(d(pre-activation) GEMM, dx GEMM, weight-gradient kernel) configs and their source.

    The flat loop (``persistent = 2``) has the plain epilogue only. A d(act) config from a table
    that has it, where this layer computes the derivative in the epilogue (GELU and ReLU, or
    SwiGLU without ``unfused_act``), runs the nested kernel instead: the tables' entries are
    measured on SwiGLU shapes and other activations borrow the nearest one (as ``joint`` applies
    to SwiGLU only). The same config given explicitly (``INTERLACE_BWD_ACT``) stays an error."""
    (ca, cd, cw), source = _choose(BACKWARD_KERNELS, dy, w_down, num_rows, activation)
    if (ca.persistent == 2 and not (ca.unfused_act and activation == "swiglu")
            and _config_from_env(BACKWARD_KERNELS[0][1]) is None):
        ca = replace(ca, persistent=0)
    return ca, cd, cw, source


def expert_ffn_triton(x: torch.Tensor, gather: torch.Tensor | None, divisor: int, num_rows: int,
                      w_up: torch.Tensor, w_down: torch.Tensor, ends: torch.Tensor, activation: str,
                      store_h: bool = False, configs: tuple[GemmConfig, GemmConfig] | None = None,
                      return_act: bool = False, return_schedule: bool = False):
    """Expert FFN over ``num_rows`` expert-major rows, row r reading ``x[gather[r] // divisor]``
    (or ``x[r]`` without ``gather``). Returns ``(y (num_rows, N), h or None)``. ``configs``
    forces the two kernels' configs (the tuner); by default they come from the tuning tables.
    ``return_schedule``: the GEMM0 tile schedule is appended to the result (None without rows),
    for a backward over the same rows to reuse."""
    N = x.shape[1]
    K = w_down.shape[2]
    up_width = w_up.shape[1]
    c0, c1 = configs if configs is not None else choose_configs(x, w_down, num_rows, activation, store_h)[:2]
    act = alloc.empty((num_rows, K), x.dtype, x.device)
    h = alloc.empty((num_rows, up_width), x.dtype, x.device) if store_h else None
    y = alloc.empty((num_rows, N), x.dtype, x.device)
    if num_rows == 0:
        return ((y, h, act) if return_act else (y, h)) + ((None,) if return_schedule else ())
    tma = use_tma(w_up, w_down)
    if tma:
        _ensure_allocator()
    from interlace.kernels.expert_gemm import chain as expert_chain

    chained = expert_chain.chain_wanted(c1) and expert_chain.chain_fits(c0, c1)
    sched0 = tile_schedule(ends, num_rows, c0.block_m, with_ready=chained)
    if chained:  # one launch, GEMM1 tiles filling GEMM0's last wave
        expert_chain.ffn_chain(x, gather, divisor, w_up, w_down, act, h, y, sched0, num_rows, activation, c0, c1, tma)
    else:
        _launch_gemm0(x, gather, divisor, w_up, act, h, sched0, num_rows, activation, c0, tma)
        _launch_gemm(act, w_down, y, None, ends, num_rows, cols=N, red=K, b_trans=True, epilogue=0, config=c1,
                     schedule=sched0 if c1.block_m == c0.block_m else None, tma=tma)
    return ((y, h, act) if return_act else (y, h)) + ((sched0,) if return_schedule else ())


def _gemm0_flat_stages(c0: GemmConfig, store_h: bool) -> int:
    """Pipeline stages of the flat GEMM0 (:func:`_gemm0_flat_kernel`). Storing h takes masked
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
    flat: bool  # the flat loop (:func:`_gemm0_flat_kernel`)
    joint: bool  # gate and up in one double-width dot
    tma_store: bool  # the nested loop's full tiles stored through a descriptor
    stages: int


def gemm0_form(x, gather, divisor, num_rows, act, store_h: bool, activation: str, c0: GemmConfig,
               tma: bool) -> Gemm0Form:
    """GEMM0's operands and flags as ``c0`` runs on them (both GEMM0 launchers read this). With
    ``a_tma`` and a gather, the rows are first copied contiguous (Hopper has no TMA gather: the
    permuted token matrix is written once, R·N elements; the table picks it only where it
    measured faster than the gather fused into the A load)."""
    a_tma = bool(c0.a_tma) and tma
    if a_tma and gather is not None:
        from interlace.kernels.rows import gather_rows

        x, gather, divisor = gather_rows(x, gather[:num_rows], divisor), None, 1
    a_tma = a_tma and tma_rows_ok(x)
    flat = c0.persistent == 2 and a_tma and tma_rows_ok(act)
    return Gemm0Form(x, gather, divisor, a_tma, flat, bool(c0.joint) and tma and activation == "swiglu",
                     bool(c0.tma_store) and tma and tma_rows_ok(act) and not flat,
                     _gemm0_flat_stages(c0, store_h) if flat else c0.num_stages)


def plain_gemm_tma(config: GemmConfig, tma: bool, a: torch.Tensor, out: torch.Tensor) -> tuple[bool, bool]:
    """(A rows through a descriptor, full tiles stored through one) of a plain-epilogue GEMM's nested loop."""
    return bool(config.a_tma) and tma and tma_rows_ok(a), bool(config.tma_store) and tma and tma_rows_ok(out)


def _launch_gemm0(x, gather, divisor, w_up, act, h, sched0, num_rows, activation, c0, tma):
    """act (and h when not None) = GEMM0 of the rows ``x[gather // divisor]`` (or x) over ``sched0``."""
    _check_config(c0)
    E, K = w_up.shape[0], act.shape[1]
    p0 = _num_programs(x.device, sched0.max_tiles * cdiv(K, c0.block_n))
    f = gemm0_form(x, gather, divisor, num_rows, act, h is not None, activation, c0, tma)
    N = f.x.shape[1]
    if f.flat:
        launch(_gemm0_flat_kernel, (p0,),
            f.x, w_up, act, h if h is not None else act, sched0.expert, sched0.start, sched0.end, sched0.count,
            N, K, E, p0, num_rows,
            ACTIVATION=_ACTIVATION_ID[activation], STORE_H=h is not None, JOINT=f.joint,
            BLOCK_M=c0.block_m, BLOCK_N=c0.block_n, BLOCK_K=c0.block_k, GROUP_M=c0.group_m,
            num_warps=c0.num_warps, num_stages=f.stages,
        )
        return act
    launch(_gemm0_kernel, (p0,),
        f.x, f.gather if f.gather is not None else sched0.start, w_up, act, h if h is not None else act,
        sched0.expert, sched0.start, sched0.end, sched0.count, N, K, E, f.divisor, p0, num_rows,
        ACTIVATION=_ACTIVATION_ID[activation], HAS_GATHER=f.gather is not None, STORE_H=h is not None, USE_TMA=tma,
        BLOCK_M=c0.block_m, BLOCK_N=c0.block_n, BLOCK_K=c0.block_k, GROUP_M=c0.group_m, FLATTEN=bool(c0.flatten),
        A_TMA=f.a_tma, JOINT=f.joint, TMA_STORE=f.tma_store, num_warps=c0.num_warps, num_stages=f.stages,
    )
    return act


def _check_config(config: GemmConfig) -> None:
    """Config combinations the GEMM kernels refuse (raised before any launch)."""
    if config.persistent and not config.a_tma:
        raise ValueError(f"GEMM config {config}: persistent = {config.persistent} reads rows through TMA descriptors "
                         "and needs a_tma = 1")
    if config.tma_store and config.flatten:
        raise ValueError(f"GEMM config {config}: tma_store and flatten cannot be combined (Triton 3.6 fails to "
                         "compile the store branch in a flattened loop on sm90)")
    if config.persistent == 2 and config.flatten:
        raise ValueError(f"GEMM config {config}: persistent = 2 is itself one flat loop; flatten must be 0")


def _launch_gemm(a, w, out, h, ends, num_rows, cols, red, b_trans, epilogue, config, schedule=None, tma=False):
    """out = a @ B_e per expert, w (E, cols, red) with ``b_trans`` (B_e = w[e]ᵀ) else (E, red, cols)."""
    _check_config(config)
    if config.persistent == 2 and epilogue != 0:
        raise ValueError(f"GEMM config {config}: persistent = 2 (the flat loop) has the plain epilogue only; "
                         "with an activation-gradient epilogue use unfused_act = 1 or persistent = 0")
    sched = schedule or tile_schedule(ends, num_rows, config.block_m)
    p = _num_programs(a.device, sched.max_tiles * cdiv(cols, config.block_n))
    if config.persistent == 2 and tma and tma_rows_ok(a) and tma_rows_ok(out):
        launch(_gemm_flat_kernel, (p,),
            a, w, out, sched.expert, sched.start, sched.end, sched.count, cols, red, w.shape[0], p, num_rows,
            B_TRANS=b_trans, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return out
    a_tma, tma_store = plain_gemm_tma(config, tma, a, out)
    launch(_gemm_kernel, (p,),
        a, w, out, h if h is not None else out, sched.expert, sched.start, sched.end, sched.count,
        cols, red, w.shape[0], p, num_rows, B_TRANS=b_trans, EPILOGUE=epilogue, USE_TMA=tma,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        FLATTEN=bool(config.flatten), A_TMA=a_tma, TMA_STORE=tma_store and epilogue == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def _launch_wgrad(a, b, gather, divisor, out, ends, P, Q, config, segments: torch.Tensor | None = None,
                  tma: bool = False):
    """out[e] = a[rows of e]ᵀ b[src(rows of e)]; the rows of e from the inclusive ``ends`` (E,),
    or from ``segments`` (2, S, E) int32 (starts, then counts: S runs of rows per expert).
    With ``tma`` (TMA descriptors usable here) and ``config.a_tma``, ungathered a and b rows are
    read through descriptors; with ``config.persistent`` too (and P a multiple of the block),
    persistent programs store the blocks through a descriptor (:func:`_wgrad_persistent_kernel`;
    ``persistent = 2``: :func:`_wgrad_flat_kernel`, one software pipeline across the blocks)."""
    _check_config(config)
    E = out.shape[0]
    if E == 0:
        return out
    table = ends if segments is None else segments
    rows_tma = bool(tma and config.a_tma and gather is None and tma_rows_ok(a) and tma_rows_ok(b)
                    and a.shape[1] == P and b.shape[1] == Q)
    items = E * cdiv(P, config.block_m) * cdiv(Q, config.block_n)
    if rows_tma and config.persistent == 2 and P % config.block_m == 0:
        _ensure_allocator()  # every descriptor of this kernel is made in the kernel
        programs = _num_programs(out.device, items)
        launch(_wgrad_flat_kernel, (programs,),
            a, b, out, table, P, Q, E, max(a.shape[0], 1), max(b.shape[0], 1), programs,  # no empty tensor map
            BLOCK_P=config.block_m, BLOCK_Q=config.block_n, BLOCK_R=config.block_k, GROUP_P=config.group_m,
            NUM_SEG=0 if segments is None else segments.shape[1],
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return out
    if rows_tma:
        # Built on the host, not in the kernel: this grid has a program per output block (tens of
        # thousands), and an in-kernel descriptor costs each program a global write and a fence.
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(a, [config.block_k, config.block_m])
        b_desc = TensorDescriptor.from_tensor(b, [config.block_k, config.block_n])
    else:
        a_desc, b_desc = a, b  # unused
    if rows_tma and config.persistent and P % config.block_m == 0:
        out_desc = TensorDescriptor(out, [E * P, Q], [Q, 1], [config.block_m, config.block_n])
        programs = _num_programs(out.device, items)
        launch(_wgrad_persistent_kernel, (programs,),
            a, b, out, table, a_desc, b_desc, out_desc, P, Q, E, programs,
            BLOCK_P=config.block_m, BLOCK_Q=config.block_n, BLOCK_R=config.block_k, GROUP_P=config.group_m,
            NUM_SEG=0 if segments is None else segments.shape[1],
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return out
    launch(_wgrad_kernel, (items,),
        a, b, gather if gather is not None else table, out, table, a_desc, b_desc, P, Q, divisor, E,
        HAS_GATHER=gather is not None, BLOCK_P=config.block_m, BLOCK_Q=config.block_n, BLOCK_R=config.block_k,
        GROUP_P=config.group_m, NUM_SEG=0 if segments is None else segments.shape[1],
        ROWS_TMA=rows_tma,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def _launch_d_pre_act(dy, w_down, d_h, h, ends, R, N, K, activation, config, sched, tma):
    """d_h = act'(h) ⊙ (dy @ W_down[e]) per expert. By default the derivative runs in the GEMM's
    epilogue. ``config.unfused_act`` (SwiGLU): the GEMM stores d(act) plainly and one elementwise
    pass applies the derivative — on H200 the fused epilogue (two h loads, two stores per tile,
    not overlapped with the short main loop of this K=hidden reduction) cost 25–38% of the
    kernel, more than the pass's extra R·K round trip (run 31). The flat loop with the derivative
    in its epilogue (h through TMA after the main loop; 128 × 128 tiles, as the two h blocks and
    the accumulator fill the registers) was correct but 0.77–1.01× the tables' unfused 128 × 256
    entries on an H100 (runs 179–180), and was removed again. Running dW_down on a side stream
    beside that pass (forked after the d(act) GEMM) was bitwise identical but slowed the block's
    backward on 9 of 12 bench rows (0.935–0.998×, run 186), and was removed too."""
    if config.unfused_act and activation == "swiglu":
        from interlace.kernels.activation import swiglu_backward

        d_act = alloc.empty((R, K), dy.dtype, dy.device)
        _launch_gemm(dy, w_down, d_act, None, ends, R, cols=K, red=N, b_trans=False, epilogue=0, config=config,
                     schedule=sched, tma=tma)
        return swiglu_backward(h, d_act, out=d_h)
    return _launch_gemm(dy, w_down, d_h, h, ends, R, cols=K, red=N, b_trans=False,
                        epilogue=1 + _ACTIVATION_ID[activation], config=config, schedule=sched, tma=tma)


def _wgrad_gather_mode() -> str:
    """``INTERLACE_WGRAD_GATHER``: ``copy`` (default) gathers x's rows into a contiguous buffer
    before dW_up; ``fused`` reads them through the index inside the wgrad kernel's loop."""
    mode = os.environ.get("INTERLACE_WGRAD_GATHER", "copy")
    if mode not in ("copy", "fused"):
        raise ValueError(f"INTERLACE_WGRAD_GATHER must be 'copy' or 'fused', got {mode!r}")
    return mode


def _launch_dw_up(d_h, x, gather, divisor, out, ends, P, Q, config, tma=False):
    """dW_up = d_hᵀ x[gather // divisor] per expert. The indirect load along the reduction was
    the slowest kernel of the backward (255–364 TFLOP/s on H200, run 12, vs up to 546 for the
    same kernel on contiguous rows); one gather copy of x's rows (R × N) costs far less."""
    if gather is not None and _wgrad_gather_mode() == "copy":
        from interlace.kernels.rows import gather_rows

        rows = gather_rows(x, gather[: d_h.shape[0]], divisor)  # entries past R are unspecified
        return _launch_wgrad(d_h, rows, None, 1, out, ends, P, Q, config, tma=tma)
    return _launch_wgrad(d_h, x, gather, divisor, out, ends, P, Q, config, tma=tma)


def expert_ffn_triton_backward(dy, x, gather, divisor, w_up, w_down, ends, activation, h, act, configs=None,
                               schedule: TileSchedule | None = None):
    """Gradients of :func:`expert_ffn_triton` from dy (R, N) in expert-major order.

    Returns ``(dx_rows (R, N), dw_up, dw_down)``: ``dx_rows[r]`` is the gradient of the input
    row that row r read (``x[gather[r] // divisor]``); summing or permuting it back to x is the
    caller's (deterministic) job. Four kernels (:func:`backward_steps`): d(pre-activation) with
    the activation's derivative in the epilogue, dW_down, dW_up (over a gathered copy of x's
    rows), dx_rows. ``configs`` = (d(pre-activation) GEMM, dx GEMM, wgrad) forces the configs.
    ``schedule``: the forward's tile schedule of these rows, reused where the tile heights match.
    """
    outputs, steps = backward_steps(dy, x, gather, divisor, w_up, w_down, ends, activation, h, act, configs,
                                    schedule)
    for _, _, run_step in steps:
        run_step()
    return tuple(outputs)


def backward_steps(dy, x, gather, divisor, w_up, w_down, ends, activation, h, act, configs=None,
                   schedule: TileSchedule | None = None):
    """The backward's outputs ``[dx_rows, dw_up, dw_down]`` (a list: the weight gradients
    allocated, not yet written; ``dx_rows`` set by its step) and its kernels in order as
    ``(name, FLOPs, launch)`` (the bench times them one by one).

    dW_up runs before dx and dx_rows is allocated at its step: dW_up reads a gathered copy of
    x's rows (R × N), which is freed before dx_rows (R × N) exists, so the two never coexist
    (R × N is 1.9 GB at dsv3-like 16384 tokens; the training layer's peak fell by 1.0 GiB there,
    runs 103–104)."""
    R, N = dy.shape
    E, up_width, _ = w_up.shape
    K = w_down.shape[2]
    c_act, c_dx, c_w = configs if configs is not None else choose_backward_configs(dy, w_down, R, activation)[:3]
    dw_up = alloc.empty(w_up.shape, w_up.dtype, w_up.device)
    dw_down = alloc.empty(w_down.shape, w_down.dtype, w_down.device)
    outputs = [None, dw_up, dw_down]
    if R == 0:
        return [alloc.empty((R, N), dy.dtype, dy.device), dw_up.zero_(), dw_down.zero_()], []
    d_h = alloc.empty((R, up_width), dy.dtype, dy.device)
    dy = dy.contiguous()
    tma = use_tma(w_up, w_down)
    if tma:
        _ensure_allocator()
    # The forward's schedule if it has these tiles: one launch and allocation less (host time, run 76).
    reuse = schedule is not None and schedule.block_m == c_act.block_m
    sched = schedule if reuse else tile_schedule(ends, R, c_act.block_m)
    sched_dx = sched if c_dx.block_m == c_act.block_m else tile_schedule(ends, R, c_dx.block_m)

    def dx_step():
        # dx_rows = d_h @ W_up[e]  (W_up[e] is (up, N) row-major)
        outputs[0] = alloc.empty((R, N), dy.dtype, dy.device)
        _launch_gemm(d_h, w_up, outputs[0], None, ends, R, cols=N, red=up_width, b_trans=False, epilogue=0,
                     config=c_dx, schedule=sched_dx, tma=tma)

    steps = [
        # d_act = dy @ W_down[e]  (W_down[e] is (N, K) row-major) → d_h through the activation
        ("d_pre_act", 2 * R * N * K, lambda: _launch_d_pre_act(dy, w_down, d_h, h, ends, R, N, K, activation, c_act,
                                                               sched, tma)),
        ("dw_down", 2 * R * N * K, lambda: _launch_wgrad(dy, act, None, 1, dw_down, ends, N, K, c_w, tma=tma)),  # dyᵀ act
        ("dw_up", 2 * R * up_width * N,  # d_hᵀ x[g]
         lambda: _launch_dw_up(d_h, x, gather, divisor, dw_up, ends, up_width, N, c_w, tma)),
        ("dx", 2 * R * up_width * N, dx_step),
    ]
    return outputs, steps


def supports(x: torch.Tensor, w_up: torch.Tensor) -> bool:
    """The Triton expert path runs on CUDA (or the interpreter) for bf16/fp16/fp32."""
    return use_triton(x) and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w_up.dtype == x.dtype


class TritonExpertFFN(torch.autograd.Function):
    """The expert block on the Triton kernels, forward and backward.

    ``ungather`` maps the gradients of the rows back onto x: with ``divisor == 1`` it is the
    inverse of the bijection ``gather`` (dx = dx_rows[ungather]); with ``divisor == k`` it is
    ``row_of_assignment`` (T, k) and dx[t] = Σ_j dx_rows[row[t, j]] (no atomics either way).
    """

    @staticmethod
    def forward(ctx, x, w_up, w_down, gather, divisor, num_rows, ends, activation, ungather):
        needs_grad = any(ctx.needs_input_grad[:3])
        y, h, act, sched = expert_ffn_triton(x, gather, divisor, num_rows, w_up, w_down, ends, activation,
                                             store_h=needs_grad, return_act=True, return_schedule=True)
        if needs_grad:
            ctx.save_for_backward(x, w_up, w_down, gather, ends, h, act, ungather)
            ctx.schedule = sched  # device lists the backward reuses (read only)
        ctx.divisor, ctx.activation = divisor, activation
        return y

    @staticmethod
    def backward(ctx, grad):
        from interlace.kernels.rows import combine_rows, gather_rows

        x, w_up, w_down, gather, ends, h, act, ungather = ctx.saved_tensors
        dx_rows, dw_up, dw_down = expert_ffn_triton_backward(grad, x, gather, ctx.divisor, w_up, w_down, ends,
                                                             ctx.activation, h, act, schedule=ctx.schedule)
        if gather is None:
            dx = dx_rows
        elif ctx.divisor == 1:
            dx = gather_rows(dx_rows, ungather)
        else:
            dx = combine_rows(dx_rows, ungather, None, x.dtype)
        return dx, dw_up, dw_down, None, None, None, None, None, None
