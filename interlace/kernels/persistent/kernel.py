"""The whole MoE layer (world size 1) as one persistent Triton kernel: gate → index → GEMM0 +
activation → GEMM1 → combine, as tasks taken from one device-side queue.

A fixed grid of programs (no more than are co-resident) loops: take the next task number from
a global atomic counter, run it, repeat until the numbers run out. The task kinds, their counts
and their dependencies are listed in :mod:`interlace.kernels.persistent.tasks`; the state words,
waits and task ranges (shared with W > 1) in :mod:`interlace.kernels.persistent.protocol`; the
gate's device code in :mod:`interlace.kernels.persistent.routing`; the parameters in
:class:`~interlace.kernels.persistent.args.MoeKernelArgs`. In short:

* gate task g: fp32 router logits of tokens [g·BLOCK_T, (g+1)·BLOCK_T), top-k, routing weights,
  and this block's per-expert histogram plus each assignment's rank among the block's
  assignments of its expert (no atomics: the row order is a function of the routing alone);
* index task: waits for every gate task, scans the histograms into per-(block, expert) bases
  and per-expert offsets (an exclusive prefix sum), writes the row-tile table (expert, first
  row, expert end) and the expert-sorted row list both ways, then publishes the index flag;
* GEMM0 task (K-slice, tile): the tile's ≤ BLOCK_M rows gathered from x, times the expert's
  gate (and up) rows of that K-slice, activation in fp32, stored to h; counts its tile done;
* GEMM1 task (N-slice, tile): after the tile's every K-slice, h rows times W_down's slice;
* combine task (token block, N-slice): after every GEMM1 task of a real tile (the counter
  reaches n_tiles · n_n1, n_tiles read after the index flag), each token's k rows summed in
  fp32 in slot order (deterministic: no atomics touch any output), scaled by the weights.

Tasks past the real tile count (the launch is sized by a bound, see tasks.py) take their number,
see the index flag and the tile count, and exit without signalling: nothing waits for them
(the GEMM1 tasks of a tile wait for its own K-slices; the combine counts real tiles only).

Why this cannot deadlock. Task numbers are handed out in increasing order by the counter, and
every task waits only on tasks with smaller numbers (gate < index < GEMM0 < GEMM1 < combine). A
program only takes a number once it is running, so every task that has been taken belongs to a
program that runs. Take the smallest unfinished task: everything it waits for has a smaller
number, so it has been taken (numbers are taken in order) and, being smaller than the smallest
unfinished, has finished; so it does not wait and finishes. By induction every task finishes,
whatever the number of programs and however the GPU schedules them (even one program alone:
under ``TRITON_INTERPRET=1`` programs run one after another and the first one runs every task,
which checks the order). Waits are still bounded (``max_spins`` polls): a timed-out wait writes
one error record (the first; later waits give up at once) and the task skips its work, so a
broken order or a lost program ends the launch with an error the host raises instead of a hang.

Epochs. ``state[EPOCH]`` counts the calls that finished; a call's epoch is that plus one, read
by every program at its start (the previous launch has finished: stream order). The index flag
is set to the epoch (a waiter waits for ``flag ≥ epoch``), so it is never reset. The counters
(queue, gate and GEMM1 completions, per-tile GEMM0 completions, finished programs) are zeroed by
the last program to finish, inside the launch, after every other program has left its loop:
nothing is reset by the host between calls and a CUDA graph of the launch replays correctly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from interlace.kernels.expert_gemm.tile import activation_epilogue, gate_up_tile
from interlace.kernels.persistent import tasks
from interlace.kernels.persistent.protocol import (
    DONE, EPOCH, GATE_DONE, GEMM1_DONE, HEAD, INDEX_FLAG, N_TILES, PLAIN, QUEUE, WAIT_GATE, WAIT_GEMM0, WAIT_GEMM1,
    WAIT_INDEX, kind_starts, wait_at_least,
)
from interlace.kernels.persistent.routing import gate_choice, gate_logits, store_tile_table
from interlace.kernels.timeline import timeline_now, timeline_record

# Timeline record kinds (tasks.TIMELINE_KINDS).
REC_GATE = tl.constexpr(tasks.TIMELINE_KINDS.index("gate"))
REC_INDEX = tl.constexpr(tasks.TIMELINE_KINDS.index("index"))
REC_GEMM0 = tl.constexpr(tasks.TIMELINE_KINDS.index("gemm0"))
REC_GEMM1 = tl.constexpr(tasks.TIMELINE_KINDS.index("gemm1"))
REC_COMBINE = tl.constexpr(tasks.TIMELINE_KINDS.index("combine"))
REC_SKIP = tl.constexpr(tasks.TIMELINE_KINDS.index("skip"))


@triton.jit
def _signal(ptr):
    """Count one finished task: this program's earlier stores (all threads), then a release add."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def _gate_task(g, x_ptr, rw_ptr, bias_ptr, idx_ptr, wt_ptr, lrank_ptr, hist_ptr, T, N, E, scale, n_gate,
               TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_G: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
               W_PIECES: tl.constexpr, DOT_FP32: tl.constexpr, ROUND_LOGITS: tl.constexpr, CAPACITY: tl.constexpr):
    """Routing of tokens [g·BLOCK_T, ...): :func:`_gate_logits` over all E experts, then
    :func:`_gate_choice`."""
    tokens = g * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tokens < T
    cols = tl.arange(0, E_PAD)
    emask = cols < E
    acc = gate_logits(x_ptr, rw_ptr, tokens, tmask, cols, emask, N, 0, N, BLOCK_T, E_PAD, BLOCK_G, W_PIECES,
                      DOT_FP32, ROUND_LOGITS)
    logits = tl.where(emask[None, :], acc, float("-inf"))
    gate_choice(logits, g, tokens, tmask, bias_ptr, idx_ptr, wt_ptr, lrank_ptr, hist_ptr, E, scale, n_gate, TOP_K,
                E_PAD, SOFTMAX, HAS_BIAS, RENORMALIZE, CAPACITY)


