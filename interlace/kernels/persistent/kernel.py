"""The whole MoE layer (world size 1) as one persistent Triton kernel: gate → index → GEMM0 +
activation → GEMM1 → combine, as tasks taken from one device-side queue.

A fixed grid of programs (no more than are co-resident) loops: take the next task number from
a global atomic counter, run it, repeat until the numbers run out. The task kinds, their counts
and their dependencies are listed in :mod:`interlace.kernels.persistent.tasks`; in short:

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

from interlace.kernels.comet.flags import record_error_fields
from interlace.kernels.expert_gemm.tile import activation_epilogue, gate_up_tile
from interlace.kernels.persistent import tasks
from interlace.kernels.router_gemm import _piece
from interlace.kernels.router_topk import scores_and_top_k
from interlace.kernels.timeline import timeline_now, timeline_record

# The state words and wait kinds of tasks.py as constexprs (a kernel may read only constexpr globals).
EPOCH = tl.constexpr(tasks.EPOCH)
QUEUE = tl.constexpr(tasks.QUEUE)
DONE = tl.constexpr(tasks.DONE)
GATE_DONE = tl.constexpr(tasks.GATE_DONE)
GEMM1_DONE = tl.constexpr(tasks.GEMM1_DONE)
N_TILES = tl.constexpr(tasks.N_TILES)
INDEX_FLAG = tl.constexpr(tasks.INDEX_FLAG)
WAIT_GATE = tl.constexpr(tasks.WAIT_GATE)
WAIT_INDEX = tl.constexpr(tasks.WAIT_INDEX)
WAIT_GEMM0 = tl.constexpr(tasks.WAIT_GEMM0)
WAIT_GEMM1 = tl.constexpr(tasks.WAIT_GEMM1)
# Timeline record kinds (tasks.TIMELINE_KINDS).
REC_GATE = tl.constexpr(tasks.TIMELINE_KINDS.index("gate"))
REC_INDEX = tl.constexpr(tasks.TIMELINE_KINDS.index("index"))
REC_GEMM0 = tl.constexpr(tasks.TIMELINE_KINDS.index("gemm0"))
REC_GEMM1 = tl.constexpr(tasks.TIMELINE_KINDS.index("gemm1"))
REC_COMBINE = tl.constexpr(tasks.TIMELINE_KINDS.index("combine"))
REC_SKIP = tl.constexpr(tasks.TIMELINE_KINDS.index("skip"))


@triton.jit
def _wait_at_least(ptr, target, max_spins, err_ptr, host_err_ptr, task, kind, what, epoch):
    """Acquire-poll ``*ptr`` until it is ≥ ``target``; False after ``max_spins`` polls, or at once
    once another wait has timed out (the error record is set). The first timed-out wait writes
    the record: [1, rank 0, kind, task, what, value, target, epoch], into the device record and
    into its host mirror (:func:`~interlace.kernels.persistent.launch.host_error_record`)."""
    value = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (value < target) & (spins < max_spins):
        value = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        spins += 1
        if tl.load(err_ptr, volatile=True) != 0:
            spins = max_spins
    ok = value >= target
    if not ok:
        record_timeout(err_ptr, host_err_ptr, 0, kind, task, what, value, target, epoch)
    return ok


@triton.jit
def record_timeout(err_ptr, host_err_ptr, rank, kind, task, what, value, target, epoch):
    """A timed-out wait's error record, if it is the first: claimed on the device (the record
    other waits poll), then written there and into its host mirror."""
    if tl.atomic_cas(err_ptr, 0, 1) == 0:
        record_error_fields(err_ptr, rank, kind, task, what, value, target, epoch)
        record_error_fields(host_err_ptr, rank, kind, task, what, value, target, epoch)
        tl.store(host_err_ptr, 1)


@triton.jit
def _signal(ptr):
    """Count one finished task: this program's earlier stores (all threads), then a release add."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def _gate_logits(x_ptr, rw_ptr, tokens, tmask, cols, emask, N, n_lo, n_hi, BLOCK_T: tl.constexpr,
                 BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr, W_PIECES: tl.constexpr, DOT_FP32: tl.constexpr,
                 ROUND_LOGITS: tl.constexpr):
    """(BLOCK_T, BLOCK_C) fp32 logits x[tokens] (·, N) @ W_r[cols] (·, N)ᵀ (bf16 x: W_r's W_PIECES
    bf16 pieces as ``router_gemm`` "split" (3) or "input" (1); else an fp32 dot); 0 where masked.
    ROUND_LOGITS 1 / 2: the fp32 sums rounded to bf16 / fp16 (a router whose logits come from a
    GEMM in that dtype, as a transformers model in bf16 computes them: fp32 sums, rounded once).
    ``n_lo``, ``n_hi``: the part of the sum over columns [n_lo, n_hi) (0, N: all of it)."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_G):
        nn = n0 + tl.arange(0, BLOCK_G)
        nmask = nn < n_hi
        a = tl.load(x_ptr + tokens[:, None].to(tl.int64) * N + nn[None, :], mask=tmask[:, None] & nmask[None, :],
                    other=0.0)
        w = tl.load(rw_ptr + cols[None, :].to(tl.int64) * N + nn[:, None], mask=emask[None, :] & nmask[:, None],
                    other=0.0).to(tl.float32)  # (BLOCK_G, BLOCK_C): W_rᵀ
        if W_PIECES == 0:
            acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
        else:
            ab = _piece(a, 0, 1, DOT_FP32)
            for i in tl.static_range(W_PIECES):
                acc = tl.dot(ab, _piece(w, i, 3, DOT_FP32), acc)
    return round_logits(acc, ROUND_LOGITS)


@triton.jit
def round_logits(acc, ROUND_LOGITS: tl.constexpr):
    """fp32 logit sums rounded to bf16 (1) or fp16 (2), as values in fp32; 0: unchanged."""
    if ROUND_LOGITS == 1:
        acc = acc.to(tl.bfloat16).to(tl.float32)
    elif ROUND_LOGITS == 2:
        acc = acc.to(tl.float16).to(tl.float32)
    return acc


@triton.jit
def _gate_choice(logits, g, tokens, tmask, bias_ptr, idx_ptr, wt_ptr, lrank_ptr, hist_ptr, E, scale, n_gate,
                 TOP_K: tl.constexpr, E_PAD: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
                 RENORMALIZE: tl.constexpr, CAPACITY: tl.constexpr = False):
    """The choice rule of :mod:`interlace.kernels.router_topk` (slot 0 the best; NaN never wins;
    ties to the lower expert) on a token block's logits (BLOCK_T, E_PAD) fp32 (−inf past E).
    Writes idx/weight/rank per assignment a = t·k + j, and the block's histogram hist[g, :].

    CAPACITY (a capacity factor: experts served slot-major, MoEConfig.capacity_factor): a
    histogram per pick, hist[j·n_gate + g, :], and each assignment's rank among the block's
    assignments of its expert with the same pick j; the index's running sum over those rows in
    that order (pick-major) is the policy's order."""
    cols = tl.arange(0, E_PAD)
    weights, slot = scores_and_top_k(logits, bias_ptr, tl.where(tmask, tokens, -1), cols, E, scale, TOP_K, E_PAD,
                                     SOFTMAX, HAS_BIAS, RENORMALIZE)
    chosen = (slot >= 0).to(tl.int32)
    if CAPACITY:
        before = tl.zeros(slot.shape, dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            pick = (slot == j).to(tl.int32)
            before = tl.where(slot == j, tl.cumsum(pick, axis=0) - pick, before)
            tl.store(hist_ptr + (j * n_gate + g) * E_PAD + cols, tl.sum(pick, axis=0))
    else:
        # Rank of (t, j) among the block's assignments of its expert, in assignment order t·k + j:
        # a token picks k distinct experts, so it is the number of earlier tokens that picked it.
        before = tl.cumsum(chosen, axis=0) - chosen
        tl.store(hist_ptr + g * E_PAD + cols, tl.sum(chosen, axis=0))
    a = tokens[:, None].to(tl.int64) * TOP_K + slot
    tl.store(idx_ptr + a, tl.broadcast_to(cols[None, :], slot.shape), mask=slot >= 0)
    tl.store(lrank_ptr + a, before, mask=slot >= 0)
    tl.store(wt_ptr + a, weights, mask=slot >= 0)


@triton.jit
def store_tile_table(tiles_ptr, stride, rows, starts, experts, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr):
    """The row-tile table of experts with ``rows`` rows each (vectors over the experts; expert
    ``experts[i]``'s rows start at row ``starts[i]``), BLOCK_M rows a tile, in expert order:
    tiles_ptr[j], [stride + j], [2·stride + j] = expert, first row, end row of tile j. Returns
    the number of tiles (shared with the W > 1 kernel's table)."""
    n_tiles_e = (rows + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(n_tiles_e, axis=0)
    tile_beg = tile_end - n_tiles_e
    n_tiles = tl.sum(n_tiles_e, axis=0)
    for j0 in range(0, n_tiles, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        inside = (j[:, None] >= tile_beg[None, :]) & (j[:, None] < tile_end[None, :])  # at most one expert
        expert = tl.sum(tl.where(inside, experts[None, :], 0), axis=1)
        first = tl.sum(tl.where(inside, starts[None, :] + (j[:, None] - tile_beg[None, :]) * BLOCK_M, 0), axis=1)
        end = tl.sum(tl.where(inside, (starts + rows)[None, :], 0), axis=1)
        jmask = j < n_tiles
        tl.store(tiles_ptr + j, expert, mask=jmask)
        tl.store(tiles_ptr + stride + j, first, mask=jmask)
        tl.store(tiles_ptr + 2 * stride + j, end, mask=jmask)
    return n_tiles


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
    acc = _gate_logits(x_ptr, rw_ptr, tokens, tmask, cols, emask, N, 0, N, BLOCK_T, E_PAD, BLOCK_G, W_PIECES,
                       DOT_FP32, ROUND_LOGITS)
    logits = tl.where(emask[None, :], acc, float("-inf"))
    _gate_choice(logits, g, tokens, tmask, bias_ptr, idx_ptr, wt_ptr, lrank_ptr, hist_ptr, E, scale, n_gate, TOP_K,
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
def _gemm0_task(tile, ks, x_ptr, w_up_ptr, h_ptr, asg_of_ptr, tiles_ptr, max_tiles, N, K, UP,
                TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K0: tl.constexpr,
                BLOCK_N0: tl.constexpr):
    """h[rows, K-slice ks] = act(x[tokens of rows] @ W_up[e][gate (and up) rows of the slice]ᵀ)."""
    e = tl.load(tiles_ptr + tile).to(tl.int64)
    first = tl.load(tiles_ptr + max_tiles + tile)
    end = tl.load(tiles_ptr + 2 * max_tiles + tile)
    rows = first + tl.arange(0, BLOCK_M)
    rmask = rows < end
    token = tl.load(asg_of_ptr + rows, mask=rmask, other=0, cache_modifier=".cg") // TOP_K
    cols = ks * BLOCK_K0 + tl.arange(0, BLOCK_K0)
    cmask = cols < K
    acc_g, acc_u = gate_up_tile(x_ptr + token.to(tl.int64) * N, rmask, w_up_ptr + e * UP * N, None, 0, cols, cmask,
                                N, K, ACTIVATION, BLOCK_M, BLOCK_K0, BLOCK_N0, False)
    act = activation_epilogue(acc_g, acc_u, ACTIVATION)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], act.to(h_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _gemm1_task(tile, ns, h_ptr, w_down_ptr, y_ptr, tiles_ptr, max_tiles, N, K,
                BLOCK_M: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr):
    """y[rows, N-slice ns] = h[rows] @ W_down[e][slice]ᵀ."""
    e = tl.load(tiles_ptr + tile).to(tl.int64)
    first = tl.load(tiles_ptr + max_tiles + tile)
    end = tl.load(tiles_ptr + 2 * max_tiles + tile)
    rows = first + tl.arange(0, BLOCK_M)
    rmask = rows < end
    cols = ns * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    cmask = cols < N
    acc, _ = gate_up_tile(h_ptr + rows.to(tl.int64) * K, rmask, w_down_ptr + e * N * K, None, 0, cols, cmask,
                          K, K, 3, BLOCK_M, BLOCK_N1, BLOCK_K1, False)
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
    x_ptr, rw_ptr, bias_ptr, w_up_ptr, w_down_ptr, out_ptr,  # (T, N), (E, N), (E,), (E, UP, N), (E, N, K), (T, N)
    idx_ptr, wt_ptr, lrank_ptr, row_of_ptr, asg_of_ptr,  # (T·k,) each: int32, fp32, int32 ×3
    hist_ptr, base_ptr, offs_ptr, tiles_ptr,  # (n_gate, E_PAD) ×2, (E_PAD,), (3, max_tiles) int32
    h_ptr, y_ptr,  # (T·k, K), (T·k, N) in x's dtype
    state_ptr, err_ptr, gemm0_done_ptr,  # persistent: (STATE_WORDS,), (ERROR_WORDS,), (≥ max_tiles,) int32
    host_err_ptr,  # (ERROR_WORDS,) int32: the record's host mirror (page-locked memory on CUDA)
    T, N, K, E, UP, scale, max_spins, n_programs,
    n_gate, max_tiles, n_k0, n_n1, n_comb_t, n_comb_n, capacity,  # capacity: per expert (CAPACITY)
    timeline_ptr, timeline_clock, timeline_cap,  # (cap, 8) int64 records, (1,) int64 clock: see below
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K0: tl.constexpr,
    BLOCK_N0: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_TC: tl.constexpr,
    BLOCK_NC: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    ACTIVATION: tl.constexpr, W_PIECES: tl.constexpr, DOT_FP32: tl.constexpr, ORDER: tl.constexpr,
    TIMELINE: tl.constexpr = 0,  # 0 off (compiled out), 1 GPU clock, 2 logical clock (interpreter)
    ROUND_LOGITS: tl.constexpr = 0,  # 1 / 2: the router logits rounded to bf16 / fp16 (_gate_logits)
    CAPACITY: tl.constexpr = False,  # a capacity factor: hist (TOP_K·n_gate, E_PAD); _index_task
):
    """One MoE layer call; see the module. ORDER 1 (tests only) dequeues the combine tasks right
    after the index, before the GEMM tasks: a broken order the waits must catch.

    TIMELINE (:mod:`interlace.kernels.timeline`): every task taken writes one record into slot
    = its task number: [epoch, program, SM, kind (tasks.TIMELINE_KINDS), task, start, end of its
    waits, end]; a GEMM task past the real tile count is recorded as kind "skip"."""
    epoch = tl.load(state_ptr + EPOCH) + 1
    n_gemm0 = max_tiles * n_k0
    n_gemm1 = max_tiles * n_n1
    n_comb = n_comb_t * n_comb_n
    first_gemm = n_gate + 1
    total = first_gemm + n_gemm0 + n_gemm1 + n_comb
    task = tl.atomic_add(state_ptr + QUEUE, 1, sem="relaxed", scope="gpu")
    while task < total:
        t_start = timeline_now(timeline_clock, TIMELINE)
        t_waited = t_start
        rec_kind = tl.full((), REC_GATE, tl.int32)
        if task < n_gate:
            _gate_task(task, x_ptr, rw_ptr, bias_ptr, idx_ptr, wt_ptr, lrank_ptr, hist_ptr, T, N, E, scale, n_gate,
                       TOP_K, E_PAD, BLOCK_T, BLOCK_G, SOFTMAX, HAS_BIAS, RENORMALIZE, W_PIECES, DOT_FP32,
                       ROUND_LOGITS, CAPACITY)
            _signal(state_ptr + GATE_DONE)
        elif task < first_gemm:
            gated = _wait_at_least(state_ptr + GATE_DONE, n_gate, max_spins, err_ptr, host_err_ptr, task, WAIT_GATE, 0,
                                   epoch)
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
            ready = _wait_at_least(state_ptr + INDEX_FLAG, epoch, max_spins, err_ptr, host_err_ptr, task, WAIT_INDEX, 0,
                                   epoch)
            n_tiles = tl.load(state_ptr + N_TILES, volatile=True)
            t_waited = timeline_now(timeline_clock, TIMELINE)
            if is_comb:
                if ready:
                    ready = _wait_at_least(state_ptr + GEMM1_DONE, n_tiles * n_n1, max_spins, err_ptr, host_err_ptr,
                                           task, WAIT_GEMM1, 0, epoch)
                t_waited = timeline_now(timeline_clock, TIMELINE)
                rec_kind = tl.full((), REC_COMBINE, tl.int32)
                if ready:
                    _combine_task(comb // n_comb_n, comb % n_comb_n, y_ptr, wt_ptr, row_of_ptr, out_ptr, T, N, TOP_K,
                                  BLOCK_TC, BLOCK_NC, CAPACITY)
            elif rel < n_gemm0:
                tile = rel % max_tiles
                rec_kind = tl.where(tile < n_tiles, REC_GEMM0, REC_SKIP)
                if ready & (tile < n_tiles):  # (a task past the real tiles exits: nobody waits for it)
                    _gemm0_task(tile, rel // max_tiles, x_ptr, w_up_ptr, h_ptr, asg_of_ptr, tiles_ptr, max_tiles, N, K, UP,
                                TOP_K, ACTIVATION, BLOCK_M, BLOCK_K0, BLOCK_N0)
                    _signal(gemm0_done_ptr + tile)
            else:
                tile = (rel - n_gemm0) % max_tiles
                rec_kind = tl.where(tile < n_tiles, REC_GEMM1, REC_SKIP)
                if ready & (tile < n_tiles):
                    tile_ready = _wait_at_least(gemm0_done_ptr + tile, n_k0, max_spins, err_ptr, host_err_ptr, task,
                                                WAIT_GEMM0, tile, epoch)
                    t_waited = timeline_now(timeline_clock, TIMELINE)
                    if tile_ready:
                        _gemm1_task(tile, (rel - n_gemm0) // max_tiles, h_ptr, w_down_ptr, y_ptr, tiles_ptr, max_tiles, N,
                                    K, BLOCK_M, BLOCK_N1, BLOCK_K1)
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
