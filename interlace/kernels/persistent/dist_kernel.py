"""The whole MoE layer at world size W > 1 as ONE persistent Triton launch per rank: gate →
index → dispatch (device-initiated one-sided stores into the owners' symmetric memory) →
receive → GEMM0 + activation → GEMM1 (stored straight into the sources' symmetric memory) →
combine, as tasks from one device-side queue per rank.

Tasks, counts and the symmetric layout are in :mod:`interlace.kernels.persistent.dist_tasks`;
the state words, waits and task ranges shared with world size 1 in
:mod:`interlace.kernels.persistent.protocol`; the front's tasks (logits, top-k, index, send) in
:mod:`interlace.kernels.persistent.dist_front`, their choice rule the world-1 gate's
(:mod:`interlace.kernels.persistent.routing`); the parameters in
:class:`~interlace.kernels.persistent.args.DistKernelArgs`. The GEMM tasks run narrow or wide
tiles (``W_TMA``/``JOINT``: see :class:`~interlace.kernels.persistent.config.PersistentKernelConfig`).
In short:

* index: per-(block, expert) bases from the gate's histograms; each assignment's slot = its
  rank among this rank's assignments to that expert (so slots of one (source, expert) pair are
  0 .. count−1, decided by the source alone), and the per-expert counts;
* send (token block × column slice): each token row stored once into ``recv[me][t]`` of
  every peer owner of one of its k experts, and each assignment's ``amap[me][local
  expert][slot] = t·k + j`` at its owner (a row crosses NVLink once per owner, not once per
  expert). A program counts its send tasks (acq_rel, system scope) when it leaves the kind; the count that reaches the total writes
  this rank's per-(owner, local expert) counts into every owner's ``counts[me]`` and then,
  release at system scope, the epoch into every owner's ``sent[me]`` — also owners it sends
  no row to;
* receive (source s): waits (acquire, system scope) for ``sent[s] ≥ epoch`` and counts itself
  done; the last receive task builds the tile table over every source's rows (row tiles of one
  local expert hold its rows from all sources, so each touched expert's weights are read once)
  and publishes a local ready flag; with no row from anyone it publishes ``done[me] = epoch`` at
  every rank at once;
* GEMM0 (tile, K-slice) and GEMM1 (tile, N-slice): as at world 1, numbered expert by expert
  and, within one expert, slice by slice over its tiles (so each weight slice is read once for
  all of them); a row's assignment is ``a = amap[s][l][slot]``, its token row ``recv[s][a //
  k]`` (this rank's own: its input); GEMM1 stores each output row into its source's
  ``ret[a]``; a program counts its GEMM1 tasks (acq_rel, system scope) when it leaves the
  kind, and the count that reaches the total publishes ``done[me] = epoch`` at every rank;
* combine (token block, N-slice): waits for this rank's index flag, then for ``done[d] ≥
  epoch`` of every owner d its tokens use (combine task 0: of every owner), then sums each
  token's k rows ``ret[t·k + j]`` in fp32 in j order (deterministic: nothing atomic touches an
  output).

Why every wait terminates. Each rank's task numbers run kind by kind (gate < index < send <
receive < GEMM0 < GEMM1 < combine) and are taken in increasing order from its queue by
programs that are running. Within a rank a task waits only on smaller numbers. Across ranks a
task waits only on a peer's task of a strictly earlier kind: receive on the peer's send tasks,
combine on the peer's receive and GEMM1 tasks; no task waits on a peer's task of its own kind
or a later one (sends, GEMM tasks and the index never wait on a peer). Suppose some waits
never end, and take a blocked task X of the earliest kind over all ranks (the smallest number
on its rank among those). Its own-rank waits are on smaller numbers, taken already; one not
finished would be blocked, of an earlier kind or a smaller number: impossible. A peer task Y it
waits on is of an earlier kind; if the peer has a blocked task, that task's kind is no earlier
than X's, so its number is larger than Y's, so Y was taken, and Y unfinished would be blocked
with a kind earlier than X's: impossible; if the peer has none, its programs keep taking
numbers until all are taken and done. So X's waits end: a contradiction. (A finished send or
GEMM1 task is counted when its program leaves the kind, before any later wait of that
program: its count waits only on the program's later tasks of the same kind, whose waits are
on earlier kinds.) Nothing
assumes that programs are co-resident or start in any order (a program waits only after taking
a number, and the numbers it waits on were taken by programs already running), only that every
rank launches the same call. Waits are bounded (``max_spins`` polls and, on a GPU, ``timeout_ns``): a
timed-out wait writes the error record (naming this rank, the task and the peer rank) and the
task skips its work.

Epochs, and why no call needs a barrier. A call's epoch is the local call counter + 1; every
rank makes the same calls, so epochs agree, and flags (``sent``, ``done``, local ready and
index flags) hold epochs, never reset. A rank's call ends only after it has ``done[d] ≥ epoch``
from every owner d (combine task 0), and an owner publishes that only after it has copied this
rank's counts and (the GEMM1 tasks wait for every GEMM0 task of their tile) read its rows for
the last time: so when this rank's next call writes ``recv``, ``amap``, ``counts`` and ``sent``
at an owner, the owner is done with the previous ones. An owner writes this rank's ``ret`` only after
this rank's ``sent`` of that call, i.e. after this rank's previous combine. Local counters are
zeroed by the last program to leave the launch that ends the call (CUDA-graph replays stay right).

Phases (simulated ranks on the CPU, the staged transport): ``task_lo``/``task_hi`` restrict a
launch to a range of task numbers; ``final`` marks the launch that ends the call.
"""

