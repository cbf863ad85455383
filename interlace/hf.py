"""Hugging Face transformers (5.x) MoE models on interlace: :func:`replace_moe_blocks`.

Each sparse-MoE block of a transformers model (``MixtralSparseMoeBlock``,
``Qwen3MoeSparseMoeBlock``, ``OlmoeSparseMoeBlock``, ...) becomes an :class:`InterlaceMoeBlock`
that holds the HF block's own weights, routes as the HF block does (interlace's router, the
family's score function and top-k order) and runs the routed experts through an interlace
strategy, with the experts sharded over the expert-parallel group: rank r holds experts
``[r*E/W, (r+1)*E/W)``.

The replacement keeps HF's module names, so checkpoints move both ways:

* its parameters and buffers have HF's state-dict keys (``gate.weight``,
  ``experts.gate_up_proj`` (E, 2K, N), ``experts.down_proj`` (E, N, K), the shared expert's
  own keys), and at world size 1 HF's shapes: ``model.state_dict()`` loads into the plain
  transformers model;
* at world size W > 1 the expert tensors are this rank's shard (E/W, ...):
  :func:`gather_hf_state_dict` all-gathers the full HF state dict, and ``load_state_dict``
  takes a full HF state dict (each rank keeps its slice of the experts);
* the router stays an instance of the HF router class (its class is swapped for a subclass
  that routes with interlace), so HF's ``output_router_logits`` hooks record its logits and
  the auxiliary load-balancing loss works unchanged.

Shapes: B batch, S sequence, T = B·S tokens on this rank, N hidden size, K expert FFN size,
E routed experts, k experts per token, W expert-parallel world size.

Not supported: gpt-oss (``GptOssMLP``; :func:`replace_moe_blocks` says so). Its router bias and
top-k-then-softmax would fit interlace's router, but its experts do not fit the kernels: a bias
after the gate/up GEMM and one after the down GEMM (each scaled into the combine with the routing
weight), the gate and up columns interleaved and transposed, and a clamped SwiGLU with an offset,
``(clamp(up, ±7) + 1) · g · sigmoid(1.702 g)`` with g = ``min(gate, 7)``. Every strategy's expert
path (the torch grouped-GEMM path's activation kernel, the Triton GEMM epilogues of
``sequential:triton`` and ``fused``, ``fused:train``'s backward, ``tp_ep``'s sharded experts) would
need the new activation and the two biases with their gradients; biases through the torch paths
alone would leave the default strategy unable to run the model.

FP8 models (transformers' ``FP8Experts``: ``FineGrainedFP8Config`` with 128 × 128 blocks and
dynamic activation scales): the e4m3 experts and their fp32 block scales are taken as they are
(their layout is interlace's, :func:`interlace.fp8_checkpoint.from_transformers`), the block's
config gets ``expert_quant="fp8"`` and the model's dtype for the activations, and the experts
run W8A8 through a strategy that runs FP8 experts. Inference only. A dense model's blocks become
FP8 with :func:`interlace.quantize_experts` (or ``block.quantize_experts_()``).

Inference calls may route inside the strategy's kernel (``persistent``, or ``auto`` weighing
it): the block hands the strategy a view of HF's router (:class:`KernelRouter`: its weight in
fp32, its bias, and the dtype its logits GEMM rounds to, bf16 in a bf16 Mixtral/Qwen/OLMoE, so
the kernel routes on the logits HF computes). Not while transformers collects the router
logits (``output_router_logits``): the router's own forward then runs, and its hooks record them.

Training: the expert shards differ between the ranks of an EP group, so a data-parallel wrapper
must leave them out of anything over those ranks. :func:`interlace.parallelize` (FSDP2 or DDP
over a ``("dp", "ep")`` DeviceMesh; docs/training.md) shards or replicates them over ``dp`` only
and reduces their gradients there (each rank's expert gradient already sums its EP group's
tokens, through the all-to-all's backward); every other parameter (:func:`replicated_parameters`)
is data-parallel over all ranks. A plain ``DDP(model)`` / ``fully_shard(model)`` over EP ranks
raises. Without a wrapper and with one data-parallel replica (dp = 1, W = ep ranks): divide each
rank's loss by W before ``backward()`` and sum-all-reduce the replicated gradients; the expert
gradients then need nothing (examples/train_hf_moe.py without ``--ddp``/``--fsdp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from interlace import data_parallel, op_keys, shared_overlap
from interlace.config import MoEConfig
from interlace.experts import ExpertShard, set_fp8_weights
from interlace.fp8 import FP8_BLOCK, FP8_DTYPE, BlockFP8Weight
from interlace.fp8_checkpoint import from_transformers
from interlace.parallel.comm import ExpertParallel, check_same_across_ranks
from interlace.parallel.mesh import MoEMesh
from interlace.quantize import quantize_experts
from interlace.routing import route_logits
from interlace.strategies import make_strategy
from interlace.strategies.base import strategy_class
from interlace.strategies.custom_op import FP8_TRAINING


# ----------------------------------------------------------------------------- families
@dataclass(frozen=True)
class Family:
    """How one transformers MoE block routes and what it adds beside the routed experts.

    ``config``: the :class:`MoEConfig` fields of a block (hidden, ffn, experts, top_k, the
    routing flags) read from the block's modules. ``logits``: the block's router GEMM
    ``(router, x (T, N)) → (T, E)`` exactly as HF computes it. ``shared``: the output of the
    always-on experts ``(block, hidden_states (B, S, N)) → (B, S, N)``, or None.
    """

    config: Callable[[nn.Module], dict]
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    shared: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    jitter: bool = False  # Mixtral's multiplicative input noise in training (router_jitter_noise)


def _experts_shape(block: nn.Module) -> dict:
    experts = block.experts
    act = type(experts.act_fn).__name__
    if act not in ("SiLUActivation", "SiLU"):
        raise ValueError(f"{type(block).__name__}: interlace runs SwiGLU experts (hidden_act 'silu'), got {act}")
    E, two_k, N = experts.gate_up_proj.shape
    return dict(hidden=N, ffn=two_k // 2, num_experts=E, activation="swiglu")


def _softmax_topk(block: nn.Module) -> dict:
    """Mixtral, Qwen2/3-MoE, OLMoE: softmax over all experts, then top-k, then (norm_topk_prob)
    the k weights renormalized; Mixtral always renormalizes."""
    renormalize = getattr(block.gate, "norm_topk_prob", True)
    return dict(_experts_shape(block), top_k=block.gate.top_k, router="softmax", renormalize=bool(renormalize))


def _deepseek_v3(block: nn.Module) -> dict:
    """DeepSeek-V3: sigmoid scores; the selection bias ``e_score_correction_bias`` added for the
    choice only; group-limited (a group scores the sum of its two best biased scores); the
    unbiased scores of the chosen k renormalized (norm_topk_prob) and scaled."""
    gate = block.gate
    return dict(_experts_shape(block), top_k=gate.top_k, router="sigmoid", renormalize=bool(gate.norm_topk_prob),
                route_scale=float(gate.routed_scaling_factor), n_group=int(gate.num_group or 1),
                topk_group=int(gate.topk_group or gate.num_group or 1), group_score="top2_sum")


def _deepseek_v2(block: nn.Module) -> dict:
    """DeepSeek-V2: softmax, top-k (``greedy``) or group-limited top-k with a group's best score
    (``group_limited_greedy``), scaled by routed_scaling_factor, never renormalized."""
    gate = block.gate
    grouped = gate.topk_method == "group_limited_greedy"
    if gate.topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepSeek-V2 topk_method {gate.topk_method!r} is not supported")
    return dict(_experts_shape(block), top_k=gate.top_k, router="softmax", renormalize=False,
                route_scale=float(gate.routed_scaling_factor), n_group=int(gate.num_group) if grouped else 1,
                topk_group=int(gate.topk_group) if grouped else None, group_score="max")


def _plain_logits(router: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, router.weight)


def _fp32_logits(router: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek: the router GEMM in fp32 whatever the model's dtype."""
    return F.linear(x.float(), router.weight.float())


