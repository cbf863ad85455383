"""``auto``'s agreement and calibration on gloo ranks: every rank runs the same strategy on every
call (different, zero and changing token counts), ranks with different timings reach one choice,
calibration calls return what the chosen strategy returns, decisions survive in the cache, and
the model's prior prunes candidates."""

import json
import math
import logging
import sys
from pathlib import Path

import pytest
import torch

from helpers import reference_grads, rel_err, run_gloo
from interlace import MoEConfig, MoELayer
from interlace.planning.profile import shape_key
from interlace.strategies.auto_prior import predicted_candidates, prune
from interlace.strategies.auto_decisions import DecisionCache, Choice, token_bucket

CFG = MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32)
CANDS = ("sequential", "pipelined:2")


def _set_profile_dir(tmp):
    import os

    from interlace import env

    os.environ["INTERLACE_PROFILE_DIR"] = tmp
    env.refresh()


def _spy(layer, log):
    """Record (call, spec) of every sub-strategy call of an auto layer."""
    strategy = layer.strategy
    make = strategy._impl

    class Spy:  # (the strategy's attributes are its own: warm_calls, captures, ...)
        def __init__(self, spec, inner):
            self.spec, self.inner = spec, inner

        def __call__(self, *args):
            log.append(self.spec)
            return self.inner(*args)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def impl(spec, agreed):
        return Spy(spec, make(spec, agreed))

    strategy._impl = impl


def _gather_lists(values):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return out


def _uneven_calls(rank, world, tmp):
    """Different and zero token counts in one call, and a changing sequence of them, with
    injected rank-dependent timings: every rank runs the same strategy every call, outputs
    match the fp64 reference, and the group agrees on one choice per key."""
    _set_profile_dir(tmp)
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": CANDS, "warmup": 0, "samples": 1, "extra_samples": 0})
    # Rank r sees sequential as fast and pipelined as slow on even ranks, the reverse on odd ones:
    # the max over ranks must still pick one for all.
    layer.strategy.measure_override = lambda spec, ms: {0: 1.0, 1: 3.0}[(spec == "sequential") ^ (rank % 2)]
    ran = []
    _spy(layer, ran)
    g = torch.Generator().manual_seed(5)
    sequences = [[1] + [0] * (world - 1), [0] * world, [5, 0, 17, 3][:world], [40, 1, 0, 9][:world],
                 [3] * world, [0, 33, 2, 8][:world], [64, 64, 1, 0][:world], [7, 0, 0, 0][:world],
                 [2, 3, 4, 5][:world], [1, 0, 0, 1][:world]]
    # Keys follow each call's agreed largest count: four passes give every bucket of the sequence
    # (1, 0, 32, 64, 4, 64, 64, 8, 8, 1) calls enough to finish its calibration in some mode.
    for i, counts in enumerate(sequences * 4):
        xs = [torch.randn(t, CFG.hidden, generator=g) for t in counts]
        gs = [torch.randn(t, CFG.hidden, generator=g) for t in counts]
        training = i % 4 == 3
        if training:
            x = xs[rank].clone().requires_grad_()
            out = layer(x)
            out.backward(gs[rank])
            outs, dxs, *_ = reference_grads(CFG, 3, xs, gs)
            assert rel_err(x.grad, dxs[rank]) < 2e-6 or counts[rank] == 0
        else:
            with torch.no_grad():
                out = layer(xs[rank])
            outs = reference_grads(CFG, 3, xs, [torch.zeros_like(x) for x in xs])[0]
        assert out.shape == (counts[rank], CFG.hidden)
        assert counts[rank] == 0 or rel_err(out, outs[rank]) < 2e-6, counts
    runs = _gather_lists(ran)
    assert all(r == runs[0] for r in runs), runs  # same strategy on every call on every rank
    choices = _gather_lists({k: c.spec for k, c in layer.strategy.choices.items()})
    assert all(c == choices[0] for c in choices)
    measured = [c for c in layer.strategy.choices.values() if c.source == "measured"]
    assert measured
    for c in measured:  # max over ranks: both took 3.0 on some rank; a tie goes to the first listed
        assert c.spec == "sequential" and c.times_ms == {"sequential": 3.0, "pipelined:2": 3.0}
        assert c.calibration_calls == 2


def _slow_first_call(layer, ran, spec: str, captures: bool, seconds: float) -> None:
    """The first call of ``spec`` (before the spy logs it in ``ran``) sleeps ``seconds`` and, with
    ``captures``, counts as one that captured a CUDA graph."""
    import time

    make = layer.strategy._impl

    class SlowFirst:
        def __init__(self, spy):
            self.spy = spy

        def __call__(self, *args):
            if spec not in ran:
                self.spy.inner.captures += captures
                time.sleep(seconds)
            return self.spy(*args)

        def __getattr__(self, name):
            return getattr(self.spy, name)

    layer.strategy._impl = lambda s, agreed: SlowFirst(make(s, agreed)) if s == spec else make(s, agreed)


