"""The router's GEMMs at fp32 accuracy on bf16 tensor cores (``MoEConfig.router_gemm="split"``).

An fp32 value is exactly the sum of three bf16 values (hi = bf16(v), mid = bf16(v − hi),
lo = bf16(v − hi − mid)): bf16 keeps fp32's exponent range, and each piece takes the next 8+
bits of the 24-bit significand. A product of two bf16 pieces is exact in fp32, so a GEMM over
the pieces, accumulated in fp32, would give the fp32 GEMM's result up to the order of its fp32
sums. The tensor cores' fp32 accumulation keeps fewer bits, so the result is somewhat less exact
than the fp32 GEMM's, but still about three orders of magnitude below bf16's rounding.

:func:`split_mm` computes ``a @ b`` where either operand is bf16 (one piece) or fp32 split
into ``PIECES`` bf16 pieces, summing the products of pieces ``(i, j)`` with
``i + j < max(PIECES_A, PIECES_B)``: the terms down to 2^-16–2^-24 of the leading one. The fp32
operand is always the small one (the router's weight, E × N, or the logits' gradient, T × E).
Split in registers, every program of the GEMM splits it again at every reduction step, which at
64–128-wide tiles costs about as much as the dots; so a large GEMM first splits it once into a
bf16 stack (one small launch), and a small one (decode) splits in registers, saving the launch.

* logits ``x (T, N) bf16 @ Wᵀ``, W (E, N) fp32 in 3 pieces: the fp32 GEMM's logits;
* ``dW = gᵀ x``, g (T, E) fp32 in 3 pieces: the fp32 GEMM's weight gradient;
* ``dx = g @ W``, both in 2 pieces (hi·hi + hi·mid + mid·hi, ~2^-16 relative): far below the
  bf16 rounding of dx.

Tile sizes follow the output (a router has 8–512 experts): they shrink, and then the reduction is
split, where the output's tiles alone would leave SMs idle: see :func:`_plan`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interlace.kernels import alloc
from interlace.kernels.launch import cdiv, launch, next_power_of_2, sm_count

CPU_PROGRAMS = 8  # the interpreter's "SMs": few enough that tests split the reduction too


@triton.jit
def _piece(v, i: tl.constexpr, PIECES: tl.constexpr, DOT_FP32: tl.constexpr):
    """Piece ``i`` of ``v`` as a dot operand: v itself for a bf16 operand (PIECES = 1), else of
    its fp32 split hi, mid, lo (round to nearest even). bf16, or the same values in fp32 with
    ``DOT_FP32`` (the interpreter, whose bf16 dot is not a product of values; the persistent
    kernel's router calls it so too)."""
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
        p = p.to(tl.float32)
    return p


@triton.jit
def _split_pieces_kernel(src_ptr, dst_ptr, n, PIECES: tl.constexpr, BLOCK: tl.constexpr):
    """dst (PIECES, n) bf16 ← the pieces of src (n,) fp32 (flat, contiguous)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(src_ptr + offs, mask=mask, other=0.0)
    for i in tl.static_range(PIECES):
        tl.store(dst_ptr + i * n + offs, _piece(v, i, PIECES, False), mask=mask)


@triton.jit
def _load_pieces(at, mask, stride_p, PIECES: tl.constexpr, STACKED: tl.constexpr):
    """An operand's tile as its (up to) three bf16 pieces (unused ones repeat the first)."""
    if STACKED:
        p0 = tl.load(at, mask=mask, other=0.0)
        p1 = p0
        p2 = p0
        if PIECES > 1:
            p1 = tl.load(at + stride_p, mask=mask, other=0.0)
        if PIECES > 2:
            p2 = tl.load(at + 2 * stride_p, mask=mask, other=0.0)
    else:
        v = tl.load(at, mask=mask, other=0.0)
        p0 = _piece(v, 0, PIECES, False)
        p1 = p0
        p2 = p0
        if PIECES > 1:
            p1 = _piece(v, 1, PIECES, False)
        if PIECES > 2:
            p2 = _piece(v, 2, PIECES, False)
    return p0, p1, p2


@triton.jit
def _pick(p0, p1, p2, i: tl.constexpr, DOT_FP32: tl.constexpr):
    """Piece ``i`` of (p0, p1, p2) as a dot operand: bf16, or the same values in fp32 with
    ``DOT_FP32`` (the interpreter, whose bf16 dot is not a product of values)."""
    if i == 0:
        p = p0
    elif i == 1:
        p = p1
    else:
        p = p2
    if DOT_FP32:
        p = p.to(tl.float32)
    return p


@triton.jit
def _split_mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, K_PER, stride_ap, stride_am, stride_ak, stride_bp, stride_bk,
                     stride_bn, stride_cs, stride_cm, stride_cn, PIECES_A: tl.constexpr, PIECES_B: tl.constexpr,
                     STACKED_A: tl.constexpr, STACKED_B: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr = False):
    """c (M, N) = a (M, K) @ b (K, N) over bf16 pieces, fp32 accumulation; one tile per program.
    An operand is bf16 (one piece), fp32 split in registers, or (``STACKED_*``) a bf16 stack of
    its pieces (piece p at ``p · stride_*p``).
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
        a_at = a_ptr + rows.to(tl.int64)[:, None] * stride_am + kk[None, :] * stride_ak
        a_mask = rmask[:, None] & kmask[None, :]
        b_at = b_ptr + kk.to(tl.int64)[:, None] * stride_bk + cols[None, :] * stride_bn
        b_mask = kmask[:, None] & cmask[None, :]
        a0, a1, a2 = _load_pieces(a_at, a_mask, stride_ap, PIECES_A, STACKED_A)
        b0, b1, b2 = _load_pieces(b_at, b_mask, stride_bp, PIECES_B, STACKED_B)
        # smallest terms first, into one fp32 accumulator
        for t in tl.static_range(TERMS - 1, -1, -1):
            for i in tl.static_range(0, PIECES_A):
                if t - i >= 0:
                    if t - i < PIECES_B:
                        acc = tl.dot(_pick(a0, a1, a2, i, DOT_FP32), _pick(b0, b1, b2, t - i, DOT_FP32), acc,
                                     input_precision="ieee")
    out = c_ptr + pid_s.to(tl.int64) * stride_cs + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    if c_ptr.dtype.element_ty == tl.float32:
        tl.store(out, acc, mask=rmask[:, None] & cmask[None, :])
    else:  # (dx, bf16)
        tl.store(out, acc.to(c_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=rmask[:, None] & cmask[None, :])


# Where a GEMM does at least this much work (M·N·K), its fp32 operands are split once before it
# (H200, against the split in registers on the same tiles: dsv3-like's logits at 4096 tokens
# 158 -> 92 µs, qwen3-30b-a3b's at 16384 135 -> 64);
# below, the extra launch (host time too, in an eager call) costs about what the split saves.
PRESPLIT_MIN_WORK = 1 << 32
MIN_BLOCK = 64  # a tile's smallest side where the output is large (a warpgroup MMA's rows)


def _plan(M: int, N: int, K: int, programs: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, splits of K) for ``programs`` SMs: 128-wide tiles,
    narrower where the output is. Where the reduction is at least 4× the output's rows (dW = gᵀx:
    an E × N output summed over T tokens, or a few tokens' logits) and the output's tiles alone
    would leave SMs idle, the reduction is split (fp32 partials, at least 4 steps each) to about
    two programs per SM. Otherwise (the logits at many tokens, T × E over N: 32 tiles of
    128 × 128 at 4096 tokens and 128 experts), the tiles are halved, down to 64, until they fill
    the SMs once; split partials cost more there (101 against 74 µs at qwen3-30b-a3b's 8192 tokens)."""
    block_n = max(16, min(128, next_power_of_2(N)))
    block_m = max(16, min(128, next_power_of_2(M)))
    block_k = 64

    def tiles():
        return cdiv(M, block_m) * cdiv(N, block_n)

    splits = 1
    if K >= 4 * M:
        if tiles() < 2 * programs:
            splits = max(1, min(cdiv(K, 4 * block_k), cdiv(2 * programs, tiles())))
    else:
        while tiles() < programs and max(block_m, block_n) > MIN_BLOCK:
            if block_m >= block_n:
                block_m //= 2
            else:
                block_n //= 2
    return block_m, block_n, block_k, 8 if block_m * block_n >= 128 * 128 else 4, splits


