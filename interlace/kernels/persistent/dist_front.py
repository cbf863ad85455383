"""The front of a W > 1 persistent call (tasks of :mod:`interlace.kernels.persistent.dist_kernel`):
the router's logits and top-k, the index (each assignment's slot at its expert's owner), and the
dispatch (each token row stored once into each peer owner's symmetric memory, each
assignment's map entry, then the counts and the ``sent`` flag). Each task is a short chain
that every GEMM tile waits for, so its loads are issued together, before the stores or sums
that use them: one program's dependent loads cost a memory round trip each, and the front runs
before any weight is read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from interlace.kernels.comet.flags import peer_region
from interlace.kernels.persistent.protocol import SEND_DONE
from interlace.kernels.persistent.routing import gate_choice, gate_logits, round_logits


@triton.jit
def logits_task(g, eb, ks, x_ptr, rw_ptr, logits_ptr, T, N, E, ls_chunk, E_PAD: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, W_PIECES: tl.constexpr,
                DOT_FP32: tl.constexpr):
    """logits[ks][tokens of block g, experts of block eb] (fp32, rows of E_PAD): the part over
    columns [ks·ls_chunk, (ks+1)·ls_chunk) of the router GEMM, split over expert blocks and
    column parts, so one token block's gate is many programs' work (one program's pass over the
    whole router weight is a latency-bound chain of N / BLOCK_G loads). The choice task sums the
    parts in ks order (deterministic)."""
    tokens = g * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tokens < T
    cols = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    # ls_chunk is whole BLOCK_G steps (DistPlan) but not specialized (it changes with the token
    # count): written as steps × BLOCK_G, the compiler knows the part's bounds are aligned, so the
    # x tiles load as 16-byte vectors, pipelined with the weight's (else each x element was its
    # own 2-byte load, and every step waited for its tile).
    ls_chunk = (ls_chunk // BLOCK_G) * BLOCK_G
    n_lo = ks * ls_chunk
    acc = gate_logits(x_ptr, rw_ptr, tokens, tmask, cols, cols < E, N, n_lo, tl.minimum(N, n_lo + ls_chunk),
                      BLOCK_T, BLOCK_E, BLOCK_G, W_PIECES, DOT_FP32, 0)
    part = logits_ptr + ks * T * E_PAD  # (parts · T · E_PAD < 2³¹)
    tl.store(part + tokens[:, None].to(tl.int64) * E_PAD + cols[None, :], acc,
             mask=tmask[:, None] & (cols[None, :] < E))


@triton.jit
def choice_task(g, logits_ptr, bias_ptr, idx_ptr, wt_ptr, lrank_ptr, hist_ptr, T, E, scale, n_ls, n_gate,
                TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                ROUND_LOGITS: tl.constexpr, LS_MAX: tl.constexpr, CAPACITY: tl.constexpr):
    """Token block g's top-k from its logits rows, the ``n_ls`` (≤ LS_MAX) column parts summed in
    order (then rounded: ROUND_LOGITS), by the world-1 gate's choice rule. The parts' loads are
    unrolled and masked (a part past ``n_ls`` adds 0.0), so they are issued together."""
    tokens = g * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tokens < T
    cols = tl.arange(0, E_PAD)
    emask = cols < E
    offs = tokens[:, None].to(tl.int64) * E_PAD + cols[None, :]
    m = tmask[:, None] & emask[None, :]
    acc = tl.load(logits_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
    for ks in tl.static_range(1, LS_MAX):
        acc += tl.load(logits_ptr + ks * T * E_PAD + offs, mask=m & (ks < n_ls), other=0.0, cache_modifier=".cg")
    logits = tl.where(emask[None, :], round_logits(acc, ROUND_LOGITS), float("-inf"))
    gate_choice(logits, g, tokens, tmask, bias_ptr, idx_ptr, wt_ptr, lrank_ptr, hist_ptr, E, scale, n_gate, TOP_K,
                E_PAD, SOFTMAX, HAS_BIAS, RENORMALIZE, CAPACITY)


@triton.jit
def index_task(idx_ptr, lrank_ptr, hist_ptr, base_ptr, counts_ptr, slot_ptr, n_gate, TK, capacity,
               E_PAD: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_A: tl.constexpr,
               G_CHUNK: tl.constexpr, CAPACITY: tl.constexpr):
    """Per-expert counts and each assignment's slot (its rank among this rank's assignments to
    its expert: the block's base plus its rank within the block). The bases are a running sum
    of the gate blocks' histograms, G_CHUNK blocks a step (one load and a scan, not a load per
    block). CAPACITY: the histograms are per (pick, block), scanned pick-major, so a slot is the
    rank in the policy's order; slots at or past ``capacity`` are dropped (the send and the
    combine skip them) and each expert counts min(count, capacity) rows."""
    cols = tl.arange(0, E_PAD)
    gs = tl.arange(0, G_CHUNK)
    running = tl.zeros((E_PAD,), dtype=tl.int32)
    n_rows = n_gate * TOP_K if CAPACITY else n_gate
    for g0 in range(0, n_rows, G_CHUNK):
        gmask = (g0 + gs < n_rows)[:, None]
        offs = (g0 + gs)[:, None] * E_PAD + cols[None, :]
        h = tl.load(hist_ptr + offs, mask=gmask, other=0, cache_modifier=".cg")
        tl.store(base_ptr + offs, running[None, :] + tl.cumsum(h, axis=0) - h, mask=gmask)
        running += tl.sum(h, axis=0)
    if CAPACITY:
        running = tl.minimum(running, capacity)
    tl.store(counts_ptr + cols, running)
    tl.debug_barrier()  # the bases are read back below by other threads
    for a0 in range(0, TK, BLOCK_A):
        a = a0 + tl.arange(0, BLOCK_A)
        amask = a < TK
        e = tl.load(idx_ptr + a, mask=amask, other=0, cache_modifier=".cg")
        block = a // (TOP_K * BLOCK_T)
        if CAPACITY:
            block += (a % TOP_K) * n_gate  # (the pick's rows come pick-major)
        slot = (tl.load(base_ptr + block * E_PAD + e, mask=amask, other=0)
                + tl.load(lrank_ptr + a, mask=amask, other=0, cache_modifier=".cg"))
        tl.store(slot_ptr + a, slot, mask=amask)


@triton.jit
def block_assignments(first, T, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Tokens [first, first + BLOCK) and their assignments as a block: (tokens (BLOCK,), tmask,
    js (K_PAD,), a (BLOCK, K_PAD) int64 = t·k + j, amask: token < T and j < k)."""
    tokens = first + tl.arange(0, BLOCK)
    tmask = tokens < T
    js = tl.arange(0, K_PAD)
    a = tokens[:, None].to(tl.int64) * TOP_K + js[None, :]
    return tokens, tmask, js, a, tmask[:, None] & (js[None, :] < TOP_K)


