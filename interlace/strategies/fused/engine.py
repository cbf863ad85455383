"""``FusedEngine``: the fused layer of one rank over one :class:`~interlace.parallel.PeerBuffer`.

It owns what one call needs between the routing and the output: the dispatch index, the
device-side plan (:mod:`interlace.kernels.comet.plan`), the activation buffer, and the launches
of layer0 (:mod:`interlace.kernels.comet.layer0`: dispatch → GEMM0) and layer1
(:mod:`interlace.kernels.comet.layer1`: GEMM1 → combine), each either as one launch (GPUs) or
as its two program roles launched separately (simulated ranks, the staged transport).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from interlace.kernels import alloc
from interlace.kernels.comet.flags import describe_error
from interlace.kernels.comet.layer0 import dispatch_gemm0
from interlace.kernels.comet.layer1 import gemm1_combine
from interlace.kernels.comet.plan import build_plan
from interlace.kernels.routing_index import build_dispatch_index
from interlace.kernels.rows import _INTERPRET
from interlace.kernels.timeline import CLOCK_GPU, CLOCK_LOGICAL, TimelineBuffer, layer_capacities
from interlace.parallel.peer_buffer import PeerBuffer
from interlace.strategies.fused.options import DEFAULT_SPINS, FusedKernelConfig


def default_split(num_programs: int) -> tuple[int, int]:
    """Untuned (n_comm, n_comm1): about 1/8 of the programs move data. ``interlace tune`` measures."""
    n = max(1, num_programs // 8)
    return n, n


@dataclass
class FusedCall:
    """One rank's state of one call between the kernel phases (device tensors)."""

    x: torch.Tensor  # (T, N) tokens (the backward: the weighted output-gradient rows)
    topk_weight: torch.Tensor  # (T, k)
    row_of_assignment: torch.Tensor  # (T·k,) dispatch row of each assignment t·k + j, -1 if dropped
    assignment_of_row: torch.Tensor  # (R,) assignment of each dispatch row
    plan: object  # FusedPlan
    h: torch.Tensor  # (W·cap, K) layer0's output, layer1's input (fused:lean: (R, K), packed at h_base)
    out: torch.Tensor  # (T, N)
    kept: torch.Tensor | None = None  # (E,) rows kept per expert (the staged return exchange)
    h_base: torch.Tensor | None = None  # (W,) int32 first row of h of each source's rows (None: s·cap)


