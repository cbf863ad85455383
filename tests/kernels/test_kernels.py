"""Each kernel against a plain-torch twin, under TRITON_INTERPRET=1, outputs poisoned."""

import warnings

import pytest
import torch
import triton
import triton.language as tl

from helpers import rel_err
from interlace.kernels.activation import swiglu, swiglu_backward
from interlace.kernels.routing_index import (
    build_dispatch_index,
    build_dispatch_index_reference,
    expert_major_index,
    expert_major_index_reference,
)
from interlace.kernels.router_topk import choice_key
from interlace.kernels.rows import combine_rows, combine_rows_backward, copy_used_rows, gather_rows, gather_used_rows


def random_topk(T, k, E, gen=None):
    if T == 0:
        return torch.empty(0, k, dtype=torch.long)
    return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])


@pytest.mark.parametrize(
    "T,k,E,capacity",
    [(37, 2, 5, None), (300, 4, 16, None), (300, 4, 16, 30), (1, 1, 1, None), (0, 2, 4, None),
     (129, 3, 7, 1), (257, 8, 256, None), (200, 2, 64, 3)],
)
def test_dispatch_index_matches_stable_sort(T, k, E, capacity):
    idx = random_topk(T, k, E)
    rows, assign, kept, end = build_dispatch_index(idx, E, capacity)
    assert torch.equal(end, kept.cumsum(0).int())
    rows_ref, assign_ref, kept_ref = build_dispatch_index_reference(idx, E, capacity)
    R = int(kept_ref.sum())
    assert torch.equal(kept, kept_ref)
    assert torch.equal(rows, rows_ref)
    assert torch.equal(assign[:R], assign_ref[:R])
    # Every kept row is claimed exactly once, and rows are expert-major.
    assert sorted(rows[rows >= 0].tolist()) == list(range(R))
    if capacity is not None:
        assert kept.numel() == 0 or int(kept.max()) <= capacity


def test_dispatch_index_skewed_all_to_one_expert():
    T, E = 130, 8
    idx = torch.tensor([[3, 5]] * T)
    rows, assign, kept, _ = build_dispatch_index(idx, E, None)
    assert kept.tolist() == [0, 0, 0, T, 0, T, 0, 0]
    assert rows[:, 0].tolist() == list(range(T))  # first choices, in token order
    assert rows[:, 1].tolist() == list(range(T, 2 * T))


# The row kernels' tile heights: the interpreter's (the module's default under it) and a GPU's
# (rows.py: 4 rows a gather program, one token a combine program), both run here.
ROW_TILES = [None, (4, 1)]


@pytest.fixture(params=ROW_TILES, ids=["interpreter-tiles", "gpu-tiles"])
def row_tiles(request, monkeypatch):
    import interlace.kernels.rows as rows_module

    if request.param is not None:
        monkeypatch.setattr(rows_module, "GATHER_ROWS", request.param[0])
        monkeypatch.setattr(rows_module, "COMBINE_TOKENS", request.param[1])