@triton.jit
def send_task(sb, ns, n_ns, x_ptr, idx_ptr, slot_ptr, recv_table, amap_table, me, W, E_loc, max_tokens, T, N,
              capacity, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_NS: tl.constexpr,
              CAPACITY: tl.constexpr):
    """Tokens [sb·BLOCK_S, ...), columns [ns·BLOCK_NS, ...): each token row into recv[me][t]
    of every peer owner it chose an expert of, once per owner (a task per column slice: one
    program's stores over NVLink are latency bound, so the rows go out from many programs);
    and the map entries amap[me][e − owner·E_loc][slot] = t·k + j of the assignments j with
    j mod n_ns = ns (spread over the column tasks). The experts and slots of all k assignments
    are loaded as one block first. CAPACITY: assignments at slots past ``capacity`` are dropped
    (no map entry; a row only for a kept one)."""
    tokens, tmask, js, a, amask = block_assignments(sb * BLOCK_S, T, TOP_K, K_PAD, BLOCK_S)
    cols = ns * BLOCK_NS + tl.arange(0, BLOCK_NS)
    cmask = cols < N
    e = tl.load(idx_ptr + a, mask=amask, other=0, cache_modifier=".cg")
    slot = tl.load(slot_ptr + a, mask=amask, other=0, cache_modifier=".cg")
    if CAPACITY:
        amask = amask & (slot < capacity)
    owner = e // E_loc
    v = tl.load(x_ptr + tokens[:, None].to(tl.int64) * N + cols[None, :], mask=tmask[:, None] & cmask[None, :],
                other=0.0)
    rows = (me * max_tokens + tokens).to(tl.int64) * N
    for d in range(0, W):
        if d != me:
            uses = tl.sum((amask & (owner == d)).to(tl.int32), axis=1) > 0
            recv = peer_region(recv_table, d, x_ptr.dtype.element_ty)
            tl.store(recv + rows[:, None] + cols[None, :], v, mask=uses[:, None] & cmask[None, :])
    # (16-byte aligned regions, as peer_region says)
    maps = tl.load(amap_table + owner, mask=amask, other=0).to(tl.pointer_type(tl.int32))
    entry = (me * E_loc + e - owner * E_loc).to(tl.int64) * max_tokens + slot
    tl.store(maps + entry, a.to(tl.int32), mask=amask & (js[None, :] % n_ns == ns))


@triton.jit
def count_sends(pending, n_send, state_ptr, counts_ptr, counts_table, sent_table, me, W, E_loc, epoch,
                EL_PAD: tl.constexpr):
    """Count this program's ``pending`` finished send tasks (acq_rel, system scope, after every
    thread's stores); the count that reaches ``n_send`` publishes the counts and the dispatch
    flag (:func:`_publish_sent`). A program counts its sends once, when it leaves the kind, not
    after each: the system-scope release waits for every store in flight (its rows into the
    peers' memory), and per task it stalled each program at every send's end. Called before
    any later wait (a receive may wait on this very flag) and at the program's exit. Returns 0."""
    if pending > 0:
        tl.debug_barrier()
        if tl.atomic_add(state_ptr + SEND_DONE, pending, sem="acq_rel", scope="sys") + pending == n_send:
            _publish_sent(counts_ptr, counts_table, sent_table, me, W, E_loc, epoch, EL_PAD)
    return tl.full((), 0, tl.int32)


@triton.jit
def _publish_sent(counts_ptr, counts_table, sent_table, me, W, E_loc, epoch, EL_PAD: tl.constexpr):
    """Every owner d: counts[me][:] = this rank's rows per d's local expert, then (release,
    system scope, after every send task's rows: the caller's count, :func:`count_sends`, was
    an acq_rel at system scope) sent[me] = epoch."""
    lo = tl.arange(0, EL_PAD)
    lmask = lo < E_loc
    for d in range(0, W):
        c = tl.load(counts_ptr + d * E_loc + lo, mask=lmask, other=0, cache_modifier=".cg")
        tl.store(peer_region(counts_table, d, tl.int32) + me * E_loc + lo, c, mask=lmask)
    tl.debug_barrier()
    for d in range(0, W):
        tl.atomic_xchg(peer_region(sent_table, d, tl.int32) + me, epoch, sem="release", scope="sys")
