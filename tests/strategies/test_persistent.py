"""The ``persistent`` strategy under TRITON_INTERPRET=1 (world size 1, and 2 and 4 gloo ranks):
inference calls route inside the kernel (the layer's hook), training calls and forced indices
run ``sequential``'s path; both against the fp64 reference. Refusals are one-line ValueErrors."""

from __future__ import annotations

import pytest
import torch

from interlace import MoEConfig, MoELayer, reference_moe
from interlace.kernels.persistent.config import PersistentKernelConfig
from interlace.kernels.persistent.protocol import Wait
from interlace.parallel.comm import ExpertParallel
from interlace.strategies.persistent import PersistentStrategy

CPU = torch.device("cpu")


def layer_for(router="softmax", strategy_options=None, **changes):
    changes = {"dtype": torch.float32, **changes}
    cfg = MoEConfig(hidden=32, ffn=24, num_experts=4, top_k=2, router=router, **changes)
    layer = MoELayer(cfg, strategy="persistent", seed=3, device=CPU, strategy_options=strategy_options)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.randn(cfg.num_experts) * 0.1)
    return layer


def reference(layer, x, **kw):
    shared = None
    if layer.shared is not None:
        shared = (layer.shared.w_up.detach(), layer.shared.w_down.detach(),
                  None if layer.shared.gate is None else layer.shared.gate.detach())
    ref, _ = reference_moe(x.reshape(-1, layer.config.hidden), layer.router.weight.detach(),
                           layer.experts.w_up.detach(), layer.experts.w_down.detach(), layer.config,
                           expert_bias=layer.router.expert_bias, shared=shared, **kw)
    return ref.reshape(x.shape)


def epoch(layer) -> int:
    buf = layer.strategy.state.buffer
    return 0 if buf is None else int(buf[0])


@pytest.mark.parametrize("T", [0, 1, 7, 33])
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_inference_routes_in_the_kernel(T, router):
    extra = dict(renormalize=True, route_scale=2.5) if router == "sigmoid" else {}
    layer = layer_for(router, **extra)
    x = torch.randn(T, 32)
    with torch.no_grad():
        out = layer(x)
        again = layer(x)
    assert epoch(layer) == (2 if T else 0)  # two launches of the kernel (none for T = 0)
    assert torch.equal(out, again)
    assert torch.isfinite(out).all()
    if T:
        assert (out.double() - reference(layer, x)).abs().max() < 1e-4


def test_batched_input_and_shared_expert():
    layer = layer_for(shared_ffn=16, shared_gate=True)
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == x.shape and epoch(layer) == 1
    assert (out.double() - reference(layer, x)).abs().max() < 1e-4


def test_training_call_runs_sequential():
    layer = layer_for()
    x = torch.randn(7, 32, requires_grad=True)
    out = layer(x)
    assert epoch(layer) == 0  # not the kernel
    assert (out.double() - reference(layer, x.detach())).abs().max() < 1e-4
    out.sum().backward()
    assert x.grad is not None and layer.experts.w_up.grad is not None and layer.router.weight.grad is not None


def test_forced_indices_run_sequential():
    layer = layer_for()
    x = torch.randn(7, 32)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3], [0, 3]])
    with torch.no_grad():
        out = layer(x, expert_indices=idx)
    assert epoch(layer) == 0
    assert (out.double() - reference(layer, x, expert_indices=idx)).abs().max() < 1e-4


def test_broken_task_order_raises():
    layer = layer_for(strategy_options={"task_order": "combine_first", "max_spins": 1})
    with torch.no_grad(), pytest.raises(RuntimeError, match="timed out waiting for the GEMM1 counter"):
        layer(torch.randn(7, 32))


