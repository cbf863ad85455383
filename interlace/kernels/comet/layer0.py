"""Layer0 of the fused strategy (COMET): dispatch → GEMM0 in one launch, thread-block specialized.

Programs ``0 .. n_comm-1`` are **communication** programs: they walk this rank's send tiles
(rows for other ranks' experts, see :mod:`interlace.kernels.comet.plan`), read the rows straight
from the token matrix through the dispatch index, store them into the owner's ``recv`` region
(peer stores over NVLink with torch symmetric memory), and release the tile's flag on the
owner. They never wait, so every wait below ends as long as all ranks launch the layer.

Programs ``n_comm ..`` are **GEMM** programs: a persistent loop over (row tile, column block)
work items of this rank's receive tiles, **local rows first** (their A rows come straight from
the token matrix through the dispatch index; no copy), then the tiles of the other sources,
each after an acquire-wait on its flag. The epilogue applies the activation (SwiGLU: gate and
up accumulate in the same tile) and stores ``h`` at the rows' region positions: row
``h_base[s] + r`` for the r-th row received from source s (``h_base[s] = s·cap``, the receive
buffer's layout, unless the caller packs the regions: the training backward's compact rows).

``n_comm`` is a run-time argument (the split is profiled per shape, never compiled in). The
grid never exceeds the SM count, one program per SM, so all programs are co-resident.
``pid_base`` and a partial grid let tests and the staged transport run the two roles as
separate launches (producers before consumers) with the very same code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interlace.kernels.expert_gemm.tile import activation_epilogue, gate_up_desc, gate_up_tile, grouped_work, kmajor_tile
from interlace.kernels.comet.flags import (WAIT_LAYER0, claim, fence_proxy_async, finish_queue, launch_roles,
                                 peer_region, publish_flag, wait_flag)
from interlace.kernels.tma import tma_rows_ok
from interlace.kernels.launch import cdiv, launch, next_power_of_2
from interlace.kernels.timeline import KIND_GEMM0_LOCAL, KIND_GEMM0_REMOTE, KIND_SEND, timeline_now, timeline_record

ACTIVATIONS = {"swiglu": 0, "gelu": 1, "relu": 2, "none": 3}

# ``gather0`` and ``joint0`` at -1 (auto) are on where the hidden size (GEMM0's reduction) is at
# least this: with a smaller hidden size the gather's extra copy of the local rows weighs more
# against a short GEMM0 than TMA's reads save (measured: docs/performance.md).
AUTO_GATHER0_MIN_HIDDEN = 4096


def layer0_switch(value: int, hidden: int) -> bool:
    """A ``gather0`` / ``joint0`` setting (-1 auto, 0, 1) for a layer of this hidden size."""
    return bool(value) if value >= 0 else hidden >= AUTO_GATHER0_MIN_HIDDEN


@triton.jit
def _copy_send_tile(x_ptr, assign_ptr, dst_ptr, row0, dst_row0, nrows, N, TOP_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, COPY_ROWS: tl.constexpr, COPY_COLS: tl.constexpr):
    """dst[dst_row0 + r] = x[assign[row0 + r] // TOP_K] for r < nrows (all N columns)."""
    for r0 in range(0, BLOCK_M, COPY_ROWS):
        r = r0 + tl.arange(0, COPY_ROWS)
        rmask = r < nrows
        tok = (tl.load(assign_ptr + row0 + r, mask=rmask, other=0) // TOP_K).to(tl.int64)
        dst_rows = (dst_row0 + r).to(tl.int64)
        for c0 in range(0, N, COPY_COLS):
            cols = c0 + tl.arange(0, COPY_COLS)
            m = rmask[:, None] & (cols < N)[None, :]
            v = tl.load(x_ptr + tok[:, None] * N + cols[None, :], mask=m)
            tl.store(dst_ptr + dst_rows[:, None] * N + cols[None, :], v, mask=m)


@triton.jit
def _gather_local_kernel(x_ptr, assign_ptr, recv_ptr, recv_local_row0, sent_rows, me, cap, N,
                         TOP_K: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``recv[me·cap + r] = x[assign[first + r] // TOP_K]`` for the ``sent_rows[me]`` rows this
    rank keeps for its own experts (``first``: their first dispatch row; they are one run in
    expert order, the same order as the local receive segments' offsets). Region ``me`` of
    ``recv`` is never written by a peer, so the local tiles can then read contiguous rows
    through TMA like the remote ones (Hopper has no TMA gather). Grid: cdiv(cap, ROWS)
    programs × cdiv(N, COLS); the row count stays on the device (no host sync)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    n = tl.load(sent_rows + me)
    if tl.program_id(0) * ROWS < n:
        rmask = r < n
        tok = (tl.load(assign_ptr + tl.load(recv_local_row0) + r, mask=rmask, other=0) // TOP_K).to(tl.int64)
        m = rmask[:, None] & (cols < N)[None, :]
        v = tl.load(x_ptr + tok[:, None] * N + cols[None, :], mask=m)
        tl.store(recv_ptr + (me * cap + r).to(tl.int64)[:, None] * N + cols[None, :], v, mask=m)


@triton.jit
def _dispatch_gemm0_kernel(
    x_ptr, assign_ptr,  # (T, N) tokens; (R,) int32 dispatch row → assignment t·k + j
    w_ptr, h_ptr,  # (E_l, up_width, N) up projection (B_KMAJOR: (E_l, N, K)); out (rows, K)
    pre_ptr,  # STORE_PRE: (rows, up_width) pre-activation out (the backward's input)
    h_base_ptr,  # (W,) int32 first row in h (and pre) of source s's region (s·cap: the receive layout)
    recv_ptr, flags0_ptr,  # this rank's recv (W, cap, N) and flags0 (W, E_l, TPS)
    recv_table, flags0_table,  # (W,) int64 peer addresses of recv and flags0
    send_count, send_row0, send_dst_off, send_tile_seg, send_tile_idx, send_num_tiles,
    recv_count, recv_off, recv_local_row0, recv_tile_seg, recv_tile_idx, recv_num_tiles,
    epoch_ptr, error_ptr,
    me, W, N, K, cap, num_local, TPS,
    queue_ptr,  # (3,) int32 work queue: [send tiles claimed, GEMM items claimed, programs done]
    n_comm, n_programs, pid_base, max_spins, join,
    timeline_ptr, timeline_clock, timeline_cap,  # (cap, 8) int64 records, (1,) clock: interlace.kernels.timeline
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COPY_ROWS: tl.constexpr, COPY_COLS: tl.constexpr, GROUP_M: tl.constexpr, USE_TMA: tl.constexpr,
    STORE_PRE: tl.constexpr = False, B_KMAJOR: tl.constexpr = False,
    TIMELINE: tl.constexpr = 0,  # 0 off (compiled out), 1 GPU clock, 2 logical clock (interpreter)
    A_TMA: tl.constexpr = False,  # remote tiles' A rows (contiguous in recv) through a TMA descriptor
    PROXY_FENCE: tl.constexpr = False,  # with A_TMA on a GPU: order the flag acquire before the TMA loads
    JOINT: tl.constexpr = False,  # SwiGLU with TMA weights: gate and up in one dot (expert_tile.gate_up_tile)
    LOCAL_TMA: tl.constexpr = False,  # with A_TMA: the local rows were gathered into region me (gather0)
):
    pid = tl.program_id(0) + pid_base
    epoch = tl.load(epoch_ptr)
    if pid < n_comm:
        # ---- communication program: push this rank's rows to their experts' owners ----
        n_send = tl.load(send_num_tiles)
        task = claim(queue_ptr)
        while task < n_send:
            t_start = timeline_now(timeline_clock, TIMELINE)
            seg = tl.load(send_tile_seg + task)
            i = tl.load(send_tile_idx + task)
            d = seg // num_local
            e = seg % num_local
            nrows = tl.minimum(BLOCK_M, tl.load(send_count + seg) - i * BLOCK_M)
            row0 = tl.load(send_row0 + seg) + i * BLOCK_M
            dst_row0 = me * cap + tl.load(send_dst_off + seg) + i * BLOCK_M
            dst = peer_region(recv_table, d, x_ptr.dtype.element_ty)
            _copy_send_tile(x_ptr, assign_ptr, dst, row0, dst_row0, nrows, N, TOP_K, BLOCK_M, COPY_ROWS, COPY_COLS)
            flags = peer_region(flags0_table, d, tl.int32)
            publish_flag(flags + (me * num_local + e) * TPS + i, epoch)
            if TIMELINE:
                timeline_record(timeline_ptr, timeline_cap, task, epoch, pid, KIND_SEND, task, t_start, t_start,
                                timeline_now(timeline_clock, TIMELINE), TIMELINE)
            task = claim(queue_ptr)
    if (pid >= n_comm) | (join != 0):
        # ---- GEMM work: h = act(A @ W_gate^T) * (A @ W_up^T), local tiles first. Items are
        # claimed in order by any program (communication programs join once nothing is left
        # to send, when ``join``: not in split launches, where they would run ahead of peers).
        n_blocks = tl.cdiv(K, BLOCK_N)
        up_width = 2 * K if ACTIVATION == 0 else K
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        n_work = tl.load(recv_num_tiles) * n_blocks
        w_desc = w_ptr  # the pointer path ignores it
        if USE_TMA:  # weights through TMA (Hopper+); A rows are gathered, so they stay tl.load
            if B_KMAJOR:
                w_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_local * N, K], strides=[K, 1],
                                                   block_shape=[BLOCK_K, BLOCK_N])
            else:  # (JOINT: gate and up rows as one 3-D block, one double-width dot)
                w_desc = gate_up_desc(w_ptr, num_local, up_width, N, K, BLOCK_N, BLOCK_K, JOINT)
        a_desc = recv_ptr
        if A_TMA:
            # Hopper has no TMA gather, so only remote tiles (contiguous rows of recv) use it; a block
            # past the tile's valid rows reads neighbours into output rows the store masks.
            a_desc = tl.make_tensor_descriptor(recv_ptr, shape=[W * cap, N], strides=[N, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
        work = claim(queue_ptr + 1)
        while work < n_work:
            t_start = timeline_now(timeline_clock, TIMELINE)
            tile, nb = grouped_work(work, n_work // n_blocks, n_blocks, GROUP_M)
            seg = tl.load(recv_tile_seg + tile)
            i = tl.load(recv_tile_idx + tile)
            j = seg // num_local  # j-th source in the order me, me+1, ...
            e = seg % num_local
            s = (me + j) % W
            rmask = offs_m < tl.load(recv_count + seg) - i * BLOCK_M
            h_row0 = s * cap + tl.load(recv_off + seg) + i * BLOCK_M  # (the tile's rows in recv)
            h_rows = (h_row0 + offs_m).to(tl.int64)
            out_rows = (tl.load(h_base_ptr + s) + tl.load(recv_off + seg) + i * BLOCK_M + offs_m).to(tl.int64)
            # Row pointers by select, not by branch: a pointer produced by a branch keeps the
            # compiler from pipelining the A loads (a much slower GEMM0).
            is_local = j == 0
            if not LOCAL_TMA:  # (a compile-time branch: the select below stays one pointer)
                local = tl.load(assign_ptr + tl.load(recv_local_row0 + seg) + i * BLOCK_M + offs_m,
                                mask=rmask & is_local, other=0)
            if not is_local:
                wait_flag(flags0_ptr + (s * num_local + e) * TPS + i, epoch, max_spins, error_ptr, me, WAIT_LAYER0,
                          s, e, i)
                if PROXY_FENCE:  # the rows are then read through TMA (the async proxy)
                    fence_proxy_async(epoch)
            t_waited = timeline_now(timeline_clock, TIMELINE)
            if LOCAL_TMA:
                a_rows = recv_ptr + h_rows * N
            else:
                a_rows = tl.where(is_local, x_ptr + (local // TOP_K).to(tl.int64) * N, recv_ptr + h_rows * N)
            cols = nb * BLOCK_N + offs_n
            cmask = cols < K
            if B_KMAJOR:  # backward: d(act) = dy_rows @ W_down[e], W_down[e] (N, K) as stored
                acc_g = kmajor_tile(a_rows, rmask, w_ptr + e.to(tl.int64) * N * K, w_desc, (e * N).to(tl.int32),
                                    nb * BLOCK_N, cols, cmask, N, K, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA)
                acc_u = acc_g
            else:
                w_base = w_ptr + e.to(tl.int64) * up_width * N
                w_row = (e * up_width + nb * BLOCK_N).to(tl.int32)
                if LOCAL_TMA:  # every tile's rows are contiguous in recv (local ones gathered there)
                    acc_g, acc_u = gate_up_tile(a_rows, rmask, w_base, w_desc, w_row, cols, cmask, N, K, ACTIVATION,
                                                BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, a_desc, h_row0.to(tl.int32), True,
                                                JOINT, e.to(tl.int32), nb * BLOCK_N)
                elif A_TMA and not is_local:  # two main loops, each pipelined on its own
                    acc_g, acc_u = gate_up_tile(a_rows, rmask, w_base, w_desc, w_row, cols, cmask, N, K, ACTIVATION,
                                                BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, a_desc, h_row0.to(tl.int32), True,
                                                JOINT, e.to(tl.int32), nb * BLOCK_N)
                else:
                    acc_g, acc_u = gate_up_tile(a_rows, rmask, w_base, w_desc, w_row, cols, cmask, N, K, ACTIVATION,
                                                BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, a_desc, 0, False,
                                                JOINT, e.to(tl.int32), nb * BLOCK_N)
            act = activation_epilogue(acc_g, acc_u, ACTIVATION)
            omask = rmask[:, None] & cmask[None, :]
            tl.store(h_ptr + out_rows[:, None] * K + cols[None, :], act.to(h_ptr.dtype.element_ty), mask=omask)
            if STORE_PRE:  # training: gate (and up) before the activation, for the backward
                tl.store(pre_ptr + out_rows[:, None] * up_width + cols[None, :], acc_g.to(pre_ptr.dtype.element_ty),
                         mask=omask)
                if ACTIVATION == 0:
                    tl.store(pre_ptr + out_rows[:, None] * up_width + K + cols[None, :],
                             acc_u.to(pre_ptr.dtype.element_ty), mask=omask)
            if TIMELINE:  # slots after the send tiles'
                timeline_record(timeline_ptr, timeline_cap, tl.load(send_num_tiles) + work, epoch, pid,
                                tl.where(is_local, KIND_GEMM0_LOCAL, KIND_GEMM0_REMOTE), work, t_start, t_waited,
                                timeline_now(timeline_clock, TIMELINE), TIMELINE)
            work = claim(queue_ptr + 1)
    finish_queue(queue_ptr, n_programs)


def dispatch_gemm0(x, assign, w_up, h, buf, plan, *, activation: str, n_comm: int, n_programs: int,
                   config, max_spins: int, role: str = "all", timeline: tuple | None = None,
                   pre: torch.Tensor | None = None, w_kmajor: bool = False, h_base: torch.Tensor | None = None):
    """Launch layer0 on this rank. ``role``: ``"all"`` (one launch, both roles),
    ``"comm"`` or ``"gemm"`` (one role only: simulated ranks and the staged transport).
    ``timeline``: ``(records, clock, cap, mode)`` of :class:`interlace.kernels.timeline.TimelineBuffer`
    to record every work item, or None (off: the recording is compiled out).
    ``pre`` (rows of h, up_width): also store the pre-activation there (training).
    ``h_base`` (W,) int32: the first row of h (and pre) of each source's rows (default
    ``buf.region_base``, s·cap: h is (W·cap, K) in the receive buffer's layout).
    ``w_kmajor``: ``w_up`` is a (E_l, N, K) matrix used as stored (``activation="none"``: the
    backward's dy_rows @ W_down). ``config.tma`` forces TMA on or off (None: by capability)."""
    spec = buf.spec
    N = spec.hidden
    K = w_up.shape[2] if w_kmajor else w_up.shape[1] // (2 if activation == "swiglu" else 1)
    pid_base, grid, tma = launch_roles("layer0", role, n_comm, n_programs, w_up, force_tma=config.tma)
    # (the backward's k-major GEMM keeps the pointer path)
    a_tma = bool(config.a_tma0) and tma and not w_kmajor and tma_rows_ok(buf.views["recv"])
    tl_records, tl_clock, tl_cap, tl_mode = timeline or (None, None, 0, 0)
    v = buf.views
    # gather0: the local rows are copied into region `me` of recv first, so every GEMM0 tile reads
    # its A rows through TMA (before the GEMM role: the staged transport's exchange runs between
    # the roles and may rewrite recv).
    local_tma = a_tma and layer0_switch(config.gather0, N)
    if local_tma and role in ("all", "gemm"):
        rows, cols = 32, min(512, next_power_of_2(N))
        launch(_gather_local_kernel, (cdiv(spec.cap, rows), cdiv(N, cols)),
            x, assign, v["recv"], plan.recv_local_row0, plan.sent_rows, buf.rank, spec.cap, N,
            TOP_K=spec.top_k, ROWS=rows, COLS=cols, num_warps=4,
        )
    launch(_dispatch_gemm0_kernel, (grid,),
        x, assign, w_up, h, pre if pre is not None else h, buf.region_base if h_base is None else h_base,
        v["recv"], v["flags0"], buf.tables["recv"], buf.tables["flags0"],
        plan.send_count, plan.send_row0, plan.send_dst_off, plan.send_tiles[0], plan.send_tiles[1],
        plan.send_tiles[2],
        plan.recv_count, plan.recv_off, plan.recv_local_row0, plan.recv_tiles[0], plan.recv_tiles[1],
        plan.recv_tiles[2],
        buf.epoch, buf.error,
        buf.rank, spec.world, N, K, spec.cap, spec.num_local, spec.tiles_per_segment,
        buf.queue0, n_comm, n_programs, pid_base, max_spins, int(role == "all"),
        tl_records, tl_clock, tl_cap,
        TOP_K=spec.top_k, ACTIVATION=ACTIVATIONS[activation],
        BLOCK_M=spec.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        COPY_ROWS=config.copy_rows, COPY_COLS=config.copy_cols, GROUP_M=config.group_m, USE_TMA=tma,
        STORE_PRE=pre is not None, B_KMAJOR=w_kmajor,
        num_warps=config.num_warps, num_stages=config.num_stages, TIMELINE=tl_mode, A_TMA=a_tma,
        PROXY_FENCE=a_tma and x.is_cuda,
        JOINT=layer0_switch(config.joint0, N) and tma and not w_kmajor and activation == "swiglu",
        LOCAL_TMA=local_tma,
    )