def _captured_calls(rank, world, tmp, train):
    """A timed call during which a candidate captured a CUDA graph (here rank 1's first
    pipelined:2 call, made slow) is not counted: every rank schedules that candidate once more
    (the same calls on both ranks), and that sample stays out of its time."""
    _set_profile_dir(tmp)
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": CANDS, "warmup": 0, "samples": 2, "extra_samples": 0})
    ran = []
    _spy(layer, ran)
    _slow_first_call(layer, ran, "pipelined:2", captures=rank == 1, seconds=0.3 if rank == 1 else 0.0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(7):
        x = torch.randn(12, CFG.hidden, generator=g).requires_grad_(train)
        with torch.set_grad_enabled(train):
            out = layer(x)
        if train:  # (a training call: the sample spans its backward)
            out.square().sum().backward()
    ((key, choice),) = layer.strategy.choices.items()
    assert choice.source == "measured" and choice.calibration_calls == 5
    assert ran[:5].count("pipelined:2") == 3 and ran[:5].count("sequential") == 2  # one call more
    assert _gather_lists(ran)[0] == _gather_lists(ran)[1]
    samples = layer.strategy.decider.keys[key].samples[CANDS.index("pipelined:2")]
    assert [s.captured for s in samples] == ([True, False, False] if rank == 1 else [False] * 3)


@pytest.mark.parametrize("train", [False, True])
def test_a_call_that_captured_a_graph_is_timed_again(tmp_path, train):
    run_gloo(_captured_calls, 2, str(tmp_path), train)


def _capture_delays_peer(rank, world, tmp):
    """Rank 1 captures a graph in its first pipelined:2 call and rank 0, whose call waits for it in
    the call's exchanges (here: sleeps as long), does not: the call is left out on both ranks, so
    the slow sample moves neither rank's time (with one sample more, a median of two would). The
    times are mapped to 1 ms, and 1000 ms for the slow call (2 s of sleep), so that CPU load
    cannot move the comparison."""
    _set_profile_dir(tmp)
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": CANDS, "warmup": 0, "samples": 1, "extra_samples": 0})
    ran = []
    _spy(layer, ran)
    _slow_first_call(layer, ran, "pipelined:2", captures=rank == 1, seconds=2.0)
    layer.strategy.measure_override = lambda spec, ms: 1000.0 if ms > 1500 else 1.0
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for _ in range(5):
            layer(torch.randn(12, CFG.hidden, generator=g))
    ((key, choice),) = layer.strategy.choices.items()
    assert choice.calibration_calls == 3 and ran[:3].count("pipelined:2") == 2
    # (rank 0's own median over the slow call and the next would be 500.5)
    assert choice.times_ms == {"sequential": 1.0, "pipelined:2": 1.0}, choice.times_ms


def test_a_graph_captured_on_one_rank_leaves_the_call_out_on_every_rank(tmp_path):
    run_gloo(_capture_delays_peer, 2, str(tmp_path))


def test_uneven_and_zero_counts_2_ranks(tmp_path):
    run_gloo(_uneven_calls, 2, str(tmp_path))


def test_uneven_and_zero_counts_4_ranks(tmp_path):
    run_gloo(_uneven_calls, 4, str(tmp_path))


def _timings_agree(rank, world, tmp):
    _set_profile_dir(tmp)
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": CANDS, "warmup": 0, "samples": 2})
    # Rank 0 thinks sequential is fastest (1 vs 2 ms), every other rank is slower on it (5 ms):
    # the max over ranks is sequential 5, pipelined 2: pipelined for all.
    layer.strategy.measure_override = lambda spec, ms: (1.0 if rank == 0 else 5.0) if spec == "sequential" else 2.0
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for _ in range(6):
            layer(torch.randn(12 + rank, CFG.hidden, generator=g))
    (choice,) = layer.strategy.choices.values()
    assert choice.spec == "pipelined:2" and choice.source == "measured"
    assert choice.times_ms == {"sequential": 5.0, "pipelined:2": 2.0}
    assert choice.calibration_ms == pytest.approx(2 * 5.0 + 2 * 2.0)
    assert choice.overhead_ms == pytest.approx(14.0 - 4 * 2.0)


def test_ranks_with_different_timings_reach_one_choice(tmp_path):
    run_gloo(_timings_agree, 2, str(tmp_path))


def _shared_calibration(rank, world, tmp, share):
    """Two auto layers of one config and options share one calibration (each call serves the next
    candidate, whichever layer makes it) and its decision; with share_calibration=False each
    layer calibrates alone. Outputs stay each layer's own."""
    _set_profile_dir(tmp)
    opts = {"candidates": CANDS, "warmup": 0, "samples": 1, "extra_samples": 0, "cache": False,
            "share_calibration": share}
    layers = [MoELayer(CFG, strategy="auto", seed=s, device="cpu", strategy_options=opts) for s in (3, 4)]
    layers[0].strategy.measure_override = lambda spec, ms: 1.0 if spec == "pipelined:2" else 2.0
    layers[1].strategy.measure_override = lambda spec, ms: 1.0 if spec == "pipelined:2" else 2.0
    assert (layers[0].strategy.decider is layers[1].strategy.decider) == share
    ran = [[], []]
    for layer, log in zip(layers, ran):
        _spy(layer, log)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(6 + rank, CFG.hidden, generator=g)
        with torch.no_grad():
            outs = [layer(x) for layer in layers]
        xs = _gather_tensors(x)
        for seed, out in zip((3, 4), outs):
            ref = reference_grads(CFG, seed, xs, [torch.zeros_like(t) for t in xs])[0][rank]
            assert rel_err(out, ref) < 2e-6
    if share:  # call 1: layer 0 sequential, layer 1 pipelined:2; then both run the decision
        assert ran == [["sequential", "pipelined:2", "pipelined:2"], ["pipelined:2"] * 3], ran
        assert layers[0].strategy.choices == layers[1].strategy.choices
    else:
        assert ran == [["sequential", "pipelined:2", "pipelined:2"]] * 2, ran
    assert all(c.spec == "pipelined:2" for layer in layers for c in layer.strategy.choices.values())


def _shared_training_calibration(rank, world, tmp):
    """Three training layers sharing a calibration of two candidates: in step 1 layers 0 and 1
    serve the schedule and layer 2's call, with their backward timings still to come, runs the
    first candidate untimed; step 2's first call decides, and every layer runs the winner.
    Gradients stay right throughout."""
    _set_profile_dir(tmp)
    opts = {"candidates": CANDS, "warmup": 0, "samples": 1, "extra_samples": 0, "cache": False}
    layers = [MoELayer(CFG, strategy="auto", seed=3, device="cpu", strategy_options=opts) for _ in range(3)]
    layers[0].strategy.measure_override = lambda spec, ms: 1.0 if spec == "pipelined:2" else 2.0
    ran = [[], [], []]
    for layer, log in zip(layers, ran):
        _spy(layer, log)
    for step in range(2):
        xs = [torch.randn(6 + r, CFG.hidden, generator=torch.Generator().manual_seed(step * 10 + r))
              for r in range(world)]
        gs = [torch.randn_like(x) for x in xs]
        outs, dxs, *_ = reference_grads(CFG, 3, xs, gs)
        inputs = [xs[rank].clone().requires_grad_() for _ in layers]
        outs = [layer(x) for layer, x in zip(layers, inputs)]  # every forward, then the backwards (a model)
        torch.autograd.backward(outs, [gs[rank]] * len(layers))
        assert all(rel_err(x.grad, dxs[rank]) < 2e-6 for x in inputs)
        if step == 0:
            assert (8, "fwdbwd") not in layers[0].strategy.choices
    assert ran == [["sequential", "pipelined:2"], ["pipelined:2", "pipelined:2"], ["sequential", "pipelined:2"]], ran
    choice = layers[2].strategy.choices[(8, "fwdbwd")]
    assert choice.spec == "pipelined:2" and choice.calibration_calls == 2 and choice.source == "measured"


def _cold_instances(rank, world, tmp):
    """Three layers sharing a calibration, warm-up 1: the schedule's warm-up round warms the
    candidate of the layer that serves it, so a timed slot reaching a layer whose own instance
    of that candidate has not run yet is served untimed by it and stays for the next call (an
    instance's first call compiles, a graph strategy's second captures: not its speed)."""
    from interlace.planning.rounds import round_order

    _set_profile_dir(tmp)
    opts = {"candidates": CANDS, "warmup": 1, "samples": 1, "extra_samples": 0, "cache": False}
    layers = [MoELayer(CFG, strategy="auto", seed=s, device="cpu", strategy_options=opts) for s in (3, 4, 5)]
    ran = [[], [], []]
    for layer, log in zip(layers, ran):
        _spy(layer, log)
    slots = [CANDS[i] for r in range(2) for i in round_order([0, 1], r)]  # the warm-up round, the timed one
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for _ in range(3):
            for layer in layers:
                layer(torch.randn(6 + rank, CFG.hidden, generator=g))
    state = layers[0].strategy.decider.keys[(8, "fwd")]
    # warm-up slots: layer 0 runs the first, layer 1 the second; layer 2's instance of the first
    # timed slot's candidate is cold: it serves that call untimed and layer 0 takes the slot
    seen, expect, pos, calls = [set(), set(), set()], [[], [], []], 0, 0
    while pos < len(slots):
        li = calls % 3
        spec = slots[pos]
        expect[li].append(spec)
        if pos < 2 or spec in seen[li]:
            pos += 1
        seen[li].add(spec)
        calls += 1
    assert [r[:len(e)] for r, e in zip(ran, expect)] == expect, (ran, expect)
    assert calls == len(slots) + 1  # (the one cold call)
    assert state.choice is not None and state.choice.source == "measured"


def test_shared_calibration_times_only_warm_instances(tmp_path):
    run_gloo(_cold_instances, 2, str(tmp_path))


def test_auto_layers_share_a_training_calibration(tmp_path):
    run_gloo(_shared_training_calibration, 2, str(tmp_path))


def test_layers_differing_only_in_source_share_one_decider():
    """HF blocks name their layer in the config's ``source`` (``DeepseekV3MoE model.layers.0.mlp``):
    that alone must not split the calibration; a shape difference does."""
    from interlace.parallel.comm import ExpertParallel
    from interlace.strategies.auto import AutoStrategy

    ep = ExpertParallel(None, 0, 2, CFG.num_experts // 2)  # a view for planning only
    a, b = (AutoStrategy(CFG.with_(source=f"layers.{i}.mlp"), ep, cache=False) for i in range(2))
    assert a.decider is b.decider
    assert AutoStrategy(CFG.with_(top_k=1), ep, cache=False).decider is not a.decider


def _gather_tensors(x):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


@pytest.mark.parametrize("share", [True, False])
def test_auto_layers_share_one_calibration(tmp_path, share):
    run_gloo(_shared_calibration, 2, str(tmp_path), share)


def _close_calls(rank, world, tmp, slower, extra, calls):
    """Candidates whose agreed medians lie within ``resolution`` get further rounds (up to
    ``extra_samples``), each of only the close ones; a clear winner decides after ``samples``.
    A third candidate far behind is not timed again."""
    _set_profile_dir(tmp)
    cands = CANDS + ("pipelined:3",)
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": cands, "warmup": 0, "samples": 1, "cache": False,
                                       "resolution": 0.03, "extra_samples": extra})
    times = {"sequential": 1.0, "pipelined:2": slower, "pipelined:3": 2.0}
    layer.strategy.measure_override = lambda spec, ms: times[spec]
    ran = []
    _spy(layer, ran)
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for _ in range(calls + 2):
            layer(torch.randn(12 + rank, CFG.hidden, generator=g))
    (choice,) = layer.strategy.choices.values()
    assert choice.source == "measured" and choice.spec == "sequential"
    assert choice.calibration_calls == calls
    assert ran[:3] == list(cands) and ran.count("pipelined:3") == 1  # (round 0: each once)
    assert ran[calls:] == ["sequential"] * 2
    assert sorted(ran[3:calls]) == sorted(["sequential", "pipelined:2"] * (extra if slower < 1.03 else 0))


