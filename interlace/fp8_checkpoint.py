"""FP8 expert checkpoints of other layouts → interlace's (:class:`~interlace.fp8.BlockFP8Weight`
``w_up`` (E, up_width, N), ``w_down`` (E, N, K)), and back.

interlace's SwiGLU up projection stacks the gate rows [0, K) over the up rows [K, 2K) and
quantizes the stack as one matrix: its scale grid has ⌈2K/128⌉ block rows, block b covering
stacked rows [128·b, 128·b + 128). The layouts:

* transformers' ``FP8Experts`` (``gate_up_proj`` (E, 2K, N) + ``gate_up_proj_scale_inv``
  (E, ⌈2K/128⌉, ⌈N/128⌉), gate first (``chunk(2)``), ``down_proj`` (E, N, K) +
  ``down_proj_scale_inv``): interlace's layout exactly (:func:`from_transformers`).
* DeepSeek-V3's checkpoints (``experts.{e}.gate_proj.weight`` (K, N) +
  ``.weight_scale_inv`` (⌈K/128⌉, ⌈N/128⌉), ``up_proj`` alike, ``down_proj`` (N, K)):
  gate and up quantized separately (:func:`from_deepseek`, :func:`to_deepseek`).
* vLLM's and SGLang's fused MoE (``w13_weight`` (E, 2K, N), gate (w1) rows first, +
  ``w13_weight_scale_inv`` (E, 2·⌈K/128⌉, ⌈N/128⌉): the gate's grid over the up's; ``w2_weight``
  (E, N, K) + ``w2_weight_scale_inv``) (:func:`from_vllm`, :func:`to_vllm`).

**The partial-block rule.** Where K is a multiple of 128 the gate's and the up's grids stacked
*are* the stacked matrix's grid: the conversion is exact, values and scales copied. Where it is
not, a block of the stacked matrix holds the gate's last rows and the up's first rows, which the
separate grids scale differently: no exact conversion exists. The loaders then raise
``ValueError``, unless ``requantize=True``: the two halves are dequantized (fp32) and the stack
quantized again (:func:`~interlace.fp8.quantize_weight`), a second rounding of every up row
(the relative error of one e4m3 rounding, ≤ 2⁻⁴, again on those values).

Scales in ue8m0 (``torch.float8_e8m0fnu``, powers of two) are converted to fp32 exactly.
"""

from __future__ import annotations

import torch

from interlace.fp8 import FP8_BLOCK, BlockFP8Weight, blocks, quantize_weight

SCALE_SUFFIX = "_scale_inv"


