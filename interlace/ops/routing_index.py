"""Counting sort of token→expert assignments on the device (no argsort, no host sync).

Assignments are numbered slot-major, ``a = j * T + t`` for token t and slot j < k, so that a
stable sort by expert serves every token's first choice before any second choice. That order
is also the capacity policy: an expert keeps the first ``capacity`` assignments it receives
in that order and drops the rest.

Two kernels, one idea each:

1. ``_block_histogram_kernel``: the assignments are cut into blocks of ``BLOCK_A``; each
   program counts its block's assignments per expert → ``block_counts`` (num_blocks, E).
2. ``_assign_rows_kernel``: an assignment's rank inside its expert is the exclusive prefix of
   its expert over the earlier blocks (a cumsum over ``block_counts``, done with torch on a
   tiny (num_blocks, E) tensor) plus the number of earlier assignments of the same expert in
   its own block (a BLOCK_A × BLOCK_A comparison). Kept assignments get the row
   ``expert_start[e] + rank``; dropped ones get -1.

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

from interlace.ops import alloc

# Tuning: BLOCK_A is the number of assignments one program handles; the rank-in-block
# comparison costs BLOCK_A² and the histogram BLOCK_A·E_PAD, so keep it modest.
BLOCK_A = 128
NUM_WARPS = 4


@triton.jit
def _block_histogram_kernel(
    expert_ptr,  # (A,) int32, slot-major expert ids
    counts_ptr,  # (num_blocks, E) int32, out
    A,
    E,
    BLOCK_A: tl.constexpr,
    E_PAD: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK_A + tl.arange(0, BLOCK_A)
    mask = offs < A
    experts = tl.load(expert_ptr + offs, mask=mask, other=0)
    hist = tl.histogram(experts, E_PAD, mask=mask)
    bins = tl.arange(0, E_PAD)
    tl.store(counts_ptr + pid * E + bins, hist.to(tl.int32), mask=bins < E)


@triton.jit
def _assign_rows_kernel(
    expert_ptr,  # (A,) int32, slot-major expert ids
    block_prefix_ptr,  # (num_blocks, E) int32: assignments of expert e in blocks before this one
    expert_start_ptr,  # (E,) int32: first row of expert e (exclusive cumsum of kept counts)
    capacity_ptr,  # (E,) int32: rows expert e may keep
    row_of_assignment_ptr,  # (T, k) int32, out
    assignment_of_row_ptr,  # (A,) int32, out
    A,
    T,
    E,
    TOP_K: tl.constexpr,
    BLOCK_A: tl.constexpr,
):
    pid = tl.program_id(0)
    idx = tl.arange(0, BLOCK_A)
    offs = pid * BLOCK_A + idx
    mask = offs < A
    experts = tl.load(expert_ptr + offs, mask=mask, other=-1)
    # Earlier assignments of the same expert inside this block (stable order).
    same = (experts[:, None] == experts[None, :]) & (idx[None, :] < idx[:, None])
    rank_in_block = tl.sum(same.to(tl.int32), axis=1)
    safe_e = tl.where(mask, experts, 0)
    rank = tl.load(block_prefix_ptr + pid * E + safe_e, mask=mask, other=0) + rank_in_block
    cap = tl.load(capacity_ptr + safe_e, mask=mask, other=0)
    keep = mask & (rank < cap)
    row = tl.load(expert_start_ptr + safe_e, mask=mask, other=0) + rank
    # slot-major a = j*T + t  →  token-major flat index t*k + j
    token = offs % T
    slot = offs // T
    flat = token * TOP_K + slot
    tl.store(row_of_assignment_ptr + flat, tl.where(keep, row, -1), mask=mask)
    tl.store(assignment_of_row_ptr + row, flat, mask=keep)


def build_dispatch_index(
    topk_idx: torch.Tensor, num_experts: int, capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counting sort of ``topk_idx`` (T, k) by expert; see the module docstring.

    Returns ``(row_of_assignment (T, k) int32, assignment_of_row (T*k,) int32,
    kept_counts (E,) int32)``. Runs entirely on ``topk_idx.device``; no host sync.
    """
    T, k = topk_idx.shape
    A = T * k
    device = topk_idx.device
    E = num_experts
    row_of_assignment = alloc.empty((T, k), dtype=torch.int32, device=device)
    assignment_of_row = alloc.empty((A,), dtype=torch.int32, device=device)
    if A == 0:
        return row_of_assignment, assignment_of_row, torch.zeros(E, dtype=torch.int32, device=device)
    experts = topk_idx.t().reshape(-1).to(torch.int32)  # slot-major
    num_blocks = triton.cdiv(A, BLOCK_A)
    block_counts = alloc.empty((num_blocks, E), dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(E)
    _block_histogram_kernel[(num_blocks,)](
        experts, block_counts, A, E, BLOCK_A=BLOCK_A, E_PAD=e_pad, num_warps=NUM_WARPS
    )
    inclusive = block_counts.cumsum(0, dtype=torch.int32)
    block_prefix = inclusive - block_counts
    counts = inclusive[-1]
    if capacity is None:
        kept = counts
        cap = torch.full((E,), A, dtype=torch.int32, device=device)
    else:
        kept = counts.clamp(max=capacity)
        cap = torch.full((E,), capacity, dtype=torch.int32, device=device)
    expert_start = kept.cumsum(0, dtype=torch.int32) - kept
    _assign_rows_kernel[(num_blocks,)](
        experts, block_prefix, expert_start, cap, row_of_assignment, assignment_of_row,
        A, T, E, TOP_K=k, BLOCK_A=BLOCK_A, num_warps=NUM_WARPS,
    )
    return row_of_assignment, assignment_of_row, kept.to(torch.int32)


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
