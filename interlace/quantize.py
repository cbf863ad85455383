"""FP8 experts for a dense model, in place: :func:`quantize_experts`.

Every interlace MoE layer of a model (:class:`interlace.MoELayer`, and the transformers blocks
:func:`interlace.hf.replace_moe_blocks` made) gets block-scaled FP8 expert weights
(:mod:`interlace.fp8`: e4m3 values, one fp32 scale per 128 × 128 block, what DeepSeek-V3's
checkpoints hold), its config ``expert_quant="fp8"`` and its strategy built again for it. The
router, the shared expert and everything outside the layers stay as they are.

Everything is checked on every layer before any is changed (a strategy that does not run FP8
experts, a tensor-parallel slice that cuts the 128-blocks, an fp64 layer), so an error leaves the model as
it was.
"""

from __future__ import annotations

from torch import nn

from interlace.config import EXPERT_QUANTS, MoEConfig
from interlace.experts import ExpertShard, check_fp8_ffn_slice
from interlace.strategies.base import check_expert_quant


def expert_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every interlace MoE layer of ``model`` (itself included): the
    modules with a :class:`MoEConfig` ``config``, an :class:`ExpertShard` ``experts`` and
    ``set_strategy`` (``MoELayer``, ``interlace.hf.InterlaceMoeBlock``), in module order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "config", None), MoEConfig) and isinstance(getattr(m, "experts", None), ExpertShard)
            and hasattr(m, "set_strategy")]


def quantize_experts(model: nn.Module, quant: str = "fp8", strategy: str | None = None) -> list[str]:
    """Convert the routed experts of every interlace MoE layer of ``model`` to ``quant`` in place.

    Args:
        model: a model holding interlace MoE layers (or one layer). Call it on every rank alike
            (each converts its own experts; nothing is communicated).
        quant: ``"fp8"``: each expert weight ``W`` (..., R, C) becomes e4m3 ``W`` and fp32
            ``W_scale_inv`` (..., ⌈R/128⌉, ⌈C/128⌉), parameters without gradients
            (:func:`interlace.fp8.quantize_weight`); the layer's config gets ``expert_quant="fp8"``.
        strategy: the strategy each layer runs afterwards (default: the one it was given, built
            again for the new config); it must run FP8 experts (``ValueError`` otherwise,
            naming those that do).

    Returns:
        the qualified names of the converted layers (``""``: ``model`` itself). Layers whose
        experts are FP8 already are left alone. ``ValueError`` if ``model`` has no layer.
    """
    if quant not in EXPERT_QUANTS or quant is None:
        raise ValueError(f"quantize_experts: unsupported quant {quant!r}; choose one of "
                         f"{[q for q in EXPERT_QUANTS if q is not None]}")
    layers = expert_layers(model)
    if not layers:
        raise ValueError(f"quantize_experts: {type(model).__name__} holds no interlace MoE layer (MoELayer, or a "
                         f"transformers block replaced by interlace.hf.replace_moe_blocks)")
    todo = []
    for name, layer in layers:  # every check first: an error leaves the model unchanged
        if layer.experts.expert_quant == quant:
            continue
        where = name or type(layer).__name__
        try:
            config = layer.config.with_(expert_quant=quant)
            spec = strategy or layer.strategy_spec
            check_expert_quant(spec, config)
            check_fp8_ffn_slice(getattr(layer.experts, "ffn_slice", (0, config.ffn)), config.ffn)
        except ValueError as err:
            raise ValueError(f"quantize_experts: {where}: {err}") from None
        todo.append((name, layer, config, spec))
    for _, layer, config, spec in todo:
        layer.experts.quantize_()
        layer.replace_config(config)
        layer.set_strategy(spec)
    return [name for name, *_ in todo]