from __future__ import annotations

import triton
import triton.language as tl

from interlace.kernels.comet.flags import peer_region
from interlace.kernels.expert_gemm.tile import activation_epilogue, gate_up_desc, gate_up_tile
from interlace.kernels.persistent import dist_tasks as dt
from interlace.kernels.persistent.dist_front import (
    block_assignments, choice_task, count_sends, index_task, logits_task, send_task,
)
from interlace.kernels.persistent.protocol import (
    DONE, EPOCH, GATE_DONE, GEMM1_DONE, HEAD, INDEX_FLAG, LOGITS_DONE, N_TILES, PLAIN, QUEUE, READY, RECV_DONE,
    SEND_DONE, WAIT_DONE, WAIT_GATE, WAIT_GEMM0, WAIT_INDEX, WAIT_LOGITS, WAIT_READY, WAIT_SENT, kind_starts,
    wait_at_least,
)
from interlace.kernels.persistent.routing import store_tile_table
from interlace.kernels.timeline import timeline_now, timeline_record

# Timeline record kinds: dt.TIMELINE_KINDS (the task kinds, then skip).
REC_LOGITS = tl.constexpr(dt.LOGITS)
REC_GATE = tl.constexpr(dt.GATE)
REC_INDEX = tl.constexpr(dt.INDEX)
REC_SEND = tl.constexpr(dt.SEND)
REC_RECEIVE = tl.constexpr(dt.RECEIVE)
REC_GEMM0 = tl.constexpr(dt.GEMM0)
REC_GEMM1 = tl.constexpr(dt.GEMM1)
REC_COMBINE = tl.constexpr(dt.COMBINE)
REC_SKIP = tl.constexpr(dt.SKIP)


@triton.jit
def _tile_table(counts_table, offs_ptr, tiles_ptr, me, W, E_loc, mt, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr,
                EL_PAD: tl.constexpr):
    """Row tiles over every source's rows (read after every source's dispatch flag): offs[s][l]
    = rows of local expert l from sources before s (expert l's rows, concatenated in source
    order, are ``offs[s][l] + slot`` for source s); tiles = (local expert, first row, end row)
    per tile, in expert order. Returns the number of tiles."""
    lo = tl.arange(0, EL_PAD)
    lmask = lo < E_loc
    counts = peer_region(counts_table, me, tl.int32)
    total = tl.zeros((EL_PAD,), dtype=tl.int32)
    for s in range(0, W):
        tl.store(offs_ptr + s * EL_PAD + lo, total)
        total += tl.load(counts + s * E_loc + lo, mask=lmask, other=0, volatile=True)
    # (a local expert's rows of all sources are rows 0 .. total − 1 of that expert)
    return store_tile_table(tiles_ptr, mt, total, tl.zeros((EL_PAD,), dtype=tl.int32), lo, BLOCK_M, BLOCK_J)


