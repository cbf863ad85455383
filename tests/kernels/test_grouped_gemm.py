"""Triton expert GEMMs (fused gather, SwiGLU epilogue) against the torch path, interpreter,
ragged groups (0 and 1 rows, rows not divisible by the tile height), outputs poisoned."""

from dataclasses import replace

import pytest
import torch

from helpers import rel_err
from interlace.kernels.activation import activation_reference
from interlace.kernels.expert_gemm.autograd import TritonExpertFFN
from interlace.kernels.expert_gemm.configs import ExpertKernelOptions
from interlace.kernels.expert_gemm.forward import expert_ffn_triton
from interlace.kernels.expert_gemm.schedule import tile_schedule
from interlace.kernels.tma import use_tma
from interlace.tuning.tables import GemmConfig


def small(**fields) -> GemmConfig:
    """A small config (16 × 16 × 16 tiles, swizzle groups of 2 row tiles) with these kernel-form fields."""
    return GemmConfig(16, 16, 16, 4, 1, group_m=2, **fields)


def reference(x, gather, divisor, w_up, w_down, counts, activation):
    xg = x[gather.long() // divisor] if gather is not None else x
    outs, hs, start = [], [], 0
    for e, c in enumerate(counts):
        h = xg[start:start + c].double() @ w_up[e].double().t()
        hs.append(h)
        outs.append(activation_reference(h, activation) @ w_down[e].double().t())
        start += c
    return torch.cat(outs), torch.cat(hs)


@pytest.mark.parametrize("counts", [[0, 1, 17, 0, 33], [5], [0, 0, 0], [16, 16, 15, 2]])
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu"])
@pytest.mark.parametrize("gathered", [False, True])
def test_expert_ffn_triton_matches_reference(counts, activation, gathered):
    N, K, E = 24, 40, len(counts)
    up = 2 * K if activation == "swiglu" else K
    M = sum(counts)
    w_up = torch.randn(E, up, N) / N**0.5
    w_down = torch.randn(E, N, K) / K**0.5
    divisor = 3 if gathered else 1
    x = torch.randn(M + 7, N)
    gather = torch.randint(0, x.shape[0] * divisor, (M,), dtype=torch.int32) if gathered else None
    if not gathered:
        x = x[:M].contiguous()
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    y, h = expert_ffn_triton(x, gather, divisor, M, w_up, w_down, ends, activation, store_h=True)
    y_ref, h_ref = reference(x, gather, divisor, w_up, w_down, counts, activation)
    if M:
        assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


def test_tile_schedule_covers_every_row_once():
    counts = [0, 1, 17, 0, 33, 16]
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    sched = tile_schedule(ends, sum(counts), 16)
    n = int(sched.count)
    assert n == sum((c + 15) // 16 for c in counts)
    rows = []
    for t in range(n):
        e, s, stop = int(sched.expert[t]), int(sched.start[t]), int(sched.end[t])
        lo = int(ends[e]) - counts[e]
        assert lo <= s < stop <= int(ends[e]) and stop - s <= 16
        rows += list(range(s, stop))
    assert rows == list(range(sum(counts)))  # expert-major, every row exactly once


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu"])
@pytest.mark.parametrize("mode", ["plain", "bijection", "k-way"])
def test_triton_expert_ffn_backward_matches_reference(activation, mode):
    """dW_up over a gathered copy of x's rows (gathered modes) or x itself (plain)."""
    check_forward_backward(activation, mode, [3, 0, 17, 1])


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_tma_descriptors_and_swizzled_order_match_reference(activation):
    """The Hopper path (weights through tensor descriptors, run by the interpreter), with L2
    swizzle groups of 2 row tiles (7 tiles: groups and a partial last one), forward and backward."""
    c = small()
    options = ExpertKernelOptions(gemm0=c, gemm1=c, bwd_act=c, bwd_dx=c, wgrad=c, tma=True)
    w = torch.randn(2, 32, 16)
    assert use_tma(w, force=True) and not use_tma(w[:, :, :15], force=True)  # 60-byte rows cannot be a descriptor's
    assert not use_tma(w) and not use_tma(w, force=False)  # the CPU has no TMA of its own
    check_forward_backward(activation, "k-way", [0, 1, 17, 0, 33, 16], N=32, K=24, options=options)


def test_backward_steps_never_hold_dx_rows_and_the_gathered_copy_together(monkeypatch):
    """dW_up's gathered copy of x's rows and dx_rows are both R × N: dx_rows is allocated only at
    its step, after dW_up (whose copy is freed when it returns), and the outputs still match
    the reference."""
    from interlace.kernels.expert_gemm.backward import backward_steps

    counts, N, K = [3, 0, 17, 1], 16, 40
    E, R = len(counts), sum(counts)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(R + 2, N)
    gather = torch.randperm(R + 2)[:R].to(torch.int32)
    w_up, w_down = torch.randn(E, 2 * K, N) / 4, torch.randn(E, N, K) / 6
    _, h, act = expert_ffn_triton(x, gather, 1, R, w_up, w_down, ends, "swiglu", store_h=True, return_act=True)
    dy = torch.randn(R, N)
    live = []
    import interlace.kernels.rows as rows

    real_gather_rows = rows.gather_rows

    def spy(src, index, divisor=1):
        live.append("copy")
        return real_gather_rows(src, index, divisor)

    monkeypatch.setattr(rows, "gather_rows", spy)
    outputs, steps = backward_steps(dy, x, gather, 1, w_up, w_down, ends, "swiglu", h, act)
    assert [name for name, _, _ in steps] == ["d_pre_act", "dw_down", "dw_up", "dx"]
    for name, _, run_step in steps:
        run_step()
        assert (outputs[0] is None) == (name != "dx"), name  # dx_rows exists only from its own step on
    assert live == ["copy"]  # the dW_up step made its gathered copy (then dropped it)
    ref_x = x[gather.long()].double().requires_grad_()
    ref_up, ref_down = w_up.double().requires_grad_(), w_down.double().requires_grad_()
    out = []
    for e, (lo, hi) in enumerate(zip([0] + ends[:-1].tolist(), ends.tolist())):
        hh = ref_x[lo:hi] @ ref_up[e].T
        out.append((torch.nn.functional.silu(hh[:, :K]) * hh[:, K:]) @ ref_down[e].T)
    torch.cat(out).backward(dy.double())
    for got, want in zip(outputs, (ref_x.grad, ref_up.grad, ref_down.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def check_forward_backward(activation, mode, counts, N=16, K=40, options=None):
    E = len(counts)
    up = 2 * K if activation == "swiglu" else K
    M = sum(counts)
    w_up = (torch.randn(E, up, N) / 4).requires_grad_()
    w_down = (torch.randn(E, N, K) / 6).requires_grad_()
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    if mode == "plain":
        x = torch.randn(M, N, requires_grad=True)
        gather, divisor, ungather = None, 1, None
    elif mode == "bijection":
        x = torch.randn(M, N, requires_grad=True)
        gather = torch.randperm(M).to(torch.int32)
        divisor, ungather = 1, torch.empty(M, dtype=torch.int32)
        ungather[gather.long()] = torch.arange(M, dtype=torch.int32)
    else:  # each token read by up to k = 2 rows, as in the world-size-1 dispatch
        T, divisor = (M + 1) // 2 + 3, 2
        x = torch.randn(T, N, requires_grad=True)
        gather = torch.randperm(T * divisor)[:M].to(torch.int32)
        ungather = torch.full((T, divisor), -1, dtype=torch.int32)
        ungather.view(-1)[gather.long()] = torch.arange(M, dtype=torch.int32)
    y = TritonExpertFFN.apply(x, w_up, w_down, gather, divisor, M, ends, activation, ungather, options)
    g = torch.randn_like(y)
    y.backward(g)
    x2, wu2, wd2 = (t.detach().double().requires_grad_() for t in (x, w_up, w_down))
    y_ref, _ = reference(x2, gather, divisor, wu2, wd2, counts, activation)
    y_ref.backward(g.double())
    assert rel_err(y, y_ref) < 1e-5
    for got, ref in ((x.grad, x2.grad), (w_up.grad, wu2.grad), (w_down.grad, wd2.grad)):
        assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_unfused_activation_gradient_matches_reference(activation):
    """d(pre-activation) with SwiGLU's derivative in a separate pass (``unfused_act``; GELU keeps
    its epilogue), forward and backward against the fp64 reference."""
    check_forward_backward(activation, "k-way", [0, 1, 17, 0, 33, 16], N=32, K=24,
                           options=ExpertKernelOptions(bwd_act=small(unfused_act=1)))


def test_swiglu_backward_into_out_uses_the_first_rows_of_h():
    from interlace.kernels.activation import swiglu_backward

    h, g = torch.randn(9, 10), torch.randn(7, 5)
    out = torch.full((7, 10), float("nan"))
    assert swiglu_backward(h, g, out=out) is out
    hr = h[:7].double().requires_grad_()
    activation_reference(hr, "swiglu").backward(g.double())
    assert rel_err(out, hr.grad) < 1e-5


@pytest.mark.parametrize("interpret", [True, False])
def test_swiglu_backward_regions_writes_only_the_used_rows(interpret, monkeypatch):
    """The fused backward's derivative over W regions of which only the first used[s] rows hold
    data: those rows match the reference (a full region, an empty one, a partial one; a block
    of the kernel spans a region boundary), and the rows past them are not written."""
    import interlace.kernels.activation as act

    monkeypatch.setattr(act, "use_triton", lambda t: interpret)
    region, K = 7, 150  # 7·150 elements per region: blocks of 1024 cross region boundaries
    used = torch.tensor([7, 0, 3, 5], dtype=torch.int32)
    h, g = torch.randn(4 * region, 2 * K), torch.randn(4 * region, K)
    out = act.swiglu_backward_regions(h, g, used, region)
    hr = h.double().requires_grad_()
    activation_reference(hr, "swiglu").backward(g.double())
    rows = (torch.arange(region)[None, :] < used[:, None].long()).reshape(-1)
    assert rel_err(out[rows], hr.grad[rows]) < 1e-5
    assert torch.isnan(out[~rows]).all(), "rows past used[s] must stay untouched"
    with pytest.raises(ValueError, match="4 regions of 6 rows"):
        act.swiglu_backward_regions(h, g, used, 6)


@pytest.mark.parametrize("a_tma", [0, 1])
def test_joint_gate_up_matches_reference(a_tma):
    """GEMM0 with gate and up as one 3-D descriptor block and one double-width dot (``joint``):
    K = 24 is not a multiple of the 16-column block, so the last block's gate and up planes run
    past K (zeros from the descriptor, masked columns), gathered (k-way) and contiguous A rows."""
    options = ExpertKernelOptions(gemm0=small(a_tma=a_tma, joint=1), tma=True)
    check_forward_backward("swiglu", "k-way", [0, 1, 17, 0, 33, 16], N=32, K=24, options=options)
    if a_tma:  # GELU has no up projection: joint is ignored, not an error
        check_forward_backward("gelu", "plain", [3, 0, 17, 1], N=32, K=24, options=options)


@pytest.mark.parametrize("mode,persistent", [("plain", 0), ("k-way", 0), ("plain", 2), ("k-way", 2)])
def test_tma_fed_rows_match_reference(mode, persistent):
    """Configs with the A rows through a descriptor too (``a_tma``; a gathered A is copied
    contiguous first): tiles of 16 rows over ragged experts, so a tile's A block runs into the
    next expert's rows (and past the last row), which must land only in masked output rows.
    The weight gradients read whole 16-row blocks of an expert's rows through descriptors and
    its last partial block (17, 33 rows) through masked loads; ``persistent = 2``: four programs
    loop over the weight-gradient blocks in one flat loop over the blocks' row blocks (the rows
    past an expert's end zeroed, one step for an empty expert) and store them through a descriptor."""
    rows = small(a_tma=1)
    options = ExpertKernelOptions(gemm0=rows, gemm1=rows, bwd_dx=rows, wgrad=small(a_tma=1, persistent=persistent),
                                  bwd_act=small(unfused_act=1, a_tma=1), tma=True)
    check_forward_backward("swiglu", mode, [0, 1, 17, 0, 33, 16], N=32, K=24, options=options)


@pytest.mark.parametrize("num_seg", [0, 2])
def test_flat_weight_gradient_reads_no_row_past_a_run(num_seg):
    """The flat weight-gradient loop (``persistent = 2``) reads whole 16-row steps through its
    window maps; the rows of a step past its run's end must read as zeros in a and b. Here every
    row that is not a run's (the gaps between runs, and the row after the last) holds NaN, and
    each run is a few rows short of a step or ends exactly on one, the first one at row 0; an
    expert with no rows at all gets an all-zero block. Runs per source (``num_seg = 2``, the fused
    training path) leave gaps; with ``ends`` (0) the runs are back to back, so the rows past a
    run are the next expert's."""
    from interlace.kernels.expert_gemm.wgrad import launch_wgrad
    from interlace.kernels.tma import ensure_allocator

    g = torch.Generator().manual_seed(7)
    E, P, Q = 4, 32, 48
    counts = [[5, 17, 0, 16], [16, 0, 0, 3]] if num_seg else [[5, 17, 0, 16]]
    starts, row, gap = [], 0, 2 if num_seg else 0
    for seg in counts:
        starts.append([])
        for c in seg:
            starts[-1].append(row)
            row += c + gap
    R = row + 1
    a = torch.full((R, P), float("nan"))
    b = torch.full((R, Q), float("nan"))
    ref = torch.zeros(E, P, Q, dtype=torch.float64)
    for seg_starts, seg_counts in zip(starts, counts):
        for e, (s0, c) in enumerate(zip(seg_starts, seg_counts)):
            a[s0:s0 + c] = torch.randn(c, P, generator=g)
            b[s0:s0 + c] = torch.randn(c, Q, generator=g)
            ref[e] += a[s0:s0 + c].double().T @ b[s0:s0 + c].double()
    if num_seg:
        segments, ends = torch.tensor([starts, counts], dtype=torch.int32), None
    else:  # back to back: the last row (NaN) is past the last expert's end
        segments, ends = None, torch.tensor(counts[0], dtype=torch.int32).cumsum(0).to(torch.int32)
    out = torch.full((E, P, Q), float("nan"))
    ensure_allocator()
    launch_wgrad(a, b, out, ends, P, Q, small(a_tma=1, persistent=2), segments=segments, tma=True)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("form", ["pointers", "tma", "flat"])
def test_weight_gradient_reads_b_runs_at_their_own_starts(form):
    """A (3, S, E) run table: each run of a's rows pairs with the run of b's rows starting at
    the table's third part (fused:train's dW_down: the g rows in the receive layout against the
    packed activations). b's runs are packed back to back in another order than a's, every row
    outside a run is NaN in both, and the result matches the fp64 reference on every kernel
    form (pointer loads, host TMA descriptors, the flat loop's window maps)."""
    from interlace.kernels.expert_gemm.wgrad import launch_wgrad
    from interlace.kernels.tma import ensure_allocator

    g = torch.Generator().manual_seed(8)
    E, P, Q, cap = 3, 32, 48, 40
    counts = [[5, 17, 0], [16, 0, 3]]
    a = torch.full((2 * cap, P), float("nan"))
    a_starts, b_starts, rows = [[], []], [[], []], 0
    for s in (1, 0):  # b packs source 1's runs first
        off = 0
        for e in range(E):
            a_starts[s].append(s * cap + off)
            b_starts[s].append(rows)
            off += counts[s][e]
            rows += counts[s][e]
    b = torch.full((rows + 3, Q), float("nan"))
    ref = torch.zeros(E, P, Q, dtype=torch.float64)
    for s in range(2):
        for e in range(E):
            c, a0, b0 = counts[s][e], a_starts[s][e], b_starts[s][e]
            a[a0:a0 + c] = torch.randn(c, P, generator=g)
            b[b0:b0 + c] = torch.randn(c, Q, generator=g)
            ref[e] += a[a0:a0 + c].double().T @ b[b0:b0 + c].double()
    table = torch.tensor([a_starts, counts, b_starts], dtype=torch.int32)
    config = {"pointers": small(), "tma": small(a_tma=1), "flat": small(a_tma=1, persistent=2)}[form]
    out = torch.full((E, P, Q), float("nan"))
    ensure_allocator()
    launch_wgrad(a, b, out, None, P, Q, config, segments=table, tma=form != "pointers")
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu"])
def test_tabled_flat_d_act_config_runs_for_every_activation(activation, monkeypatch):
    """A d(act) table entry with the flat loop (``persistent = 2``, ``unfused_act``), as the H200
    tables hold for SwiGLU shapes: a GELU or ReLU layer borrowing it computes the derivative in
    the epilogue, which the flat loop has no form of, so it runs the nested kernel instead of
    failing. Given in the options, the config stays an error (the test below)."""
    from interlace.kernels.expert_gemm import configs

    flat = small(unfused_act=1, a_tma=1, persistent=2)
    real_choose = configs._choose

    def tabled(kernels, *args):  # the tables' choice, as on a GPU
        chosen, _ = real_choose(kernels, *args)
        if kernels is configs.BACKWARD_KERNELS:
            return (flat,) + tuple(chosen[1:]), "bwd_act tuned; bwd_dx tuned; wgrad tuned"
        return chosen, "tuned"

    monkeypatch.setattr(configs, "_choose", tabled)
    ca = configs.choose_backward_configs(torch.randn(4, 32), torch.randn(2, 32, 24), 4, activation)[0]
    assert ca.persistent == (2 if activation == "swiglu" else 0)
    check_forward_backward(activation, "k-way", [0, 1, 17, 0, 33, 16], N=32, K=24,
                           options=ExpertKernelOptions(tma=True))


@pytest.mark.parametrize("a_tma", [0, 1])
def test_tma_stored_tiles_match_reference(a_tma):
    """``tma_store``: the plain-epilogue GEMMs (GEMM1, dx, d(act) with ``unfused_act``) store full
    16-row tiles through a descriptor and partial ones (1, 17, 33 rows) masked; a full tile's box
    must not reach the next expert's rows, nor a partial tile's store skip any (outputs poisoned)."""
    stored = small(a_tma=a_tma, tma_store=1)
    options = ExpertKernelOptions(gemm1=stored, bwd_dx=stored, bwd_act=small(unfused_act=1, a_tma=a_tma, tma_store=1),
                                  tma=True)
    check_forward_backward("swiglu", "k-way", [0, 1, 17, 0, 33, 16], N=32, K=24, options=options)
    check_forward_backward("gelu", "plain", [16, 0, 3, 32], N=32, K=24, options=options)


@pytest.mark.parametrize("joint", [0, 1])
def test_flat_loop_gemms_match_reference(joint):
    """``persistent = 2`` for GEMM0 and the plain-epilogue GEMMs: one flat loop over (tile, k step)
    steps, A, B and the outputs through descriptors; a partial tile (1, 17, 33 rows) stores through
    a descriptor ending at its last row, which must clip the next expert's rows (outputs
    poisoned). K = 24 with 16-wide blocks: the last column block runs past K. The training
    forward stores h (masked) from the same loop; GELU takes one dot, SwiGLU one joint or two."""
    flat = small(a_tma=1, persistent=2)
    options = ExpertKernelOptions(gemm0=small(a_tma=1, persistent=2, joint=joint), gemm1=flat, bwd_dx=flat,
                                  bwd_act=small(unfused_act=1, a_tma=1, persistent=2), tma=True)
    check_forward_backward("swiglu", "k-way", [0, 1, 17, 0, 33, 16], N=32, K=24, options=options)
    options = replace(options, bwd_act=small(a_tma=1))  # GELU's derivative runs in the epilogue
    check_forward_backward("gelu", "plain", [16, 0, 3, 32], N=32, K=24, options=options)


def test_flat_loop_with_an_activation_gradient_epilogue_is_refused():
    options = ExpertKernelOptions(bwd_act=small(a_tma=1, persistent=2), tma=True)  # fused derivative, flat loop
    with pytest.raises(ValueError, match="persistent = 2"):
        check_forward_backward("swiglu", "plain", [3, 17], N=32, K=24, options=options)


@pytest.mark.parametrize("name", ["gemm1", "wgrad"])
def test_persistent_without_tma_rows_is_refused(name):
    """``persistent`` reads rows through descriptors: without ``a_tma`` it is an error, not a
    silent switch to another kernel."""
    options = ExpertKernelOptions(tma=True, **{name: small(persistent=2)})
    with pytest.raises(ValueError, match="needs a_tma"):
        check_forward_backward("swiglu", "plain", [3, 17], N=32, K=24, options=options)


def test_persistent_takes_no_other_form():
    """``persistent`` is 0 (a loop per work item) or 2 (one flat loop); any other value is refused."""
    options = ExpertKernelOptions(wgrad=small(a_tma=1, persistent=1), tma=True)
    with pytest.raises(ValueError, match="persistent must be 0"):
        check_forward_backward("swiglu", "plain", [3, 17], N=32, K=24, options=options)


def test_kernel_options_are_checked_and_reach_the_sequential_strategy():
    """``ExpertKernelOptions`` takes configs and a TMA switch only; ``sequential`` takes it as its
    ``kernels`` option (a clear TypeError for anything else) for the Triton expert backend."""
    from interlace.strategies.sequential import SequentialStrategy

    with pytest.raises(TypeError, match="gemm0 must be a GemmConfig"):
        ExpertKernelOptions(gemm0=(16, 16, 16, 4, 1))
    with pytest.raises(TypeError, match="tma must be"):
        ExpertKernelOptions(tma=1)
    cfg, ep = object(), object()
    options = ExpertKernelOptions(tma=True)
    assert SequentialStrategy(cfg, ep, expert_backend="triton", kernels=options).kernels is options
    with pytest.raises(TypeError, match="must be an ExpertKernelOptions"):
        SequentialStrategy(cfg, ep, expert_backend="triton", kernels={"tma": True})
    with pytest.raises(ValueError, match="expert_backend='triton'"):
        SequentialStrategy(cfg, ep, kernels=options)


# Compiles a kernel for sm90 without a GPU (a child process: the tests' interpreter mode
# replaces the kernels): bf16 data pointers, int32 tile lists and sizes, 16-divisible pointers and dims.
_SM90_COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from interlace.kernels.expert_gemm import gemm0, grouped, wgrad

DATA = ("x_ptr", "w_ptr", "out_ptr", "h_ptr", "a_ptr", "b_ptr")


def compile_sm90(kernel, constexprs, warps, stages, types=None):
    # types: pointer types by name that override bf16 data / int32 lists
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        pointer = name.endswith("_ptr")
        sig[name] = ((types or {}).get(name) or ("*bf16" if name in DATA else "*i32")) if pointer else "i32"
        if pointer or name in ("N", "K", "COLS", "RED", "P", "Q"):  # (16-divisible, as on launch)
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))
"""


def _run_sm90(script: str):
    """Runs ``_SM90_COMPILE + script`` in a child process; returns its last stdout line as JSON."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_COMPILE + script], capture_output=True, text=True, env=env,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


_SM90_JOINT = r"""
constexprs = dict(ACTIVATION=0, HAS_GATHER=True, STORE_H=False, USE_TMA=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                  GROUP_M=8, A_TMA=False, JOINT=True, TMA_STORE=False)
ptx = compile_sm90(gemm0.gemm0_kernel, constexprs, 8, 4).asm["ptx"]
print(json.dumps(sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)|cp\.async\.bulk\.tensor\.(\dd)",
                                       ptx)))))
"""


def test_joint_gate_up_compiles_to_one_wide_wgmma():
    """With ``joint`` the sm90 code of GEMM0 (128 × 128 tiles of gate and up) issues n256 wgmma
    instructions fed by 3-D TMA loads: one double-width dot, not two n128 ones. Compiled without
    a GPU in a child process (the tests' interpreter mode replaces the kernels)."""
    found = _run_sm90(_SM90_JOINT)
    assert ["m64n256k16", ""] in found and ["", "3d"] in found, found
    assert ["m64n128k16", ""] not in found, found


_SM90_TABLE_CONFIGS = r"""
from interlace.tuning.tables import PACKAGED_DIR, GemmConfig

# What each table's kernel launches with a config (the launchers of gemm0 and grouped, SwiGLU, Hopper).
KERNELS = {"gemm0_flat_kernel": gemm0.gemm0_flat_kernel, "gemm0_kernel": gemm0.gemm0_kernel,
           "gemm_flat_kernel": grouped.gemm_flat_kernel, "gemm_kernel": grouped.gemm_kernel}
jobs = set()
for path in sorted(PACKAGED_DIR.glob("expert_*-NVIDIA_H*.json")):
    table = path.name.split("-")[0].replace("expert_gemm0_train", "expert_gemm0")  # the same kernel
    for entry in json.loads(path.read_text())["entries"]:
        c = GemmConfig(**entry["config"])
        if not (c.tma_store or c.persistent == 2) or table == "expert_wgrad":
            continue
        blocks = (("BLOCK_M", c.block_m), ("BLOCK_N", c.block_n), ("BLOCK_K", c.block_k), ("GROUP_M", c.group_m))
        for store_h in ((False, True) if table == "expert_gemm0" else (False,)):
            if table == "expert_gemm0" and c.persistent == 2:
                jobs.add(("gemm0_flat_kernel", blocks + (("ACTIVATION", 0), ("STORE_H", store_h),
                          ("JOINT", bool(c.joint))), c.num_warps, gemm0.gemm0_flat_stages(c, store_h)))
            elif table == "expert_gemm0":
                jobs.add(("gemm0_kernel", blocks + (("ACTIVATION", 0), ("HAS_GATHER", not c.a_tma), ("STORE_H", store_h),
                          ("USE_TMA", True), ("A_TMA", bool(c.a_tma)),
                          ("JOINT", bool(c.joint)), ("TMA_STORE", True)), c.num_warps, c.num_stages))
            elif c.persistent == 2:
                jobs.add(("gemm_flat_kernel", blocks + (("B_TRANS", table == "expert_gemm1"),), c.num_warps,
                          c.num_stages))
            else:
                jobs.add(("gemm_kernel", blocks + (("B_TRANS", table == "expert_gemm1"), ("EPILOGUE", 0),
                          ("USE_TMA", True), ("A_TMA", bool(c.a_tma)),
                          ("TMA_STORE", True)), c.num_warps, c.num_stages))
found = []
for name, constexprs, warps, stages in sorted(jobs, key=str):
    k = compile_sm90(KERNELS[name], dict(constexprs), warps, stages)
    found.append([name, dict(constexprs), warps, stages, k.metadata.shared,
                  len(re.findall(r"cp\.async\.bulk\.tensor\.[2-5]d\.global\.shared", k.asm["ptx"]))])
print(json.dumps(found))
"""


def test_table_configs_with_tma_stores_fit_hopper_shared_memory():
    """Every packaged H200 table entry that uses a TMA store or the flat loop compiles for sm90
    within the 227 KB of shared memory a Hopper block may have, as the launcher runs it (GEMM0
    with and without storing h), and issues TMA stores. A config over the limit only fails at
    launch on the GPU (e.g. the flat GEMM0 at 4 stages while storing h, which the launcher caps
    at 3 stages); this catches it on the CPU. Compiled in a child process (no interpreter)."""
    found = _run_sm90(_SM90_TABLE_CONFIGS)
    kernels = {f[0] for f in found}
    assert {"gemm0_flat_kernel", "gemm_flat_kernel"} <= kernels, kernels  # the tables use the flat loops
    for name, constexprs, warps, stages, shared, tma_stores in found:
        assert shared <= 232448, (name, constexprs, warps, stages, shared)  # sm90's opt-in maximum per block
        assert tma_stores >= 1, (name, constexprs)


_SM90_WGRAD_FLAT = r"""
from interlace.tuning.tables import PACKAGED_DIR, GemmConfig

configs = set()
for path in sorted(PACKAGED_DIR.glob("expert_wgrad-NVIDIA_H*.json")):
    for entry in json.loads(path.read_text())["entries"]:
        c = GemmConfig(**entry["config"])
        if c.persistent == 2:
            configs.add((c.block_m, c.block_n, c.block_k, c.group_m, c.num_warps, c.num_stages))
found = []
for bm, bn, bk, gm, warps, stages in sorted(configs):
    for num_seg in (0, 2):
        constexprs = dict(BLOCK_P=bm, BLOCK_Q=bn, BLOCK_R=bk, GROUP_P=gm, NUM_SEG=num_seg, BLOCK_I=256)
        k = compile_sm90(wgrad.wgrad_flat_kernel, constexprs, warps, stages)
        ptx = k.asm["ptx"]
        found.append([constexprs, k.metadata.shared, ptx.count("fence.proxy.tensormap"),
                      ptx.count("cp.async.bulk.tensor.3d.shared"), ptx.count("wgmma.mma_async")])
print(json.dumps(found))
"""


def test_flat_weight_gradient_makes_its_maps_once():
    """The packaged H200 weight-gradient configs' flat kernel, compiled for sm90: it fits in
    shared memory, reads its rows through the 3-D window maps (TMA loads of 3-D boxes), and makes
    exactly its three tensor maps (a's window, b's, the output's), one proxy fence each, all before
    the loop: a map made per run inside it costs each program a global write and a proxy fence per run."""
    found = _run_sm90(_SM90_WGRAD_FLAT)
    assert found, "no flat weight-gradient config in the packaged tables"
    for constexprs, shared, fences, loads_3d, wgmma in found:
        assert shared <= 232448, (constexprs, shared)
        assert fences == 3, (constexprs, fences)
        assert loads_3d >= 1 and wgmma >= 1, (constexprs, loads_3d, wgmma)


def test_layer_strategy_options_reach_the_expert_kernels():
    """``MoELayer(strategy="sequential:triton", strategy_options={"kernels": ...})``: the options
    reach the kernels (a config they refuse raises; the TMA flat loops give the default's output)."""
    from interlace import MoEConfig, MoELayer

    cfg = MoEConfig(hidden=32, ffn=24, num_experts=4, top_k=2, dtype=torch.float32)
    x = torch.randn(9, 32)

    def run(options):
        layer = MoELayer(cfg, strategy="sequential:triton", strategy_options={"kernels": options}, seed=3,
                         device="cpu")
        xs = x.clone().requires_grad_()
        out = layer(xs)
        out.backward(torch.ones_like(out))
        return out, xs.grad

    with pytest.raises(ValueError, match="needs a_tma"):
        run(ExpertKernelOptions(gemm1=small(persistent=2)))
    flat = small(a_tma=1, persistent=2)
    out, dx = run(ExpertKernelOptions(gemm0=flat, gemm1=flat, bwd_dx=flat, wgrad=flat,
                                      bwd_act=small(unfused_act=1, a_tma=1, persistent=2), tma=True))
    ref_out, ref_dx = run(None)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(dx, ref_dx) < 1e-5
