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

**Pull mode** (``COMBINE_PULL``): a GEMM tile stores its block into the *owner's own* ``recv``
region instead (a local store, at the rows its ``h`` rows have: layer0 is done with them), and
the home's combine programs load each row from its owner, over NVLink for a peer. So no GEMM
program pushes over NVLink (run 54: GEMM1 tiles with a remote home took 12-27% longer, stalled
until their 64 KiB drained); the combine programs carry the transfer. A home dispatch row r
for owner d lives at row ``home·cap + r − (first dispatch row for d)`` of d's region: the same
place the row's token went in layer0. The region is next written by the home's next layer0
sends, which start only after the home's combine has finished.

**Push mode** (``PUSH_RET``): a GEMM tile with a remote home is stored in the owner's own
``recv`` region too (the same place as in pull mode) and its per-item flag is released; the
combine programs first *push* those tiles to their homes, in the GEMM items' order as they
become ready, count them on the (home, slice) counters and only then start combining. The
GEMM programs never store over NVLink and the bytes still cross under GEMM1 (pull mode's
loads wait for whole tokens, so they came after it, run 64); the pushes use programs that
would otherwise spin on the first slice's flags. Tiles of this rank's own tokens go straight
to ``ret`` as in the default mode. Measured 0.97–1.12× the default's time on H200 (runs
72–75): GEMM1 stops stalling, but under GEMM1 a push program moves only 6–12 GB/s, so about
half the bytes still cross after it. Off by default (``FusedKernelConfig.combine_push``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from interlace.kernels.expert_gemm.tile import slice_grouped_work
from interlace.kernels.comet.flags import (WAIT_LAYER1, WAIT_PUSH1, bulk_stores_done, claim, fence_acq_rel_sys, finish_queue,
                                 launch_roles, peer_region, publish_flag, wait_flag)
from interlace.kernels.tma import tma_rows_ok
from interlace.kernels.launch import launch
from interlace.kernels.timeline import (KIND_COMBINE, KIND_GEMM1, KIND_GEMM1_REMOTE, KIND_PUSH1, timeline_now,
                                    timeline_record)


@triton.jit
def _count_tile(counters_ptr, tiles_from_source, flags1_table, s, sl, n_slices, me, epoch,
                BULK_WAIT: tl.constexpr = False):
    """Count one finished tile of (home ``s``, slice ``sl``); the last one publishes the slice.
    acq_rel + sys scope: this program's earlier stores (peer stores included) are released, and
    the last arriver acquires everyone's before it releases the home's flag. ``BULK_WAIT``: the
    rows went out as TMA stores; every thread first waits for its own to complete."""
    if BULK_WAIT:
        bulk_stores_done(epoch)
    tl.debug_barrier()
    counter = counters_ptr + s * n_slices + sl
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="sys")
    if done == tl.load(tiles_from_source + s) - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        flags = peer_region(flags1_table, s, tl.int32)
        publish_flag(flags + me * n_slices + sl, epoch)


@triton.jit
def _count_tile_fenced(counters_ptr, tiles_from_source, flags1_table, s, sl, n_slices, me, epoch):
    """:func:`_count_tile` after the caller's ``fence_acq_rel_sys`` (which released this
    program's stores): a relaxed count; the last arriver fences again (acquiring every other
    count's stores) before it releases the home's flag."""
    counter = counters_ptr + s * n_slices + sl
    done = tl.atomic_add(counter, 1, sem="relaxed", scope="gpu")
    if done == tl.load(tiles_from_source + s) - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        fence_acq_rel_sys(done)
        flags = peer_region(flags1_table, s, tl.int32)
        publish_flag(flags + me * n_slices + sl, epoch)


