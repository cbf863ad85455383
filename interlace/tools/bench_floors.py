"""The bench's floors and error measures (docs/benchmarking.md): the prefill floor, the decode
floor's weight term, and relative errors summed in fp64 over chunks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from interlace.config import MoEConfig


def floor_ms(cfg: MoEConfig, tokens: int, world: int, mode: str, tflops: float | None, peer_gbps: float | None):
    if tflops is None:
        return None
    flops = cfg.flops_per_token() * tokens
    remote_bytes = tokens * cfg.top_k * (world - 1) / world * cfg.hidden * 2
    compute = flops / (tflops * 1e12)
    comm = 2 * remote_bytes / (peer_gbps * 1e9) if peer_gbps else 0.0
    if mode == "fwdbwd":
        compute, comm = 3 * compute, 2 * comm
    return max(compute, comm) * 1e3


def touched_expert_bytes(cfg: MoEConfig, topk_idx: torch.Tensor, env) -> int:
    """Bytes of expert weights the busiest rank must read for one call: every local expert that
    at least one token of any rank chose (``topk_idx`` (T, k): this rank's choices). FP8 experts
    (``cfg.expert_quant``): one byte a weight, and a 4-byte scale per 128 × 128 block."""
    chosen = torch.bincount(topk_idx.reshape(-1).long(), minlength=cfg.num_experts)
    if env.world > 1:
        dist.all_reduce(chosen, group=env.group)
    touched = (chosen > 0).view(env.world, cfg.num_experts // env.world).sum(dim=1)
    return int(touched.max()) * expert_bytes(cfg)


def expert_bytes(cfg: MoEConfig) -> int:
    """Bytes of one expert's weights (up and down projections) as the layer stores them."""
    if cfg.expert_quant == "fp8":
        blocks = lambda rows, cols: -(-rows // 128) * -(-cols // 128)  # noqa: E731
        return (cfg.up_width + cfg.ffn) * cfg.hidden + 4 * (blocks(cfg.up_width, cfg.hidden)
                                                            + blocks(cfg.hidden, cfg.ffn))
    return (cfg.up_width + cfg.ffn) * cfg.hidden * torch.finfo(cfg.dtype).bits // 8


def decode_floor_ms(floor: float | None, weight_bytes: int, hbm_tbps: float | None, world: int,
                    peer_latency_us: float | None) -> float | None:
    """The decode floor (docs/benchmarking.md), forward only: the largest of the prefill floor,
    reading the touched expert weights once from HBM, and (world > 1) the two one-way peer
    latencies of dispatch and combine."""
    if floor is None or not hbm_tbps:
        return None
    latency = 2 * peer_latency_us * 1e-3 if world > 1 and peer_latency_us else 0.0
    return max(floor, weight_bytes / (hbm_tbps * 1e12) * 1e3, latency)


def squared_error_sums(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 26) -> tuple[float, float]:
    """(Σ (a − b)², Σ b²) in fp64, over chunks of ``chunk`` elements: dsv3-like's expert gradients
    are 7.5 GB in bf16, and converting one whole to fp32 at once runs an 80 GB GPU out of memory.
    The first sum is inf where ``a`` has a non-finite value. Sums over pieces add up (the expert
    bench compares its reference group by group)."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    diff = ref = 0.0
    for i in range(0, a.numel(), chunk):
        ac, bc = a[i:i + chunk].double(), b[i:i + chunk].double()
        diff += (ac - bc).square().sum().item() if torch.isfinite(ac).all() else float("inf")
        ref += bc.square().sum().item()
    return diff, ref


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64 (inf where ``a`` has a non-finite value)."""
    diff, ref = squared_error_sums(a, b)
    return diff**0.5 / max(ref**0.5, 1e-30)
