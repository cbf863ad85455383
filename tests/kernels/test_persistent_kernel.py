"""The persistent MoE kernel (interlace.kernels.persistent) under TRITON_INTERPRET=1: outputs
against the fp64 reference, the routing and index against plain torch, the task order (a
broken order must be caught), the bounded waits' error record, epochs across calls."""

from __future__ import annotations

import pytest
import torch

from interlace.config import MoEConfig
from interlace.experts import init_expert_weights
from interlace.kernels.persistent.config import PersistentKernelConfig
from interlace.kernels.persistent.launch import PersistentState, persistent_moe
from interlace.kernels.persistent.protocol import Word, state_views
from interlace.kernels.persistent.tasks import reference_index
from interlace.reference import reference_moe
from interlace.routing import route

CPU = torch.device("cpu")


def make_case(T, *, router="softmax", top_k=2, experts=6, hidden=48, ffn=40, activation="swiglu", dtype=torch.float32,
              **cfg_changes):
    cfg = MoEConfig(hidden=hidden, ffn=ffn, num_experts=experts, top_k=top_k, router=router, activation=activation,
                    dtype=dtype, **cfg_changes)
    x = torch.randn(T, hidden).to(dtype)
    router_weight = torch.randn(experts, hidden) / hidden**0.5
    bias = torch.randn(experts) * 0.1 if router == "sigmoid" else None
    w_up, w_down = init_expert_weights(cfg, range(experts), seed=T + 11, device=CPU)
    return cfg, x, router_weight, bias, w_up, w_down


def run(cfg, x, router_weight, bias, w_up, w_down, state=None, workspace=None, **kw):
    state = PersistentState() if state is None else state
    from interlace.kernels.persistent.config import router_pieces

    out = persistent_moe(x, router_weight, bias, w_up, w_down, state, top_k=cfg.top_k, softmax=cfg.router == "softmax",
                         renormalize=cfg.renormalize, route_scale=cfg.route_scale, activation=cfg.activation,
                         w_pieces=router_pieces(x.dtype, cfg.router_gemm), workspace=workspace, **kw)
    return out, state


def check_against_reference(cfg, x, router_weight, bias, w_up, w_down, out, rtol=1e-4):
    ref, _ = reference_moe(x, router_weight, w_up, w_down, cfg, expert_bias=bias)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all(), "an output row was not written (poisoned NaN left)"
    if not out.numel():
        return
    err = (out.double() - ref).abs().max().item()
    assert err <= rtol * max(1.0, ref.abs().max().item()), f"max error {err}"


@pytest.mark.parametrize("T", [0, 1, 7, 33, 130])
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_matches_reference(T, router):
    extra = dict(renormalize=True, route_scale=2.5) if router == "sigmoid" else {}
    case = make_case(T, router=router, **extra)
    ws = {}
    out, state = run(*case, workspace=ws)
    state.check()
    check_against_reference(*case, out)
    if T == 0:
        return
    cfg, x, router_weight, bias = case[:4]
    # The gate's routing is the layer's (fp32 logits, same choice rule) ...
    topk_idx, topk_weight, _ = route(x, router_weight, bias, cfg)
    assert torch.equal(ws["idx"].view(T, cfg.top_k).long(), topk_idx)
    torch.testing.assert_close(ws["weight"].view(T, cfg.top_k), topk_weight.float(), rtol=1e-6, atol=1e-6)
    # ... and the index is the plain counting sort.
    row_of, asg_of, tiles = reference_index(topk_idx, cfg.num_experts, ws["block_m"])
    assert torch.equal(ws["row_of_assignment"].long(), row_of)
    assert torch.equal(ws["assignment_of_row"].long(), asg_of)
    n_tiles = tiles.shape[1]
    assert int(ws["state"][Word.N_TILES]) == n_tiles <= ws["layout"].max_tiles
    assert torch.equal(ws["tiles"].view(3, ws["layout"].max_tiles)[:, :n_tiles].long(), tiles)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_single_projection_activations(activation):
    case = make_case(7, activation=activation, top_k=3)
    out, state = run(*case)
    state.check()
    check_against_reference(*case, out)


def test_bf16_split_router_gemm():
    """bf16 tokens: the gate splits the fp32 router weight into three bf16 pieces (router_gemm
    "split") and chooses what the layer's router chooses, with fp32-class weights. (The expert
    GEMMs in bf16 are checked on the GPU, benchmarks/persistent_decode.py: the interpreter's bf16
    dot does not multiply values.)"""
    cfg, x, router_weight, bias, w_up, w_down = make_case(33, dtype=torch.bfloat16)
    ws = {}
    run(cfg, x, router_weight, bias, w_up, w_down, workspace=ws)[1].check()
    topk_idx, topk_weight, _ = route(x, router_weight, bias, cfg)
    assert torch.equal(ws["idx"].view(33, cfg.top_k).long(), topk_idx)
    torch.testing.assert_close(ws["weight"].view(33, cfg.top_k), topk_weight.float(), rtol=1e-5, atol=1e-6)