def test_kernel_option_and_bad_options():
    layer = layer_for(strategy_options={"kernel": PersistentKernelConfig(block_m=32, programs=2)})
    x = torch.randn(33, 32)
    with torch.no_grad():
        assert (layer(x).double() - reference(layer, x)).abs().max() < 1e-4
    with pytest.raises(TypeError, match="PersistentKernelConfig"):
        layer_for(strategy_options={"kernel": {"block_m": 16}})
    with pytest.raises(ValueError, match="task_order"):
        layer_for(strategy_options={"task_order": "backwards"})


@pytest.mark.parametrize("router, factor", [("softmax", 0.5), ("sigmoid", 0.75), ("softmax", 2.0)])
def test_capacity_factor_drops_as_the_reference(router, factor):
    """A capacity factor at world size 1: each expert keeps ceil(factor·T·k/E) of the call's
    assignments, served slot-major (every first choice in token order before any second), the
    rest add nothing; 0.5 and 0.75 drop many, 2.0 none. A skewing bias makes one expert
    overflow."""
    extra = dict(renormalize=True, route_scale=2.5) if router == "sigmoid" else {}
    layer = layer_for(router, capacity_factor=factor, **extra)
    x = torch.randn(29, 32)
    with torch.no_grad():
        for bias in (None, 3.0):
            if bias is not None and layer.router.expert_bias is not None:
                layer.router.expert_bias.zero_()[1] = bias
            out = layer(x)
            assert torch.isfinite(out).all()
            assert (out.double() - reference(layer, x)).abs().max() < 1e-4
        assert torch.equal(layer(x), out)
    assert epoch(layer) == 3  # (three calls of the kernel)


@pytest.mark.parametrize("changes, message", [
    (dict(n_group=2, topk_group=1), "group-limited routing"),
    (dict(softmax_after_topk=True), "softmax_after_topk"),
    (dict(dtype=torch.float64), "bf16/fp16/fp32"),
])
def test_phase_one_refusals(changes, message):
    with pytest.raises(ValueError, match=message):
        layer_for(**changes)


def test_world_size_must_divide_the_experts():
    cfg = MoEConfig(hidden=32, ffn=24, num_experts=4, top_k=2, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^persistent: the world size \(3\) must divide the number of experts \(4\)$"):
        PersistentStrategy(cfg, ExpertParallel(None, 0, 3, 1))
    with pytest.raises(ValueError, match="world-1 test option"):
        PersistentStrategy(cfg, ExpertParallel(None, 0, 2, 2), task_order="combine_first")
    with pytest.raises(ValueError, match="max_tokens"):
        PersistentStrategy(cfg, ExpertParallel(None, 0, 2, 2), max_tokens=0)
    PersistentStrategy(cfg, ExpertParallel(None, 0, 2, 2))  # W = 2 divides E = 4


def _gloo_persistent(rank, world):
    """W ranks under gloo (the staged transport: three launches per call with all_to_all
    exchanges between): uneven, zero and skewed token counts against the fp64 reference over
    all experts, bitwise repeatability, epochs, training through sequential, max_tokens."""
    from cases import make_inputs
    from helpers import full_weights

    cfg = MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, router="sigmoid", renormalize=True,
                    dtype=torch.float32)
    rw, bias, wu, wd = full_weights(cfg, 3)
    layer = MoELayer(cfg, strategy="persistent", seed=3, device=CPU, strategy_options={"max_tokens": 16})
    assert layer.strategy.ep.world == world and torch.equal(layer.router.weight.detach(), rw)
    calls = 0
    for case, tokens in (("uneven", [5 + 3 * r for r in range(world)]),
                         ("empty rank", [0 if r == 1 else 9 + r for r in range(world)]),
                         ("all empty", [0] * world), ("one token", [1] * world), ("full", [16] * world),
                         ("skewed", [7 + r for r in range(world)])):
        if case == "skewed":  # every token of every rank to two experts of the last rank
            bias = torch.zeros(cfg.num_experts)
            bias[-2:] = 100.0
            layer.router.expert_bias.copy_(bias)
        xs, _ = make_inputs(cfg, tokens, seed=sum(tokens))
        with torch.no_grad():
            out = layer(xs[rank])
            again = layer(xs[rank])
        calls += 2
        assert torch.equal(out, again), case
        ref = reference_moe(xs[rank], rw, wu, wd, cfg, expert_bias=bias)[0]
        assert out.shape == ref.shape and torch.isfinite(out).all(), case
        if tokens[rank]:
            assert (out.double() - ref).abs().max() < 1e-4, case
    buf = layer.strategy.state
    assert buf.kind == "staged" and int(buf.state[0]) == calls
    # training: sequential's path (the kernel does not run), gradients flow
    x = make_inputs(cfg, [6] * world, seed=1)[0][rank].requires_grad_()
    out = layer(x)
    out.sum().backward()
    assert int(buf.state[0]) == calls and x.grad is not None
    assert (out.detach().double() - reference_moe(x.detach(), rw, wu, wd, cfg, expert_bias=bias)[0]).abs().max() < 1e-4
    with pytest.raises(ValueError, match=r"^persistent: a rank passed 17 tokens, over max_tokens=16"):
        with torch.no_grad():
            layer(torch.randn(17 if rank == 0 else 3, 32))  # (every rank raises, before the kernel)
    # release_shared_buffers drops the process's W > 1 buffers; this layer keeps its own
    from interlace.parallel import release_shared_buffers
    from interlace.strategies.persistent import _DIST_BUFFERS

    assert list(_DIST_BUFFERS.values()) == [buf]
    release_shared_buffers()
    assert not _DIST_BUFFERS and layer.strategy.state is buf