@triton.jit
def _push_tiles(h_ptr, y_ptr, items_ptr, ret_table, flags1_table, counters_ptr, tiles_from_source,
                recv_count, recv_off, recv_ret_row0, recv_tile_seg, recv_tile_idx, recv_num_tiles,
                queue_ptr, epoch, error_ptr, me, W, N, cap, num_local, T, max_spins, slice_group, pid,
                timeline_ptr, timeline_clock, timeline_cap, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_T: tl.constexpr, GROUP_M: tl.constexpr, PUSH_ROWS: tl.constexpr, TIMELINE: tl.constexpr,
                PUSH_BATCH: tl.constexpr, FENCED: tl.constexpr):
    """Push mode: move staged tiles with a remote home to it, claimed in the GEMM items' order
    (a push waits only on an item that a running GEMM program holds, and GEMM items never
    wait; joined GEMM programs help with the last ones), then count each for its home.

    Items are claimed ``PUSH_BATCH`` at a time and counted after the whole batch is pushed: a
    count is a system-scope release, which waits until the program's peer stores have landed,
    so one per 64 KiB tile held a program to ~8 GB/s (run 72); one wait per batch lets the
    stores of a batch stream. ``FENCED`` (GPUs): one ``fence.acq_rel.sys`` per batch and
    relaxed counts, where an acq_rel count per item fenced again each time (~4 µs per item of a
    batch, run 74)."""
    n_slices = tl.cdiv(N, BLOCK_N)
    n_tiles = tl.load(recv_num_tiles)
    n_items = n_slices * n_tiles
    offs_r = tl.arange(0, PUSH_ROWS)
    offs_n = tl.arange(0, BLOCK_N)
    n_tb = tl.cdiv(T, BLOCK_T)
    p0 = tl.atomic_add(queue_ptr + 3, PUSH_BATCH, sem="relaxed", scope="gpu")
    while p0 < n_items:
        p_end = tl.minimum(p0 + PUSH_BATCH, n_items)
        for p in range(p0, p_end):
            _push_tile(h_ptr, y_ptr, items_ptr, ret_table, recv_count, recv_off, recv_ret_row0, recv_tile_seg,
                       recv_tile_idx, epoch, error_ptr, me, W, N, cap, num_local, max_spins, slice_group, pid,
                       p, n_tiles, n_slices, n_tb, offs_r, offs_n, timeline_ptr, timeline_clock, timeline_cap,
                       BLOCK_M, BLOCK_N, GROUP_M, PUSH_ROWS, TIMELINE)
        if FENCED:
            tl.debug_barrier()  # every thread's stores, then one fence (which waits for them to land)
            fence_acq_rel_sys(p0)
        for p in range(p0, p_end):
            tile, sl = slice_grouped_work(p, n_tiles, n_slices, slice_group, GROUP_M)
            s = (me + tl.load(recv_tile_seg + tile) // num_local) % W
            if s != me:
                if FENCED:
                    _count_tile_fenced(counters_ptr, tiles_from_source, flags1_table, s, sl, n_slices, me, epoch)
                else:
                    _count_tile(counters_ptr, tiles_from_source, flags1_table, s, sl, n_slices, me, epoch)
        p0 = tl.atomic_add(queue_ptr + 3, PUSH_BATCH, sem="relaxed", scope="gpu")


@triton.jit
def _push_tile(h_ptr, y_ptr, items_ptr, ret_table, recv_count, recv_off, recv_ret_row0, recv_tile_seg, recv_tile_idx,
               epoch, error_ptr, me, W, N, cap, num_local, max_spins, slice_group, pid,
               p, n_tiles, n_slices, n_tb, offs_r, offs_n, timeline_ptr, timeline_clock, timeline_cap,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, PUSH_ROWS: tl.constexpr,
               TIMELINE: tl.constexpr):
    """Push item ``p`` (uncounted) if its rows' home is a peer: wait for its staging flag, then
    copy its rows of the slice from this rank's staging region into the home's ``ret``. Whole
    tiles per step by default: the loop is not software-pipelined, so each step waits for its
    loads (16-row steps moved ~6 GB/s per program under GEMM1, run 73)."""
    tile, sl = slice_grouped_work(p, n_tiles, n_slices, slice_group, GROUP_M)
    seg = tl.load(recv_tile_seg + tile)
    s = (me + seg // num_local) % W
    if s != me:
        t_start = timeline_now(timeline_clock, TIMELINE)
        i = tl.load(recv_tile_idx + tile)
        wait_flag(items_ptr + p, epoch, max_spins, error_ptr, me, WAIT_PUSH1, s, sl, tile)
        tl.debug_barrier()  # the staged rows are read after the acquire, by every thread
        t_waited = timeline_now(timeline_clock, TIMELINE)
        n_rows = tl.minimum(tl.load(recv_count + seg) - i * BLOCK_M, BLOCK_M)
        src_row0 = s * cap + tl.load(recv_off + seg) + i * BLOCK_M
        dst_row0 = tl.load(recv_ret_row0 + seg) + i * BLOCK_M
        dst = peer_region(ret_table, s, h_ptr.dtype.element_ty)
        cols = sl * BLOCK_N + offs_n
        cmask = cols < N
        for r0 in range(0, n_rows, PUSH_ROWS):
            r = r0 + offs_r
            m = (r < n_rows)[:, None] & cmask[None, :]
            v = tl.load(y_ptr + (src_row0 + r).to(tl.int64)[:, None] * N + cols[None, :], mask=m)
            tl.store(dst + (dst_row0 + r).to(tl.int64)[:, None] * N + cols[None, :], v, mask=m)
        if TIMELINE:  # slots after the combine tasks'; the record ends before the batch's count
            timeline_record(timeline_ptr, timeline_cap, n_slices * (n_tiles + n_tb) + p, epoch, pid, KIND_PUSH1,
                            p, t_start, t_waited, timeline_now(timeline_clock, TIMELINE), TIMELINE)


@triton.jit
def _count_tile_each_thread(counters_ptr, tiles_from_source, flags1_table, s, sl, n_slices, me, epoch, valid,
                            THREADS: tl.constexpr, BULK_WAIT: tl.constexpr):
    """:func:`_count_tile` without a barrier, for the flat loop (a ``debug_barrier`` in a loop
    keeps Triton from pipelining it): *every thread* counts, so the counter of (home ``s``,
    slice ``sl``) ends at tiles × THREADS. Each thread's acq_rel count releases its own
    earlier writes — for the thread that issued the tile's TMA store, after it waited for the
    store to complete (``BULK_WAIT``) —, so whichever thread issued it, the last arriver has
    acquired every store before it releases the home's flag. ``valid`` False: a no-op."""
    if BULK_WAIT:
        bulk_stores_done(epoch)
    sv = tl.maximum(s, 0)
    lanes = tl.arange(0, THREADS)
    counter = counters_ptr + sv * n_slices + sl + lanes * 0
    done = tl.atomic_add(counter, tl.full((THREADS,), 1, tl.int32), sem="acq_rel", scope="sys",
                         mask=valid & (lanes >= 0))
    last = valid & (done == tl.load(tiles_from_source + sv) * THREADS - 1)
    tl.atomic_xchg(counter, tl.zeros((THREADS,), tl.int32), sem="relaxed", scope="gpu", mask=last)
    flags = peer_region(flags1_table, sv, tl.int32)
    tl.atomic_xchg(flags + me * n_slices + sl + lanes * 0, tl.full((THREADS,), 0, tl.int32) + epoch, sem="release",
                   scope="sys", mask=last)


@triton.jit
def _gemm1_flat(h_ptr, w_ptr, ret_table, flags1_table, counters_ptr, tiles_from_source, recv_count, recv_off,
                recv_ret_row0, recv_tile_seg, recv_tile_idx, recv_num_tiles, epoch, me, W, N, K, cap, num_local,
                n_comm, n_programs, pid, slice_group, H_ROWS, timeline_ptr, timeline_clock, timeline_cap,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                TIMELINE: tl.constexpr, BULK_WAIT: tl.constexpr, THREADS: tl.constexpr, TMA_STORE: tl.constexpr):
    """The GEMM programs' work as one flat loop over (item, k step) steps (``flat1``; the form
    of the expert kernels' ``persistent = 2``): the software pipeline runs across items, so the
    next tile's first h and W_down blocks load while this tile's last steps and its store run.
    GEMM1's reduction is short (K = ffn: 12–32 steps of 64), so a nested loop's pipeline fill
    and epilogue per tile are a large share of it.

    Items are dealt statically, ``g, g + G, …`` for GEMM program g of G (a loop's trip count
    must be known for Triton to pipeline it, which a claimed queue does not give), in the same
    slice-grouped order as the queue. GEMM programs still never wait, so every slice flag is
    published once they have run; a combine program that waits on a GEMM program not yet
    resident only holds its own SM (grid ≤ SM count, one program per SM).

    ``TMA_STORE`` (``flat1 = 1``): a tile's rows go to their home's ``ret`` as one TMA store
    (through a descriptor made per tile whose rows end at the segment's last row, so a partial
    tile's other rows are clipped) that drains under the next tile's loads; else (``flat1 = 2``)
    as masked register stores. Its count is deferred to the next tile's end, after a wait for the
    TMA store to complete (``BULK_WAIT`` on GPUs): the count releases the rows."""
    n_slices = tl.cdiv(N, BLOCK_N)
    n_tiles = tl.load(recv_num_tiles)
    n_gemm = n_programs - n_comm
    g = pid - n_comm
    k_steps = tl.cdiv(K, BLOCK_K)
    my_items = tl.maximum(tl.cdiv(n_slices * n_tiles - g, n_gemm), 0)
    a_desc = tl.make_tensor_descriptor(h_ptr, shape=[H_ROWS, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_local * N, K], strides=[K, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    ki = k_steps - 1
    work = g - n_gemm
    seg = tl.full((), 0, tl.int32)
    i = tl.full((), 0, tl.int32)
    sl = tl.full((), 0, tl.int32)
    s = tl.full((), 0, tl.int32)
    e = tl.full((), 0, tl.int32)
    h_row0 = tl.full((), 0, tl.int32)
    pend_s = tl.full((), -1, tl.int32)
    pend_sl = tl.full((), 0, tl.int32)
    t_start = timeline_now(timeline_clock, TIMELINE)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, my_items * k_steps):
        ki = tl.where(ki == k_steps - 1, 0, ki + 1)
        if ki == 0:
            work += n_gemm
            tile, sl = slice_grouped_work(work, n_tiles, n_slices, slice_group, GROUP_M)
            seg = tl.load(recv_tile_seg + tile)
            i = tl.load(recv_tile_idx + tile)
            e = seg % num_local
            s = (me + seg // num_local) % W
            h_row0 = s * cap + tl.load(recv_off + seg) + i * BLOCK_M
            if TIMELINE:
                t_start = timeline_now(timeline_clock, TIMELINE)
        a = a_desc.load([h_row0, ki * BLOCK_K])
        b = w_desc.load([e * N + sl * BLOCK_N, ki * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
        if ki == k_steps - 1:
            # the previous tile, whose store has drained under this tile's loop
            _count_tile_each_thread(counters_ptr, tiles_from_source, flags1_table, pend_s, pend_sl, n_slices, me,
                                    epoch, pend_s >= 0, THREADS, BULK_WAIT)
            ret_row0 = tl.load(recv_ret_row0 + seg)
            dst = peer_region(ret_table, s, h_ptr.dtype.element_ty)
            if TMA_STORE:
                # (a descriptor per tile: the previous tile's store, the last user of this one's
                # scratch, has completed: its count waited for it)
                ret_desc = tl.make_tensor_descriptor(dst, shape=[ret_row0 + tl.load(recv_count + seg), N],
                                                     strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
                ret_desc.store([ret_row0 + i * BLOCK_M, sl * BLOCK_N], acc.to(h_ptr.dtype.element_ty))
            else:  # register stores (each thread's count below releases its own)
                offs_m = tl.arange(0, BLOCK_M)
                cols = sl * BLOCK_N + tl.arange(0, BLOCK_N)
                rmask = offs_m < tl.load(recv_count + seg) - i * BLOCK_M
                ret_rows = (ret_row0 + i * BLOCK_M + offs_m).to(tl.int64)
                tl.store(dst + ret_rows[:, None] * N + cols[None, :], acc.to(h_ptr.dtype.element_ty),
                         mask=rmask[:, None] & (cols < N)[None, :])
            pend_s = s
            pend_sl = sl
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if TIMELINE:
                kind = tl.where(s == me, KIND_GEMM1, KIND_GEMM1_REMOTE)  # by the rows' home
                timeline_record(timeline_ptr, timeline_cap, work, epoch, pid, kind, work, t_start, t_start,
                                timeline_now(timeline_clock, TIMELINE), TIMELINE)
    # the last tile, before this program joins the combine (which may wait on it)
    _count_tile_each_thread(counters_ptr, tiles_from_source, flags1_table, pend_s, pend_sl, n_slices, me, epoch,
                            pend_s >= 0, THREADS, BULK_WAIT)


@triton.jit
def _gemm1_combine_kernel(
    h_ptr, w_ptr,  # (W·cap, K) from layer0; w_down (E_l, N, K) (B_KMAJOR: (E_l, K, N), the backward's W_up)
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
    RET_TMA: tl.constexpr = False,  # the tile's rows go to the home as a TMA store (see below)
    BULK_WAIT: tl.constexpr = False,  # with RET_TMA on a GPU: wait for the stores before a count
    COMBINE_PULL: tl.constexpr = False,  # pull mode (module docstring)
    y_ptr=None, y_table=None, send_row0_ptr=None,  # pull mode: this rank's recv (W·cap, N), its peers'
    # addresses, and the first dispatch row of each (destination, expert) segment (W·E_l,)
    PUSH_RET: tl.constexpr = False,  # push mode (module docstring); y_ptr is the staging region
    items_ptr=None,  # push mode: (≥ S·tiles,) int32 per-item staging flags (epochs), local
    push_only=0,  # push mode, simulated ranks: these programs push, then leave (no combine)
    PUSH_ROWS: tl.constexpr = 128,  # push mode: rows per load/store step of a push
    PUSH_BATCH: tl.constexpr = 8,  # push mode: items a program claims, pushes, then counts together
    PUSH_FENCED: tl.constexpr = False,  # push mode on a GPU: one system fence per batch, relaxed counts
    FLAT: tl.constexpr = False,  # GEMM items as one flat pipelined loop, rows stored by TMA (_gemm1_flat)
    THREADS: tl.constexpr = 256,  # FLAT: threads per program (32 · num_warps)
    FLAT_TMA: tl.constexpr = True,  # FLAT: the rows go home as TMA stores (else register stores)
):
    pid = tl.program_id(0) + pid_base
    epoch = tl.load(epoch_ptr)
    n_slices = tl.cdiv(N, BLOCK_N)
    if FLAT:
        if pid >= n_comm:
            _gemm1_flat(h_ptr, w_ptr, ret_table, flags1_table, counters_ptr, tiles_from_source, recv_count, recv_off,
                        recv_ret_row0, recv_tile_seg, recv_tile_idx, recv_num_tiles, epoch, me, W, N, K, cap,
                        num_local, n_comm, n_programs, pid, slice_group, H_ROWS, timeline_ptr, timeline_clock,
                        timeline_cap, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TIMELINE, BULK_WAIT, THREADS, FLAT_TMA)
    elif pid >= n_comm:
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
            h_row0 = s * cap + tl.load(recv_off + seg) + i * BLOCK_M
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
                    _count_tile(counters_ptr, tiles_from_source, flags1_table, pend_s, pend_sl, n_slices, me, epoch,
                                BULK_WAIT)
            ret_row0 = tl.load(recv_ret_row0 + seg)
            dst = peer_region(ret_table, s, h_ptr.dtype.element_ty)
            count_s = s  # the home whose (home, slice) counter this program counts the tile on
            if COMBINE_PULL:  # into this rank's own region, at the h rows' positions
                tl.store(y_ptr + h_rows[:, None] * N + cols[None, :], acc.to(h_ptr.dtype.element_ty),
                         mask=rmask[:, None] & cmask[None, :])
            elif PUSH_RET:
                if s != me:  # staged locally; a push program moves it and counts it
                    tl.store(y_ptr + h_rows[:, None] * N + cols[None, :], acc.to(h_ptr.dtype.element_ty),
                             mask=rmask[:, None] & cmask[None, :])
                    tl.debug_barrier()  # every thread's stores before the release
                    tl.atomic_xchg(items_ptr + work, epoch, sem="release", scope="gpu")
                    count_s = tl.full((), -1, tl.int32)
                else:
                    ret_rows = (ret_row0 + i * BLOCK_M + offs_m).to(tl.int64)
                    tl.store(ret_ptr + ret_rows[:, None] * N + cols[None, :], acc.to(h_ptr.dtype.element_ty),
                             mask=rmask[:, None] & cmask[None, :])
            elif RET_TMA:
                # RET_TMA: the TMA unit moves the tile (over NVLink for a peer home), meant to let
                # the program go on where register stores to a peer stall it until they drain
                # (run 54). Measured no faster on H200 (run 55): Triton waits after the store
                # until TMA has read the staged tile, which drains at the same rate.
                # The descriptor ends at the segment's last row, so the rows of a partial tile
                # past it (another segment's) are clipped, not written. A descriptor per tile:
                # the previous tile's store has completed (its count waited) before it is rebuilt.
                ret_desc = tl.make_tensor_descriptor(dst, shape=[ret_row0 + tl.load(recv_count + seg), N],
                                                     strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
                ret_desc.store([ret_row0 + i * BLOCK_M, sl * BLOCK_N], acc.to(h_ptr.dtype.element_ty))
            else:
                ret_rows = (ret_row0 + i * BLOCK_M + offs_m).to(tl.int64)
                tl.store(dst + ret_rows[:, None] * N + cols[None, :], acc.to(h_ptr.dtype.element_ty),
                         mask=rmask[:, None] & cmask[None, :])
            if DEFER_COUNT:
                pend_s = count_s
                pend_sl = sl
            elif count_s >= 0:  # count the tile now; the last of (home s, slice) publishes
                _count_tile(counters_ptr, tiles_from_source, flags1_table, s, sl, n_slices, me, epoch, BULK_WAIT)
            if TIMELINE:
                kind = tl.where(s == me, KIND_GEMM1, KIND_GEMM1_REMOTE)  # by the rows' home
                timeline_record(timeline_ptr, timeline_cap, work, epoch, pid, kind, work, t_start, t_start,
                                timeline_now(timeline_clock, TIMELINE), TIMELINE)
            work = claim(queue_ptr)
        if DEFER_COUNT:
            if pend_s >= 0:  # before this program joins the combine, which may wait on it
                _count_tile(counters_ptr, tiles_from_source, flags1_table, pend_s, pend_sl, n_slices, me, epoch,
                            BULK_WAIT)
    if PUSH_RET:
        if (pid < n_comm) | (join != 0):
            _push_tiles(h_ptr, y_ptr, items_ptr, ret_table, flags1_table, counters_ptr, tiles_from_source,
                        recv_count, recv_off, recv_ret_row0, recv_tile_seg, recv_tile_idx, recv_num_tiles,
                        queue_ptr, epoch, error_ptr, me, W, N, cap, num_local, T, max_spins, slice_group, pid,
                        timeline_ptr, timeline_clock, timeline_cap, BLOCK_M, BLOCK_N, BLOCK_T, GROUP_M, PUSH_ROWS,
                        TIMELINE, PUSH_BATCH, PUSH_FENCED)
    if ((pid < n_comm) | (join != 0)) & (push_only == 0):
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
                if COMBINE_PULL:
                    # owner d of dispatch row r: the last rank whose rows start at or before r
                    # (ranks this rank sent nothing start where the next one does)
                    owner = tl.zeros_like(row)
                    for dd in range(1, W):
                        owner += (row >= tl.load(send_row0_ptr + dd * num_local)).to(row.dtype)
                    src_row = me * cap + row - tl.load(send_row0_ptr + owner * num_local, mask=kept, other=0)
                    base = tl.load(y_table + owner, mask=kept, other=0).to(tl.pointer_type(h_ptr.dtype.element_ty))
                    base = tl.multiple_of(base, 16)  # PeerBuffer checks the 16-byte alignment
                    y = tl.load(base[:, None] + src_row.to(tl.int64)[:, None] * N + cols[None, :],
                                mask=kept[:, None] & cmask[None, :], other=0.0)
                else:
                    y = tl.load(ret_ptr + row.to(tl.int64)[:, None] * N + cols[None, :],
                                mask=kept[:, None] & cmask[None, :], other=0.0)
                acc += wt[:, None] * y.to(tl.float32)
            tl.store(out_ptr + t.to(tl.int64)[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=tmask[:, None] & cmask[None, :])
            if TIMELINE:  # slots after the GEMM1 items'
                timeline_record(timeline_ptr, timeline_cap, n_slices * tl.load(recv_num_tiles) + task, epoch, pid,
                                KIND_COMBINE, task, t_start, t_waited, timeline_now(timeline_clock, TIMELINE), TIMELINE)
            task = claim(queue_ptr + 1)
    if push_only == 0:
        finish_queue(queue_ptr, n_programs)


def gemm1_combine(h, w_down, out, topk_weight, row_of_assignment, buf, plan, *, n_comm: int, n_programs: int,
                  config, max_spins: int, role: str = "all", timeline: tuple | None = None, w_kmajor: bool = False,
                  pull: bool = False, push: bool = False):
    """Launch layer1 on this rank. ``role``: ``"all"``, ``"gemm"``, ``"push"`` (push mode's
    pushes only, before any rank's ``"comm"``) or ``"comm"`` (pushes left, then the combine).
    ``timeline``: as for :func:`interlace.kernels.comet.layer0.dispatch_gemm0`. ``w_kmajor``:
    ``w_down`` is a (E_l, K, N) matrix used as stored and ``h`` has K columns (the backward's
    d_h @ W_up, K = up width). ``pull``: pull mode (module docstring; needs peer loads, so not
    on the staged transport, and leaves ``ret`` unwritten). ``push``: push mode (module
    docstring; stages tiles in this rank's ``recv`` region, so not where the caller reads it after)."""
    if pull and buf.kind == "staged":
        raise ValueError("the pull combine loads rows from peers' buffers; the staged transport has none")
    if push and (pull or buf.kind == "staged"):
        raise ValueError("push mode needs peer stores from the combine programs (not the staged transport) "
                         "and excludes pull mode")
    if role == "push" and not push:
        raise ValueError("role 'push' is push mode's first phase")
    spec = buf.spec
    N, K = spec.hidden, (w_down.shape[1] if w_kmajor else w_down.shape[2])
    pid_base, grid, tma = launch_roles("layer1", role, n_comm, n_programs, w_down)
    a_tma = bool(config.a_tma1) and tma and tma_rows_ok(h) and h.shape[1] == K
    ret_tma = bool(config.ret_tma) and tma and N * h.element_size() % 16 == 0
    tl_records, tl_clock, tl_cap, tl_mode = timeline or (None, None, 0, 0)
    v = buf.views
    # flat1: the default mode only (the rows straight to ret), forward weights, everything through TMA
    flat = (bool(config.flat1) and tma and a_tma and not (w_kmajor or pull or push or ret_tma)
            and N * h.element_size() % 16 == 0)
    if push and spec.num_slices * plan.recv_tiles[3] > buf.items1.numel():
        raise ValueError(f"push mode: {spec.num_slices} slices × {plan.recv_tiles[3]} tiles exceed the buffer's "
                         f"{buf.items1.numel()} item flags")
    launch(_gemm1_combine_kernel, (grid,),
        h, w_down, v["ret"], v["flags1"], buf.counters1, buf.tables["ret"], buf.tables["flags1"],
        plan.recv_count, plan.recv_off, plan.recv_ret_row0, plan.recv_tiles[0], plan.recv_tiles[1],
        plan.recv_tiles[2], plan.tiles_from_source,
        out, topk_weight, row_of_assignment, plan.sent_rows,
        buf.epoch, buf.error,
        buf.rank, spec.world, N, K, spec.cap, spec.num_local, out.shape[0],
        buf.queue1, n_comm, n_programs, pid_base, max_spins, int(role == "all"), config.slice_group,
        tl_records, tl_clock, tl_cap,
        TOP_K=spec.top_k, BLOCK_M=spec.block_m, BLOCK_N=spec.block_n1, BLOCK_K=config.block_k,
        BLOCK_T=config.block_t, GROUP_M=config.group_m, USE_TMA=tma, B_KMAJOR=w_kmajor, num_warps=config.num_warps,
        # the flat loop's TMA store stages a whole tile in shared memory: 3 stages fit beside it (sm90:
        # 213 KB; 4 with register stores, whose layout conversion takes less: 229 KB)
        num_stages=min(config.num_stages, 3) if flat and config.flat1 == 1 else config.num_stages,
        TIMELINE=tl_mode, A_TMA=a_tma,
        H_ROWS=h.shape[0], DEFER_COUNT=bool(config.defer_count), RET_TMA=ret_tma and not (pull or push),
        BULK_WAIT=((flat and config.flat1 == 1) or (ret_tma and not (pull or push))) and h.is_cuda,
        COMBINE_PULL=pull, FLAT=flat, THREADS=32 * config.num_warps, FLAT_TMA=config.flat1 == 1,
        y_ptr=v["recv"] if pull or push else None, y_table=buf.tables["recv"] if pull else None,
        send_row0_ptr=plan.send_row0 if pull else None,
        PUSH_RET=push, items_ptr=buf.items1 if push else None, push_only=int(role == "push"),
        PUSH_ROWS=min(config.push_rows, spec.block_m),
        PUSH_BATCH=config.push_batch, PUSH_FENCED=push and h.is_cuda,
    )
