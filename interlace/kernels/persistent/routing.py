"""The router's and the index's device code that the persistent kernels of both world sizes
share: the gate's logits (a token block's fp32 router GEMM), their rounding, the choice rule
(top-k, weights, each assignment's rank within its block) and the row-tile table.
"""

from __future__ import annotations

import triton
import triton.language as tl

from interlace.kernels.router_gemm import _piece
from interlace.kernels.router_topk import scores_and_top_k


@triton.jit
def gate_logits(x_ptr, rw_ptr, tokens, tmask, cols, emask, N, n_lo, n_hi, BLOCK_T: tl.constexpr,
                BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr, W_PIECES: tl.constexpr, DOT_FP32: tl.constexpr,
                ROUND_LOGITS: tl.constexpr):
    """(BLOCK_T, BLOCK_C) fp32 logits x[tokens] (·, N) @ W_r[cols] (·, N)ᵀ (bf16 x: W_r's W_PIECES
    bf16 pieces as ``router_gemm`` "split" (3) or "input" (1); else an fp32 dot); 0 where masked.
    ROUND_LOGITS 1 / 2: the fp32 sums rounded to bf16 / fp16 (a router whose logits come from a
    GEMM in that dtype, as a transformers model in bf16 computes them: fp32 sums, rounded once).
    ``n_lo``, ``n_hi``: the part of the sum over columns [n_lo, n_hi) (0, N: all of it)."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_G):
        nn = n0 + tl.arange(0, BLOCK_G)
        nmask = nn < n_hi
        a = tl.load(x_ptr + tokens[:, None].to(tl.int64) * N + nn[None, :], mask=tmask[:, None] & nmask[None, :],
                    other=0.0)
        w = tl.load(rw_ptr + cols[None, :].to(tl.int64) * N + nn[:, None], mask=emask[None, :] & nmask[:, None],
                    other=0.0).to(tl.float32)  # (BLOCK_G, BLOCK_C): W_rᵀ
        if W_PIECES == 0:
            acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
        else:
            ab = _piece(a, 0, 1, DOT_FP32)
            for i in tl.static_range(W_PIECES):
                acc = tl.dot(ab, _piece(w, i, 3, DOT_FP32), acc)
    return round_logits(acc, ROUND_LOGITS)


@triton.jit
def round_logits(acc, ROUND_LOGITS: tl.constexpr):
    """fp32 logit sums rounded to bf16 (1) or fp16 (2), as values in fp32; 0: unchanged."""
    if ROUND_LOGITS == 1:
        acc = acc.to(tl.bfloat16).to(tl.float32)
    elif ROUND_LOGITS == 2:
        acc = acc.to(tl.float16).to(tl.float32)
    return acc


@triton.jit
def gate_choice(logits, g, tokens, tmask, bias_ptr, idx_ptr, wt_ptr, lrank_ptr, hist_ptr, E, scale, n_gate,
                TOP_K: tl.constexpr, E_PAD: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
                RENORMALIZE: tl.constexpr, CAPACITY: tl.constexpr = False):
    """The choice rule of :mod:`interlace.kernels.router_topk` (slot 0 the best; NaN never wins;
    ties to the lower expert) on a token block's logits (BLOCK_T, E_PAD) fp32 (−inf past E).
    Writes idx/weight/rank per assignment a = t·k + j, and the block's histogram hist[g, :].

    CAPACITY (a capacity factor: experts served slot-major, MoEConfig.capacity_factor): a
    histogram per pick, hist[j·n_gate + g, :], and each assignment's rank among the block's
    assignments of its expert with the same pick j; the index's running sum over those rows in
    that order (pick-major) is the policy's order."""
    cols = tl.arange(0, E_PAD)
    weights, slot = scores_and_top_k(logits, bias_ptr, tl.where(tmask, tokens, -1), cols, E, scale, TOP_K, E_PAD,
                                     SOFTMAX, HAS_BIAS, RENORMALIZE)
    chosen = (slot >= 0).to(tl.int32)
    if CAPACITY:
        before = tl.zeros(slot.shape, dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            pick = (slot == j).to(tl.int32)
            before = tl.where(slot == j, tl.cumsum(pick, axis=0) - pick, before)
            tl.store(hist_ptr + (j * n_gate + g) * E_PAD + cols, tl.sum(pick, axis=0))
    else:
        # Rank of (t, j) among the block's assignments of its expert, in assignment order t·k + j:
        # a token picks k distinct experts, so it is the number of earlier tokens that picked it.
        before = tl.cumsum(chosen, axis=0) - chosen
        tl.store(hist_ptr + g * E_PAD + cols, tl.sum(chosen, axis=0))
    a = tokens[:, None].to(tl.int64) * TOP_K + slot
    tl.store(idx_ptr + a, tl.broadcast_to(cols[None, :], slot.shape), mask=slot >= 0)
    tl.store(lrank_ptr + a, before, mask=slot >= 0)
    tl.store(wt_ptr + a, weights, mask=slot >= 0)


@triton.jit
def store_tile_table(tiles_ptr, stride, rows, starts, experts, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr):
    """The row-tile table of experts with ``rows`` rows each (vectors over the experts; expert
    ``experts[i]``'s rows start at row ``starts[i]``), BLOCK_M rows a tile, in expert order:
    tiles_ptr[j], [stride + j], [2·stride + j] = expert, first row, end row of tile j. Returns
    the number of tiles (shared with the W > 1 kernel's table)."""
    n_tiles_e = (rows + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(n_tiles_e, axis=0)
    tile_beg = tile_end - n_tiles_e
    n_tiles = tl.sum(n_tiles_e, axis=0)
    for j0 in range(0, n_tiles, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        inside = (j[:, None] >= tile_beg[None, :]) & (j[:, None] < tile_end[None, :])  # at most one expert
        expert = tl.sum(tl.where(inside, experts[None, :], 0), axis=1)
        first = tl.sum(tl.where(inside, starts[None, :] + (j[:, None] - tile_beg[None, :]) * BLOCK_M, 0), axis=1)
        end = tl.sum(tl.where(inside, (starts + rows)[None, :], 0), axis=1)
        jmask = j < n_tiles
        tl.store(tiles_ptr + j, expert, mask=jmask)
        tl.store(tiles_ptr + stride + j, first, mask=jmask)
        tl.store(tiles_ptr + 2 * stride + j, end, mask=jmask)
    return n_tiles
