"""FP8 (W8A8, 128 × 128 block scales) expert GEMMs under the interpreter against the fp32
reference of the same arithmetic (interlace.fp8), outputs poisoned (conftest).

Tolerances: with fp32 activations the kernels and the reference make the same roundings except
the order of fp32 sums, and where such a difference tips the e4m3 rounding of an activation
value between GEMM0 and GEMM1, that one value moves by one e4m3 step (1/16 of itself): relative
Frobenius error < 2e-4 (measured 3e-7 without a tip, 2.4e-5 with one). With bf16 activations
the output is rounded to bf16 (2^-9 relative per element): < 5e-3.
"""

import pytest
import torch

from interlace.fp8 import (
    FP8_DTYPE, BlockFP8Weight, QuantizedRows, act_agreement, dequantize_rows, dequantize_weight,
    expert_ffn_fp8_reference, packed_row_bytes, quantize_rows, quantize_weight,
)
from interlace.kernels.expert_gemm.fp8 import expert_ffn_fp8, quantize_rows_fp8
from interlace.kernels.expert_gemm.fp8_quant import quantize_rows_packed


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_interpreter_casts_to_e4m3_like_the_gpu():
    """fp32 → e4m3 inside a kernel rounds to nearest even with the carry (7.9 → 8), keeps
    subnormals (0.001 → 2^-9) and saturates at ±448 (Hopper's cvt.rn.satfinite): a group whose
    amax is 448 has scale 1, so its e4m3 values are the kernel's casts themselves."""
    values = [7.9, 1.0625, 1.1875, 0.001, -0.0009, 239.0, -448.0, 448.0]
    x = torch.tensor([values + [0.5] * 120])
    q, scale = quantize_rows_fp8(x)
    assert scale.item() == 1.0
    assert torch.equal(q.view(torch.uint8), x.to(FP8_DTYPE).view(torch.uint8))
    assert q[0, :4].float().tolist() == [8.0, 1.0, 1.25, 2.0**-9]


@pytest.mark.parametrize("cols", [128, 200, 64, 257])
def test_quantize_rows_kernel_equals_reference_bitwise(cols):
    x = torch.randn(37, cols) * torch.logspace(-3, 3, 37)[:, None]
    x[4] = 0.0  # an all-zero row: scale 1
    x[9, cols - 1] = float("nan")  # a NaN: its group's scale is NaN, no other group's
    q, s = quantize_rows_fp8(x.bfloat16())
    qr, sr = quantize_rows(x.bfloat16())
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s.isnan(), sr.isnan()) and torch.equal(s[~s.isnan()], sr[~sr.isnan()])
    assert s.isnan().sum() == 1 and (s[4] == 1).all()


