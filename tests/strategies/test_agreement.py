"""The agreement of a call across ranks (interlace.parallel.agreement) on gloo ranks, through the
public API: a rank without tokens follows its peers' routing (the soak's hang: ``auto`` with
``persistent`` decided, rank 0 with no tokens and no indices, rank 1 with forced indices); ranks
whose calls differ in kind raise, every one of them, and the layer serves the next call; plain
``persistent`` at W > 1 over its ``max_tokens`` raises on every rank; ``set_strategy`` keeps the
options given for a strategy name and closes the old strategy."""

from __future__ import annotations

import pytest
import torch

from helpers import reference_grads, rel_err, run_gloo
from interlace import MoEConfig, MoELayer
from interlace.parallel.agreement import Agreed, CallKind, TOKEN_BITS, decide

CFG = MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32)
TOL = 1e-4  # fp32 kernels under the interpreter against the fp64 reference


def _word(tokens, train, routed):
    return tokens | CallKind(train, routed).flags() << TOKEN_BITS


def test_decide_keys_and_mismatches():
    assert decide((_word(3, False, None), _word(5, False, False)), "x") == Agreed(5, False, False)
    assert decide((_word(0, False, None), _word(2, False, True)), "x") == Agreed(2, False, True)
    assert decide((_word(0, True, None), _word(0, True, None)), "x") == Agreed(0, True, None)  # (each its own way)
    assert decide((_word(0, False, None), _word(0, False, False)), "x") == Agreed(0, False, False)
    with pytest.raises(RuntimeError, match=r"ranks \[1\] make a training call .* ranks \[0\] an inference"):
        decide((_word(1, False, False), _word(1, True, False)), "layer 7")
    with pytest.raises(RuntimeError, match=r"layer 7: ranks \[0, 2\] hand the call over .* ranks \[1\] route"):
        decide((_word(1, False, True), _word(4, False, False), _word(2, False, True)), "layer 7")


def _one_expert(tokens, cfg, gen):
    """Every token on expert 0, then k − 1 others (the soak's "one-expert" routing)."""
    rest = torch.rand(tokens, cfg.num_experts - 1, generator=gen).argsort(1)[:, :cfg.top_k - 1] + 1
    return torch.cat([torch.zeros(tokens, 1, dtype=torch.long), rest], 1)


def _check(layer, xs, idxs, rank, tol=TOL):
    ref = reference_grads(CFG, 3, xs, [torch.zeros_like(x) for x in xs], indices=idxs)[0][rank]
    with torch.no_grad():
        out = layer(xs[rank], expert_indices=None if idxs is None else idxs[rank])
    assert out.shape == ref.shape
    assert xs[rank].shape[0] == 0 or rel_err(out, ref) < tol, rel_err(out, ref)


def _zero_token_rank_follows(rank, world, tmp):
    import os

    from interlace import env

    os.environ["INTERLACE_PROFILE_DIR"] = tmp
    env.refresh()
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": ("sequential", "persistent"), "warmup": 0, "samples": 1,
                                       "cache": False, "persistent_max_tokens": 8})
    layer.strategy.measure_override = lambda spec, ms: 1.0 if spec == "persistent" else 2.0
    g = torch.Generator().manual_seed(5)
    for counts in ([3, 4], [4, 3], [4, 4]):  # routed calls of bucket 4 calibrate: persistent wins
        _check(layer, [torch.randn(t, CFG.hidden, generator=g) for t in counts], None, rank)
    assert layer.strategy.choice_for(4).spec == "persistent"
    # The soak's call: no tokens and no indices on rank 0 (it could go routed, to persistent),
    # forced indices on rank 1 (it must be routed by the layer): rank 0 follows rank 1.
    xs = [torch.randn(0, CFG.hidden), torch.randn(3, CFG.hidden, generator=g)]
    idxs = [torch.empty(0, CFG.top_k, dtype=torch.long), _one_expert(3, CFG, g)]
    ref = reference_grads(CFG, 3, xs, [torch.zeros_like(x) for x in xs], indices=idxs)[0][rank]
    with torch.no_grad():
        out = layer(xs[rank], expert_indices=None if rank == 0 else idxs[1])
    assert rank == 0 or rel_err(out, ref) < TOL
    # Both ranks with tokens, one with forced indices: every rank raises, naming both kinds.
    xs = [torch.randn(2, CFG.hidden, generator=g) for _ in range(world)]
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"ranks \[1\] hand the call over .* ranks \[0\] route"):
        layer(xs[rank], expert_indices=_one_expert(2, CFG, g) if rank == 0 else None)
    # A training call on one rank and an inference call on the other: every rank raises.
    x = torch.randn(2, CFG.hidden, generator=g, requires_grad=rank == 0)
    with torch.set_grad_enabled(rank == 0), pytest.raises(RuntimeError, match=r"ranks \[0\] make a training call"):
        layer(x)
    # The layer serves the next call, on both paths.
    _check(layer, [torch.randn(t, CFG.hidden, generator=g) for t in (2, 0)], None, rank)
    xs = [torch.randn(t, CFG.hidden, generator=g) for t in (0, 5)]
    _check(layer, xs, [_one_expert(t, CFG, g) for t in (0, 5)], rank)