def _gloo_capacity(rank, world):
    """A capacity factor over gloo (the staged transport): uneven and skewed token counts
    against the fp64 reference of each rank's own tokens (capacity is per rank)."""
    from cases import make_inputs
    from helpers import full_weights

    cfg = MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32, capacity_factor=0.5)
    rw, bias, wu, wd = full_weights(cfg, 3)
    layer = MoELayer(cfg, strategy="persistent", seed=3, device=CPU, strategy_options={"max_tokens": 24})
    for tokens in ([5 + 7 * r for r in range(world)], [0] + [24] * (world - 1)):
        xs, _ = make_inputs(cfg, tokens, seed=sum(tokens))
        with torch.no_grad():
            out = layer(xs[rank])
        ref = reference_moe(xs[rank], rw, wu, wd, cfg, expert_bias=bias)[0]
        assert out.shape == ref.shape and torch.isfinite(out).all()
        if tokens[rank]:
            assert (out.double() - ref).abs().max() < 1e-4, tokens
    assert int(layer.strategy.state.state[0]) == 2  # (two calls of the kernel, not a fallback)


def test_gloo_capacity_factor():
    from helpers import run_gloo

    run_gloo(_gloo_capacity, 2)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_world_sizes(world):
    from helpers import run_gloo

    run_gloo(_gloo_persistent, world)


# ---- plans and CUDA graphs (EagerRecorder: the graph logic on the CPU) ---------------------------

class CountingRecorder:
    """An EagerRecorder that counts its captures (class attribute: one count per test)."""

    captures: list = []

    def __init__(self):
        from interlace.strategies.graphs import EagerRecorder

        self.inner = EagerRecorder()

    def capture(self, fn, device, shared_pool: bool = False):
        CountingRecorder.captures.append(device)
        assert shared_pool  # its output is cloned at once: the shared pool (strategies/graphs.py)
        return self.inner.capture(fn, device)

    def replay(self):
        self.inner.replay()


def graph_layer(**options):
    CountingRecorder.captures = []
    layer = layer_for("sigmoid", renormalize=True, route_scale=2.5, strategy_options=options or None)
    layer.strategy.graph_recorder = CountingRecorder
    return layer