@pytest.mark.parametrize("slower, extra, calls", [(1.02, 4, 3 + 2 * 4), (1.02, 0, 3), (1.1, 4, 3)])
def test_close_candidates_take_more_samples(tmp_path, slower, extra, calls):
    run_gloo(_close_calls, 2, str(tmp_path), slower, extra, calls)


def _calibration_outputs_and_cache(rank, world, tmp, phase):
    """phase 0: calibrate (each calibration call's output equals what the chosen strategy gives
    on the same input), store. phase 1 (a new process): the cached decision runs at once."""
    _set_profile_dir(tmp)
    opts = {"candidates": CANDS, "warmup": 1, "samples": 1, "extra_samples": 0}
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu", strategy_options=opts)
    fixed = {s: MoELayer(CFG, strategy=s, seed=3, device="cpu") for s in CANDS}
    ran = []
    _spy(layer, ran)
    g = torch.Generator().manual_seed(9 + rank)
    xs = [torch.randn(20, CFG.hidden, generator=g) for _ in range(5)]
    with torch.no_grad():
        outs = [layer(x) for x in xs]
        for x, out, spec in zip(xs, outs, ran):  # each call's output is exactly its strategy's
            assert torch.equal(fixed[spec](x), out), spec
    assert ran[-1] == layer.strategy.choices[(32, "fwd")].spec
    (key, choice), = layer.strategy.choices.items()
    assert key == (32, "fwd")
    if phase == 0:
        assert choice.source == "measured" and choice.calibration_calls == 4
        if rank == 0:
            stored = json.loads(layer.strategy.decider.cache.path.read_text())
            assert stored["decisions"]
    else:
        assert choice.source == "cached" and choice.calibration_calls == 4  # the record kept its cost
        assert not any(layer.strategy.decider.keys[key].samples)  # nothing timed


