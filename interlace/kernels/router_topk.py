"""Fused routing: scores, top-k choice and routing weights of a token block in one kernel.

From router logits (T, E) fp32, ``_route_topk_kernel`` computes the scores (softmax, or
sigmoid for the DeepSeek-V3 router), picks the k best experts per token (by score, plus the
selection bias for sigmoid), gathers their scores as weights, renormalizes and scales them.
It replaces five to seven torch launches (softmax, topk, gather, sum, div, mul) by one, which
matters where the layer is bound by the host's launch rate.

Choice order: slot 0 is the best expert, slot 1 the second, ... (the capacity policy serves
slot 0 first). A NaN score never wins: a token whose scores are all NaN still gets k valid,
distinct experts, and NaN weights, so the NaN stays in that token's output row.

Backward recomputes the weights from the saved logits with torch ops and differentiates
those: the gradient is exactly the plain path's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interlace.kernels import alloc
from interlace.kernels.launch import cdiv, launch, next_power_of_2


@triton.jit
def choice_key(choice, cols, E_PAD: tl.constexpr):
    """(BLOCK_T, E_PAD) int64 keys whose order is the choice order: the fp32 value's bits made
    monotone as a signed integer (sign-magnitude to two's complement) in the high word, ``E_PAD
    − 1 − column`` in the low word, so a row's maximum is its best value and, among equal values,
    the lower expert: one reduction per pick, where a max then a min over ties took two. −0.0
    is made +0.0 first (it must tie with +0.0, as the float comparison does)."""
    bits = (choice + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (E_PAD - 1 - cols[None, :]).to(tl.int64)


@triton.jit
def scores_and_top_k(logits, bias_ptr, tokens, cols, E, scale, TOP_K: tl.constexpr, E_PAD: tl.constexpr,
                     SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):
    """The choice rule (module docstring) on one token block, shared with the persistent kernel's gate.

    Args: logits (BLOCK_T, E_PAD) fp32, -inf past column E; bias_ptr the (E,) fp32 selection
    bias (read with HAS_BIAS); tokens (BLOCK_T,) (rows with tokens < 0 choose nothing); cols
    the (E_PAD,) arange.
    Returns, per (token, column): weights (BLOCK_T, E_PAD) fp32 (renormalized, scaled; used
    where chosen) and slot (BLOCK_T, E_PAD) int32, the pick j that chose the column (0 the
    best) or −1. The callers store (t·k + slot) ← column, weight where slot ≥ 0: no per-pick
    gather, each a reduction over the experts.
    """
    # Rows that choose nothing compute on zeros: their logits (−inf past T) would give
    # −inf − (−inf) in the softmax and 0/0 in the renormalization, NaN that is never stored but
    # that NumPy warns about under the interpreter.
    live = tokens >= 0
    logits = tl.where(live[:, None], logits, 0.0)
    if SOFTMAX:
        row_max = tl.max(logits, axis=1)
        p = tl.where(cols[None, :] < E, tl.exp(logits - row_max[:, None]), 0.0)
        scores = p / tl.sum(p, axis=1)[:, None]
    else:
        scores = tl.sigmoid(logits)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + cols, mask=cols < E, other=0.0)[None, :]
    choice = tl.where(choice != choice, float("-inf"), choice)  # NaN never wins
    free = (cols[None, :] < E) & live[:, None]  # padding columns are never chosen
    key = tl.where(free, choice_key(choice, cols, E_PAD), -(1 << 63))
    slot = tl.full(key.shape, -1, tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        pick = (key == best[:, None]) & free
        slot = tl.where(pick, j, slot)
        key = tl.where(pick, -(1 << 63), key)
    weights = scores
    if RENORMALIZE:
        chosen_sum = tl.sum(tl.where(slot >= 0, weights, 0.0), axis=1)
        weights = weights / tl.where(live, chosen_sum, 1.0)[:, None]
    return weights * scale, slot


@triton.jit
def _route_topk_kernel(
    logits_ptr,  # (T, E) fp32
    bias_ptr,  # (E,) fp32 selection bias (sigmoid router) or dummy
    idx_ptr,  # (T, K) int64, out
    weight_ptr,  # (T, K) fp32, out
    T, E, scale,
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    tmask = tokens < T
    valid = cols[None, :] < E
    logits = tl.load(logits_ptr + tokens[:, None].to(tl.int64) * E + cols[None, :],
                     mask=tmask[:, None] & valid, other=float("-inf")).to(tl.float32)
    weights, slot = scores_and_top_k(logits, bias_ptr, tl.where(tmask, tokens, -1), cols, E, scale, TOP_K, E_PAD,
                                     SOFTMAX, HAS_BIAS, RENORMALIZE)
    out = tokens[:, None].to(tl.int64) * TOP_K + slot
    omask = tmask[:, None] & (slot >= 0)
    tl.store(idx_ptr + out, tl.broadcast_to(cols[None, :], slot.shape).to(tl.int64), mask=omask)
    tl.store(weight_ptr + out, weights, mask=omask)


def route_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, softmax: bool,
               renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) fp32 → (topk_idx (T, k) int64, topk_weight (T, k) fp32). Forward only."""
    T, E = logits.shape
    if not 0 < top_k <= E:
        raise ValueError(f"route_topk: top_k must be in 1..{E} (the logits' experts), got {top_k}")
    logits = logits.contiguous()
    idx = alloc.empty((T, top_k), dtype=torch.int64, device=logits.device)
    weight = alloc.empty((T, top_k), dtype=torch.float32, device=logits.device)
    if T == 0:
        return idx, weight
    e_pad = next_power_of_2(E)
    block_t = max(1, min(128, 4096 // e_pad))
    launch(_route_topk_kernel, (cdiv(T, block_t),),
        logits, bias if bias is not None else logits, idx, weight, T, E, float(scale),
        TOP_K=top_k, E_PAD=e_pad, BLOCK_T=block_t,
        SOFTMAX=softmax, HAS_BIAS=bias is not None, RENORMALIZE=renormalize, num_warps=4,
    )
    return idx, weight


# :func:`route_topk` as an opaque op, for ``torch.compile`` (Dynamo cannot trace the kernel's
# launch): a compiled layer routes exactly as an eager one. Forward only, as :func:`route_topk`;
# the router's autograd Function differentiates around it. Registered with the low-level
# torch.library API (one Python kernel per call; ``torch.library.custom_op``'s wrappers would
# double its host time in a compiled step).
_LIB = torch.library.Library("interlace", "FRAGMENT")
_LIB.define("route_topk(Tensor logits, Tensor? bias, int top_k, bool softmax, bool renormalize, float scale) "
            "-> (Tensor, Tensor)", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.impl("route_topk", route_topk, "CompositeExplicitAutograd")


def _route_topk_fake(logits, bias, top_k, softmax, renormalize, scale):
    T = logits.shape[0]
    return (logits.new_empty((T, top_k), dtype=torch.int64), logits.new_empty((T, top_k), dtype=torch.float32))


torch.library.register_fake("interlace::route_topk", _route_topk_fake, lib=_LIB)
route_topk_op = torch.ops.interlace.route_topk.default