class FusedEngine:
    """The fused layer of one rank over one :class:`PeerBuffer` (any transport).

    :meth:`prepare` → :meth:`layer0` → :meth:`layer1`; each layer takes ``role`` ``"all"``
    (one launch, GPU) or runs its two program roles as separate launches (``"comm"``,
    ``"gemm"``): simulated ranks in one process and the staged transport call those in
    producer-before-consumer order across ranks.
    """

    def __init__(self, cfg, buf: PeerBuffer, kernel: FusedKernelConfig, n_programs: int, n_comm: int,
                 n_comm1: int, max_spins: int = DEFAULT_SPINS, timeline: bool = False):
        self.cfg, self.buf, self.kernel = cfg, buf, kernel
        self.n_programs, self.n_comm, self.n_comm1, self.max_spins = n_programs, n_comm, n_comm1, max_spins
        # ---- timeline (opt-in): per-work-item records, see interlace.kernels.timeline ----
        device = buf.epoch.device
        self.timeline = TimelineBuffer(device, CLOCK_GPU if device.type == "cuda" and not _INTERPRET
                                       else CLOCK_LOGICAL) if timeline else None

    def _timeline_args(self, call: FusedCall, layer: int):
        if self.timeline is None:
            return None
        n_blocks0 = -(-call.h.shape[1] // self.kernel.block_n)
        self.timeline.ensure(*layer_capacities(call.plan, n_blocks0, self.buf.spec.num_slices, call.out.shape[0],
                                               self.kernel.block_t))
        return self.timeline.args(layer)

    def timeline_records(self) -> list[dict]:
        """Records of this rank's last call (host sync); see :meth:`TimelineBuffer.records`."""
        if self.timeline is None:
            raise RuntimeError("the timeline is off: build the strategy with timeline=True")
        return self.timeline.records(int(self.buf.epoch.item()))

    def dispatch_index(self, topk_idx: torch.Tensor):
        """The counting sort of the routing (T, k): see :func:`build_dispatch_index`."""
        cfg = self.cfg
        T = topk_idx.shape[0]
        if T > self.buf.spec.max_tokens:
            raise ValueError(f"{T} tokens exceed the fused buffers' max_tokens={self.buf.spec.max_tokens}; "
                             f"build the strategy with strategy_options={{'max_tokens': ...}}")
        return build_dispatch_index(topk_idx, cfg.num_experts, cfg.capacity(T))

    def prepare(self, x, topk_weight, index, counts_all, h: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> FusedCall:
        """Plan and buffers of a call; ``counts_all`` (W, E) int32 is every rank's ``kept``;
        ``h`` (W·cap, K): layer0's output buffer, ``out`` (T, N) the layer's (default new ones)."""
        row_of_assignment, assignment_of_row, _, _ = index
        spec = self.buf.spec
        plan = build_plan(counts_all, self.buf.rank, spec.num_local, spec.max_tokens, spec.top_k, spec.block_m,
                          interleave=self.kernel.interleave0_args())
        if h is None:
            h = alloc.empty((spec.world * spec.cap, self.cfg.ffn), x.dtype, x.device)
        out = alloc.empty(x.shape, x.dtype, x.device) if out is None else out
        return FusedCall(x, topk_weight.contiguous(), row_of_assignment, assignment_of_row, plan, h, out, index[2])

    def layer0(self, call: FusedCall, w_up: torch.Tensor, role: str = "all", pre: torch.Tensor | None = None,
               backward: bool = False) -> None:
        """Forward: h = act(x rows @ W_upᵀ) (and the pre-activation into ``pre``). Backward
        (``call.x`` the weighted output-gradient rows, ``w_up`` = W_down): h = rows @ W_down."""
        dispatch_gemm0(call.x, call.assignment_of_row, w_up, call.h, self.buf, call.plan,
                       activation="none" if backward else self.cfg.activation, n_comm=self.n_comm,
                       n_programs=self.n_programs, config=self.kernel, max_spins=self.max_spins, role=role,
                       timeline=self._timeline_args(call, 0), pre=pre, w_kmajor=backward, h_base=call.h_base)

    def layer1(self, call: FusedCall, w_down: torch.Tensor, role: str = "all", backward: bool = False) -> None:
        """Forward: out = combine(h @ W_downᵀ). Backward (``call.h`` = d_h, ``w_down`` = W_up,
        weights 1): out = Σ_j (d_h @ W_up)[row(t, j)] = dx."""
        gemm1_combine(call.h, w_down, call.out, call.topk_weight, call.row_of_assignment, self.buf, call.plan,
                      n_comm=self.n_comm1, n_programs=self.n_programs, config=self.kernel,
                      max_spins=self.max_spins, role=role, timeline=self._timeline_args(call, 1), w_kmajor=backward,
                      h_base=call.h_base)


def run_simulated(engines: list[FusedEngine], xs, topk_idxs, topk_weights, w_ups, w_downs) -> list[torch.Tensor]:
    """All ranks of a simulated world (one process), each phase of every rank before the next."""
    indices = [eng.dispatch_index(t) for eng, t in zip(engines, topk_idxs)]
    counts_all = torch.stack([ix[2] for ix in indices]).to(torch.int32)
    for eng in engines:
        eng.buf.advance_epoch()
    calls = [eng.prepare(x, w, ix, counts_all) for eng, x, w, ix in zip(engines, xs, topk_weights, indices)]
    for layer, role in (("layer0", "comm"), ("layer0", "gemm"), ("layer1", "gemm"), ("layer1", "comm")):
        for eng, call, wu, wd in zip(engines, calls, w_ups, w_downs):
            if layer == "layer0":
                eng.layer0(call, wu, role)
            else:
                eng.layer1(call, wd, role)
    for eng in engines:
        check_error_record(eng.buf)
    return [c.out for c in calls]


def check_error_record(buf: PeerBuffer) -> None:
    """Raise if a wait of this rank timed out (reads the record: a host sync)."""
    message = describe_error(buf.error.tolist())
    if message:
        buf.error.zero_()
        raise RuntimeError(message)
