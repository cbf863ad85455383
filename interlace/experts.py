"""This rank's expert weights, laid out for grouped GEMM, with seed-deterministic init."""

from __future__ import annotations

import sys
from typing import ClassVar

import torch
from torch import nn

from interlace.config import MoEConfig
from interlace.fp8 import FP8_BLOCK, BlockFP8Weight, check_fp8_ffn_slice, quantize_weight
from interlace.kernels.activation import activation_reference
from interlace.parallel.comm import ExpertParallel
from interlace.parallel.wrapper_checks import check_ddp_wrapper, check_dtensor_mesh
from interlace.strategies.base import fp8_strategy_names, outside_inference_mode
from interlace.strategies.custom_op import run_routed, run_strategy


def _is_dtensor(value) -> bool:
    """Whether ``value`` is a DTensor, without importing torch.distributed.tensor (about a second
    of every process's start-up) where nothing has: no DTensor exists before that import."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def init_expert_weights(
    config: MoEConfig, expert_ids, seed: int, device: torch.device, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of the given experts, identical whichever rank builds them.

    Each expert draws from its own generator seeded by (seed, expert id) on ``device``, in
    fp32, then casts to ``dtype``: the shard of rank r equals the slice of the full set built
    on the same kind of device.

    Returns ``w_up`` (len(ids), up_width, N) and ``w_down`` (len(ids), N, K), in the
    ``nn.Linear`` (out, in) layout; for SwiGLU rows [0, K) of ``w_up`` are the gate.
    """
    dtype = dtype or config.dtype
    N, K = config.hidden, config.ffn
    ups, downs = [], []
    for e in expert_ids:
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 7919 * (int(e) + 1))
        ups.append((torch.randn(config.up_width, N, generator=gen, device=device) / N**0.5).to(dtype))
        downs.append((torch.randn(N, K, generator=gen, device=device) / K**0.5).to(dtype))
    if not ups:
        return (torch.empty(0, config.up_width, N, device=device, dtype=dtype),
                torch.empty(0, N, K, device=device, dtype=dtype))
    return torch.stack(ups), torch.stack(downs)


def shard_ffn(w_up: torch.Tensor, w_down: torch.Tensor, config: MoEConfig, lo: int, hi: int):
    """Tensor-parallel shard ``[lo, hi)`` of the FFN dimension K of every expert.

    ``w_up`` (E, up_width, N) → (E, up_width·(hi−lo)/K, N): for SwiGLU the gate rows [lo, hi)
    then the up rows [K+lo, K+hi), so the shard is again "gate rows first, then up rows".
    ``w_down`` (E, N, K) → (E, N, hi−lo). Activations are elementwise, so
    ``Σ_shards w_down_s · act(w_up_s · x)`` is the full expert's output.
    """
    K = config.ffn
    if (lo, hi) == (0, K):
        return w_up, w_down
    rows = [w_up[:, lo:hi]] + ([w_up[:, K + lo:K + hi]] if config.gated else [])
    return torch.cat(rows, dim=1).contiguous(), w_down[:, :, lo:hi].contiguous()


