"""The router's GEMMs at fp32 accuracy on bf16 tensor cores (``MoEConfig.router_gemm="split"``).

An fp32 value is exactly the sum of three bf16 values (hi = bf16(v), mid = bf16(v − hi),
lo = bf16(v − hi − mid)): bf16 keeps fp32's exponent range, and each piece takes the next 8+
bits of the 24-bit significand. A product of two bf16 pieces is exact in fp32, so a GEMM over
the pieces, accumulated in fp32, would give the fp32 GEMM's result up to the order of its fp32
sums. The tensor cores' fp32 accumulation keeps fewer bits, so the result is somewhat less exact
than the fp32 GEMM's, but still about three orders of magnitude below bf16's rounding.

:func:`split_mm` computes ``a @ b`` where either operand is bf16 (one piece) or fp32 split
*in registers* into ``PIECES`` bf16 pieces, summing the products of pieces ``(i, j)`` with
``i + j < max(PIECES_A, PIECES_B)``: the terms down to 2^-16–2^-24 of the leading one. One
launch, no split copy of either operand in memory:

* logits ``x (T, N) bf16 @ Wᵀ``, W (E, N) fp32 in 3 pieces: the fp32 GEMM's logits;
* ``dW = gᵀ x``, g (T, E) fp32 in 3 pieces: the fp32 GEMM's weight gradient;
* ``dx = g @ W``, both in 2 pieces (hi·hi + hi·mid + mid·hi, ~2^-16 relative): far below the
  bf16 rounding of dx.

Tile sizes follow the output (a router has 8–512 experts), and the reduction is split where the
output alone would leave SMs idle: see :func:`_plan`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interlace.kernels import alloc
from interlace.kernels.launch import cdiv, launch, next_power_of_2, sm_count

CPU_PROGRAMS = 8  # the interpreter's "GPU": enough programs that tests split the reduction too


@triton.jit
def _piece(v, i: tl.constexpr, PIECES: tl.constexpr, DOT_FP32: tl.constexpr):
    """Piece ``i`` of ``v`` as a dot operand: v itself for a bf16 operand (PIECES = 1), else
    of its fp32 split hi, mid, lo (round to nearest even). bf16, or the same values in fp32
    with ``DOT_FP32`` (the interpreter, whose bf16 dot is not a product of values)."""
    if PIECES == 1:
        p = v.to(tl.bfloat16)
    else:
        hi = v.to(tl.bfloat16, fp_downcast_rounding="rtne")
        if i == 0:
            p = hi
        else:
            rest = v - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16, fp_downcast_rounding="rtne")
            if i == 1:
                p = mid
            else:
                p = (rest - mid.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
    if DOT_FP32:
        return p.to(tl.float32)
    else:
        return p


@triton.jit
def _split_mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, K_PER, stride_am, stride_ak, stride_bk, stride_bn, stride_cs,
                     stride_cm, stride_cn, PIECES_A: tl.constexpr, PIECES_B: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr = False):
    """c (M, N) = a (M, K) @ b (K, N) over bf16 pieces, fp32 accumulation; one tile per program.
    Program (·, ·, s) sums the reduction range [s·K_PER, (s + 1)·K_PER) into c's plane s
    (``stride_cs``: split-K partials, which the launcher adds up)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rmask = rows < M
    cmask = cols < N
    TERMS: tl.constexpr = PIECES_A if PIECES_A > PIECES_B else PIECES_B
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.minimum(K, (pid_s + 1) * K_PER)
    for k0 in range(pid_s * K_PER, k_end, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < k_end
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr + kk.to(tl.int64)[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=kmask[:, None] & cmask[None, :], other=0.0)
        # smallest terms first, into one fp32 accumulator
        for t in tl.static_range(TERMS - 1, -1, -1):
            for i in tl.static_range(0, PIECES_A):
                if t - i >= 0:
                    if t - i < PIECES_B:
                        acc = tl.dot(_piece(a, i, PIECES_A, DOT_FP32), _piece(b, t - i, PIECES_B, DOT_FP32), acc,
                                     input_precision="ieee")
    out = c_ptr + pid_s.to(tl.int64) * stride_cs + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    if c_ptr.dtype.element_ty == tl.float32:
        tl.store(out, acc, mask=rmask[:, None] & cmask[None, :])
    else:  # (dx, bf16)
        tl.store(out, acc.to(c_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=rmask[:, None] & cmask[None, :])


def _plan(M: int, N: int, K: int, programs: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, splits of K) for about ``programs`` programs: 128-wide
    tiles, narrower where the output is; the reduction split where it is at least 4× the output's
    rows and the output's tiles alone would leave SMs idle (dW = gᵀx: an E × N output summed over T
    tokens, else a handful of programs each running over every token), each split at least 4
    steps. (The logits, T × E over N, are not split: on H200 their partials cost more than the
    idle SMs, 101 against 74 µs at qwen3-30b-a3b's 8192 tokens.)"""
    block_n = max(16, min(128, next_power_of_2(N)))
    block_m = max(16, min(128, next_power_of_2(M)))
    block_k = 64
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    splits = 1
    if K >= 4 * M and tiles < programs:
        splits = max(1, min(cdiv(K, 4 * block_k), cdiv(programs, tiles)))
    return block_m, block_n, block_k, 8 if block_m * block_n >= 128 * 128 else 4, splits


def split_mm(a: torch.Tensor, b: torch.Tensor, pieces_a: int, pieces_b: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (M, K) @ b (K, N)`` over bf16 pieces (module docstring): an operand with 1 piece is
    bf16, one with 2 or 3 pieces is fp32. Any strides (transposed views need no copy).
    Returns a new (M, N) tensor of ``out_dtype``. Where the output has too few tiles to fill the
    GPU, the reduction is split: fp32 partials, then their sum in a fixed order (deterministic)."""
    for t, p in ((a, pieces_a), (b, pieces_b)):
        want = torch.bfloat16 if p == 1 else torch.float32
        if t.dtype != want or p not in (1, 2, 3):
            raise ValueError(f"split_mm: a {p}-piece operand must be {want}, got {t.dtype}")
    M, K = a.shape
    N = b.shape[1]
    if b.shape[0] != K:
        raise ValueError(f"split_mm: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not chain")
    if M == 0 or N == 0:
        return alloc.empty((M, N), out_dtype, a.device)
    if K == 0:
        return alloc.empty((M, N), out_dtype, a.device).zero_()
    programs = 2 * sm_count(a.device) if a.is_cuda else CPU_PROGRAMS
    block_m, block_n, block_k, warps, splits = _plan(M, N, K, programs)
    k_per = cdiv(cdiv(K, splits), block_k) * block_k
    splits = cdiv(K, k_per)
    c = alloc.empty((splits, M, N) if splits > 1 else (M, N), torch.float32 if splits > 1 else out_dtype, a.device)
    launch(_split_mm_kernel, (cdiv(M, block_m), cdiv(N, block_n), splits),
        a, b, c, M, N, K, k_per, a.stride(0), a.stride(1), b.stride(0), b.stride(1), M * N if splits > 1 else 0,
        c.stride(-2), c.stride(-1), PIECES_A=pieces_a, PIECES_B=pieces_b, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_FP32=not a.is_cuda, num_warps=warps, num_stages=3,
    )
    return c.sum(0).to(out_dtype) if splits > 1 else c


# :func:`split_mm` as an opaque op, for ``torch.compile`` (Dynamo cannot trace a Triton launch
# through :func:`interlace.kernels.launch.launch`); eager callers call :func:`split_mm` itself. Not
# differentiable by itself: the router's autograd Function calls it in its forward and backward.
# Registered with the low-level torch.library API (one Python kernel: a compiled step calls it
# three times per layer, and ``torch.library.custom_op``'s wrappers would double its host time).
_LIB = torch.library.Library("interlace", "FRAGMENT")
_LIB.define("split_mm(Tensor a, Tensor b, int pieces_a, int pieces_b, ScalarType out_dtype) -> Tensor",
            tags=(torch.Tag.pt2_compliant_tag,))
_LIB.impl("split_mm", split_mm, "CompositeExplicitAutograd")


def _split_mm_fake(a, b, pieces_a, pieces_b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


torch.library.register_fake("interlace::split_mm", _split_mm_fake, lib=_LIB)
split_mm_op = torch.ops.interlace.split_mm.default


def split_bf16(t: torch.Tensor, pieces: int = 3) -> torch.Tensor:
    """fp32 ``t`` as ``pieces`` bf16 pieces stacked on a new first dim (hi, mid, lo; with 3,
    ``t == hi + mid + lo`` exactly: only residuals below ~1e-38 are lost, and values past
    bf16's largest, 3.39e38, round to inf). The plain-torch twin of the kernel's split."""
    out, rest = [], t
    for _ in range(pieces):
        out.append(rest.to(torch.bfloat16))
        rest = rest - out[-1].float()
    return torch.stack(out)


def split_mm_reference(a: torch.Tensor, b: torch.Tensor, pieces_a: int, pieces_b: int,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`split_mm` in plain torch (the same products of pieces, each an fp32 matmul of
    exact bf16 values, summed smallest first): CPU without the Triton interpreter."""
    pa = a[None] if pieces_a == 1 else split_bf16(a, pieces_a)
    pb = b[None] if pieces_b == 1 else split_bf16(b, pieces_b)
    terms = max(pieces_a, pieces_b)
    acc = None
    for t in range(terms - 1, -1, -1):
        for i in range(pieces_a):
            if 0 <= t - i < pieces_b:
                term = pa[i].float() @ pb[t - i].float()
                acc = term if acc is None else acc + term
    return acc.to(out_dtype)