def test_expert_without_tokens():
    """Expert 0 gets no token (its router row makes its logit the smallest for positive x)."""
    cfg, x, router_weight, bias, w_up, w_down = make_case(33)
    x = x.abs() + 0.1
    router_weight[0] = -1.0
    ws = {}
    out, state = run(cfg, x, router_weight, bias, w_up, w_down, workspace=ws)
    state.check()
    assert not (ws["idx"] == 0).any()
    check_against_reference(cfg, x, router_weight, bias, w_up, w_down, out)


def test_all_tokens_on_one_expert():
    """Skewed routing: a selection bias sends every token to expert 3 (top-1), 130 rows in 9 tiles."""
    cfg, x, router_weight, bias, w_up, w_down = make_case(130, router="sigmoid", top_k=1)
    bias = torch.zeros(cfg.num_experts)
    bias[3] = 100.0
    ws = {}
    out, state = run(cfg, x, router_weight, bias, w_up, w_down, workspace=ws)
    state.check()
    assert (ws["idx"] == 3).all()
    check_against_reference(cfg, x, router_weight, bias, w_up, w_down, out)


def test_nan_token_stays_in_its_row():
    cfg, x, router_weight, bias, w_up, w_down = make_case(7)
    x[2, 5] = float("nan")
    out, state = run(cfg, x, router_weight, bias, w_up, w_down)
    state.check()
    assert torch.isnan(out[2]).all()
    rows = [0, 1, 3, 4, 5, 6]
    check_against_reference(cfg, x[rows], router_weight, bias, w_up, w_down, out[rows])


def test_bitwise_repeatable_across_calls_and_grids():
    """Two calls on one state, and other grid sizes: the same bits (no atomics reach an output;
    the combine sums each token's rows in slot order). The epoch counts the calls and every
    counter is back at zero after each."""
    case = make_case(33)
    state = PersistentState()
    first, _ = run(*case, state=state)
    second, _ = run(*case, state=state)
    assert torch.equal(first, second)
    for programs in (1, 8):
        other, _ = run(*case, config=PersistentKernelConfig(programs=programs))
        assert torch.equal(first, other)
    head, tile_counters, _ = state_views(state.buffer)
    assert head[Word.EPOCH] == 2
    assert [int(head[w]) for w in (Word.QUEUE, Word.DONE, Word.GATE_DONE, Word.GEMM1_DONE)] == [0, 0, 0, 0]
    assert (tile_counters == 0).all()  # per-tile GEMM0 counters
    state.check()


def test_broken_task_order_is_caught():
    """Mutation: combine tasks dequeued before the GEMM tasks. Under the interpreter one program
    runs the tasks in queue order, so a combine task waits for GEMM1 tasks nobody has taken: its
    bounded wait times out, the error record names it, and its rows are not written."""
    case = make_case(7)
    state = PersistentState()
    out, _ = run(*case, state=state, order="combine_first", max_spins=20)
    with pytest.raises(RuntimeError, match=r"task \d+ timed out waiting for the GEMM1 counter"):
        state.check()
    assert torch.isnan(out).any()  # the poisoned rows the skipped combine tasks left
    # The record is cleared and the counters were reset: the next call is right.
    good, _ = run(*case, state=state)
    state.check()
    check_against_reference(*case, good)


@pytest.mark.parametrize("max_spins", [0, 1])
def test_spin_limit_error_record(max_spins):
    """A spin limit of 0 or 1 with a broken order: a clear RuntimeError naming the task, the
    flag, its value and the expected count, raised on the host from the record."""
    case = make_case(1)
    state = PersistentState()
    run(*case, state=state, order="combine_first", max_spins=max_spins)
    # The kernel wrote the same record into the host mirror (what the CUDA path reads, no copy).
    assert state.host_error[0] == 1 and state.host_error.tolist() == state.error_record().tolist()
    with pytest.raises(RuntimeError, match=r"persistent MoE kernel, rank 0: task \d+ .* value 0, expected ≥ \d+"):
        state.check()
    state.check()  # cleared
    assert state.host_error.tolist() == [0] * len(state.host_error)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_tile_bound_holds_for_any_routing(block_m):
    """TaskLayout.max_tiles (from T alone) bounds the real tile count: random, skewed and
    spread routings, small and large T (the kernel would drop rows otherwise)."""
    from interlace.kernels.persistent.tasks import TaskLayout

    gen = torch.Generator().manual_seed(0)
    for T, E, k in [(1, 8, 2), (1, 128, 8), (3, 4, 2), (33, 6, 2), (130, 64, 4), (512, 128, 8)]:
        layout = TaskLayout.build(T, 64, 64, E, k, 16, block_m, 64, 64, 16, 64)
        routings = [torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]),
                    (torch.arange(T * k).view(T, k) % E),  # spread: as many experts as possible
                    torch.arange(k).repeat(T, 1)]  # skewed: every token on the same k experts
        for idx in routings:
            tiles = reference_index(idx, E, block_m)[2]
            assert tiles.shape[1] <= layout.max_tiles


