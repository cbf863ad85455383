"""``sequential``: the strong non-overlapped path.

Counting sort on the device (``build_dispatch_index``), one gather kernel to build the send
buffer, the count exchange and **the forward's one host sync** (NCCL needs split sizes on the
host), ``all_to_all_single`` (FP8 experts: of the token rows quantized where they live, e4m3 and
their scales), a re-layout gather from [source rank][expert] to
[expert][source rank] order, grouped GEMMs with the SwiGLU fused between them (gate and up are
one GEMM; the kernel reads both halves in place), the inverse re-layout, the reverse
all-to-all, and a deterministic fp32 gather-reduce combine (no atomics, forward or backward).

At world size 1 there is no communication and, dropless, no host sync at all.

Options (``MoELayer(..., strategy="sequential", strategy_options={...})``):

* ``expert_backend``: ``"torch"`` (``torch._grouped_mm``, the default) or ``"triton"``
  (interlace's grouped GEMMs; the spelling ``"sequential:triton"`` says the same);
* ``kernels``: an :class:`~interlace.kernels.expert_gemm.configs.ExpertKernelOptions` for the
  Triton backend (configs and TMA; default: the tuning tables' choice);
* ``fp8_backend``: for FP8 experts, ``"auto"`` (default), ``"triton"`` (no host sync: what a
  captured decode step needs) or ``"blockwise"`` (cuBLAS per expert):
  :func:`~interlace.kernels.expert_gemm.fp8.expert_ffn_fp8`.
"""

from __future__ import annotations

import itertools

import torch

from interlace.parallel.comm import all_to_all, all_to_all_counts
from interlace.kernels.expert_gemm.autograd import TritonExpertFFN, supports
from interlace.kernels.expert_gemm.configs import ExpertKernelOptions
from interlace.kernels.expert_gemm.fp8 import FP8_BACKENDS, expert_ffn_fp8
from interlace.kernels.activation import activation_fused
from interlace.kernels.expert_gemm.torch_grouped_mm import grouped_mm
from interlace.fp8 import BlockFP8Weight, QuantizedRows
from interlace.kernels.routing_index import build_dispatch_index, expert_major_index
from interlace.kernels.expert_gemm.fp8_quant import quantize_rows_packed
from interlace.kernels.rows import CombineRows, DispatchRows, PermuteRows, gather_rows
from interlace.strategies.base import Strategy, register_strategy


def expert_ffn(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, offs: torch.Tensor, activation: str):
    """Grouped expert FFN on expert-major rows: x (M, N) → (M, N)."""
    act = activation_fused(grouped_mm(x, w_up, offs), activation)
    return grouped_mm(act, w_down, offs)


EXPERT_BACKENDS = ("torch", "triton")


def gathered_expert_ffn(backend: str, x, src_row, inverse, num_rows: int, w_up, w_down, offs, activation,
                        kernels: ExpertKernelOptions | None = None):
    """Expert FFN of rows ``x[src_row[q]]`` (expert-major order) → (num_rows, N), dense weights
    (FP8 experts take :func:`~interlace.kernels.expert_gemm.fp8.expert_ffn_fp8`).

    ``torch``: a gather kernel, then torch._grouped_mm + SwiGLU kernel + torch._grouped_mm.
    ``triton``: interlace's grouped GEMMs with the gather fused into the first one's A load
    (``kernels``: their options).
    """
    if backend == "triton" and supports(x, w_up):
        return TritonExpertFFN.apply(x, w_up, w_down, src_row, 1, num_rows, offs, activation, inverse, kernels)
    return expert_ffn(PermuteRows.apply(x, src_row, inverse), w_up, w_down, offs, activation)


