"""``MoELayer``: router + this rank's experts + a strategy for dispatch/compute/combine."""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

from interlace import shared_overlap
from interlace.parallel.comm import ExpertParallel, check_same_across_ranks
from interlace.config import MoEConfig
from interlace.experts import GroupedExperts, SharedExpert
from interlace.parallel.mesh import MoEMesh
from interlace.quantize import quantize_experts
from interlace.routing import Router, check_expert_indices, load_balance_loss
from interlace.strategies import make_strategy  # (importing the package registers every strategy)
from interlace.strategies.base import strategy_class
from interlace.strategies.custom_op import FP8_TRAINING


_LAYER_NUMBERS = itertools.count()  # names layers in errors: "MoELayer 3" is the process's fourth


class AddAuxiliaryLoss(torch.autograd.Function):
    """Returns ``out`` unchanged; in backward, adds ``scale`` · d(aux)/d(params) as if
    ``scale · aux`` had been added to the loss. Lets the layer carry its balance loss without
    changing its output; ``scale`` is the factor the loss itself is multiplied by before
    ``backward()`` (:attr:`MoELayer.aux_loss_scale`), so the balance loss's gradient scales
    like the loss's (a scalar output gradient cannot tell it: it mixes the loss's factor with
    the loss's own derivative)."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.aux_dtype, ctx.aux_device, ctx.scale = aux.dtype, aux.device, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device), None


def _resolve_device(device: torch.device | str | None) -> torch.device:
    """The parameters' device; ``ValueError`` for a CUDA device this process cannot use (before
    torch's own error for it, which on a CPU-only build is a linker-level message)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "no CUDA device is visible to this process")
            raise ValueError(f"device {device} was asked for, but CUDA is not available ({why}); "
                             f"use device='cpu' (see the README's CPU quick start)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {device} was asked for, but this process sees "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return device


class MoELayer(nn.Module):
    """A distributed Mixture-of-Experts layer.

    Experts are sharded over the expert-parallel ``group`` (default: the world group if
    torch.distributed is initialized, else a single process): rank r holds experts
    ``[r*E/W, (r+1)*E/W)``. The router is replicated.

    Args:
        config: the layer's :class:`MoEConfig` (must be equal on every rank; checked here).
        group: expert-parallel process group, or None.
        strategy: a name of ``interlace.STRATEGIES`` (``"naive"``, ``"sequential"``,
            ``"pipelined"``, ``"fused"``, ``"tp_ep"``, ``"persistent"``, ``"auto"``), optionally with its
            ``":arg"`` (``"pipelined:4"`` fixes the degree). A strategy that cannot run on
            ``device`` here says what it needs (``ValueError``) before any weight is built.
            Default ``"auto"``: every rank runs the same strategy, the one measured fastest on
            the first calls of each token-count bucket (decisions cached on disk; at world
            size 1, ``sequential``); see :mod:`interlace.strategies.auto`.
        seed: every weight is a function of (seed, expert id); ranks agree without
            broadcasting and a single-process reference can rebuild the same weights.
        device: where parameters live (default: the current CUDA device, else CPU). A CUDA
            device on a machine without CUDA raises ``ValueError``.
        strategy_options: keyword options of the strategy (e.g. ``{"degree": "auto"}``).
        mesh: an :class:`interlace.parallel.mesh.MoEMesh` instead of ``group``: experts over its EP
            group, each expert's FFN dimension sharded over its TP group (strategy
            ``"tp_ep:O0"`` … ``"tp_ep:O3"`` for tp > 1). ``MoEMesh.build`` gives the groups
            their own high-priority communicators.

    Shapes: T tokens on this rank, N = ``config.hidden``, K = ``config.ffn``, E =
    ``config.num_experts``, k = ``config.top_k``, W the expert-parallel world size.
    Parameters: ``router.weight`` (E, N); ``experts.w_up`` (E/W, up_width, N) with up_width
    2K for SwiGLU (gate rows first) else K; ``experts.w_down`` (E/W, N, K); with
    ``config.shared_ffn`` > 0, ``shared.w_up``, ``shared.w_down`` (and ``shared.gate``), the
    replicated shared expert (:class:`interlace.experts.SharedExpert`).
    With ``config.expert_quant == "fp8"`` the experts are e4m3 with fp32 block scales
    (``experts.w_up_scale_inv``, ``experts.w_down_scale_inv``; :class:`interlace.experts.GroupedExperts`),
    the strategy must run them (``Strategy.fp8_experts``: ``sequential``, ``persistent``, ``auto``; at
    tp > 1 ``tp_ep``, where K % (128·tp) == 0), and the layer
    is inference-only: a call that builds an autograd graph raises ``RuntimeError``.
    """

    def __init__(
        self,
        config: MoEConfig,
        group=None,
        strategy: str = "auto",
        seed: int = 0,
        device: torch.device | str | None = None,
        strategy_options: dict | None = None,
        mesh: MoEMesh | None = None,
    ):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        config.validate()
        self.config = config
        device = _resolve_device(device)
        if mesh is not None and group is not None:
            raise ValueError("give the expert-parallel group= or a mesh=, not both")
        self.mesh = mesh if mesh is not None else MoEMesh.from_groups(None, group)
        ffn_slice = self.mesh.shard_ffn(config.ffn)
        self.ep = ExpertParallel.build(self.mesh.ep_group, config.num_experts)
        self.label = f"MoELayer {next(_LAYER_NUMBERS)}"
        self._strategy_options: dict[str, dict] = {}  # per strategy name, the options last given
        check_same_across_ranks(config.fingerprint(), self.ep, "MoEConfig", config.math_fields())
        check_same_across_ranks(seed, self.ep, "seed")
        if self.mesh.tp > 1:
            tp_view = ExpertParallel(self.mesh.tp_group, self.mesh.tp_rank, self.mesh.tp, config.num_experts)
            check_same_across_ranks(config.fingerprint(), tp_view, "MoEConfig", config.math_fields())
            check_same_across_ranks(seed, tp_view, "seed")
        # The strategy first: one that cannot run here says so before any weight is built.
        self.strategy = self._make_strategy(strategy, strategy_options or {}, device)
        self.router = Router(config, seed, device)
        self.experts = GroupedExperts(config, self.ep, seed, device, ffn_slice)
        self.shared = SharedExpert(config, seed, device) if config.shared_ffn else None
        self.last_aux_loss: torch.Tensor | None = None
        # The factor the training loop multiplies its loss by before backward() (1/n for n
        # accumulated micro-batches, 1/W for a mean over W ranks taken by hand): the balance
        # loss's gradient gets it too. Wrappers that average gradients (DDP, FSDP,
        # interlace.parallelize) need none: 1. interlace.set_aux_loss_scale sets every layer's.
        self.aux_loss_scale = 1.0
        # (weak reference, version) of the last forced expert_indices whose values were checked
        self._checked_indices: tuple[weakref.ref, int] | None = None

    def set_strategy(self, name: str, **options) -> None:
        """Switch the strategy; parameters are untouched. Call it on every rank alike.

        ``options`` are the strategy's; without them, the options last given for a strategy of
        this name (to the constructor's ``strategy_options`` or an earlier ``set_strategy``) hold
        again. The old strategy's own CUDA graphs and call plans are dropped
        (:meth:`Strategy.close`)."""
        new = self._make_strategy(name, options)
        old, self.strategy = self.strategy, new
        old.close()

    def _make_strategy(self, name: str, options: dict, device: torch.device | None = None):
        cls = strategy_class(name)
        given = dict(options) if options else self._strategy_options.get(cls.name, {})
        options = given
        if getattr(cls, "uses_mesh", False):
            options = {"mesh": self.mesh, **options}
        elif self.mesh.tp > 1:
            raise ValueError(f"strategy {name!r} does not shard experts over a tensor-parallel group "
                             f"(mesh tp={self.mesh.tp}); use 'tp_ep:O0' .. 'tp_ep:O3'")
        device = self.experts.w_up.device if device is None else device
        strategy = make_strategy(name, self.config, self.ep, device=device, **options)
        strategy.label = self.label
        self._strategy_options[cls.name] = given  # (kept once they built a strategy)
        self.strategy_spec = name  # (as given: quantize_experts_ builds it again for FP8 experts)
        return strategy

    def quantize_experts_(self, quant: str = "fp8", strategy: str | None = None) -> None:
        """Make this layer's experts FP8 in place (:func:`interlace.quantize_experts`): the
        weights e4m3 with fp32 block scales, ``config.expert_quant="fp8"``, the strategy
        (``strategy``, default the current one) built again. Call it on every rank alike."""
        quantize_experts(self, quant, strategy)

    def replace_config(self, config: MoEConfig) -> None:
        """(:func:`interlace.quantize_experts`) Take ``config``, which differs from the current one
        in how the experts are stored only; the caller builds the strategy again."""
        self.config = config

    def _check_input(self, x: torch.Tensor, weight_device: torch.device) -> None:
        cfg = self.config
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoELayer expects a tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != cfg.hidden:
            raise ValueError(f"input hidden size {tuple(x.shape)[-1:]} does not match config.hidden={cfg.hidden}")
        if x.dtype != cfg.dtype:
            raise TypeError(f"input dtype {x.dtype} does not match config.dtype={cfg.dtype}")
        if x.device != weight_device:
            raise ValueError(f"input is on {x.device} but the layer's weights are on {weight_device}")

    def forward(self, x: torch.Tensor, expert_indices: torch.Tensor | None = None) -> torch.Tensor:
        """
        Args:
            x: (..., N) tokens in ``config.dtype`` on the layer's device; the leading dims
                flatten to T tokens.
            expert_indices: optional (T, k) int32/int64 forced choice of experts (tests,
                benchmarks): each row k distinct experts in ``[0, E)``, else ``ValueError``.
                The weights still come from the router, so it still gets gradients.

        Returns:
            (..., N) in ``config.dtype``: Σ_j weight[t, j] · expert_{idx[t, j]}(x[t]), plus the
            shared expert's output ``shared(x[t])`` when the config has one.

        With ``config.aux_loss_coef > 0`` and in training mode, the balance loss times the coef
        is folded into the backward pass (times :attr:`aux_loss_scale`, the loss's own factor)
        and its value kept in ``last_aux_loss``.
        """
        # (the submodules and parameters fetched once: each nn.Module attribute is a __getattr__
        # call, and a decode-sized call's host time is what a layer adds to the GPU's)
        router, experts = self.router, self.experts
        w_up, w_down = experts.w_up, experts.w_down
        self._check_input(x, w_up.device)
        compiling = torch.compiler.is_compiling()
        if not compiling:  # (compiled: the strategy's op raises it, at its first read of the group)
            self.ep.check_group()  # the group destroyed: a clear error before any work of the call
        wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, router.weight, w_up, w_down))
        # (compiled: the custom op refuses an FP8 training call, with the same message)
        train = not compiling and wants_grad
        if train and experts.scale_names is not None:
            raise RuntimeError(f"{self.label}: {FP8_TRAINING}")
        shape = x.shape
        x = x.reshape(-1, self.config.hidden).contiguous()
        if expert_indices is not None:
            # The value check reads the indices on the host; a caller that passes the same tensor
            # call after call (a benchmark) pays it once, until the tensor is modified in place
            # (an inference tensor has no version counter: checked every call).
            version = None if expert_indices.is_inference() else expert_indices._version
            seen = self._checked_indices
            again = (version is not None and seen is not None and seen[0]() is expert_indices
                     and seen[1] == version)
            check_expert_indices(expert_indices, x.shape[0], self.config, values=not again)
            self._checked_indices = (weakref.ref(expert_indices), version)
        # (a rank without tokens has no indices to honour: it may take either path, as its peers do)
        if compiling:  # (the strategy posts inside its own op, and there decides whether it routes)
            routed = self._routes_when_compiled(expert_indices, wants_grad)
        else:
            routed = self._routes_in_strategy(x, expert_indices if x.shape[0] else None, router, w_up, w_down)
            # e.g. auto's agreement with its peers (token count and kind of call), under the router
            routed = self.strategy.begin_call(x.shape[0], train, routed)
        # The shared expert first, on a side stream on CUDA (config.shared_overlap): it runs while
        # this stream routes and the strategy dispatches, computes and combines; joined below.
        shared = None if self.shared is None else shared_overlap.start(
            self.shared, x, overlap=self.config.shared_overlap)
        # The experts run through their module's call (not with w_up, w_down read here): a
        # data-parallel wrapper's hooks on it (FSDP2's all-gather) see the call.
        if routed:  # (its kernel routes: `persistent`)
            out = experts(x, strategy=self.strategy, router=router)
        else:
            topk_idx, topk_weight, logits = router(x, expert_indices, fused=self.strategy.fused_routing)
            out = experts(x, topk_idx, topk_weight, strategy=self.strategy)
        if shared is not None:
            out = out + shared.join()
        if self.config.aux_loss_coef > 0 and self.training:
            aux = load_balance_loss(logits, topk_idx, self.config) * self.config.aux_loss_coef
            self.last_aux_loss = aux.detach()
            out = AddAuxiliaryLoss.apply(out, aux, float(self.aux_loss_scale))
        return out.reshape(shape)

    def _routes_in_strategy(self, x: torch.Tensor, expert_indices: torch.Tensor | None, router, w_up: torch.Tensor,
                            w_down: torch.Tensor) -> bool:
        """Whether the strategy routes this call inside its own kernel: only a ``routes_itself``
        strategy, without forced indices, outside ``torch.compile``, with no balance loss to
        compute, and where the strategy takes the call (inference: no autograd graph)."""
        return (self.strategy.routes_itself and expert_indices is None and not torch.compiler.is_compiling()
                and not (self.config.aux_loss_coef > 0 and self.training)
                and self.strategy.routes_call(x, router, w_up, w_down))

    def _routes_when_compiled(self, expert_indices: torch.Tensor | None, wants_grad: bool) -> bool:
        """Under ``torch.compile``: whether the call goes to the strategy with its router (the op
        ``interlace::moe_routed``, which runs the eager layer's path from the router on, routing in
        the kernel where the strategy takes the call): a ``routes_itself`` strategy, no forced
        indices, no balance loss, and no gradient wanted (decided while tracing; Dynamo guards
        grad mode and ``requires_grad``)."""
        return (self.strategy.routes_itself and expert_indices is None and not wants_grad
                and not (self.config.aux_loss_coef > 0 and self.training))

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden={c.hidden}, ffn={c.ffn}, experts={c.num_experts} ({self.ep.num_local}/rank, "
                f"tp={self.mesh.tp}), "
                f"top_k={c.top_k}, activation={c.activation}, router={c.router}, strategy={self.strategy.name}"
                + (f", experts {c.expert_quant}" if c.expert_quant else ""))