def test_calibration_outputs_and_cache_round_trip(tmp_path):
    run_gloo(_calibration_outputs_and_cache, 2, str(tmp_path), 0)
    run_gloo(_calibration_outputs_and_cache, 2, str(tmp_path), 1)


def _fused_calibration(rank, world, tmp):
    """With the fused path among the candidates (the Triton interpreter): every call takes its
    own agreed count's key (one wait per call, before the launch), the fused buffers grow at
    agreed points only (every rank at the same call, before any launch), and uneven counts still
    run one strategy everywhere with right outputs."""
    _set_profile_dir(tmp)
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": ("sequential", "fused"), "warmup": 0, "samples": 1,
                                       "cache": False})
    layer.strategy.measure_override = lambda spec, ms: 1.0 if spec == "fused" else 2.0
    agree = layer.strategy._agree
    ran, sizes, agreed = [], [], []
    _spy(layer, ran)
    g = torch.Generator().manual_seed(2)
    # 1-3: bucket 4 calibrates (sequential, fused with buffers for 4) and decides fused.
    # 4-5: bucket 32 calibrates: sequential, then fused, its buffers grown to 32 first.
    # 6-9: bucket 2 calibrates (sequential, fused: the buffers for 32 hold it) and decides fused.
    for counts in ([3, 0], [1, 3], [4, 0], [0, 30], [17, 2], [2, 2], [2, 1], [1, 2], [2, 2]):
        xs = [torch.randn(t, CFG.hidden, generator=g) for t in counts]
        outs = reference_grads(CFG, 3, xs, [torch.zeros_like(x) for x in xs])[0]
        before = agree.calls
        with torch.no_grad():
            out = layer(xs[rank])
        agreed.append(agree.calls - before)
        assert counts[rank] == 0 or rel_err(out, outs[rank]) < 2e-6, counts
        impl = layer.strategy._impls.get("fused")
        sizes.append(None if impl is None else impl.max_tokens)
    assert _gather_lists(ran)[0] == ran
    assert ran == ["sequential", "fused", "fused", "sequential", "fused", "sequential", "fused", "fused",
                   "fused"], ran
    assert sizes == [None, 4, 4, 4, 32, 32, 32, 32, 32], sizes
    assert agreed == [1] * 9  # every call agrees once


