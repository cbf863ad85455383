"""The persistent MoE kernel's task list (world size 1) and a torch reference of its index math
(for tests); the state layout and error records are :mod:`interlace.kernels.persistent.protocol`'s.

One launch runs five kinds of task, numbered so that every task depends only on tasks with
smaller numbers (see :mod:`interlace.kernels.persistent.kernel` for why that cannot deadlock):

=========  =====================================  ==========================================
kind       count (static upper bound, from T)     waits for
=========  =====================================  ==========================================
gate       ``G = ceil(T / BLOCK_T)``              nothing
index      1                                      every gate task (a counter reaches G)
GEMM0      ``max_tiles · ceil(K / BLOCK_K0)``     the index (a flag reaches the call's epoch)
GEMM1      ``max_tiles · ceil(N / BLOCK_N1)``     the index; its row tile's GEMM0 tasks
combine    ``ceil(T / BLOCK_TC) · ceil(N / BLOCK_NC)``  the index; every GEMM1 task of a real tile
=========  =====================================  ==========================================

``max_tiles = floor((T·k + min(E, T·k)·(BLOCK_M − 1)) / BLOCK_M)`` bounds the row tiles of any
routing: expert e's c_e rows take ``ceil(c_e / BLOCK_M) ≤ (c_e + BLOCK_M − 1) / BLOCK_M`` tiles,
at most min(E, T·k) experts have rows, and the sum of those bounds is at most the above (an
integer). So the host sizes the launch from T alone, without reading the routing back; tasks
past the real tile count exit at once, without signalling anything (at decode the bound is
nearly tight: T = 1, k = 8 gives 8).

GEMM0 and GEMM1 tasks are numbered slice-major, tile-minor (task = slice · max_tiles + tile):
the row tiles of one expert take the same weight slice one after another, so it is read from
HBM once and from L2 by the expert's other tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from interlace.kernels.launch import cdiv
from interlace.kernels.persistent.protocol import kind_starts

# Kinds of the kernel's timeline records (``TIMELINE`` on; :mod:`interlace.kernels.timeline`), by
# index: the five task kinds in task-number order, then "skip" (a GEMM task past the real tile count:
# it takes its number, reads the tile count and exits).
TIMELINE_KINDS = ("gate", "index", "gemm0", "gemm1", "combine", "skip")

# Task orders: "normal" is the only correct one; "combine_first" (tests only) dequeues the
# combine tasks right after the index, before any GEMM task, which must be caught.
TASK_ORDERS = ("normal", "combine_first")


class TaskLayout(NamedTuple):
    """Static task counts of one call (T tokens), from its shape only (no routing); the
    kernel's task-count arguments (:class:`~interlace.kernels.persistent.args.MoeKernelArgs`).

    Attributes: ``n_gate``, ``max_tiles``, ``n_k0`` (GEMM0 K-slices per tile), ``n_n1`` (GEMM1
    N-slices per tile), ``n_comb_t`` × ``n_comb_n`` combine tasks; ``total`` of them all.
    """

    n_gate: int
    max_tiles: int
    n_k0: int
    n_n1: int
    n_comb_t: int
    n_comb_n: int

    @classmethod
    def build(cls, T: int, N: int, K: int, E: int, top_k: int, block_t: int, block_m: int, block_k0: int,
              block_n1: int, block_tc: int, block_nc: int) -> TaskLayout:
        rows = T * top_k
        max_tiles = (rows + min(E, rows) * (block_m - 1)) // block_m
        return cls(n_gate=cdiv(T, block_t), max_tiles=max_tiles, n_k0=cdiv(K, block_k0),
                   n_n1=cdiv(N, block_n1), n_comb_t=cdiv(T, block_tc), n_comb_n=cdiv(N, block_nc))

    @property
    def total(self) -> int:
        """Every task of the call (numbered as the kernel numbers them:
        :func:`~interlace.kernels.persistent.protocol.kind_starts`, no logits, send or receive
        task at world size 1)."""
        return kind_starts.fn(0, self.n_gate, 0, 0, self.max_tiles * self.n_k0, self.max_tiles * self.n_n1,
                              self.n_comb_t * self.n_comb_n)[-1]


def reference_index(topk_idx: torch.Tensor, num_experts: int, block_m: int):
    """What the index task computes, plainly.

    Args:
        topk_idx: (T, k) expert of each assignment (assignment a = t·k + j).
    Returns:
        row_of_assignment (T·k,) int64: the assignment's row in expert-major order (within an
        expert, assignments in order); assignment_of_row (T·k,) its inverse; tiles (3, n_tiles)
        int64: each row tile's expert, first row and its expert's end row.
    """
    flat = topk_idx.reshape(-1).long().cpu()
    counts = torch.bincount(flat, minlength=num_experts)
    ends = counts.cumsum(0)
    starts = ends - counts
    order = torch.argsort(flat, stable=True)  # expert-major, assignments in order within one
    row_of = torch.empty_like(flat)
    row_of[order] = torch.arange(flat.numel())
    tiles = [(e, int(starts[e]) + i * block_m, int(ends[e]))
             for e in range(num_experts) for i in range(cdiv(int(counts[e]), block_m))]
    tiles_t = torch.tensor(tiles, dtype=torch.int64).reshape(-1, 3).t()
    return row_of, order, tiles_t
