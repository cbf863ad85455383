"""Index plan of the fused (COMET) strategy: who sends which rows where, and the tile lists.

Everything is computed on the device from ``counts_all`` (W, E) int32 — every rank's kept
rows per global expert, exchanged by one all-gather — with no host sync, so the fused layer
needs none. Notation: W ranks, ``me`` this rank, ``E_l`` experts per rank, rank d owns global
experts ``[d·E_l, (d+1)·E_l)``. A source's dispatch rows are sorted by global expert (the
counting sort of ``interlace.kernels.routing_index``), so its rows for rank d and local expert e
form one contiguous *segment* starting at ``start_all[s, d·E_l + e]``.

* Send segments (this rank as a source): (d, e) for every d ≠ me; the segment's rows go to
  region ``me`` of d's ``recv`` buffer at ``start_all[me, d·E_l+e] − start_all[me, d·E_l]``.
* Receive segments (this rank as an expert owner): (s, e) with the sources in the order
  ``me, me+1, …`` — **local rows first**, so their GEMM tiles start while remote rows move.
* Send *tiles* go out in the destination order ``me−1, me−2, …`` (mod W): the j-th remote
  source an owner d waits on is ``d+j``, and ``d+j`` sends to ``d`` j-th, so at every stage each
  rank pushes the rows their owner needs next. (In plain destination order the owner's first
  source would, at W ≥ 3, send to it last, and its GEMM programs would stall behind the flags;
  at W = 2 the two orders are the same.)

**Interleaved order** (``lead`` < E_l, W ≥ 2). Local-first reads every expert's weights twice
per layer0, once for its local rows and again for its remote rows half a layer later, which
makes GEMM0's items measurably slower. But the first remote source's rows all arrive early
(the sends take a small part of layer0), so the receive tiles go: the local segments of the first
``lead`` experts (time for the first sends to land), then for each later expert its local
segment and the first remote source's (``j = 1``) segment back to back (its weights read
once), then the first ``lead`` experts' ``j = 1`` segments, then the other sources in order.
The first remote source sends to this rank first, its experts in the same rotated order
(``lead``, lead+1, …, then 0 … lead−1). ``lead = E_l`` is plain local-first.

Each owner's ``lead`` comes from ``interleave = (k, max_rows)``: ``⌈E_l / k⌉`` where the owner
receives at most ``max_rows`` rows per local expert in this call, else ``E_l`` (k = 0: always
``E_l``). The plan computes it on the device from ``counts_all``, which every rank holds, so a
sender rotates its experts as its destination orders them, and no host sync is needed. Re-read
weights cost in proportion to 1 / (rows per expert), so the interleaved order pays off for
owners with few rows per expert only (the measured threshold: docs/performance.md).

Segments are cut into row tiles of ``BLOCK_M``; tile i of a segment is the unit of readiness
(flag ``flags0[s, e, i]``) and of the GEMMs. ``_plan_kernel`` computes everything in one launch;
:func:`build_plan_reference` is its plain-torch twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from interlace.kernels import alloc
from interlace.kernels.launch import cdiv, launch, next_power_of_2
from interlace.kernels.rows import use_triton


def segment_tiles(counts: torch.Tensor, max_rows: int, block_m: int):
    """Plain-torch tiles of ``block_m`` rows over segments with ``counts`` (S,) rows each (the
    reference plan's; the plan kernel emits the same lists on the device).

    Returns ``(tile_seg, tile_idx, num_tiles (1,), max_tiles)``; entries past ``num_tiles``
    are unspecified. ``max_rows`` bounds Σ counts (sizes the lists).
    """
    S = counts.numel()
    max_tiles = cdiv(max_rows, block_m) + S
    dev = counts.device
    tiles = (counts.long() + block_m - 1) // block_m
    seg = torch.repeat_interleave(torch.arange(S, device=dev), tiles)
    first = tiles.cumsum(0) - tiles
    idx = torch.arange(seg.numel(), device=dev) - first[seg]
    tile_seg = alloc.empty((max_tiles,), torch.int32, dev)
    tile_idx = alloc.empty((max_tiles,), torch.int32, dev)
    tile_seg[:seg.numel()] = seg.to(torch.int32)
    tile_idx[:seg.numel()] = idx.to(torch.int32)
    num_tiles = torch.full((1,), seg.numel(), dtype=torch.int32, device=dev)
    return tile_seg, tile_idx, num_tiles, max_tiles


@dataclass
class FusedPlan:
    """Device-side index plan of one call on one rank (see the module docstring).

    Send side (segments ``d·E_l + e``; zero rows for d = me):
        send_count, send_row0, send_dst_off: (W·E_l,) int32 — rows, first dispatch row,
        row offset inside region ``me`` of d's recv buffer.
        send_tiles: (tile_seg, tile_idx, num_tiles, max_tiles), destinations in the order
        me−1, me−2, … (mod W).
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


def recv_segment_order(W: int, El: int, lead: int) -> list[int]:
    """Receive segment ids ``j·E_l + e`` in GEMM order (the module docstring's interleaved order;
    ``lead = E_l``: local first)."""
    if W == 1:
        return list(range(El))
    lead = max(0, min(lead, El))
    order = list(range(lead))
    for e in range(lead, El):
        order += [e, El + e]
    return order + [El + e for e in range(lead)] + list(range(2 * El, W * El))


def send_expert_order(El: int, lead: int) -> list[int]:
    """Experts in the order this rank sends them to its first destination: ``lead`` … E_l−1,
    then 0 … lead−1 (the order its owner consumes them in)."""
    lead = max(0, min(lead, El)) % El if El else 0
    return list(range(lead, El)) + list(range(lead))


def owner_leads(counts_all: torch.Tensor, num_local: int, interleave: tuple[int, int]) -> list[int]:
    """Each owner rank's ``lead`` (module docstring) from the counts; a host sync (reference)."""
    W = counts_all.shape[0]
    k, max_rows = interleave
    rows = counts_all.long().view(W, W, num_local).sum(dim=(0, 2)).tolist()  # rows each owner receives
    if k <= 0 or W == 1:
        return [num_local] * W
    return [-(-num_local // k) if r <= max_rows * num_local else num_local for r in rows]


def build_plan_reference(counts_all: torch.Tensor, me: int, num_local: int, max_tokens: int, top_k: int,
                         block_m: int, interleave: tuple[int, int] = (0, 0)) -> FusedPlan:
    """Plain-torch twin of :func:`build_plan` (about 25 small ops: tests and CPU without Triton)."""
    W, E = counts_all.shape
    El = num_local
    leads = owner_leads(counts_all, El, interleave)
    lead, lead_send = leads[me], leads[(me - 1) % W]
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
    # Send tiles in destination order me-1, me-2, ... (see the module docstring): tile
    # positions p, then map each position's segment back to its (destination, expert) id.
    # (the first destination's experts in send_expert_order: module docstring)
    dev = counts.device
    seg_of_pos = torch.tensor([((me - 1 - p) % W) * El + e
                               for p in range(W) for e in (send_expert_order(El, lead_send) if p == 0 else range(El))],
                              dtype=torch.long, device=dev)
    send_tiles = segment_tiles(send_count[seg_of_pos], rows_max, block_m)
    send_tiles = (seg_of_pos[send_tiles[0].long().clamp(0, W * El - 1)].to(torch.int32),) + send_tiles[1:]
    recv_order = torch.tensor(recv_segment_order(W, El, lead), dtype=torch.long, device=dev)
    recv_tiles = segment_tiles(recv_count[recv_order], W * max_tokens * min(top_k, El), block_m)
    recv_tiles = (recv_order[recv_tiles[0].long().clamp(0, W * El - 1)].to(torch.int32),) + recv_tiles[1:]
    tiles_from_source = ((cnt[:, me] + block_m - 1) // block_m).sum(1, dtype=torch.int32)
    sent_rows = cnt[me].sum(1, dtype=torch.int32)
    return FusedPlan(send_count, send_row0, send_dst_off, send_tiles, recv_count, recv_off, recv_ret_row0,
                     recv_local_row0, recv_tiles, tiles_from_source, sent_rows)


@triton.jit
def _emit_tiles(tiles2, first2, segid2, total, tile_seg_ptr, tile_idx_ptr, pid, n_programs, BLOCK_T: tl.constexpr):
    """Write (segment, tile index) of this program's tiles (blocks of ``BLOCK_T``, every
    ``n_programs``-th); segment a·E_l + el has tiles2[a, el] tiles starting at global tile
    first2[a, el]."""
    for t0 in range(pid * BLOCK_T, total, n_programs * BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t3 = t[:, None, None]
        owns = (first2[None, :, :] <= t3) & (t3 < (first2 + tiles2)[None, :, :])
        seg = tl.sum(tl.sum(tl.where(owns, segid2[None, :, :], 0), axis=2), axis=1)
        idx = t - tl.sum(tl.sum(tl.where(owns, first2[None, :, :], 0), axis=2), axis=1)
        tl.store(tile_seg_ptr + t, seg, mask=t < total)
        tl.store(tile_idx_ptr + t, idx, mask=t < total)


@triton.jit
def _first_tiles(tiles2):
    """Global first tile of each segment, segments in row-major (a, el) order."""
    rows = tl.sum(tiles2, axis=1)
    return (tl.cumsum(rows, axis=0) - rows)[:, None] + tl.cumsum(tiles2, axis=1) - tiles2


@triton.jit
def _plan_kernel(
    counts_ptr,  # (W, W·E_l) int32: counts[s, d·E_l + el] rows source s keeps for expert (d, el)
    out_ptr,  # (8, W·E_l) int32: send_count, send_row0, send_dst_off, recv_count, recv_off, recv_ret_row0
    tiles_from_source_ptr, sent_rows_ptr,  # (W,) int32 each
    send_seg_ptr, send_idx_ptr, send_num_ptr, recv_seg_ptr, recv_idx_ptr, recv_num_ptr,
    me, W, E_l, interleave_k, interleave_max_rows,  # the interleaved order's (k, max_rows): module docstring
    BLOCK_M: tl.constexpr, W_PAD: tl.constexpr, EL_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # Every program computes the (small) per-segment tables; program 0 stores them, and the
    # programs share the tile lists (one program emitting every tile of a large call was slow,
    # with every later kernel of the call waiting on it).
    # 3-D index (source s, destination d, local expert el).
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    first = pid == 0
    s3 = tl.arange(0, W_PAD)[:, None, None]
    d3 = tl.arange(0, W_PAD)[None, :, None]
    el3 = tl.arange(0, EL_PAD)[None, None, :]
    valid = (s3 < W) & (d3 < W) & (el3 < E_l)
    E = W * E_l
    cnt = tl.load(counts_ptr + s3 * E + d3 * E_l + el3, mask=valid, other=0)
    within = tl.cumsum(cnt, axis=2) - cnt  # row offset inside (s → d)'s block
    block = tl.sum(cnt, axis=2)  # (s, d) rows
    block_start = tl.cumsum(block, axis=1) - block  # first dispatch row of (s → d) on source s
    start = block_start[:, :, None] + within

    a2 = tl.arange(0, W_PAD)[:, None]  # destination (send) or source position j (recv)
    el2 = tl.arange(0, EL_PAD)[None, :]
    seg_mask = (a2 < W) & (el2 < E_l)
    segid2 = a2 * E_l + el2
    # Send side: row s = me, zero rows to itself.
    is_me = s3 == me
    row_me = tl.sum(tl.where(is_me, cnt, 0), axis=0)  # (d, el) rows this rank keeps per expert
    send_cnt = tl.where(a2 == me, 0, row_me)
    tl.store(out_ptr + segid2, send_cnt, mask=seg_mask & first)
    tl.store(out_ptr + E + segid2, tl.sum(tl.where(is_me, start, 0), axis=0), mask=seg_mask & first)
    tl.store(out_ptr + 2 * E + segid2, tl.sum(tl.where(is_me, within, 0), axis=0), mask=seg_mask & first)
    w1 = tl.arange(0, W_PAD)
    tl.store(sent_rows_ptr + w1, tl.sum(row_me, axis=1), mask=(w1 < W) & first)  # to itself too: it waits on itself
    # Receive side: column d = me, rows reordered to j = (s − me) mod W (local source first).
    to_me = d3 == me
    col_cnt = tl.sum(tl.where(to_me, cnt, 0), axis=1)  # (s, el)
    col_within = tl.sum(tl.where(to_me, within, 0), axis=1)
    col_start = tl.sum(tl.where(to_me, start, 0), axis=1)
    tiles_by_source = tl.sum((col_cnt + BLOCK_M - 1) // BLOCK_M, axis=1)
    tl.store(tiles_from_source_ptr + w1, tiles_by_source, mask=(w1 < W) & first)
    j3 = tl.arange(0, W_PAD)[:, None, None]
    src_of_j = (j3 + me) % W
    pick = tl.arange(0, W_PAD)[None, :, None] == src_of_j  # (j, s, 1)
    recv_cnt = tl.sum(tl.where(pick, col_cnt[None, :, :], 0), axis=1)
    tl.store(out_ptr + 3 * E + segid2, recv_cnt, mask=seg_mask & first)
    tl.store(out_ptr + 4 * E + segid2, tl.sum(tl.where(pick, col_within[None, :, :], 0), axis=1),
             mask=seg_mask & first)
    tl.store(out_ptr + 5 * E + segid2, tl.sum(tl.where(pick, col_start[None, :, :], 0), axis=1),
             mask=seg_mask & first)
    # Every owner's lead from the rows it receives (the same on every rank): this rank's for
    # its receive order, its first destination's for its send order.
    rows_d = tl.sum(tl.sum(cnt, axis=2), axis=0)  # (d,) rows owner d receives
    short = (rows_d <= interleave_max_rows * E_l) & (interleave_k > 0) & (W > 1)
    lead_d = tl.where(short, (E_l + interleave_k - 1) // tl.maximum(interleave_k, 1), E_l)
    lead = tl.sum(tl.where(w1 == me, lead_d, 0))
    lead_send = tl.sum(tl.where(w1 == (me - 1 + W) % W, lead_d, 0)) % E_l
    # Tile lists, by position (p, el) in row-major order; each position's count is read straight
    # from counts. Send tiles: destination (me - 1 - p) mod W (module docstring), the first
    # destination's experts rotated by lead_send.
    dest2 = (me - 1 - a2 + W) % W
    send_e = tl.where(a2 == 0, (el2 + lead_send) % E_l, el2)
    send_segid = dest2 * E_l + send_e
    send_tiles = tl.where(seg_mask, (tl.load(counts_ptr + me * E + send_segid, mask=seg_mask & (dest2 != me),
                                             other=0) + BLOCK_M - 1) // BLOCK_M, 0)
    # Receive tiles in the interleaved order: position q → (source j, expert e).
    q = a2 * E_l + el2
    mix_end = lead + 2 * (E_l - lead)
    r = q - lead
    in_lead = q < lead
    in_mix = (q >= lead) & (q < mix_end)
    in_tail = (q >= mix_end) & (q < 2 * E_l)
    pos_j = tl.where(in_lead, 0, tl.where(in_mix, r % 2, tl.where(in_tail, 1, q // E_l)))
    pos_e = tl.where(in_lead, q, tl.where(in_mix, lead + r // 2, tl.where(in_tail, q - mix_end, q % E_l)))
    recv_segid = pos_j * E_l + pos_e
    recv_tiles = tl.where(seg_mask, (tl.load(counts_ptr + ((me + pos_j) % W) * E + me * E_l + pos_e, mask=seg_mask,
                                             other=0) + BLOCK_M - 1) // BLOCK_M, 0)
    n_send = tl.sum(tl.sum(send_tiles, axis=1), axis=0)
    n_recv = tl.sum(tl.sum(recv_tiles, axis=1), axis=0)
    if first:
        tl.store(send_num_ptr, n_send)
        tl.store(recv_num_ptr, n_recv)
    _emit_tiles(send_tiles, _first_tiles(send_tiles), send_segid, n_send, send_seg_ptr, send_idx_ptr, pid, n_programs,
                BLOCK_T)
    _emit_tiles(recv_tiles, _first_tiles(recv_tiles), recv_segid, n_recv, recv_seg_ptr, recv_idx_ptr, pid,
                n_programs, BLOCK_T)


# Most programs of the plan kernel (each emits blocks of tiles; see _plan_kernel).
PLAN_PROGRAMS = 64


def build_plan(counts_all: torch.Tensor, me: int, num_local: int, max_tokens: int, top_k: int,
               block_m: int, block_t: int | None = None, interleave: tuple[int, int] = (0, 0)) -> FusedPlan:
    """The :class:`FusedPlan` of rank ``me`` from every rank's kept counts (W, E) int32: one
    kernel launch (the prologue of the fused layer is bound by the host's launch rate, so one
    launch instead of ~25 small torch ops matters). No host sync. ``block_t``: tiles a
    program emits per step (default: from the padded segment count; tests pass small ones).
    ``interleave``: (k, max_rows) of the interleaved receive order (module docstring); k = 0:
    local first."""
    if not use_triton(counts_all):
        return build_plan_reference(counts_all, me, num_local, max_tokens, top_k, block_m, interleave)
    W, E = counts_all.shape
    dev = counts_all.device
    S = E
    max_send = cdiv(max_tokens * top_k, block_m) + S
    max_recv = cdiv(W * max_tokens * min(top_k, num_local), block_m) + S
    # One allocation for every int32 output (fewer allocator calls on the hot path).
    flat = alloc.empty((6 * S + 2 * W + 2 + 2 * max_send + 2 * max_recv,), torch.int32, dev)
    cols = flat[:6 * S].view(6, S)
    o = 6 * S
    tiles_from_source, sent_rows = flat[o:o + W], flat[o + W:o + 2 * W]
    o += 2 * W
    send_num, recv_num = flat[o:o + 1], flat[o + 1:o + 2]
    o += 2
    send_seg, send_idx = flat[o:o + max_send], flat[o + max_send:o + 2 * max_send]
    o += 2 * max_send
    recv_seg, recv_idx = flat[o:o + max_recv], flat[o + max_recv:o + 2 * max_recv]
    el_pad = next_power_of_2(num_local)
    w_pad = next_power_of_2(W)
    if block_t is None:
        block_t = max(1, min(64, 4096 // (w_pad * el_pad)))
    block_t = next_power_of_2(block_t)
    programs = max(1, min(PLAN_PROGRAMS, cdiv(max(max_send, max_recv), block_t)))
    launch(_plan_kernel, (programs,),
        counts_all.to(torch.int32).contiguous(), cols, tiles_from_source, sent_rows,
        send_seg, send_idx, send_num, recv_seg, recv_idx, recv_num,
        me, W, num_local, max(0, interleave[0]), min(max(0, interleave[1]), (2**31 - 1) // max(num_local, 1)),
        BLOCK_M=block_m, W_PAD=w_pad, EL_PAD=el_pad, BLOCK_T=block_t, num_warps=4,
    )
    return FusedPlan(cols[0], cols[1], cols[2], (send_seg, send_idx, send_num, max_send), cols[3], cols[4], cols[5],
                     cols[5], (recv_seg, recv_idx, recv_num, max_recv), tiles_from_source, sent_rows)