@triton.jit
def _index_task(idx_ptr, lrank_ptr, hist_ptr, base_ptr, offs_ptr, tiles_ptr, row_of_ptr, asg_of_ptr, state_ptr,
                n_gate, max_tiles, TK, capacity, E_PAD: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_J: tl.constexpr, CAPACITY: tl.constexpr):
    """Offsets, the row-tile table and the expert-sorted row list (see the module), then N_TILES.
    CAPACITY: the histograms' rows are per (pick, block), scanned pick-major, so an
    assignment's slot is its rank in the policy's order; those at or past ``capacity`` are
    dropped (row −1, in no tile) and each expert keeps min(count, capacity) rows."""
    cols = tl.arange(0, E_PAD)
    running = tl.zeros((E_PAD,), dtype=tl.int32)
    for g in range(0, n_gate * (TOP_K if CAPACITY else 1)):
        h = tl.load(hist_ptr + g * E_PAD + cols, cache_modifier=".cg")
        tl.store(base_ptr + g * E_PAD + cols, running)
        running += h
    if CAPACITY:
        running = tl.minimum(running, capacity)
    ends = tl.cumsum(running, axis=0)
    starts = ends - running
    tl.store(offs_ptr + cols, starts)
    n_tiles = store_tile_table(tiles_ptr, max_tiles, running, starts, cols, BLOCK_M, BLOCK_J)
    tl.debug_barrier()  # the bases and offsets above are read back below by other threads
    for a0 in range(0, TK, BLOCK_A):
        a = a0 + tl.arange(0, BLOCK_A)
        amask = a < TK
        e = tl.load(idx_ptr + a, mask=amask, other=0, cache_modifier=".cg")
        if CAPACITY:
            block = (a % TOP_K) * n_gate + a // (TOP_K * BLOCK_T)  # (pick, the gate task that routed it)
        else:
            block = a // (TOP_K * BLOCK_T)  # the gate task that routed it
        slot = (tl.load(base_ptr + block * E_PAD + e, mask=amask, other=0)
                + tl.load(lrank_ptr + a, mask=amask, other=0, cache_modifier=".cg"))
        kept = amask
        if CAPACITY:
            kept = amask & (slot < capacity)
        row = tl.load(offs_ptr + e, mask=amask, other=0) + slot
        tl.store(row_of_ptr + a, tl.where(kept, row, -1), mask=amask)
        tl.store(asg_of_ptr + row, a, mask=kept)
    tl.store(state_ptr + N_TILES, n_tiles)


