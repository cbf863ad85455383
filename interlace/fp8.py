"""Block-scaled FP8 expert weights (inference): the format, its quantizers and a plain reference.

The layout is DeepSeek-V3's checkpoints' (and vLLM's, SGLang's, transformers' ``FP8Experts``):
a weight ``W`` (..., R, C) is stored as e4m3 values ``q`` (..., R, C) and one fp32 scale per
128 × 128 block, ``scale_inv`` (..., ⌈R/128⌉, ⌈C/128⌉), with

    W[r, c] ≈ q[r, c] · scale_inv[r // 128, c // 128].

R and C need not be multiples of 128: the last block of a row or column is partial and has a
scale of its own (what DeepSeek's and transformers' quantizers write).

Activations (W8A8): each row of the GEMM's left operand is quantized per group of 128 columns,
``a[m, c] ≈ aq[m, c] · a_scale[m, c // 128]`` with ``a_scale = amax(|group|) / 448`` (1 for an
all-zero group), so a GEMM's k step of 128 columns meets one activation scale per row and one
weight scale per output column: ``Σ_blocks (aq · qᵀ)_block · a_scale · scale_inv``, fp32
accumulation. A row's NaN stays in its row (its group's amax is NaN, no other row's is).

:func:`expert_ffn_fp8_reference` is the expert FFN of this arithmetic in fp32 on expert-major
rows: the reference the FP8 kernels are checked against (it counts no quantization error that
the kernels do not also make), and the CPU path where Triton does not run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from interlace.kernels.activation import activation_reference

FP8_BLOCK = 128
"""Rows and columns of one weight scale block, and columns of one activation scale group."""
E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn value: a group's amax maps to it."""
FP8_DTYPE = torch.float8_e4m3fn


def blocks(n: int) -> int:
    """Scale blocks along a dimension of ``n``: ⌈n / 128⌉."""
    return -(-n // FP8_BLOCK)


@dataclass(frozen=True)
class BlockFP8Weight:
    """A block-scaled FP8 weight: ``weight`` (..., R, C) float8_e4m3fn and ``scale_inv``
    (..., ⌈R/128⌉, ⌈C/128⌉) float32 on the same device (the checkpoints' names).

    What the experts module hands a strategy in place of a dense weight. ``shape`` is the
    weight's, so shape checks read the same as for a dense one.
    """

    weight: torch.Tensor
    scale_inv: torch.Tensor

    def __post_init__(self) -> None:
        check_block_fp8(self.weight, self.scale_inv)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight (..., R, C) in ``dtype``: ``q · scale_inv`` per block, computed in fp32."""
        return dequantize_weight(self.weight, self.scale_inv).to(dtype)


def packed_scale_offset(C: int) -> int:
    """Byte offset of the scales in a packed row of C columns (:class:`QuantizedRows`)."""
    return -(-C // 16) * 16


def packed_row_bytes(C: int) -> int:
    """Bytes of one packed row of C columns: C e4m3 values and ⌈C/128⌉ fp32 scales, each part
    padded to 16 bytes (hidden 7168: 7392 bytes, against 14336 in bf16)."""
    return packed_scale_offset(C) + -(-4 * blocks(C) // 16) * 16


@dataclass(frozen=True)
class QuantizedRows:
    """Activation rows already quantized, W8A8's left operand, packed: ``packed`` (M,
    packed_row_bytes(cols) / 4) int32, each row its ``cols`` e4m3 values, then (from byte
    :func:`packed_scale_offset`) its ⌈cols/128⌉ fp32 scales, :func:`quantize_rows`'s pair. One
    buffer, so one row gather and one all-to-all move both; the kernels read the two parts
    through typed pointers into it (no views made per call). ``dtype``: the activations' own
    dtype, which an FFN's output takes.

    What ``sequential`` sends over the wire for FP8 experts: a token's row quantized once where it
    lives, half the bytes of bf16, and the receiving GEMMs take it as it comes."""

    packed: torch.Tensor
    cols: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        p = self.packed
        if p.dtype != torch.int32 or p.dim() != 2 or p.shape[1] * 4 != packed_row_bytes(self.cols) or (
                p.shape[0] and p.stride(1) != 1):
            raise ValueError(f"QuantizedRows of {self.cols} columns: packed rows are (M, "
                             f"{packed_row_bytes(self.cols) // 4}) int32 with unit column stride, got "
                             f"{tuple(p.shape)} {p.dtype}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.cols))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def q(self) -> torch.Tensor:
        """The e4m3 values (M, cols): a view into ``packed``."""
        return self.packed.view(FP8_DTYPE)[:, :self.cols]

    @property
    def scale(self) -> torch.Tensor:
        """The scales (M, ⌈cols/128⌉) fp32: a view into ``packed``."""
        s0 = packed_scale_offset(self.cols) // 4
        return self.packed.view(torch.float32)[:, s0:s0 + blocks(self.cols)]

    def take(self, index: torch.Tensor) -> "QuantizedRows":
        """The rows ``index`` (int tensor)."""
        return QuantizedRows(self.packed[index.long()], self.cols, self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The rows in fp32: ``q · scale`` per group."""
        return dequantize_rows(self.q, self.scale)