def test_graph_taken_on_the_second_call_and_equals_the_eager_path():
    layer = graph_layer()
    eager = layer_for("sigmoid", renormalize=True, route_scale=2.5, strategy_options={"cuda_graph": False})
    eager.load_state_dict(layer.state_dict())
    xs = [torch.randn(7, 32) for _ in range(4)]
    with torch.no_grad():
        outs = [layer(x) for x in xs]
        assert len(CountingRecorder.captures) == 1  # first call eager, second captures, then replays
        assert set(layer.strategy._graphs) == {7}
        for x, out in zip(xs, outs):
            assert torch.equal(out, eager(x))  # same kernel, same grid: the same bits
            assert (out.double() - reference(layer, x)).abs().max() < 1e-4
    assert all(not torch.equal(outs[0], o) for o in outs[1:])  # each output its own (not the static buffer)
    assert epoch(layer) == 4  # one launch per call: eager, capture (the EagerRecorder runs it), two replays


def test_graphs_of_different_token_counts_do_not_mix():
    layer = graph_layer()
    with torch.no_grad():
        for T in (5, 9, 5, 9, 5, 9):
            x = torch.randn(T, 32)
            out = layer(x)
            assert out.shape == (T, 32)
            assert (out.double() - reference(layer, x)).abs().max() < 1e-4
    assert len(CountingRecorder.captures) == 2 and set(layer.strategy._graphs) == {5, 9}


def test_a_new_weight_tensor_recaptures_and_in_place_updates_do_not():
    layer = graph_layer()
    x = torch.randn(6, 32)
    with torch.no_grad():
        layer(x), layer(x)
        assert len(CountingRecorder.captures) == 1
        layer.experts.w_up.mul_(1.5)  # in place: same address, the graph sees the new values
        assert (layer(x).double() - reference(layer, x)).abs().max() < 1e-4
        assert len(CountingRecorder.captures) == 1
        layer.experts.w_down = torch.nn.Parameter(layer.experts.w_down.detach() * 0.5)  # a new tensor
        out = layer(x)
        assert len(CountingRecorder.captures) == 2  # captured again at once (T seen)
        assert (out.double() - reference(layer, x)).abs().max() < 1e-4
        layer.router.expert_bias = layer.router.expert_bias.clone() + 0.3
        out = layer(x)
        assert len(CountingRecorder.captures) == 3
        assert (out.double() - reference(layer, x)).abs().max() < 1e-4


def test_plans_are_reused_and_rebuilt_when_the_state_grows(monkeypatch):
    from interlace.strategies import persistent

    layer = layer_for(strategy_options={"cuda_graph": False})
    strategy = layer.strategy
    with torch.no_grad():
        layer(torch.randn(3, 32))
        plan = strategy._plans[3]
        layer(torch.randn(3, 32))
        assert strategy._plans[3] is plan  # reused
        layer(torch.randn(200, 32))  # more tiles: the state's buffer grows
        assert not plan.matches(torch.randn(3, 32), layer.router.weight, None, layer.experts.w_up,
                                layer.experts.w_down)
        x = torch.randn(3, 32)
        out = layer(x)
        assert strategy._plans[3] is not plan
        assert (out.double() - reference(layer, x)).abs().max() < 1e-4
        monkeypatch.setattr(persistent, "MAX_PLANS", 2)
        for T in (4, 5, 6):
            layer(torch.randn(T, 32))
        assert list(strategy._plans) == [5, 6]  # least recently used dropped


def test_graph_dropped_with_its_plan(monkeypatch):
    from interlace.strategies import persistent

    monkeypatch.setattr(persistent, "MAX_PLANS", 1)
    layer = graph_layer()
    with torch.no_grad():
        x = torch.randn(4, 32)
        layer(x), layer(x)
        assert set(layer.strategy._graphs) == {4}
        layer(torch.randn(8, 32))
        assert set(layer.strategy._graphs) == set()  # T = 4's plan (and graph) dropped
        out = layer(x)  # T = 4 seen: a new plan, captured again
        assert len(CountingRecorder.captures) == 2
        assert (out.double() - reference(layer, x)).abs().max() < 1e-4