def shard_ffn_fp8(w_up: BlockFP8Weight, w_down: BlockFP8Weight, lo: int,
                  hi: int) -> tuple[BlockFP8Weight, BlockFP8Weight]:
    """:func:`shard_ffn` of FP8 experts: the slice ``[lo, hi)`` of K (whole 128-blocks:
    :func:`~interlace.fp8.check_fp8_ffn_slice`) of the full weights with their block scales.

    ``w_up`` (E, up_width, N): the gate rows [lo, hi) and (SwiGLU, up_width = 2K) the up rows
    [K+lo, K+hi), each with its scale rows; ``w_down`` (E, N, K): columns [lo, hi) with their scale
    columns. Equal, bitwise, to quantizing :func:`shard_ffn` of the dense weights (each block of
    the slice is a block of the full weight)."""
    K = w_down.shape[-1]
    check_fp8_ffn_slice((lo, hi), K)
    if (lo, hi) == (0, K):
        return w_up, w_down
    b0, b1 = lo // FP8_BLOCK, hi // FP8_BLOCK
    halves = [(0, 0)] + ([(K, K // FP8_BLOCK)] if w_up.shape[-2] == 2 * K else [])
    up = BlockFP8Weight(torch.cat([w_up.weight[..., at + lo:at + hi, :] for at, _ in halves], dim=-2).contiguous(),
                        torch.cat([w_up.scale_inv[..., bt + b0:bt + b1, :] for _, bt in halves], dim=-2).contiguous())
    down = BlockFP8Weight(w_down.weight[..., lo:hi].contiguous(), w_down.scale_inv[..., b0:b1].contiguous())
    return up, down


class ExpertShard(nn.Module):
    """This rank's block of a layer's routed experts: the base of :class:`GroupedExperts`
    (``MoELayer``) and :class:`interlace.hf.ShardedExperts` (HF blocks).

    The layer runs its experts by *calling* this module (``experts(x, topk_idx, topk_weight,
    strategy=...)``), never by reading the weights beside it, so a wrapper's module hooks see the
    call: FSDP2's pre-forward hook all-gathers the weights of ``fully_shard(experts, mesh=dp)``
    before the strategy reads them, its pre-backward hook again before their gradients.

    Data parallelism over an expert-parallel layer: these parameters differ between the ranks
    of the layer's EP group (``ep``), so a wrapper must replicate / shard / reduce them over the
    data-parallel replicas of this rank only (:func:`interlace.parallelize`). A ``DTensor``
    assigned to a weight (what ``fully_shard`` does) whose mesh holds another rank of the EP
    group raises ``ValueError`` there, before any step.
    """

    weight_names: ClassVar[tuple[str, str]] = ("w_up", "w_down")
    # FP8 experts (MoEConfig.expert_quant="fp8"): the names of the fp32 block scales beside each
    # of ``weight_names`` (``<weight>_scale_inv``, the checkpoints' names); None: dense weights.
    scale_names: tuple[str, str] | None = None
    ep: ExpertParallel

    @property
    def expert_quant(self) -> str | None:
        """``"fp8"`` when the weights are block-scaled FP8, else None."""
        return None if self.scale_names is None else "fp8"

    def expert_weights(self) -> tuple:
        """(w_up, w_down) as the strategy takes them: the parameters, or with FP8 weights
        :class:`~interlace.fp8.BlockFP8Weight` pairs of each weight and its block scales."""
        weights = [getattr(self, name) for name in self.weight_names]
        if self.scale_names is None:
            return tuple(weights)
        return tuple(BlockFP8Weight(w, getattr(self, s)) for w, s in zip(weights, self.scale_names))

    def quantize_(self) -> None:
        """Replace the dense weights by block-scaled FP8 ones in place (e4m3 + fp32 scales, as
        :func:`~interlace.fp8.quantize_weight` computes them), parameters without gradients."""
        if self.scale_names is not None:
            raise ValueError(f"{type(self).__name__}: the experts are FP8 already")
        set_fp8_weights(self, [quantize_weight(getattr(self, name).detach()) for name in self.weight_names])

    def load_fp8_(self, w_up: BlockFP8Weight, w_down: BlockFP8Weight) -> None:
        """Copy FP8 expert weights into this FP8 module (built with ``expert_quant="fp8"``, or
        after :func:`interlace.quantize_experts`): this rank's experts (E_local, ...), or every
        expert's (E, ...) of which it keeps its own (:mod:`interlace.fp8_checkpoint` reads other
        layouts into these). On a tensor-parallel slice of K (``ffn_slice``), weights of the full K
        are cut to this rank's slice (:func:`shard_ffn_fp8`); weights of the slice's K are taken
        as they are."""
        if self.scale_names is None:
            raise ValueError(f"{type(self).__name__}: the experts are dense; build the layer with "
                             f"expert_quant='fp8' or quantize it (interlace.quantize_experts) first")
        k_slice = getattr(self, "ffn_slice", None)
        if k_slice is not None and w_down.shape[-1] != k_slice[1] - k_slice[0]:  # the full K: this rank's slice
            w_up, w_down = shard_ffn_fp8(w_up, w_down, *k_slice)
        lo, n = self.ep.first_expert, self.ep.num_local
        with torch.no_grad():
            for name, scale_name, w in zip(self.weight_names, self.scale_names, (w_up, w_down)):
                target = getattr(self, name)
                if w.shape[0] == n * self.ep.world != n:  # (every expert's: this rank's slice)
                    w = BlockFP8Weight(w.weight[lo:lo + n], w.scale_inv[lo:lo + n])
                if w.shape != target.shape:
                    raise ValueError(f"{name}: got shape {tuple(w.shape)}, this rank's experts have {tuple(target.shape)}")
                target.copy_(w.weight)
                getattr(self, scale_name).copy_(w.scale_inv)

    def tensor_names(self) -> tuple[str, ...]:
        """The expert-sharded tensors (E_local, ...): the weights and, FP8, their scales."""
        return self.weight_names + (self.scale_names or ())

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor | None = None, topk_weight: torch.Tensor | None = None,
                *, strategy, router=None) -> torch.Tensor:
        """x (T, N), topk_idx (T, k), topk_weight (T, k) → (T, N): the strategy's dispatch, expert
        GEMMs and combine with this rank's weights. With ``router`` (and no indices), a strategy
        that routes inside its kernel takes the call (``strategy.forward_layer``)."""
        if not torch.compiler.is_compiling():
            check_ddp_wrapper(self)
        w_up, w_down = (getattr(self, name) for name in self.weight_names)
        scales = None
        if self.scale_names is not None:
            if not strategy.fp8_experts:  # (the layers refuse such a strategy when they build it)
                raise ValueError(f"strategy {strategy.name!r} does not run FP8 experts; "
                                 f"strategies that do: {', '.join(fp8_strategy_names())}")
            scales = tuple(getattr(self, name) for name in self.scale_names)
        if torch.compiler.is_compiling():
            if router is not None:  # (inference: the router and strategy in one op)
                return run_routed(strategy, router, x, w_up, w_down, scales)
            return run_strategy(strategy, x, topk_idx, topk_weight, w_up, w_down, scales)
        with outside_inference_mode():
            if router is not None:
                return strategy.forward_layer(x, router, *self.expert_weights())
            return run_strategy(strategy, x, topk_idx, topk_weight, w_up, w_down, scales)

    def __setattr__(self, name: str, value) -> None:
        # (fully_shard assigns through setattr where a module defines it: its sharded DTensor here)
        if name in self.weight_names and _is_dtensor(value):
            check_dtensor_mesh(self, name, value)
        super().__setattr__(name, value)


def set_fp8_weights(module: ExpertShard, weights) -> None:
    """Make ``module``'s experts the FP8 ``weights`` (one :class:`BlockFP8Weight` per name of
    ``weight_names``): each weight and its ``<name>_scale_inv`` scales become parameters without
    gradients (frozen, as transformers' FP8 experts; the state dict then holds both)."""
    for name, weight in zip(module.weight_names, weights):
        setattr(module, name, nn.Parameter(weight.weight, requires_grad=False))
        setattr(module, name + "_scale_inv", nn.Parameter(weight.scale_inv, requires_grad=False))
    module.scale_names = tuple(name + "_scale_inv" for name in module.weight_names)


class GroupedExperts(ExpertShard):
    """Experts ``first .. first + num_local - 1`` of the layer: weights; the strategy runs them
    (rows grouped by expert through one grouped GEMM per projection) when the layer calls this
    module (:meth:`ExpertShard.forward`).

    Shapes: E_local = ``num_local``, N = ``config.hidden``, K = ``config.ffn``, up_width =
    ``config.up_width`` (2K for SwiGLU, gate rows first; else K).
    Parameters: ``w_up`` (E_local, up_width, N), ``w_down`` (E_local, N, K), in
    ``config.dtype``; with a tensor-parallel slice ``ffn_slice=(lo, hi)`` of K, the
    :func:`shard_ffn` slices of them (K replaced by hi − lo).

    FP8 (``config.expert_quant == "fp8"``): ``w_up`` (E_local, up_width, N) and ``w_down``
    (E_local, N, K) float8_e4m3fn, ``w_up_scale_inv`` (E_local, ⌈up_width/128⌉, ⌈N/128⌉) and
    ``w_down_scale_inv`` (E_local, ⌈N/128⌉, ⌈K/128⌉) fp32, all without gradients: the
    same seeded init quantized (:func:`~interlace.fp8.quantize_weight`), so an FP8 layer is
    the quantized dense layer of the same seed. A tensor-parallel slice must be whole 128-blocks
    (K % (128·tp) == 0, :func:`~interlace.fp8.check_fp8_ffn_slice`, else ``ValueError``): the
    slice's FP8 weights are then the slice (:func:`shard_ffn_fp8`) of the full FP8 weights.
    """

    def __init__(self, config: MoEConfig, ep: ExpertParallel, seed: int, device: torch.device,
                 ffn_slice: tuple[int, int] | None = None):
        super().__init__()
        self.ep = ep
        self.first = ep.first_expert
        self.num_local = ep.num_local
        self.ffn_slice = ffn_slice or (0, config.ffn)
        self.ffn = config.ffn  # (the full K: ffn_slice below it is a tensor-parallel slice)
        if config.expert_quant == "fp8":
            check_fp8_ffn_slice(self.ffn_slice, config.ffn)
        w_up, w_down = init_expert_weights(config, range(self.first, self.first + self.num_local), seed, device)
        w_up, w_down = shard_ffn(w_up, w_down, config, *self.ffn_slice)
        self.w_up = nn.Parameter(w_up)
        self.w_down = nn.Parameter(w_down)
        if config.expert_quant == "fp8":
            self.quantize_()


def shared_expert_forward(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, gate: torch.Tensor | None,
                          activation: str) -> torch.Tensor:
    """The shared expert, plainly: x (T, N), w_up (up_width_s, N), w_down (N, K_s), gate (1, N)
    or None → (T, N) = [sigmoid(x · gateᵀ) ·] act(x w_upᵀ) w_downᵀ. The layer and the
    reference both run it (dense GEMMs; nothing to fuse)."""
    y = activation_reference(x @ w_up.t(), activation) @ w_down.t()
    if gate is not None:
        y = torch.sigmoid(x @ gate.t()) * y
    return y


class SharedExpert(nn.Module):
    """The always-on expert (``MoEConfig.shared_ffn`` > 0), replicated on every rank and run on
    every rank's own tokens beside the routed experts: DeepSeek's shared experts (one FFN of
    n_shared·K), Qwen2-MoE's shared expert with its sigmoid gate (``MoEConfig.shared_gate``).

    Parameters: ``w_up`` (up_width_s, N), gate rows first for SwiGLU, with up_width_s 2·K_s for
    SwiGLU else K_s (K_s = ``config.shared_ffn``); ``w_down`` (N, K_s); ``gate`` (1, N) with
    ``shared_gate``. Weights are a function of ``seed`` only (drawn from their own generator),
    so ranks agree without a broadcast. Gradients are data-parallel: all-reduce them.
    """

    def __init__(self, config: MoEConfig, seed: int, device: torch.device):
        super().__init__()
        self.activation = config.activation
        N, K = config.hidden, config.shared_ffn
        up_width = 2 * K if config.gated else K
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 104_729)
        w_up = torch.randn(up_width, N, generator=gen, device=device) / N**0.5
        w_down = torch.randn(N, K, generator=gen, device=device) / K**0.5
        self.w_up = nn.Parameter(w_up.to(config.dtype))
        self.w_down = nn.Parameter(w_down.to(config.dtype))
        if config.shared_gate:
            gate = torch.randn(1, N, generator=gen, device=device) / N**0.5
            self.gate = nn.Parameter(gate.to(config.dtype))
        else:
            self.gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, N) → (T, N)."""
        return shared_expert_forward(x, self.w_up, self.w_down, self.gate, self.activation)
