"""Configuration of one MoE layer: :class:`MoEConfig` and the model-shape presets.

Shapes in the docstrings use: T tokens on this rank, N hidden size, K expert FFN size,
E experts in all, k experts per token (top-k), W expert-parallel world size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import torch

Activation = Literal["swiglu", "gelu", "relu"]
RouterKind = Literal["softmax", "sigmoid"]
RouterGemm = Literal["split", "input", "upcast"]
GroupScore = Literal["top2_sum", "max"]
ExpertQuant = Literal[None, "fp8"]

ACTIVATIONS: tuple[str, ...] = ("swiglu", "gelu", "relu")
ROUTERS: tuple[str, ...] = ("softmax", "sigmoid")
ROUTER_GEMMS: tuple[str, ...] = ("split", "input", "upcast")
GROUP_SCORES: tuple[str, ...] = ("top2_sum", "max")
EXPERT_QUANTS: tuple[str | None, ...] = (None, "fp8")
# Activation dtypes the FP8 expert kernels take (their rows are quantized to e4m3 inside them).
FP8_ACTIVATION_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
# Activation / weight dtypes the fast paths support. fp64 is for references and CPU tests.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
ROUTER_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)


def _dtype_of_name(value):
    """``torch.float32`` for ``"float32"`` or ``"torch.float32"`` (what a config file or a command
    line gives); anything else unchanged, for :meth:`MoEConfig.validate` to judge."""
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return value


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer.

    Args:
        hidden: N, the model (token) dimension.
        ffn: K, the intermediate size of one expert.
        num_experts: E, routed experts in the whole layer (all ranks together).
        top_k: k, experts chosen per token.
        activation: ``"swiglu"`` (gate and up projections, ``silu(x Wg) * (x Wu)``),
            ``"gelu"`` or ``"relu"`` (one up projection).
        router: ``"softmax"``: weights are the softmax probabilities of the chosen experts.
            ``"sigmoid"``: DeepSeek-V3 style, scores ``sigmoid(logits)``; a per-expert bias
            (a buffer, not learned by gradient) is added for the *choice* only and the
            weights are the unbiased scores of the chosen experts.
        renormalize: divide the chosen k weights by their sum.
        route_scale: multiply the routing weights by this (DeepSeek-V3's routed_scaling_factor).
        capacity_factor: ``None`` means dropless. Otherwise each rank lets each expert take at
            most ``ceil(capacity_factor * T * k / E)`` of its own T tokens' assignments; the
            assignments are served slot-major (every token's first choice, in token order,
            before any second choice) and the rest are dropped: a dropped assignment adds
            nothing to its token's output (the kept weights are not renormalized).
        aux_loss_coef: weight of the Switch-style load-balancing loss ``E * sum_e f_e * P_e``
            computed over this rank's tokens; 0 disables it.
        dtype: dtype of the expert weights and the activations the layer takes: a
            ``torch.dtype`` or its name (``"bfloat16"``, ``"torch.float32"``), stored as the dtype.
        router_dtype: dtype of the router weights, the logits and the routing computation (a
            ``torch.dtype`` or its name, as ``dtype``).
        router_gemm: how the router's logits GEMM ``x @ W_router^T`` runs when the activations
            are 16-bit. ``"split"`` (bf16 activations, fp32 router): one bf16 tensor-core GEMM
            against the weight's three bf16 pieces, whose sum is the fp32 weight exactly, split
            in registers (:mod:`interlace.kernels.router_gemm`); every product is exact in the
            fp32 accumulator, so the logits are fp32-class (only the accumulation rounds) and
            the top-k almost always equals the fp32 GEMM's, at about a bf16 GEMM's cost.
            ``"input"``: both operands rounded to the activations' dtype, fp32 accumulation;
            the fastest, but the rounded weight changes the top-k of many tokens.
            ``"upcast"``: the activations converted to ``router_dtype`` and an fp32 (fp64)
            GEMM: exact products without the split, but a full-precision GEMM plus a
            conversion of the activations, several times ``"split"``'s cost on GPUs
            (``docs/performance.md``). Other cases (fp16 activations with ``"split"``,
            fp32/fp64 activations) take ``"upcast"``'s path.
        softmax_after_topk: softmax router only: choose the k experts of the largest logits and
            take the softmax over those k logits as the weights (top-k, then softmax), instead
            of the softmax over all E experts' logits gathered at the k chosen (softmax, then
            top-k; with ``renormalize`` the two are equal in exact arithmetic).
        n_group: group-limited routing (DeepSeek-V2/V3): the E experts form ``n_group`` groups of
            E / n_group consecutive experts; each token first keeps its ``topk_group`` best
            groups, then chooses its k experts among theirs. 1: no groups.
        topk_group: groups kept per token (default: all ``n_group``, no limit).
        group_score: a group's score for that choice, from the choice scores (with the
            selection bias): ``"top2_sum"``, the sum of its two best (DeepSeek-V3), or
            ``"max"``, its best (DeepSeek-V2's ``group_limited_greedy``).
        shared_ffn: intermediate size of the shared expert, a dense FFN with the routed
            experts' activation applied to every token beside them (DeepSeek's
            ``n_shared_experts`` always-on experts are one FFN of n_shared·K; Qwen2-MoE's
            ``shared_expert_intermediate_size``); 0: none. Its weights are replicated.
        shared_gate: scale the shared expert's output per token by ``sigmoid(x · w_gate)``
            (Qwen2-MoE's ``shared_expert_gate``, w_gate (1, N)).
        shared_overlap: on CUDA, run the shared expert on a side stream while the routed experts
            are routed, dispatched, computed and combined, forward and backward (Megatron's
            shared-expert overlap, :mod:`interlace.shared_overlap`); False runs it after them on
            the current stream. The result is the same either way (not part of
            :meth:`fingerprint`); nothing changes on a CPU.
        expert_quant: how the routed experts' weights are stored. None: dense, in ``dtype``.
            ``"fp8"``: block-scaled FP8 (:mod:`interlace.fp8`, DeepSeek-V3's checkpoint layout):
            each expert weight is float8_e4m3fn with one fp32 scale per 128 × 128 block
            (``experts.w_up`` + ``experts.w_up_scale_inv``, ``experts.w_down`` +
            ``experts.w_down_scale_inv``), so the expert weights are then *not* in ``dtype``
            (``dtype`` stays the activations', bf16/fp16/fp32, and the router's and shared
            expert's weights'). The expert GEMMs are W8A8: their input rows are quantized per
            token and group of 128 columns inside the kernels, accumulation in fp32. Inference
            only (a call that builds an autograd graph raises); strategies whose
            ``fp8_experts`` is True run it (``sequential``, ``persistent``, ``tp_ep`` where
            K % (128·tp) == 0; ``auto`` picks among those).
            :func:`interlace.quantize_experts` converts a dense model in place; docs/fp8.md.
        source: where the shape comes from (for presets).
    """

    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    activation: Activation = "swiglu"
    router: RouterKind = "softmax"
    renormalize: bool = False
    route_scale: float = 1.0
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.0
    dtype: torch.dtype = torch.bfloat16
    router_dtype: torch.dtype = torch.float32
    router_gemm: RouterGemm = "split"
    softmax_after_topk: bool = False
    n_group: int = 1
    topk_group: int | None = None
    group_score: GroupScore = "top2_sum"
    shared_ffn: int = 0
    shared_gate: bool = False
    shared_overlap: bool = True
    expert_quant: ExpertQuant = None
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("dtype", "router_dtype"):
            object.__setattr__(self, name, _dtype_of_name(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` for a configuration no strategy can run."""
        for name in ("hidden", "ffn", "num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"MoEConfig.{name} must be an int, got {type(value).__name__}")
        if self.hidden <= 0 or self.ffn <= 0 or self.num_experts <= 0:
            raise ValueError(
                f"MoEConfig sizes must be positive: hidden={self.hidden}, ffn={self.ffn}, "
                f"num_experts={self.num_experts}"
            )
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts={self.num_experts}, got {self.top_k}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.activation!r}; choose one of {ACTIVATIONS}")
        if self.router not in ROUTERS:
            raise ValueError(f"unsupported router {self.router!r}; choose one of {ROUTERS}")
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"unsupported dtype {self.dtype!r}; choose one of {SUPPORTED_DTYPES} (or its name)")
        if not isinstance(self.router_dtype, torch.dtype) or self.router_dtype not in ROUTER_DTYPES:
            raise TypeError(f"unsupported router_dtype {self.router_dtype!r}; choose one of {ROUTER_DTYPES} "
                            f"(or its name)")
        if self.router_gemm not in ROUTER_GEMMS:
            raise ValueError(f"unsupported router_gemm {self.router_gemm!r}; choose one of {ROUTER_GEMMS}")
        if self.capacity_factor is not None:
            if isinstance(self.capacity_factor, bool) or not isinstance(self.capacity_factor, (int, float)):
                raise TypeError("capacity_factor must be a number or None")
            if not math.isfinite(self.capacity_factor) or self.capacity_factor <= 0:
                raise ValueError(f"capacity_factor must be > 0 (or None for dropless), got {self.capacity_factor}")
        if not math.isfinite(self.route_scale) or self.route_scale <= 0:
            raise ValueError(f"route_scale must be a positive finite number, got {self.route_scale}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        if self.softmax_after_topk and self.router != "softmax":
            raise ValueError("softmax_after_topk is for the softmax router")
        for name in ("n_group", "shared_ffn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (name == "n_group" and value < 1):
                raise ValueError(f"MoEConfig.{name} must be an int >= {1 if name == 'n_group' else 0}, got {value!r}")
        if self.num_experts % self.n_group:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
        groups = self.groups_kept
        if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= self.n_group:
            raise ValueError(f"topk_group must be in 1..n_group={self.n_group}, got {self.topk_group!r}")
        if groups * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError(f"topk_group={groups} groups of {self.num_experts // self.n_group} experts hold fewer "
                             f"than top_k={self.top_k} experts")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"unsupported group_score {self.group_score!r}; choose one of {GROUP_SCORES}")
        if self.group_limited and self.group_score == "top2_sum" and self.num_experts // self.n_group < 2:
            raise ValueError("group_score='top2_sum' needs at least 2 experts per group")
        if not isinstance(self.shared_overlap, bool):
            raise TypeError(f"MoEConfig.shared_overlap must be a bool, got {self.shared_overlap!r}")
        if self.shared_gate and not self.shared_ffn:
            raise ValueError("shared_gate needs a shared expert (shared_ffn > 0)")
        if self.expert_quant not in EXPERT_QUANTS:
            raise ValueError(f"unsupported expert_quant {self.expert_quant!r}; choose one of {EXPERT_QUANTS}")
        if self.expert_quant == "fp8" and self.dtype not in FP8_ACTIVATION_DTYPES:
            raise ValueError(f"expert_quant='fp8' takes bf16/fp16/fp32 activations (dtype), got {self.dtype}")

    # ----------------------------------------------------------------- derived
    @property
    def groups_kept(self) -> int:
        """Groups each token keeps (``topk_group``, default ``n_group``)."""
        return self.n_group if self.topk_group is None else self.topk_group

    @property
    def group_limited(self) -> bool:
        """Whether group-limited routing removes any expert from a token's choice."""
        return self.groups_kept < self.n_group

    @property
    def gated(self) -> bool:
        """SwiGLU has two input projections (gate and up); GELU/ReLU one."""
        return self.activation == "swiglu"

    @property
    def up_width(self) -> int:
        """Columns of the first projection: 2K for SwiGLU (gate then up), K otherwise."""
        return 2 * self.ffn if self.gated else self.ffn

    def capacity(self, num_tokens: int) -> int | None:
        """Per-rank, per-expert capacity for ``num_tokens`` local tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def flops_per_token(self) -> int:
        """Routed-expert FLOPs per token (forward): 2·k·N·K per projection, 3 projections for
        SwiGLU (the shared expert's are not counted)."""
        projections = 3 if self.gated else 2
        return 2 * self.top_k * self.hidden * self.ffn * projections

    def with_(self, **changes) -> MoEConfig:
        return dataclasses.replace(self, **changes)

    def math_fields(self) -> dict[str, str]:
        """The ``repr`` of every field that changes the math, by name: what ranks must agree on
        (:meth:`fingerprint` hashes them; a mismatch is reported field by field)."""
        fields = dataclasses.asdict(self)
        for name in ("source", "shared_overlap"):
            fields.pop(name)
        return {name: repr(value) for name, value in fields.items()}

    def fingerprint(self) -> int:
        """A 63-bit hash of :meth:`math_fields`, used to check ranks agree."""
        text = repr(sorted(self.math_fields().items()))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


# Model shapes the benchmarks use (docs/benchmarking.md). Each cites where its numbers come from.
PRESETS: dict[str, MoEConfig] = {
    "mixtral-8x7b": MoEConfig(
        hidden=4096, ffn=14336, num_experts=8, top_k=2,
        source="Mixtral of Experts (Jiang et al. 2024) and mistralai/Mixtral-8x7B-v0.1 config.json; "
        "COMET Table 2",
    ),
    "phi3.5-moe": MoEConfig(
        hidden=4096, ffn=6400, num_experts=16, top_k=2,
        source="microsoft/Phi-3.5-MoE-instruct config.json; COMET Table 2",
    ),
    "qwen2-moe": MoEConfig(
        hidden=2048, ffn=1408, num_experts=64, top_k=4,
        source="COMET Table 2 (Qwen2-MoE-2.7B: 64 experts, top-4, 2048/1408)",
    ),
    "qwen3-30b-a3b": MoEConfig(
        hidden=2048, ffn=768, num_experts=128, top_k=8, renormalize=True,
        source="Qwen/Qwen3-30B-A3B config.json (moe_intermediate_size 768, 128 experts, 8 active, "
        "norm_topk_prob true)",
    ),
    "dsv3-like": MoEConfig(
        hidden=7168, ffn=2048, num_experts=256, top_k=8, router="sigmoid", renormalize=True,
        route_scale=2.5,
        source="DeepSeek-V3 technical report §2.1.2 and deepseek-ai/DeepSeek-V3 config.json "
        "(routed experts only; sigmoid scores with selection bias, routed_scaling_factor 2.5)",
    ),
    "flashdmoe-cfg": MoEConfig(
        hidden=2048, ffn=2048, num_experts=64, top_k=2,
        source="FlashDMoE §4 (embedding 2048, FFN 2048, top-2; 64 experts as in the benchmarks)",
    ),
}


def preset(name: str, **changes) -> MoEConfig:
    """A preset by name (a key of :data:`PRESETS`), with optional field changes."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name].with_(**changes) if changes else PRESETS[name]
