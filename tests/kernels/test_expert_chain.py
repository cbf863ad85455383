"""The chained forward (interlace.kernels.expert_gemm.chain): GEMM0 and GEMM1 in one launch, GEMM1 tiles
waiting per row tile for GEMM0's activations. Under the interpreter: the results against an
fp64 reference (outputs poisoned), the readiness counts, the multi-program split (as a GEMM0-only
and a GEMM1-only launch), a timed-out wait's error, the selection; an sm90 compile checks that
the counting keeps the flat GEMM0 loop pipelined."""

import pytest
import torch
from test_grouped_gemm import _run_sm90, check_forward_backward, reference

from helpers import rel_err
from interlace.kernels.expert_gemm import chain as expert_chain
from interlace.kernels.expert_gemm.grouped_gemm import GemmConfig, expert_ffn_triton, tile_schedule

COUNTS = [0, 1, 17, 0, 33, 16]  # empty experts, a 1-row expert, rows not a multiple of the 16-row tile


def _problem(activation, counts=COUNTS, N=32, K=24, divisor=2):
    E, M = len(counts), sum(counts)
    up = 2 * K if activation == "swiglu" else K
    w_up = torch.randn(E, up, N) / N**0.5
    w_down = torch.randn(E, N, K) / K**0.5
    x = torch.randn(M // divisor + 5, N)
    gather = torch.randint(0, x.shape[0] * divisor, (M,), dtype=torch.int32)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x, gather, divisor, w_up, w_down, ends, M


def _run(activation, c0, c1, tma, phases=3, programs=None, store_h=True, max_spins=expert_chain.CHAIN_SPINS):
    x, gather, divisor, w_up, w_down, ends, M = _problem(activation)
    K = w_down.shape[2]
    sched = tile_schedule(ends, M, c0.block_m, with_ready=True)
    act = torch.full((M, K), float("nan"))
    h = torch.full((M, w_up.shape[1]), float("nan")) if store_h else None
    y = torch.full((M, x.shape[1]), float("nan"))
    launches = [phases] if phases == 3 else [1, 2]
    for p in launches:
        expert_chain.ffn_chain(x, gather, divisor, w_up, w_down, act, h, y, sched, M, activation, c0, c1, tma,
                               phases=p, programs=programs, max_spins=max_spins)
    y_ref, h_ref = reference(x, gather, divisor, w_up, w_down, COUNTS, activation)
    return y, h, y_ref, h_ref, sched


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu"])
@pytest.mark.parametrize("phases,programs", [(3, None), (1, 3)])
def test_chained_forward_matches_reference(activation, phases, programs):
    """One program chained (every wait met at once), and three programs split into a GEMM0-only
    and a GEMM1-only launch: GEMM1's items continue GEMM0's round-robin, and every tile of both
    GEMMs is written once (outputs poisoned). The counts: each row tile counted once per GEMM0
    column block, and the launch's total after them."""
    c = GemmConfig(16, 16, 16, 4, 1, 2)
    y, h, y_ref, h_ref, sched = _run(activation, c, c, tma=False, phases=phases, programs=programs)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5
    tiles = int(sched.count)
    n_blocks0 = -(-24 // 16)
    if phases == 3:
        assert sched.ready[:tiles].tolist() == [n_blocks0] * tiles
        assert int(sched.ready[sched.max_tiles]) == tiles * n_blocks0
    else:
        assert int(sched.ready.abs().sum()) == 0  # split launches count nothing


@pytest.mark.parametrize("flat", [0, 2])
def test_chained_forward_through_descriptors_matches_reference(flat, monkeypatch):
    """The TMA form (the interpreter's descriptors): GEMM0 as the flat loop or the nested one
    with TMA stores and A rows through descriptors, GEMM1 reading act through a descriptor and
    storing through one, gate and up as one joint block; a flat GEMM1 config runs nested here."""
    monkeypatch.setenv("INTERLACE_TMA", "1")
    c0 = GemmConfig(16, 16, 16, 4, 1, 2, 0, 0, 1, flat, 1, 0 if flat else 1)
    c1 = GemmConfig(16, 32, 16, 4, 1, 2, 0, 0, 1, flat, 0, 0 if flat else 1)
    for phases, programs in ((3, None), (1, 3)):
        y, h, y_ref, h_ref, _ = _run("swiglu", c0, c1, tma=True, phases=phases, programs=programs)
        assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


def test_a_wait_that_times_out_raises_naming_the_tile():
    """Two programs in the interpreter run one after the other, so program 0's first GEMM1 tile
    waits for rows program 1 has not computed yet: the bounded wait gives up, and the call
    raises with the rank, the expert and the row tile, instead of hanging."""
    c = GemmConfig(16, 16, 16, 4, 1, 2)
    with pytest.raises(RuntimeError, match=r"rank 0: the chained expert forward timed out: a GEMM1 tile of expert "
                                           r"\d+ waited for GEMM0's activations of row tile \d+"):
        _run("swiglu", c, c, tma=False, programs=2, max_spins=3)
    _run("swiglu", c, c, tma=False)  # the record was cleared: the next call runs


def test_chained_forward_and_backward_through_the_layer(monkeypatch):
    """``INTERLACE_CHAIN=1`` puts the expert block's forward (the training forward, storing h) on
    the chained launch; the backward reads its h and activations: gradients match fp64."""
    calls = []
    real = expert_chain.ffn_chain
    monkeypatch.setattr(expert_chain, "ffn_chain", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("INTERLACE_CHAIN", "1")
    monkeypatch.setenv("INTERLACE_GEMM0", "16,16,16,4,1,2")
    monkeypatch.setenv("INTERLACE_GEMM1", "16,16,16,4,1,2")
    check_forward_backward("swiglu", "k-way", COUNTS, N=32, K=24)
    check_forward_backward("gelu", "bijection", [16, 0, 3, 32], N=32, K=24)
    assert len(calls) == 2


def test_chain_selection(monkeypatch):
    """The GEMM1 config's ``chain`` chooses; INTERLACE_CHAIN=0/1 overrides it; configs of other
    tile heights run as two launches; a bad setting is an error before any launch."""
    chained = GemmConfig(16, 16, 16, 4, 1, 2, chain=1)
    assert expert_chain.chain_wanted(chained) and not expert_chain.chain_wanted(GemmConfig(16, 16, 16, 4, 1))
    monkeypatch.setenv("INTERLACE_CHAIN", "0")
    assert not expert_chain.chain_wanted(chained)
    monkeypatch.setenv("INTERLACE_CHAIN", "yes")
    with pytest.raises(ValueError, match="INTERLACE_CHAIN"):
        expert_chain.chain_wanted(chained)
    monkeypatch.setenv("INTERLACE_CHAIN", "1")
    assert not expert_chain.chain_fits(GemmConfig(16, 16, 16, 4, 1), GemmConfig(32, 16, 16, 4, 1))
    monkeypatch.setenv("INTERLACE_GEMM0", "16,16,16,4,1")
    monkeypatch.setenv("INTERLACE_GEMM1", "32,16,16,4,1")
    calls, real = [], expert_chain.ffn_chain
    monkeypatch.setattr(expert_chain, "ffn_chain", lambda *a, **k: calls.append(1))
    x, gather, divisor, w_up, w_down, ends, M = _problem("swiglu")
    y, _ = expert_ffn_triton(x, gather, divisor, M, w_up, w_down, ends, "swiglu")
    y_ref, _ = reference(x, gather, divisor, w_up, w_down, COUNTS, "swiglu")
    assert not calls and rel_err(y, y_ref) < 1e-5
    with pytest.raises(ValueError, match="same block_m"):
        real(x, gather, divisor, w_up, w_down, y, None, y, tile_schedule(ends, M, 16), M, "swiglu",
             GemmConfig(16, 16, 16, 4, 1), GemmConfig(32, 16, 16, 4, 1), False)


_SM90_CHAIN = r"""
import interlace.kernels.expert_gemm.chain as ec

DATA = DATA + ("w_up_ptr", "act_ptr", "w_down_ptr", "y_ptr")
flat = dict(ACTIVATION=0, HAS_GATHER=False, STORE_H=False, USE_TMA=True, BLOCK_M=128, FLAT0=True, BLOCK_N0=128,
            BLOCK_K0=64, GROUP_M0=8, FLATTEN0=False, A_TMA0=True, JOINT=True, TMA_STORE0=False, BLOCK_N1=256,
            BLOCK_K1=64, GROUP_M1=8, A_TMA1=True, TMA_STORE1=False, STAGES1=3, PHASES=3, FENCE=True, FENCE1=True,
            ASM=True)
nested = dict(flat, FLAT0=False, HAS_GATHER=True, A_TMA0=False, TMA_STORE0=True, STAGES1=4)
found = {}
for name, cx, stages in (("flat", flat, 3), ("flat_h", dict(flat, STORE_H=True), 3), ("nested", nested, 4),
                         ("nested_h", dict(nested, STORE_H=True), 4), ("flat_alone", dict(flat, PHASES=1), 3),
                         ("gemm1_alone", dict(flat, PHASES=2), 3)):
    k = compile_sm90(ec._ffn_chain_kernel, cx, 8, stages)
    found[name] = [k.metadata.shared, "bar.sync" in k.asm["ptx"], "cp.async.bulk.wait_group 0" in k.asm["ptx"]]
print(json.dumps(found))
"""


def test_chained_kernel_compiles_pipelined_for_hopper():
    """sm90 compiles of the chained kernel in the tables' forms: it fits a Hopper block's shared
    memory, and its shared memory is the larger of its two loops' alone (the GEMM0 loop's
    pipeline stages survive the counting: a tl.debug_barrier in it cost them all), so the two
    loops share one allocation. The counting waits for bulk stores."""
    found = _run_sm90(_SM90_CHAIN)
    assert found["flat"][0] == max(found["flat_alone"][0], found["gemm1_alone"][0]), found
    assert found["flat_alone"][0] > found["gemm1_alone"][0], found  # 3 stages of 128 × (64 + 2·128) + staging
    for name, (shared, barrier, bulk_wait) in found.items():
        assert shared <= 232448, (name, shared)
        if name in ("flat", "flat_h", "nested", "nested_h"):
            assert barrier and bulk_wait, (name, found)


def test_bench_env_settings_may_hold_configs(monkeypatch):
    """``bench_expert_kernels.py --envs NAME=VAR=VALUE[,VAR=VALUE]``: a value may be a config with
    commas (run 192's first weight-gradient A/B failed on them); ``VAR=`` removes VAR."""
    import os
    import sys

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    sys.modules.pop("bench_expert_kernels", None)
    import bench_expert_kernels

    monkeypatch.setenv("INTERLACE_GEMM1", "16,16,16,4,1")
    monkeypatch.delenv("INTERLACE_WGRAD", raising=False)
    monkeypatch.delenv("INTERLACE_CHAIN", raising=False)
    bench_expert_kernels.use_envs("INTERLACE_WGRAD=128,256,64,8,3,16,0,0,1,2,INTERLACE_CHAIN=1,INTERLACE_GEMM1=")
    assert os.environ["INTERLACE_WGRAD"] == "128,256,64,8,3,16,0,0,1,2"
    assert os.environ["INTERLACE_CHAIN"] == "1" and "INTERLACE_GEMM1" not in os.environ


def test_bench_paired_timing_runs_every_call_each_iteration(monkeypatch):
    """``bench_expert_kernels.py --paired N``: each of the five timed calls runs once per iteration, in an
    order rotated per iteration, and returns N times each; the gradients are dropped after every call
    (both backends' would otherwise be held at once). Events stand in for CUDA's on the CPU."""
    import os
    import sys

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    sys.modules.pop("bench_expert_kernels", None)
    import bench_expert_kernels as bench
    from interlace.config import PRESETS

    clock = iter(range(10**6))

    class Event:
        def __init__(self, **_):
            self.t = None

        def record(self):
            self.t = next(clock)

        def elapsed_time(self, other):
            return float(other.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    order, held = [], []

    def fake_block(backend, x, w_up, w_down, weights, index, activation):
        order.append((backend, torch.is_grad_enabled() and w_up.requires_grad))
        held.append(sum(t.grad is not None for t in (x, w_up, w_down, weights)))
        return (x.float() @ torch.ones(x.shape[1], 1) * weights.sum()).expand(x.shape).to(x.dtype) + 0 * w_up.sum()

    monkeypatch.setattr(bench, "block", fake_block)
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    calls = bench.paired_times(PRESETS["flashdmoe-cfg"], x, torch.randn(2, 8, 8), torch.randn(2, 8, 4),
                               torch.rand(4, 2), None, grad, calls=7, warmup=2)
    assert {k: len(v) for k, v in calls.items()} == dict.fromkeys(
        ["torch_fwd", "torch_fb", "triton_fwd", "triton_train_fwd", "triton_fb"], 7)
    assert all(t == 1.0 for v in calls.values() for t in v)  # start and end events bracket one call each
    assert len(order) == 9 * 5 and order[0] == ("torch", False) and order[5] == ("torch", True)  # rotated
    assert max(held) == 0  # no gradient outlives its call
    assert bench.spread([1.0, 2.0, 3.0]).startswith("2.000 [")