def split_pieces(t: torch.Tensor, pieces: int) -> torch.Tensor:
    """fp32 ``t`` (R, C) as a (pieces, R, C) bf16 stack of its pieces (:func:`split_bf16`'s
    values, rounded to nearest even), one launch; each piece has ``t``'s layout where ``t`` or
    its transpose is contiguous (a transposed weight stays a transposed view)."""
    transposed = not t.is_contiguous() and t.t().is_contiguous()
    src = t.t() if transposed else t.contiguous()
    out = alloc.empty((pieces, *src.shape), torch.bfloat16, t.device)
    n = src.numel()
    if n:
        block = 1024
        launch(_split_pieces_kernel, (cdiv(n, block),), src, out, n, PIECES=pieces, BLOCK=block, num_warps=4)
    return out.transpose(1, 2) if transposed else out


def _operand(t: torch.Tensor, pieces: int, stacked: bool) -> tuple[torch.Tensor, int]:
    """A dot operand as (its piece stack, or the tensor itself; the piece stride)."""
    if not stacked:
        return t, 0
    stack = split_pieces(t, pieces)
    return stack, stack.stride(0)


def split_mm(a: torch.Tensor, b: torch.Tensor, pieces_a: int, pieces_b: int, out_dtype: torch.dtype,
             presplit: bool | None = None) -> torch.Tensor:
    """``a (M, K) @ b (K, N)`` over bf16 pieces (module docstring): an operand with 1 piece is
    bf16, one with 2 or 3 pieces is fp32. The fp32 operands are split into bf16 piece stacks
    first (one small launch each) where the GEMM is large (``presplit``: by default where
    M·N·K ≥ ``PRESPLIT_MIN_WORK``), else in registers. Any strides (transposed views need no copy).
    Returns a new (M, N) tensor of ``out_dtype``. Where the output has too few tiles to fill the
    GPU, the tiles shrink, then the reduction is split: fp32 partials, then their sum in a fixed
    order (deterministic)."""
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
    programs = sm_count(a.device) if a.is_cuda else CPU_PROGRAMS
    block_m, block_n, block_k, warps, splits = _plan(M, N, K, programs)
    k_per = cdiv(cdiv(K, splits), block_k) * block_k
    splits = cdiv(K, k_per)
    c = alloc.empty((splits, M, N) if splits > 1 else (M, N), torch.float32 if splits > 1 else out_dtype, a.device)
    stacked = (presplit if presplit is not None else M * N * K >= PRESPLIT_MIN_WORK)
    stacked_a, stacked_b = stacked and pieces_a > 1, stacked and pieces_b > 1
    ap, stride_ap = _operand(a, pieces_a, stacked_a)
    bp, stride_bp = _operand(b, pieces_b, stacked_b)
    launch(_split_mm_kernel, (cdiv(M, block_m), cdiv(N, block_n), splits),
        ap, bp, c, M, N, K, k_per, stride_ap, ap.stride(-2), ap.stride(-1), stride_bp, bp.stride(-2), bp.stride(-1),
        M * N if splits > 1 else 0, c.stride(-2), c.stride(-1), PIECES_A=pieces_a, PIECES_B=pieces_b,
        STACKED_A=stacked_a, STACKED_B=stacked_b, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=not a.is_cuda, num_warps=warps, num_stages=3,
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
