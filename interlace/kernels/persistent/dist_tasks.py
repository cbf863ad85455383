"""Task list, state layout, symmetric regions and error records of the persistent MoE kernel
at world size W > 1 (:mod:`interlace.kernels.persistent.dist_kernel`).

One launch per rank runs seven kinds of task, in this number order on every rank:

=========  ======================================  ============================================
kind       count (static upper bound)              waits for
=========  ======================================  ============================================
logits     ``ceil(T / BLOCK_T) · ceil(E / BLOCK_E)  nothing (token block × expert block × column
           · S``                                   part: S parts of the router GEMM's sum)
gate       ``G = ceil(T / BLOCK_TK)``              every logits task (a counter reaches n_logits)
index      1                                       this rank's gate tasks (a counter reaches G)
send       ``max(1, ceil(T / BLOCK_S)) · n_ns``    this rank's index (a flag reaches the epoch)
receive    ``W`` (one per source rank)             every send task of source s, counted (s's
                                                   dispatch flag in this rank's table reaches
                                                   the epoch); the last receive task also
                                                   builds the tile table
GEMM0      ``MT · n_k0``                           the tile table (a flag reaches the epoch)
GEMM1      ``MT · n_n1``                           the tile table; the tile's GEMM0 tasks
combine    ``max(1, ceil(T / BLOCK_TC)) · n_nc``   each owner's last GEMM1 task (or its tile
                                                   table, when it got no rows at all)
=========  ======================================  ============================================

A row tile holds rows of ONE local expert from ALL sources (expert l's rows, source 0's slots
first, then source 1's, ...): each touched expert's weights are read once per call, not once
per source that sent it rows (at decode the layer is a stream of weights, and tiles per
(source, expert) read them W times).

``MT`` bounds the row tiles that all sources' rows to this rank's ``E_loc`` experts make:
each source sends at most ``max_tokens · min(k, E_loc)`` rows here (a token picks an expert at
most once), so ``R = W · max_tokens · min(k, E_loc)``, and c rows of one expert take
``ceil(c / BLOCK_M)`` tiles, so ``MT = floor((R + min(E_loc, R) · (BLOCK_M − 1)) / BLOCK_M)``.
GEMM tasks are numbered tile-major, then slice (the slices of one tile run side by side): the
tiles past the real count are the tail of the kind's range, and the first task that finds
itself there moves the queue past it at once (``atomic_max``): one skip per kind.

Symmetric regions of one rank (identical layout on every rank; peers write into them)::

    recv    (W, max_tokens, N)         token rows sent here: [source][its token]; a token row
                                       crosses once per owner it chose an expert of, however
                                       many of that owner's experts it chose (this rank's own
                                       tokens are read from its input, never copied)
    amap    (W, E_loc, max_tokens) int32  [source][local expert][slot] = the source's
                                       assignment a = t·k + j that the slot holds
    ret     (max_tokens · k, N)        expert outputs returned here: [this rank's assignment a],
                                       written by a's owner
    counts  (W, E_loc) int32           rows per (source, local expert), written by the source
    sent    (W,) int32                 dispatch flags: [source] = the source's epoch, after rows,
                                       map and counts
    done    (W,) int32                 return flags: [owner] = the owner's epoch, after the rows
                                       it returned here

A slot is the assignment's rank among its source's assignments to that expert (the index task
computes it from the gate's per-block histograms), so sources never write the same address and
no count exchange precedes the rows. An owner gathers a tile's rows through ``amap`` (source s,
expert l, slot → token a // k of s) and returns each output row to ``ret[a]`` of its source.
Local state: one int32 tensor per rank, never shared, laid out as at world size 1
(:mod:`interlace.kernels.persistent.protocol`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from interlace.kernels.launch import cdiv
from interlace.kernels.persistent.protocol import Kind, kind_starts

LOGITS, GATE, INDEX, SEND, RECEIVE, GEMM0, GEMM1, COMBINE = Kind
KINDS = tuple(kind.name.lower() for kind in Kind)
# Kinds of the kernel's timeline records (``TIMELINE`` on; :mod:`interlace.kernels.timeline`), by
# index: the task kinds above, then "skip" (the GEMM task that finds itself past the real row
# tiles and moves the queue past the rest of its kind's range; the tasks jumped over have no record).
SKIP = len(KINDS)
TIMELINE_KINDS = KINDS + ("skip",)
# Phases of the simulated and staged transports: every rank runs a phase before any rank runs
# the next (the producer-before-consumer order one GPU launch gets from its waits).
PHASES = ((LOGITS, SEND), (RECEIVE, GEMM1), (COMBINE, COMBINE))


def max_tiles(world: int, max_tokens: int, top_k: int, num_local: int, block_m: int) -> int:
    """``MT``: row tiles all sources' rows can make on one rank (see the module)."""
    rows = world * max_tokens * min(top_k, num_local)
    return (rows + min(num_local, rows) * (block_m - 1)) // block_m


@dataclass(frozen=True)
class DistLayout:
    """Static task counts of one rank's call (T tokens here, sized by ``max_tokens`` for what
    peers send), from shapes only. ``first(kind)`` is the kind's first task number."""

    world: int
    n_logits: int
    n_gate: int
    n_send: int
    mt: int
    n_k0: int
    n_n1: int
    n_comb_t: int
    n_comb_n: int

    @classmethod
    def build(cls, T: int, N: int, K: int, world: int, num_local: int, top_k: int, max_tokens: int, *, block_t: int,
              block_tk: int, block_e: int, block_s: int, block_ns: int, block_m: int, block_k0: int, block_n1: int,
              block_tc: int, block_nc: int, num_experts: int, logits_splits: int = 1,
              comb_slices: int = 1) -> DistLayout:
        """``comb_slices``: BLOCK_NC column slices per combine task (``n_comb_n`` tasks per token
        block)."""
        return cls(world=world, n_logits=cdiv(T, block_t) * cdiv(num_experts, block_e) * logits_splits,
                   n_gate=cdiv(T, block_tk),
                   n_send=max(1, cdiv(T, block_s)) * cdiv(N, block_ns),
                   mt=max_tiles(world, max_tokens, top_k, num_local, block_m), n_k0=cdiv(K, block_k0),
                   n_n1=cdiv(N, block_n1), n_comb_t=max(1, cdiv(T, block_tc)),
                   n_comb_n=cdiv(cdiv(N, block_nc), comb_slices))

    def counts(self) -> tuple[int, ...]:
        """Tasks of each kind, in kind order."""
        return (self.n_logits, self.n_gate, 1, self.n_send, self.world, self.n_k0 * self.mt, self.n_n1 * self.mt,
                self.n_comb_t * self.n_comb_n)

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """The first task number of each kind, in kind order, then the total (as the kernel
        numbers them: :func:`~interlace.kernels.persistent.protocol.kind_starts`)."""
        n_logits, n_gate, _, n_send, n_receive, n_gemm0, n_gemm1, n_combine = self.counts()
        return (0, *kind_starts.fn(n_logits, n_gate, n_send, n_receive, n_gemm0, n_gemm1, n_combine))

    def first(self, kind: int) -> int:
        return self.starts[kind]

    @property
    def total(self) -> int:
        return self.starts[-1]

    def task_range(self, phase: tuple[int, int] | None = None) -> tuple[int, int]:
        """[lo, hi) task numbers of kinds ``phase`` = (first kind, last kind); None: every task
        (the one-launch call)."""
        if phase is None:
            return 0, self.total
        lo_kind, hi_kind = phase
        return self.first(lo_kind), self.first(hi_kind + 1)