def _deepseek_shared(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """DeepSeek: the n_shared_experts always-on experts, one SwiGLU MLP, on every token."""
    return block.shared_experts(hidden_states)


def _qwen2_shared(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE: one shared SwiGLU expert on every token, scaled by ``sigmoid(x · w_gate)``."""
    return torch.sigmoid(block.shared_expert_gate(hidden_states)) * block.shared_expert(hidden_states)


FAMILIES: dict[str, Family] = {
    "MixtralSparseMoeBlock": Family(_softmax_topk, _plain_logits, jitter=True),
    "Qwen3MoeSparseMoeBlock": Family(_softmax_topk, _plain_logits),
    "OlmoeSparseMoeBlock": Family(_softmax_topk, _plain_logits),
    "Qwen2MoeSparseMoeBlock": Family(_softmax_topk, _plain_logits, shared=_qwen2_shared),
    "DeepseekV3MoE": Family(_deepseek_v3, _fp32_logits, shared=_deepseek_shared),
    "DeepseekV2Moe": Family(_deepseek_v2, _fp32_logits, shared=_deepseek_shared),
}

# MoE blocks interlace does not take, with the reason (replace_moe_blocks raises it).
UNSUPPORTED: dict[str, str] = {
    "GptOssMLP": "gpt-oss experts add per-expert biases (gate_up and down) and a clamped SwiGLU "
                 "((up + 1) * gate * sigmoid(1.702 * gate), clamped at 7) that interlace's expert kernels do not "
                 "compute; see interlace.hf's module docstring",
}


# ----------------------------------------------------------------------------- modules
class InterlaceRouterMixin:
    """Routes with interlace; mixed into the HF router class (see :func:`_router_class`), so the
    module keeps its class identity for HF's output hooks and its parameters and buffers.

    ``forward(hidden_states (..., N))`` → ``(logits (T, E) as HF computes them, weights (T, k)
    fp32, indices (T, k) int64)``, HF's router return order.
    """

    def forward(self, hidden_states: torch.Tensor):
        config: MoEConfig = self.interlace_config
        x = hidden_states.reshape(-1, config.hidden)
        logits = self.interlace_family.logits(self, x)
        bias = getattr(self, "e_score_correction_bias", None)
        idx, weight = route_logits(logits.float(), bias, config, fused=self.interlace_fused)
        return logits, weight, idx


_ROUTER_CLASSES: dict[type, type] = {}


def _router_class(hf_class: type) -> type:
    """``Interlace<HFRouter>``: the mixin over the HF router class, one per HF class, in this
    module's namespace so pickling a model finds it."""
    if hf_class not in _ROUTER_CLASSES:
        name = "Interlace" + hf_class.__name__
        cls = type(name, (InterlaceRouterMixin, hf_class), {"__module__": __name__, "__qualname__": name})
        globals()[name] = cls
        _ROUTER_CLASSES[hf_class] = cls
    return _ROUTER_CLASSES[hf_class]


class ShardedExperts(ExpertShard):
    """This rank's routed experts in HF's fused layout, run by the block's call of this module
    (:meth:`interlace.experts.ExpertShard.forward`).

    Parameters: ``gate_up_proj`` (E/W, 2K, N), gate rows [0, K) then up rows [K, 2K) (HF's
    ``chunk(2)`` order, which is interlace's SwiGLU layout); ``down_proj`` (E/W, N, K).
    FP8 (``scales``: HF's ``gate_up_proj_scale_inv``, ``down_proj_scale_inv``): the weights e4m3
    and ``gate_up_proj_scale_inv`` (E/W, ⌈2K/128⌉, ⌈N/128⌉), ``down_proj_scale_inv``
    (E/W, ⌈N/128⌉, ⌈K/128⌉) fp32, all without gradients (HF's names and layout).
    ``load_state_dict`` also takes HF's full (E, ...) tensors and keeps this rank's slice.
    """

    weight_names = ("gate_up_proj", "down_proj")

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, ep: ExpertParallel,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        self.ep = ep
        self.num_experts = gate_up_proj.shape[0]
        if scales is None:
            self.gate_up_proj = _shard(gate_up_proj, ep)
            self.down_proj = _shard(down_proj, ep)
        else:
            weights = from_transformers(gate_up_proj, scales[0], down_proj, scales[1])
            set_fp8_weights(self, [BlockFP8Weight(_rank_experts(w.weight, ep), _rank_experts(w.scale_inv, ep))
                                   for w in weights])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        lo, n = self.ep.first_expert, self.ep.num_local
        for name in self.tensor_names():
            tensor = state_dict.get(prefix + name)
            if tensor is not None and n != self.num_experts and tensor.shape[0] == self.num_experts:
                state_dict[prefix + name] = tensor[lo:lo + n]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"experts {self.ep.first_expert}..{self.ep.first_expert + self.ep.num_local - 1} of {self.num_experts}"


def hf_fp8_scales(experts: nn.Module, where: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """transformers' FP8 experts' (``FP8Experts``) block scales (gate_up's, down's), or None for
    dense experts; ``ValueError`` for FP8 experts interlace does not run as they are."""
    if getattr(experts, "gate_up_proj", None) is None or experts.gate_up_proj.dtype != FP8_DTYPE:
        return None
    block = tuple(getattr(experts, "block_size", None) or ())
    why = None
    if block != (FP8_BLOCK, FP8_BLOCK):
        why = f"block_size {block or None}, interlace's scales are {FP8_BLOCK}x{FP8_BLOCK} blocks"
    elif getattr(experts, "activation_scheme", "dynamic") != "dynamic":
        why = f"activation_scheme {experts.activation_scheme!r}; interlace quantizes activations per token (dynamic)"
    elif not getattr(experts, "is_concatenated", True) or getattr(experts, "is_transposed", False):
        why = "gate/up interleaved or transposed; interlace stacks gate rows over up rows"
    if why:
        raise ValueError(f"{where}: FP8 experts with {why}")
    return experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv


def _rank_experts(tensor: torch.Tensor, ep: ExpertParallel, copy: bool = False) -> torch.Tensor:
    """Rank ``ep.rank``'s experts of an (E, ...) tensor: at W = 1 the tensor itself (unless
    ``copy``), else a copy of the slice (a view would keep the whole tensor alive)."""
    if ep.world == 1 and not copy:
        return tensor
    lo = ep.first_expert
    return tensor[lo:lo + ep.num_local].clone()


def _shard(param: torch.Tensor, ep: ExpertParallel) -> nn.Parameter:
    """Rank ``ep.rank``'s experts of an HF (E, ...) tensor: the same Parameter at W = 1 (no copy),
    else a copy of the slice (a view would keep the whole tensor alive)."""
    if ep.world == 1 and isinstance(param, nn.Parameter):
        return param
    return nn.Parameter(_rank_experts(param.detach(), ep, copy=True), requires_grad=param.requires_grad)


class KernelRouter:
    """HF's router as a strategy that routes inside its kernel takes it: ``weight`` (E, N) fp32
    (HF's weight converted once per change of it), ``expert_bias`` (E,) or None, ``logits_dtype``
    (the dtype HF's logits GEMM rounds to; None: fp32, as DeepSeek computes them). Calling it is
    interlace's :class:`~interlace.routing.Router` call: ``(x (T, N), expert_indices, fused)`` →
    topk_idx (T, k) int64, topk_weight (T, k) fp32, logits (T, E) (for the other candidates)."""

    def __init__(self, gate: nn.Module, family: Family, config: MoEConfig):
        self.gate, self.family, self.config = gate, family, config
        self._weight, self._key = None, None
        self.op_key = op_keys.register(self)  # (names it inside a compiled block's op)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.op_key = op_keys.register(self)  # (a copy is another router)

    @property
    def weight(self) -> torch.Tensor:
        w = self.gate.weight
        if w.dtype == torch.float32:
            return w
        # (in-place updates bump the version; an inference tensor has none, and outside
        # inference mode it cannot be changed in place)
        key = (w.data_ptr(), None if w.is_inference() else w._version, w.device, w.dtype)
        if key != self._key:
            self._weight, self._key = w.detach().float(), key
        return self._weight

    @property
    def expert_bias(self) -> torch.Tensor | None:
        return getattr(self.gate, "e_score_correction_bias", None)

    @property
    def logits_dtype(self) -> torch.dtype | None:
        return None if self.family.logits is _fp32_logits else self.gate.weight.dtype

    def __call__(self, x: torch.Tensor, expert_indices: torch.Tensor | None = None, fused: bool = False):
        if expert_indices is not None:
            raise ValueError("KernelRouter: forced expert indices go through the HF block's own path")
        logits = self.family.logits(self.gate, x)
        idx, weight = route_logits(logits.float(), self.expert_bias, self.config, fused=fused)
        return idx, weight, logits

    # What a compiled block's op interlace::moe_routed asks of its router (custom_op.run_routed): the
    # eager block's routing where the strategy does not route this call (HF's router, its hooks run).
    def op_tensors(self) -> list[torch.Tensor]:
        bias = self.expert_bias
        return [self.gate.weight] if bias is None else [self.gate.weight, bias]

    def op_may_route(self) -> bool:
        return not _collecting_outputs()

    def op_route(self, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        _, weight, idx = self.gate(x)
        return idx, weight


def _collecting_outputs() -> bool:
    """Whether transformers is collecting module outputs in this forward (``output_router_logits``
    and the like, through forward hooks): the HF router's own forward must then run. An unknown
    transformers counts as collecting."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return True
    return bool(_active_collector.get())


class InterlaceMoeBlock(nn.Module):
    """An HF sparse-MoE block on interlace: HF's router (routing with interlace), this rank's
    experts (:class:`ShardedExperts`) run by an interlace strategy, and HF's shared-expert
    modules (if the family has them) as they are, on every rank's own tokens.

    ``forward(hidden_states (B, S, N))`` → (B, S, N), what the HF block returns. The router's
    logits reach HF's ``output_router_logits`` through the router's forward hooks, as in HF.
    """

    def __init__(self, block: nn.Module, family: Family, config: MoEConfig, ep: ExpertParallel, strategy,
                 name: str):
        super().__init__()
        self.family_name = name
        self.family = family
        self.config = config
        self.ep = ep
        self.strategy = strategy
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0)) if family.jitter else 0.0
        # The block's children in its own order (state-dict key order): the router (its class
        # swapped, its tensors kept), the experts (sharded), any other module (shared experts) as is.
        for attr, child in block.named_children():
            if attr == "gate":
                child.__class__ = _router_class(type(child))
                child.interlace_config, child.interlace_family = config, family
                child.interlace_fused = strategy.fused_routing
            elif attr == "experts":
                child = ShardedExperts(child.gate_up_proj, child.down_proj, ep, hf_fp8_scales(child, name))
            setattr(self, attr, child)
        self.kernel_router = KernelRouter(self.gate, family, config)  # (a plain attribute: no state)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        x = hidden_states.reshape(-1, self.config.hidden).contiguous()
        w_up, w_down = self.experts.gate_up_proj, self.experts.down_proj
        compiling = torch.compiler.is_compiling()
        wants_grad = torch.is_grad_enabled() and (
            x.requires_grad or w_up.requires_grad or w_down.requires_grad
            or any(p.requires_grad for p in self.gate.parameters()))
        # (compiled: the custom op refuses an FP8 training call, with the same message)
        train = not compiling and wants_grad
        if train and self.experts.scale_names is not None:
            raise RuntimeError(f"{self.strategy.label}: {FP8_TRAINING}")
        if compiling:  # (the strategy posts inside its own op, and there decides whether it routes)
            # Not while the router has forward hooks: transformers' output capture (router logits
            # for the balance loss) records them from the router's own forward, which must then
            # run in the compiled graph (whether it collects now is a ContextVar Dynamo cannot read).
            routed = self.strategy.routes_itself and not self.gate._forward_hooks and not wants_grad
        else:
            self.ep.check_group()  # the group destroyed: a clear error before any work of the call
            routed = self._routes_in_strategy(x)
            # e.g. auto's agreement with its peers (token count and kind of call), under the router
            routed = self.strategy.begin_call(x.shape[0], train, routed)
        # The shared experts first, on a side stream on CUDA (MoEConfig.shared_overlap), beside
        # the routing and the strategy on this stream; joined below (same sum as HF's).
        shared = None if self.family.shared is None else shared_overlap.start(
            self._shared, hidden_states, overlap=self.config.shared_overlap)
        # (the experts through their module's call: a data-parallel wrapper's hooks see it)
        if routed:
            out = self.experts(x, strategy=self.strategy, router=self.kernel_router).reshape(shape)
        else:
            _, weight, idx = self.gate(x)
            out = self.experts(x, idx, weight, strategy=self.strategy).reshape(shape)
        if shared is not None:
            out = out + shared.join()
        return out

    def _routes_in_strategy(self, x: torch.Tensor) -> bool:
        """As :meth:`interlace.MoELayer._routes_in_strategy`: a ``routes_itself`` strategy that
        takes this call (inference), outside ``torch.compile`` and while no output is collected."""
        return (self.strategy.routes_itself and not torch.compiler.is_compiling() and not _collecting_outputs()
                and self.strategy.routes_call(x, self.kernel_router, self.experts.gate_up_proj,
                                              self.experts.down_proj))

    def _shared(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.family.shared(self, hidden_states)

    def set_strategy(self, name: str, **options) -> None:
        """Switch the strategy (on every rank alike); weights are untouched. As
        :meth:`interlace.MoELayer.set_strategy`: without ``options``, those last given for this
        strategy name hold again; the old strategy's own graphs and plans are dropped."""
        base = strategy_class(name).name
        given = dict(options) if options else self._strategy_options.get(base, {})
        new = make_strategy(name, self.config, self.ep, device=self.experts.down_proj.device, **given)
        new.label = self.strategy.label
        self._strategy_options[base] = given
        self.strategy_spec = name
        old, self.strategy = self.strategy, new
        old.close()
        self.gate.interlace_fused = self.strategy.fused_routing

    def quantize_experts_(self, quant: str = "fp8", strategy: str | None = None) -> None:
        """Make this block's experts FP8 in place (:func:`interlace.quantize_experts`)."""
        quantize_experts(self, quant, strategy)

    def replace_config(self, config: MoEConfig) -> None:
        """(:func:`interlace.quantize_experts`) Take ``config`` (the experts' storage changed)."""
        self.config = self.gate.interlace_config = self.kernel_router.config = config

    def extra_repr(self) -> str:
        c = self.config
        return (f"{self.family_name}: experts={c.num_experts} ({self.ep.num_local}/rank), top_k={c.top_k}, "
                f"router={c.router}, renormalize={c.renormalize}, strategy={self.strategy.name}")


# ----------------------------------------------------------------------------- entry points
def replace_moe_blocks(model: nn.Module, group=None, mesh: MoEMesh | None = None, strategy: str = "auto",
                       strategy_options: dict | None = None, **config_changes) -> list[str]:
    """Replace every transformers sparse-MoE block of ``model`` in place by an
    :class:`InterlaceMoeBlock` that takes over its weights.

    Args:
        model: a transformers 5.x model (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3), on its device,
            with its weights (load the checkpoint before, or load it afterwards with
            ``load_state_dict``, which accepts full HF tensors at any world size).
        group: the expert-parallel process group (default: the world group when
            torch.distributed is initialized, else one process). Every rank of it must hold
            the same model (same weights) and call this alike.
        mesh: a :class:`~interlace.parallel.mesh.MoEMesh` instead of ``group`` (its EP group;
            tensor-parallel experts, tp > 1, are not supported here).
        strategy: an interlace strategy name (``"auto"``, ``"sequential"``, ``"pipelined:2"``, ...).
        strategy_options: the strategy's keyword options.
        config_changes: :class:`MoEConfig` fields to change from the block's own (e.g.
            ``capacity_factor=1.25``; the result then differs from HF's dropless block).

    Returns:
        the qualified names of the replaced blocks. ``ValueError`` if there is none.
    """
    if mesh is not None:
        if group is not None:
            raise ValueError("give the expert-parallel group= or a mesh=, not both")
        if mesh.tp > 1:
            raise ValueError(f"replace_moe_blocks shards whole experts; a mesh with tp={mesh.tp} is not supported")
        group = mesh.ep_group
    for name, module in model.named_modules():
        if type(module).__name__ in UNSUPPORTED:
            raise ValueError(f"{name or type(model).__name__}: {type(module).__name__} is not supported: "
                             f"{UNSUPPORTED[type(module).__name__]}")
    targets = [(name, module) for name, module in model.named_modules() if type(module).__name__ in FAMILIES]
    if not targets:
        known = ", ".join(FAMILIES)
        raise ValueError(f"no transformers MoE block found in {type(model).__name__} (known blocks: {known})")
    for name, block in targets:
        family_name = type(block).__name__
        family = FAMILIES[family_name]
        w = block.experts.gate_up_proj
        fp8 = w.dtype == FP8_DTYPE  # (transformers' FP8Experts: the activations are in the model's dtype)
        dtype = block.gate.weight.dtype if fp8 else w.dtype
        config = MoEConfig(**{**family.config(block), "dtype": dtype, "router_dtype": torch.float32,
                              "expert_quant": "fp8" if fp8 else None, "source": f"{family_name} {name}",
                              **config_changes})
        ep = ExpertParallel.build(group, config.num_experts)
        check_same_across_ranks(config.fingerprint(), ep, f"MoEConfig of {name}", config.math_fields())
        impl = make_strategy(strategy, config, ep, device=w.device, **(strategy_options or {}))
        impl.label = f"{name} (interlace)"
        replacement = InterlaceMoeBlock(block, family, config, ep, impl, family_name)
        replacement._strategy_options = {impl.name: dict(strategy_options or {})}
        replacement.strategy_spec = strategy
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
    return [name for name, _ in targets]


# (the expert / replicated split is the same for MoELayer models: interlace.data_parallel)
expert_parameters = data_parallel.expert_parameters
replicated_parameters = data_parallel.replicated_parameters


def moe_blocks(model: nn.Module) -> list[InterlaceMoeBlock]:
    """The :class:`InterlaceMoeBlock` modules of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, InterlaceMoeBlock)]


def gather_hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every tensor whole: expert shards all-gathered to HF's full
    (E, ...) tensors, FSDP's DTensors gathered: the state dict of the plain transformers model,
    on every rank, in any layout of :func:`interlace.parallelize` (``model``: the parallelized
    model or its DDP wrapper). A collective: call it on every rank."""
    model = data_parallel.unwrapped(model)
    state = {name: _whole(t) for name, t in model.state_dict().items()}
    for name, module in model.named_modules():
        if not isinstance(module, ShardedExperts) or module.ep.world == 1:
            continue
        for attr in module.tensor_names():
            key = f"{name}.{attr}" if name else attr
            shard = state[key].contiguous()
            if shard.dtype == FP8_DTYPE:  # (as bytes: gloo has no float8 type)
                shard = shard.view(torch.uint8)
            parts = [torch.empty_like(shard) for _ in range(module.ep.world)]
            dist.all_gather(parts, shard, group=module.ep.group)
            state[key] = torch.cat(parts).view(state[key].dtype)
    return state


def load_hf_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full HF state dict (the plain transformers model's, or :func:`gather_hf_state_dict`'s)
    into ``model`` in any layout of :func:`interlace.parallelize`: each rank keeps its experts' rows
    and, under FSDP, its shard of every tensor. Every key of the model must be in ``state``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    model = data_parallel.unwrapped(model)
    owners = {f"{name}.{attr}" if name else attr: module for name, module in model.named_modules()
              if isinstance(module, ShardedExperts) for attr in module.tensor_names()}
    missing = [key for key in model.state_dict() if key not in state]
    if missing:
        raise ValueError(f"load_hf_state_dict: the state dict lacks {len(missing)} of the model's keys, e.g. "
                         f"{missing[:3]}")
    with torch.no_grad():
        for key, target in model.state_dict(keep_vars=True).items():
            source = state[key]
            experts = owners.get(key)
            if experts is not None and source.shape[0] == experts.num_experts != experts.ep.num_local:
                source = source[experts.ep.first_expert:experts.ep.first_expert + experts.ep.num_local]
            source = source.to(device=target.device, dtype=target.dtype)
            if isinstance(target, DTensor):  # (this rank's shard of the full tensor every rank holds)
                source = distribute_tensor(source, target.device_mesh, target.placements, src_data_rank=None)
            target.copy_(source)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP's shard) gathered over its mesh; any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