def check_fp8_ffn_slice(ffn_slice: tuple[int, int], ffn: int) -> None:
    """``ValueError`` unless the tensor-parallel slice ``[lo, hi)`` of the FFN dimension K of FP8
    experts is whole 128-wide scale blocks: the full K, or (equal slices over tp ranks) K % (128·tp)
    == 0. Then a rank's slice of ``w_up`` (SwiGLU: gate rows [lo, hi), up rows [K+lo, K+hi)) and of
    ``w_down``'s columns holds whole blocks of the full weight with their own scales, and the
    activation's 128-column groups are the full layer's: the slice's W8A8 arithmetic is exactly the
    full layer's, its partial down projections sum to the full FFN."""
    lo, hi = ffn_slice
    if (lo, hi) == (0, ffn) or not (lo % FP8_BLOCK or hi % FP8_BLOCK or ffn % FP8_BLOCK):
        return
    width = hi - lo
    tp = f"tp={ffn // width}" if width > 0 and ffn % width == 0 else "the tensor-parallel size"
    raise ValueError(f"FP8 experts over a tensor-parallel group need each rank's slice of the FFN dimension to be "
                     f"whole {FP8_BLOCK}-wide scale blocks, K % ({FP8_BLOCK} * tp) == 0: K={ffn} at {tp} gives "
                     f"the slice [{lo}, {hi}), which cuts the {FP8_BLOCK}x{FP8_BLOCK} blocks (use a tp that "
                     f"divides K / {FP8_BLOCK}, or tp=1)")


