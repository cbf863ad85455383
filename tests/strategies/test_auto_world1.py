"""``auto`` at world size 1: inference calls come with the router and calibrate ``persistent``
(routing inside its kernel) against ``sequential`` (routed by the layer's router), each timed
with its routing; each calibration call returns its candidate's own output; training calls and
forced indices run ``sequential``; the decision is cached."""

import torch

from helpers import rel_err
from interlace import MoEConfig, MoELayer, reference_moe

CFG = MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32)


def _layer(tmp_path, winner: str, **options):
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": ("persistent", "sequential"), "warmup": 0, "samples": 1,
                                       "decisions_dir": str(tmp_path), "shipped_decisions": False, **options})
    layer.strategy.measure_override = lambda spec, ms: 1.0 if spec == winner else 2.0
    return layer


def _spy(layer):
    """Record which sub-strategy served each call (routed or not)."""
    ran = []
    strategy = layer.strategy
    make = strategy._impl

    def impl(spec, agreed):
        inner = make(spec, agreed)
        ran.append(spec)
        return inner

    strategy._impl = impl
    return ran


def _reference(layer, x):
    r = layer.router
    return reference_moe(x, r.weight.detach(), layer.experts.w_up.detach(), layer.experts.w_down.detach(),
                         CFG, expert_bias=r.expert_bias)[0]


def test_world1_calibrates_persistent_against_sequential(tmp_path):
    layer = _layer(tmp_path, "persistent")
    ran = _spy(layer)
    fixed = {s: MoELayer(CFG, strategy=s, seed=3, device="cpu") for s in ("persistent", "sequential")}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(6, CFG.hidden, generator=g)
            out = layer(x)
            assert rel_err(out, _reference(layer, x)) < 1e-5
            assert torch.equal(out, fixed[ran[-1]](x)), ran[-1]  # the candidate's own output
    assert ran == ["persistent", "sequential", "persistent", "persistent"], ran
    choice = layer.strategy.choices[(8, "fwd")]
    assert choice.spec == "persistent" and choice.source == "measured"
    assert choice.times_ms == {"persistent": 1.0, "sequential": 2.0}
    # A training call and forced indices: sequential, routed by the layer.
    x = torch.randn(5, CFG.hidden, generator=g, requires_grad=True)
    layer(x).sum().backward()
    assert ran[-1] == "sequential" and x.grad is not None
    with torch.no_grad():
        layer(x.detach(), expert_indices=torch.tensor([[0, 1]] * 5))
    assert ran[-1] == "sequential"
    # A new process (as one: not sharing this process's decider): the cached decision, nothing timed.
    again = _layer(tmp_path, "sequential", share_calibration=False)
    ran = _spy(again)
    with torch.no_grad():
        again(torch.randn(7, CFG.hidden, generator=g))
    assert ran == ["persistent"] and again.strategy.choices[(8, "fwd")].source == "cached"


def test_world1_keeps_sequential_when_it_is_faster_and_without_a_gpu(tmp_path):
    layer = _layer(tmp_path, "sequential")
    ran = _spy(layer)
    with torch.no_grad():
        for _ in range(3):
            layer(torch.randn(3, CFG.hidden))
    assert ran[-1] == "sequential" and layer.strategy.choices[(4, "fwd")].spec == "sequential"
    # No candidates given, on the CPU: persistent is not considered (GPU only); nothing routed here.
    plain = MoELayer(CFG, strategy="auto", seed=3, device="cpu")
    x = torch.randn(4, CFG.hidden)
    assert not plain.strategy.routes_call(x, plain.router, plain.experts.w_up, plain.experts.w_down)
    with torch.no_grad():
        assert rel_err(plain(x), _reference(plain, x)) < 1e-5
    assert plain.strategy.choices[(4, "fwd")].spec == "sequential"
