"""``naive``: the baseline of BENCHMARKS.md, written the way users write it today.

argsort permute → all_to_all_single with host-side split sizes → torch._grouped_mm gate and
up (two GEMMs) → SiLU·up → torch._grouped_mm down → all_to_all_single back → fp32 unpermute
and weighted sum (index_add). Several host syncs (``tolist``), atomics in its backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from interlace.parallel.comm import all_to_all
from interlace.kernels.activation import activation_reference
from interlace.kernels.expert_gemm.torch_grouped_mm import grouped_mm
from interlace.strategies.base import Strategy, register_strategy


@register_strategy
class NaiveStrategy(Strategy):
    name = "naive"

    def __call__(self, x, topk_idx, topk_weight, w_up, w_down):
        cfg, ep = self.config, self.ep
        T, N = x.shape
        E = cfg.num_experts
        # Slot-major assignment order; stable argsort by expert (capacity policy of MoEConfig).
        experts = topk_idx.t().reshape(-1)
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=E)
        capacity = cfg.capacity(T)
        if capacity is not None:
            rank_in_expert = torch.arange(order.numel(), device=x.device) - (counts.cumsum(0) - counts)[experts[order]]
            order = order[rank_in_expert < capacity]
            counts = counts.clamp(max=capacity)
        tokens = order % T if T else order
        x_send = x[tokens]

        if ep.world > 1:
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=ep.group)
            in_splits = counts.view(ep.world, -1).sum(1).tolist()  # host sync
            recv = recv_counts.view(ep.world, ep.num_local)
            out_splits = recv.sum(1).tolist()  # host sync
            x_recv = all_to_all(x_send, out_splits, in_splits, ep)
            local_expert = torch.arange(ep.num_local, device=x.device).repeat(ep.world)
            row_expert = torch.repeat_interleave(local_expert, recv.reshape(-1))
            perm = torch.argsort(row_expert, stable=True)
            x_sorted = x_recv[perm]
            local_counts = recv.sum(0)
        else:
            x_sorted = x_send
            local_counts = counts
        offs = local_counts.cumsum(0).to(torch.int32)

        if cfg.gated:
            K = cfg.ffn
            gate = grouped_mm(x_sorted, w_up[:, :K], offs)
            up = grouped_mm(x_sorted, w_up[:, K:], offs)
            act = torch.nn.functional.silu(gate) * up
        else:
            act = activation_reference(grouped_mm(x_sorted, w_up, offs), cfg.activation)
        y_sorted = grouped_mm(act, w_down, offs)

        if ep.world > 1:
            y_recv = torch.empty_like(y_sorted)
            y_recv[perm] = y_sorted
            y = all_to_all(y_recv, in_splits, out_splits, ep)
        else:
            y = y_sorted
        weights = topk_weight.t().reshape(-1)[order]
        out = torch.zeros((T, N), dtype=torch.float32, device=x.device)
        out.index_add_(0, tokens, y.float() * weights.float().unsqueeze(-1))
        return out.to(x.dtype)
