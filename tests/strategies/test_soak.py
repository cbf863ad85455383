"""A soak through the public API on 2 gloo ranks (the long one is ../shared/soak_switching.py and
benchmarks/soak.py): calls of two layers with the strategy switched per call, the same on every
rank (``auto`` among them, with ``persistent`` a candidate of its routed calls as on GPUs),
inference and training calls, token counts drawn per rank with many zeros, and routing by the
router, Zipf-skewed or "every token on expert 0" given as ``expert_indices`` (the same kind on
every rank; a rank without tokens passes none). Every call's output is checked against the layer's own ``naive`` run of
the same call; a training call's input gradient too. No call may raise or hang."""

from __future__ import annotations

import random

import torch

from helpers import rel_err, run_gloo
from interlace import MoEConfig, MoELayer

CALLS = 45
TOL = 1e-4  # fp32 everywhere (kernels under the interpreter), against naive's fp32 torch ops
CONFIGS = [MoEConfig(hidden=16, ffn=8, num_experts=4, top_k=2, dtype=torch.float32),
           MoEConfig(hidden=16, ffn=16, num_experts=8, top_k=3, dtype=torch.float32)]
AUTO = {"candidates": ("sequential", "fused", "fused:train", "persistent"), "warmup": 0, "samples": 1,
        "extra_samples": 0, "shipped_decisions": False, "persistent_max_tokens": 8, "agree_timeout_s": 60.0}
# Decisions as a GPU machine's cache holds them (set_strategy("auto") builds a new auto, which
# reads them): routed calls of up to 8 tokens per rank run persistent, the others a mix; the
# buckets left out calibrate.
DECIDED = {"fwd-routed": {1: "persistent", 2: "persistent", 4: "persistent", 8: "persistent"},
           "fwd": {1: "fused", 4: "sequential", 8: "fused", 16: "pipelined:2", 32: "fused"},
           "fwdbwd": {1: "fused:train", 4: "sequential", 8: "fused:train", 32: "fused:train"}}


def _seed_decisions(directory: str) -> None:
    from pathlib import Path

    from interlace.planning.profile import machine_key
    from interlace.strategies.auto_decisions import Choice, DecisionCache, decision_shape

    cache = DecisionCache(machine_key(2, torch.device("cpu")), Path(directory), None)
    for cfg in CONFIGS:
        for mode, table in DECIDED.items():
            for bucket, spec in table.items():
                cache.store(decision_shape(cfg, 2), mode, bucket, Choice(spec, "measured"))


def _routing(kind: str, tokens: int, cfg: MoEConfig, gen: torch.Generator) -> torch.Tensor | None:
    if kind == "router" or tokens == 0:
        return None
    k, E = cfg.top_k, cfg.num_experts
    if kind == "skewed":
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float32) ** 1.2
        return torch.multinomial(p.expand(tokens, E), k, replacement=False, generator=gen)
    rest = torch.rand(tokens, E - 1, generator=gen).argsort(1)[:, :k - 1] + 1
    return torch.cat([torch.zeros(tokens, 1, dtype=torch.long), rest], 1)


def _call(layer, strategy, x, idx, train):
    layer.set_strategy(strategy)
    if not train:
        with torch.no_grad():
            return layer(x, expert_indices=idx), None
    x = x.clone().requires_grad_(True)
    out = layer(x, expert_indices=idx)
    grad = torch.randn_like(out, generator=torch.Generator().manual_seed(x.shape[0]))
    out.backward(grad)
    return out.detach(), x.grad


def _soak(rank, world, tmp):
    if rank == 0:
        _seed_decisions(tmp)
    torch.distributed.barrier()
    options = {**AUTO, "decisions_dir": tmp}
    layers = [MoELayer(cfg, strategy="auto", seed=3 + i, device="cpu", strategy_options=options)
              for i, cfg in enumerate(CONFIGS)]
    shared = random.Random(7)  # the same layer, strategy and mode on every rank
    mine = random.Random(100 + rank)  # token counts differ per rank
    gen = torch.Generator().manual_seed(rank)
    auto_ran = set()
    for i in range(CALLS):
        layer = layers[shared.randrange(len(layers))]
        train = shared.random() < 0.2
        pool = ["fused:train", "sequential", "auto"] if train else ["fused", "sequential", "pipelined", "auto",
                                                                     "auto", "persistent"]
        strategy = shared.choice(pool)
        tokens = mine.choice((0, 0, 1, 3, 9, mine.randrange(24)))
        x = torch.randn(tokens, layer.config.hidden, generator=gen)
        idx = _routing(shared.choice(("router", "skewed", "one-expert")), tokens, layer.config, gen)
        where = f"call {i}: {strategy} train={train} T={tokens} routed={idx is None}"
        out, dx = _call(layer, strategy, x, idx, train)
        if strategy == "auto":
            auto_ran |= {choice.spec for choice in layer.strategy.choices.values()}
        ref, ref_dx = _call(layer, "naive", x, idx, train)
        assert out.shape == x.shape, where
        if tokens:
            assert rel_err(out, ref) < TOL, where
            assert dx is None or rel_err(dx, ref_dx) < TOL, where
        for p in layer.parameters():
            p.grad = None
    # (auto ran its decided strategies, persistent among them, not only calibration calls)
    assert {"persistent", "fused", "fused:train", "sequential"} <= auto_ran, auto_ran


def test_soak_switching_strategies_two_ranks(tmp_path):
    run_gloo(_soak, 2, str(tmp_path))