def test_fused_candidate_uneven_counts(tmp_path):
    run_gloo(_fused_calibration, 2, str(tmp_path))


def _losers_released(rank, world, tmp, winner):
    """Once a key decides, the candidates no key runs or still calibrates are dropped, and their
    peer buffer leaves the process cache (the steady state holds what the winner holds). With a
    third candidate winning, a strategy without buffers leaves beside one that holds them."""
    from interlace.parallel import peer_buffer

    _set_profile_dir(tmp)
    candidates = ("sequential", "fused") + (() if winner == "sequential" else (winner,))
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": candidates, "warmup": 0, "samples": 1, "extra_samples": 0,
                                       "cache": False})
    auto = layer.strategy
    auto.measure_override = lambda spec, ms: 1.0 if spec == winner else 2.0
    g = torch.Generator().manual_seed(5)
    held = []
    for counts in ([3, 4], [4, 2], [1, 3], [4, 4]):  # one call per candidate calibrates, the next runs the winner
        xs = [torch.randn(t, CFG.hidden, generator=g) for t in counts]
        ref = reference_grads(CFG, 3, xs, [torch.zeros_like(x) for x in xs])[0][rank]
        with torch.no_grad():
            out = layer(xs[rank])
        assert rel_err(out, ref) < 2e-6, counts
        fused = auto._impls.get("fused")
        held.append((fused is not None, len(peer_buffer._CACHE)))
        if fused is not None:
            buf = fused.buf
    assert auto.choices[(4, "fwd")].spec == winner
    calibrating = [(True, 1)] * (len(candidates) - 1)  # fused's buffer held until the key decides
    assert held == [(False, 0)] + calibrating + [(False, 0)] * (4 - len(candidates)), held
    assert buf.users == 0
    assert list(auto._impls) in ([], [winner]), list(auto._impls)


@pytest.mark.parametrize("winner", ["sequential", "pipelined:2"])
def test_losing_candidates_are_dropped_with_their_buffers(tmp_path, winner):
    run_gloo(_losers_released, 2, str(tmp_path), winner)


def _decided_keys_and_capacity(rank, world, tmp):
    """Once a key is decided, its calls run the decision (a new bucket calibrates its own); a
    call over ``capacity`` raises on every rank alike, before any launch, and the layer serves
    the next call."""
    _set_profile_dir(tmp)
    g = torch.Generator().manual_seed(4)
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": CANDS, "warmup": 0, "samples": 1, "extra_samples": 0,
                                       "cache": False})
    ran = []
    _spy(layer, ran)

    def run(lay, counts):
        xs = [torch.randn(t, CFG.hidden, generator=g) for t in counts]
        ref = reference_grads(CFG, 3, xs, [torch.zeros_like(x) for x in xs])[0][rank]
        with torch.no_grad():
            out = lay(xs[rank])
        assert counts[rank] == 0 or rel_err(out, ref) < 2e-6, counts

    for counts in ([9, 12], [16, 10], [11, 0]):  # bucket 16: calibrates and decides
        run(layer, counts)
    decided = layer.strategy.choices[(16, "fwd")]
    assert decided.source == "measured"
    del ran[:]
    for counts in ([12, 9], [0, 16], [16, 16]):
        run(layer, counts)
    assert ran == [decided.spec] * 3
    run(layer, [2, 4])  # a new bucket (4) calibrates its own key: the first candidate
    assert ran[-1] == CANDS[0] and (4, "fwd") not in layer.strategy.choices
    fused = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": ("fused",), "capacity": 4, "cache": False})
    for counts in ([3, 4], [4, 1]):
        run(fused, counts)
    with pytest.raises(ValueError, match="over capacity=4"):
        run(fused, [2, 6])
    run(fused, [4, 3])
    # A decided fused key goes straight to its strategy while its buffers hold the call; where
    # another bucket grows them, the keys that ran the old buffers are dropped and re-enter.
    grow = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                    strategy_options={"candidates": ("fused",), "warmup": 0, "samples": 1, "cache": False})
    auto = grow.strategy
    for counts in ([3, 4], [4, 2], [1, 3]):
        run(grow, counts)
    old = auto._impls["fused"]
    assert auto._ready[(4, "fwd")] == (old, 4, "fused")
    for counts in ([16, 2], [9, 12], [5, 16]):
        run(grow, counts)
    new = auto._impls["fused"]
    assert new is not old and new.max_tokens == 16 and (4, "fwd") not in auto._ready
    run(grow, [4, 3])
    assert auto._ready[(4, "fwd")] == (new, 16, "fused") == auto._ready[(16, "fwd")]


