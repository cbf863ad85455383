"""Index plan of the fused (COMET) strategy: who sends which rows where, and the tile lists.

Everything is computed on the device from ``counts_all`` (W, E) int32 — every rank's kept
rows per global expert, exchanged by one all-gather — with no host sync, so the fused layer
needs none. Notation: W ranks, ``me`` this rank, ``E_l`` experts per rank, rank d owns global
experts ``[d·E_l, (d+1)·E_l)``. A source's dispatch rows are sorted by global expert (the
counting sort of ``interlace.ops.routing_index``), so its rows for rank d and local expert e
form one contiguous *segment* starting at ``start_all[s, d·E_l + e]``.

* Send segments (this rank as a source): (d, e) for every d ≠ me; the segment's rows go to
  region ``me`` of d's ``recv`` buffer at ``start_all[me, d·E_l+e] − start_all[me, d·E_l]``.
* Receive segments (this rank as an expert owner): (s, e) with the sources in the order
  ``me, me+1, …`` — **local rows first**, so their GEMM tiles start while remote rows move.

Segments are cut into row tiles of ``BLOCK_M``; tile i of a segment is the unit of readiness
(flag ``flags0[s, e, i]``) and of the GEMMs. ``_segment_tiles_kernel`` lists the tiles of a
segment list on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from interlace.ops import alloc
from interlace.ops.rows import use_triton


@triton.jit
def _segment_tiles_kernel(
    count_ptr,  # (S,) int32 rows per segment
    tile_seg_ptr, tile_idx_ptr,  # (max_tiles,) int32 each, out: segment and tile index in it
    num_tiles_ptr,  # (1,) int32, out
    S, max_tiles,
    BLOCK_M: tl.constexpr, S_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.arange(0, S_PAD)
    counts = tl.load(count_ptr + s, mask=s < S, other=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    first = tl.cumsum(tiles, axis=0) - tiles
    total = tl.sum(tiles, axis=0)
    if pid == 0:
        tl.store(num_tiles_ptr, total)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    owns = (first[None, :] <= t[:, None]) & (t[:, None] < (first + tiles)[None, :])
    seg = tl.sum(tl.where(owns, s[None, :], 0), axis=1)
    idx = t - tl.sum(tl.where(owns, first[None, :], 0), axis=1)
    valid = (t < total) & (t < max_tiles)
    tl.store(tile_seg_ptr + t, seg, mask=valid)
    tl.store(tile_idx_ptr + t, idx, mask=valid)


def segment_tiles(counts: torch.Tensor, max_rows: int, block_m: int):
    """Tiles of ``block_m`` rows over segments with ``counts`` (S,) rows each, on the device.

    Returns ``(tile_seg, tile_idx, num_tiles (1,), max_tiles)``; entries past ``num_tiles``
    are unspecified. ``max_rows`` bounds Σ counts (sizes the lists without a host sync).
    """
    S = counts.numel()
    max_tiles = triton.cdiv(max_rows, block_m) + S
    dev = counts.device
    tile_seg = alloc.empty((max_tiles,), torch.int32, dev)
    tile_idx = alloc.empty((max_tiles,), torch.int32, dev)
    num_tiles = alloc.empty((1,), torch.int32, dev)
    if not use_triton(counts):  # plain torch twin (CPU without the interpreter)
        tiles = (counts.long() + block_m - 1) // block_m
        seg = torch.repeat_interleave(torch.arange(S, device=dev), tiles)
        first = tiles.cumsum(0) - tiles
        idx = torch.arange(seg.numel(), device=dev) - first[seg]
        tile_seg[:seg.numel()] = seg.to(torch.int32)
        tile_idx[:seg.numel()] = idx.to(torch.int32)
        num_tiles.fill_(seg.numel())
        return tile_seg, tile_idx, num_tiles, max_tiles
    s_pad = triton.next_power_of_2(max(S, 1))
    block_t = max(1, min(64, 8192 // s_pad))
    _segment_tiles_kernel[(triton.cdiv(max_tiles, block_t),)](
        counts, tile_seg, tile_idx, num_tiles, S, max_tiles,
        BLOCK_M=block_m, S_PAD=s_pad, BLOCK_T=block_t, num_warps=4,
    )
    return tile_seg, tile_idx, num_tiles, max_tiles


@dataclass
class FusedPlan:
    """Device-side index plan of one call on one rank (see the module docstring).

    Send side (segments ``d·E_l + e``; zero rows for d = me):
        send_count, send_row0, send_dst_off: (W·E_l,) int32 — rows, first dispatch row,
        row offset inside region ``me`` of d's recv buffer.
        send_tiles: (tile_seg, tile_idx, num_tiles, max_tiles).
    Receive side (segments ``j·E_l + e`` for the j-th source ``(me + j) % W``):
        recv_count, recv_off, recv_ret_row0, recv_local_row0: (W·E_l,) int32 — rows, row
        offset inside the source's region, first row in the source's dispatch order (where
        layer1 returns the outputs), first local dispatch row (j = 0 only).
        recv_tiles: as send_tiles. tiles_from_source: (W,) int32 tiles per source *rank*.
    Home side: sent_rows (W,) int32 rows this rank sent to each rank (layer1 waits only on
        ranks it sent rows to).
    """

    send_count: torch.Tensor
    send_row0: torch.Tensor
    send_dst_off: torch.Tensor
    send_tiles: tuple
    recv_count: torch.Tensor
    recv_off: torch.Tensor
    recv_ret_row0: torch.Tensor
    recv_local_row0: torch.Tensor
    recv_tiles: tuple
    tiles_from_source: torch.Tensor
    sent_rows: torch.Tensor


def build_plan(counts_all: torch.Tensor, me: int, num_local: int, max_tokens: int, top_k: int,
               block_m: int) -> FusedPlan:
    """The :class:`FusedPlan` of rank ``me`` from every rank's kept counts (W, E) int32."""
    W, E = counts_all.shape
    El = num_local
    counts = counts_all.to(torch.int32)
    start_all = (counts.cumsum(1, dtype=torch.int32) - counts).view(W, W, El)  # [source, dest, e]
    cnt = counts.view(W, W, El)
    region_start = start_all[:, :, :1]

    send_count = cnt[me].clone()
    send_count[me] = 0
    send_count = send_count.reshape(-1).contiguous()
    send_row0 = start_all[me].reshape(-1).contiguous()
    send_dst_off = (start_all[me] - region_start[me]).reshape(-1).contiguous()

    def in_source_order(t):  # (W, El) indexed by source rank → row j is source (me + j) % W
        return torch.roll(t, shifts=-me, dims=0).reshape(-1).contiguous()

    recv_count = in_source_order(cnt[:, me])
    recv_off = in_source_order(start_all[:, me] - region_start[:, me])
    recv_ret_row0 = in_source_order(start_all[:, me])
    recv_local_row0 = recv_ret_row0  # for j = 0 the source is this rank: same rows
    rows_max = max_tokens * top_k
    send_tiles = segment_tiles(send_count, rows_max, block_m)
    recv_tiles = segment_tiles(recv_count, W * max_tokens * min(top_k, El), block_m)
    tiles_from_source = ((cnt[:, me] + block_m - 1) // block_m).sum(1, dtype=torch.int32)
    sent_rows = cnt[me].sum(1, dtype=torch.int32)
    return FusedPlan(send_count, send_row0, send_dst_off, send_tiles, recv_count, recv_off, recv_ret_row0,
                     recv_local_row0, recv_tiles, tiles_from_source, sent_rows)
