"""``auto``'s routed calls at world size W > 1 (interlace.strategies.auto) on gloo ranks:
inference calls come with the router, ``persistent`` (its kernel under the interpreter, the
staged transport) is calibrated beside the other candidates under key mode ``"fwd-routed"``,
every rank runs the same strategy on every call, and a call with more tokens on some rank than
the persistent buffers hold is keyed on that count everywhere (no persistent)."""

from __future__ import annotations

import pytest
import torch

from helpers import reference_grads, rel_err, run_gloo
from interlace import MoEConfig, MoELayer
from interlace.strategies.auto import AutoOptions
from interlace.strategies.auto_plan import ROUTED

CFG = MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32)
TOL = 1e-4  # the kernel's fp32 dots under the interpreter against the fp64 reference


def _spy_routed(layer, log):
    """Record the name of the sub-strategy that serves each routed call."""
    strategy = layer.strategy
    run = strategy._run

    def spy(impl, args, routed):
        if routed:
            log.append(impl.name)
        return run(impl, args, routed)

    strategy._run = spy


def _calibrating_layer(tmp, persistent_max_tokens: int, winner: str) -> MoELayer:
    """An auto layer calibrating sequential against persistent, one timed call each, where
    ``winner`` measures faster (the profile dir under ``tmp``)."""
    import os

    from interlace import env

    os.environ["INTERLACE_PROFILE_DIR"] = tmp
    env.refresh()
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": ("sequential", "persistent"), "warmup": 0, "samples": 1,
                                       "cache": False, "persistent_max_tokens": persistent_max_tokens})
    layer.strategy.measure_override = lambda spec, ms: 1.0 if spec == winner else 2.0
    return layer


def _persistent_calibrated_beside_sequential(rank, world, tmp, winner):
    import os

    import torch.distributed as dist

    layer = _calibrating_layer(tmp, 8, winner)
    strategy = layer.strategy
    ran = []
    _spy_routed(layer, ran)
    g = torch.Generator().manual_seed(6)
    # 1-2: bucket 4 calibrates (sequential, then persistent); 3-4: decided, the winner runs;
    # 5: rank 1 has 12 tokens: every rank keys the call on 12 (bucket 16), where persistent is no
    # candidate (over persistent_max_tokens: key mode "fwd"): sequential, predicted; 6: bucket 1
    # calibrates, sequential first.
    for counts in ([3, 4], [4, 3], [4, 4], [4, 0], [2, 12], [1, 1]):
        xs = [torch.randn(t, CFG.hidden, generator=g) for t in counts]
        ref = reference_grads(CFG, 3, xs, [torch.zeros_like(x) for x in xs])[0][rank]
        with torch.no_grad():
            assert strategy.routes_call(xs[rank], layer.router, layer.experts.w_up, layer.experts.w_down)
            out = layer(xs[rank])
        assert out.shape == ref.shape
        assert counts[rank] == 0 or rel_err(out, ref) < TOL, (counts, rel_err(out, ref))
    seen = [None] * world
    dist.all_gather_object(seen, ran)
    assert seen[0] == ran, seen
    assert ran == ["sequential", "persistent", winner, winner, "sequential", "sequential"], ran
    # (bucket 16 is over persistent_max_tokens: the key of a call that comes routed, shared)
    assert strategy.choices[(16, "fwd")].spec == "sequential" and (16, ROUTED) not in strategy.choices
    assert strategy.choices[(4, ROUTED)].spec == winner
    assert strategy.choice_for(4, "fwd").spec == winner  # (the bench reads routed decisions as "fwd")
    if rank == 0:  # calls that come routed never have persistent among their candidates
        assert "persistent" not in strategy.decider.plan((4, "fwd"), "cpu").candidates
    # A training call builds an autograd graph: it comes routed (the layer routes), never persistent.
    x = torch.randn(3, CFG.hidden, requires_grad=True)
    assert not strategy.routes_call(x, layer.router, layer.experts.w_up, layer.experts.w_down)


@pytest.mark.parametrize("winner", ["persistent", "sequential"])
def test_persistent_calibrated_beside_sequential_2_ranks(tmp_path, winner):
    run_gloo(_persistent_calibrated_beside_sequential, 2, str(tmp_path), winner)


def test_persistent_max_tokens_option_is_checked():
    with pytest.raises(ValueError, match="persistent_max_tokens"):
        AutoOptions(persistent_max_tokens=-1)
    with pytest.raises(ValueError, match="persistent_max_tokens"):
        AutoOptions(persistent_max_tokens=True)
    assert AutoOptions(persistent_max_tokens=0).persistent_max_tokens == 0


def _persistent_grows_and_is_released(rank, world, tmp):
    """At W > 1 ``persistent``'s buffers are sized to the bucket it serves and grow with it (every
    rank at the same call; the old buffer leaves the process cache); once every key has decided
    against it, it is dropped and its buffer freed from the cache."""
    from interlace.strategies import persistent as persistent_module

    layer = _calibrating_layer(tmp, 16, "sequential")
    strategy = layer.strategy
    cache = persistent_module._DIST_BUFFERS
    g = torch.Generator().manual_seed(8)
    sizes, cached = [], []
    # 1-2: bucket 4 calibrates (sequential, then persistent sized for 4); 3-4: bucket 16
    # calibrates (sequential, then persistent grown to 16: the 4-token buffer leaves the cache);
    # 5: bucket 16 decides sequential (bucket 4 still calibrates persistent: kept); 6: bucket 4
    # decides sequential: no key needs persistent, dropped, its buffer gone from the cache.
    for counts in ([3, 4], [4, 3], [9, 16], [16, 12], [12, 12], [4, 4]):
        xs = [torch.randn(t, CFG.hidden, generator=g) for t in counts]
        ref = reference_grads(CFG, 3, xs, [torch.zeros_like(x) for x in xs])[0][rank]
        with torch.no_grad():
            out = layer(xs[rank])
        assert rel_err(out, ref) < TOL, (counts, rel_err(out, ref))
        impl = strategy._impls.get("persistent")
        sizes.append(None if impl is None else impl.max_tokens)
        cached.append(sorted(key[-1].max_tokens for key in cache))
    assert strategy.choices[(16, ROUTED)].spec == "sequential"
    assert strategy.choices[(4, ROUTED)].spec == "sequential"
    # Bucket 4 still calibrates persistent when bucket 16 decides (call 5): it stays until call 6.
    assert sizes == [None, 4, 4, 16, 16, None], sizes
    assert cached == [[], [4], [4], [16], [16], []], cached


def test_persistent_grows_with_the_bucket_and_is_released_2_ranks(tmp_path):
    run_gloo(_persistent_grows_and_is_released, 2, str(tmp_path))