_SM90_BUILD = r"""
import os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from interlace.kernels.persistent.kernel import persistent_moe_kernel as kernel
from interlace.kernels.persistent.config import PersistentKernelConfig

names = [p.name for p in kernel.params]
fp = {"rw_ptr": "*fp32", "bias_ptr": "*fp32", "wt_ptr": "*fp32", "w_up_scale_ptr": "*fp32", "w_down_scale_ptr": "*fp32"}
bf16 = {"x_ptr", "w_up_ptr", "w_down_ptr", "out_ptr", "h_ptr", "y_ptr"}
i64 = {"timeline_ptr": "*i64", "timeline_clock": "*i64"}  # (unused with TIMELINE 0)
def signature(fp8):
    types = {**fp, "w_up_ptr": "*fp8e4nv", "w_down_ptr": "*fp8e4nv"} if fp8 else fp
    return {n: "constexpr" if p.is_constexpr else i64[n] if n in i64 else types.get(n, "*bf16" if n in bf16 else "*i32")
            if n.endswith("_ptr") else "fp32" if n == "scale" else "i32" for n, p in zip(names, kernel.params)}
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
config = PersistentKernelConfig()
for spec in sys.argv[1:]:
    block_m, e_pad, top_k, *capacity = map(int, spec.split(","))
    fp8 = len(capacity) > 1 and capacity[1]
    sig = signature(fp8)
    k0, n0, n1, k1 = config.tiles(block_m)
    consts = dict(TOP_K=top_k, E_PAD=e_pad, BLOCK_T=16, BLOCK_G=32, BLOCK_A=128,
                  BLOCK_J=max(16, min(64, 2048 // e_pad)), BLOCK_M=block_m, BLOCK_K0=k0, BLOCK_N0=n0, BLOCK_N1=n1,
                  BLOCK_K1=k1, BLOCK_TC=16, BLOCK_NC=128, SOFTMAX=False, HAS_BIAS=True, RENORMALIZE=True,
                  ACTIVATION=0, W_PIECES=3, DOT_FP32=False, ORDER=0, TIMELINE=0, ROUND_LOGITS=0,
                  CAPACITY=bool(capacity and capacity[0]), W_FP8=bool(fp8))
    # (pointers and N, K, UP divisible by 16, as a launch specializes them at every preset: without
    # the hints the build loads the weights 2 bytes at a time and spills several times as much)
    src = ASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in names
                           if n not in consts and (n.endswith("_ptr") or n in ("N", "K", "UP"))})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    print(spec, regs, stack, flush=True)
"""

# (BLOCK_M, E_PAD, TOP_K[, CAPACITY[, FP8]]) → the most spill stack (bytes per thread) the sm90 build may use, with
# the default 4 warps: specialized as a launch is, the configs measured 0–112 bytes (150–255
# registers; the 128-row tiles and top-8 gates at the top), bounded here with room. Unspecialized
# they measured 168–1168. Four warps, two programs per SM, measured 15–20% faster than eight on
# an H100 at decode sizes: twice the weight loads are in flight.
_SM90_CONFIGS = {(16, 16, 2): 64, (32, 16, 2): 64, (64, 16, 2): 64, (128, 16, 2): 64,
                 (16, 64, 8): 64, (32, 64, 8): 64, (64, 64, 8): 64, (16, 128, 8): 128, (64, 128, 8): 128,
                 (128, 128, 8): 192, (16, 16, 2, 1): 64, (32, 64, 8, 1): 64, (128, 128, 8, 1): 256,
                 (16, 16, 2, 0, 1): 64, (64, 64, 8, 0, 1): 64, (128, 128, 8, 0, 1): 192}