def test_eager_variant_and_bad_graph_option():
    layer = MoELayer(MoEConfig(hidden=32, ffn=24, num_experts=4, top_k=2, dtype=torch.float32),
                     strategy="persistent:eager", seed=3, device=CPU)
    assert layer.strategy.cuda_graph is False
    with pytest.raises(ValueError, match="cuda_graph"):
        layer_for(strategy_options={"cuda_graph": "yes"})


def test_landed_error_record_raises_on_the_next_call():
    """The CUDA path's bookkeeping (the record's host mirror, read once an event behind the call
    has completed), with a stand-in event on the CPU: a call not completed yet raises nothing;
    once completed, a set mirror raises at the next call, naming the task and the flag, and the
    mirror and the device record are cleared."""
    layer = layer_for()
    strategy = layer.strategy

    class Event:
        done = False

        def query(self):
            return self.done

    with torch.no_grad():
        layer(torch.randn(3, 32))
        strategy.state.host_error.copy_(torch.tensor([1, 0, Wait.GEMM1, 17, 0, 3, 9, 2], dtype=torch.int32))
        strategy._record_view = strategy.state.host_error.numpy()
        strategy._record_event, strategy._record_pending = Event(), True
        layer(torch.randn(3, 32))  # not landed: nothing raised yet
        strategy._record_event.done = True
        with pytest.raises(RuntimeError, match=r"task 17 timed out waiting for the GEMM1 counter .* value 3, expected ≥ 9"):
            layer(torch.randn(3, 32))
        assert not strategy._record_pending and not strategy.state.host_error.any()
        assert not strategy.state.error_record().any()
        x = torch.randn(3, 32)
        assert (layer(x).double() - reference(layer, x)).abs().max() < 1e-4


def test_no_event_query_inside_a_capture(monkeypatch):
    """Inside a user's CUDA graph capture the strategy neither queries nor marks the error
    record's event (CUDA refuses an event query while the stream captures): stand-ins on the CPU."""
    strategy = layer_for().strategy

    class Event:
        def query(self):
            raise AssertionError("queried inside a capture")

    strategy._record_event, strategy._record_pending = Event(), True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    strategy._raise_landed_error()  # no query
    assert strategy._record_pending


def test_timeline_option_records_the_last_call_and_runs_eagerly():
    """``timeline=True``: no CUDA graph (the recorder is never asked), the records of the last
    call only (task numbers 0 .. total−1 once each at world size 1), the same bits as with the
    timeline off; errors before a call and with the option off; a non-bool is refused."""
    from interlace.kernels.persistent.tasks import TIMELINE_KINDS

    layer = graph_layer(timeline=True)
    off = layer_for("sigmoid", renormalize=True, route_scale=2.5)
    off.load_state_dict(layer.state_dict())
    with pytest.raises(RuntimeError, match="no call yet"):
        layer.strategy.timeline_records()
    xs = [torch.randn(9, 32), torch.randn(9, 32), torch.randn(4, 32)]
    with torch.no_grad():
        outs = [layer(x) for x in xs]
        for x, out in zip(xs, outs):
            assert torch.equal(out, off(x))
    assert CountingRecorder.captures == [] and not layer.strategy._graphs
    recs = layer.strategy.timeline_records()
    layout = layer.strategy._plans[4].layout  # the last call's (T = 4), not T = 9's
    assert [r["task"] for r in recs] == list(range(layout.total))
    assert {r["kind"] for r in recs} <= set(TIMELINE_KINDS) and recs[0]["kind"] == "gate"
    assert min(r["start"] for r in recs) == 0 and all(r["start"] <= r["waited"] <= r["end"] for r in recs)
    with pytest.raises(RuntimeError, match="timeline is off"):
        off.strategy.timeline_records()
    with pytest.raises(ValueError, match=r"^strategy option 'timeline' must be a bool, got 'yes'$"):
        layer_for(strategy_options={"timeline": "yes"})


