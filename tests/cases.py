"""Routing cases shared by the single- and multi-process tests.

A case gives, for a world of W ranks, each rank's token count and (optionally) the forced
expert choice of every token, built identically on every rank from a seed.
"""

from __future__ import annotations

import torch

from interlace import MoEConfig

CASES = ["random", "balanced", "one_expert", "zero_recv_rank", "uneven_and_empty_rank", "empty_batch"]


def case_tokens(case: str, world: int, base: int = 12) -> list[int]:
    if case == "empty_batch":
        return [0] * world
    if case == "uneven_and_empty_rank":
        return [base + 5 * r if r != 1 % world else 0 for r in range(world)] if world > 1 else [0]
    return [base + 3 * r for r in range(world)]


def case_indices(case: str, cfg: MoEConfig, world: int, tokens: list[int], seed: int = 0):
    """Forced (T_r, k) expert choices per rank, or None for the router's own choice."""
    E, k = cfg.num_experts, cfg.top_k
    gen = torch.Generator().manual_seed(seed)
    if case in ("random", "uneven_and_empty_rank", "empty_batch"):
        return None
    out, start = [], 0
    for T in tokens:
        t = torch.arange(start, start + T)
        if case == "balanced":
            idx = (t.unsqueeze(1) * k + torch.arange(k)) % E
        elif case == "one_expert":
            # Every token picks experts 0..k-1: one rank gets all traffic, the others none.
            idx = torch.arange(k).expand(T, k).clone()
        elif case == "zero_recv_rank":
            # Never pick the last rank's experts, so that rank receives zero rows.
            allowed = E - E // world if world > 1 else E
            idx = torch.stack([torch.randperm(allowed, generator=gen)[:k] for _ in range(T)]) if T else \
                torch.empty(0, k, dtype=torch.long)
        else:
            raise ValueError(case)
        out.append(idx)
        start += T
    return out


def make_inputs(cfg: MoEConfig, tokens: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed + 17)
    xs = [torch.randn(T, cfg.hidden, generator=gen).to(cfg.dtype) for T in tokens]
    grads = [torch.randn(T, cfg.hidden, generator=gen).to(cfg.dtype) for T in tokens]
    return xs, grads