@triton.jit
def _gemm0_task(tile, ks, x_ptr, w_up_ptr, w_up_scale_ptr, h_ptr, asg_of_ptr, tiles_ptr, max_tiles, N, K, UP,
                TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K0: tl.constexpr,
                BLOCK_N0: tl.constexpr, W_FP8: tl.constexpr):
    """h[rows, K-slice ks] = act(x[tokens of rows] @ W_up[e][gate (and up) rows of the slice]ᵀ)
    (W_FP8: e4m3 weights, ``w_up_scale_ptr`` their (E, ⌈UP/128⌉, ⌈N/128⌉) block scales)."""
    e = tl.load(tiles_ptr + tile).to(tl.int64)
    first = tl.load(tiles_ptr + max_tiles + tile)
    end = tl.load(tiles_ptr + 2 * max_tiles + tile)
    rows = first + tl.arange(0, BLOCK_M)
    rmask = rows < end
    token = tl.load(asg_of_ptr + rows, mask=rmask, other=0, cache_modifier=".cg") // TOP_K
    cols = ks * BLOCK_K0 + tl.arange(0, BLOCK_K0)
    cmask = cols < K
    scale_cols = tl.cdiv(N, 128)
    acc_g, acc_u = gate_up_tile(x_ptr + token.to(tl.int64) * N, rmask, w_up_ptr + e * UP * N, None, 0, cols, cmask,
                                N, K, ACTIVATION, BLOCK_M, BLOCK_K0, BLOCK_N0, False,
                                w_scale=w_up_scale_ptr + e * tl.cdiv(UP, 128) * scale_cols, SCALE_COLS=scale_cols,
                                W_FP8=W_FP8)
    act = activation_epilogue(acc_g, acc_u, ACTIVATION)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], act.to(h_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _gemm1_task(tile, ns, h_ptr, w_down_ptr, w_down_scale_ptr, y_ptr, tiles_ptr, max_tiles, N, K,
                BLOCK_M: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, W_FP8: tl.constexpr):
    """y[rows, N-slice ns] = h[rows] @ W_down[e][slice]ᵀ (W_FP8: e4m3, (E, ⌈N/128⌉, ⌈K/128⌉) scales)."""
    e = tl.load(tiles_ptr + tile).to(tl.int64)
    first = tl.load(tiles_ptr + max_tiles + tile)
    end = tl.load(tiles_ptr + 2 * max_tiles + tile)
    rows = first + tl.arange(0, BLOCK_M)
    rmask = rows < end
    cols = ns * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    cmask = cols < N
    scale_cols = tl.cdiv(K, 128)
    acc, _ = gate_up_tile(h_ptr + rows.to(tl.int64) * K, rmask, w_down_ptr + e * N * K, None, 0, cols, cmask,
                          K, K, PLAIN, BLOCK_M, BLOCK_N1, BLOCK_K1, False,
                          w_scale=w_down_scale_ptr + e * tl.cdiv(N, 128) * scale_cols, SCALE_COLS=scale_cols,
                          W_FP8=W_FP8)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _combine_task(tb, ns, y_ptr, wt_ptr, row_of_ptr, out_ptr, T, N, TOP_K: tl.constexpr, BLOCK_TC: tl.constexpr,
                  BLOCK_NC: tl.constexpr, CAPACITY: tl.constexpr):
    """out[tokens, slice] = Σ_j weight[t, j] · y[row(t, j), slice], in fp32, j in order.
    CAPACITY: an assignment the capacity dropped (row −1) adds nothing (not 0 · its weight: a
    NaN weight would still be NaN)."""
    tokens = tb * BLOCK_TC + tl.arange(0, BLOCK_TC)
    tmask = tokens < T
    cols = ns * BLOCK_NC + tl.arange(0, BLOCK_NC)
    cmask = cols < N
    acc = tl.zeros((BLOCK_TC, BLOCK_NC), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        a = tokens.to(tl.int64) * TOP_K + j
        row = tl.load(row_of_ptr + a, mask=tmask, other=0, cache_modifier=".cg")
        kept = tmask & (row >= 0) if CAPACITY else tmask
        w = tl.load(wt_ptr + a, mask=kept, other=0.0, cache_modifier=".cg")
        y = tl.load(y_ptr + row[:, None].to(tl.int64) * N + cols[None, :], mask=kept[:, None] & cmask[None, :],
                    other=0.0, cache_modifier=".cg")
        if CAPACITY:
            acc += tl.where(kept[:, None], w[:, None] * y.to(tl.float32), 0.0)
        else:
            acc += w[:, None] * y.to(tl.float32)
    tl.store(out_ptr + tokens[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


# The arguments that change with the call's token count: not specialized (one build per row
# tile, not one per pattern of "divisible by 16" and "equal to 1" among them).
BY_TOKEN_COUNT = ("T", "n_programs", "n_gate", "max_tiles", "n_comb_t", "capacity")


@triton.jit(do_not_specialize=BY_TOKEN_COUNT)
def persistent_moe_kernel(
    # The parameters in groups, each a dataclass of interlace.kernels.persistent.args (MoeKernelArgs).
    x_ptr, out_ptr, n_programs,  # MoeCall
    rw_ptr, bias_ptr, w_up_ptr, w_down_ptr, w_up_scale_ptr, w_down_scale_ptr,  # Weights
    idx_ptr, wt_ptr, lrank_ptr, row_of_ptr, asg_of_ptr, hist_ptr, base_ptr, offs_ptr, tiles_ptr, h_ptr,  # MoeWorkspace
    y_ptr,
    state_ptr, err_ptr, host_err_ptr, max_spins,  # Sync
    T, N, K, E, UP, scale, capacity,  # Sizes
    n_gate, max_tiles, n_k0, n_n1, n_comb_t, n_comb_n,  # TaskLayout
    timeline_ptr, timeline_clock, timeline_cap,  # TimelineArgs
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_A: tl.constexpr,  # MoeFrontTiles
    BLOCK_J: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K0: tl.constexpr, BLOCK_N0: tl.constexpr,  # GemmTiles
    BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_TC: tl.constexpr, BLOCK_NC: tl.constexpr,
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,  # Routing
    RENORMALIZE: tl.constexpr, W_PIECES: tl.constexpr, DOT_FP32: tl.constexpr, ROUND_LOGITS: tl.constexpr,
    CAPACITY: tl.constexpr,
    ACTIVATION: tl.constexpr, ORDER: tl.constexpr, TIMELINE: tl.constexpr, W_FP8: tl.constexpr,  # MoeModes
):
    """One MoE layer call; see the module and, for each parameter,
    :class:`~interlace.kernels.persistent.args.MoeKernelArgs`. ORDER 1 (tests only) dequeues the
    combine tasks right after the index, before the GEMM tasks: a broken order the waits must
    catch.

    TIMELINE (:mod:`interlace.kernels.timeline`): every task taken writes one record into slot
    = its task number: [epoch, program, SM, kind (tasks.TIMELINE_KINDS), task, start, end of its
    waits, end]; a GEMM task past the real tile count is recorded as kind "skip"."""
    epoch = tl.load(state_ptr + EPOCH) + 1
    gemm0_done_ptr = state_ptr + HEAD  # the per-tile GEMM0 counters
    n_gemm0 = max_tiles * n_k0
    n_gemm1 = max_tiles * n_n1
    n_comb = n_comb_t * n_comb_n
    # (world size 1: no logits, send or receive task)
    _, f_index, _, _, first_gemm, _, _, total = kind_starts(0, n_gate, 0, 0, n_gemm0, n_gemm1, n_comb)
    task = tl.atomic_add(state_ptr + QUEUE, 1, sem="relaxed", scope="gpu")
    while task < total:
        t_start = timeline_now(timeline_clock, TIMELINE)
        t_waited = t_start
        rec_kind = tl.full((), REC_GATE, tl.int32)
        if task < f_index:
            _gate_task(task, x_ptr, rw_ptr, bias_ptr, idx_ptr, wt_ptr, lrank_ptr, hist_ptr, T, N, E, scale, n_gate,
                       TOP_K, E_PAD, BLOCK_T, BLOCK_G, SOFTMAX, HAS_BIAS, RENORMALIZE, W_PIECES, DOT_FP32,
                       ROUND_LOGITS, CAPACITY)
            _signal(state_ptr + GATE_DONE)
        elif task < first_gemm:
            gated = wait_at_least(state_ptr + GATE_DONE, n_gate, max_spins, 0, err_ptr, host_err_ptr, 0, task,
                                  WAIT_GATE, 0, epoch, "gpu", False)
            t_waited = timeline_now(timeline_clock, TIMELINE)
            rec_kind = tl.full((), REC_INDEX, tl.int32)
            if gated:
                _index_task(idx_ptr, lrank_ptr, hist_ptr, base_ptr, offs_ptr, tiles_ptr, row_of_ptr, asg_of_ptr,
                            state_ptr, n_gate, max_tiles, T * TOP_K, capacity, E_PAD, TOP_K, BLOCK_T, BLOCK_M,
                            BLOCK_A, BLOCK_J, CAPACITY)
            tl.debug_barrier()
            tl.atomic_xchg(state_ptr + INDEX_FLAG, epoch, sem="release", scope="gpu")
        else:
            rel = task - first_gemm
            if ORDER == 0:
                is_comb = rel >= n_gemm0 + n_gemm1
                comb = rel - n_gemm0 - n_gemm1
            else:
                is_comb = rel < n_comb
                comb = rel
                rel = rel - n_comb
            ready = wait_at_least(state_ptr + INDEX_FLAG, epoch, max_spins, 0, err_ptr, host_err_ptr, 0, task,
                                  WAIT_INDEX, 0, epoch, "gpu", False)
            n_tiles = tl.load(state_ptr + N_TILES, volatile=True)
            t_waited = timeline_now(timeline_clock, TIMELINE)
            if is_comb:
                if ready:
                    ready = wait_at_least(state_ptr + GEMM1_DONE, n_tiles * n_n1, max_spins, 0, err_ptr,
                                          host_err_ptr, 0, task, WAIT_GEMM1, 0, epoch, "gpu", False)
                t_waited = timeline_now(timeline_clock, TIMELINE)
                rec_kind = tl.full((), REC_COMBINE, tl.int32)
                if ready:
                    _combine_task(comb // n_comb_n, comb % n_comb_n, y_ptr, wt_ptr, row_of_ptr, out_ptr, T, N, TOP_K,
                                  BLOCK_TC, BLOCK_NC, CAPACITY)
            elif rel < n_gemm0:
                tile = rel % max_tiles
                rec_kind = tl.where(tile < n_tiles, REC_GEMM0, REC_SKIP)
                if ready & (tile < n_tiles):  # (a task past the real tiles exits: nobody waits for it)
                    _gemm0_task(tile, rel // max_tiles, x_ptr, w_up_ptr, w_up_scale_ptr, h_ptr, asg_of_ptr, tiles_ptr,
                                max_tiles, N, K, UP, TOP_K, ACTIVATION, BLOCK_M, BLOCK_K0, BLOCK_N0, W_FP8)
                    _signal(gemm0_done_ptr + tile)
            else:
                tile = (rel - n_gemm0) % max_tiles
                rec_kind = tl.where(tile < n_tiles, REC_GEMM1, REC_SKIP)
                if ready & (tile < n_tiles):
                    tile_ready = wait_at_least(gemm0_done_ptr + tile, n_k0, max_spins, 0, err_ptr, host_err_ptr, 0,
                                               task, WAIT_GEMM0, tile, epoch, "gpu", False)
                    t_waited = timeline_now(timeline_clock, TIMELINE)
                    if tile_ready:
                        _gemm1_task(tile, (rel - n_gemm0) // max_tiles, h_ptr, w_down_ptr, w_down_scale_ptr, y_ptr,
                                    tiles_ptr, max_tiles, N, K, BLOCK_M, BLOCK_N1, BLOCK_K1, W_FP8)
                    _signal(state_ptr + GEMM1_DONE)
        if TIMELINE:
            timeline_record(timeline_ptr, timeline_cap, task, epoch, tl.program_id(0), rec_kind, task, t_start,
                            t_waited, timeline_now(timeline_clock, TIMELINE), TIMELINE)
        task = tl.atomic_add(state_ptr + QUEUE, 1, sem="relaxed", scope="gpu")
    # The last program out resets the counters for the next call and publishes its epoch.
    if tl.atomic_add(state_ptr + DONE, 1, sem="acq_rel", scope="gpu") == n_programs - 1:
        for t0 in range(0, max_tiles, BLOCK_J):
            t = t0 + tl.arange(0, BLOCK_J)
            tl.store(gemm0_done_ptr + t, tl.zeros((BLOCK_J,), dtype=tl.int32), mask=t < max_tiles)
        tl.store(state_ptr + QUEUE, 0)
        tl.store(state_ptr + GATE_DONE, 0)
        tl.store(state_ptr + GEMM1_DONE, 0)
        tl.store(state_ptr + DONE, 0)
        tl.store(state_ptr + EPOCH, epoch)
