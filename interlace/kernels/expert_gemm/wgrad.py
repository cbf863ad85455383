"""Per-expert weight gradients ``out[e] = a[rows of e]ᵀ b[rows of e]`` over expert-major rows.

The rows of an expert are the reduction: one run ``[ends[e-1], ends[e])``, or several runs per
expert (the fused training path: an expert's rows from each source rank, ``segments``). Both
operands are contiguous rows (dW_up reads a gathered copy of x's rows,
:func:`interlace.kernels.expert_gemm.backward.launch_dw_up`).

Two kernels, one launcher (:func:`launch_wgrad`):

* :func:`wgrad_kernel` — one program per output block (expert, P block, Q block); with
  ``ROWS_TMA`` the whole blocks of rows come through host-built TMA descriptors and each run's
  last partial block through masked loads.
* :func:`wgrad_flat_kernel` — ``persistent = 2``: persistent programs over the output blocks in
  one flat loop over (block, run, row block) steps, so the pipeline runs across blocks (short
  reductions and ragged experts would otherwise pay a pipeline fill per block); every row
  through TMA window maps, every block stored through a descriptor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interlace.kernels.expert_gemm.configs import check_config, num_programs
from interlace.kernels.expert_gemm.tile import window_map
from interlace.kernels.launch import cdiv, launch
from interlace.kernels.tma import ensure_allocator, tma_rows_ok
from interlace.tuning.tables import GemmConfig


@triton.jit
def _wgrad_rows(acc, a_ptr, b_ptr, start, end, ps, qs, P, Q, BLOCK_R: tl.constexpr, b_shift=0):
    """acc += a[start:end, ps]ᵀ b[start + b_shift:end + b_shift, qs] (the reduction of one run of rows)."""
    offs_r = tl.arange(0, BLOCK_R)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + offs_r
        rmask = rows < end
        rows64 = rows.to(tl.int64)
        a = tl.load(a_ptr + rows64[:, None] * P + ps[None, :], mask=rmask[:, None] & (ps < P)[None, :], other=0.0)
        b = tl.load(b_ptr + (rows64 + b_shift)[:, None] * Q + qs[None, :], mask=rmask[:, None] & (qs < Q)[None, :],
                    other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    return acc


@triton.jit
def _wgrad_rows_tma(acc, a_desc, b_desc, a_ptr, b_ptr, start, end, ps, qs, p0, q0, P, Q, BLOCK_R: tl.constexpr,
                    b_shift=0):
    """:func:`_wgrad_rows` with the whole blocks of rows through TMA descriptors and the last,
    partial block through masked loads: a descriptor block cannot stop at ``end``, and the rows
    after it (the next expert's, or unwritten ones) must not enter the sum."""
    n_full = (end - start) // BLOCK_R
    for i in range(n_full):
        r0 = start + i * BLOCK_R
        a = a_desc.load([r0, p0])
        b = b_desc.load([r0 + b_shift, q0])
        acc = tl.dot(a.T, b, acc)
    return _wgrad_rows(acc, a_ptr, b_ptr, start + n_full * BLOCK_R, end, ps, qs, P, Q, BLOCK_R, b_shift)


@triton.jit
def _wgrad_coords(item, P, Q, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP_P: tl.constexpr):
    """Output block ``item`` of the weight gradient → its expert, P block and Q block. Items are
    expert-major, and inside an expert grouped by GROUP_P P blocks (L2 swizzle) so that running
    programs share the a and b column blocks they stream."""
    n_p = tl.cdiv(P, BLOCK_P)
    n_q = tl.cdiv(Q, BLOCK_Q)
    e = item // (n_p * n_q)
    r = item % (n_p * n_q)
    per_group = GROUP_P * n_q
    first_p = (r // per_group) * GROUP_P
    group_size = tl.minimum(n_p - first_p, GROUP_P)
    pb = first_p + (r % per_group) % group_size
    qb = (r % per_group) // group_size
    return e, pb, qb


@triton.jit
def _wgrad_block(item, a_ptr, b_ptr, ends_ptr, a_desc, b_desc, P, Q, E,
                 BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
                 GROUP_P: tl.constexpr, NUM_SEG: tl.constexpr, ROWS_TMA: tl.constexpr, B_STARTS: tl.constexpr):
    """One output block of :func:`wgrad_kernel`: item → (fp32 block, expert, P block, Q block)
    (the order of :func:`_wgrad_coords`)."""
    e, pb, qb = _wgrad_coords(item, P, Q, BLOCK_P, BLOCK_Q, GROUP_P)
    ps = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    if NUM_SEG == 0:
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        if ROWS_TMA:
            acc = _wgrad_rows_tma(acc, a_desc, b_desc, a_ptr, b_ptr, start, tl.load(ends_ptr + e), ps, qs,
                                  pb * BLOCK_P, qb * BLOCK_Q, P, Q, BLOCK_R)
        else:
            acc = _wgrad_rows(acc, a_ptr, b_ptr, start, tl.load(ends_ptr + e), ps, qs, P, Q, BLOCK_R)
    else:
        for sg in tl.static_range(NUM_SEG):
            start = tl.load(ends_ptr + sg * E + e)
            count = tl.load(ends_ptr + (NUM_SEG + sg) * E + e)
            shift = 0
            if B_STARTS:
                shift = tl.load(ends_ptr + (2 * NUM_SEG + sg) * E + e) - start
            if ROWS_TMA:
                acc = _wgrad_rows_tma(acc, a_desc, b_desc, a_ptr, b_ptr, start, start + count, ps, qs,
                                      pb * BLOCK_P, qb * BLOCK_Q, P, Q, BLOCK_R, shift)
            else:
                acc = _wgrad_rows(acc, a_ptr, b_ptr, start, start + count, ps, qs, P, Q, BLOCK_R, shift)
    return acc, e, pb, qb


@triton.jit
def wgrad_kernel(
    a_ptr, b_ptr, out_ptr, ends_ptr, a_desc, b_desc,
    P, Q, E,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_P: tl.constexpr, NUM_SEG: tl.constexpr = 0, ROWS_TMA: tl.constexpr = False,
    B_STARTS: tl.constexpr = False,
):
    """out[e] (P, Q) = Σ_{rows r of e} a[r, :P]ᵀ b[r, :Q].

    The rows of expert e: ``[ends[e-1], ends[e])`` (``NUM_SEG == 0``), or NUM_SEG runs
    ``[start, start + count)`` with ``ends_ptr`` a (2, NUM_SEG, E) int32 table of starts then
    counts (the fused training path: an expert's rows from each source rank); with ``B_STARTS``
    a (3, NUM_SEG, E) table whose third part gives each run's first row in b (b's rows of a run
    lie elsewhere than a's: the training path's packed rows against the receive buffer's).

    One program per (expert, P block, Q block) (:func:`_wgrad_block`); the rows of the expert
    are the reduction. ``ROWS_TMA``: a and b read through the host-built TMA descriptors
    ``a_desc`` (blocks BLOCK_R × BLOCK_P) and ``b_desc`` (BLOCK_R × BLOCK_Q), but for each run's
    last partial block (else those arguments are unused)."""
    acc, e, pb, qb = _wgrad_block(tl.program_id(0), a_ptr, b_ptr, ends_ptr, a_desc, b_desc, P, Q, E,
                                  BLOCK_P, BLOCK_Q, BLOCK_R, GROUP_P, NUM_SEG, ROWS_TMA, B_STARTS)
    ps = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    out = out_ptr + e.to(tl.int64) * P * Q
    tl.store(out + ps[:, None].to(tl.int64) * Q + qs[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(ps < P)[:, None] & (qs < Q)[None, :])


@triton.jit
def _wgrad_run(ends_ptr, e, sg, E, NUM_SEG: tl.constexpr, B_STARTS: tl.constexpr):
    """First and end row of run ``sg`` of expert e's rows: its whole range from the inclusive
    ``ends`` (NUM_SEG = 0), or the run's start and count from the (2, NUM_SEG, E) table; and the
    offset of the run's rows in b from a's (``B_STARTS``: the table's third part, else 0)."""
    shift = 0
    if NUM_SEG == 0:
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(ends_ptr + e)
    else:
        start = tl.load(ends_ptr + sg * E + e)
        end = start + tl.load(ends_ptr + (NUM_SEG + sg) * E + e)
        if B_STARTS:
            shift = tl.load(ends_ptr + (2 * NUM_SEG + sg) * E + e) - start
    return start, end, shift


@triton.jit
def wgrad_flat_kernel(
    a_ptr, b_ptr, out_ptr, ends_ptr,
    P, Q, E, R, Rb, num_programs,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_P: tl.constexpr,
    NUM_SEG: tl.constexpr = 0, BLOCK_I: tl.constexpr = 256, B_STARTS: tl.constexpr = False,
):
    """Persistent programs over the output blocks of :func:`wgrad_kernel` (P a multiple of
    BLOCK_P), as one flat loop over (output block, run of rows, row block) steps, so the software
    pipeline runs across output blocks: the next block's first rows load while this block's last
    steps and its store run. For short reductions (a few hundred rows per expert, 4 row blocks
    per output block) and ragged experts (a partial last row block each) the per-block pipeline
    fill is otherwise a large share of the time. Each block is stored through a TMA descriptor
    over out viewed as (E·P, Q).

    An expert's rows are one run (``NUM_SEG = 0``: from ``ends``) or NUM_SEG runs (the fused
    training path: one per source rank). Every step reads a whole BLOCK_R block of rows through
    TMA, and the rows of a step past its run's end must read as zeros, so that the rows paired
    with them add nothing (zeroing them in registers instead fed the dot from registers, which
    was slower). a and b come through one :func:`window_map` each (BLOCK_R rows), made once
    per program: (s, i, column) ↦ a[s + i, column]. A step at row r0 with v ≤ BLOCK_R rows of
    its run left loads the box at s = r0, i = v - BLOCK_R: its last v rows are the run's rows
    r0 .. r0+v-1, and its first BLOCK_R - v rows fall before the middle dimension's start, which
    TMA fills with zeros in both operands alike (the order of the rows in a step does not matter
    to the reduction). Only a run's own rows are ever read, and no map depends on a run's end.
    Maps made per run instead (one whenever a program's next block had another expert, nearly
    every block) cost each program a global write and a proxy fence in the loop. (A window
    whose zeros came past the middle dimension's end needed a base pointer BLOCK_R rows before
    a, which can be an illegal address.) Runs may leave unwritten rows between them that hold
    NaN (0 · NaN is NaN); no step reads them. An empty run still takes one step (all zeros), so
    every block is stored once. The output's map is made in the kernel too, not on the host: a
    host descriptor costs host time per launch to build and encode. R and Rb are a's and b's
    row counts, at least 1."""
    RUNS: tl.constexpr = 1 if NUM_SEG == 0 else NUM_SEG
    pid = tl.program_id(0)
    per_expert = tl.cdiv(P, BLOCK_P) * tl.cdiv(Q, BLOCK_Q)
    n_items = E * per_expert
    # this program's steps: over its blocks and their runs, max(row blocks of the run, 1)
    total = 0
    for i0 in range(pid, n_items, num_programs * BLOCK_I):
        its = i0 + num_programs * tl.arange(0, BLOCK_I)
        valid = its < n_items
        ex = its // per_expert
        if NUM_SEG == 0:
            hi = tl.load(ends_ptr + ex, mask=valid, other=0)
            lo = tl.load(ends_ptr + ex - 1, mask=valid & (ex > 0), other=0)
            total += tl.sum(tl.where(valid, tl.maximum(tl.cdiv(hi - lo, BLOCK_R), 1), 0))
        else:
            for sg in tl.static_range(NUM_SEG):
                count = tl.load(ends_ptr + (NUM_SEG + sg) * E + ex, mask=valid, other=0)
                total += tl.sum(tl.where(valid, tl.maximum(tl.cdiv(count, BLOCK_R), 1), 0))
    item = pid - num_programs
    sg = RUNS - 1
    ki = -1
    n_k = 0
    e = 0
    pb = 0
    qb = 0
    start = 0
    end = 0
    shift = 0
    a_win = window_map(a_ptr, R, P, BLOCK_R, BLOCK_P)
    b_win = window_map(b_ptr, Rb, Q, BLOCK_R, BLOCK_Q)
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[E * P, Q], strides=[Q, 1], block_shape=[BLOCK_P, BLOCK_Q])
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for _ in range(0, total):
        ki += 1
        if ki == n_k:  # the next run, or the next output block (the persistent matmul tutorial's flat loop)
            sg += 1
            next_block = sg == RUNS
            item = tl.where(next_block, item + num_programs, item)
            sg = tl.where(next_block, 0, sg)
            e, pb, qb = _wgrad_coords(item, P, Q, BLOCK_P, BLOCK_Q, GROUP_P)
            start, end, shift = _wgrad_run(ends_ptr, e, sg, E, NUM_SEG, B_STARTS)
            n_k = tl.maximum(tl.cdiv(end - start, BLOCK_R), 1)
            ki = 0
            start = tl.minimum(start, end)  # an empty run: its one step reads no row of the run
        r0 = start + ki * BLOCK_R
        i0 = tl.minimum(end - r0, BLOCK_R) - BLOCK_R  # -(rows of the step past the run): zeros first
        a = tl.reshape(a_win.load([r0, i0, pb * BLOCK_P]), (BLOCK_R, BLOCK_P))
        b = tl.reshape(b_win.load([r0 + shift, i0, qb * BLOCK_Q]), (BLOCK_R, BLOCK_Q))
        acc = tl.dot(a.T, b, acc)
        if (ki == n_k - 1) & (sg == RUNS - 1):
            out_desc.store([(e * P + pb * BLOCK_P).to(tl.int32), qb * BLOCK_Q], acc.to(out_ptr.dtype.element_ty))
            acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)


def launch_wgrad(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, ends: torch.Tensor | None, P: int, Q: int,
                 config: GemmConfig, segments: torch.Tensor | None = None, tma: bool = False) -> torch.Tensor:
    """out[e] (P, Q) = a[rows of e, :P]ᵀ b[rows of e, :Q] for out (E, P, Q); the rows of e from the
    inclusive ``ends`` (E,) int32, or from ``segments`` (2, S, E) int32 (starts, then counts: S
    runs of rows per expert) or (3, S, E) (then each run's first row in b, where b's rows of a run
    are not a's). With ``tma`` (TMA descriptors usable here) and ``config.a_tma``,
    a and b rows are read through descriptors; with ``config.persistent = 2`` too (and P a
    multiple of the block) by :func:`wgrad_flat_kernel`."""
    check_config(config)
    E = out.shape[0]
    if E == 0:
        return out
    table = ends if segments is None else segments
    num_seg = 0 if segments is None else segments.shape[1]
    b_starts = segments is not None and segments.shape[0] == 3
    rows_tma = bool(tma and config.a_tma and tma_rows_ok(a) and tma_rows_ok(b) and a.shape[1] == P
                    and b.shape[1] == Q)
    items = E * cdiv(P, config.block_m) * cdiv(Q, config.block_n)
    if rows_tma and config.persistent == 2 and P % config.block_m == 0:
        ensure_allocator()  # every descriptor of this kernel is made in the kernel
        programs = num_programs(out.device, items)
        launch(wgrad_flat_kernel, (programs,),
            a, b, out, table, P, Q, E, max(a.shape[0], 1), max(b.shape[0], 1), programs,  # no empty tensor map
            BLOCK_P=config.block_m, BLOCK_Q=config.block_n, BLOCK_R=config.block_k, GROUP_P=config.group_m,
            NUM_SEG=num_seg, B_STARTS=b_starts, num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return out
    if rows_tma:
        # Built on the host, not in the kernel: this grid has a program per output block (tens of
        # thousands), and an in-kernel descriptor costs each program a global write and a fence.
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(a, [config.block_k, config.block_m])
        b_desc = TensorDescriptor.from_tensor(b, [config.block_k, config.block_n])
    else:
        a_desc, b_desc = a, b  # unused
    launch(wgrad_kernel, (items,),
        a, b, out, table, a_desc, b_desc, P, Q, E,
        BLOCK_P=config.block_m, BLOCK_Q=config.block_n, BLOCK_R=config.block_k, GROUP_P=config.group_m,
        NUM_SEG=num_seg, ROWS_TMA=rows_tma, B_STARTS=b_starts, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