@register_strategy
class SequentialStrategy(Strategy):
    name = "sequential"
    fused_routing = True
    fp8_experts = True

    def __init__(self, config, ep, expert_backend: str = "torch", kernels: ExpertKernelOptions | None = None,
                 fp8_backend: str = "auto"):
        super().__init__(config, ep)
        if expert_backend not in EXPERT_BACKENDS:
            raise ValueError(f"expert_backend must be one of {EXPERT_BACKENDS}, got {expert_backend!r}")
        if fp8_backend not in FP8_BACKENDS:
            raise ValueError(f"fp8_backend must be one of {FP8_BACKENDS}, got {fp8_backend!r}")
        if kernels is not None and not isinstance(kernels, ExpertKernelOptions):
            raise TypeError(f"strategy option 'kernels' must be an ExpertKernelOptions "
                            f"(interlace.kernels.expert_gemm.configs), got {type(kernels).__name__}")
        if kernels is not None and expert_backend != "triton":
            raise ValueError("strategy option 'kernels' configures the Triton expert kernels: use it with "
                             "expert_backend='triton' (strategy 'sequential:triton')")
        self.expert_backend = expert_backend
        self.kernels = kernels
        self.fp8_backend = fp8_backend

    @classmethod
    def parse_arg(cls, arg: str) -> dict:
        return {"expert_backend": arg}

    def __call__(self, x, topk_idx, topk_weight, w_up, w_down):
        cfg, ep = self.config, self.ep
        T = x.shape[0]
        k = cfg.top_k
        capacity = cfg.capacity(T)
        row_of_assignment, assignment_of_row, kept, expert_end = build_dispatch_index(
            topk_idx, cfg.num_experts, capacity)

        if ep.world == 1:
            # Host sync only with a capacity: the number of kept rows sizes the buffers.
            rows = T * k if capacity is None else int(expert_end[-1])
            if isinstance(w_up, BlockFP8Weight):
                y = expert_ffn_fp8(x, assignment_of_row, k, rows, w_up, w_down, expert_end, cfg.activation,
                                   backend=self.fp8_backend)
            elif self.expert_backend == "triton" and supports(x, w_up):
                # The dispatch gather is fused into the first GEMM: rows read x[assignment // k].
                y = TritonExpertFFN.apply(x, w_up, w_down, assignment_of_row[:rows], k, rows, expert_end,
                                          cfg.activation, row_of_assignment, self.kernels)
            else:
                x_send = DispatchRows.apply(x, assignment_of_row[:rows], row_of_assignment)
                y = expert_ffn(x_send, w_up, w_down, expert_end, cfg.activation)
            return CombineRows.apply(y, topk_weight, row_of_assignment, x.dtype)

        recv_counts = all_to_all_counts(kept, ep)
        # THE host sync of the forward: all_to_all_single takes its split sizes on the host.
        counts = torch.cat([kept, recv_counts]).tolist()
        E = cfg.num_experts
        in_splits = [sum(counts[r * ep.num_local:(r + 1) * ep.num_local]) for r in range(ep.world)]
        out_splits = [sum(counts[E + r * ep.num_local:E + (r + 1) * ep.num_local]) for r in range(ep.world)]
        rows_send, rows_recv = sum(in_splits), sum(out_splits)

        # The `del`s free each row buffer as soon as the next one exists (lower peak memory
        # in inference; in training autograd keeps only what backward needs).
        if isinstance(w_up, BlockFP8Weight):
            # FP8 experts quantize each token row anyway: quantized where it lives, it goes over
            # the wire as e4m3 with its scales (about half of bf16's bytes), and the receiving
            # GEMMs take it as it comes. The same arithmetic bitwise (rows quantize alone).
            x_send = gather_rows(quantize_rows_packed(x).packed, assignment_of_row[:rows_send], divisor=k)
            x_recv = QuantizedRows(all_to_all(x_send, out_splits, in_splits, ep), x.shape[1], x.dtype)
        else:
            x_send = DispatchRows.apply(x, assignment_of_row[:rows_send], row_of_assignment)
            x_recv = all_to_all(x_send, out_splits, in_splits, ep)
        del x_send
        src_row, inverse, offs = expert_major_index(recv_counts.view(ep.world, ep.num_local), rows_recv)
        if isinstance(w_up, BlockFP8Weight):  # (back in receive order inside: one row gather fewer)
            # Each local expert's rows are known here since the sync above: cuBLAS's per-expert
            # GEMMs (the blockwise backend) need no second one.
            L = ep.num_local

            def host_ends():
                per_expert = map(sum, zip(*(counts[E + r * L:E + (r + 1) * L] for r in range(ep.world))))
                return list(itertools.accumulate(per_expert))

            y_recv = expert_ffn_fp8(x_recv, src_row, 1, rows_recv, w_up, w_down, offs, cfg.activation,
                                    backend=self.fp8_backend, out_rows=inverse, host_ends=host_ends)
        else:
            y_grouped = gathered_expert_ffn(self.expert_backend, x_recv, src_row, inverse, rows_recv, w_up, w_down,
                                            offs, cfg.activation, self.kernels)
            y_recv = PermuteRows.apply(y_grouped, inverse, src_row)
            del y_grouped
        del x_recv
        y = all_to_all(y_recv, in_splits, out_splits, ep)
        del y_recv
        return CombineRows.apply(y, topk_weight, row_of_assignment, x.dtype)
