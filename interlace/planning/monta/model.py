"""Whole-model descriptions for planning: an MoE layer shape (:class:`MoEConfig`) plus what the
memory model needs (layers, attention, vocabulary). Presets extend the layer presets of
``interlace.config`` with their models' published configs; each cites its source."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from interlace.config import PRESETS, MoEConfig, preset


@dataclass(frozen=True)
class ModelSpec:
    """A transformer with MoE layers.

    Args:
        name: preset name or file stem.
        moe: the MoE layer shape (hidden N, expert FFN K, experts E, top-k).
        layers: transformer layers l; ``moe_layers`` of them are MoE (default: all), the rest
            dense with FFN size ``dense_ffn`` (SwiGLU).
        heads, kv_heads, head_dim: attention shape a; ``attn_params`` overrides the attention
            parameter count per layer (e.g. MLA).
        vocab: vocabulary; ``tied`` if input and output embeddings share weights.
    """

    name: str
    moe: MoEConfig
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    moe_layers: int | None = None
    dense_ffn: int = 0
    attn_params: int | None = None
    tied: bool = False
    source: str = ""

    def __post_init__(self):
        if self.layers < 1 or self.heads < 1 or self.kv_heads < 1 or self.head_dim < 1 or self.vocab < 1:
            raise ValueError(f"model {self.name}: layers, heads, kv_heads, head_dim, vocab must be >= 1")
        if self.moe_layers is not None and not 0 <= self.moe_layers <= self.layers:
            raise ValueError(f"model {self.name}: moe_layers must be in 0..layers")

    @property
    def hidden(self) -> int:
        return self.moe.hidden

    @property
    def n_moe(self) -> int:
        return self.layers if self.moe_layers is None else self.moe_layers

    def attention_params(self) -> int:
        if self.attn_params is not None:
            return self.attn_params
        h, hd = self.hidden, self.head_dim
        return h * self.heads * hd * 2 + h * self.kv_heads * hd * 2 + 2 * h  # q, o, k, v, two norms

    def non_moe_params(self) -> int:
        """P1 (MoNTA Table 2): attention, norms, routers, dense layers, embeddings."""
        dense = (self.layers - self.n_moe) * 3 * self.hidden * self.dense_ffn
        routers = self.n_moe * self.moe.num_experts * self.hidden
        return (self.layers * self.attention_params() + dense + routers
                + self.vocab * self.hidden * (1 if self.tied else 2))

    def moe_params(self) -> int:
        """P2: the routed experts of every MoE layer."""
        projections = 3 if self.moe.gated else 2
        return self.n_moe * self.moe.num_experts * self.hidden * self.moe.ffn * projections

    def to_json(self) -> dict:
        m = self.moe
        return {"name": self.name, "hidden": m.hidden, "ffn": m.ffn, "num_experts": m.num_experts,
                "top_k": m.top_k, "activation": m.activation, "layers": self.layers, "heads": self.heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "vocab": self.vocab,
                "moe_layers": self.moe_layers, "dense_ffn": self.dense_ffn, "attn_params": self.attn_params,
                "tied": self.tied, "source": self.source}

    @staticmethod
    def from_json(d: dict) -> "ModelSpec":
        moe = MoEConfig(hidden=int(d["hidden"]), ffn=int(d["ffn"]), num_experts=int(d["num_experts"]),
                        top_k=int(d["top_k"]), activation=d.get("activation", "swiglu"))
        return ModelSpec(d["name"], moe, int(d["layers"]), int(d["heads"]), int(d.get("kv_heads", d["heads"])),
                         int(d.get("head_dim", moe.hidden // int(d["heads"]))), int(d["vocab"]),
                         d.get("moe_layers"), int(d.get("dense_ffn", 0)), d.get("attn_params"),
                         bool(d.get("tied", False)), d.get("source", ""))


MODEL_PRESETS: dict[str, ModelSpec] = {
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", preset("mixtral-8x7b"), 32, 32, 8, 128, 32000,
                              source="mistralai/Mixtral-8x7B-v0.1 config.json (46.7B parameters)"),
    "phi3.5-moe": ModelSpec("phi3.5-moe", preset("phi3.5-moe"), 32, 32, 8, 128, 32064,
                            source="microsoft/Phi-3.5-MoE-instruct config.json"),
    "qwen2-moe": ModelSpec("qwen2-moe", preset("qwen2-moe"), 24, 16, 16, 128, 151936,
                           source="Qwen/Qwen1.5-MoE-A2.7B config.json (the shared expert is not modelled)"),
    "qwen3-30b-a3b": ModelSpec("qwen3-30b-a3b", preset("qwen3-30b-a3b"), 48, 32, 4, 128, 151936,
                               source="Qwen/Qwen3-30B-A3B config.json"),
    "dsv3-like": ModelSpec("dsv3-like", preset("dsv3-like"), 61, 128, 128, 128, 129280, moe_layers=58,
                           dense_ffn=18432, attn_params=187_000_000,
                           source="deepseek-ai/DeepSeek-V3 config.json: 61 layers, first 3 dense (FFN 18432); "
                           "MLA ≈ 187M parameters per layer; routed experts only (shared expert not modelled)"),
    "flashdmoe-cfg": ModelSpec("flashdmoe-cfg", preset("flashdmoe-cfg"), 24, 16, 16, 128, 32000,
                               source="FlashDMoE §4 layer shape; 24 layers, 16 heads, vocab 32000 assumed"),
    "monta-2x70b": ModelSpec("monta-2x70b", MoEConfig(hidden=8192, ffn=28672, num_experts=2, top_k=1,
                                                      source="MoNTA 2x70B: two Llama-2-70B-shaped experts"),
                             80, 64, 8, 128, 32000,
                             source="MoNTA §Evaluation (2x70B, h = 8192, EP = 2, one expert per node); "
                             "Llama-2-70B shapes (80 layers, 64 heads, 8 KV heads, FFN 28672); top-1 assumed. "
                             "With Adam state (16 B/parameter) this 125B model does not fit 16×80 GB even with "
                             "ZeRO-3; MoNTA does not say how it fit it"),
}
assert set(PRESETS) <= set(MODEL_PRESETS)


def load_model(spec: str | Path | ModelSpec) -> ModelSpec:
    """A model preset name or a JSON file (:meth:`ModelSpec.to_json`'s format)."""
    if isinstance(spec, ModelSpec):
        return spec
    if str(spec) in MODEL_PRESETS:
        return MODEL_PRESETS[str(spec)]
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"{spec!r} is neither a model preset ({', '.join(MODEL_PRESETS)}) nor a JSON file")
    return ModelSpec.from_json(json.loads(path.read_text()))


def with_dtype(model: ModelSpec, dtype: str) -> ModelSpec:
    """The model in the cluster's training dtype (fp16 on GPUs without bf16)."""
    want = torch.float16 if dtype == "fp16" else torch.bfloat16
    if model.moe.dtype == want:
        return model
    from dataclasses import replace

    return replace(model, moe=model.moe.with_(dtype=want))
