"""Layer1 of the fused strategy (COMET): GEMM1 → return → top-k combine in one launch.

**GEMM programs** (``pid >= n_comm``) compute the down projection ``y = h @ W_down^T``
*column-wise*: work items are (N-slice, row tile) with the slice outer, so slice 0 of every
row is finished first. A tile's epilogue stores its (≤BLOCK_M × BLOCK_N1) block of ``y``
straight into the **home rank's** ``ret`` buffer at the rows' positions in the home's dispatch
order (a peer store over NVLink; for the home itself a local store), then counts the tile on a
per-(home, slice) counter (acq_rel); the last tile of a (home, slice) resets the counter and
releases the home's flag ``flags1[this rank, slice]`` with the epoch. GEMM programs never wait.

**Combine programs** (``pid < n_comm``) run on every rank as the home of its tokens: for each
(slice, token block) task they acquire-wait until every rank this rank sent rows to has
published that slice, then reduce each token's top-k rows in fp32 in slot order with the
routing weights (deterministic, no atomics) and store the slice of the output.

Zero rows never deadlock: a home only waits on ranks it sent rows to (known from the counts),
and exactly those ranks have tiles for it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from interlace.kernels.expert_gemm.tile import slice_grouped_work
from interlace.kernels.comet.flags import (WAIT_LAYER1, claim, finish_queue, launch_roles, peer_region, publish_flag,
                                 wait_flag)
from interlace.kernels.tma import tma_rows_ok
from interlace.kernels.launch import launch
from interlace.kernels.timeline import KIND_COMBINE, KIND_GEMM1, KIND_GEMM1_REMOTE, timeline_now, timeline_record


@triton.jit
def _count_tile(counters_ptr, tiles_from_source, flags1_table, s, sl, n_slices, me, epoch):
    """Count one finished tile of (home ``s``, slice ``sl``); the last one publishes the slice.
    acq_rel + sys scope: this program's earlier stores (peer stores included) are released, and
    the last arriver acquires everyone's before it releases the home's flag."""
    tl.debug_barrier()
    counter = counters_ptr + s * n_slices + sl
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="sys")
    if done == tl.load(tiles_from_source + s) - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        flags = peer_region(flags1_table, s, tl.int32)
        publish_flag(flags + me * n_slices + sl, epoch)


# T (the call's token count) only bounds the combine's tokens: not specialized, so every T reuses
# one build instead of one per pattern of "divisible by 16" and "equal to 1".
@triton.jit(do_not_specialize=("T",))
def _gemm1_combine_kernel(
    h_ptr, w_ptr,  # (rows, K) from layer0; w_down (E_l, N, K) (B_KMAJOR: (E_l, K, N), the backward's W_up)
    h_base_ptr,  # (W,) int32 first row in h of source s's rows (s·cap: the receive layout)
    ret_ptr, flags1_ptr, counters_ptr,  # this rank's ret (R_max, N), flags1 (W, S), counters (W, S)
    ret_table, flags1_table,  # (W,) int64 peer addresses
    recv_count, recv_off, recv_ret_row0, recv_tile_seg, recv_tile_idx, recv_num_tiles, tiles_from_source,
    out_ptr, weight_ptr, row_of_assignment_ptr, sent_rows_ptr,  # home side: (T, N) out, (T, k) weights/rows
    epoch_ptr, error_ptr,
    me, W, N, K, cap, num_local, T,
    queue_ptr,  # (3,) int32 work queue: [GEMM items claimed, combine tasks claimed, programs done]
    n_comm, n_programs, pid_base, max_spins, join, slice_group,
    timeline_ptr, timeline_clock, timeline_cap,  # (cap, 8) int64 records, (1,) clock: interlace.kernels.timeline
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr, GROUP_M: tl.constexpr, USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr = False,
    TIMELINE: tl.constexpr = 0,  # 0 off (compiled out), 1 GPU clock, 2 logical clock (interpreter)
    A_TMA: tl.constexpr = False,  # h rows through a TMA descriptor (a tile's rows are contiguous in h)
    H_ROWS=1,  # rows of h (the A descriptor's extent; only read with A_TMA)
    DEFER_COUNT: tl.constexpr = False,  # count a tile after the next tile's main loop (see below)
):
    pid = tl.program_id(0) + pid_base
    epoch = tl.load(epoch_ptr)
    n_slices = tl.cdiv(N, BLOCK_N)
    if pid >= n_comm:
        # ---- GEMM program: y slices, stored at the home rank, slice-major order ----
        n_tiles = tl.load(recv_num_tiles)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        w_desc = w_ptr  # the pointer path ignores it
        if USE_TMA:  # w_down (E_l·N, K) rows through TMA; rows past an expert's N feed masked columns
            if B_KMAJOR:  # (E_l·K, N): block rows past an expert's K meet zero A columns
                w_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_local * K, N], strides=[N, 1],
                                                   block_shape=[BLOCK_K, BLOCK_N])
            else:
                w_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_local * N, K], strides=[K, 1],
                                                   block_shape=[BLOCK_N, BLOCK_K])
        a_desc = h_ptr
        if A_TMA:
            # A block past the tile's valid rows reads the next segment's (or unwritten) rows of h:
            # they only feed output rows the store masks; past the end of h, TMA reads zeros.
            a_desc = tl.make_tensor_descriptor(h_ptr, shape=[H_ROWS, K], strides=[K, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
        # DEFER_COUNT: the count (a system-scope release, which waits until this program's peer
        # stores have landed) of a tile is issued after the *next* tile's main loop, so the stores
        # drain under that loop instead of stalling the program. A count is late by at most one
        # item, and items never wait, so every flag is still published.
        pend_s = -1
        pend_sl = 0
        work = claim(queue_ptr)
        while work < n_slices * n_tiles:
            t_start = timeline_now(timeline_clock, TIMELINE)
            tile, sl = slice_grouped_work(work, n_tiles, n_slices, slice_group, GROUP_M)
            seg = tl.load(recv_tile_seg + tile)
            i = tl.load(recv_tile_idx + tile)
            e = seg % num_local
            s = (me + seg // num_local) % W
            rmask = offs_m < tl.load(recv_count + seg) - i * BLOCK_M
            h_row0 = tl.load(h_base_ptr + s) + tl.load(recv_off + seg) + i * BLOCK_M
            h_rows = (h_row0 + offs_m).to(tl.int64)
            cols = sl * BLOCK_N + offs_n
            cmask = cols < N
            w_base = w_ptr + e.to(tl.int64) * N * K
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                kmask = kk < K
                if A_TMA:
                    a = a_desc.load([h_row0.to(tl.int32), k0])
                else:
                    a = tl.load(h_ptr + h_rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                                other=0.0)
                if B_KMAJOR:
                    if USE_TMA:
                        b = w_desc.load([(e * K + k0).to(tl.int32), sl * BLOCK_N])
                    else:
                        b = tl.load(w_base + kk[:, None].to(tl.int64) * N + cols[None, :],
                                    mask=kmask[:, None] & cmask[None, :], other=0.0)
                elif USE_TMA:
                    b = w_desc.load([(e * N + sl * BLOCK_N).to(tl.int32), k0]).T
                else:
                    b = tl.load(w_base + cols[None, :].to(tl.int64) * K + kk[:, None],
                                mask=kmask[:, None] & cmask[None, :], other=0.0)
                acc = tl.dot(a, b, acc)
            if DEFER_COUNT:
                if pend_s >= 0:  # the previous tile: its stores were issued a main loop ago
                    _count_tile(counters_ptr, tiles_from_source, flags1_table, pend_s, pend_sl, n_slices, me, epoch)
            ret_row0 = tl.load(recv_ret_row0 + seg)
            dst = peer_region(ret_table, s, h_ptr.dtype.element_ty)
            ret_rows = (ret_row0 + i * BLOCK_M + offs_m).to(tl.int64)
            tl.store(dst + ret_rows[:, None] * N + cols[None, :], acc.to(h_ptr.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :])
            if DEFER_COUNT:
                pend_s = s
                pend_sl = sl
            else:  # count the tile now; the last of (home s, slice) publishes
                _count_tile(counters_ptr, tiles_from_source, flags1_table, s, sl, n_slices, me, epoch)
            if TIMELINE:
                kind = tl.where(s == me, KIND_GEMM1, KIND_GEMM1_REMOTE)  # by the rows' home
                timeline_record(timeline_ptr, timeline_cap, work, epoch, pid, kind, work, t_start, t_start,
                                timeline_now(timeline_clock, TIMELINE), TIMELINE)
            work = claim(queue_ptr)
        if DEFER_COUNT:
            if pend_s >= 0:  # before this program joins the combine, which may wait on it
                _count_tile(counters_ptr, tiles_from_source, flags1_table, pend_s, pend_sl, n_slices, me, epoch)
    if (pid < n_comm) | (join != 0):
        # ---- combine work: out[t, slice] = Σ_j w[t, j] · ret[row(t, j), slice] in fp32. Tasks
        # are claimed in slice order; GEMM programs join once every GEMM item is claimed (when
        # ``join``), so a waiting task only waits on items running programs hold.
        n_tb = tl.cdiv(T, BLOCK_T)
        offs_t = tl.arange(0, BLOCK_T)
        offs_n = tl.arange(0, BLOCK_N)
        # A program's claims only grow, so its tasks come in slice order: once it has acquired a
        # slice's flags, its later tasks of that slice skip the (system-scope) polls. Their loads
        # follow that acquire in program order, barriers included, so they see the slice's rows.
        checked_sl = -1
        task = claim(queue_ptr + 1)
        while task < n_slices * n_tb:
            t_start = timeline_now(timeline_clock, TIMELINE)
            sl = task // n_tb
            tb = task % n_tb
            if sl > checked_sl:
                for d in range(0, W):
                    if tl.load(sent_rows_ptr + d) > 0:
                        wait_flag(flags1_ptr + d * n_slices + sl, epoch, max_spins, error_ptr, me, WAIT_LAYER1, d, sl,
                                  -1)
                checked_sl = sl
            t_waited = timeline_now(timeline_clock, TIMELINE)
            t = tb * BLOCK_T + offs_t
            tmask = t < T
            cols = sl * BLOCK_N + offs_n
            cmask = cols < N
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(TOP_K):
                row = tl.load(row_of_assignment_ptr + t * TOP_K + j, mask=tmask, other=-1)
                wt = tl.load(weight_ptr + t * TOP_K + j, mask=tmask, other=0.0).to(tl.float32)
                kept = tmask & (row >= 0)
                y = tl.load(ret_ptr + row.to(tl.int64)[:, None] * N + cols[None, :],
                            mask=kept[:, None] & cmask[None, :], other=0.0)
                acc += wt[:, None] * y.to(tl.float32)
            tl.store(out_ptr + t.to(tl.int64)[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=tmask[:, None] & cmask[None, :])
            if TIMELINE:  # slots after the GEMM1 items'
                timeline_record(timeline_ptr, timeline_cap, n_slices * tl.load(recv_num_tiles) + task, epoch, pid,
                                KIND_COMBINE, task, t_start, t_waited, timeline_now(timeline_clock, TIMELINE), TIMELINE)
            task = claim(queue_ptr + 1)
    finish_queue(queue_ptr, n_programs)


def gemm1_combine(h, w_down, out, topk_weight, row_of_assignment, buf, plan, *, n_comm: int, n_programs: int,
                  config, max_spins: int, role: str = "all", timeline: tuple | None = None, w_kmajor: bool = False,
                  h_base: torch.Tensor | None = None):
    """Launch layer1 on this rank. ``role``: ``"all"`` (one launch, both roles), ``"gemm"`` or
    ``"comm"`` (the combine). ``timeline``: as for :func:`interlace.kernels.comet.layer0.dispatch_gemm0`.
    ``w_kmajor``: ``w_down`` is a (E_l, K, N) matrix used as stored and ``h`` has K columns (the
    backward's d_h @ W_up, K = up width). ``config.tma`` forces TMA on or off (None: by capability).
    ``h_base`` (W,) int32: the first row of h of each source's rows (default ``buf.region_base``:
    the receive buffer's layout, as layer0 stores it)."""
    spec = buf.spec
    N, K = spec.hidden, (w_down.shape[1] if w_kmajor else w_down.shape[2])
    pid_base, grid, tma = launch_roles("layer1", role, n_comm, n_programs, w_down, force_tma=config.tma)
    a_tma = bool(config.a_tma1) and tma and tma_rows_ok(h) and h.shape[1] == K
    tl_records, tl_clock, tl_cap, tl_mode = timeline or (None, None, 0, 0)
    v = buf.views
    launch(_gemm1_combine_kernel, (grid,),
        h, w_down, buf.region_base if h_base is None else h_base, v["ret"], v["flags1"], buf.counters1,
        buf.tables["ret"], buf.tables["flags1"],
        plan.recv_count, plan.recv_off, plan.recv_ret_row0, plan.recv_tiles[0], plan.recv_tiles[1],
        plan.recv_tiles[2], plan.tiles_from_source,
        out, topk_weight, row_of_assignment, plan.sent_rows,
        buf.epoch, buf.error,
        buf.rank, spec.world, N, K, spec.cap, spec.num_local, out.shape[0],
        buf.queue1, n_comm, n_programs, pid_base, max_spins, int(role == "all"), config.slice_group,
        tl_records, tl_clock, tl_cap,
        TOP_K=spec.top_k, BLOCK_M=spec.block_m, BLOCK_N=spec.block_n1, BLOCK_K=config.block_k,
        BLOCK_T=config.block_t, GROUP_M=config.group_m, USE_TMA=tma, B_KMAJOR=w_kmajor, num_warps=config.num_warps,
        num_stages=config.num_stages, TIMELINE=tl_mode, A_TMA=a_tma,
        H_ROWS=h.shape[0], DEFER_COUNT=bool(config.defer_count),
    )
