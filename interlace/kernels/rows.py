"""Row movement for dispatch and combine: gathers and the deterministic weighted combine.

Shapes: T tokens, k slots per token, N hidden, R dispatch rows (R ≤ T·k; fewer when
capacity drops assignments). ``row_of_assignment`` (T, k) int32 gives each assignment's row
or -1; ``assignment_of_row`` (R,) int32 gives each row's flat assignment index ``t*k + j``.

Kernels (one idea each):
    _gather_rows_kernel:      out[i] = x[index[i]]                       (copy)
    _region_rows_kernel:      out[base[s] + i] = x[s·cap + i], or x[index[i]] into one region,
                              for the first used[s] rows of each region s only (copy; base[s]
                              = s·cap, or the first row of region s packed)
    _combine_rows_kernel:     out[t] = Σ_j w[t,j] · y[row[t,j]]          (fp32 accumulate,
                              fixed j order: deterministic, no atomics)
    _combine_backward_kernel: dy[row[t,j]] = w[t,j] · dout[t];
                              dw[t,j] = <dout[t], y[row[t,j]]>

Every launcher falls back to plain torch when the tensors are on the CPU and Triton's
interpreter is off, so the layer also runs on a machine with no Triton backend.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from interlace.kernels import alloc
from interlace.kernels.launch import cdiv, launch, next_power_of_2

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Tuning: a program moves a (rows × block_n(N)) tile at a time, its rows in one load. On a GPU a
# gather program takes 4 rows (1024 columns with 4 warps: 32 bf16 elements a thread in flight)
# and a combine program one token (8 elements a thread, one program per token keeps decode-sized
# calls spread over the SMs). Triton's interpreter runs each of a program's ops as one NumPy call
# over the whole tile, so there a program takes 64 rows or tokens: the same values (every
# element is computed alone, in the same order), a fraction of the interpreter's per-op cost.
GATHER_ROWS = 64 if _INTERPRET else 4
COMBINE_TOKENS = 64 if _INTERPRET else 1
BLOCK_N = 1024
NUM_WARPS = 4


def block_n(N: int) -> int:
    """Columns a program moves at a time: BLOCK_N, or N's power of two below it (a row of 64
    columns is not moved as 1024 masked ones)."""
    return min(BLOCK_N, next_power_of_2(N))


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    return t.is_cuda or _INTERPRET


@triton.jit
def _gather_rows_kernel(x_ptr, index_ptr, out_ptr, R, N, divisor, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < R
    src = (tl.load(index_ptr + r, mask=live, other=0) // divisor).to(tl.int64)
    dst = r.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(0, N, BLOCK_N):
        c = n0 + cols
        m = live[:, None] & (c < N)[None, :]
        v = tl.load(x_ptr + src[:, None] * N + c[None, :], mask=m)
        tl.store(out_ptr + dst[:, None] * N + c[None, :], v, mask=m)


def gather_rows(x: torch.Tensor, index: torch.Tensor, divisor: int = 1) -> torch.Tensor:
    """``out[i] = x[index[i] // divisor]`` for a (M, N) contiguous x and an int32 (R,) index.

    ``divisor=k`` turns flat assignment indices ``t*k + j`` into token indices in place.
    """
    R, N = index.numel(), x.shape[1]
    out = alloc.empty((R, N), dtype=x.dtype, device=x.device)
    if R == 0 or N == 0:
        return out
    if not use_triton(x):
        return torch.index_select(x, 0, torch.div(index.long(), divisor, rounding_mode="floor"), out=out)
    launch(_gather_rows_kernel, (cdiv(R, GATHER_ROWS),),
        x, index, out, R, N, divisor, ROWS=GATHER_ROWS, BLOCK_N=block_n(N), num_warps=NUM_WARPS
    )
    return out


@triton.jit
def _region_rows_kernel(x_ptr, index_ptr, used_ptr, out_ptr, out_base_ptr, cap, N, divisor, first, skip,
                        GATHER: tl.constexpr, OUT_BASE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    s = tl.program_id(1) + first  # the region
    if s != skip:
        used = tl.load(used_ptr + s)
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = r < used
        src = s.to(tl.int64) * cap + r
        if GATHER:
            src = (tl.load(index_ptr + r, mask=live, other=0) // divisor).to(tl.int64)
        dst = s.to(tl.int64) * cap + r
        if OUT_BASE:
            dst = tl.load(out_base_ptr + s).to(tl.int64) + r
        cols = tl.arange(0, BLOCK_N)
        for n0 in range(0, N, BLOCK_N):
            c = n0 + cols
            m = live[:, None] & (c < N)[None, :]
            v = tl.load(x_ptr + src[:, None] * N + c[None, :], mask=m)
            tl.store(out_ptr + dst[:, None] * N + c[None, :], v, mask=m)


def copy_used_rows(x: torch.Tensor, out: torch.Tensor, used: torch.Tensor, skip: int = -1,
                   base: torch.Tensor | None = None) -> torch.Tensor:
    """``out[base[s] + i] = x[s·cap + i]`` for the first ``used[s]`` rows of each region s ≠
    ``skip`` of a (W·cap, N) buffer; ``used`` (W,) int32 on the device: no host sync (a
    capacity-sized region that is half used copies half). ``base`` (W,) int32 (default s·cap:
    ``out`` laid out as ``x``) places region s's rows in ``out`` (the regions packed: the
    exclusive prefix sum of ``used``). Region ``skip`` is not written; with the default base the
    rows past ``used[s]`` are unspecified (the kernel leaves them as they are, the torch fallback
    copies them too)."""
    W = used.numel()
    cap, N = x.shape[0] // max(W, 1), x.shape[1]
    if cap == 0 or N == 0:
        return out
    if not use_triton(x):
        starts = None if base is None else base.tolist()  # (the plain-torch path may sync)
        counts = used.tolist() if base is not None else [cap] * W
        for s in range(W):
            if s != skip:
                dst = s * cap if starts is None else starts[s]
                out[dst:dst + counts[s]] = x[s * cap:s * cap + counts[s]]
        return out
    launch(_region_rows_kernel, (cdiv(cap, GATHER_ROWS), W),
        x, used, used, out, used if base is None else base, cap, N, 1, 0, skip, GATHER=False,
        OUT_BASE=base is not None, ROWS=GATHER_ROWS, BLOCK_N=block_n(N), num_warps=NUM_WARPS
    )
    return out


def gather_used_rows(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor, used: torch.Tensor, region: int,
                     divisor: int = 1, base: torch.Tensor | None = None) -> torch.Tensor:
    """``out[base[region] + i] = x[index[i] // divisor]`` for the first ``used[region]`` rows of
    region ``region`` (cap = ``index.numel()``, ``used`` (W,) int32 on the device; ``base`` (W,)
    int32 as in :func:`copy_used_rows`, default s·cap: ``out`` is (W·cap, N)); no other region is
    written, and with the default base the rows past the used ones are unspecified (as in
    :func:`copy_used_rows`). Entries of ``index`` past the used rows are never read."""
    cap, N = index.numel(), out.shape[1]
    if cap == 0 or N == 0 or x.shape[0] == 0:  # (no rows: none used)
        return out
    if not use_triton(out):
        src = torch.div(index.long(), divisor, rounding_mode="floor").clamp_(0, x.shape[0] - 1)
        if base is None:
            out[region * cap:(region + 1) * cap] = x[src]
        else:  # (the plain-torch path may sync)
            dst, n = int(base[region]), int(used[region])
            out[dst:dst + n] = x[src[:n]]
        return out
    launch(_region_rows_kernel, (cdiv(cap, GATHER_ROWS), 1),
        x, index, used, out, used if base is None else base, cap, N, divisor, region, -1, GATHER=True,
        OUT_BASE=base is not None, ROWS=GATHER_ROWS, BLOCK_N=block_n(N), num_warps=NUM_WARPS
    )
    return out


@triton.jit
def _combine_rows_kernel(
    y_ptr, row_ptr, w_ptr, out_ptr, T, N,
    TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    live = t < T
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(0, N, BLOCK_N):
        c = n0 + cols
        acc = tl.zeros((TOKENS, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            row = tl.load(row_ptr + t * TOP_K + j, mask=live, other=-1)
            kept = (row >= 0)[:, None]
            m = kept & (c < N)[None, :]
            v = tl.load(y_ptr + row.to(tl.int64)[:, None] * N + c[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                v = v * tl.load(w_ptr + t * TOP_K + j, mask=live, other=0.0).to(tl.float32)[:, None]
            acc = tl.where(kept, acc + v, acc)  # (a dropped slot adds nothing, not even a zero)
        tl.store(out_ptr + t[:, None] * N + c[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & (c < N)[None, :])


def combine_rows(
    y: torch.Tensor, row_of_assignment: torch.Tensor, weights: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """``out[t] = Σ_j w[t,j] · y[row[t,j]]`` (rows -1 skipped; w = 1 if None), fp32 accumulate.

    y: (R, N); row_of_assignment: (T, k) int32; weights: (T, k) or None → (T, N) out_dtype.
    """
    T, k = row_of_assignment.shape
    N = y.shape[1]
    out = alloc.empty((T, N), dtype=out_dtype, device=y.device)
    if T == 0 or N == 0:
        return out
    if not use_triton(y):
        rows = row_of_assignment.long()
        kept = (rows >= 0).unsqueeze(-1)
        picked = y[rows.clamp(min=0)].float() * kept
        if weights is not None:
            picked = picked * weights.float().unsqueeze(-1)
        return picked.sum(1).to(out_dtype)
    w = weights.contiguous() if weights is not None else row_of_assignment  # dummy pointer when unused
    launch(_combine_rows_kernel, (cdiv(T, COMBINE_TOKENS),),
        y, row_of_assignment, w, out, T, N,
        TOP_K=k, HAS_WEIGHTS=weights is not None, TOKENS=COMBINE_TOKENS, BLOCK_N=block_n(N), num_warps=NUM_WARPS,
    )
    return out


@triton.jit
def _combine_backward_kernel(
    dout_ptr, y_ptr, row_ptr, w_ptr, dy_ptr, dw_ptr, T, N,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    live = t < T
    cols = tl.arange(0, BLOCK_N)
    slots = tl.arange(0, K_PAD)
    dw = tl.zeros((TOKENS, K_PAD), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        c = n0 + cols
        g = tl.load(dout_ptr + t[:, None] * N + c[None, :], mask=live[:, None] & (c < N)[None, :],
                    other=0.0).to(tl.float32)
        for j in tl.static_range(TOP_K):
            row = tl.load(row_ptr + t * TOP_K + j, mask=live, other=-1)
            kept = row >= 0
            m = kept[:, None] & (c < N)[None, :]
            at = row.to(tl.int64)[:, None] * N + c[None, :]
            v = tl.load(y_ptr + at, mask=m, other=0.0).to(tl.float32)  # (before the store: it need not wait behind it)
            w = tl.load(w_ptr + t * TOP_K + j, mask=kept, other=0.0).to(tl.float32)
            tl.store(dy_ptr + at, (g * w[:, None]).to(dy_ptr.dtype.element_ty), mask=m)
            dw += tl.where((slots[None, :] == j) & kept[:, None], tl.sum(g * v, axis=1)[:, None], 0.0)
    tl.store(dw_ptr + t[:, None] * TOP_K + slots[None, :], dw.to(dw_ptr.dtype.element_ty),
             mask=live[:, None] & (slots < TOP_K)[None, :])


def combine_rows_backward(
    grad_out: torch.Tensor, y: torch.Tensor, row_of_assignment: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`combine_rows` with weights: ``(dy (R, N) y.dtype, dw (T, k) w.dtype)``.

    Every kept row belongs to exactly one assignment, so each dy row is written once.
    """
    T, k = row_of_assignment.shape
    R, N = y.shape
    dy = alloc.empty(y.shape, y.dtype, y.device)
    dw = alloc.empty((T, k), dtype=weights.dtype, device=weights.device)
    if T == 0:
        return dy, dw
    grad_out = grad_out.contiguous()
    if not use_triton(y):
        rows = row_of_assignment.long()
        kept = rows >= 0
        g = grad_out.float()
        picked = y[rows.clamp(min=0)].float()
        dw.copy_(((picked * g.unsqueeze(1)).sum(-1) * kept))
        flat_rows = rows[kept]
        contrib = (g.unsqueeze(1) * weights.float().unsqueeze(-1)).expand(T, k, N)[kept]
        dy[flat_rows] = contrib.to(dy.dtype)
        return dy, dw
    launch(_combine_backward_kernel, (cdiv(T, COMBINE_TOKENS),),
        grad_out, y, row_of_assignment, weights.contiguous(), dy, dw, T, N,
        TOP_K=k, K_PAD=next_power_of_2(k), TOKENS=COMBINE_TOKENS, BLOCK_N=block_n(N), num_warps=NUM_WARPS,
    )
    return dy, dw


# ----------------------------------------------------------------------------- autograd
class DispatchRows(torch.autograd.Function):
    """x (T, N) → x_send (R, N), row r holding token ``assignment_of_row[r] // k``.

    Backward sums each token's k row gradients with :func:`combine_rows` (no atomics).
    """

    @staticmethod
    def forward(ctx, x, assignment_of_row, row_of_assignment):
        ctx.save_for_backward(row_of_assignment)
        ctx.x_dtype = x.dtype
        return gather_rows(x, assignment_of_row, divisor=row_of_assignment.shape[1])

    @staticmethod
    def backward(ctx, grad):
        (row_of_assignment,) = ctx.saved_tensors
        return combine_rows(grad.contiguous(), row_of_assignment, None, ctx.x_dtype), None, None


class PermuteRows(torch.autograd.Function):
    """A bijective row permutation ``out[i] = x[index[i]]``; backward uses ``inverse``."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return gather_rows(x, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return gather_rows(grad.contiguous(), inverse), None, None


class CombineRows(torch.autograd.Function):
    """y (R, N), weights (T, k) → (T, N): the weighted top-k reduction, fp32 inside."""

    @staticmethod
    def forward(ctx, y, weights, row_of_assignment, out_dtype):
        ctx.save_for_backward(y, weights, row_of_assignment)
        return combine_rows(y, row_of_assignment, weights, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        y, weights, row_of_assignment = ctx.saved_tensors
        dy, dw = combine_rows_backward(grad, y, row_of_assignment, weights)
        return dy, dw, None, None
