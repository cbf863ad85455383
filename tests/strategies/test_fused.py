"""The fused (COMET) strategy's kernels with W ranks simulated in one process.

Peer buffers are ordinary tensors and every rank's tables point at the others' tensors, so the
kernels' peer stores, tile flags, epochs and the column-wise layer1 run exactly as on GPUs;
each phase of every rank runs before the next phase (producers before consumers). Checked
against an fp64 loop over experts, outputs poisoned first.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from interlace import MoEConfig
from interlace.experts import init_expert_weights
from interlace.kernels.comet.plan import build_plan
from interlace.strategies.fused.engine import FusedEngine, check_error_record, run_simulated
from interlace.strategies.fused.options import INTERPRETER_CONFIG
from interlace.parallel.peer_buffer import BufferSpec, simulated_world

from helpers import rel_err


def expert_reference(x, idx, w, w_up, w_down, cfg):
    """fp64: out[t] = Σ_j w[t, j] · FFN_{idx[t, j]}(x[t]) over all experts' full weights."""
    x = x.double()
    out = torch.zeros_like(x)
    K = cfg.ffn
    for e in range(cfg.num_experts):
        t, j = (idx == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        h = x[t] @ w_up[e].double().t()
        if cfg.activation == "swiglu":
            act = F.silu(h[:, :K]) * h[:, K:]
        elif cfg.activation == "gelu":
            act = F.gelu(h)
        else:
            act = F.relu(h)
        out.index_add_(0, t, w[t, j].double().unsqueeze(1) * (act @ w_down[e].double().t()))
    return out


def simulate(cfg, tokens, idxs, seed=0, n_comm=(1, 1), n_programs=4, max_tokens=None, calls=1, spins=1 << 20,
             kernel=INTERPRETER_CONFIG, poison_recv=False):
    W = len(tokens)
    El = cfg.num_experts // W
    spec = BufferSpec(W, El, cfg.hidden, cfg.top_k, max_tokens or max(max(tokens), 1), kernel.block_m,
                      kernel.block_n1, cfg.dtype)
    bufs = simulated_world(spec)
    if poison_recv:  # rows no send may write stay NaN
        for b in bufs:
            b.views["recv"].fill_(float("nan"))
    engines = [FusedEngine(cfg, b, kernel, n_programs, n_comm[0], n_comm[1], spins) for b in bufs]
    w_up, w_down = init_expert_weights(cfg, range(cfg.num_experts), seed, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed + 5)
    results = []
    for _ in range(calls):  # fresh inputs every call: epochs advance, nothing is reset
        xs = [torch.randn(T, cfg.hidden, generator=gen).to(cfg.dtype) for T in tokens]
        ws = [torch.rand(T, cfg.top_k, generator=gen) for T in tokens]
        outs = run_simulated(engines, xs, idxs, ws, [w_up[r * El:(r + 1) * El] for r in range(W)],
                             [w_down[r * El:(r + 1) * El] for r in range(W)])
        refs = [expert_reference(x, i, w, w_up, w_down, cfg) for x, i, w in zip(xs, idxs, ws)]
        results.append((outs, refs))
    return results, engines


# The strategy's bookkeeping tests (CUDA-graph leases and eviction, train paths, a shared peer
# buffer, a second backward) check which path a call takes and that its results equal the eager
# path's bit for bit; the shape is immaterial there, and the interpreted kernels' time grows with
# the experts and widths (on CONFIGS["swiglu"], 8 experts, a fused:train call took 3x as long).
# SwiGLU (whose backward writes over the saved pre-activation), top-2 of 4 experts, 2 per rank
# at world size 2.
SMALL = MoEConfig(hidden=16, ffn=16, num_experts=4, top_k=2, dtype=torch.float32)


def random_indices(cfg, tokens, gen):
    return [torch.stack([torch.randperm(cfg.num_experts, generator=gen)[:cfg.top_k] for _ in range(T)])
            if T else torch.empty(0, cfg.top_k, dtype=torch.long) for T in tokens]


@pytest.mark.parametrize("world,tokens,activation", [
    (2, [37, 21], "swiglu"),   # rows not divisible by the tile, ragged segments
    (3, [9, 0, 26], "gelu"),   # an empty rank
    (4, [5, 17, 1, 12], "relu"),
])
def test_fused_matches_reference(world, tokens, activation):
    cfg = MoEConfig(hidden=40, ffn=24, num_experts=2 * world, top_k=2, activation=activation, dtype=torch.float32)
    idxs = random_indices(cfg, tokens, torch.Generator().manual_seed(world))
    results, engines = simulate(cfg, tokens, idxs, calls=2)
    for outs, refs in results:
        for out, ref in zip(outs, refs):
            assert out.shape == ref.shape
            assert rel_err(out, ref) < 1e-5
    assert all(int(e.buf.epoch) == 2 for e in engines)


def test_fused_skewed_zero_experts_fp16():
    """All tokens on one rank's experts (the other receives nothing), fp16, more programs. (bf16 tl.dot
    is wrong under the Triton 3.6 interpreter, so bf16 is checked on GPUs only.)"""
    cfg = MoEConfig(hidden=48, ffn=32, num_experts=4, top_k=2, dtype=torch.float16)
    tokens = [33, 18]
    idxs = [torch.tensor([[0, 1]] * T) for T in tokens]
    (outs, refs), = simulate(cfg, tokens, idxs, n_comm=(2, 3), n_programs=6)[0]
    for out, ref in zip(outs, refs):
        assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("tma", [False, True])
def test_fused_swizzled_work_orders(tma):
    """L2-swizzled work orders (row-tile groups of 3, N-slices in groups of 2 and all at once)
    cover every (tile, column block) exactly once: checked through the output; weights through
    pointers and through TMA descriptors (the interpreter emulates them)."""
    from dataclasses import replace

    # hidden 48: 3 N-slices of 16 (groups of 2 leave a partial one; a send row of 32 + 16 columns);
    # ffn 40: 2.5 column blocks of 16 (the last block's planes run past K). 45 and 30 tokens: about
    # 3 row tiles per expert, 6 per rank, so groups of 3 tiles. (80 and 72 checked the same
    # properties with more blocks, at 1.6 times the interpreted work.)
    cfg = MoEConfig(hidden=48, ffn=40, num_experts=4, top_k=2, dtype=torch.float32)
    tokens = [45, 30]
    idxs = random_indices(cfg, tokens, torch.Generator().manual_seed(9))
    # with TMA, the A rows through descriptors too: layer0's remote tiles (a_tma0) and layer1's h
    # rows (a_tma1; the tiles' rows start mid-buffer); layer1's tile counts deferred by one item
    # (the default) and counted at once; combine tasks wider than the token count (block_t); and
    # send copy steps taller than a row tile and narrower than a row (copy_rows, copy_cols)
    variants = [dict(slice_group=2), dict(slice_group=0), dict(slice_group=2, defer_count=0),
                dict(slice_group=2, block_t=64), dict(slice_group=2, copy_rows=32, copy_cols=32)]
    if tma:
        variants.append(dict(slice_group=2, a_tma0=1, a_tma1=1))
        variants.append(dict(slice_group=2, a_tma0=0, a_tma1=0))
        # layer0's gate and up as one 3-D block and one dot (ffn 40: the last block's planes run past K)
        variants.append(dict(slice_group=2, joint0=1))
        variants.append(dict(slice_group=2, joint0=1, a_tma0=0))
        # layer0's local rows gathered into the rank's own recv region first, then read through TMA
        variants.append(dict(slice_group=2, gather0=1))
        variants.append(dict(slice_group=2, gather0=1, joint0=1, copy_rows=32))
    for variant in variants:
        kernel = replace(INTERPRETER_CONFIG, block_n=16, block_n1=16, group_m=3, tma=tma, **variant)
        (outs, refs), = simulate(cfg, tokens, idxs, kernel=kernel)[0]
        for out, ref in zip(outs, refs):
            assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("world,tokens,capacity", [
    (3, [9, 0, 26], None),     # an empty rank (it gathers no local rows)
    (4, [5, 17, 1, 12], 0.5),  # capacity drops: only kept local rows are gathered, in dispatch order
])
def test_fused_gathered_local_rows_match_default(world, tokens, capacity):
    """``gather0`` (with TMA, which the interpreter emulates): each rank copies its own kept rows
    into its own ``recv`` region before layer0, poisoned with NaN first, and reads every tile
    from there. Over two calls it equals the default path (local rows gathered through pointers)
    bit for bit, and matches the reference without drops."""
    from dataclasses import replace

    cfg = MoEConfig(hidden=48, ffn=32, num_experts=2 * world, top_k=2, dtype=torch.float32,
                    **({} if capacity is None else dict(capacity_factor=capacity)))
    idxs = random_indices(cfg, tokens, torch.Generator().manual_seed(world + 30))
    kernel = replace(INTERPRETER_CONFIG, block_n=16, block_n1=16, a_tma0=1, tma=True)
    gathered, _ = simulate(cfg, tokens, idxs, calls=2, kernel=replace(kernel, gather0=1), poison_recv=True)
    default, _ = simulate(cfg, tokens, idxs, calls=2, kernel=replace(kernel, gather0=0), poison_recv=True)
    for (outs, refs), (outs_default, _) in zip(gathered, default):
        for out, ref, out_default in zip(outs, refs, outs_default):
            assert torch.isfinite(out).all()
            assert torch.equal(out, out_default)
            if capacity is None:
                assert rel_err(out, ref) < 1e-5


def stalled_call(cfg, kernel, rank, expert, counts_all):
    """Rank ``rank`` of a simulated 2-rank world (one expert per rank, top-1, 8 tokens all on
    ``expert``, waits bounded at 50 polls) with its call prepared for the counts ``counts_all``
    but no peer having run: its engine, call, buffers and local weights."""
    spec = BufferSpec(2, 1, cfg.hidden, 1, 8, kernel.block_m, kernel.block_n1, cfg.dtype)
    bufs = simulated_world(spec)
    eng = FusedEngine(cfg, bufs[rank], kernel, 4, 1, 1, max_spins=50)
    w_up, w_down = init_expert_weights(cfg, [rank], 0, torch.device("cpu"))
    index = eng.dispatch_index(torch.full((8, 1), expert, dtype=torch.long))
    bufs[rank].advance_epoch()
    call = eng.prepare(torch.randn(8, cfg.hidden), torch.rand(8, 1), index, torch.tensor(counts_all, dtype=torch.int32))
    return eng, call, bufs, w_up, w_down


def test_sends_write_only_their_segments_rows():
    """A partial send tile writes its valid rows only: in each receiver's region of a source,
    the rows past what that source sent stay poisoned (the stores are masked). Row counts not
    divisible by the tile or the copy step; weights through TMA."""
    from dataclasses import replace

    cfg = MoEConfig(hidden=48, ffn=32, num_experts=4, top_k=2, dtype=torch.float32)
    tokens = [23, 13]
    idxs = random_indices(cfg, tokens, torch.Generator().manual_seed(4))
    kernel = replace(INTERPRETER_CONFIG, block_m=16, copy_rows=8, copy_cols=32, tma=True)
    results, engines = simulate(cfg, tokens, idxs, max_tokens=40, kernel=kernel, poison_recv=True)
    (outs, refs), = results
    for out, ref in zip(outs, refs):
        assert rel_err(out, ref) < 1e-5
    El = cfg.num_experts // 2
    for r, eng in enumerate(engines):
        recv = eng.buf.views["recv"].reshape(2, -1, cfg.hidden)
        for s in range(2):
            if s == r:
                continue  # a rank's own rows are read in place, never copied
            sent = int((idxs[s] // El == r).sum())
            assert sent > 0 and not torch.isnan(recv[s, :sent]).any(), (r, s)
            assert torch.isnan(recv[s, sent:]).all(), f"rank {s} wrote rows past its {sent} into rank {r}"


def test_fused_capacity_drops_like_reference():
    cfg = MoEConfig(hidden=32, ffn=16, num_experts=4, top_k=2, capacity_factor=0.5, dtype=torch.float32)
    tokens = [20, 20]
    idxs = [torch.tensor([[0, 3]] * 20), torch.tensor([[1, 2]] * 20)]
    (outs, _), = simulate(cfg, tokens, idxs)[0]
    from interlace.reference import capacity_keep_mask

    for out, idx in zip(outs, idxs):
        keep = capacity_keep_mask(idx, cfg)
        assert keep.sum() < keep.numel()  # something is dropped
        # Tokens whose every assignment was dropped get exactly zero (not poison, not stale rows).
        dropped_all = ~keep.any(1)
        assert torch.isfinite(out).all()
        assert (out[dropped_all] == 0).all()


def test_wait_times_out_with_a_named_error_instead_of_hanging():
    """Rank 1's GEMM runs before rank 0 ever sent: the bounded wait records who waited on what."""
    cfg = MoEConfig(hidden=16, ffn=16, num_experts=2, top_k=1, dtype=torch.float32)
    # rank 0 claims to send 8 rows
    eng, call, bufs, w_up, _ = stalled_call(cfg, INTERPRETER_CONFIG, 1, 1, [[0, 8], [0, 8]])
    eng.layer0(call, w_up, "gemm")
    with pytest.raises(RuntimeError, match=r"rank 1: timed out waiting for rows from source rank 0 for local "
                                           r"expert 0, row tile 0 \(flag value 0, expected epoch 1\)"):
        check_error_record(bufs[1])


def test_combine_waits_for_each_new_slice_once_per_program():
    """The combine skips the flag polls of a slice it already acquired, but never those of a new
    slice: rank 1 published slice 0 of rank 0's rows and not slice 1, so rank 0's combine passes
    slice 0 and times out on slice 1, naming it."""
    cfg = MoEConfig(hidden=64, ffn=16, num_experts=2, top_k=1, dtype=torch.float32)  # 2 N-slices of 32
    # all of rank 0's tokens go to expert 1, on rank 1
    eng, call, bufs, _, w_down = stalled_call(cfg, INTERPRETER_CONFIG, 0, 1, [[0, 8], [0, 8]])
    assert eng.buf.spec.num_slices == 2
    bufs[0].views["flags1"][1, 0] = 1  # rank 1's slice 0 for rank 0 has landed (epoch 1); slice 1 has not
    eng.layer1(call, w_down, "comm")
    with pytest.raises(RuntimeError, match=r"rank 0: timed out waiting for expert outputs from rank 1 for N-slice 1 "
                                           r"\(flag value 0, expected epoch 1\)"):
        check_error_record(bufs[0])


def test_peer_tables_must_be_16_byte_aligned():
    """The kernels tell the compiler the peer regions are 16-byte aligned (vector stores); a
    table that breaks the promise is refused where it is built, not corrupted in a kernel."""
    spec = BufferSpec(2, 1, 16, 1, 8, INTERPRETER_CONFIG.block_m, INTERPRETER_CONFIG.block_n1, torch.float32)
    bufs = simulated_world(spec)
    good = [b.raw.data_ptr() for b in bufs]
    bufs[0]._set_tables(good)  # aligned: accepted
    with pytest.raises(ValueError, match="16-byte aligned"):
        bufs[0]._set_tables([good[0], good[1] + 8])


# The fused kernels compiled for sm90 without a GPU (child processes of the tests below).
_SM90_COMPILE90 = r"""
import json, re, sys
from collections import Counter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import interlace.kernels.comet.layer1 as l1, interlace.kernels.comet.layer0 as l0

def compile90(kernel, constexprs, bf16, i64, fp32=(), stages=4):
    defaults = dict(LOCAL_TMA=False)  # compile-time switches not given
    constexprs = {**{k: v for k, v in defaults.items() if k in kernel.arg_names}, **constexprs}
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        pointer = (name in bf16 or name in i64 or name in fp32 or name.endswith("_ptr")
                   or name.startswith(("send_", "recv_")) or name == "tiles_from_source")
        sig[name] = ("*bf16" if name in bf16 else "*i64" if name in i64 else "*fp32" if name in fp32
                     else "*i32") if pointer else "i32"
        if pointer or name in ("N", "K"):
            attrs[(i,)] = [["tt.divisibility", 16]]  # how Triton's launcher specializes aligned args
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=8, num_stages=stages))
"""

_SM90_STORES = _SM90_COMPILE90 + r"""
def widths(kernel, constexprs, bf16, i64, fp32=()):
    compiled = compile90(kernel, constexprs, bf16, i64, fp32)
    return Counter(re.findall(r"\n\s*(?:@%p\d+\s+)?(st\.global[\w.]*)", compiled.asm["ptx"]))

i64 = {"ret_table", "flags1_table", "recv_table", "flags0_table", "timeline_ptr", "timeline_clock"}
print(json.dumps({
    "layer1": widths(l1._gemm1_combine_kernel,
                     dict(TOP_K=8, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, BLOCK_T=32, GROUP_M=8, USE_TMA=True,
                          B_KMAJOR=False, TIMELINE=0, A_TMA=True, DEFER_COUNT=True),
                     {"h_ptr", "w_ptr", "ret_ptr", "out_ptr"}, i64, {"weight_ptr"}),
    "layer0": widths(l0._dispatch_gemm0_kernel,
                     dict(TOP_K=8, ACTIVATION=0, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, COPY_ROWS=16, COPY_COLS=512,
                          GROUP_M=8, USE_TMA=True, STORE_PRE=False, B_KMAJOR=False, TIMELINE=0, A_TMA=True,
                          PROXY_FENCE=True, JOINT=False),
                     {"x_ptr", "w_ptr", "h_ptr", "pre_ptr", "recv_ptr"}, i64),
}))
"""


def test_peer_row_stores_compile_to_16_byte_vectors():
    """The rows each rank stores into a peer's buffer (layer0's sends, layer1's expert outputs)
    go out as 16-byte vector stores in the sm90 code, not 2 bytes at a time (a loaded address
    carries no alignment unless the kernel states it). Compiled for sm90 without a GPU, in a
    child process: the tests' interpreter mode replaces the kernels with interpreted ones."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_STORES], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    for name, stores in counts.items():
        assert stores.get("st.global.b16", 0) == 0, f"{name}: scalar bf16 stores {stores}"
        assert stores.get("st.global.v4.b32", 0) > 0, f"{name}: no 16-byte stores {stores}"


_SM90_GATHERED = _SM90_COMPILE90 + r"""
local = compile90(l0._dispatch_gemm0_kernel,
                  dict(TOP_K=8, ACTIVATION=0, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, COPY_ROWS=16, COPY_COLS=512,
                       GROUP_M=8, USE_TMA=True, STORE_PRE=False, B_KMAJOR=False, TIMELINE=0, A_TMA=True,
                       PROXY_FENCE=True, JOINT=True, LOCAL_TMA=True),
                  {"x_ptr", "w_ptr", "h_ptr", "pre_ptr", "recv_ptr"}, {"recv_table", "flags0_table", "timeline_ptr",
                  "timeline_clock"}, (), 4)
print(json.dumps(dict(layer0_pointer_a=len(re.findall(r"cp\.async\.cg", local.asm["ptx"])))))
"""


def test_gathered_layer0_compiles_for_sm90():
    """sm90 code of ``gather0``, compiled without a GPU in a child process: with the local rows
    gathered, layer0's GEMM reads no A rows through pointers."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_GATHERED], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["layer0_pointer_a"] == 0, got


def test_layer0_auto_switches_follow_the_hidden_size():
    """``gather0`` / ``joint0`` at -1 (the default) turn on from AUTO_GATHER0_MIN_HIDDEN; 0 and 1 force."""
    from interlace.kernels.comet.layer0 import AUTO_GATHER0_MIN_HIDDEN, layer0_switch
    from interlace.strategies.fused.options import GPU_CONFIG

    assert GPU_CONFIG.gather0 == GPU_CONFIG.joint0 == -1
    assert layer0_switch(-1, AUTO_GATHER0_MIN_HIDDEN) and layer0_switch(-1, 7168)
    assert not layer0_switch(-1, AUTO_GATHER0_MIN_HIDDEN - 16) and not layer0_switch(-1, 2048)
    assert layer0_switch(1, 40) and not layer0_switch(0, 8192)


def test_fused_options_from_a_dict_or_the_dataclass():
    """``strategy_options`` takes the fields of :class:`FusedOptions` (the kernel config's as a
    dict under ``kernel``) or a whole ``FusedOptions``; unknown or wrong fields are refused when
    the strategy is built, naming the valid ones or the field."""
    from dataclasses import replace

    from interlace import MoELayer
    from interlace.strategies.fused import FusedOptions
    from interlace.strategies.fused.options import GPU_CONFIG

    cfg = MoEConfig(hidden=8, ffn=8, num_experts=2, top_k=1, dtype=torch.float32)
    layer = MoELayer(cfg, strategy="fused:eager", device="cpu",
                     strategy_options={"max_tokens": 16, "kernel": {"block_t": 64}})
    opts = layer.strategy.options
    assert opts.max_tokens == 16 and not opts.cuda_graph and opts.kernel == {"block_t": 64}
    assert opts.kernel_for(INTERPRETER_CONFIG) == replace(INTERPRETER_CONFIG, block_t=64)
    given = FusedOptions(n_comm=2, train_path="fused", tma=True)
    layer = MoELayer(cfg, strategy="fused", device="cpu", strategy_options={"options": given, "n_comm1": 3})
    assert layer.strategy.options == replace(given, n_comm1=3) and layer.strategy.train_path == "fused"
    assert given.kernel_for(GPU_CONFIG) == replace(GPU_CONFIG, tma=True)
    with pytest.raises(ValueError, match=r"unknown option 'block_q'; valid: max_tokens, n_comm, "):
        MoELayer(cfg, strategy="fused", device="cpu", strategy_options={"block_q": 1})
    with pytest.raises(ValueError, match=r"kernel.*unknown field 'no_such_field'; valid: block_m, "):
        FusedOptions(kernel={"no_such_field": 1})
    for kernel, match in (({"copy_cols": 500}, "copy_cols must be a power of two"),
                          ({"block_t": 0}, "block_t must be a power of two"),
                          ({"defer_count": 2}, "defer_count is a switch"),
                          ({"gather0": 2}, "gather0 is -1"),
                          ({"slice_group": -1}, "slice_group")):
        with pytest.raises(ValueError, match=match):
            FusedOptions(kernel=kernel)
    with pytest.raises(ValueError, match="n_comm must be a positive int or 'auto'"):
        FusedOptions(n_comm=0)


def test_plan_orders_local_tiles_first():
    counts_all = torch.tensor([[3, 0, 5, 2], [1, 4, 0, 6]], dtype=torch.int32)  # W=2, E_l=2
    plan = build_plan(counts_all, me=1, num_local=2, max_tokens=16, top_k=2, block_m=4)
    # rank 1's receive segments: source 1 first (experts 2, 3 → 0 and 6 rows), then source 0 (5, 2)
    assert plan.recv_count.tolist() == [0, 6, 5, 2]
    assert plan.recv_ret_row0.tolist() == [5, 5, 3, 8]  # rows in each source's dispatch order
    assert plan.send_count.tolist() == [1, 4, 0, 0]  # to rank 0; nothing to itself
    n = int(plan.recv_tiles[2])
    assert n == 2 + 2 + 1
    assert plan.recv_tiles[0][:n].tolist() == [1, 1, 2, 2, 3]
    assert plan.tiles_from_source.tolist() == [3, 2]
    assert plan.sent_rows.tolist() == [5, 6]


@pytest.mark.parametrize("W", [2, 3, 4, 5])
def test_plan_sends_to_each_owner_when_it_needs_the_rows(W):
    """Owner d waits on its remote sources in the order d+1, d+2, …; source s must therefore
    send to s−1 first, then s−2, …: at stage j every source feeds the owner waiting on it."""
    El, block_m = 2, 4
    gen = torch.Generator().manual_seed(W)
    counts = torch.randint(1, 9, (W, W * El), generator=gen, dtype=torch.int32)  # every segment nonempty
    for me in range(W):
        plan = build_plan(counts, me, El, max_tokens=40, top_k=3, block_m=block_m)
        n = int(plan.send_tiles[2])
        dests = [seg // El for seg in plan.send_tiles[0][:n].tolist()]
        stages = [(me - d) % W for d in dests]  # owner d consumes source me at stage (me - d) mod W
        assert stages == sorted(stages) and set(stages) == set(range(1, W)), (me, dests)
        # and every (destination, expert) segment is sent exactly once, tile by tile
        want = {(seg, i) for seg in range(W * El) if seg // El != me
                for i in range(-(-int(counts[me, seg]) // block_m))}
        got = list(zip(plan.send_tiles[0][:n].tolist(), plan.send_tiles[1][:n].tolist()))
        assert len(got) == len(want) and set(got) == want


# ---- the strategy under gloo (staged transport: same kernels, collectives between phases) ----
def test_fused_gloo_two_ranks_all_cases():
    """Every config and routing case forward (the fused kernels); backward on two cases with the
    fused forward and a recompute through sequential (``fused:recompute``)."""
    from cases import CASES
    from helpers import run_gloo
    from core.test_distributed import CONFIGS, _check_all

    run_gloo(_check_all, 2, "fused:recompute", list(CONFIGS), CASES, ("random", "uneven_and_empty_rank"))


def _train_paths(rank, world):
    """Default ``fused``: a training call runs sequential's graph (the fused engine is never set
    up); ``fused:recompute`` runs the fused kernels forward, ``fused:train`` forward and backward;
    no_grad always runs them."""
    from cases import make_inputs
    from helpers import reference_grads

    from interlace import MoELayer

    cfg = SMALL
    xs, gs = make_inputs(cfg, [12] * world, seed=5)
    refs = reference_grads(cfg, 11, xs, gs, None, aux_coef=cfg.aux_loss_coef)
    for arg, engine_after_training in (("fused", False), ("fused:recompute", True), ("fused:train", True)):
        layer = MoELayer(cfg, strategy=arg, seed=11, device="cpu")
        x = xs[rank].clone().requires_grad_()
        out = layer(x)
        out.backward(gs[rank])
        assert rel_err(out, refs[0][rank]) < 1e-4 and rel_err(x.grad, refs[1][rank]) < 1e-4, arg
        assert (layer.strategy.engine is not None) == engine_after_training, arg
        with torch.no_grad():
            assert rel_err(layer(xs[rank]), refs[0][rank]) < 1e-4
        assert layer.strategy.engine is not None  # inference ran the fused kernels
    # CUDA graphs (the default) replay only with CUDA symmetric memory; elsewhere calls run eagerly.
    assert not MoELayer(cfg, strategy="fused:eager", seed=11, device="cpu").strategy.cuda_graph
    layer = MoELayer(cfg, strategy="fused", seed=11, device="cpu")
    assert layer.strategy.cuda_graph
    with torch.no_grad():
        for _ in range(3):
            assert rel_err(layer(xs[rank]), refs[0][rank]) < 1e-4
    assert not layer.strategy._graphs


def test_fused_training_paths():
    from helpers import run_gloo

    from interlace import MoELayer

    run_gloo(_train_paths, 2)
    with pytest.raises(ValueError, match="train_path"):
        MoELayer(MoEConfig(hidden=8, ffn=8, num_experts=2, top_k=1, dtype=torch.float32), strategy="fused:bogus",
                 device="cpu")


def _forward_warns_nothing(rank, world):
    import warnings

    from interlace import MoELayer

    cfg = MoEConfig(hidden=16, ffn=8, num_experts=4, top_k=2, dtype=torch.float32)
    layer = MoELayer(cfg, strategy="fused:eager", seed=3, device="cpu")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        # (Triton's interpreter's own: the one the project's pytest configuration ignores)
        warnings.filterwarnings("ignore", "Conversion of an array with ndim > 0", DeprecationWarning)
        layer(torch.randn(5 + rank, cfg.hidden))


def test_fused_forward_on_two_ranks_warns_nothing():
    """The count exchange uses torch's current all-gather (all_gather_into_tensor is deprecated:
    a FutureWarning at every call), and the router kernel makes no NumPy warning."""
    from helpers import run_gloo

    run_gloo(_forward_warns_nothing, 2)


def test_fused_gloo_four_ranks():
    from helpers import run_gloo
    from core.test_distributed import _check_all

    run_gloo(_check_all, 4, "fused", ["capacity"], ["zero_recv_rank", "uneven_and_empty_rank"], ())


# ---- training through the fused kernels (roles swapped in the backward) ----
def test_fused_train_gloo_two_ranks_all_cases():
    """``fused:train``: forward and backward (dx, router, dW_up, dW_down) through the fused kernels
    against the fp64 reference on every config and routing case (capacity drops, a rank that
    receives nothing, an empty rank, an empty batch)."""
    from cases import CASES
    from helpers import run_gloo
    from core.test_distributed import CONFIGS, _check_all

    run_gloo(_check_all, 2, "fused:train", list(CONFIGS), CASES)


def _check_with_options(rank, world, options, config_names, cases, spec="fused:train"):
    """``_check_all`` (tests/core/test_distributed.py) for ``spec`` built with ``options``."""
    from cases import case_indices, case_tokens, make_inputs
    from helpers import assert_grads_match, reference_grads
    from core.test_distributed import CONFIGS, TOL

    from interlace import MoELayer

    for name in config_names:
        cfg = CONFIGS[name]
        for case in cases:
            tokens = case_tokens(case, world)
            indices = case_indices(case, cfg, world, tokens, seed=world)
            xs, gs = make_inputs(cfg, tokens, seed=world)
            layer = MoELayer(cfg, strategy=spec, seed=11, device="cpu", strategy_options=options)
            x = xs[rank].clone().requires_grad_()
            out = layer(x, expert_indices=None if indices is None else indices[rank])
            refs = reference_grads(cfg, 11, xs, gs, indices, aux_coef=cfg.aux_loss_coef)
            where = f"rank {rank}/{world} {spec} {options} {name} {case}"
            assert rel_err(out, refs[0][rank]) < TOL, where + " output"
            out.backward(gs[rank])
            assert_grads_match(layer, x, refs, rank, tokens[rank], where, TOL)


@pytest.mark.parametrize("spec", ["fused:train", "fused:lean"])
def test_fused_train_gloo_four_ranks_and_tma_path(spec):
    """Four ranks; the weights of both swapped-role kernels through tensor descriptors (the
    Hopper path, run by the interpreter), and the weight gradients' rows (per-source runs of an
    expert's rows in one flat loop over the blocks' runs, each run's rows through window maps that
    read the rows past its end as zeros, an empty run one all-zero step). ``fused:lean``: the
    kept rows packed (a rank that receives nothing keeps one unused row)."""
    from helpers import run_gloo

    from interlace.tuning.tables import GemmConfig

    options = {"tma": True, "wgrad": GemmConfig(16, 16, 16, 4, 1, group_m=2, a_tma=1, persistent=2)}
    cases = ["random", "uneven_and_empty_rank"] + (["zero_recv_rank"] if spec == "fused:lean" else [])
    run_gloo(_check_with_options, 4, options, ["swiglu", "sigmoid-gelu"], cases, spec)


def _two_layers(rank, world):
    """Two fused:train layers sharing one peer buffer (forward 1, forward 2, backward 2,
    backward 1), three steps with fresh tokens, against the same two layers on ``sequential``:
    what a layer's backward needs must survive the other layer's use of the buffer."""
    from cases import make_inputs

    from interlace import MoELayer

    cfg = SMALL
    options = {"sequential": {}, "fused:train": {"max_tokens": 32}}
    stacks = {s: [MoELayer(cfg, strategy=s, seed=seed, device="cpu", strategy_options=options[s]) for seed in (11, 12)]
              for s in options}
    for step in range(3):
        xs, gs = make_inputs(cfg, [9 + 4 * r + step for r in range(world)], seed=step)
        got = {}
        for s, (a, b) in stacks.items():
            x = xs[rank].clone().requires_grad_()
            out = b(a(x))
            out.backward(gs[rank])
            got[s] = [out, x.grad] + [p.grad.clone() for p in (*a.parameters(), *b.parameters())]
            for p in (*a.parameters(), *b.parameters()):
                p.grad = None
        for i, (want, have) in enumerate(zip(got["sequential"], got["fused:train"])):
            assert rel_err(have, want) < 1e-5, (rank, step, i)


def _lean_layouts(rank, world):
    """``fused:lean`` keeps R = Σ received rows for the backward (each source's rows packed at
    its base), not the W·cap rows of the receive layout that ``fused:train`` keeps and that
    ``fused:lean`` falls back to inside a caller's CUDA-graph capture (forced here): all three
    give bitwise the same output and gradients. Uneven token counts per rank, three calls."""
    from cases import make_inputs

    import interlace.strategies.fused.train as train
    from interlace import MoELayer

    cfg = SMALL
    keep, capturing, states = train.forward_body, train.caller_capturing, []
    train.forward_body = lambda *a, **k: states.append(keep(*a, **k)) or states[-1]
    results = {}
    for name in ("fused:train", "fused:lean", "fused:lean captured"):
        spec = name.split()[0]
        layer = MoELayer(cfg, strategy=spec, seed=11, device="cpu", strategy_options={"max_tokens": 32})
        train.caller_capturing = (lambda x: True) if name.endswith("captured") else capturing
        results[name] = []
        for step in range(3):
            xs, gs = make_inputs(cfg, [9 + 4 * r + step for r in range(world)], seed=step)
            x = xs[rank].clone().requires_grad_()
            out = layer(x)
            out.backward(gs[rank])
            results[name] += [out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]
            st, cap = states[-1], layer.strategy.buf.spec.cap
            packed = name == "fused:lean"
            rows = int(st.used.sum()) if packed else world * cap
            assert st.packed == packed and st.pre.shape[0] == st.act.shape[0] == st.x_rows.shape[0] == rows
            assert int(st.used.sum()) < world * cap
    train.forward_body, train.caller_capturing = keep, capturing
    for name in ("fused:lean", "fused:lean captured"):
        for i, (a, b) in enumerate(zip(results["fused:train"], results[name])):
            assert torch.equal(a, b), (rank, name, i)


def _lean_graphs(rank, world):
    """``fused:lean`` through its graphs (:class:`EagerRecorder`): the preparation graph, the
    host's read of the rows received, the layers' graph captured for that many rows and
    captured again, larger, when a later call receives more (kept rows: exactly the rows
    received here, so the routing's changes from call to call force it); every call bitwise as
    ``fused:lean`` eager, whose rows it keeps."""
    from cases import make_inputs

    import interlace.strategies.fused.train as train
    from interlace import MoELayer
    from interlace.strategies.graphs import EagerRecorder

    cfg = SMALL
    keep_rows, kept = train.kept_rows, []
    train.kept_rows = lambda total, spec, previous=0: kept.append(total) or max(total, 1)
    try:
        layers = {}
        for name in ("eager", "graphs"):
            layers[name] = MoELayer(cfg, strategy="fused:lean", seed=11, device="cpu",
                                    strategy_options={"max_tokens": 32})
        layers["graphs"].strategy.graph_recorder = EagerRecorder
        for step in range(6):
            xs, gs = make_inputs(cfg, [9 + 4 * r for r in range(world)], seed=step)
            got = {}
            for name, layer in layers.items():
                x = xs[rank].clone().requires_grad_()
                out = layer(x)
                out.backward(gs[rank])
                got[name] = [out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]
                layer.zero_grad(set_to_none=True)
            for i, (a, b) in enumerate(zip(got["eager"], got["graphs"])):
                assert torch.equal(a, b), (rank, step, i)
        graph = layers["graphs"].strategy._train_graphs[9 + 4 * rank]
        assert graph.packed and graph.prep is not None and graph.fwd is not None
        assert graph.rows_kept == max(kept) and len(kept) >= 2 and kept == sorted(kept)  # captured again, larger
        assert graph.fwd[2].pre.shape[0] == graph.rows_kept < world * layers["graphs"].strategy.buf.spec.cap
    finally:
        train.kept_rows = keep_rows


def test_kept_rows_headroom():
    """A captured fused:lean forward keeps 1/16 more rows than it received, in 256s; one that
    outgrew its graph at least 1/4 more than before; never more than W·cap, never fewer than
    received."""
    from types import SimpleNamespace

    from interlace.strategies.fused.train import kept_rows

    spec = SimpleNamespace(world=2, cap=4096)
    assert kept_rows(1000, spec) == 1280  # 1062, in 256s
    assert kept_rows(1300, spec, previous=1280) == 1792  # 1600, in 256s
    assert kept_rows(3000, spec, previous=1280) == 3328  # 3187: the rows decide
    assert kept_rows(7000, spec, previous=6800) == 8192  # 8500: W·cap
    assert kept_rows(0, spec) == 1


def test_fused_lean_graphs_capture_again_when_more_rows_arrive():
    from helpers import run_gloo

    run_gloo(_lean_graphs, 2)


def test_fused_lean_keeps_the_received_rows_packed():
    from helpers import run_gloo

    run_gloo(_lean_layouts, 2)


def test_fused_train_two_layers_share_the_buffer():
    from helpers import run_gloo

    run_gloo(_two_layers, 2)


def test_fused_train_one_rank():
    """World size 1 (the simulated transport)."""
    from cases import make_inputs
    from helpers import assert_grads_match, reference_grads
    from core.test_distributed import CONFIGS

    from interlace import MoELayer

    cfg = CONFIGS["capacity"]
    xs, gs = make_inputs(cfg, [13], seed=3)
    refs = reference_grads(cfg, 11, xs, gs, None, aux_coef=cfg.aux_loss_coef)
    layer = MoELayer(cfg, strategy="fused:train", seed=11, device="cpu")
    x = xs[0].clone().requires_grad_()
    out = layer(x)
    out.backward(gs[0])
    assert layer.strategy.buf.kind == "simulated" and layer.strategy.train_path == "fused"
    assert rel_err(out, refs[0][0]) < 2e-6
    assert_grads_match(layer, x, refs, 0, 13, "fused:train world 1", 2e-6)


def test_fused_train_second_backward_through_one_forward_raises():
    """The backward writes SwiGLU's gradient over the saved pre-activation: a second backward
    through the same forward (retain_graph) must raise, not use the overwritten rows; a fresh
    forward trains again."""
    from cases import make_inputs

    from interlace import MoELayer

    cfg = SMALL
    xs, gs = make_inputs(cfg, [11], seed=4)
    layer = MoELayer(cfg, strategy="fused:train", seed=11, device="cpu")
    x = xs[0].clone().requires_grad_()
    out = layer(x)
    out.backward(gs[0], retain_graph=True)
    first = x.grad.clone()
    with pytest.raises(RuntimeError, match="backward ran twice through one forward"):
        out.backward(gs[0])
    x.grad = None
    layer(x).backward(gs[0])
    assert torch.equal(x.grad, first)


def test_owner_rows_runs_per_source_and_expert():
    """Two ranks, rank 1's view: sources in the order (1, 0), local rows first; each expert's
    rows from each source are one run of buffer rows (the weight-gradient kernel's segments)."""
    from interlace.strategies.fused.train import owner_rows
    from interlace.parallel.peer_buffer import BufferSpec

    spec = BufferSpec(2, 2, 8, 2, 3, 4, 8, torch.float32)  # cap = 3 · min(2, 2) = 6 rows per source
    # counts_all[s, d·2 + e]: source 0 keeps 1 row for (1, 0) and 2 for (1, 1); source 1: 3 and 0.
    counts_all = torch.tensor([[2, 1, 1, 2], [0, 3, 3, 0]], dtype=torch.int32)
    plan = build_plan(counts_all, 1, 2, 3, 2, 4)
    rows = owner_rows(plan, spec, 1)
    starts, counts = rows.segments.tolist()
    assert starts == [[6, 9], [0, 1]]  # region 1 (this rank) at row 6, then region 0
    assert counts == [[3, 0], [1, 2]]
    assert rows.local_row.tolist() == [3, 4, 5, 0, 0, 0]  # rank 1's dispatch rows for global expert 2
    assert rows.used.tolist() == [3, 3]  # region 0 (source 0): 1 + 2 rows; region 1 (this rank): 3 + 0


@pytest.mark.parametrize("block_t,interleave", [(None, (0, 0)), (2, (0, 0)), (None, (8, 1 << 20)), (2, (2, 1 << 20)),
                                                 (None, (1, 1 << 20)), (None, (2, 3))])
@pytest.mark.parametrize("W,El,me", [(2, 2, 1), (3, 5, 0), (4, 3, 2), (1, 6, 0)])
def test_plan_kernel_matches_reference(W, El, me, block_t, interleave):
    """The plan kernel against the plain-torch plan, ragged counts with zeros; ``block_t=2``:
    many programs share the tile lists; ``interleave``: the interleaved receive order (max_rows
    3: only owners with few rows per expert interleave)."""
    from interlace.kernels.comet.plan import build_plan_reference

    gen = torch.Generator().manual_seed(W * 10 + El)
    counts = torch.randint(0, 9, (W, W * El), generator=gen, dtype=torch.int32)
    counts[:, 0] = 0
    kernel = build_plan(counts, me, El, max_tokens=40, top_k=3, block_m=4, block_t=block_t, interleave=interleave)
    ref = build_plan_reference(counts, me, El, max_tokens=40, top_k=3, block_m=4, interleave=interleave)
    for name in ("send_count", "send_row0", "send_dst_off", "recv_count", "recv_off", "recv_ret_row0",
                 "recv_local_row0", "tiles_from_source", "sent_rows"):
        assert getattr(kernel, name).tolist() == getattr(ref, name).tolist(), name
    for side in ("send_tiles", "recv_tiles"):
        n = int(getattr(ref, side)[2])
        assert int(getattr(kernel, side)[2]) == n, side
        for i in (0, 1):
            assert getattr(kernel, side)[i][:n].tolist() == getattr(ref, side)[i][:n].tolist(), side


@pytest.mark.parametrize("W", [1, 2, 3])
def test_plan_interleaved_order(W):
    """lead = 1 of E_l = 3: expert 0's local rows alone, then experts 1 and 2 local and first
    remote source back to back, then expert 0's first-remote rows, then the other sources; the
    first destination gets this rank's experts rotated (1, 2, 0), the others in order."""
    from interlace.kernels.comet.plan import recv_segment_order, send_expert_order

    from interlace.kernels.comet.plan import owner_leads

    El, me, bm = 3, 0, 4
    counts = torch.full((W, W * El), 5, dtype=torch.int32)  # 2 tiles per segment
    rows_per_expert = 5 * W
    assert owner_leads(counts, El, (3, rows_per_expert)) == ([1] * W if W > 1 else [El])
    assert owner_leads(counts, El, (3, rows_per_expert - 1)) == [El] * W  # more rows than max_rows
    assert owner_leads(counts, El, (0, 1 << 20)) == [El] * W
    plan = build_plan(counts, me, El, max_tokens=40, top_k=3, block_m=bm, interleave=(3, rows_per_expert))
    n = int(plan.recv_tiles[2])
    segs = plan.recv_tiles[0][:n].tolist()
    want = [0, 1, El + 1, 2, El + 2, El + 0] + list(range(2 * El, W * El)) if W > 1 else [0, 1, 2]
    assert recv_segment_order(W, El, 1) == want
    assert segs == [s for s in want for _ in range(2)]
    assert plan.recv_tiles[1][:n].tolist() == [0, 1] * len(want)
    assert send_expert_order(El, 1) == [1, 2, 0]
    if W > 1:
        n = int(plan.send_tiles[2])
        sent = [seg for i, seg in enumerate(plan.send_tiles[0][:n].tolist()) if i % 2 == 0]
        first = (me - 1) % W
        want_send = [first * El + e for e in (1, 2, 0)]
        for p in range(1, W - 1):
            want_send += [((me - 1 - p) % W) * El + e for e in range(El)]
        assert sent == want_send


@pytest.mark.parametrize("world,tokens,interleave", [
    (2, [37, 21], 0),     # local first (the default, auto, interleaves at these few rows)
    (2, [37, 21], 2),     # 2 experts per rank: expert 0 leads, expert 1 interleaved
    (3, [9, 0, 26], 1),   # lead = every expert: local first
    (4, [5, 17, 1, 12], 3),
    (2, [40, 33], 8),     # 3 experts per rank, lead 1
])
def test_fused_interleaved_order_matches_reference(world, tokens, interleave):
    """The fused layer with layer0's interleaved receive order (simulated ranks, two calls)
    against the reference, with the recv buffers poisoned."""
    from dataclasses import replace

    El = 3 if world == 2 and interleave == 8 else 2
    kernel = replace(INTERPRETER_CONFIG, interleave0=interleave)
    assert kernel.interleave0_args()[0] == interleave and replace(kernel, interleave0=0).interleave0_args()[0] == 0
    cfg = MoEConfig(hidden=40, ffn=24, num_experts=El * world, top_k=2, dtype=torch.float32)
    idxs = random_indices(cfg, tokens, torch.Generator().manual_seed(world + 70))
    results, _ = simulate(cfg, tokens, idxs, calls=2, kernel=kernel, poison_recv=True)
    for outs, refs in results:
        for out, ref in zip(outs, refs):
            assert rel_err(out, ref) < 1e-5


def test_fused_interleave_decided_per_owner(monkeypatch):
    """Auto interleave with a low row threshold: rank 0's experts get many rows (local first),
    rank 1's few (interleaved); each sender follows its destination's choice. Two calls against
    the reference, the recv buffers poisoned."""
    import interlace.strategies.fused.options as fused_options
    from interlace.kernels.comet.plan import owner_leads

    monkeypatch.setattr(fused_options, "AUTO_INTERLEAVE0_MAX_ROWS", 6)
    assert INTERPRETER_CONFIG.interleave0 == -1 and INTERPRETER_CONFIG.interleave0_args() == (8, 6)
    cfg = MoEConfig(hidden=40, ffn=24, num_experts=6, top_k=2, dtype=torch.float32)  # 3 experts per rank
    tokens = [30, 26]
    gen = torch.Generator().manual_seed(77)
    # both choices on rank 0's experts, but every 7th token's second choice on rank 1's
    def choice(t):
        first, second = torch.randperm(3, generator=gen)[:2].tolist()
        return [first, 3 + second if t % 7 == 0 else second]
    idxs = [torch.tensor([choice(t) for t in range(T)]) for T in tokens]
    counts = torch.stack([torch.bincount(i.flatten(), minlength=6).to(torch.int32) for i in idxs])
    # rank 0 receives over 30 rows per expert (local first), rank 1 under 6 (interleaved)
    assert owner_leads(counts, 3, (8, 6)) == [3, 1]
    results, _ = simulate(cfg, tokens, idxs, calls=2, poison_recv=True)
    for outs, refs in results:
        for out, ref in zip(outs, refs):
            assert rel_err(out, ref) < 1e-5


def test_block_split_lookup_uses_the_shipped_table_and_warns_without_one(tmp_path, monkeypatch):
    import json
    import warnings

    from interlace.config import preset
    from interlace.tuning.fused_split import load_entries, lookup_split, split_key

    cfg = preset("qwen2-moe")
    for world in (2, 4):  # the shipped H200 table covers both (values change with every re-tune)
        shipped = load_entries()[split_key(cfg, world, 132)]
        assert lookup_split(cfg, 15000, world=world, sm_count=132) == tuple(shipped["16384"])  # nearest bucket
        assert lookup_split(cfg, 5000, world=world, sm_count=132) == tuple(shipped["4096"])
    # nearest bucket in log distance, and an override directory beside the package's
    (tmp_path / "fused-split-test.json").write_text(json.dumps(
        {"entries": {split_key(cfg, 2, 77): {"1024": [4, 8], "8192": [24, 12]}}, "meta": {}}))
    from interlace import env

    monkeypatch.setenv("INTERLACE_TUNING_DIR", str(tmp_path))
    env.refresh()
    assert lookup_split(cfg, 2800, world=2, sm_count=77) == (4, 8)  # log-nearer to 1024 than to 8192
    assert lookup_split(cfg, 3000, world=2, sm_count=77) == (24, 12)
    with pytest.warns(UserWarning, match="no tuned fused block split"):
        assert lookup_split(cfg, 5000, world=2, sm_count=78) is None
    # An untuned shape (issue 32): the split of the nearest tuned shape of the same world and SM
    # count, and its source says which, with no warning.
    from interlace.tuning.fused_split import find_split

    odd = cfg.with_(hidden=3000, num_experts=cfg.num_experts + 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split, source = find_split(odd, 2800, world=2, sm_count=77)
    assert split == (4, 8) and source == f"tuned for {split_key(cfg, 2, 77)}"
    assert find_split(cfg, 2800, world=2, sm_count=77) == ((4, 8), "tuned")


def _train_calls(recorder, order, cfg, xs, gs, spec="fused:train"):
    """Run ``fused:train`` calls in ``order`` ("f", i): forward of input i; "b": backward of the
    latest forward not yet backwarded) and return, per backward, (input, out, dx, dW_up,
    dW_down, router grad) and the layer."""
    from interlace import MoELayer

    layer = MoELayer(cfg, strategy=spec, seed=11, device="cpu")
    layer.strategy.graph_recorder = recorder
    pending, got = [], []
    for op, i in order:
        if op == "f":
            x = xs[i].clone().requires_grad_()
            pending.append((i, x, layer(x)))
            continue
        j, x, out = pending.pop()
        layer.zero_grad(set_to_none=True)
        out.backward(gs[j])
        got.append((j, out.detach().clone(), x.grad.clone(), layer.experts.w_up.grad.clone(),
                     layer.experts.w_down.grad.clone(), layer.router.weight.grad.clone()))
    return got, layer


@pytest.mark.parametrize("spec", ["fused:train", "fused:lean"])
def test_fused_train_graphs_match_eager_and_never_share_buffers(spec):
    """``fused:train``'s captured graphs (here :class:`EagerRecorder`, which keeps a graph's
    static-buffer contract on the CPU: every replay rewrites the captured outputs in place)
    against the eager calls, bitwise: first call eager, then capture and replays, and two
    forwards before their backwards. The second of those must run eagerly, since the first one's
    saved state lives in the graph's buffers until its backward (without that guard its
    gradients come out wrong)."""
    from cases import make_inputs

    from interlace.strategies.graphs import EagerRecorder

    cfg = SMALL
    xs, gs = make_inputs(cfg, [11, 11, 11, 11], seed=4)
    order = [("f", 0), ("b", 0), ("f", 1), ("b", 0), ("f", 2), ("b", 0), ("f", 3), ("f", 0), ("b", 0), ("b", 0),
             ("f", 1), ("b", 0)]
    eager, _ = _train_calls(None, order, cfg, xs, gs, spec)
    graphs, layer = _train_calls(EagerRecorder, order, cfg, xs, gs, spec)
    entry = layer.strategy._train_graphs[11]
    assert entry.fwd is not None and entry.bwd is not None and entry.owner is None
    assert [g[0] for g in graphs] == [0, 1, 2, 0, 3, 1]
    for want, have in zip(eager, graphs):
        for name, a, b in zip(("out", "dx", "dW_up", "dW_down", "router"), want[1:], have[1:]):
            assert torch.equal(a, b), f"call with input {want[0]}: {name} differs on the graph path"


def test_graphs_that_share_the_device_pool_are_those_whose_outputs_are_read_at_once():
    """Which captures go into the shared pool (strategies/graphs.py): inference graphs and
    ``fused:train``'s backward graphs (their outputs are cloned or read right after the replay),
    never a ``fused:train`` forward graph, whose saved rows wait for their backward while other
    graphs replay."""
    from cases import make_inputs

    from interlace import MoELayer
    from interlace.strategies.graphs import EagerRecorder

    captures = []

    class Recorder(EagerRecorder):
        def capture(self, fn, device, shared_pool=False):
            captures.append(shared_pool)
            return super().capture(fn, device)

    cfg = SMALL
    xs, gs = make_inputs(cfg, [9, 9], seed=5)
    layer = MoELayer(cfg, strategy="fused:train", seed=11, device="cpu")
    layer.strategy.graph_recorder = Recorder
    for i in range(3):  # eager (compiles), forward capture, backward capture, replays
        layer(xs[i % 2].clone().requires_grad_()).backward(gs[0])
    assert captures == [False, True]
    with torch.no_grad():
        for i in range(3):
            layer(xs[i % 2])
    assert captures == [False, True, True]


@pytest.mark.parametrize("spec", ["fused", "fused:train", "fused:lean"])
def test_graphs_of_different_layers_share_their_static_buffers(spec):
    """Two layers' graphs (:class:`EagerRecorder`) of one token count read their input x from, and
    write their output (and, training, dx) into, the same buffers (strategies/graphs.py:
    ``shared_static``), and every call through them is bitwise the eager one: one layer's
    replay between another's calls changes none of its results. (Sharing a training graph's
    routing weights too gave the first layer's dx from the second layer's weights.)"""
    from cases import make_inputs

    from interlace import MoELayer
    from interlace.strategies.graphs import EagerRecorder

    cfg = SMALL
    train = spec != "fused"
    xs, gs = make_inputs(cfg, [9, 9, 9, 9], seed=8)
    stacks = {}
    for name in ("eager", "graphs"):
        stacks[name] = [MoELayer(cfg, strategy=spec, seed=11 + i, device="cpu", strategy_options={"max_tokens": 9})
                        for i in range(2)]
    for layer in stacks["graphs"]:
        layer.strategy.graph_recorder = EagerRecorder
    for i in range(4):  # eager, capture, replays
        got = {}
        for name, (a, b) in stacks.items():
            x = xs[i].clone().requires_grad_(train)
            with torch.set_grad_enabled(train):
                h = a(x)
                out = b(h)
            got[name] = [h.detach().clone(), out.detach().clone()]
            if train:
                out.backward(gs[i])
                got[name] += [x.grad] + [p.grad.clone() for layer in (a, b) for p in layer.parameters()]
                for layer in (a, b):
                    layer.zero_grad(set_to_none=True)
        for j, (u, v) in enumerate(zip(got["eager"], got["graphs"])):
            assert torch.equal(u, v), (spec, i, j)
    a, b = (layer.strategy for layer in stacks["graphs"])
    if train:
        ga, gb = a._train_graphs[9], b._train_graphs[9]
        pa, pb = (ga.prep, gb.prep) if spec == "fused:lean" else (ga.fwd, gb.fwd)
        # x shared; the routing weights not: the backward reads them after the other layer's forward
        assert pa[1][0] is pb[1][0] and pa[1][2] is not pb[1][2]
        assert ga.bwd[1] is gb.bwd[1] and ga.bwd[2][0] is gb.bwd[2][0]  # the output gradient, dx
        assert ga.fwd[2].out is gb.fwd[2].out and ga.fwd[2].pre is not gb.fwd[2].pre  # (saves: each its own)
    else:
        ea, eb = a._graphs[9], b._graphs[9]
        assert all(u is v for u, v in zip(ea.static, eb.static)) and ea.out is eb.out


def test_fused_train_graph_freed_by_a_forward_without_backward():
    """A training forward whose autograd graph is dropped without a backward releases its hold
    on the captured buffers, so the next call with that token count replays the graph again."""
    import gc

    from cases import make_inputs

    from interlace import MoELayer
    from interlace.strategies.graphs import EagerRecorder

    cfg = SMALL
    xs, gs = make_inputs(cfg, [9], seed=5)
    layer = MoELayer(cfg, strategy="fused:train", seed=11, device="cpu")
    layer.strategy.graph_recorder = EagerRecorder
    layer(xs[0].clone().requires_grad_()).backward(gs[0])  # eager: compiles
    out = layer(xs[0].clone().requires_grad_())  # captured
    entry = layer.strategy._train_graphs[9]
    assert entry.owner is not None
    del out
    gc.collect()
    assert entry.owner is None
    x = xs[0].clone().requires_grad_()
    layer(x).backward(gs[0])
    assert entry.owner is None and entry.bwd is not None
    assert torch.isfinite(x.grad).all()


def test_release_shared_buffers_drops_fused_graphs_and_a_pending_backward_still_runs():
    """``release_shared_buffers`` (the step before ``destroy_process_group``) drops every captured
    graph: NCCL cannot destroy a communicator that a live graph captured. A forward replayed
    before that still gets its backward (eagerly, on the state it saved), and later calls
    capture again; every call bitwise as on the eager path."""
    from cases import make_inputs

    from interlace.strategies.graphs import EagerRecorder
    from interlace.parallel import release_shared_buffers

    cfg = SMALL
    xs, gs = make_inputs(cfg, [10, 10, 10, 10], seed=6)
    order = [("f", 0), ("b", 0), ("f", 1), ("b", 0), ("f", 2), ("release", 0), ("b", 0), ("f", 3), ("b", 0),
             ("f", 0), ("b", 0)]
    eager, _ = _train_calls(None, [o for o in order if o[0] != "release"], cfg, xs, gs)

    from interlace import MoELayer

    layer = MoELayer(cfg, strategy="fused:train", seed=11, device="cpu")
    layer.strategy.graph_recorder = EagerRecorder
    pending, got = [], []
    for op, i in order:
        if op == "release":
            assert len(layer.strategy._train_graphs) == 1
            release_shared_buffers()
            assert not layer.strategy._train_graphs
        elif op == "f":
            x = xs[i].clone().requires_grad_()
            pending.append((i, x, layer(x)))
        else:
            j, x, out = pending.pop()
            layer.zero_grad(set_to_none=True)
            out.backward(gs[j])
            got.append((j, out.detach().clone(), x.grad.clone(), layer.experts.w_up.grad.clone(),
                        layer.experts.w_down.grad.clone(), layer.router.weight.grad.clone()))
    assert layer.strategy._train_graphs[10].bwd is not None  # captured again after the release
    for want, have in zip(eager, got):
        assert all(torch.equal(a, b) for a, b in zip(want[1:], have[1:])), f"call with input {want[0]}"


def test_destroy_process_group_drops_the_fused_graphs_first(monkeypatch):
    """Once a fused strategy captures a graph, ``torch.distributed.destroy_process_group`` drops
    every fused graph before it destroys the group (a live graph with a captured NCCL
    collective would keep the communicator's destruction waiting forever); installed once."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    import interlace.strategies.fused.inference as fused

    calls = []

    def fake_destroy(group=None):
        calls.append(("destroy", group))

    monkeypatch.setattr(dist, "destroy_process_group", fake_destroy)
    monkeypatch.setattr(distributed_c10d, "destroy_process_group", fake_destroy)
    monkeypatch.setattr(fused, "release_graphs", lambda: calls.append("release") or 0)
    fused.guard_destroy_process_group()
    fused.guard_destroy_process_group()  # idempotent
    assert distributed_c10d.destroy_process_group is dist.destroy_process_group
    dist.destroy_process_group("g")
    assert calls == ["release", ("destroy", "g")]


def test_fused_train_graph_eviction_skips_held_graphs_and_new_weights_recapture(monkeypatch):
    """With room for one graph: a second token count runs eagerly while the first count's graph
    holds a pending call's state, and evicts it once that call's backward has run; replacing a
    weight tensor (not an in-place update) captures anew. Every call bitwise as on the eager path."""
    from cases import make_inputs

    import interlace.strategies.fused.inference as fused
    from interlace import MoELayer
    from interlace.strategies.graphs import EagerRecorder

    monkeypatch.setattr(fused, "MAX_GRAPHS", 1)
    cfg = SMALL
    xs, gs = make_inputs(cfg, [8, 9, 8, 9], seed=7)
    layers = [MoELayer(cfg, strategy="fused:train", seed=11, device="cpu", strategy_options={"max_tokens": 9})
              for _ in range(2)]
    layers[1].strategy.graph_recorder = EagerRecorder
    st = layers[1].strategy

    def step(layer, i, backward=True):
        x = xs[i].clone().requires_grad_()
        out = layer(x)
        if not backward:
            return x, out
        layer.zero_grad(set_to_none=True)
        out.backward(gs[i])
        return out.detach(), x.grad, layer.experts.w_up.grad, layer.experts.w_down.grad

    def same(a, b):
        assert all(torch.equal(u, v) for u, v in zip(a, b))

    for i in (0, 1, 0, 1):  # both token counts seen (eager), then T = 8 captured; T = 9 needs the one slot
        same(step(layers[0], i), step(layers[1], i))
    assert list(st._train_graphs) == [9]  # T = 9 evicted the idle T = 8 graph
    held_x, held = step(layers[1], 2, backward=False)  # T = 8: captured again, held until its backward
    assert list(st._train_graphs) == [8] and st._train_graphs[8].owner is not None
    same(step(layers[0], 3), step(layers[1], 3))  # T = 9: the slot is held, so eagerly
    assert list(st._train_graphs) == [8]
    layers[1].zero_grad(set_to_none=True)
    held.backward(gs[2])
    x0 = xs[2].clone().requires_grad_()
    layers[0].zero_grad(set_to_none=True)
    layers[0](x0).backward(gs[2])
    same((held_x.grad, layers[1].experts.w_up.grad), (x0.grad, layers[0].experts.w_up.grad))
    first = st._train_graphs[8]
    for layer in layers:  # new weight tensors with the same values
        layer.experts.w_up = torch.nn.Parameter(layer.experts.w_up.detach().clone())
    same(step(layers[0], 0), step(layers[1], 0))
    assert st._train_graphs[8] is not first and st._train_graphs[8].fwd is not None


def test_fused_inference_graphs_match_eager():
    """Inference calls through the graph path (:class:`EagerRecorder` on the CPU): the first call
    with a token count eager, then capture and replays, then new weight tensors capture anew;
    every output bitwise as on the eager path."""
    from cases import make_inputs

    from interlace import MoELayer
    from interlace.strategies.graphs import EagerRecorder

    cfg = SMALL
    xs, _ = make_inputs(cfg, [10, 10, 10, 10, 10], seed=8)
    layers = [MoELayer(cfg, strategy="fused", seed=11, device="cpu") for _ in range(2)]
    layers[1].strategy.graph_recorder = EagerRecorder
    with torch.no_grad():
        for i in range(5):
            if i == 4:
                for layer in layers:
                    layer.experts.w_down = torch.nn.Parameter(layer.experts.w_down.detach().clone())
            want, have = layers[0](xs[i]), layers[1](xs[i])
            assert torch.equal(want, have), f"call {i}"
            if i == 3:
                first = layers[1].strategy._graphs[10]
    assert layers[1].strategy._graphs[10] is not first and not layers[0].strategy._graphs