@triton.jit
def _tile_rows(first, end, lx, offs_ptr, W, EL_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows ``first`` .. ``first + BLOCK_M`` of local expert ``lx`` (its rows of all sources,
    ``end`` in all): per row its source rank, its slot in that source's ``recv[s][l]``, and
    whether it is a row (the tile's tail past the expert's rows is not)."""
    i = first + tl.arange(0, BLOCK_M)
    src = tl.zeros((BLOCK_M,), dtype=tl.int32)
    base = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for s in range(1, W):  # (offs[s][l] grows with s: the last source whose first row is ≤ i)
        off = tl.load(offs_ptr + s * EL_PAD + lx)
        later = i >= off
        src = tl.where(later, s, src)
        base = tl.where(later, off, base)
    return src, i - base, i < end


@triton.jit
def _weight_descriptors(w_up_ptr, w_down_ptr, E_loc, UP, N, K, BLOCK_K0: tl.constexpr, BLOCK_N0: tl.constexpr,
                        BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, W_TMA: tl.constexpr, JOINT: tl.constexpr):
    """Wide tiles (W_TMA): the expert weights as TMA descriptors, made once per program. W_up
    (E_loc, UP, N): with JOINT (SwiGLU) as E_loc·2 planes of (K, N) whose one load brings a
    tile's gate and up rows (:func:`joint_gate_up_desc`), else as E_loc·UP rows of N; W_down
    (E_loc, N, K) as E_loc·N rows of K. Block rows past an expert's slice feed only output
    columns the stores mask. Else the pointers (the tiles then load through them)."""
    w_up_desc = w_up_ptr
    w_down_desc = w_down_ptr
    if W_TMA:
        w_up_desc = gate_up_desc(w_up_ptr, E_loc, UP, N, K, BLOCK_K0, BLOCK_N0, JOINT)
        w_down_desc = tl.make_tensor_descriptor(w_down_ptr, shape=[E_loc * N, K], strides=[K, 1],
                                                block_shape=[BLOCK_N1, BLOCK_K1])
    return w_up_desc, w_down_desc


@triton.jit
def _row_assignments(lx, src, slot, rmask, amap_table, me, E_loc, max_tokens):
    """Each tile row's assignment a = t·k + j at its source (``amap[src][l][slot]``)."""
    amap = peer_region(amap_table, me, tl.int32)
    return tl.load(amap + (src * E_loc + lx).to(tl.int64) * max_tokens + slot, mask=rmask, other=0,
                   cache_modifier=".cg")


@triton.jit
def _gemm0_task(tile, ks, lx, first, end, x_ptr, recv_table, amap_table, w_up_ptr, w_up_desc, w_up_scale_ptr, h_ptr,
                offs_ptr, me, W, E_loc, max_tokens, N, K, UP, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr,
                EL_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K0: tl.constexpr, BLOCK_N0: tl.constexpr,
                W_TMA: tl.constexpr, JOINT: tl.constexpr, W_FP8: tl.constexpr):
    """h[tile rows, K-slice ks] = act(token rows @ W_up[l][gate (and up) rows]ᵀ): a row of
    source s ≠ me is recv[s][t], one of this rank's own tokens x[t] (t = amap[s][l][slot] // k)."""
    src, slot, rmask = _tile_rows(first, end, lx, offs_ptr, W, EL_PAD, BLOCK_M)
    t = (_row_assignments(lx, src, slot, rmask, amap_table, me, E_loc, max_tokens) // TOP_K).to(tl.int64)
    recv = peer_region(recv_table, me, h_ptr.dtype.element_ty)
    a_rows = tl.where(src == me, x_ptr + t * N, recv + (src.to(tl.int64) * max_tokens + t) * N)
    cols = ks * BLOCK_K0 + tl.arange(0, BLOCK_K0)
    cmask = cols < K
    acc_g, acc_u = gate_up_tile(a_rows, rmask, w_up_ptr + lx.to(tl.int64) * UP * N, w_up_desc,
                                lx * UP + ks * BLOCK_K0, cols, cmask, N, K, ACTIVATION, BLOCK_M, BLOCK_K0, BLOCK_N0,
                                W_TMA, JOINT=JOINT, w_expert=lx, col0=ks * BLOCK_K0,
                                w_scale=w_up_scale_ptr + lx.to(tl.int64) * tl.cdiv(UP, 128) * tl.cdiv(N, 128),
                                SCALE_COLS=tl.cdiv(N, 128), W_FP8=W_FP8)
    act = activation_epilogue(acc_g, acc_u, ACTIVATION)
    h_rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(h_ptr + h_rows[:, None] * K + cols[None, :], act.to(h_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _gemm1_task(tile, ns, lx, first, end, h_ptr, w_down_ptr, w_down_desc, w_down_scale_ptr, ret_table, amap_table,
                offs_ptr, me, W, E_loc, max_tokens, N, K, EL_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, W_TMA: tl.constexpr, W_FP8: tl.constexpr):
    """Each row's source s and assignment a (amap[s][l][slot]): s's ret[a, N-slice ns] =
    h[row] @ W_down[l][slice]ᵀ (stored into s's memory)."""
    src, slot, rmask = _tile_rows(first, end, lx, offs_ptr, W, EL_PAD, BLOCK_M)
    # (the rows' assignments are loaded before the GEMM: their round trip overlaps its loop)
    rows = _row_assignments(lx, src, slot, rmask, amap_table, me, E_loc, max_tokens).to(tl.int64)
    h_rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = ns * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    cmask = cols < N
    acc, _ = gate_up_tile(h_ptr + h_rows * K, rmask, w_down_ptr + lx.to(tl.int64) * N * K, w_down_desc,
                          lx * N + ns * BLOCK_N1, cols, cmask, K, K, PLAIN, BLOCK_M, BLOCK_N1, BLOCK_K1, W_TMA,
                          w_scale=w_down_scale_ptr + lx.to(tl.int64) * tl.cdiv(N, 128) * tl.cdiv(K, 128),
                          SCALE_COLS=tl.cdiv(K, 128), W_FP8=W_FP8)
    y = acc.to(h_ptr.dtype.element_ty)
    for d in range(0, W):
        dst = peer_region(ret_table, d, h_ptr.dtype.element_ty)
        m = rmask & (src == d)
        tl.store(dst + rows[:, None] * N + cols[None, :], y, mask=m[:, None] & cmask[None, :])


@triton.jit
def expert_slice_order(rel, tile, n_slices, tiles_ptr, mt, BLOCK_M: tl.constexpr):
    """(tile, slice, local expert, first row, end row) of GEMM task ``rel`` of its kind,
    numbered expert by expert (the table's tiles are in expert order) and, within an expert,
    slice by slice over its tiles: the tiles of one expert take each weight slice at the same
    time, so it is read from HBM once for all of them (numbered tile by tile, each tile read it
    again, a whole round of tasks later). The numbers of expert l are those of its tiles taken
    tile-major, so which tiles exist (and the skip past them) is unchanged. ``tile``: rel //
    n_slices, a real tile. One round trip: the task's tile is of the same expert as ``tile``,
    whose entry gives the expert, its rows (first rows count from 0 per expert) and its tiles."""
    lx = tl.load(tiles_ptr + tile)
    within = tl.load(tiles_ptr + mt + tile) // BLOCK_M
    end = tl.load(tiles_ptr + 2 * mt + tile)
    n_l = (end + BLOCK_M - 1) // BLOCK_M
    first_tile = tile - within
    r = rel - first_tile * n_slices
    return first_tile + r % n_l, r // n_l, lx, (r % n_l) * BLOCK_M, end


@triton.jit
def _count_gemm1(pending, total, state_ptr, done_table, me, W, epoch):
    """Count this program's ``pending`` finished GEMM1 tasks (acq_rel, system scope, after every
    thread's stores); the count that reaches ``total`` publishes ``done[me] = epoch`` at every
    rank. A program counts its GEMM1 tasks once, when it leaves the kind, not after each: the
    system-scope release waits for every store in flight (rows into peers' memory), and per
    task it stalled each program at every task's end. Called before any later wait (a
    combine task's, which the count may be gating) and at the program's exit. Returns 0."""
    if pending > 0:
        tl.debug_barrier()
        if tl.atomic_add(state_ptr + GEMM1_DONE, pending, sem="acq_rel", scope="sys") + pending == total:
            _publish_done(done_table, me, W, epoch)
    return tl.full((), 0, tl.int32)


@triton.jit
def _publish_done(done_table, me, W, epoch):
    """done[me] = epoch at every rank (release, system scope): this rank has read their rows and
    counts for the last time in this call and returned every output row."""
    for d in range(0, W):
        tl.atomic_xchg(peer_region(done_table, d, tl.int32) + me, epoch, sem="release", scope="sys")


@triton.jit
def _combine_wait(comb, tb, idx_ptr, done_table, err_ptr, host_err_ptr, me, W, E_loc, T, max_spins, timeout_ns, task,
                  epoch, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_TC: tl.constexpr, CLOCK: tl.constexpr):
    """Wait for done[d] ≥ epoch of every owner d that this token block uses (combine task 0: of
    every owner, so that the call ends after every owner is done with this rank's data)."""
    _, _, _, a, amask = block_assignments(tb * BLOCK_TC, T, TOP_K, K_PAD, BLOCK_TC)
    owner = tl.load(idx_ptr + a, mask=amask, other=0, cache_modifier=".cg") // E_loc
    done = peer_region(done_table, me, tl.int32)
    failed = 0
    for d in range(0, W):
        uses = tl.sum(tl.sum(((owner == d) & amask).to(tl.int32), axis=1), axis=0)
        if (uses > 0) | (comb == 0):
            ok = wait_at_least(done + d, epoch, max_spins, timeout_ns, err_ptr, host_err_ptr, me, task, WAIT_DONE, d,
                               epoch, "sys", CLOCK)
            failed += tl.where(ok, 0, 1)
    return failed == 0


@triton.jit
def assignment_column(block, js, j: tl.constexpr):
    """Column j of a (rows, K_PAD) block of per-assignment values, as a (rows,) vector (in
    registers: the block was loaded once for all j)."""
    return tl.sum(tl.where(js[None, :] == j, block, 0), axis=1)


@triton.jit
def _combine_task(tb, nt, n_cs, ret_table, wt_ptr, slot_ptr, out_ptr, me, T, N, capacity, TOP_K: tl.constexpr,
                  K_PAD: tl.constexpr, BLOCK_TC: tl.constexpr, BLOCK_NC: tl.constexpr, CAPACITY: tl.constexpr):
    """out[tokens, slice] = Σ_j weight[t, j] · ret[t·k + j], in fp32, j in order, for the
    ``n_cs`` column slices nt·n_cs, ... of this task (the weights of the block loaded once for
    all of them: one task per SM or so, each waiting on the owners once). CAPACITY: an
    assignment at a slot past ``capacity`` was dropped and adds nothing (its row was never
    written; not 0 · its weight either: a NaN weight would still be NaN)."""
    tokens, tmask, js, a, amask = block_assignments(tb * BLOCK_TC, T, TOP_K, K_PAD, BLOCK_TC)
    weights = tl.load(wt_ptr + a, mask=amask, other=0.0, cache_modifier=".cg")
    if CAPACITY:
        kept = amask & (tl.load(slot_ptr + a, mask=amask, other=0, cache_modifier=".cg") < capacity)
    ret = peer_region(ret_table, me, out_ptr.dtype.element_ty)
    for ns in range(nt * n_cs, tl.minimum(nt * n_cs + n_cs, tl.cdiv(N, BLOCK_NC))):
        cols = ns * BLOCK_NC + tl.arange(0, BLOCK_NC)
        cmask = cols < N
        acc = tl.zeros((BLOCK_TC, BLOCK_NC), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            row = tokens.to(tl.int64) * TOP_K + j
            if CAPACITY:
                kept_j = assignment_column(kept.to(tl.int32), js, j) > 0
                y = tl.load(ret + row[:, None] * N + cols[None, :], mask=kept_j[:, None] & cmask[None, :],
                            other=0.0, cache_modifier=".cg")
                acc += tl.where(kept_j[:, None], assignment_column(weights, js, j)[:, None] * y.to(tl.float32), 0.0)
            else:
                y = tl.load(ret + row[:, None] * N + cols[None, :], mask=tmask[:, None] & cmask[None, :], other=0.0,
                            cache_modifier=".cg")
                acc += assignment_column(weights, js, j)[:, None] * y.to(tl.float32)
        tl.store(out_ptr + tokens[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & cmask[None, :])


# The arguments that change with the call's token count: not specialized (Triton would compile
# the kernel again for each pattern of "divisible by 16" and "equal to 1" among them, where one
# build per row tile is enough; docs/persistent.md, Builds).
BY_TOKEN_COUNT = ("T", "n_programs", "n_logits", "n_ls", "ls_chunk", "n_gate", "n_send", "n_comb_t", "n_comb_n",
                  "comb_slices", "task_lo", "task_hi", "capacity")


@triton.jit(do_not_specialize=BY_TOKEN_COUNT)
def persistent_dist_kernel(
    # The parameters in groups, each a dataclass of interlace.kernels.persistent.args (DistKernelArgs).
    x_ptr, out_ptr, n_programs, task_lo, task_hi, final,  # DistCall
    rw_ptr, bias_ptr, w_up_ptr, w_down_ptr, w_up_scale_ptr, w_down_scale_ptr,  # Weights
    logits_ptr, idx_ptr, wt_ptr, lrank_ptr, slot_ptr, hist_ptr, base_ptr, counts_ptr, offs_ptr, tiles_ptr,  # DistWorkspace
    h_ptr,
    recv_table, amap_table, ret_table, counts_table, sent_table, done_table,  # PeerTables
    state_ptr, err_ptr, host_err_ptr, max_spins, timeout_ns,  # DistSync
    me, W, E_loc, max_tokens,  # World
    T, N, K, E, UP, scale, capacity,  # Sizes
    n_logits, n_eb, n_ls, ls_chunk, n_gate, n_send, n_ns, mt, n_k0, n_n1, n_comb_t, n_comb_n, comb_slices,  # DistTasks
    timeline_ptr, timeline_clock, timeline_cap,  # TimelineArgs
    BLOCK_T: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,  # DistFrontTiles
    BLOCK_S: tl.constexpr, BLOCK_NS: tl.constexpr, BLOCK_A: tl.constexpr, G_CHUNK: tl.constexpr, LS_MAX: tl.constexpr,
    K_PAD: tl.constexpr, EL_PAD: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K0: tl.constexpr, BLOCK_N0: tl.constexpr,  # GemmTiles
    BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_TC: tl.constexpr, BLOCK_NC: tl.constexpr,
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,  # Routing
    RENORMALIZE: tl.constexpr, W_PIECES: tl.constexpr, DOT_FP32: tl.constexpr, ROUND_LOGITS: tl.constexpr,
    CAPACITY: tl.constexpr,
    ACTIVATION: tl.constexpr, CLOCK: tl.constexpr, TIMELINE: tl.constexpr, W_TMA: tl.constexpr,  # DistModes
    JOINT: tl.constexpr, W_FP8: tl.constexpr,
):
    """One rank's part of one MoE layer call (tasks [task_lo, task_hi)); see the module and, for
    each parameter, :class:`~interlace.kernels.persistent.args.DistKernelArgs`.

    TIMELINE (:mod:`interlace.kernels.timeline`): every task taken writes one record into slot
    = its task number: [epoch, program, SM, kind (dt.TIMELINE_KINDS), task, start, end of its
    waits, end]; the GEMM task that skips the rest of its kind's range is kind "skip" (the
    tasks skipped over are never taken and have no record)."""
    epoch = tl.load(state_ptr + EPOCH) + 1
    w_up_desc, w_down_desc = _weight_descriptors(w_up_ptr, w_down_ptr, E_loc, UP, N, K, BLOCK_K0, BLOCK_N0, BLOCK_N1,
                                                 BLOCK_K1, W_TMA, JOINT)
    g0_done_ptr = state_ptr + HEAD  # the per-tile GEMM0 counters
    f_gate, f_index, f_send, f_recv, f_g0, f_g1, f_comb, _ = kind_starts(n_logits, n_gate, n_send, W, n_k0 * mt,
                                                                         n_n1 * mt, n_comb_t * n_comb_n)
    table_seen = tl.full((), 0, tl.int32)  # this program has seen the call's tile table (READY)
    n_tiles = tl.full((), 0, tl.int32)
    g1_pending = tl.full((), 0, tl.int32)  # GEMM1 tasks finished here, not yet counted
    send_pending = tl.full((), 0, tl.int32)  # send tasks finished here, not yet counted
    task = task_lo + tl.atomic_add(state_ptr + QUEUE, 1, sem="relaxed", scope="gpu")
    while task < task_hi:
        if task >= f_recv:  # (past the sends for good: count this program's before any later wait)
            send_pending = count_sends(send_pending, n_send, state_ptr, counts_ptr, counts_table, sent_table, me, W,
                                       E_loc, epoch, EL_PAD)
        t_start = timeline_now(timeline_clock, TIMELINE)
        t_waited = t_start
        rec_kind = tl.full((), REC_LOGITS, tl.int32)
        if task < f_gate:
            logits_task(task // (n_eb * n_ls), (task // n_ls) % n_eb, task % n_ls, x_ptr, rw_ptr, logits_ptr, T,
                        N, E, ls_chunk, E_PAD, BLOCK_T, BLOCK_E, BLOCK_G, W_PIECES, DOT_FP32)
            tl.debug_barrier()
            tl.atomic_add(state_ptr + LOGITS_DONE, 1, sem="release", scope="gpu")
        elif task < f_index:
            have_logits = wait_at_least(state_ptr + LOGITS_DONE, n_logits, max_spins, timeout_ns, err_ptr, host_err_ptr,
                                        me, task, WAIT_LOGITS, me, epoch, "gpu", CLOCK)
            t_waited = timeline_now(timeline_clock, TIMELINE)
            rec_kind = tl.full((), REC_GATE, tl.int32)
            if have_logits:
                choice_task(task - f_gate, logits_ptr, bias_ptr, idx_ptr, wt_ptr, lrank_ptr, hist_ptr, T, E, scale,
                            n_ls, n_gate, TOP_K, E_PAD, BLOCK_TK, SOFTMAX, HAS_BIAS, RENORMALIZE, ROUND_LOGITS,
                            LS_MAX, CAPACITY)
            tl.debug_barrier()
            tl.atomic_add(state_ptr + GATE_DONE, 1, sem="release", scope="gpu")
        elif task < f_send:
            gated = wait_at_least(state_ptr + GATE_DONE, n_gate, max_spins, timeout_ns, err_ptr, host_err_ptr, me, task,
                                  WAIT_GATE, me, epoch, "gpu", CLOCK)
            t_waited = timeline_now(timeline_clock, TIMELINE)
            rec_kind = tl.full((), REC_INDEX, tl.int32)
            if gated:
                index_task(idx_ptr, lrank_ptr, hist_ptr, base_ptr, counts_ptr, slot_ptr, n_gate, T * TOP_K, capacity,
                           E_PAD, TOP_K, BLOCK_TK, BLOCK_A, G_CHUNK, CAPACITY)
            tl.debug_barrier()
            tl.atomic_xchg(state_ptr + INDEX_FLAG, epoch, sem="release", scope="gpu")
        elif task < f_recv:
            indexed = wait_at_least(state_ptr + INDEX_FLAG, epoch, max_spins, timeout_ns, err_ptr, host_err_ptr, me,
                                    task, WAIT_INDEX, me, epoch, "gpu", CLOCK)
            t_waited = timeline_now(timeline_clock, TIMELINE)
            rec_kind = tl.full((), REC_SEND, tl.int32)
            if indexed:
                send_task((task - f_send) // n_ns, (task - f_send) % n_ns, n_ns, x_ptr, idx_ptr, slot_ptr,
                          recv_table, amap_table, me, W, E_loc, max_tokens, T, N, capacity, TOP_K, K_PAD, BLOCK_S,
                          BLOCK_NS, CAPACITY)
                # (a failed wait counts nothing: the owners then time out naming this rank)
                send_pending += 1  # (counted when this program leaves the kind: _count_sends)
        elif task < f_g0:
            s = (me + task - f_recv) % W  # (this rank's own rows first: they arrive first)
            sent = peer_region(sent_table, me, tl.int32)
            # (a failed wait still counts: the table is then built from stale counts, which are
            # bounded, and every later wait of this rank gives up at once on the error record)
            wait_at_least(sent + s, epoch, max_spins, timeout_ns, err_ptr, host_err_ptr, me, task, WAIT_SENT, s, epoch,
                          "sys", CLOCK)
            t_waited = timeline_now(timeline_clock, TIMELINE)
            rec_kind = tl.full((), REC_RECEIVE, tl.int32)
            tl.debug_barrier()
            if tl.atomic_add(state_ptr + RECV_DONE, 1, sem="acq_rel", scope="gpu") == W - 1:
                n_tiles = _tile_table(counts_table, offs_ptr, tiles_ptr, me, W, E_loc, mt, BLOCK_M, BLOCK_J, EL_PAD)
                tl.store(state_ptr + N_TILES, n_tiles)
                if n_tiles == 0:  # no rows here at all: every source's data here is read already
                    _publish_done(done_table, me, W, epoch)
                tl.debug_barrier()
                tl.atomic_xchg(state_ptr + READY, epoch, sem="release", scope="gpu")
        elif task < f_comb:
            # GEMM tasks: expert, then slice, then the expert's row tile (expert_slice_order).
            is_g0 = task < f_g1
            n_slices = tl.where(is_g0, n_k0, n_n1)
            first = tl.where(is_g0, f_g0, f_g1)
            rel = task - first
            tile = rel // n_slices
            piece = rel % n_slices
            # The tile table is this call's once seen: a program waits for it (and reads the
            # tile count) at its first GEMM task only.
            if table_seen == 0:
                ready = wait_at_least(state_ptr + READY, epoch, max_spins, timeout_ns, err_ptr, host_err_ptr, me, task,
                                      WAIT_READY, me, epoch, "gpu", CLOCK)
                n_tiles = tl.load(state_ptr + N_TILES, volatile=True)
                table_seen = tl.where(ready, 1, 0)
            real = (table_seen != 0) & (tile < n_tiles)
            lx = tl.full((), 0, tl.int32)
            row0 = tl.full((), 0, tl.int32)
            row_end = tl.full((), 0, tl.int32)
            if real:
                tile, piece, lx, row0, row_end = expert_slice_order(rel, tile, n_slices, tiles_ptr, mt, BLOCK_M)
            t_waited = timeline_now(timeline_clock, TIMELINE)
            rec_kind = tl.where(tile < n_tiles, tl.where(is_g0, REC_GEMM0, REC_GEMM1), REC_SKIP)
            if real:
                if is_g0:
                    _gemm0_task(tile, piece, lx, row0, row_end, x_ptr, recv_table, amap_table, w_up_ptr, w_up_desc,
                                w_up_scale_ptr, h_ptr, offs_ptr, me, W, E_loc, max_tokens, N, K, UP, TOP_K, ACTIVATION,
                                EL_PAD, BLOCK_M, BLOCK_K0, BLOCK_N0, W_TMA, JOINT, W_FP8)
                    tl.debug_barrier()
                    tl.atomic_add(g0_done_ptr + tile, 1, sem="release", scope="gpu")
                else:
                    tile_ready = wait_at_least(g0_done_ptr + tile, n_k0, max_spins, timeout_ns, err_ptr, host_err_ptr,
                                               me, task, WAIT_GEMM0, tile, epoch, "gpu", CLOCK)
                    t_waited = timeline_now(timeline_clock, TIMELINE)
                    if tile_ready:
                        _gemm1_task(tile, piece, lx, row0, row_end, h_ptr, w_down_ptr, w_down_desc, w_down_scale_ptr,
                                    ret_table, amap_table, offs_ptr, me, W, E_loc, max_tokens, N, K, EL_PAD, BLOCK_M,
                                    BLOCK_N1, BLOCK_K1, W_TMA, W_FP8)
                    g1_pending += 1  # (counted when this program leaves the kind: _count_gemm1)
            else:
                # Tiles past the real count are the rest of this kind's range: skip it at once.
                g1_pending = _count_gemm1(g1_pending, n_tiles * n_n1, state_ptr, done_table, me, W, epoch)
                tl.atomic_max(state_ptr + QUEUE, first + mt * n_slices - task_lo, sem="relaxed", scope="gpu")
        else:
            g1_pending = _count_gemm1(g1_pending, n_tiles * n_n1, state_ptr, done_table, me, W, epoch)
            comb = task - f_comb
            tb = comb // n_comb_n
            # This rank's routing first (the owners to wait for are read from it): a combine task
            # can be taken while the gate still runs (a grid with more programs than tasks takes
            # every number at once), and one that read a stale expert index naming no owner
            # would wait for nobody and read its rows at stale slots.
            returned = wait_at_least(state_ptr + INDEX_FLAG, epoch, max_spins, timeout_ns, err_ptr, host_err_ptr, me,
                                     task, WAIT_INDEX, me, epoch, "gpu", CLOCK)
            if returned:
                returned = _combine_wait(comb, tb, idx_ptr, done_table, err_ptr, host_err_ptr, me, W, E_loc, T,
                                         max_spins, timeout_ns, task, epoch, TOP_K, K_PAD, BLOCK_TC, CLOCK)
            t_waited = timeline_now(timeline_clock, TIMELINE)
            rec_kind = tl.full((), REC_COMBINE, tl.int32)
            if returned:
                _combine_task(tb, comb % n_comb_n, comb_slices, ret_table, wt_ptr, slot_ptr, out_ptr, me, T, N,
                              capacity, TOP_K, K_PAD, BLOCK_TC, BLOCK_NC, CAPACITY)
        if TIMELINE:
            timeline_record(timeline_ptr, timeline_cap, task, epoch, tl.program_id(0), rec_kind, task, t_start,
                            t_waited, timeline_now(timeline_clock, TIMELINE), TIMELINE)
        task = task_lo + tl.atomic_add(state_ptr + QUEUE, 1, sem="relaxed", scope="gpu")
    count_sends(send_pending, n_send, state_ptr, counts_ptr, counts_table, sent_table, me, W, E_loc, epoch, EL_PAD)
    _count_gemm1(g1_pending, n_tiles * n_n1, state_ptr, done_table, me, W, epoch)
    # The last program out resets the queue; after the call's last launch, also the counters,
    # and publishes the epoch.
    if tl.atomic_add(state_ptr + DONE, 1, sem="acq_rel", scope="gpu") == n_programs - 1:
        if final != 0:
            for t0 in range(0, mt, BLOCK_J):
                t = t0 + tl.arange(0, BLOCK_J)
                tl.store(g0_done_ptr + t, tl.zeros((BLOCK_J,), dtype=tl.int32), mask=t < mt)
            tl.store(state_ptr + LOGITS_DONE, 0)
            tl.store(state_ptr + GATE_DONE, 0)
            tl.store(state_ptr + SEND_DONE, 0)
            tl.store(state_ptr + RECV_DONE, 0)
            tl.store(state_ptr + GEMM1_DONE, 0)
            tl.store(state_ptr + EPOCH, epoch)
        tl.store(state_ptr + QUEUE, 0)
        tl.store(state_ptr + DONE, 0)