@pytest.mark.parametrize("cols", [128, 200, 64, 7168])
def test_packed_rows_hold_the_quantized_rows_bitwise(cols):
    """A packed row (e4m3 values, then fp32 scales, each part on 16 bytes: what ``sequential``
    sends for FP8 experts) holds quantize_rows' pair, NaN and all-zero groups included."""
    x = torch.randn(9, cols) * torch.logspace(-2, 2, 9)[:, None]
    x[2] = 0.0
    x[5, cols // 2] = float("nan")
    rows = quantize_rows_packed(x.bfloat16())
    assert rows.packed.dtype == torch.int32 and rows.packed.shape == (9, packed_row_bytes(cols) // 4)
    assert rows.shape == (9, cols) and rows.dtype == torch.bfloat16
    qr, sr = quantize_rows(x.bfloat16())
    assert torch.equal(rows.q.view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(rows.scale.isnan(), sr.isnan()) and torch.equal(rows.scale[~sr.isnan()], sr[~sr.isnan()])
    assert rows.q.data_ptr() == rows.packed.data_ptr()  # views, no copy
    assert packed_row_bytes(7168) == 7392 and packed_row_bytes(200) == 208 + 16
    with pytest.raises(ValueError, match=f"QuantizedRows of {cols} columns"):
        QuantizedRows(rows.packed[:, :-1], cols, torch.bfloat16)
    with pytest.raises(ValueError, match="QuantizedRows"):
        QuantizedRows(rows.packed.float(), cols, torch.bfloat16)


def random_block_fp8(*shape) -> BlockFP8Weight:
    """e4m3 values and block scales drawn independently (powers of two times [1, 2)), so a wrong
    block index for any block shows in the output."""
    q = (torch.randn(*shape) * 64).clamp(-448, 448).to(FP8_DTYPE)
    rb, cb = -(-shape[-2] // 128), -(-shape[-1] // 128)
    scale = torch.rand(*shape[:-2], rb, cb) * 2.0 ** torch.randint(-14, -6, (*shape[:-2], rb, cb)).float()
    return BlockFP8Weight(q, scale + 2.0**-12)


CASES = [  # (activation, N, K, counts per expert)
    ("swiglu", 160, 200, [10, 0, 17, 1, 18]),
    ("swiglu", 256, 128, [0, 0, 33]),
    ("gelu", 130, 300, [7, 0, 40]),
    ("relu", 96, 64, [1, 2, 3, 0]),
    ("swiglu", 144, 176, [40, 0, 21]),  # 16-byte rows (TMA) whose gate and up rows share scale blocks
]


@pytest.mark.parametrize("activation,N,K,counts", CASES)
@pytest.mark.parametrize("dtype,tma", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_expert_ffn_fp8_matches_reference(activation, N, K, counts, dtype, tma):
    """``tma``: weights (and GEMM1's rows) through descriptors where their rows are 16-byte
    multiples (N, K % 16 == 0: the second, fourth and last cases), with one weight scale per tile
    and k step unless SwiGLU's up rows start inside a scale block (the last case)."""
    E = len(counts)
    up = random_block_fp8(E, (2 if activation == "swiglu" else 1) * K, N)
    down = random_block_fp8(E, N, K)
    ends = torch.tensor(counts).cumsum(0).int()
    R = sum(counts)
    k = 2
    T = -(-R // k)
    x = (torch.randn(T, N) * 2).to(dtype)
    gather = torch.randperm(T * k)[:R].int()
    y, act = expert_ffn_fp8(x, gather, k, R, up, down, ends, activation, return_act=True, tma=tma)
    ref, ref_act = expert_ffn_fp8_reference(x[gather.long() // k], up, down, ends, activation, torch.float32,
                                            return_act=True)
    assert y.dtype == dtype and y.shape == (R, N)
    assert not y.isnan().any()
    assert rel(y, ref) < (2e-4 if dtype == torch.float32 else 5e-3)
    flipped, units = act_agreement(act, ref_act)
    # one e4m3 step at most (32 units of the scale at the top), and the scale's drift
    assert flipped < 5e-2 and units <= 33, (flipped, units)
    # bitwise repeatable
    assert torch.equal(expert_ffn_fp8(x, gather, k, R, up, down, ends, activation, tma=tma), y)


class NoReadBack(torch.Tensor):
    """A tensor whose values the host must not read back (``tolist``: a host sync on a GPU)."""

    def tolist(self):
        raise AssertionError("read back on the host")


@pytest.mark.parametrize("tma", [False, True])
def test_quantized_rows_give_the_same_ffn_bitwise(tma):
    """Rows quantized before they come (a packed buffer's views, gathered as ``sequential``
    sends them) give what quantizing them in the FFN gives, bitwise: Triton kernels, their
    reference, and the blockwise backend's copy into its layout (a torch stand-in for cuBLAS)."""
    from interlace.kernels.expert_gemm.fp8_blockwise import expert_ffn_fp8_blockwise
    from interlace.kernels.rows import gather_rows

    E, N, K, k = 3, 512, 512, 2
    counts = [9, 0, 23]
    up, down = random_block_fp8(E, 2 * K, N), random_block_fp8(E, N, K)
    ends = torch.tensor(counts).cumsum(0).int()
    R = sum(counts)
    x = torch.randn(20, N).bfloat16()
    x[4, 3] = float("nan")
    send = torch.randperm(20 * k)[:R].int()  # the rows a rank sends, token send[r] // k
    wire = QuantizedRows(gather_rows(quantize_rows_packed(x).packed, send, divisor=k), N, x.dtype)
    rows = x[send.long() // k]
    gather = torch.randperm(R).int()  # the receiver's expert-major re-layout
    want = expert_ffn_fp8(rows, gather, 1, R, up, down, ends, "swiglu", tma=tma)
    got = expert_ffn_fp8(wire, gather, 1, R, up, down, ends, "swiglu", tma=tma)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    ref = expert_ffn_fp8_reference(rows[gather.long()], up, down, ends, "swiglu")
    assert torch.equal(expert_ffn_fp8_reference(wire.take(gather), up, down, ends, "swiglu").view(torch.int16),
                       ref.view(torch.int16))
    blockwise = [expert_ffn_fp8_blockwise(a, gather, 1, R, up, down, ends, "swiglu", mm=fake_blockwise_mm)
                 for a in (rows, wire)]
    assert torch.equal(blockwise[0].view(torch.int16), blockwise[1].view(torch.int16))
    # out_rows: the output in another row order, folded into the blockwise gather (Triton: a gather after)
    order = torch.randperm(R).int()
    permuted = expert_ffn_fp8_blockwise(wire, gather, 1, R, up, down, ends, "swiglu", mm=fake_blockwise_mm,
                                        out_rows=order)
    assert torch.equal(permuted.view(torch.int16), blockwise[1][order.long()].view(torch.int16))
    # the row counts from the host (sequential has them after its count exchange): no read-back
    host = expert_ffn_fp8_blockwise(wire, gather, 1, R, up, down, NoReadBack(ends), "swiglu", mm=fake_blockwise_mm,
                                    out_rows=order, host_ends=ends.tolist)
    assert torch.equal(host.view(torch.int16), permuted.view(torch.int16))
    got = expert_ffn_fp8(wire, gather, 1, R, up, down, ends, "swiglu", tma=tma, out_rows=order)
    assert torch.equal(got.view(torch.int16), want[order.long()].view(torch.int16))


def test_expert_ffn_fp8_ungathered_and_empty():
    E, N, K = 3, 128, 128
    up, down = random_block_fp8(E, 2 * K, N), random_block_fp8(E, N, K)
    x = torch.randn(20, N)
    ends = torch.tensor([5, 5, 20]).int()
    y = expert_ffn_fp8(x, None, 1, 20, up, down, ends, "swiglu")
    assert rel(y, expert_ffn_fp8_reference(x, up, down, ends, "swiglu")) < 1e-5
    empty = expert_ffn_fp8(x[:0], None, 1, 0, up, down, torch.zeros(E, dtype=torch.int32), "swiglu")
    assert empty.shape == (0, N)


def test_nan_token_stays_in_its_rows():
    E, N, K = 2, 128, 256
    up, down = random_block_fp8(E, 2 * K, N), random_block_fp8(E, N, K)
    x = torch.randn(8, N)
    x[3, 17] = float("nan")
    gather = torch.arange(16).int()
    y = expert_ffn_fp8(x, gather, 2, 16, up, down, torch.tensor([9, 16]).int(), "swiglu")
    bad = (gather.long() // 2) == 3
    assert y[bad].isnan().all(dim=1).all() and not y[~bad].isnan().any()


def test_quantized_layer_error_against_bf16_weights():
    """What block FP8 costs against the dense weights it came from (not a kernel error): on
    random Gaussian data the W8A8 FFN is 6.4% (relative Frobenius) off the fp32 FFN: e4m3 keeps 3
    mantissa bits (relative rounding error up to 2^-4, about 3% RMS per value), and four operands
    are rounded (x, W_up, the activation, W_down); the weights alone are 3% off."""
    E, N, K = 2, 256, 384
    w_up, w_down = torch.randn(E, 2 * K, N) / N**0.5, torch.randn(E, N, K) / K**0.5
    up, down = quantize_weight(w_up), quantize_weight(w_down)
    assert rel(dequantize_weight(up.weight, up.scale_inv), w_up) < 0.04
    x = torch.randn(64, N)
    ends = torch.tensor([30, 64]).int()
    y = expert_ffn_fp8(x, None, 1, 64, up, down, ends, "swiglu")
    dense = torch.cat([
        (torch.nn.functional.silu(x[s:e] @ w_up[i, :K].t()) * (x[s:e] @ w_up[i, K:].t())) @ w_down[i].t()
        for i, (s, e) in enumerate([(0, 30), (30, 64)])
    ])
    assert 0.02 < rel(y, dense) < 0.09


def test_wrong_weight_shapes_raise():
    up, down = random_block_fp8(2, 256, 128), random_block_fp8(2, 128, 64)
    with pytest.raises(ValueError, match="do not form"):
        expert_ffn_fp8(torch.randn(4, 128), None, 1, 4, up, down, torch.tensor([2, 4]).int(), "swiglu")


# Compiles the FP8 GEMM for sm90 without a GPU (test_grouped_gemm's child-process helper): e4m3
# operands, fp32 scales, int32 tile lists.
_SM90_FP8 = r"""
from interlace.kernels.expert_gemm import fp8

TYPES = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32",
         "out_scale_ptr": "*fp32"}
found = []
configs = {(c, tma) for rows in (1, 2000, 100000) for tma in (False, True) for c in fp8.choose_configs(rows, 16, tma)}
for config, tma in sorted(configs, key=lambda c: (c[0].block_m, c[0].num_warps, c[1])):
    for epilogue, packed in ((0, False), (1, False), (1, True)):  # packed: GEMM0 on rows off the wire
        constexprs = dict(EPILOGUE=epilogue, GATHER=epilogue == 1, BLOCK_M=config.block_m, BLOCK_N=128,
                          BLOCK_K=128, GROUP_M=config.group_m, W_TMA=tma, A_TMA=tma and epilogue == 0,
                          SCALAR_SCALE=tma, A_PACKED=packed)
        types = dict(TYPES, out_ptr="*fp8e4nv" if epilogue else "*bf16")
        if packed:
            types.update(a_ptr="*i32", a_scale_ptr="*i32")
        compiled = compile_sm90(fp8.fp8_gemm_kernel, constexprs, config.num_warps, config.num_stages, types)
        ptx = compiled.asm["ptx"]
        mma = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.f32\.e4m3\.e4m3|mma\.sync", ptx)))
        found.append([config.block_m, epilogue, tma, compiled.metadata.shared, mma,
                      len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx))])
print(json.dumps(found))
"""


def test_fp8_gemm_builds_for_sm90_within_shared_memory():
    """Every config :func:`choose_configs` picks, with and without TMA (and GEMM0 on packed rows,
    as they come off the wire), builds for sm90 (bundled ptxas, no GPU) within Hopper's 227 KB of
    shared memory per block; tiles of 64 rows and more run e4m3 wgmma; the TMA forms load through
    tensor descriptors."""
    from test_grouped_gemm import _run_sm90

    found = _run_sm90(_SM90_FP8)
    assert len(found) >= 18, found
    for block_m, epilogue, tma, shared, mma, bulk_loads in found:
        assert shared <= 232448, (block_m, epilogue, shared)
        if block_m >= 64:
            assert mma and all(m.startswith("wgmma") and m.endswith("e4m3.e4m3") for m in mma), (block_m, mma)
        assert (bulk_loads > 0) == tma, (block_m, epilogue, tma, bulk_loads)


def fake_blockwise_mm(a, a_scale, w_t, w_scale_t, out):
    """cuBLAS's block-scaled GEMM in fp32 torch, with its layout rules: a_scale (m, ⌈k/128⌉)
    column-major with strides exactly (1, m), w (n, k) and its scales (⌈n/128⌉, ⌈k/128⌉) row-major,
    passed transposed."""
    m = a.shape[0]
    assert m % 4 == 0 and a_scale.shape == (m, -(-a.shape[1] // 128)) and a_scale.stride() == (1, m), a_scale.stride()
    w, w_scale = w_t.t(), w_scale_t.t()
    assert w.is_contiguous() and w_scale.is_contiguous() and a.is_contiguous() and out.is_contiguous()
    out.copy_(dequantize_rows(a, a_scale.contiguous()) @ dequantize_weight(w, w_scale).t())


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_blockwise_backend_layouts_on_cpu(activation):
    """The blockwise backend's quantize kernels (interpreter) and per-expert slicing, with a
    torch stand-in for cuBLAS's GEMM: the reference's result but for GEMM0's bf16 output."""
    from interlace.kernels.expert_gemm.fp8_blockwise import expert_ffn_fp8_blockwise

    E, N, K = 4, 512, 512
    counts = [5, 0, 37, 16]
    up = random_block_fp8(E, (2 if activation == "swiglu" else 1) * K, N)
    down = random_block_fp8(E, N, K)
    ends = torch.tensor(counts).cumsum(0).int()
    R, k = sum(counts), 2
    x = torch.randn(-(-R // k), N).bfloat16()
    gather = torch.randperm(x.shape[0] * k)[:R].int()
    y = expert_ffn_fp8_blockwise(x, gather, k, R, up, down, ends, activation, mm=fake_blockwise_mm)
    ref = expert_ffn_fp8_reference(x[gather.long() // k], up, down, ends, activation, torch.float32)
    assert not y.isnan().any()
    # GEMM0's bf16 output moves some activation values one e4m3 step (measured 1.7e-2 here)
    assert rel(y, ref) < 3e-2


def test_fp8_backend_is_checked_and_reaches_the_sequential_strategy():
    from interlace.strategies.sequential import SequentialStrategy

    assert SequentialStrategy(object(), object(), fp8_backend="triton").fp8_backend == "triton"
    with pytest.raises(ValueError, match="fp8_backend must be one of"):
        SequentialStrategy(object(), object(), fp8_backend="cublas")
    up, down = random_block_fp8(2, 256, 128), random_block_fp8(2, 128, 128)
    with pytest.raises(ValueError, match="backend must be one of"):
        expert_ffn_fp8(torch.randn(4, 128), None, 1, 4, up, down, torch.tensor([2, 4]).int(), "swiglu", backend="x")
    with pytest.raises(ValueError, match="compute capability 9.0"):  # a CPU tensor: cuBLAS's path cannot run
        expert_ffn_fp8(torch.randn(4, 128), None, 1, 4, up, down, torch.tensor([2, 4]).int(), "swiglu",
                       backend="blockwise")


def test_auto_takes_blockwise_where_it_was_measured_faster():
    """``blockwise_pays`` on one GPU's share of a 2-GPU layer, against which backend measured faster
    on an H200 (benchmarks/fp8_experts.py, rows where one was more than 10% faster): few large
    experts at 4096 tokens per GPU and more, never dsv3-like's 128 experts per GPU at 4096 (its 256
    GEMMs bind the host) nor at decode sizes. (dsv3-like at 16384 measured a tie: not asserted.)"""
    from interlace.config import preset
    from interlace.kernels.expert_gemm.fp8 import blockwise_pays

    faster = {("mixtral-8x7b", 128): False, ("mixtral-8x7b", 512): False, ("mixtral-8x7b", 4096): True,
              ("mixtral-8x7b", 16384): True, ("dsv3-like", 128): False, ("dsv3-like", 512): False,
              ("dsv3-like", 4096): False, ("flashdmoe-cfg", 4096): False, ("flashdmoe-cfg", 16384): False}
    for (name, tokens), want in faster.items():
        cfg = preset(name)
        up = 2 * cfg.ffn if cfg.activation == "swiglu" else cfg.ffn
        got = blockwise_pays(tokens * cfg.top_k, cfg.num_experts // 2, cfg.hidden, cfg.ffn, up)
        assert got == want, (name, tokens)
