"""Counting sort of token→expert assignments on the device (no argsort, no host sync).

Assignments are numbered slot-major, ``a = j * T + t`` for token t and slot j < k, so that a
stable sort by expert serves every token's first choice before any second choice. That order
is also the capacity policy: an expert keeps the first ``capacity`` assignments it receives
in that order and drops the rest.

Two kernels, one idea each:

1. ``_block_histogram_kernel``: the assignments are cut into blocks of ``BLOCK_A``; each
   program counts its block's assignments per expert → ``block_counts`` (num_blocks, E).
2. ``_scan_counts_kernel``: one program scans ``block_counts`` column-wise into exclusive
   per-block prefixes, and writes each expert's kept count and its row range.
3. ``_assign_rows_kernel``: an assignment's rank inside its expert is that prefix plus the
   number of earlier assignments of the same expert in its own block (a BLOCK_A × BLOCK_A
   comparison). Kept assignments get the row ``expert_start[e] + rank``; dropped ones -1.

Three launches and no torch glue in between: at small token counts the layer is bound by
the host's launch rate, so every op saved here is time saved.

``_expert_major_index_kernel`` (receiver side) turns the [source][expert] layout of rows
received by the all-to-all into the [expert][source] layout the grouped GEMM needs.

Outputs (see :func:`build_dispatch_index`):
    row_of_assignment: (T, k) int32, the dispatch row of (t, j), or -1 if dropped.
    assignment_of_row: (A,) int32, for each dispatch row r < R the flat index ``t * k + j``
        of its assignment; entries ≥ R are unspecified.
    kept_counts: (E,) int32, rows per expert after capacity.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interlace.kernels import alloc
from interlace.kernels.launch import cdiv, launch, next_power_of_2
from interlace.kernels.rows import use_triton

# Tuning: BLOCK_A is the number of assignments one program handles; the rank-in-block
# comparison costs BLOCK_A² and the histogram BLOCK_A·E_PAD, so keep it modest.
BLOCK_A = 128
NUM_WARPS = 4


@triton.jit
def _load_slot_major_experts(topk_ptr, offs, mask, T, TOP_K: tl.constexpr):
    """Experts of slot-major assignments ``a = j*T + t`` read from the (T, k) top-k tensor."""
    token = offs % T
    slot = offs // T
    return tl.load(topk_ptr + token * TOP_K + slot, mask=mask, other=0).to(tl.int32)


@triton.jit
def _block_histogram_kernel(
    topk_ptr,  # (T, k) int32/int64 expert ids
    counts_ptr,  # (num_blocks, E) int32, out
    A, T, E,
    TOP_K: tl.constexpr, BLOCK_A: tl.constexpr, E_PAD: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK_A + tl.arange(0, BLOCK_A)
    mask = offs < A
    experts = _load_slot_major_experts(topk_ptr, offs, mask, T, TOP_K)
    hist = tl.histogram(experts, E_PAD, mask=mask)
    bins = tl.arange(0, E_PAD)
    tl.store(counts_ptr + pid * E + bins, hist.to(tl.int32), mask=bins < E)


@triton.jit
def _scan_counts_kernel(
    counts_ptr,  # (num_blocks, E) int32: in, per-block counts; out, exclusive prefix over blocks
    kept_ptr,  # (E,) int32, out: rows expert e keeps (after capacity)
    expert_end_ptr,  # (E,) int32, out: inclusive cumsum of kept (grouped-GEMM offsets)
    num_blocks, E, capacity,
    BLOCK_B: tl.constexpr, E_PAD: tl.constexpr,
):
    # One program: a column-wise scan over the (num_blocks, E) block histogram.
    cols = tl.arange(0, E_PAD)
    rows = tl.arange(0, BLOCK_B)
    carry = tl.zeros((E_PAD,), dtype=tl.int32)
    for b0 in range(0, num_blocks, BLOCK_B):
        r = b0 + rows
        m = (r[:, None] < num_blocks) & (cols[None, :] < E)
        ptrs = counts_ptr + r[:, None] * E + cols[None, :]
        tile = tl.load(ptrs, mask=m, other=0)
        tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + carry[None, :], mask=m)
        carry += tl.sum(tile, axis=0)
    kept = tl.minimum(carry, capacity)
    tl.store(kept_ptr + cols, kept, mask=cols < E)
    tl.store(expert_end_ptr + cols, tl.cumsum(kept, axis=0), mask=cols < E)


@triton.jit
def _assign_rows_kernel(
    topk_ptr,  # (T, k) expert ids
    block_prefix_ptr,  # (num_blocks, E) int32: assignments of expert e in blocks before this one
    kept_ptr, expert_end_ptr,  # (E,) int32 each, from _scan_counts_kernel
    row_of_assignment_ptr,  # (T, k) int32, out
    assignment_of_row_ptr,  # (T*k,) int32, out
    A, T, E, capacity,
    TOP_K: tl.constexpr, BLOCK_A: tl.constexpr,
):
    pid = tl.program_id(0)
    idx = tl.arange(0, BLOCK_A)
    offs = pid * BLOCK_A + idx
    mask = offs < A
    experts = _load_slot_major_experts(topk_ptr, offs, mask, T, TOP_K)
    experts = tl.where(mask, experts, -1)
    # Earlier assignments of the same expert inside this block (stable order).
    same = (experts[:, None] == experts[None, :]) & (idx[None, :] < idx[:, None])
    rank_in_block = tl.sum(same.to(tl.int32), axis=1)
    safe_e = tl.where(mask, experts, 0)
    rank = tl.load(block_prefix_ptr + pid * E + safe_e, mask=mask, other=0) + rank_in_block
    keep = mask & (rank < capacity)
    start = tl.load(expert_end_ptr + safe_e, mask=mask, other=0) - tl.load(kept_ptr + safe_e, mask=mask, other=0)
    row = start + rank
    # slot-major a = j*T + t  →  token-major flat index t*k + j
    flat = (offs % T) * TOP_K + offs // T
    tl.store(row_of_assignment_ptr + flat, tl.where(keep, row, -1), mask=mask)
    tl.store(assignment_of_row_ptr + row, flat, mask=keep)


def build_dispatch_index(
    topk_idx: torch.Tensor, num_experts: int, capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counting sort of ``topk_idx`` (T, k) by expert; see the module docstring.

    Returns ``(row_of_assignment (T, k) int32, assignment_of_row (T*k,) int32,
    kept_counts (E,) int32, expert_end (E,) int32)``; ``expert_end`` is the inclusive cumsum
    of ``kept_counts``, i.e. the grouped-GEMM offsets of the dispatch rows. Three kernel
    launches on ``topk_idx.device``; no host sync.
    """
    T, k = topk_idx.shape
    A = T * k
    device = topk_idx.device
    E = num_experts
    row_of_assignment = alloc.empty((T, k), dtype=torch.int32, device=device)
    assignment_of_row = alloc.empty((A,), dtype=torch.int32, device=device)
    if A == 0:
        zeros = torch.zeros(E, dtype=torch.int32, device=device)
        return row_of_assignment, assignment_of_row, zeros, zeros.clone()
    if not use_triton(topk_idx):
        rows, assign, kept = build_dispatch_index_reference(topk_idx, E, capacity)
        return rows, assign, kept, kept.cumsum(0, dtype=torch.int32)
    topk_idx = topk_idx.contiguous()
    cap = A if capacity is None else capacity
    num_blocks = cdiv(A, BLOCK_A)
    e_pad = next_power_of_2(E)
    block_counts = alloc.empty((num_blocks, E), dtype=torch.int32, device=device)
    kept = alloc.empty((E,), dtype=torch.int32, device=device)
    expert_end = alloc.empty((E,), dtype=torch.int32, device=device)
    launch(_block_histogram_kernel, (num_blocks,),
        topk_idx, block_counts, A, T, E, TOP_K=k, BLOCK_A=BLOCK_A, E_PAD=e_pad, num_warps=NUM_WARPS
    )
    launch(_scan_counts_kernel, (1,),
        block_counts, kept, expert_end, num_blocks, E, cap,
        BLOCK_B=max(1, min(32, 4096 // e_pad)), E_PAD=e_pad, num_warps=NUM_WARPS,
    )
    launch(_assign_rows_kernel, (num_blocks,),
        topk_idx, block_counts, kept, expert_end, row_of_assignment, assignment_of_row,
        A, T, E, cap, TOP_K=k, BLOCK_A=BLOCK_A, num_warps=NUM_WARPS,
    )
    return row_of_assignment, assignment_of_row, kept, expert_end


@triton.jit
def _expert_major_index_kernel(
    recv_counts_ptr,  # (W, E_local) int32: rows received from source s for local expert e
    src_row_ptr,  # (R,) int32, out: expert-major row q comes from received row src_row[q]
    inverse_ptr,  # (R,) int32, out: inverse[src_row[q]] = q
    offs_ptr,  # (E_local,) int32, out: grouped-GEMM row ends per local expert
    R, W, E_local,
    BLOCK_Q: tl.constexpr, EL_PAD: tl.constexpr, W_PAD: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.arange(0, EL_PAD)
    s = tl.arange(0, W_PAD)
    m = (e[:, None] < E_local) & (s[None, :] < W)
    tile = tl.load(recv_counts_ptr + s[None, :] * E_local + e[:, None], mask=m, other=0)  # tile[e, s]
    per_expert = tl.sum(tile, axis=1)
    expert_start = tl.cumsum(per_expert, axis=0) - per_expert
    # Expert-major layout [e][s]: block (e, s) starts after all of experts < e and sources < s of e.
    start_em = expert_start[:, None] + tl.cumsum(tile, axis=1) - tile
    # Received layout [s][e]: block (s, e) starts after all of sources < s and experts < e of s.
    per_source = tl.sum(tile, axis=0)
    source_start = tl.cumsum(per_source, axis=0) - per_source
    start_rm = source_start[None, :] + tl.cumsum(tile, axis=0) - tile
    if pid == 0:
        tl.store(offs_ptr + e, expert_start + per_expert, mask=e < E_local)
    NB: tl.constexpr = EL_PAD * W_PAD
    start_em_f = tl.reshape(start_em, (NB,))
    end_em_f = tl.reshape(start_em + tile, (NB,))
    start_rm_f = tl.reshape(start_rm, (NB,))
    q = pid * BLOCK_Q + tl.arange(0, BLOCK_Q)
    inside = (q[:, None] >= start_em_f[None, :]) & (q[:, None] < end_em_f[None, :])
    src = tl.sum(tl.where(inside, start_rm_f[None, :] + q[:, None] - start_em_f[None, :], 0), axis=1)
    tl.store(src_row_ptr + q, src, mask=q < R)
    tl.store(inverse_ptr + src, q, mask=q < R)


def expert_major_index(recv_counts: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-layout of received rows from [source][expert] blocks to [expert][source] blocks.

    recv_counts: (W, E_local) int32 rows received from each source for each local expert.
    Returns ``(src_row, inverse, offs)``: expert-major row q comes from received row
    ``src_row[q]``, ``inverse[src_row[q]] = q`` (both (num_rows,) int32), and ``offs``
    (E_local,) int32 the grouped-GEMM row ends. One kernel launch, no sync.
    """
    W, E_local = recv_counts.shape
    device = recv_counts.device
    if not use_triton(recv_counts):
        return expert_major_index_reference(recv_counts, num_rows)
    src_row = alloc.empty((num_rows,), dtype=torch.int32, device=device)
    inverse = alloc.empty((num_rows,), dtype=torch.int32, device=device)
    offs = alloc.empty((E_local,), dtype=torch.int32, device=device)
    el_pad, w_pad = next_power_of_2(E_local), next_power_of_2(W)
    block_q = max(1, min(128, 8192 // (el_pad * w_pad)))
    launch(_expert_major_index_kernel, (max(1, cdiv(num_rows, block_q)),),
        recv_counts.contiguous(), src_row, inverse, offs, num_rows, W, E_local,
        BLOCK_Q=block_q, EL_PAD=el_pad, W_PAD=w_pad, num_warps=NUM_WARPS,
    )
    return src_row, inverse, offs


def expert_major_index_reference(recv_counts: torch.Tensor, num_rows: int):
    """Plain-torch twin of :func:`expert_major_index`."""
    W, E_local = recv_counts.shape
    device = recv_counts.device
    counts = recv_counts.long()
    flat_rm = counts.reshape(-1)
    start_rm = (flat_rm.cumsum(0) - flat_rm).view(W, E_local).t().reshape(-1)
    flat_em = counts.t().reshape(-1)
    start_em = flat_em.cumsum(0) - flat_em
    block = torch.repeat_interleave(torch.arange(W * E_local, device=device), flat_em, output_size=num_rows)
    q = torch.arange(num_rows, device=device)
    src_row = start_rm[block] + (q - start_em[block])
    inverse = torch.empty_like(src_row)
    inverse[src_row] = q
    offs = counts.sum(0).cumsum(0)
    return src_row.to(torch.int32), inverse.to(torch.int32), offs.to(torch.int32)


def build_dispatch_index_reference(
    topk_idx: torch.Tensor, num_experts: int, capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch twin of :func:`build_dispatch_index` (stable argsort), for tests."""
    T, k = topk_idx.shape
    A = T * k
    experts = topk_idx.t().reshape(-1).long()
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=num_experts)
    starts = counts.cumsum(0) - counts
    rank = torch.arange(A, device=topk_idx.device) - starts[experts[order]]
    keep = rank < (capacity if capacity is not None else A)
    kept = counts.clamp(max=capacity) if capacity is not None else counts
    kept_start = kept.cumsum(0) - kept
    rows = kept_start[experts[order]] + rank
    row_of_assignment = torch.full((A,), -1, dtype=torch.int64, device=topk_idx.device)
    row_of_assignment[order[keep]] = rows[keep]
    a = order[keep]
    flat = (a % T) * k + a // T
    assignment_of_row = torch.full((A,), -1, dtype=torch.int64, device=topk_idx.device)
    assignment_of_row[rows[keep]] = flat
    row_tk = row_of_assignment.view(k, T).t().contiguous()
    return row_tk.int(), assignment_of_row.int(), kept.int()
