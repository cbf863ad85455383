"""The plain MoE layer every fast path is tested against: one process, all experts, a loop
over experts, computed in fp64 (or fp32). Backward is autograd through these plain ops. FP8 experts
take the W8A8 arithmetic of interlace.fp8 in fp32."""

from __future__ import annotations

import torch

from interlace.config import MoEConfig
from interlace.experts import shared_expert_forward
from interlace.fp8 import BlockFP8Weight, expert_ffn_fp8_reference
from interlace.kernels.activation import activation_reference
from interlace.routing import load_balance_loss, route


def capacity_keep_mask(topk_idx: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """(T, k) bool: which assignments survive the capacity policy of :class:`MoEConfig`.

    Written as the policy reads: walk the assignments slot-major (all first choices in token
    order, then all second choices, ...) and let each expert take them until it is full.
    """
    T, k = topk_idx.shape
    keep = torch.ones((T, k), dtype=torch.bool)
    capacity = config.capacity(T)
    if capacity is None:
        return keep
    taken = [0] * config.num_experts
    idx = topk_idx.tolist()
    for j in range(k):
        for t in range(T):
            e = idx[t][j]
            keep[t, j] = taken[e] < capacity
            taken[e] += 1
    return keep


def reference_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    config: MoEConfig,
    expert_bias: torch.Tensor | None = None,
    expert_indices: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layer, plainly.

    Args:
        x: (T, N) tokens of one rank (capacity is per rank, so call it per rank's tokens).
        router_weight: (E, N); w_up: (E, up_width, N); w_down: (E, N, K), all experts; or both
            :class:`~interlace.fp8.BlockFP8Weight` (FP8 experts): then each expert's FFN is
            :func:`~interlace.fp8.expert_ffn_fp8_reference`, the W8A8 arithmetic in fp32.
        shared: the shared expert's ``(w_up (up_width_s, N), w_down (N, K_s), gate (1, N) or
            None)`` when ``config.shared_ffn`` > 0, added to every token's output.
    Returns:
        out (T, N) in compute_dtype, aux_loss (scalar, unscaled).
    """
    c = compute_dtype
    fp8 = isinstance(w_up, BlockFP8Weight)
    x, router_weight = x.to(c), router_weight.to(c)
    if not fp8:
        w_up, w_down = w_up.to(c), w_down.to(c)
    # input_dtype: the router GEMM rounds as the layer's does (MoEConfig.router_gemm; the layer
    # takes activations in config.dtype).
    topk_idx, topk_weight, logits = route(x, router_weight, expert_bias, config, expert_indices,
                                          input_dtype=config.dtype)
    keep = capacity_keep_mask(topk_idx.cpu(), config).to(x.device)
    out = torch.zeros_like(x)
    for e in range(config.num_experts):
        tokens, slots = torch.nonzero((topk_idx == e) & keep, as_tuple=True)
        if tokens.numel() == 0:
            continue
        if fp8:
            ends = tokens.new_tensor([tokens.numel()], dtype=torch.int32)
            pick = lambda w: BlockFP8Weight(w.weight[e:e + 1], w.scale_inv[e:e + 1])  # noqa: E731
            y = expert_ffn_fp8_reference(x[tokens], pick(w_up), pick(w_down), ends, config.activation, out_dtype=c)
        else:
            h = x[tokens] @ w_up[e].t()
            y = activation_reference(h, config.activation) @ w_down[e].t()
        out = out.index_add(0, tokens, topk_weight[tokens, slots].unsqueeze(-1) * y)
    if config.shared_ffn:
        if shared is None:
            raise ValueError("config.shared_ffn > 0: pass the shared expert's weights (shared=)")
        s_up, s_down, s_gate = (None if t is None else t.to(c) for t in shared)
        out = out + shared_expert_forward(x, s_up, s_down, s_gate, config.activation)
    return out, load_balance_loss(logits, topk_idx, config)