def check_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, name: str = "weight") -> None:
    """``ValueError``/``TypeError`` unless ``weight`` is float8_e4m3fn (..., R, C) and
    ``scale_inv`` fp32 (..., ⌈R/128⌉, ⌈C/128⌉) on the same device."""
    if weight.dtype != FP8_DTYPE:
        raise TypeError(f"FP8 {name} must be torch.float8_e4m3fn, got {weight.dtype}")
    if scale_inv.dtype != torch.float32:
        raise TypeError(f"{name}'s block scales must be float32, got {scale_inv.dtype} (ue8m0 scales: convert "
                        f"them to float32 first)")
    if weight.dim() < 2:
        raise ValueError(f"FP8 {name} must have at least 2 dims (..., R, C), got shape {tuple(weight.shape)}")
    want = (*weight.shape[:-2], blocks(weight.shape[-2]), blocks(weight.shape[-1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}'s block scales have shape {tuple(scale_inv.shape)}; a weight of shape "
                         f"{tuple(weight.shape)} in {FP8_BLOCK}x{FP8_BLOCK} blocks needs {want}")
    if weight.device != scale_inv.device:
        raise ValueError(f"FP8 {name} is on {weight.device} and its scales on {scale_inv.device}")


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(..., ⌈R/128⌉, ⌈C/128⌉) → (..., R, C): each block's scale on each of its elements."""
    return scale.repeat_interleave(FP8_BLOCK, dim=-2)[..., :rows, :].repeat_interleave(FP8_BLOCK, dim=-1)[..., :cols]


def dequantize_weight(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 (..., R, C) = ``weight · scale_inv`` per 128 × 128 block."""
    check_block_fp8(weight, scale_inv)
    return weight.float() * _expand_blocks(scale_inv, weight.shape[-2], weight.shape[-1])


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 → float8_e4m3fn, round to nearest even, finite values saturated at ±448 (Hopper's
    ``cvt.rn.satfinite``; a plain cast would turn |x| > 464 into NaN). NaN stays NaN."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def quantize_weight(w: torch.Tensor) -> BlockFP8Weight:
    """A dense weight (..., R, C) → :class:`BlockFP8Weight` with one scale per 128 × 128 block:
    ``scale_inv = amax(|block|) / 448`` (1 for an all-zero block), ``q = e4m3(w / scale_inv)``."""
    if not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise TypeError(f"quantize_weight takes a dense floating-point weight, got {w.dtype}")
    R, C = w.shape[-2:]
    lead = w.shape[:-2]
    rb, cb = blocks(R), blocks(C)
    padded = torch.zeros(*lead, rb * FP8_BLOCK, cb * FP8_BLOCK, dtype=torch.float32, device=w.device)
    padded[..., :R, :C] = w.float()
    tiles = padded.view(*lead, rb, FP8_BLOCK, cb, FP8_BLOCK)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = to_e4m3(w.float() / _expand_blocks(scale, R, C))
    return BlockFP8Weight(q.contiguous(), scale.contiguous())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations (M, C) → (q (M, C) float8_e4m3fn, scale (M, ⌈C/128⌉) fp32), per row and group
    of 128 columns: ``scale = amax(|group|) / 448`` (1 for an all-zero group), ``q = e4m3(x / scale)``.
    The kernels' quantizer computes exactly this (IEEE division, round to nearest even)."""
    M, C = x.shape
    g = blocks(C)
    padded = torch.zeros(M, g * FP8_BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :C] = x.float()
    amax = padded.view(M, g, FP8_BLOCK).abs().amax(dim=-1)
    amax = torch.where(torch.isnan(padded.view(M, g, FP8_BLOCK)).any(dim=-1), torch.nan, amax)
    # (a tensor divisor: CUDA torch divides by a Python number as a product with its reciprocal,
    # one ulp off the kernels' IEEE division)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, E4M3_MAX))
    q = to_e4m3(x.float() / scale.repeat_interleave(FP8_BLOCK, dim=-1)[:, :C])
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 (M, C) from :func:`quantize_rows`'s output."""
    return q.float() * scale.repeat_interleave(FP8_BLOCK, dim=-1)[:, :q.shape[1]]


def expert_ffn_fp8_reference(x: torch.Tensor | QuantizedRows, w_up: BlockFP8Weight, w_down: BlockFP8Weight,
                             ends: torch.Tensor, activation: str, out_dtype: torch.dtype | None = None,
                             act: tuple[torch.Tensor, torch.Tensor] | None = None, return_act: bool = False):
    """The W8A8 expert FFN on expert-major rows, in fp32: x (M, N) → (M, N) in ``out_dtype``
    (default x's dtype). ``x`` may come quantized already (:class:`QuantizedRows`: taken as it is).

    Rows of expert e are ``[ends[e-1], ends[e])`` (``ends`` inclusive cumulative counts, (E,)).
    The rows are quantized per 128-column group (:func:`quantize_rows`); GEMM0 runs in fp32 on
    the dequantized operands, the activation in fp32, its output is quantized again, and GEMM1
    runs like GEMM0: exactly the roundings the FP8 kernels make, with fp32 sums.

    ``act``: the quantized activation (q (M, K), scale (M, ⌈K/128⌉)) GEMM1 takes instead of its
    own (to check a kernel's GEMM1 on the kernel's GEMM0 output); ``return_act``: return
    (out, (q, scale)) with the activation GEMM1 used.
    """
    xq = x.dequantize() if isinstance(x, QuantizedRows) else dequantize_rows(*quantize_rows(x))
    up = w_up.dequantize()
    down = w_down.dequantize()
    K = down.shape[2]
    out = torch.empty(x.shape[0], down.shape[1], dtype=out_dtype or x.dtype, device=x.device)
    if act is None:
        act_q = torch.empty(x.shape[0], K, dtype=FP8_DTYPE, device=x.device)
        act_scale = torch.empty(x.shape[0], blocks(K), dtype=torch.float32, device=x.device)
    else:
        act_q, act_scale = act
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            if act is None:
                h = activation_reference(xq[start:end] @ up[e].t(), activation)
                act_q[start:end], act_scale[start:end] = quantize_rows(h)
            h = dequantize_rows(act_q[start:end], act_scale[start:end])
            out[start:end] = (h @ down[e].t()).to(out.dtype)
        start = end
    return (out, (act_q, act_scale)) if return_act else out


def act_agreement(got: tuple[torch.Tensor, torch.Tensor],
                  want: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """(fraction of values more than half an e4m3 step apart, largest difference in units of
    the larger group scale) between two quantized activations (q, scale) of the same rows: the
    measure of a kernel's GEMM0 against the reference.

    On Hopper the FP8 tensor cores sum a k block's 128 products with about 1e-4 relative error,
    so a value near an e4m3 rounding boundary may round to its neighbour, one step away (the
    step of a code v is 2^(⌊log2 |v|⌋ − 3), 2^-9 for subnormals; at most 32 for codes of
    256-448), and a group's scale (amax / 448) moves a little. A right kernel shows a few
    percent of values one step apart and no difference above 32 units of its group's scale; a
    wrong one shows many. NaNs must agree."""
    qa, qb = got[0].float(), want[0].float()
    cols = qa.shape[1]
    sa = got[1].repeat_interleave(FP8_BLOCK, dim=-1)[:, :cols]
    sb = want[1].repeat_interleave(FP8_BLOCK, dim=-1)[:, :cols]
    a, b = qa * sa, qb * sb
    if not torch.equal(a.isnan(), b.isnan()):
        return 1.0, float("inf")
    keep = ~a.isnan() & ((a != 0) | (b != 0))
    if not keep.any():
        return 0.0, 0.0
    diff = (a - b).abs()[keep]
    scale = torch.maximum(sa, sb)[keep]
    code = torch.maximum(qa.abs(), qb.abs())[keep]
    step = torch.exp2(torch.floor(torch.log2(code)).clamp_min(-6) - 3) * scale
    return (diff > 0.5 * step).float().sum().item() / a.numel(), (diff / scale).max().item()
