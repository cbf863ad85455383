"""Top-k routing: the :class:`Router` module, the routing function it shares with the
reference, and the auxiliary load-balancing loss."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from interlace import op_keys
from interlace.config import MoEConfig
from interlace.kernels.router_gemm import split_mm, split_mm_op, split_mm_reference
from interlace.kernels.router_topk import route_topk, route_topk_op
from interlace.kernels.rows import use_triton


def router_scores(logits: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """(T, E) scores: softmax probabilities, or sigmoid scores for the DeepSeek-V3 router."""
    return torch.softmax(logits, dim=-1) if config.router == "softmax" else torch.sigmoid(logits)


def topk_weights(scores: torch.Tensor, topk_idx: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """(T, k) routing weights: the chosen experts' scores, renormalized and scaled."""
    weight = scores.gather(1, topk_idx)
    if config.renormalize:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    if config.route_scale != 1.0:
        weight = weight * config.route_scale
    return weight


LOW_PRECISION: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)

_MM_OUT_DTYPE: bool | None = None  # does this torch have torch.mm(..., out_dtype=) on CUDA?


def _cuda_mm_out_dtype(a: torch.Tensor, b: torch.Tensor) -> bool:
    global _MM_OUT_DTYPE
    if _MM_OUT_DTYPE is None:
        try:
            torch.mm(a[:1], b[:, :1], out_dtype=torch.float32)
            _MM_OUT_DTYPE = True
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            warnings.warn(f"torch.mm(..., out_dtype=torch.float32) is not available ({exc}); the router GEMMs "
                          "upcast their 16-bit operands to fp32 instead (same products, slower)", stacklevel=3)
            _MM_OUT_DTYPE = False
    return _MM_OUT_DTYPE