def _gpu_check_persistent_on_gloo(rank, world, broken):
    """tests/gpu/gpu_check.py's persistent checks on gloo ranks (the staged transport, the kernel
    under the interpreter), on small configs (fp32, and bf16 with GELU and top-1): every case
    must pass, and an output off by 10% on one rank must fail there.

    The broken run checks one config: rank 0's calls in it are the unbroken run's (rank 1's
    error is applied to its own output, after the kernel and its exchanges), and rank 1's
    failures come from the same comparison line whatever the config; over four configs it
    repeated the unbroken run's work to learn nothing more."""
    import importlib.util
    import sys
    from pathlib import Path

    import torch.distributed as dist

    gpu_dir = Path(__file__).resolve().parents[1] / "gpu"
    sys.path.insert(0, str(gpu_dir.parent))  # (gpu_check imports the shared routing cases)
    spec = importlib.util.spec_from_file_location("gpu_check", gpu_dir / "gpu_check.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    if broken and rank == 1:
        forward = PersistentStrategy.forward_layer
        PersistentStrategy.forward_layer = lambda self, *args: forward(self, *args) * 1.1
    configs = {"softmax": MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32),
               "sigmoid": MoEConfig(hidden=32, ffn=16, num_experts=8, top_k=3, router="sigmoid", renormalize=True,
                                    route_scale=2.5, dtype=torch.float32),
               "capacity": MoEConfig(hidden=32, ffn=16, num_experts=8, top_k=2, capacity_factor=1.0,
                                     dtype=torch.float32),
               # bf16 as on a GPU: the router's bf16 pieces and the bf16 rows through the staged exchange
               "bf16-top1": MoEConfig(hidden=32, ffn=48, num_experts=4, top_k=1, activation="gelu")}
    if broken:
        configs = {"softmax": configs["softmax"]}
    results = []
    script.check_persistent(torch.device("cpu"), rank, world, configs, script.CASES,
                            lambda ok, msg: results.append((ok, msg)), base=6)
    seen = [None] * world
    dist.all_gather_object(seen, results)
    for r, res in enumerate(seen):
        cases = {msg.split()[1] for _, msg in res if "rel err" in msg}
        assert cases == set(script.PERSISTENT_CASES), cases
        assert len(res) == len(configs) * 2 * len(script.PERSISTENT_CASES) + 1  # (the capacity config too; the NaN row)
        failed = [msg for ok, msg in res if not ok]
        assert bool(failed) == (broken and r == 1), failed


@pytest.mark.parametrize("broken", [False, True])
def test_gpu_check_persistent_runs_on_gloo(broken):
    from helpers import run_gloo

    run_gloo(_gpu_check_persistent_on_gloo, 2, broken)


def test_layers_share_the_plans_scratch_and_each_call_stays_its_own():
    """Two layers' plans of one token count share their activation scratch (``alloc.shared``:
    a plan per layer and token count would each keep one); calls of the two layers in turn
    give every call the result it gives alone, bitwise, and the fp64 reference's."""
    a = layer_for()
    b = layer_for()
    with torch.no_grad():
        b.router.weight.copy_(torch.randn_like(b.router.weight))
        b.experts.w_up.copy_(torch.randn_like(b.experts.w_up) * 0.1)
    xs = [torch.randn(9, 32) for _ in range(3)]
    with torch.no_grad():
        alone = [(a(x).clone(), b(x).clone()) for x in xs]  # (each layer's plan for T = 9 made here)
        for x, (ya, yb) in zip(xs, alone):
            assert torch.equal(b(x), yb) and torch.equal(a(x), ya)  # the other layer's call in between
            assert (ya.double() - reference(a, x)).abs().max() < 1e-4
            assert (yb.double() - reference(b, x)).abs().max() < 1e-4
    pa, pb = a.strategy._plans[9], b.strategy._plans[9]
    assert pa is not pb and pa.args.workspace.h_ptr is pb.args.workspace.h_ptr