def fp32_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as fp32: ue8m0 (powers of two) exactly; fp32 as they are."""
    if scale.dtype == torch.float32:
        return scale
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None) or scale.dtype in (torch.bfloat16, torch.float16):
        return scale.float()
    raise TypeError(f"block scales must be fp32 or ue8m0 (float8_e8m0fnu), got {scale.dtype}")


def stack_gate_up(gate: BlockFP8Weight, up: BlockFP8Weight, requantize: bool = False,
                  where: str = "gate/up") -> BlockFP8Weight:
    """(..., K, N) gate and up, each with its own block grid → interlace's stacked (..., 2K, N),
    gate rows first. Exact where K % 128 == 0; else ``ValueError`` unless ``requantize``
    (module doc: the partial-block rule)."""
    K = gate.shape[-2]
    if up.shape != gate.shape:
        raise ValueError(f"{where}: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if K % FP8_BLOCK == 0:
        return BlockFP8Weight(torch.cat([gate.weight, up.weight], dim=-2),
                              torch.cat([gate.scale_inv, up.scale_inv], dim=-2))
    if not requantize:
        raise ValueError(f"{where}: the expert FFN size K={K} is not a multiple of {FP8_BLOCK}, so a block of the stacked "
                         f"gate/up matrix holds rows of both, which their own scale grids scale differently; pass "
                         f"requantize=True to dequantize and quantize the stack again (a second rounding)")
    return quantize_weight(torch.cat([gate.dequantize(), up.dequantize()], dim=-2))


def split_gate_up(w_up: BlockFP8Weight, requantize: bool = False,
                  where: str = "w_up") -> tuple[BlockFP8Weight, BlockFP8Weight]:
    """interlace's stacked (..., 2K, N) → (gate, up), each (..., K, N) with its own block grid;
    the inverse of :func:`stack_gate_up`, with the same rule."""
    K = w_up.shape[-2] // 2
    if K % FP8_BLOCK == 0:
        kb = K // FP8_BLOCK
        return (BlockFP8Weight(w_up.weight[..., :K, :].contiguous(), w_up.scale_inv[..., :kb, :].contiguous()),
                BlockFP8Weight(w_up.weight[..., K:, :].contiguous(), w_up.scale_inv[..., kb:, :].contiguous()))
    if not requantize:
        raise ValueError(f"{where}: the expert FFN size K={K} is not a multiple of {FP8_BLOCK}: the stacked matrix's "
                         f"blocks do not split into the gate's and the up's; pass requantize=True (a second rounding)")
    dense = w_up.dequantize()
    return quantize_weight(dense[..., :K, :]), quantize_weight(dense[..., K:, :])


# ----------------------------------------------------------------------------- transformers
def from_transformers(gate_up_proj: torch.Tensor, gate_up_proj_scale_inv: torch.Tensor, down_proj: torch.Tensor,
                      down_proj_scale_inv: torch.Tensor) -> tuple[BlockFP8Weight, BlockFP8Weight]:
    """transformers' ``FP8Experts`` tensors → (w_up, w_down): the same tensors (scales as fp32).

    ``gate_up_proj`` (E, 2K, N) e4m3 is quantized as one stacked matrix, gate rows first, which
    is interlace's layout, so nothing moves. A scale grid of 2·⌈K/128⌉ rows where the stack has
    ⌈2K/128⌉ (transformers allocates at least 2 rows: K ≤ 64) is the per-half grid of a
    converted checkpoint: that takes :func:`from_vllm`'s rule.
    """
    up_scale = fp32_scales(gate_up_proj_scale_inv)
    K = gate_up_proj.shape[-2] // 2
    if up_scale.shape[-2] != blocks(2 * K) and up_scale.shape[-2] == 2 * blocks(K):
        return from_vllm(gate_up_proj, up_scale, down_proj, down_proj_scale_inv)
    return (BlockFP8Weight(gate_up_proj.detach(), up_scale.detach()),
            BlockFP8Weight(down_proj.detach(), fp32_scales(down_proj_scale_inv).detach()))


# ----------------------------------------------------------------------------- DeepSeek-V3
def deepseek_keys(prefix: str, expert: int, proj: str) -> tuple[str, str]:
    """(weight key, scale key) of one expert projection in a DeepSeek-V3 checkpoint:
    ``{prefix}experts.{e}.{proj}.weight`` and ``...weight_scale_inv`` (``prefix`` e.g.
    ``"model.layers.3.mlp."``)."""
    base = f"{prefix}experts.{expert}.{proj}"
    return f"{base}.weight", f"{base}.weight{SCALE_SUFFIX}"


def from_deepseek(state_dict: dict, prefix: str, experts, requantize: bool = False
                  ) -> tuple[BlockFP8Weight, BlockFP8Weight]:
    """DeepSeek-V3's per-expert FP8 tensors → (w_up (len(experts), 2K, N), w_down
    (len(experts), N, K)) for the expert ids ``experts`` (a rank's own: ``range(first, first + n)``).

    ``gate_proj`` and ``up_proj`` (K, N) are stacked gate first (the module doc's rule where
    K % 128 ≠ 0: ``ValueError``, or ``requantize=True``); ``down_proj`` (N, K) as it is."""
    experts = list(experts)
    if not experts:
        raise ValueError("from_deepseek: no expert ids given")

    def stacked(proj: str) -> BlockFP8Weight:
        weights, scales = [], []
        for e in experts:
            wkey, skey = deepseek_keys(prefix, e, proj)
            missing = [k for k in (wkey, skey) if k not in state_dict]
            if missing:
                raise KeyError(f"from_deepseek: the state dict lacks {missing[0]!r}")
            weights.append(state_dict[wkey])
            scales.append(fp32_scales(state_dict[skey]))
        return BlockFP8Weight(torch.stack(weights), torch.stack(scales))

    w_up = stack_gate_up(stacked("gate_proj"), stacked("up_proj"), requantize, where=f"{prefix}experts")
    return w_up, stacked("down_proj")


def to_deepseek(w_up: BlockFP8Weight, w_down: BlockFP8Weight, prefix: str, first_expert: int = 0,
                requantize: bool = False) -> dict[str, torch.Tensor]:
    """(w_up, w_down) of experts ``first_expert ..`` → DeepSeek-V3's per-expert keys
    (:func:`deepseek_keys`): the inverse of :func:`from_deepseek`, with the same rule."""
    gate, up = split_gate_up(w_up, requantize, where=f"{prefix}experts")
    out = {}
    for i in range(w_up.shape[0]):
        for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", w_down)):
            wkey, skey = deepseek_keys(prefix, first_expert + i, proj)
            out[wkey], out[skey] = w.weight[i].clone(), w.scale_inv[i].clone()
    return out


# ----------------------------------------------------------------------------- vLLM / SGLang
def from_vllm(w13_weight: torch.Tensor, w13_weight_scale_inv: torch.Tensor, w2_weight: torch.Tensor,
              w2_weight_scale_inv: torch.Tensor, requantize: bool = False) -> tuple[BlockFP8Weight, BlockFP8Weight]:
    """vLLM's / SGLang's fused-MoE tensors → (w_up, w_down). ``w13_weight`` (E, 2K, N) holds
    w1 (the gate) over w3 (the up), its scales (E, 2·⌈K/128⌉, ⌈N/128⌉) the two grids stacked:
    exact where K % 128 == 0, else the module doc's rule."""
    K = w13_weight.shape[-2] // 2
    scale = fp32_scales(w13_weight_scale_inv)
    kb = blocks(K)
    if scale.shape[-2] != 2 * kb:
        raise ValueError(f"from_vllm: w13_weight_scale_inv has {scale.shape[-2]} block rows; a gate and an up of K={K} "
                         f"rows with a grid each have 2·{kb}")
    gate = BlockFP8Weight(w13_weight[..., :K, :], scale[..., :kb, :])
    up = BlockFP8Weight(w13_weight[..., K:, :], scale[..., kb:, :])
    return (stack_gate_up(gate, up, requantize, where="w13_weight"),
            BlockFP8Weight(w2_weight, fp32_scales(w2_weight_scale_inv)))


def to_vllm(w_up: BlockFP8Weight, w_down: BlockFP8Weight, requantize: bool = False) -> dict[str, torch.Tensor]:
    """(w_up, w_down) → ``{"w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv"}``:
    the inverse of :func:`from_vllm`, with the same rule."""
    gate, up = split_gate_up(w_up, requantize, where="w_up")
    return {"w13_weight": torch.cat([gate.weight, up.weight], dim=-2),
            "w13_weight_scale_inv": torch.cat([gate.scale_inv, up.scale_inv], dim=-2),
            "w2_weight": w_down.weight.clone(), "w2_weight_scale_inv": w_down.scale_inv.clone()}