def test_decided_keys_and_capacity(tmp_path):
    run_gloo(_decided_keys_and_capacity, 2, str(tmp_path))


def _side_channel_paths(rank, world, tmp):
    """The agreement's paths: posted by the layer before routing, or by the strategy's own call
    (a caller that skips begin_call); a wrong announced count raises after the agreement (ranks
    stay in step); the side channel of a non-gloo group is one gloo group per rank tuple, shared
    by layers (here two EP subgroups of 4 ranks, the backend faked as NCCL); a peer that never
    comes raises within the timeout."""
    import torch.distributed as dist

    from interlace.parallel import agreement

    _set_profile_dir(tmp)
    g = torch.Generator().manual_seed(11 + rank)
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu", strategy_options={"candidates": CANDS})
    strategy = layer.strategy
    xs = [torch.randn(5 + r, CFG.hidden, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    ref = reference_grads(CFG, 3, xs, [torch.zeros_like(t) for t in xs])[0][rank]
    x = xs[rank]
    with torch.no_grad():
        idx, w, _ = layer.router(x, None, fused=True)
        direct = strategy(x, idx, w, layer.experts.w_up, layer.experts.w_down)  # posts for itself
        assert strategy._agree.calls == 1 and not strategy._agree.posted
        via_layer = layer(x)  # posted by begin_call, before the router
        assert rel_err(direct, ref) < 2e-6 and rel_err(via_layer, ref) < 2e-6
        assert strategy._agree.calls == 2 and not strategy._agree.posted
        strategy.begin_call(x.shape[0] + 1, False, False)
        with pytest.raises(RuntimeError, match=f"announced {x.shape[0] + 1} tokens"):
            strategy(x, idx, w, layer.experts.w_up, layer.experts.w_down)
        assert strategy._agree.calls == 3 and not strategy._agree.posted
    # Two EP subgroups {0, 1} and {2, 3}; their backend faked as NCCL: each gets one gloo side
    # channel, shared by both layers over it.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    real = agreement.group_backend
    agreement.group_backend = lambda grp: "nccl" if grp in groups else real(grp)
    try:
        a = MoELayer(CFG, group=mine, strategy="auto", seed=3, device="cpu", strategy_options={"candidates": CANDS})
        b = MoELayer(CFG, group=mine, strategy="auto", seed=4, device="cpu", strategy_options={"candidates": CANDS})
    finally:
        agreement.group_backend = real
    assert a.strategy._agree.group is b.strategy._agree.group and a.strategy._agree.group is not mine
    counts = [[3, 0], [9, 1]][rank // 2]
    xs = [torch.randn(t, CFG.hidden, generator=torch.Generator().manual_seed(t)) for t in counts]
    for lay, seed in ((a, 3), (b, 4)):
        ref = reference_grads(CFG, seed, xs, [torch.zeros_like(t) for t in xs])[0][rank % 2]
        for _ in range(3):
            with torch.no_grad():
                out = lay(xs[rank % 2])
            assert counts[rank % 2] == 0 or rel_err(out, ref) < 2e-6
    assert a.strategy._agree.calls == 3 and set(a.strategy.choices) <= {(4, "fwd"), (16, "fwd")}
    # A peer that never comes: rank 0's wait raises within the timeout, naming itself.
    pair = dist.new_group([0, 1])
    if rank < 2:
        lay = MoELayer(CFG, group=pair, strategy="auto", seed=3, device="cpu",
                       strategy_options={"candidates": CANDS, "agree_timeout_s": 2.0})
        if rank == 0:
            with pytest.raises(RuntimeError, match="rank 0 of 2"), torch.no_grad():
                lay(torch.randn(4, CFG.hidden, generator=g))


def test_side_channel_paths_4_ranks(tmp_path):
    run_gloo(_side_channel_paths, 4, str(tmp_path))


def test_prior_prunes_far_slower_candidates():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "planning"))
    from test_plan_auto import fused_profile

    prof = fused_profile({100: 0.2})  # fused measured 5x slower than sequential
    predicted, _ = predicted_candidates(CFG, 100, 2, prof, "fwd")
    assert set(predicted) >= {"sequential", "fused"} and predicted["fused"] > 4 * predicted["sequential"]
    kept, notes = prune(predicted, 1.5)
    assert "fused" not in kept and "sequential" in kept and any("fused: predicted" in n for n in notes)
    prof = fused_profile({100: 2.0})
    kept, _ = prune(predicted_candidates(CFG, 100, 2, prof, "fwd")[0], 1.5)
    assert kept[0] == "fused"  # ordered by prediction
    kept, _ = prune({"sequential": 1.0, "fused": None}, 1.5)  # no prediction: kept, timed last
    assert kept == ["sequential", "fused"]
    # No profile: sequential and the mode's fused path, unpredicted.
    predicted, notes = predicted_candidates(CFG, 100, 2, "/nonexistent.json", "fwdbwd")
    assert predicted == {"sequential": None, "fused:train": None}


def test_memory_cap_excludes_fused_train():
    from interlace.parallel.comm import ExpertParallel
    from interlace.strategies.auto import AutoStrategy
    from interlace.strategies.auto_prior import fused_buffer_bytes

    ep = ExpertParallel(None, 0, 2, 4)  # a 2-rank view, only for planning (nothing is called)
    need = fused_buffer_bytes(CFG, 2, 64)
    for cap, excluded in ((need - 1, True), (need, False)):
        s = AutoStrategy(CFG, ep, candidates=("sequential", "fused:train"), memory_cap=cap, cache=False)
        plan = s.decider.plan((64, "fwdbwd"), "cpu")
        if excluded:
            assert plan.choice.spec == "sequential" and any("memory_cap" in n for n in plan.choice.notes)
        else:
            assert plan.candidates == ("sequential", "fused:train")


@pytest.mark.parametrize("world,ratio,excluded", [(2, 2.0, False), (4, 2.0, True), (4, 4.0, False),
                                                  (4, None, False), (8, 2.0, True)])
def test_train_memory_ratio_excludes_fused_train(world, ratio, excluded):
    """fused:train keeps W·min(k, E_local)/k times sequential's rows for the backward (CFG: k 2,
    8 experts: 2 at EP 2, 4 at EP 4, 4 at EP 8 where a rank holds 1 expert); past
    train_memory_ratio it is no candidate, in the calibrated plan and the profile-only choice. The
    model's own candidates hold fused:lean (fused:train's kernels keeping the rows received) at
    every ratio, and never fused:train."""
    from interlace.parallel.comm import ExpertParallel
    from interlace.strategies.auto import AutoStrategy
    from interlace.strategies.auto_prior import fused_train_rows_ratio

    assert fused_train_rows_ratio(CFG, world) == {2: 2.0, 4: 4.0, 8: 4.0}[world]
    ep = ExpertParallel(None, 0, world, CFG.num_experts // world)  # a view for planning only
    s = AutoStrategy(CFG, ep, candidates=("sequential", "fused:train"), train_memory_ratio=ratio, cache=False)
    plan = s.decider.plan((64, "fwdbwd"), "cpu")
    if excluded:
        assert plan.choice.spec == "sequential"
        assert any(f"keeps {fused_train_rows_ratio(CFG, world):g}x the rows" in n for n in plan.choice.notes)
    else:
        assert plan.candidates == ("sequential", "fused:train")
    model = AutoStrategy(CFG, ep, train_memory_ratio=ratio, cache=False)  # the model's candidates: the lean path
    train = model.decider.plan((64, "fwdbwd"), "cpu").candidates
    assert "fused:lean" in train and "fused:train" not in train
    assert "fused:lean" not in model.decider.plan((64, "fwd"), "cpu").candidates
    fwd = AutoStrategy(CFG, ep, candidates=("sequential", "fused"), train_memory_ratio=ratio, cache=False)
    assert fwd.decider.plan((64, "fwd"), "cpu").candidates == ("sequential", "fused")  # (forward: untouched)
    with pytest.raises(ValueError, match="train_memory_ratio"):
        AutoStrategy(CFG, ep, train_memory_ratio=0)


@pytest.mark.parametrize("options,used", [({}, True), ({"train_memory_ratio": 1.5}, False),
                                          ({"train_fused": False}, False)])
def test_cached_decision_is_used_only_where_the_options_admit_it(tmp_path, options, used):
    """A decision cache written under other options (or an older release) can hold fused:train
    for a key these options exclude it from: that key is planned afresh, not run from the cache."""
    from interlace.parallel.comm import ExpertParallel
    from interlace.planning.profile import machine_key
    from interlace.strategies.auto import AutoStrategy

    ep = ExpertParallel(None, 0, 2, CFG.num_experts // 2)  # a view for planning only
    s = AutoStrategy(CFG, ep, candidates=("sequential", "fused:train"), decisions_dir=str(tmp_path),
                     shipped_decisions=False, **options)
    DecisionCache(machine_key(2, torch.device("cpu")), tmp_path, None).store(
        s.decider.shape, "fwdbwd", 64, Choice("fused:train", "measured"))
    plan = s.decider.plan((64, "fwdbwd"), torch.device("cpu"))
    if used:
        assert plan.choice.spec == "fused:train" and plan.choice.source == "cached"
    else:
        assert plan.choice.spec == "sequential" and plan.choice.source == "predicted", plan.choice


def test_cache_interpolates_only_between_agreeing_neighbours(tmp_path):
    cache = DecisionCache("dev", tmp_path)
    cache.store("S", "fwd", 64, Choice("fused", "measured"))
    cache.store("S", "fwd", 1024, Choice("fused", "measured"))
    cache.store("S", "fwd", 4096, Choice("sequential", "measured"))
    again = DecisionCache("dev", tmp_path)
    assert again.lookup("S", "fwd", 64).source == "cached"
    assert again.lookup("S", "fwd", 256).spec == "fused" and again.lookup("S", "fwd", 256).source == "interpolated"
    assert again.lookup("S", "fwd", 2048) is None  # neighbours disagree: calibrate
    assert again.lookup("S", "fwd", 8192) is None and again.lookup("S", "fwd", 32) is None  # outside
    assert again.lookup("S", "fwdbwd", 64) is None
    assert [token_bucket(t) for t in (0, 1, 2, 3, 64, 65)] == [0, 1, 2, 4, 64, 128]


def test_options_refuse_rank_local_choices():
    with pytest.raises(ValueError, match="fixed parameters"):
        MoELayer(CFG, strategy="auto", device="cpu", strategy_options={"candidates": ("pipelined:auto",)})
    with pytest.raises(ValueError, match="unknown"):
        MoELayer(CFG, strategy="auto", device="cpu", strategy_options={"nope": 1})


def test_default_strategy_is_auto_and_logs_its_decision(caplog):
    layer = MoELayer(CFG, device="cpu")
    assert layer.strategy.name == "auto"
    with caplog.at_level(logging.INFO, logger="interlace.auto"):
        out = layer(torch.randn(5, CFG.hidden))
    assert out.shape == (5, CFG.hidden)
    assert layer.strategy.choices[(8, "fwdbwd")].spec == "sequential"
    assert any("world size 1" in r.getMessage() for r in caplog.records)
    assert shape_key(CFG, 1) in caplog.records[0].getMessage()


def test_shipped_decisions_lie_beneath_the_users(tmp_path):
    """Decisions shipped for the presets are read beneath the user's cache: a bucket the user's
    file holds wins, one only shipped is used, and stores go to the user's file alone."""
    ship = DecisionCache("dev", tmp_path / "ship", shipped_dir=None)
    ship.store("S", "fwd", 64, Choice("fused", "measured"))
    ship.store("S", "fwd", 128, Choice("fused", "measured"))
    user = DecisionCache("dev", tmp_path / "user", shipped_dir=tmp_path / "ship")
    assert user.lookup("S", "fwd", 64).spec == "fused" and user.lookup("S", "fwd", 64).source == "cached"
    user.store("S", "fwd", 64, Choice("sequential", "measured"))
    again = DecisionCache("dev", tmp_path / "user", shipped_dir=tmp_path / "ship")
    assert again.lookup("S", "fwd", 64).spec == "sequential" and again.lookup("S", "fwd", 128).spec == "fused"
    shipped = json.loads((tmp_path / "ship" / "dev.json").read_text())["decisions"]["S/fwd"]
    assert shipped["64"]["spec"] == "fused"  # untouched by the user's store
    assert DecisionCache("dev", tmp_path / "user", shipped_dir=None).lookup("S", "fwd", 128) is None


def test_shipped_decision_files_are_readable_and_name_real_strategies(tmp_path):
    """Every file shipped in interlace/tuning/decisions/ loads through the cache, under its own
    device key, with the presets' shape keys, and names registered strategies."""
    from interlace.config import PRESETS
    from interlace.strategies.auto_decisions import SHIPPED_DIR, decision_shape
    from interlace.strategies.base import strategy_class

    files = sorted(SHIPPED_DIR.glob("*.json"))
    assert files, "no shipped decisions"
    for path in files:
        data = json.loads(path.read_text())
        key = path.stem
        assert data["device_key"] == key
        world = int(key.split("-w")[1].split("-")[0])
        preset_shapes = {decision_shape(cfg, world) for cfg in PRESETS.values()}
        cache = DecisionCache(key, tmp_path / "user", shipped_dir=SHIPPED_DIR)
        for entry, by_bucket in data["decisions"].items():
            shape, mode = entry.rsplit("/", 1)
            assert shape in preset_shapes, shape
            for bucket, record in by_bucket.items():
                strategy_class(record["spec"])
                choice = cache.lookup(shape, mode, int(bucket))
                assert choice is not None and choice.spec == record["spec"] and choice.source == "cached"


def _gradient_accumulation(rank, world, tmp):
    """Six training forwards (micro-batches), then one backward: auto decides only once every
    candidate has a complete (forward + backward) timing, on every rank alike, never on the
    forwards alone (their backward marks have not fired: an infinite time)."""
    _set_profile_dir(tmp)
    layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"candidates": CANDS, "warmup": 0, "samples": 1, "extra_samples": 0,
                                       "cache": False})
    g = torch.Generator().manual_seed(8)
    outs = [layer(torch.randn(5 + rank, CFG.hidden, generator=g, requires_grad=True)) for _ in range(6)]
    assert (8, "fwdbwd") not in layer.strategy.choices  # nothing complete yet: no decision
    torch.stack([o.square().mean() for o in outs]).sum().backward()
    for _ in range(2):
        layer(torch.randn(5 + rank, CFG.hidden, generator=g, requires_grad=True)).sum().backward()
    choice = layer.strategy.choices[(8, "fwdbwd")]
    assert choice.source == "measured" and all(math.isfinite(t) for t in choice.times_ms.values()), choice
    assert _gather_lists(choice.spec)[0] == choice.spec


def test_gradient_accumulation_decides_on_complete_timings(tmp_path):
    run_gloo(_gradient_accumulation, 2, str(tmp_path))