def _mm_accumulate(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` of 16-bit operands, accumulated and returned in ``out_dtype``: one tensor-core
    GEMM with an fp32 output on CUDA (``torch.mm(..., out_dtype=)``); elsewhere (CPU, fp64)
    the same exact products, upcast first."""
    if a.is_cuda and out_dtype == torch.float32 and a.numel() and b.numel() and _cuda_mm_out_dtype(a, b):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.to(out_dtype) @ b.to(out_dtype)


def _split_mm(a, b, pieces_a: int, pieces_b: int, out_dtype: torch.dtype) -> torch.Tensor:
    if use_triton(a):
        if torch.compiler.is_compiling():  # the kernel as an opaque op: Dynamo cannot trace its launch
            return split_mm_op(a, b, pieces_a, pieces_b, out_dtype)
        return split_mm(a, b, pieces_a, pieces_b, out_dtype)
    return split_mm_reference(a, b, pieces_a, pieces_b, out_dtype)


class _SplitRouterLogits(torch.autograd.Function):
    """``router_gemm="split"``: bf16 ``x`` (T, N) @ fp32 ``W`` (E, N)ᵀ over W's three bf16
    pieces, fp32 accumulation (:mod:`interlace.kernels.router_gemm`): fp32-class logits (each
    product of bf16 pieces is exact in fp32; only the accumulation rounds) at a bf16 GEMM's cost.
    Backward: dW = gᵀ x with g (T, E) in three pieces; dx = g W from two pieces each (~2^-16
    relative before dx's bf16 rounding)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _split_mm(x, weight.t(), 1, 3, torch.float32)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.float()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _split_mm(grad, weight, 2, 2, x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _split_mm(grad.t(), x, 3, 1, torch.float32)
        return grad_x, grad_w


class _RouterLogits(torch.autograd.Function):
    """``router_gemm="input"``: ``x @ W^T`` with both operands rounded to a 16-bit dtype and the
    products accumulated in ``W``'s dtype. Backward: the logits' gradient is rounded to the
    same 16-bit dtype, and both gradient GEMMs accumulate in fp32 (``dW`` in ``W``'s dtype)."""

    @staticmethod
    def forward(ctx, x, weight, operand_dtype):
        xo, wo = x.to(operand_dtype), weight.to(operand_dtype)
        ctx.save_for_backward(xo, wo)
        ctx.dtypes = (x.dtype, weight.dtype)
        return _mm_accumulate(xo, wo.t(), weight.dtype)

    @staticmethod
    def backward(ctx, grad):
        xo, wo = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        go = grad.to(xo.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _mm_accumulate(go, wo, w_dtype).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _mm_accumulate(go.t(), xo, w_dtype)
        return grad_x, grad_w, None


def router_logits(x: torch.Tensor, weight: torch.Tensor, config: MoEConfig,
                  input_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(T, N) tokens, (E, N) router weight → (T, E) logits in ``weight.dtype``, the GEMM as
    ``config.router_gemm`` says. ``input_dtype``: the dtype of the activations the layer takes
    (default ``x.dtype``); the fp64 reference passes the layer's, so ``"input"`` rounds its
    operands as the layer does (``"split"`` decomposes the weight exactly, so the plain GEMM
    in fp64 is its reference)."""
    act = x.dtype if input_dtype is None else input_dtype
    if config.router_gemm == "input" and act in LOW_PRECISION:
        return _RouterLogits.apply(x, weight, act)
    if config.router_gemm == "split" and x.dtype == torch.bfloat16 and weight.dtype == torch.float32:
        return _SplitRouterLogits.apply(x, weight)
    return x.to(weight.dtype) @ weight.t()


class _FusedRouteTopK(torch.autograd.Function):
    """Triton forward (:mod:`interlace.kernels.router_topk`); backward differentiates the plain
    torch weights at the chosen experts, so the gradient is the plain path's."""

    @staticmethod
    def forward(ctx, logits, bias, config):
        idx, weight = route_topk(logits, bias, config.top_k, config.router == "softmax",
                                 config.renormalize, config.route_scale)
        ctx.save_for_backward(logits, idx)
        ctx.config = config
        ctx.mark_non_differentiable(idx)
        return idx, weight

    @staticmethod
    def backward(ctx, _grad_idx, grad_weight):
        logits, idx = ctx.saved_tensors
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_()
            weight = topk_weights(router_scores(leaf, ctx.config), idx, ctx.config)
            (grad_logits,) = torch.autograd.grad(weight, leaf, grad_weight)
        return grad_logits, None, None


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    expert_bias: torch.Tensor | None,
    config: MoEConfig,
    expert_indices: torch.Tensor | None = None,
    fused: bool = False,
    input_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route T tokens to k experts.

    Args:
        x: (T, N) tokens.
        weight: (E, N) router weight; the routing math runs in ``weight.dtype``.
        expert_bias: (E,) selection bias of the sigmoid router (None: no bias).
        expert_indices: optional (T, k) forced choice (benchmarks and tests); the weights are
            still the router's scores of those experts, so the router still gets gradients.
        fused: take the one-kernel Triton path (fp32 logits on a Triton device).
        input_dtype: the dtype of the activations the layer takes (default ``x.dtype``), for
            the logits GEMM (:func:`router_logits`).

    Returns:
        topk_idx (T, k) int64 (slot 0 the best choice), topk_weight (T, k) in weight.dtype,
        logits (T, E).
    """
    logits = router_logits(x, weight, config, input_dtype)
    topk_idx, topk_weight = route_logits(logits, expert_bias, config, expert_indices, fused)
    return topk_idx, topk_weight, logits


def route_logits(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    config: MoEConfig,
    expert_indices: torch.Tensor | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k choice and weights from router logits (the second half of :func:`route`, for
    callers that compute the logits their own way, e.g. :mod:`interlace.hf`).

    Args:
        logits: (T, E) router logits; the routing math runs in ``logits.dtype``.
        expert_bias, expert_indices, fused: as in :func:`route`.

    Returns:
        topk_idx (T, k) int64 (slot 0 the best choice), topk_weight (T, k) in logits.dtype.
    """
    if (fused and expert_indices is None and logits.dtype == torch.float32 and use_triton(logits)
            and fused_topk_supports(config)):
        if torch.compiler.is_compiling():
            # The kernel's choice as an opaque op (Dynamo cannot trace its launch), so a compiled
            # layer picks the experts an eager one picks. Where a gradient is wanted, the weights
            # of those experts in plain torch, differentiable as _FusedRouteTopK's backward is;
            # else the kernel's own weights, as eagerly (no softmax kernels beside it).
            topk_idx, weight = route_topk_op(logits.detach(), expert_bias, config.top_k, config.router == "softmax",
                                             config.renormalize, float(config.route_scale))
            if not (torch.is_grad_enabled() and logits.requires_grad):
                return topk_idx, weight
            return topk_idx, topk_weights(router_scores(logits, config), topk_idx, config)
        return _FusedRouteTopK.apply(logits, expert_bias, config)
    if config.softmax_after_topk:
        if expert_indices is None:
            choice = torch.nan_to_num(logits.detach(), nan=float("-inf"))
            topk_idx = torch.topk(limit_to_groups(choice, config), config.top_k, dim=-1, sorted=True).indices
        else:
            topk_idx = expert_indices.long()
        weight = torch.softmax(logits.gather(1, topk_idx), dim=-1)
        return topk_idx, weight * config.route_scale if config.route_scale != 1.0 else weight
    scores = router_scores(logits, config)
    if expert_indices is None:
        choice = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
        # NaN scores never win (as in the fused kernel): the choice stays k valid experts.
        choice = torch.nan_to_num(choice.detach(), nan=float("-inf"))
        topk_idx = torch.topk(limit_to_groups(choice, config), config.top_k, dim=-1, sorted=True).indices
    else:
        topk_idx = expert_indices.long()
    return topk_idx, topk_weights(scores, topk_idx, config)


def fused_topk_supports(config: MoEConfig) -> bool:
    """Whether the one-kernel Triton top-k (:mod:`interlace.kernels.router_topk`) computes this
    routing: softmax-then-top-k or sigmoid with a bias, no expert groups."""
    return not config.softmax_after_topk and not config.group_limited


def limit_to_groups(choice: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V2/V3): (T, E) choice scores with every expert outside
    each token's ``topk_group`` best groups set to −inf (unchanged without a group limit).

    A group's score is the sum of its two best choice scores (``group_score="top2_sum"``,
    DeepSeek-V3, where the choice includes the selection bias) or its best (``"max"``, V2).
    """
    if not config.group_limited:
        return choice
    T, E, G = choice.shape[0], config.num_experts, config.n_group
    grouped = choice.view(T, G, E // G)
    if config.group_score == "top2_sum":
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_score = grouped.max(dim=-1).values
    best = torch.topk(group_score, config.groups_kept, dim=-1).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)


def load_balance_loss(logits: torch.Tensor, topk_idx: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """Switch-Transformer balance loss ``E * Σ_e f_e · P_e`` over this rank's tokens.

    f_e is the fraction of assignments routed to e (no gradient), P_e the mean normalized
    score of e. Zero for an empty batch.
    """
    scores = router_scores(logits, config)
    num_experts = config.num_experts
    T = scores.shape[0]
    if T == 0:
        return scores.sum() * 0.0
    probs = scores / scores.sum(dim=-1, keepdim=True)
    f = torch.bincount(topk_idx.reshape(-1), minlength=num_experts).to(scores.dtype) / topk_idx.numel()
    return num_experts * (f * probs.mean(dim=0)).sum()


def check_expert_indices(expert_indices: torch.Tensor, num_tokens: int, config: MoEConfig,
                         values: bool = True) -> None:
    """``ValueError``/``TypeError`` for a forced choice of experts the layer cannot route.

    ``expert_indices`` (T, k) int32/int64: each row k distinct experts in ``[0, E)``. Only
    called when the caller forces the routing (tests, benchmarks), so it may read the indices.
    ``values=False`` checks type and shape only (the caller knows these values passed before).
    """
    if not isinstance(expert_indices, torch.Tensor):
        raise TypeError(f"expert_indices must be a tensor, got {type(expert_indices).__name__}")
    if expert_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert_indices must be int32 or int64, got {expert_indices.dtype}")
    if tuple(expert_indices.shape) != (num_tokens, config.top_k):
        raise ValueError(
            f"expert_indices must have shape (tokens, top_k)=({num_tokens}, {config.top_k}), "
            f"got {tuple(expert_indices.shape)}"
        )
    if not values or not expert_indices.numel():
        return
    out_of_range = ((expert_indices < 0) | (expert_indices >= config.num_experts)).any(dim=1)
    ordered = expert_indices.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
    # NOTE: host sync (one read of two flags), only on this forced-routing path.
    any_out_of_range, any_repeated = torch.stack([out_of_range.any(), repeated.any()]).tolist()
    if any_out_of_range:
        row = int(out_of_range.nonzero()[0])
        raise ValueError(f"expert_indices row {row} is {expert_indices[row].tolist()}: "
                         f"an index out of range [0, num_experts={config.num_experts})")
    if any_repeated:
        row = int(repeated.nonzero()[0])
        raise ValueError(f"expert_indices row {row} is {expert_indices[row].tolist()}: "
                         f"it names an expert twice (each token's top_k={config.top_k} experts must be distinct)")


class Router(nn.Module):
    """Token router, replicated on every rank (its gradient is this rank's tokens' share;
    reduce it across ranks as with any data-parallel parameter).

    Shapes: T tokens, N hidden, E experts, k = top_k.
    Parameters: ``weight`` (E, N) in ``config.router_dtype``. Buffers: ``expert_bias`` (E,)
    fp32 for the sigmoid router (DeepSeek-V3's selection bias; update it with
    :meth:`update_bias`), else None.
    """

    def __init__(self, config: MoEConfig, seed: int, device: torch.device):
        super().__init__()
        self.config = config
        # Names this router inside a compiled layer's op (interlace.op_keys): a compiled inference
        # call may hand it to a strategy that routes inside its kernel.
        self.op_key = op_keys.register(self)
        gen = torch.Generator(device=device).manual_seed(seed)
        w = torch.randn(config.num_experts, config.hidden, generator=gen, device=device, dtype=torch.float32)
        self.weight = nn.Parameter((w / config.hidden**0.5).to(config.router_dtype))
        if config.router == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor, expert_indices: torch.Tensor | None = None, fused: bool = False):
        """
        Args:
            x: (T, N) tokens.
            expert_indices: optional (T, k) forced choice (see :func:`route`).
            fused: the one-kernel Triton top-k where it can run (see :func:`route`).

        Returns:
            topk_idx (T, k) int64 (slot 0 the best choice), topk_weight (T, k) in
            ``config.router_dtype``, logits (T, E) in ``config.router_dtype``.
        """
        return route(x, self.weight, self.expert_bias, self.config, expert_indices, fused)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.op_key = op_keys.register(self)  # (a copy is another router)

    # What the compiled layer's op interlace::moe_routed asks of its router (custom_op.run_routed).
    def op_tensors(self) -> list[torch.Tensor]:
        return [self.weight] if self.expert_bias is None else [self.weight, self.expert_bias]

    def op_may_route(self) -> bool:
        return True

    def op_route(self, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return self(x, None, fused=fused)[:2]

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded.

        ``tokens_per_expert`` (E,): the load each expert got (any numeric dtype)."""
        if self.expert_bias is None:
            raise ValueError("update_bias is for the sigmoid router")
        load = tokens_per_expert.float()
        self.expert_bias += rate * torch.sign(load.mean() - load)