def test_kernel_builds_for_sm90():
    """The interpreter accepts Python a GPU build refuses (non-constexpr globals, a loop variable
    retyped): build the kernel for sm90 (Triton's bundled ptxas, no GPU needed) in a process
    without the interpreter, for every row tile of :data:`ROW_TILES` with its default N/K tiles,
    and read the cubin's registers and spill stack (cuobjdump)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not ((bin_dir / "ptxas").exists() and (bin_dir / "cuobjdump").exists()):
        pytest.skip("Triton's bundled ptxas / cuobjdump is not installed")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    specs = [",".join(map(str, key)) for key in _SM90_CONFIGS]
    proc = subprocess.run([sys.executable, "-c", _SM90_BUILD, *specs], env=env, cwd=root, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = {tuple(map(int, spec.split(","))): (int(regs), int(stack))
             for spec, regs, stack in (line.split() for line in proc.stdout.splitlines())}
    assert set(built) == set(_SM90_CONFIGS)
    for key, (regs, stack) in built.items():
        assert regs <= 255 and stack <= _SM90_CONFIGS[key], f"(BLOCK_M, E_PAD, TOP_K) = {key}: {regs} registers, " \
                                                             f"{stack} bytes of spill stack"


def test_row_tile_choice():
    """BLOCK_M by the busiest expert's expected rows (1.25 × T·k/E), 16 … 128, with the default
    N/K tiles of each; explicit fields win."""
    from interlace.kernels.persistent.config import TILES_BY_BLOCK_M

    c = PersistentKernelConfig()
    assert [c.rows_per_tile(T, 8, 64) for T in (1, 32, 64, 128, 256, 512, 4096)] == [16, 16, 16, 32, 64, 128, 128]
    assert [c.rows_per_tile(T, 2, 4) for T in (8, 16, 32, 64, 128, 512)] == [16, 16, 32, 64, 128, 128]
    assert PersistentKernelConfig(block_m=32).rows_per_tile(4096, 8, 4) == 32
    assert c.tiles(128) == TILES_BY_BLOCK_M[128] and c.tiles(16) == TILES_BY_BLOCK_M[16]
    assert PersistentKernelConfig(block_k1=16).tiles(64) == (*TILES_BY_BLOCK_M[64][:3], 16)
    assert c.tiles(48) == TILES_BY_BLOCK_M[64]


@pytest.mark.parametrize("field, bad", [("block_e", 48), ("block_t", 0), ("block_ns", True), ("block_m", 2.0),
                                        ("num_warps", 6), ("num_warps", None), ("num_stages", 0),
                                        ("programs", -1), ("logits_splits", 1.5), ("wide", 1)])
def test_config_refuses_what_no_kernel_takes(field, bad):
    """A tile size that is not a power of 2, a count below 1, a bool or float for an int: a
    ValueError naming the field when the config is made, before any build or launch."""
    with pytest.raises(ValueError, match=f"kernel {field} must be"):
        PersistentKernelConfig(**{field: bad})
    PersistentKernelConfig(block_e=64, block_t=32, num_stages=3, programs=7, logits_splits=3)  # (fine)


@pytest.mark.parametrize("T, block_m, forced", [(130, 64, False), (300, 128, False), (33, 128, True), (300, 64, True)])
def test_large_row_tiles_match_reference(T, block_m, forced):
    """64- and 128-row tiles (by the choice rule, or forced on few rows: mostly empty tiles),
    with their narrower reduction steps, against the fp64 reference and the plain index."""
    case = make_case(T)
    config = PersistentKernelConfig(block_m=block_m if forced else None)
    ws = {}
    out, state = run(*case, workspace=ws, config=config)
    state.check()
    assert ws["block_m"] == block_m
    check_against_reference(*case, out)
    topk_idx = route(case[1], case[2], case[3], case[0])[0]
    tiles = reference_index(topk_idx, case[0].num_experts, block_m)[2]
    assert int(ws["state"][Word.N_TILES]) == tiles.shape[1]


def test_one_build_per_row_tile_over_token_counts(monkeypatch):
    """Token counts 1–64 and some up to 512 reuse their row tile's build: the arguments that
    change with the token count are not specialized by Triton (its "divisible by 16" and "equal
    to 1" patterns would each compile the kernel again). The GPU's grid is emulated (264 programs)."""
    from interlace.kernels.persistent import launch as pl
    from interlace.kernels.persistent.kernel import persistent_moe_kernel
    from helpers import triton_builds

    monkeypatch.setattr(pl.CallPlan, "_programs", lambda self: max(1, min(264, self.layout.total)))
    E, N, K, k = 16, 256, 96, 2
    rw = torch.randn(E, N)
    w_up, w_down = torch.empty(E, 2 * K, N, dtype=torch.bfloat16), torch.empty(E, N, K, dtype=torch.bfloat16)
    builds = {}
    for T in [*range(1, 65), 100, 128, 129, 256, 300, 512]:
        x = torch.empty(T, N, dtype=torch.bfloat16)
        plan = pl.CallPlan(x, rw, None, w_up, w_down, PersistentState(), top_k=k, softmax=True, renormalize=True,
                           route_scale=1.0, activation="swiglu", w_pieces=3, config=PersistentKernelConfig(),
                           max_spins=1, order="normal")
        consts, spec = triton_builds(persistent_moe_kernel, plan.kernel_args(x, torch.empty_like(x)), plan.constexprs)
        builds.setdefault(consts, set()).add(spec)
    assert len(builds) > 1 and all(len(specs) == 1 for specs in builds.values()), [len(v) for v in builds.values()]


@pytest.mark.parametrize("rounding, dtype", [(1, torch.bfloat16), (2, torch.float16)])
def test_rounded_logits_choose_as_a_gemm_in_that_dtype(rounding, dtype):
    """round_logits: the gate rounds its fp32 logit sums to bf16 / fp16 before the choice, as a
    transformers router computes them in a bf16 / fp16 model. Experts 2 and 5 are made nearly
    tied (5 a hair above 2 wherever 2's logit is positive): fp32 picks 5, the rounded logits
    mostly tie and the lower expert, 2, wins."""
    from interlace.routing import route_logits

    cfg, x, router_weight, bias, w_up, w_down = make_case(40, top_k=1, experts=8, hidden=48)
    router_weight[2] *= 4.0
    router_weight[5] = router_weight[2] * (1 + 2.0**-14)
    exact = (x.double() @ router_weight.double().t()).float()
    choices = {}
    for r, logits in ((0, exact), (rounding, exact.to(dtype).float())):
        ws = {}
        out, state = run(cfg, x, router_weight, bias, w_up, w_down, workspace=ws, round_logits=r)
        state.check()
        expected, _ = route_logits(logits, bias, cfg, fused=True)  # (fused: ties to the lower expert, as the gate)
        assert torch.equal(ws["idx"].view(-1, 1).long(), expected), r
        choices[r] = expected
    # the rounding decided something: ties (or near-ties straddling a rounding step, for fp16) move
    # tokens from 5 to 2
    assert (choices[0] == 5).sum() > (choices[rounding] == 5).sum()


def test_kernel_args_name_every_parameter():
    """A plan's MoeKernelArgs name the kernel's parameters in order (the launch by keywords runs
    the same call, bit for bit, as the plan's positional one), and the host's task count is the
    kernel's numbering (protocol.kind_starts)."""
    import inspect

    from interlace.kernels.persistent.config import router_pieces
    from interlace.kernels.persistent.kernel import persistent_moe_kernel
    from interlace.kernels.persistent.launch import CallPlan

    cfg, x, rw, bias, w_up, w_down = make_case(9, router="sigmoid")
    plan = CallPlan(x, rw, bias, w_up, w_down, PersistentState(), top_k=cfg.top_k, softmax=False,
                    renormalize=cfg.renormalize, route_scale=cfg.route_scale, activation=cfg.activation,
                    w_pieces=router_pieces(x.dtype, cfg.router_gemm), config=PersistentKernelConfig(), max_spins=1 << 16,
                    order="normal")
    kwargs = plan.args.as_kwargs()
    assert list(kwargs) == list(inspect.signature(persistent_moe_kernel.fn).parameters)
    layout = plan.layout
    assert layout.total == layout.n_gate + 1 + layout.max_tiles * (layout.n_k0 + layout.n_n1) \
        + layout.n_comb_t * layout.n_comb_n
    out = plan.run(x)
    by_name = torch.full_like(out, float("nan"))
    persistent_moe_kernel[(plan.programs,)](**{**kwargs, "x_ptr": x, "out_ptr": by_name})
    plan.state.check()
    assert torch.equal(out, by_name)
    check_against_reference(cfg, x, rw, bias, w_up, w_down, out)


def test_activation_codes_are_the_tiles():
    """protocol.Activation names the ACTIVATION codes of the expert GEMM tiles the kernels call
    (expert_gemm.tile: ACTIVATION_ID, and 3 the plain product)."""
    from interlace.kernels.expert_gemm.tile import ACTIVATION_ID
    from interlace.kernels.persistent.protocol import PLAIN, Activation

    assert {a.name.lower(): int(a) for a in Activation if a is not Activation.PLAIN} == ACTIVATION_ID
    assert int(Activation.PLAIN) == PLAIN.value == 3 and 3 not in ACTIVATION_ID.values()
