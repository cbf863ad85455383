"""Memory model: bytes per GPU for a layout (MoNTA §MoE Memory consumption, Tables 3–4).

Weights, gradients and optimizer state (Table 3, Adam with bf16/fp16 weights and gradients, fp32
master weights and two fp32 moments: 2 + 2 + 12 = 16 bytes per parameter). A GPU holds
``P₁/(t·p)`` of the non-MoE parameters and ``P₂/(t·p·e)`` of the experts; ZeRO shards over the
R replicas of each parameter (R₁ = all data-parallel copies of the non-MoE part, R₂ = the copies
of one expert shard):

    no ZeRO: 16·P      ZeRO-1: (4 + 12/R)·P      ZeRO-2: (2 + 14/R)·P      ZeRO-3: 16·P/R

(Table 3 writes R as p; with t = p = 1 and R data-parallel ranks its rows are these.)

Activations per GPU (Table 4; b micro-batch, s sequence per CP rank, h hidden, a heads, l layers,
k top-k, t TP; with 1F1B the first pipeline stage holds min(p, m) micro-batches of its l/p
layers, i.e. l layers' worth when m ≥ p):

    no TP/SP                  b·s·h·l·(13 + 21k + 5as/h)                       (Eq. 2)
    TP (+EP)                  b·s·h·l·(5 + 5k + (8 + 16k)/t + 5as/(h·t))
    TP + SP                   b·s·h·l·((13 + 21k)/t + 5as/(h·t))
    TP + SP + selective       b·s·h·l·(13 + 21k)/t
    full recomputation        2·b·s·h·l/t   (2·b·s·h·l without SP)

The OCR of Table 4's "PP+TP+EP" row is garbled; the row above is the one that agrees with both
its own total (13 + 21k without TP) and Megatron's dense case (k = 1: 10 + 24/t, Korthikanti et
al. 2022). With FlashAttention (``flash_attention=True``, the default) the 5as/h score term is
not stored and is dropped.

interlace's own buffers (one MoE layer at a time, transient): the dispatch send and receive
buffers (2·T·k·N elements), the gate/up output (T·k·up_width), the activation (T·k·K) and the
fp32 combine output (T·N·4 bytes); with TP forms O1–O3 the gathered rows add T·k·N.
"""

from __future__ import annotations

from dataclasses import dataclass

from interlace.planning.monta.model import ModelSpec

RECOMPUTE = ("none", "selective", "full")


def weight_bytes(params: float, replicas: int, zero: int, tp: int = 1, pp: int = 1, ep: int = 1) -> float:
    """Table 3: bytes per GPU of weights + gradients + Adam state for ``params`` parameters."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3, got {zero}")
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    p = params / (tp * pp * ep)
    R = replicas
    return {0: 16 * p, 1: (4 + 12 / R) * p, 2: (2 + 14 / R) * p, 3: 16 * p / R}[zero]


def activation_coef(k: int, tp: int, sp: bool, recompute: str, heads: int, seq: int, hidden: int,
                    flash_attention: bool = True) -> float:
    """Table 4's bracket: activation bytes per layer per (b·s·h)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    t = tp
    if recompute == "full":
        return 2.0 / t if sp else 2.0
    scores = 0.0 if (flash_attention or recompute == "selective") else 5.0 * heads * seq / hidden / t
    if sp:
        return (13 + 21 * k) / t + scores
    return 5 + 5 * k + (8 + 16 * k) / t + scores


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by part."""

    non_moe_weights: float
    moe_weights: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.non_moe_weights + self.moe_weights + self.activations + self.buffers

    def gib(self) -> dict:
        g = 1024 ** 3
        return {"non_moe_weights": self.non_moe_weights / g, "moe_weights": self.moe_weights / g,
                "activations": self.activations / g, "buffers": self.buffers / g, "total": self.total / g}


def interlace_buffer_bytes(model: ModelSpec, tokens: int, tp: int, form: str, bpe: int) -> float:
    """Transient buffers of one MoE layer call (see the module docstring); ``tokens`` per GPU."""
    m = model.moe
    rows = tokens * m.top_k
    elems = 2 * rows * m.hidden + rows * (m.up_width // tp) + rows * (m.ffn // tp)
    if tp > 1 and form != "O0":
        elems += rows * m.hidden
    return elems * bpe + tokens * m.hidden * 4


def estimate(model: ModelSpec, *, micro_batch: int, seq: int, tp: int, ep: int, cp: int, pp: int,
             replicas_non_moe: int, replicas_moe: int, microbatches: int, zero: int = 1, sp: bool = True,
             recompute: str = "selective", flash_attention: bool = True, form: str = "O0",
             bpe: int = 2) -> MemoryEstimate:
    """Bytes per GPU of one layout; ``seq`` is the full sequence (each CP rank holds seq/cp)."""
    if model.moe.num_experts % ep:
        raise ValueError(f"{model.moe.num_experts} experts do not divide over EP={ep}")
    w1 = weight_bytes(model.non_moe_params(), replicas_non_moe, zero, tp, pp)
    w2 = weight_bytes(model.moe_params(), replicas_moe, zero, tp, pp, ep)
    s_local = seq / cp
    coef = activation_coef(model.moe.top_k, tp, sp, recompute, model.heads, int(s_local), model.hidden,
                           flash_attention)
    in_flight = min(pp, max(1, microbatches))
    act = micro_batch * s_local * model.hidden * (model.layers / pp) * in_flight * coef
    tokens = int(micro_batch * s_local)
    buf = interlace_buffer_bytes(model, tokens, tp, form, bpe)
    return MemoryEstimate(w1, w2, act, buf)


def usable_bytes(memory_gib: float) -> float:
    """What a training process may plan to use: 92% of the GPU, less 2 GiB (CUDA context, NCCL
    buffers, allocator fragmentation)."""
    return (0.92 * memory_gib - 2.0) * 1024 ** 3