@pytest.mark.parametrize("R,N,divisor", [(0, 8, 1), (1, 3, 1), (9, 1030, 1), (33, 64, 3), (150, 20, 2)])
def test_gather_rows(R, N, divisor, row_tiles):
    x = torch.randn(max(R, 1) + 5, N)
    index = torch.randint(0, x.shape[0] * divisor, (R,), dtype=torch.int32)
    assert torch.equal(gather_rows(x, index, divisor), x[index.long() // divisor])


@pytest.mark.parametrize("used, cap, N", [([5, 0, 9], 9, 1030), ([9, 9, 1], 9, 3), ([0, 0, 0], 9, 8),
                                         ([70, 3, 100], 100, 5)])
def test_region_rows(used, cap, N, row_tiles):
    """The used rows of each region are copied (or gathered into one region) and nothing else
    is written: the poison of the other rows survives."""
    W, divisor = len(used), 2
    x = torch.randn(W * cap, N)
    count = torch.tensor(used, dtype=torch.int32)
    out = copy_used_rows(x, torch.full_like(x, float("nan")), count, skip=1)
    for s, u in enumerate(used):
        region = slice(s * cap, (s + 1) * cap)
        n = 0 if s == 1 else u
        assert torch.equal(out[region][:n], x[region][:n]) and out[region][n:].isnan().all()
    rows = torch.randn(7, N)
    index = torch.randint(0, 7 * divisor, (cap,), dtype=torch.int32)
    index[used[2]:] = -5  # (never read)
    out = gather_used_rows(rows, index, torch.full_like(x, float("nan")), count, region=2, divisor=divisor)
    assert torch.equal(out[2 * cap:2 * cap + used[2]], rows[index[:used[2]].long() // divisor])
    assert out[:2 * cap].isnan().all() and out[2 * cap + used[2]:].isnan().all()


@pytest.mark.parametrize("interpret", [True, False])
def test_region_rows_packed(interpret, monkeypatch, row_tiles):
    """With ``base`` (the exclusive prefix sum of the used counts) the used rows of every region
    land back to back, the gathered region's at its own base, and no other row of ``out`` is
    written (its poison survives); the Triton kernel and the plain-torch fallback alike."""
    import interlace.kernels.rows as rows_module

    monkeypatch.setattr(rows_module, "use_triton", lambda t: interpret)
    used, cap, N, divisor = [5, 0, 9, 3], 9, 70, 2
    W = len(used)
    x = torch.randn(W * cap, N)
    count = torch.tensor(used, dtype=torch.int32)
    base = (torch.cumsum(count, 0, dtype=torch.int32) - count).contiguous()
    R = sum(used)
    out = copy_used_rows(x, torch.full((R + 2, N), float("nan")), count, skip=2, base=base)
    for s, u in enumerate(used):
        b = int(base[s])
        if s == 2:
            assert out[b:b + u].isnan().all()
        else:
            assert torch.equal(out[b:b + u], x[s * cap:s * cap + u])
    assert out[R:].isnan().all()
    rows = torch.randn(7, N)
    index = torch.randint(0, 7 * divisor, (cap,), dtype=torch.int32)
    index[used[2]:] = -5  # (never read)
    gather_used_rows(rows, index, out, count, region=2, divisor=divisor, base=base)
    b = int(base[2])
    assert torch.equal(out[b:b + used[2]], rows[index[:used[2]].long() // divisor])
    assert torch.equal(out[:b], x[:5]) and torch.equal(out[b + used[2]:R], x[3 * cap:3 * cap + 3])  # untouched
    assert out[R:].isnan().all()


@pytest.mark.parametrize("W,E_local", [(2, 4), (4, 2), (3, 5), (1, 7), (8, 32), (2, 128)])
@pytest.mark.parametrize("zeros", [False, True])
def test_expert_major_index(W, E_local, zeros):
    counts = torch.randint(0, 6, (W, E_local), dtype=torch.int32)
    if zeros:
        counts[0] = 0
        counts[:, -1] = 0
    R = int(counts.sum())
    src, inv, offs = expert_major_index(counts, R)
    src_ref, inv_ref, offs_ref = expert_major_index_reference(counts, R)
    assert torch.equal(src, src_ref) and torch.equal(inv, inv_ref) and torch.equal(offs, offs_ref)
    # Independent check: received rows labelled (source, expert) come out expert-major.
    labels = [(s, e) for s in range(W) for e in range(E_local) for _ in range(int(counts[s, e]))]
    regrouped = [labels[i] for i in src.tolist()]
    assert regrouped == sorted(labels, key=lambda se: (se[1], se[0]))
    assert sorted(src.tolist()) == list(range(R)) and all(src[inv[i]] == i for i in range(R))


@pytest.mark.parametrize("T,k,N,drop", [(7, 2, 40, False), (16, 3, 1100, True), (0, 2, 8, False), (5, 1, 3, True),
                                        (130, 3, 20, True)])
def test_combine_rows_forward_backward(T, k, N, drop, row_tiles):
    R = T * k
    perm = torch.randperm(R).view(T, k).int() if R else torch.empty(T, k, dtype=torch.int32)
    if drop and R:
        perm[torch.rand(T, k) < 0.3] = -1
    y = torch.randn(R, N, dtype=torch.float64)
    w = torch.randn(T, k, dtype=torch.float64)
    kept = (perm >= 0).unsqueeze(-1).double()
    ref = (y[perm.long().clamp(min=0)] * w.unsqueeze(-1) * kept).sum(1)
    assert rel_err(combine_rows(y, perm, w, torch.float64), ref) < 1e-6  # kernels compute in fp32
    # A dropped slot adds nothing: its weight (NaN here) is never read.
    assert torch.equal(combine_rows(y, perm, w.masked_fill(perm < 0, float("nan")), torch.float64),
                       combine_rows(y, perm, w, torch.float64))
    ref_unit = (y[perm.long().clamp(min=0)] * kept).sum(1)
    assert rel_err(combine_rows(y, perm, None, torch.float64), ref_unit) < 1e-6  # kernels compute in fp32

    g = torch.randn(T, N, dtype=torch.float64)
    yy = y.clone().requires_grad_()
    ww = w.clone().requires_grad_()
    ((yy[perm.long().clamp(min=0)] * ww.unsqueeze(-1) * kept).sum(1) * g).sum().backward()
    dy, dw = combine_rows_backward(g, y, perm, w)
    used = torch.zeros(R, dtype=torch.bool)
    used[perm[perm >= 0].long()] = True
    # Rows of dropped assignments are not part of the dispatch buffer; compare the used ones.
    assert rel_err(dy[used], yy.grad[used]) < 1e-6
    assert rel_err(dw, ww.grad) < 1e-6


@pytest.mark.parametrize("M,K", [(0, 4), (1, 5), (13, 100), (64, 700)])
def test_swiglu_forward_backward(M, K):
    h = torch.randn(M, 2 * K, dtype=torch.float64, requires_grad=True)
    gate, up = h.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert rel_err(swiglu(h.detach()), ref) < 1e-6  # kernels compute in fp32
    g = torch.randn(M, K, dtype=torch.float64)
    (ref * g).sum().backward()
    if M:
        assert rel_err(swiglu_backward(h.detach(), g), h.grad) < 1e-6  # kernels compute in fp32


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("T,E,k", [(0, 8, 2), (5, 8, 2), (67, 64, 4), (9, 256, 8), (3, 6, 6), (33, 5, 1)])
def test_fused_router_matches_torch(router, T, E, k):
    from interlace import MoEConfig
    from interlace.routing import route

    cfg = MoEConfig(hidden=16, ffn=8, num_experts=E, top_k=k, router=router, renormalize=router == "sigmoid",
                    route_scale=2.5 if router == "sigmoid" else 1.0, dtype=torch.float32)
    x = torch.randn(T, 16)
    w = torch.randn(E, 16, requires_grad=True)
    bias = torch.randn(E) * 0.1 if router == "sigmoid" else None
    idx, wt, _ = route(x, w, bias, cfg, fused=True)
    w_ref = w.detach().clone().requires_grad_()
    idx_ref, wt_ref, _ = route(x, w_ref, bias, cfg, fused=False)
    assert torch.equal(idx, idx_ref)  # same experts, best first
    assert rel_err(wt, wt_ref) < 1e-6
    g = torch.randn(T, k)
    if T:
        (wt * g).sum().backward()
        (wt_ref * g).sum().backward()
        assert rel_err(w.grad, w_ref.grad) < 1e-6


@pytest.mark.parametrize("T", [0, 37])
def test_router_gemm_input_rounds_operands_and_logit_grad(T):
    """router_gemm="input" with bf16 activations: the logits are the products of the
    bf16-rounded operands accumulated in fp32; the backward rounds the logits' gradient to bf16.
    "upcast" is the fp32 GEMM of the unrounded weight, so the two differ."""
    from interlace import MoEConfig
    from interlace.routing import route

    cfg = MoEConfig(hidden=64, ffn=8, num_experts=16, top_k=4, dtype=torch.bfloat16, router_gemm="input")
    x = torch.randn(T, 64).to(torch.bfloat16).requires_grad_()
    w = torch.randn(16, 64, requires_grad=True)
    idx, wt, logits = route(x, w, None, cfg)
    assert logits.dtype == torch.float32
    wb = w.detach().to(torch.bfloat16).float()
    assert torch.allclose(logits, x.detach().float() @ wb.t(), rtol=1e-6, atol=1e-6)
    g = torch.randn(T, 16)
    logits.backward(g)
    gb = g.to(torch.bfloat16).float()
    assert torch.equal(x.grad, (gb @ wb).to(torch.bfloat16))
    assert torch.allclose(w.grad, gb.t() @ x.detach().float(), rtol=1e-5, atol=1e-5)
    if T:
        full = route(x.detach(), w.detach(), None, cfg.with_(router_gemm="upcast"))[2]
        assert torch.allclose(full, x.detach().float() @ w.detach().t(), rtol=1e-6, atol=1e-6)
        assert not torch.equal(full, logits.detach())
    # fp32 activations: every setting is the fp32 GEMM
    x32 = torch.randn(T, 64)
    cfg32 = cfg.with_(dtype=torch.float32)
    for mode in ("split", "upcast"):
        assert torch.equal(route(x32, w.detach(), None, cfg32)[2],
                           route(x32, w.detach(), None, cfg32.with_(router_gemm=mode))[2])


def test_split_bf16_is_exact():
    from interlace.kernels.router_gemm import split_bf16

    # (finite weights below bf16's largest value, 3.39e38, whose rounding would overflow)
    w = torch.cat((torch.randn(1000) * 1e-3, torch.randn(1000) * 1e3, torch.tensor([0.0, -1.0, 3.3e38, 1e-30])))
    pieces = split_bf16(w)
    assert pieces.dtype == torch.bfloat16 and pieces.shape == (3, w.numel())
    assert torch.equal(pieces[0].double() + pieces[1].double() + pieces[2].double(), w.double())


@pytest.mark.parametrize("pieces", [(1, 3), (3, 1), (2, 2)])
@pytest.mark.parametrize("M,N,K", [(37, 20, 150), (5, 130, 64), (0, 8, 16), (9, 0, 16), (6, 7, 0), (6, 20, 1100)])
def test_split_mm_kernel(pieces, M, N, K):
    """The one-launch piece GEMM (interpreter) against its torch twin and the exact product:
    3 pieces reproduce the fp32 operand's GEMM; 2×2 keeps ~2^-16 relative. Poisoned output.
    K = 1100 on a one-tile output: the reduction split in 5 (the last one partial), the
    partials summed."""
    from interlace.kernels.router_gemm import split_mm, split_mm_reference

    pa, pb = pieces
    a = torch.randn(M, K) if pa > 1 else torch.randn(M, K).to(torch.bfloat16)
    b = (torch.randn(N, K) / 8).t() if pb > 1 else torch.randn(K, N).to(torch.bfloat16)  # a transposed view
    from interlace.kernels.router_gemm import CPU_PROGRAMS, _plan

    if M and N and K:
        splits = _plan(M, N, K, CPU_PROGRAMS)[4]
        assert splits == (5 if K == 1100 else 1), splits
    got = split_mm(a, b, pa, pb, torch.float32)  # (outputs are poisoned: conftest)
    ref = split_mm_reference(a, b, pa, pb, torch.float32)
    # the fp32 operands split once into piece stacks before the GEMM: the same pieces, the same sums
    assert torch.equal(split_mm(a, b, pa, pb, torch.float32, presplit=True), got)
    exact = a.double() @ b.double()
    assert got.shape == (M, N) and torch.isfinite(got).all()
    if M and N:
        # (the interpreter truncates fp32 → bf16 where GPUs round to nearest: with 3 pieces the
        # split is exact either way; 2 × 2 pieces agree to their precision)
        three = max(pa, pb) == 3
        assert rel_err(got, ref) < (1e-6 if three else 2**-12)
        scale = a.double().abs() @ b.double().abs()
        assert ((got.double() - exact).abs() <= scale * (2**-20 if three else 2**-13) + 1e-30).all()


def test_split_pieces_and_plan():
    """The piece stack of an fp32 tensor (and of a transposed view, which keeps its layout) sums to
    it exactly; the GEMM's plan shrinks the logits' tiles to fill the SMs and splits dW's reduction."""
    from interlace.kernels.router_gemm import _plan, split_pieces

    w = torch.cat((torch.randn(300) * 1e-3, torch.randn(300) * 1e3)).view(20, 30)
    for t in (w, w.t()):
        stack = split_pieces(t, 3)
        assert stack.dtype == torch.bfloat16 and stack.shape == (3, *t.shape)
        assert stack[0].stride() == t.stride()
        assert torch.equal(stack.double().sum(0), t.double())
    assert _plan(4096, 128, 2048, 132) == (64, 64, 64, 4, 1)  # 128 tiles, not 32 of 128 x 128
    assert _plan(16384, 256, 7168, 132) == (128, 128, 64, 8, 1)
    assert _plan(128, 2048, 4096, 132) == (128, 128, 64, 8, 16)  # dW: 16 tiles x 16 splits


def test_split_mm_rejects_wrong_dtypes():
    from interlace.kernels.router_gemm import split_mm

    with pytest.raises(ValueError, match="piece"):
        split_mm(torch.randn(4, 4), torch.randn(4, 4), 1, 3, torch.float32)
    with pytest.raises(ValueError, match="chain"):
        split_mm(torch.randn(4, 4).bfloat16(), torch.randn(5, 4), 1, 3, torch.float32)


@pytest.mark.parametrize("T", [0, 1, 300])
def test_router_gemm_split_is_the_fp32_gemm(T):
    """router_gemm="split" (the default) with bf16 activations and an fp32 router: logits,
    top-k and dW as the exact (fp64) GEMM to fp32 accuracy; dx within bf16 rounding of exact."""
    from interlace import MoEConfig
    from interlace.routing import route

    E, N = 64, 256
    cfg = MoEConfig(hidden=N, ffn=8, num_experts=E, top_k=6, dtype=torch.bfloat16)
    assert cfg.router_gemm == "split"
    x = torch.randn(T, N).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(E, N) / N**0.5).requires_grad_()
    idx, wt, logits = route(x, w, None, cfg)
    exact = x.detach().double() @ w.detach().double().t()
    if T:
        assert rel_err(logits, exact) < 1e-6
        assert torch.equal(idx, torch.topk(exact, 6, dim=-1).indices)
    g = torch.randn(T, E)
    logits.backward(g)
    dx_exact = g.double() @ w.detach().double()
    dw_exact = g.double().t() @ x.detach().double()
    if T:
        assert rel_err(w.grad, dw_exact) < 1e-6
        # dx is bf16: within its rounding (2^-8 relative; 2^-7 where the interpreter truncates)
        # of the exact value, plus the dropped cross terms' ~2^-16 of the summands' magnitude
        # (which shows where the sum cancels)
        scale = g.abs().double() @ w.detach().abs().double()
        assert ((x.grad.double() - dx_exact).abs() <= dx_exact.abs() * 2**-7 + scale * 2**-14).all()
    else:
        assert x.grad.shape == (0, N) and not w.grad.any()


def test_fused_router_choice_order_ties_zeros_and_infinities():
    """The choice is by value, best first, ties to the lower expert (the kernel packs value and
    column into one integer key): rows of repeated values, +0.0 against -0.0 (equal), -inf,
    +inf, tiny subnormals and negative values, against a plain stable sort in float64. Sigmoid
    without renormalizing, so the scores keep the logits' order and ties."""
    from interlace.kernels.router_topk import route_topk

    g = torch.Generator().manual_seed(3)
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, float("inf"), float("-inf"), 1e-40, -1e-40, 30.0, -30.0])
    logits = pool[torch.randint(len(pool), (64, 24), generator=g)]
    idx, w = route_topk(logits, None, 5, softmax=False, renormalize=False, scale=1.0)
    scores = torch.sigmoid(logits.double()).float().double()  # (the kernel's fp32 sigmoid values)
    for row, chosen in zip(scores, idx.tolist()):
        order = sorted(range(24), key=lambda c: (-row[c].item(), c))
        assert chosen == order[:5], (row.tolist(), chosen)


@pytest.mark.parametrize("softmax", [True, False])
@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_router_warns_nothing_on_finite_logits(softmax, renormalize):
    """Finite logits make no NumPy warning under the interpreter: the rows past T in a token block
    compute on zeros, not on -inf (-inf - (-inf) in the softmax, 0/0 in the renormalization)."""
    from interlace.kernels.router_topk import route_topk

    for T, E in ((5, 8), (3, 6), (67, 64)):  # T is no multiple of the token block (E_PAD = 8, 8, 64)
        logits = torch.randn(T, E)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # (Triton's interpreter's own: the one the project's pytest configuration ignores)
            warnings.filterwarnings("ignore", "Conversion of an array with ndim > 0", DeprecationWarning)
            route_topk(logits, None, 2, softmax, renormalize, 1.0)


@triton.jit
def _best_column_kernel(v_ptr, out_ptr, E_PAD: tl.constexpr):
    cols = tl.arange(0, E_PAD)
    v = tl.load(v_ptr + tl.program_id(0) * E_PAD + cols)
    best = tl.max(choice_key(v[None, :], cols, E_PAD), axis=1)
    tl.store(out_ptr + tl.program_id(0) + tl.arange(0, 1), (E_PAD - 1 - (best & 0xFFFFFFFF)).to(tl.int32))


def test_choice_key_orders_by_value_then_lower_column():
    """choice_key's maximum is the row's largest value, its lowest column among equal ones, for
    signed zeros (equal), infinities, subnormals and negatives (the score path never makes a -0.0,
    so this is checked on the key itself)."""
    g = torch.Generator().manual_seed(4)
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 1e-40, -1e-40, -3.0])
    v = pool[torch.randint(len(pool), (200, 16), generator=g)]
    v[0] = -0.0
    v[0, 5] = 0.0  # (+0.0 at column 5 ties the -0.0 of column 0: column 0 wins)
    out = torch.empty(200, dtype=torch.int32)
    _best_column_kernel[(200,)](v, out, E_PAD=16)
    expected = [min(range(16), key=lambda c: (-row[c].item(), c)) for row in v]
    assert out.tolist() == expected


# (NaN input on purpose: NumPy's max over the all-NaN row warns under the interpreter)
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_fused_router_nan_row_gets_valid_distinct_experts():
    from interlace.kernels.router_topk import route_topk

    logits = torch.randn(4, 16)
    logits[1] = float("nan")
    logits[2, 3] = float("nan")
    idx, w = route_topk(logits, None, 4, softmax=True, renormalize=False, scale=1.0)
    assert idx.min() >= 0 and idx.max() < 16
    assert all(len(set(row)) == 4 for row in idx.tolist())
    assert torch.isnan(w[1]).all() and torch.isnan(w[2]).all()  # softmax of a NaN row is NaN
    assert torch.isfinite(w[[0, 3]]).all()
    for bad in (0, 17):  # (more picks than experts: the one-key-per-column choice would repeat picks)
        with pytest.raises(ValueError, match="top_k"):
            route_topk(logits, None, bad, softmax=True, renormalize=False, scale=1.0)