def test_zero_token_rank_follows_and_mismatches_raise(tmp_path):
    run_gloo(_zero_token_rank_follows, 2, str(tmp_path))


def _persistent_agrees(rank, world):
    layer = MoELayer(CFG, strategy="persistent", seed=3, device="cpu", strategy_options={"max_tokens": 4})
    g = torch.Generator().manual_seed(9)
    _check(layer, [torch.randn(t, CFG.hidden, generator=g) for t in (3, 4)], None, rank)
    # Over max_tokens on rank 1 only: both ranks raise before any launch, and go on.
    xs = [torch.randn(t, CFG.hidden, generator=g) for t in (2, 6)]
    with torch.no_grad(), pytest.raises(ValueError, match="6 tokens, over max_tokens=4"):
        layer(xs[rank])
    # No tokens and no indices on rank 0, forced indices on rank 1: both take sequential's path.
    xs = [torch.randn(t, CFG.hidden, generator=g) for t in (0, 3)]
    idx = _one_expert(3, CFG, g)
    ref = reference_grads(CFG, 3, xs, [torch.zeros_like(x) for x in xs],
                          indices=[torch.empty(0, CFG.top_k, dtype=torch.long), idx])[0][rank]
    with torch.no_grad():
        out = layer(xs[rank], expert_indices=idx if rank == 1 else None)
    assert rank == 0 or rel_err(out, ref) < TOL
    _check(layer, [torch.randn(t, CFG.hidden, generator=g) for t in (4, 1)], None, rank)


def test_persistent_agrees_before_its_launch():
    run_gloo(_persistent_agrees, 2)


def _set_strategy_keeps_options(rank, world):
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": ("sequential",), "capacity": 8, "cache": False})
    closed = []
    first = layer.strategy
    first.close = lambda: closed.append("auto")
    layer.set_strategy("sequential")
    assert closed == ["auto"]
    layer.set_strategy("auto")
    assert layer.strategy is not first and layer.strategy.options.capacity == 8
    assert layer.strategy.options.candidates == ("sequential",)
    layer.set_strategy("auto", capacity=16)  # new options replace the remembered ones
    assert layer.strategy.options.capacity == 16 and layer.strategy.options.candidates is None
    layer.set_strategy("sequential")
    layer.set_strategy("auto")
    assert layer.strategy.options.capacity == 16
    assert layer.strategy.label == layer.label and layer.strategy._agree.label == layer.label


def test_set_strategy_keeps_the_options_given():
    run_gloo(_set_strategy_keeps_options, 2)


def _two_hosts(rank, world):
    from interlace.parallel import comm, host_board

    comm.host_identity = host_board.host_identity = lambda: (f"node{rank}", "boot")  # a host per rank
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": ("sequential", "pipelined:2"), "cache": False})
    assert layer.ep.hosts == (0, 1) and not layer.ep.one_host
    assert layer.strategy._agree.board is None  # no shared memory across hosts: the gloo all_gather
    g = torch.Generator().manual_seed(3)
    for counts in ([3, 0], [5, 2], [0, 1], [4, 4]):
        _check(layer, [torch.randn(t, CFG.hidden, generator=g) for t in counts], None, rank)
    # Peer memory reaches one host only: refused on every rank, naming the ranks, before any buffer.
    with pytest.raises(ValueError, match=r"spans 2 hosts \(ranks \[0\] on host 0; ranks \[1\] on host 1\)"):
        MoELayer(CFG, strategy="fused", seed=3, device="cpu", strategy_options={"transport": "symmetric"})
    # (the staged transport runs on collectives: it crosses hosts)
    _check(MoELayer(CFG, strategy="fused", seed=3, device="cpu", strategy_options={"transport": "staged"}),
           [torch.randn(t, CFG.hidden, generator=g) for t in (2, 3)], None, rank)


def test_two_hosts_agree_over_gloo_and_refuse_peer_memory():
    run_gloo(_two_hosts, 2)
