"""The tile schedule of the expert GEMMs, and how persistent programs walk it.

Rows are expert-major: expert e owns rows ``[ends[e-1], ends[e])``. :func:`tile_schedule` lists,
on the device, the (expert, first row, end row) tiles of height BLOCK_M in expert-major order
and their count. Nothing is padded and nothing is read back by the host, so the expert block
stays free of host syncs (and CUDA-graph capturable: grids are sized from host-known bounds).

A persistent GEMM's work items are (row tile, column block) pairs, visited in groups of
``GROUP_M`` row tiles (an L2 swizzle over the column blocks): the programs running at one time
share a few column blocks of one expert's weights instead of streaming all of them once per
row tile. :func:`tile_work` and :func:`tile_coords` map an item to its tile; :func:`flat_items`,
:func:`flat_start` and :func:`flat_next` drive the flat (work item, k step) loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from interlace.kernels import alloc
from interlace.kernels.launch import cdiv, launch, next_power_of_2


@triton.jit
def tile_schedule_kernel(
    ends_ptr,  # (E,) int32 inclusive row ends per expert
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,  # (max_tiles,) int32 each, out
    num_tiles_ptr,  # (1,) int32, out
    E, max_tiles,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
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


@dataclass
class TileSchedule:
    """Row tiles of ``block_m`` rows, expert-major; the first ``count`` entries of each list hold."""

    expert: torch.Tensor  # (max_tiles,) int32: the tile's expert
    start: torch.Tensor  # (max_tiles,) int32: its first row
    end: torch.Tensor  # (max_tiles,) int32: one past its last row
    count: torch.Tensor  # (1,) int32 on the device: the number of tiles
    max_tiles: int  # a host-known bound of count (grids are sized from it)
    block_m: int


def tile_schedule(ends: torch.Tensor, num_rows: int, block_m: int) -> TileSchedule:
    """Tiles of ``block_m`` rows per expert from the inclusive row ends ``ends`` (E,) int32 of
    ``num_rows`` rows (on the device, no sync)."""
    E = ends.numel()
    max_tiles = cdiv(num_rows, block_m) + E
    # One allocation (host time per call); each list starts 16-byte aligned, as the kernels'
    # specializations assume of a fresh tensor.
    stride = cdiv(max_tiles, 4) * 4
    lists = alloc.empty((3 * stride + 4,), torch.int32, ends.device)
    sched = TileSchedule(lists[:max_tiles], lists[stride:stride + max_tiles], lists[2 * stride:2 * stride + max_tiles],
                         lists[3 * stride:3 * stride + 1], max_tiles, block_m)
    e_pad = next_power_of_2(max(E, 1))
    block_t = max(1, min(64, 8192 // e_pad))
    launch(tile_schedule_kernel, (cdiv(max_tiles, block_t),),
        ends, sched.expert, sched.start, sched.end, sched.count,
        E, max_tiles, BLOCK_M=block_m, E_PAD=e_pad, BLOCK_T=block_t, num_warps=4,
    )
    return sched


@triton.jit
def tile_work(work, n_blocks, num_tiles, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
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
def tile_coords(work, n_blocks, num_tiles, tile_expert_ptr, tile_start_ptr, tile_end_ptr, GROUP_M: tl.constexpr):
    """:func:`tile_work`'s scalars only: (expert, first row, column block, end row)."""
    per_group = GROUP_M * n_blocks
    first_tile = (work // per_group) * GROUP_M
    group_size = tl.minimum(num_tiles - first_tile, GROUP_M)
    tile = first_tile + (work % per_group) % group_size
    nb = (work % per_group) // group_size
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    return e, tl.load(tile_start_ptr + tile), nb, tl.load(tile_end_ptr + tile)


@triton.jit
def flat_items(num_tiles, n_blocks, pid, num_programs):
    """Work items (tile, column block) of program ``pid`` in a persistent grid of ``num_programs``."""
    return tl.maximum(tl.cdiv(num_tiles * n_blocks - pid, num_programs), 0)


@triton.jit
def flat_start(pid, num_programs, k_steps):
    """The state :func:`flat_next` starts from: (ki, work, expert, first row, column block, end row)."""
    return k_steps - 1, pid - num_programs, tl.full([], 0, tl.int64), 0, 0, 0


@triton.jit
def flat_next(ki, k_steps, work, e, row0, nb, row_end, num_programs, n_blocks, num_tiles,
              tile_expert_ptr, tile_start_ptr, tile_end_ptr, GROUP_M: tl.constexpr):
    """One step of a flat (tile, k step) loop: the next k step, and at a tile's first step the
    program's next work item and its coordinates (from :func:`flat_start`)."""
    ki = tl.where(ki == k_steps - 1, 0, ki + 1)
    if ki == 0:
        work += num_programs
        e, row0, nb, row_end = tile_coords(work, n_blocks, num_tiles, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                                           GROUP_M)
    return ki, work, e, row0, nb, row_end
